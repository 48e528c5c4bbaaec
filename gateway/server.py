"""Starts the gateway service: tokenizer, engine, gRPC server; stops it on SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from common.log import setup_logging
from common.security import ClientTls, open_channel
from common.server import (
    GrpcService,
    ServerOptions,
    add_server_arguments,
    run_until_signal,
    server_options_from_args,
    start_server,
)
from gateway.config import (
    DEFAULT_GATEWAY_PORT,
    GatewayConfig,
    add_gateway_arguments,
    config_from_args,
)
from gateway.engine import Engine
from gateway.servicer import GenerationServicer
from gateway.tokenizer import Tokenizer, load_tokenizer
from protos import gateway_pb2

log = logging.getLogger(__name__)

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name
_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    # gRPC's default reconnect backoff (1 s, growing 1.6x) dominated the time to notice a
    # restarted backend; a restart is the common case here, so retry the connection sooner.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
]


class Gateway:
    """A running gateway: its channels, engine and server."""

    def __init__(self, config: GatewayConfig, options: ServerOptions,
                 tokenizer: Tokenizer | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer or load_tokenizer(config.model)
        self._block_channel = _backend_channel(config, config.block_service)
        self._runner_channel = _backend_channel(config, config.runner)
        self.engine = Engine(config, self._block_channel, self._runner_channel)
        self.service: GrpcService | None = None
        self.servicer: GenerationServicer | None = None
        self._options = options

    def start(self, timeout_s: float = 300.0) -> GrpcService:
        info = self.engine.start(timeout_s)
        servicer = GenerationServicer(self.engine, self.tokenizer, info,
                                      tokens_checked=bool(self._options.auth_tokens))
        self.servicer = servicer
        self.service = start_server(
            self._options,
            lambda server: server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
                SERVICE_NAME, method_handlers(servicer)),)),
            [SERVICE_NAME],
        )
        # Health follows the backends: NOT_SERVING while the runner or block service is down.
        self.engine.set_health_listener(self.service.set_serving)
        return self.service

    def stop(self) -> None:
        """Ends unfinished streams (abort), drains the server, closes the session."""
        self.engine.stop()
        if self.service is not None:
            self.service.stop()
        self._block_channel.close()
        self._runner_channel.close()


@dataclass(frozen=True)
class Malformed:
    """A request whose bytes did not parse (gRPC itself would answer INTERNAL for it)."""

    message_name: str
    error: str


def lenient_parser(message_class: type[Message]) -> Callable[[bytes], Message | Malformed]:
    """A request deserializer that turns a parse failure into a Malformed value."""
    def parse(data: bytes) -> Message | Malformed:
        try:
            return message_class.FromString(data)
        except DecodeError as error:  # bad wire format or invalid UTF-8 in a string field
            return Malformed(message_class.DESCRIPTOR.name, str(error) or "unparsable")
    return parse


def _refuse_malformed(request: Any, context: grpc.ServicerContext) -> None:
    if isinstance(request, Malformed):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                      f"malformed {request.message_name}: {request.error}")


def method_handlers(servicer: GenerationServicer) -> dict[str, grpc.RpcMethodHandler]:
    """The GenerationService methods, answering INVALID_ARGUMENT to requests that don't parse."""
    def generate(request: Any, context: grpc.ServicerContext
                 ) -> Iterator[gateway_pb2.GenerateResponse]:
        _refuse_malformed(request, context)
        yield from servicer.Generate(request, context)

    def unary(method: Callable[[Any, grpc.ServicerContext], Message]
              ) -> Callable[[Any, grpc.ServicerContext], Message]:
        def handle(request: Any, context: grpc.ServicerContext) -> Message:
            _refuse_malformed(request, context)
            return method(request, context)
        return handle

    return {
        "Generate": grpc.unary_stream_rpc_method_handler(
            generate, request_deserializer=lenient_parser(gateway_pb2.GenerateRequest),
            response_serializer=gateway_pb2.GenerateResponse.SerializeToString),
        "Tokenize": grpc.unary_unary_rpc_method_handler(
            unary(servicer.Tokenize),
            request_deserializer=lenient_parser(gateway_pb2.TokenizeRequest),
            response_serializer=gateway_pb2.TokenizeResponse.SerializeToString),
        "GetModelInfo": grpc.unary_unary_rpc_method_handler(
            unary(servicer.GetModelInfo),
            request_deserializer=lenient_parser(gateway_pb2.GetModelInfoRequest),
            response_serializer=gateway_pb2.GetModelInfoResponse.SerializeToString),
    }


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
    args = build_parser().parse_args(argv)
    setup_logging("gateway", args.log_level)
    gateway = Gateway(config_from_args(args), server_options_from_args(args))
    service = gateway.start()
    log.info("gateway serving on %s:%d (block service %s, runner %s)", args.host, service.port,
             gateway.config.block_service, gateway.config.runner)
    return run_until_signal(service, on_stop=gateway.stop)
