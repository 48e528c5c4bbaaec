"""Starts the gateway service: tokenizer, engine, gRPC server; stops it on SIGTERM/SIGINT.

The gRPC server serves GenerationService (public tokens) and AdminService (the internal
token: gateway/admin.py); --lora-modules are loaded before either is served.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from dataclasses import replace

import grpc

from common.handlers import lenient_handlers
from common.log import setup_logging
from common.security import ClientTls, open_channel
from common.server import (
    EventLoopThread,
    GrpcService,
    ServerOptions,
    add_server_arguments,
    run_until_signal,
    server_options_from_args,
    start_server,
)
from gateway import refusals
from gateway.adapters import AdapterAdmin, AdapterError
from gateway.admin import ADMIN_SERVICE, AdminServicer, GatewayAuth
from gateway.admission import Admission
from gateway.config import (
    DEFAULT_GATEWAY_PORT,
    GatewayConfig,
    add_gateway_arguments,
    config_from_args,
)
from gateway.engine import Engine
from gateway.http.app import HttpApi, HttpServer
from gateway.sampling_defaults import GenerationConfigError, load_defaults
from gateway.servicer import GenerationServicer
from gateway.tokenizer import Tokenizer, load_tokenizer
from protos import gateway_pb2

log = logging.getLogger(__name__)

SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["GenerationService"]
SERVICE_NAME = SERVICE.full_name
ADMIN_SERVICE_NAME = ADMIN_SERVICE.full_name
_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    # gRPC's default reconnect backoff (1 s, growing 1.6x) dominated the time to notice a
    # restarted backend; a restart is the common case here, so retry the connection sooner.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
    # Keepalive. A runner or block service whose host vanishes without closing its connections
    # (power loss, network partition) sends no FIN or RST: without pings, the Execute in flight
    # to it waits for its deadline (PAGEWIRE_GATEWAY_RPC_TIMEOUT_S, 120 s) before its requests
    # can move. With them, a connection that has received nothing for 2 s is pinged, and closed
    # when the ping goes unanswered for 2 s: its calls fail UNAVAILABLE about 2-4 s after the
    # peer's last byte, about when the runner's 3 s registration lease runs out, so its
    # requests move as soon as the engine retires it (docs/deploy.md). gRPC enforces the 2 s
    # in two ways, both needed: keepalive_timeout_ms becomes the socket's TCP_USER_TIMEOUT (a
    # vanished host never acknowledges the ping's bytes), and ping_timeout_ms (default 1
    # minute) covers a peer whose kernel acknowledges but whose process does not answer
    # (stopped, hung). Shorter would gain little (the lease bounds the move anyway) and risk
    # closing a connection to an overloaded host (pings are answered by gRPC's own threads,
    # not by the model, even while the GIL is held); a connection closed by mistake costs only
    # a retry of the same, idempotent call. Pings go on with no call open (a broken idle
    # connection is found before a call needs it) and with no cap between data frames (a
    # long prefill sends none). Every pagewire server takes this rate (common/server.py,
    # MIN_PING_INTERVAL_MS).
    ("grpc.keepalive_time_ms", 2000),
    ("grpc.keepalive_timeout_ms", 2000),
    ("grpc.http2.ping_timeout_ms", 2000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]


class StartError(Exception):
    """The gateway cannot serve as configured (a --lora-modules adapter did not load)."""


class Gateway:
    """A running gateway: its channels, engine and server."""

    def __init__(self, config: GatewayConfig, options: ServerOptions,
                 tokenizer: Tokenizer | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer or load_tokenizer(config.model)
        self.defaults = load_defaults(self.tokenizer.folder, config.generation_config,
                                      config.override_generation_config)
        self._block_channel = _backend_channel(config, config.block_service)
        self.engine = Engine(config, self._block_channel,
                             lambda address: _backend_channel(config, address))
        self.service: GrpcService | None = None
        self.servicer: GenerationServicer | None = None
        self.admin: AdapterAdmin | None = None
        self.http: HttpServer | None = None
        self._options = replace(options, on_auth_refusal=_auth_refused)
        self._event_loop: EventLoopThread | None = None

    def start(self, timeout_s: float = 300.0) -> GrpcService:
        info = self.engine.start(timeout_s)
        admission = Admission(self.engine, self.tokenizer, info, defaults=self.defaults,
                              served_model_name=self.config.served_model_name)
        servicer = GenerationServicer(self.engine, admission,
                                      tokens_checked=bool(self._options.auth_tokens))
        log.info("serving the model as %r; default sampling: %s (a request's own parameters "
                 "win)", admission.served_model_name, self.defaults.describe())
        self.servicer = servicer
        engine = self.engine
        self.admin = admin = AdapterAdmin(admission.models, lambda: engine.loops)
        self._load_lora_modules(admin)
        admin_servicer = AdminServicer(admin)
        self._event_loop = EventLoopThread()
        # The tokens are checked by GatewayAuth: public ones, and the internal one for
        # AdminService (start_server's own check would take a public token for both).
        auth = GatewayAuth(self._options.auth_tokens, self.config.backend_token,
                           self._options.on_auth_refusal)
        self.service = start_server(
            self._options,
            lambda server: server.add_generic_rpc_handlers((
                lenient_handlers(servicer, SERVICE, gateway_pb2),
                lenient_handlers(admin_servicer, ADMIN_SERVICE, gateway_pb2))),
            [SERVICE_NAME, ADMIN_SERVICE_NAME],
            loop=self._event_loop.loop,
            auth=auth if auth.checks_tokens else None,
        )
        # Health follows the backends: NOT_SERVING while the runner or block service is down.
        self.engine.set_health_listener(self.service.set_serving)
        if self.config.http_port:
            api = HttpApi(self.engine, admission, self._options, admin)
            self.http = HttpServer(api, self._options, self.config.http_port,
                                   self._event_loop.loop)
            self.http.start()
        return self.service

    def _load_lora_modules(self, admin: AdapterAdmin) -> None:
        """Loads the --lora-modules adapters, before anything is served (StartError)."""
        for name, path in self.config.lora_modules:
            try:
                adapter = admin.load(name, path)
            except AdapterError as error:
                raise StartError(f"--lora-modules {name}={path}: {error.code_name}: "
                                 f"{error.message}") from None
            log.info("LoRA adapter %s (rank %d) loaded from %s", name, adapter.rank, path)

    def stop(self) -> None:
        """Ends unfinished streams (abort), drains the server, closes the session."""
        self.engine.stop()
        if self.http is not None:
            self.http.stop()
        if self.service is not None:
            self.service.stop()
        if self._event_loop is not None:
            self._event_loop.stop()
        self._block_channel.close()


def _auth_refused(peer: str, message: str) -> None:
    refusals.record("grpc", grpc.StatusCode.UNAUTHENTICATED.name, "unauthorized", peer, message)


def _backend_channel(config: GatewayConfig, address: str) -> grpc.Channel:
    tls = None
    if config.backend_tls_ca:
        tls = ClientTls(config.backend_tls_ca, config.backend_tls_cert or None,
                        config.backend_tls_key or None)
    return open_channel(address, tls, config.backend_token or None, _CHANNEL_OPTIONS)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gateway", description=__doc__)
    add_server_arguments(parser, "gateway", DEFAULT_GATEWAY_PORT)
    add_gateway_arguments(parser)
    parser.add_argument("--log-level", default=None)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    options = server_options_from_args(args)  # first: --nice before any thread starts
    setup_logging("gateway", args.log_level)
    try:
        config = config_from_args(args)
        gateway = Gateway(config, options)
    except ValueError as error:  # inconsistent flags or defaults: a usage error
        parser.error(str(error))
    try:
        service = gateway.start()
    except (GenerationConfigError, StartError) as error:  # defaults, --lora-modules
        gateway.stop()
        parser.error(str(error))
    log.info("gateway serving on %s:%d (block service %s, runners %s)", args.host,
             service.port, gateway.config.block_service,
             ", ".join(gateway.config.runners) or "registered with it")
    if gateway.http is not None:
        log.info("OpenAI-compatible HTTP API on http://%s:%d/v1", args.host,
                 gateway.http.port)
    return run_until_signal(service, on_stop=gateway.stop)
