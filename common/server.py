"""The gRPC server bootstrap every service uses.

One place decides how a pagewire service listens: address and port from flags or the
environment, grpc.health.v1, server reflection, Prometheus metrics, message-size limits, and
a graceful stop on SIGTERM/SIGINT (stop accepting, let in-flight calls finish within a grace
period, exit 0).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass
from types import FrameType

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.faults import interceptors_from_env
from common.heap import freeze_start_up_heap
from common.interceptors import AsyncAdapter
from common.metrics import MetricsInterceptor, start_metrics_server
from common.security import ServerTls, TokenAuthInterceptor, read_tokens

log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# The shortest interval between a client's keepalive pings a server accepts, with or without
# calls in flight. The gateway pings its runners and block service every 2 s (gateway/server.py,
# _CHANNEL_OPTIONS) to notice a vanished host within seconds; gRPC's server default (one ping
# per 5 minutes while it sends nothing, none on a connection without calls) would answer that
# with GOAWAY "too_many_pings" and fail the calls in flight. Half the client's interval, so
# that timer jitter never makes a ping look early.
MIN_PING_INTERVAL_MS = 1000


@dataclass
class ServerOptions:
    """How a service listens."""

    host: str = "127.0.0.1"
    port: int = 0  # 0 lets the OS choose; the chosen port is on GrpcService.port
    metrics_port: int = 0  # 0 serves no metrics port
    grace_s: float = 5.0
    max_workers: int = 16
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    tls: ServerTls | None = None  # None serves plaintext
    auth_tokens: tuple[str, ...] = ()  # bearer tokens accepted; empty accepts every caller
    # Told (peer, message) of each call refused for its token (the gateway logs and counts
    # its refusals: gateway/refusals.py).
    on_auth_refusal: Callable[[str, str], None] | None = None


def _env(service: str, name: str, default: str) -> str:
    return os.environ.get(f"PAGEWIRE_{service.upper()}_{name}", default)


def add_server_arguments(parser: argparse.ArgumentParser, service: str, default_port: int) -> None:
    """Adds --host, --port, --metrics-port, --grace-s, --max-workers, --max-message-bytes,
    --tls-cert, --tls-key, --tls-client-ca, --auth-token-file and --nice.

    Each defaults to PAGEWIRE_<SERVICE>_<FLAG> from the environment, then to the built-in value.
    """
    parser.add_argument("--host", default=_env(service, "HOST", "127.0.0.1"), help="bind address")
    parser.add_argument("--port", type=int, default=int(_env(service, "PORT", str(default_port))))
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=int(_env(service, "METRICS_PORT", "0")),
        help="Prometheus /metrics port (0: off)",
    )
    parser.add_argument(
        "--grace-s",
        type=float,
        default=float(_env(service, "GRACE_S", "5")),
        help="seconds in-flight calls get to finish on SIGTERM",
    )
    parser.add_argument("--max-workers", type=int, default=int(_env(service, "MAX_WORKERS", "16")))
    parser.add_argument(
        "--max-message-bytes",
        type=int,
        default=int(_env(service, "MAX_MESSAGE_BYTES", str(DEFAULT_MAX_MESSAGE_BYTES))),
    )
    parser.add_argument(
        "--tls-cert",
        default=_env(service, "TLS_CERT", ""),
        help="PEM certificate chain: serve TLS (with --tls-key)",
    )
    parser.add_argument("--tls-key", default=_env(service, "TLS_KEY", ""), help="PEM private key")
    parser.add_argument(
        "--tls-client-ca",
        default=_env(service, "TLS_CLIENT_CA", ""),
        help="PEM CA of client certificates: require mutual TLS",
    )
    parser.add_argument(
        "--auth-token-file",
        default=_env(service, "AUTH_TOKEN_FILE", ""),
        help="file of accepted bearer tokens, one per line (default: no auth)",
    )
    parser.add_argument(
        "--nice",
        type=int,
        default=int(_env(service, "NICE", "0")),
        help="lower this process's CPU priority by this much (0-19): for a service that "
             "shares cores with a CPU runner, so that its work gives way to the forward's",
    )


def server_options_from_args(args: argparse.Namespace) -> ServerOptions:
    """Reads the flags added by add_server_arguments, and applies --nice to every thread (call
    it before starting threads of your own: later ones inherit it from the one starting them)."""
    if not 0 <= args.nice <= 19:
        raise SystemExit(f"--nice {args.nice}: give 0 to 19")
    if args.nice:
        lower_priority(args.nice)
    if bool(args.tls_cert) != bool(args.tls_key):
        raise SystemExit("--tls-cert and --tls-key go together")
    if args.tls_client_ca and not args.tls_cert:
        raise SystemExit("--tls-client-ca needs --tls-cert and --tls-key")
    tls = None
    if args.tls_cert:
        tls = ServerTls(args.tls_cert, args.tls_key, args.tls_client_ca or None)
    return ServerOptions(
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        grace_s=args.grace_s,
        max_workers=args.max_workers,
        max_message_bytes=args.max_message_bytes,
        tls=tls,
        auth_tokens=read_tokens(args.auth_token_file),
    )


def lower_priority(nice: int) -> None:
    """Raises the nice value of every thread this process has (Linux keeps one per thread;
    an imported library may have started some already) and so of every later one."""
    try:
        thread_ids = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:  # no /proc: the process-wide call is all there is
        os.nice(nice)
        return
    for thread_id in thread_ids:
        current = os.getpriority(os.PRIO_PROCESS, thread_id)
        os.setpriority(os.PRIO_PROCESS, thread_id, min(19, current + nice))


class EventLoopThread:
    """An asyncio event loop on a thread of its own, for a grpc.aio server (start_server's
    `loop`) and whatever else serves on it."""

    def __init__(self, name: str = "event-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


class GrpcService:
    """A started server with its health status."""

    def __init__(
        self,
        stop_server: Callable[[float], None],
        port: int,
        health_servicer: health.HealthServicer,
        service_names: Sequence[str],
        grace_s: float,
    ) -> None:
        self._stop_server = stop_server
        self.port = port
        self._health = health_servicer
        self._service_names = list(service_names)
        self.grace_s = grace_s
        self._stopped = threading.Event()

    def set_serving(self, serving: bool) -> None:
        """Sets SERVING / NOT_SERVING for the overall server ("") and every service."""
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ["", *self._service_names]:
            self._health.set(name, status)

    def stop(self, grace_s: float | None = None) -> None:
        """Stops accepting calls and waits up to the grace period for in-flight ones."""
        self.set_serving(False)
        self._stop_server(self.grace_s if grace_s is None else grace_s)
        self._stopped.set()

    def wait(self) -> None:
        """Blocks until stop() has finished."""
        self._stopped.wait()


def start_server(
    options: ServerOptions,
    register: Callable[[grpc.Server | grpc.aio.Server], None],
    service_names: Sequence[str],
    serving: bool = True,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    loop: asyncio.AbstractEventLoop | None = None,
    auth: grpc.ServerInterceptor | None = None,
) -> GrpcService:
    """Builds, binds and starts a server with health, reflection and metrics.

    `register` adds the service's servicers; `service_names` are their full names (e.g.
    `block_pb2.DESCRIPTOR.services_by_name["BlockService"].full_name`) for health and
    reflection. With `serving=False` health says NOT_SERVING until set_serving(True).
    `auth` replaces the bearer-token check made from `options.auth_tokens` (the gateway's
    checks two kinds of token); it runs first, before interceptors that keep one handler per
    method (MetricsInterceptor) and so would keep its first answer for every later call.

    With `loop` (running on another thread), the server is a grpc.aio one on that loop: its
    coroutine handlers hold no thread while they wait, and its synchronous handlers (health,
    unary methods) run on a pool of --max-workers threads as the threaded server's do.
    """
    message_options = [
        ("grpc.max_receive_message_length", options.max_message_bytes),
        ("grpc.max_send_message_length", options.max_message_bytes),
        ("grpc.so_reuseport", 0),
        # Accept keepalive pings (MIN_PING_INTERVAL_MS): on connections without calls too, and
        # every MIN_PING_INTERVAL_MS even while this server sends nothing (a long Execute). A
        # client pinging faster still gets GOAWAY "too_many_pings" at its third early ping.
        # (gRPC's name for the server-side interval is grpc.http2.min_ping_interval_without_
        # data_ms; "min_recv_ping_interval_without_data_ms" is silently ignored.)
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
        ("grpc.http2.max_ping_strikes", 2),
    ]
    if auth is None and options.auth_tokens:
        auth = TokenAuthInterceptor(options.auth_tokens, options.on_auth_refusal)
    all_interceptors = [*([auth] if auth is not None else []), MetricsInterceptor(),
                        *interceptors, *interceptors_from_env()]
    pool = futures.ThreadPoolExecutor(max_workers=options.max_workers)
    health_servicer = health.HealthServicer()
    address = f"{options.host}:{options.port}"

    def build(server: grpc.Server | grpc.aio.Server) -> int:
        register(server)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection(
            [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server
        )
        if options.tls is not None:
            port = server.add_secure_port(address, options.tls.credentials())
        else:
            port = server.add_insecure_port(address)
        if port == 0:
            raise OSError(f"cannot bind {options.host}:{options.port}")
        return port

    stop_server: Callable[[float], None]
    if loop is None:
        server = grpc.server(pool, interceptors=all_interceptors, options=message_options)
        port = build(server)
        server.start()

        def stop_server(grace_s: float) -> None:
            server.stop(grace_s).wait()
    else:
        async def start_aio() -> tuple[grpc.aio.Server, int]:
            server = grpc.aio.server(
                migration_thread_pool=pool, options=message_options,
                interceptors=[AsyncAdapter(interceptor) for interceptor in all_interceptors])
            port = build(server)
            await server.start()
            return server, port

        aio_server, port = asyncio.run_coroutine_threadsafe(start_aio(), loop).result()

        def stop_server(grace_s: float) -> None:
            asyncio.run_coroutine_threadsafe(aio_server.stop(grace_s), loop).result()
            pool.shutdown(wait=False)
    start_metrics_server(options.metrics_port, options.host)
    service = GrpcService(stop_server, port, health_servicer, service_names, options.grace_s)
    service.set_serving(serving)
    log.info("listening on %s:%d", options.host, port)
    return service


def run_until_signal(service: GrpcService, on_stop: Callable[[], None] | None = None) -> int:
    """Serves until SIGTERM or SIGINT, then stops gracefully; returns the exit code (0).

    `on_stop` runs after the server has drained (release models, close channels). The
    process has started by now: its start-up heap is frozen for the collector (common/heap.py).
    """
    requested = threading.Event()

    def handle(signum: int, _frame: FrameType | None) -> None:
        log.info("signal %d: stopping (grace %.1fs)", signum, service.grace_s)
        requested.set()

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)
    # After the handlers: a stop asked for during the collection is still a graceful one.
    freeze_start_up_heap()
    while not requested.wait(0.5):
        pass
    service.stop()
    if on_stop is not None:
        on_stop()
    log.info("stopped")
    return 0
