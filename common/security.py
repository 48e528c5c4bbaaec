"""Transport security and credentials for servers and clients.

- TLS on a server from certificate files; with a client CA it requires client certificates
  (mutual TLS).
- Bearer tokens: a server configured with tokens refuses every call (health checks excepted,
  so orchestrators can probe) whose `authorization` metadata is not `Bearer <one of them>`,
  with UNAUTHENTICATED. The gateway's public token and the internal token that only gateways
  hold are separate files, so a client of the public API cannot call the internal services.
"""

from __future__ import annotations

import hmac
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

HEALTH_PREFIX = "/grpc.health.v1.Health/"


def read_tokens(path: str | None) -> tuple[str, ...]:
    """Tokens from a file, one per line (blank lines and # comments ignored)."""
    if not path:
        return ()
    lines = Path(path).read_text().splitlines()
    tokens = tuple(line.strip() for line in lines if line.strip() and not line.startswith("#"))
    if not tokens:
        raise ValueError(f"token file {path} holds no token")
    return tokens


@dataclass(frozen=True)
class ServerTls:
    """Certificate files of a TLS server; client_ca_file turns on mutual TLS."""

    cert_file: str
    key_file: str
    client_ca_file: str | None = None

    def credentials(self) -> grpc.ServerCredentials:
        key = Path(self.key_file).read_bytes()
        cert = Path(self.cert_file).read_bytes()
        client_ca = Path(self.client_ca_file).read_bytes() if self.client_ca_file else None
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
        )


@dataclass(frozen=True)
class ClientTls:
    """How a client verifies a TLS server (ca_file) and, for mutual TLS, proves itself."""

    ca_file: str
    cert_file: str | None = None
    key_file: str | None = None
    server_name: str | None = None  # overrides the name checked in the server certificate

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=Path(self.ca_file).read_bytes(),
            private_key=Path(self.key_file).read_bytes() if self.key_file else None,
            certificate_chain=Path(self.cert_file).read_bytes() if self.cert_file else None,
        )


def _refusal(handler: grpc.RpcMethodHandler, message: str,
             on_refusal: Callable[[str, str], None] | None = None) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that aborts with UNAUTHENTICATED (telling
    `on_refusal` the caller's peer and the message first); a coroutine one where `handler`'s
    behavior is a coroutine or async generator (a grpc.aio server runs those on its loop,
    where a synchronous abort would wait for the loop forever)."""

    def abort(_request: Any, context: grpc.ServicerContext) -> Any:
        if on_refusal is not None:
            on_refusal(context.peer(), message)
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def abort_async(_request: Any, context: grpc.aio.ServicerContext) -> Any:
        if on_refusal is not None:
            on_refusal(context.peer(), message)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kinds: dict[str, Callable[..., grpc.RpcMethodHandler]] = {
        "unary_unary": grpc.unary_unary_rpc_method_handler,
        "unary_stream": grpc.unary_stream_rpc_method_handler,
        "stream_unary": grpc.stream_unary_rpc_method_handler,
        "stream_stream": grpc.stream_stream_rpc_method_handler,
    }
    for kind, make in kinds.items():
        behavior = getattr(handler, kind)
        if behavior is not None:
            asynchronous = (inspect.iscoroutinefunction(behavior)
                            or inspect.isasyncgenfunction(behavior))
            return make(
                abort_async if asynchronous else abort,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
    raise ValueError("handler of unknown kind")


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Lets through only calls that carry `authorization: Bearer <token>` for a known token."""

    def __init__(self, tokens: Sequence[str],
                 on_refusal: Callable[[str, str], None] | None = None) -> None:
        """`on_refusal`: told (peer, message) of each call refused."""
        self._expected = [f"Bearer {token}".encode() for token in tokens]
        self._on_refusal = on_refusal

    def _authorized(self, metadata: Sequence[tuple[str, Any]] | None) -> bool:
        for key, value in metadata or ():
            if key == "authorization":
                presented = value.encode() if isinstance(value, str) else bytes(value)
                # compare_digest against every token: no early exit that leaks which matched
                return any([hmac.compare_digest(presented, e) for e in self._expected])
        return False

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = continuation(details)
        if handler is None or details.method.startswith(HEALTH_PREFIX):
            return handler
        if self._authorized(details.invocation_metadata):
            return handler
        return _refusal(handler, "missing or invalid bearer token (metadata 'authorization')",
                        self._on_refusal)


class _TokenMetadata(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds `authorization: Bearer <token>` to every call of a channel."""

    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {token}")

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = [*(details.metadata or ()), self._header]
        return details._replace(metadata=metadata)  # type: ignore[attr-defined]

    def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, requests):  # type: ignore[no-untyped-def]
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):  # type: ignore[no-untyped-def]
        return continuation(self._details(details), requests)


def open_channel(
    address: str,
    tls: ClientTls | None = None,
    token: str | None = None,
    options: Sequence[tuple[str, Any]] = (),
) -> grpc.Channel:
    """A channel to `address`, over TLS when `tls` is given, sending `token` when given."""
    all_options = list(options)
    if tls is not None and tls.server_name:
        all_options.append(("grpc.ssl_target_name_override", tls.server_name))
    if tls is not None:
        channel = grpc.secure_channel(address, tls.credentials(), options=all_options)
    else:
        channel = grpc.insecure_channel(address, options=all_options)
    if token:
        channel = grpc.intercept_channel(channel, _TokenMetadata(token))
    return channel
