"""Fault injection for tests: delay chosen RPCs of a real server process.

Set `PAGEWIRE_INJECT_DELAY_MS` (and optionally `PAGEWIRE_INJECT_DELAY_METHODS`, a comma-separated
list of method names such as `Step,Execute`) in a service's environment and every matching unary
call sleeps that long before it is handled. Nothing is injected when unset.
"""

from __future__ import annotations

import os
import time
from typing import Any

import grpc

from common.interceptors import UnaryBehavior, UnaryInterceptor


class DelayInterceptor(UnaryInterceptor):
    """Sleeps `delay_s` before handling unary calls named in `methods` (all when empty)."""

    def __init__(self, delay_s: float, methods: tuple[str, ...]) -> None:
        self.delay_s = delay_s
        self.methods = methods

    def applies_to(self, method: str) -> bool:
        return not self.methods or method.rsplit("/", 1)[-1] in self.methods

    def wrap(self, method: str, inner: UnaryBehavior) -> UnaryBehavior:
        def delayed(request: Any, context: grpc.ServicerContext) -> Any:
            time.sleep(self.delay_s)
            return inner(request, context)

        return delayed


def interceptors_from_env() -> list[grpc.ServerInterceptor]:
    """The fault interceptors the environment asks for (none by default)."""
    delay_ms = float(os.environ.get("PAGEWIRE_INJECT_DELAY_MS", "0") or 0)
    if delay_ms <= 0:
        return []
    listed = os.environ.get("PAGEWIRE_INJECT_DELAY_METHODS", "")
    methods = tuple(m.strip() for m in listed.split(",") if m.strip())
    return [DelayInterceptor(delay_ms / 1000.0, methods)]
