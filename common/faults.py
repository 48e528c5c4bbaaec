"""Fault injection for tests: delay chosen RPCs of a real server process.

Set `PAGEWIRE_INJECT_DELAY_MS` (and optionally `PAGEWIRE_INJECT_DELAY_METHODS`, a comma-separated
list of method names such as `Step,Execute`) in a service's environment and every matching unary
call sleeps that long before it is handled, as does every message of a matching bidirectional
stream (`StepStream`). With `PAGEWIRE_INJECT_DELAY_COUNT=N` only the first N matching calls or
messages are delayed (a slow moment, not a slow service). Nothing is injected when unset.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import grpc

from common.interceptors import UnaryBehavior, UnaryInterceptor

StreamBehavior = Callable[[Iterator[Any], grpc.ServicerContext], Iterator[Any]]


class DelayInterceptor(UnaryInterceptor):
    """Sleeps `delay_s` before handling unary calls named in `methods` (all when empty);
    only the first `count` of them when `count` is set."""

    def __init__(self, delay_s: float, methods: tuple[str, ...], count: int | None = None) -> None:
        super().__init__()
        self.delay_s = delay_s
        self.methods = methods
        self._left = count  # delays still to inject; None: every matching call
        self._lock = threading.Lock()

    def applies_to(self, method: str) -> bool:
        return not self.methods or method.rsplit("/", 1)[-1] in self.methods

    def _take_one(self) -> bool:
        """Whether this call is delayed (uses up one of `count`)."""
        with self._lock:
            if self._left is None:
                return True
            if self._left <= 0:
                return False
            self._left -= 1
            return True

    def wrap(self, method: str, inner: UnaryBehavior) -> UnaryBehavior:
        def delayed(request: Any, context: grpc.ServicerContext) -> Any:
            if self._take_one():
                time.sleep(self.delay_s)
            return inner(request, context)

        return delayed

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = continuation(details)
        if handler is None or handler.stream_stream is None or \
                not self.applies_to(details.method):
            # The handler is already resolved: the unary path need not ask for it again.
            return super().intercept_service(lambda _: handler, details)
        return grpc.stream_stream_rpc_method_handler(
            self._wrap_stream(handler.stream_stream),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _wrap_stream(self, inner: StreamBehavior) -> StreamBehavior:
        if inspect.isasyncgenfunction(inner):  # a grpc.aio server's coroutine stream
            return self._wrap_async_stream(inner)  # type: ignore[return-value]

        def delayed(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
            def late() -> Iterator[Any]:
                for request in requests:
                    if self._take_one():
                        time.sleep(self.delay_s)
                    yield request

            return inner(late(), context)

        return delayed

    def _wrap_async_stream(self, inner: Callable[..., AsyncIterator[Any]]
                           ) -> Callable[..., AsyncIterator[Any]]:
        async def delayed(requests: AsyncIterator[Any],
                          context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async def late() -> AsyncIterator[Any]:
                async for request in requests:
                    if self._take_one():
                        await asyncio.sleep(self.delay_s)
                    yield request

            async for response in inner(late(), context):
                yield response

        return delayed


def interceptors_from_env() -> list[grpc.ServerInterceptor]:
    """The fault interceptors the environment asks for (none by default)."""
    delay_ms = float(os.environ.get("PAGEWIRE_INJECT_DELAY_MS", "0") or 0)
    if delay_ms <= 0:
        return []
    listed = os.environ.get("PAGEWIRE_INJECT_DELAY_METHODS", "")
    methods = tuple(m.strip() for m in listed.split(",") if m.strip())
    count_text = os.environ.get("PAGEWIRE_INJECT_DELAY_COUNT", "").strip()
    count = int(count_text) if count_text else None
    return [DelayInterceptor(delay_ms / 1000.0, methods, count)]
