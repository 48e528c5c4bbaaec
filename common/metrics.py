"""Prometheus metrics: an RPC interceptor and the metrics HTTP port."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import grpc
from prometheus_client import Counter, Histogram, start_http_server

RPC_TOTAL = Counter(
    "pagewire_rpc_total", "RPCs handled, by method and status code", ["method", "code"]
)
RPC_SECONDS = Histogram(
    "pagewire_rpc_seconds",
    "Time to handle an RPC (to the first response for streams)",
    ["method"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10),
)


def start_metrics_server(port: int, host: str = "127.0.0.1") -> None:
    """Serves /metrics on `port` (0 picks none: metrics are then only in-process)."""
    if port:
        start_http_server(port, addr=host)


class MetricsInterceptor(grpc.ServerInterceptor):
    """Counts and times unary RPCs; streaming RPCs are counted when they start."""

    def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Any], details: grpc.HandlerCallDetails
    ) -> Any:
        handler = continuation(details)
        if handler is None or handler.unary_unary is None:
            if handler is not None:
                RPC_TOTAL.labels(details.method, "STREAM").inc()
            return handler
        inner = handler.unary_unary
        method = details.method

        def timed(request: Any, context: grpc.ServicerContext) -> Any:
            start = time.perf_counter()
            try:
                return inner(request, context)
            finally:
                RPC_SECONDS.labels(method).observe(time.perf_counter() - start)
                code = context.code() if hasattr(context, "code") else None
                RPC_TOTAL.labels(method, code.name if code else "OK").inc()

        return grpc.unary_unary_rpc_method_handler(
            timed,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
