"""Server interceptors that wrap unary handlers: the shared plumbing for metrics and faults."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc

UnaryBehavior = Callable[[Any, grpc.ServicerContext], Any]


class UnaryInterceptor(grpc.ServerInterceptor):
    """Wraps every unary-unary handler whose method `applies_to`; streams pass through.

    gRPC asks the interceptor for a handler on every call; the wrapped handler of a method is
    built once and kept (a server's handlers are fixed once it has started), which saves the
    lookup and wrapping on each call of a hot method such as Step or Execute.
    """

    def __init__(self) -> None:
        self._wrapped: dict[str, grpc.RpcMethodHandler] = {}

    def applies_to(self, method: str) -> bool:
        return True

    def wrap(self, method: str, inner: UnaryBehavior) -> UnaryBehavior:
        raise NotImplementedError

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        details: grpc.HandlerCallDetails,
    ) -> Any:
        wrapped = self._wrapped.get(details.method)
        if wrapped is not None:
            return wrapped
        handler = continuation(details)
        if handler is None or handler.unary_unary is None or not self.applies_to(details.method):
            return handler
        wrapped = self._wrapped[details.method] = grpc.unary_unary_rpc_method_handler(
            self.wrap(details.method, handler.unary_unary),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
        return wrapped


class AsyncAdapter(grpc.aio.ServerInterceptor):
    """A synchronous interceptor on an asyncio server (grpc.aio takes only its own kind).

    The handlers it wraps must be synchronous ones (run on the server's migration thread
    pool): pagewire's interceptors wrap unary handlers, and an asyncio server's unary
    handlers are synchronous; its coroutine handlers pass through unchanged.
    """

    def __init__(self, inner: grpc.ServerInterceptor) -> None:
        self._inner = inner

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        return self._inner.intercept_service(lambda _: handler, details)
