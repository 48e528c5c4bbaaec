"""Prometheus metrics: an RPC interceptor and the metrics HTTP port."""

from __future__ import annotations

import time
from typing import Any

import grpc
from prometheus_client import Counter, Histogram, start_http_server

from common.interceptors import UnaryBehavior, UnaryInterceptor

RPC_TOTAL = Counter(
    "pagewire_rpc_total", "Unary RPCs handled, by method and status code", ["method", "code"]
)
RPC_SECONDS = Histogram(
    "pagewire_rpc_seconds",
    "Time to handle a unary RPC",
    ["method"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10),
)


def start_metrics_server(port: int, host: str = "127.0.0.1") -> None:
    """Serves /metrics on `port` (0 serves none: metrics are then only in-process)."""
    if port:
        start_http_server(port, addr=host)


class MetricsInterceptor(UnaryInterceptor):
    """Counts and times unary RPCs by method and status code."""

    def wrap(self, method: str, inner: UnaryBehavior) -> UnaryBehavior:
        seconds = RPC_SECONDS.labels(method)
        ok_total = RPC_TOTAL.labels(method, "OK")

        def timed(request: Any, context: grpc.ServicerContext) -> Any:
            if not hasattr(context, "code"):  # a synchronous handler on a grpc.aio server
                context = _CodeKeeping(context)
            start = time.perf_counter()
            try:
                return inner(request, context)
            finally:
                seconds.observe(time.perf_counter() - start)
                code = context.code()
                total = ok_total if code is None else RPC_TOTAL.labels(method, code.name)
                total.inc()

        return timed


class _CodeKeeping:
    """A servicer context that remembers the status code set on it (grpc.aio's context for
    synchronous handlers has no code() to read it back)."""

    def __init__(self, context: Any) -> None:
        self._context = context
        self._code: grpc.StatusCode | None = None

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code
        self._context.set_code(code)

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self._code = code
        self._context.abort(code, details)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)
