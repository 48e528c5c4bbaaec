"""TLS, mutual TLS and bearer tokens, on a real server built by common.server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.security import ClientTls, ServerTls, open_channel
from common.server import GrpcService, ServerOptions, start_server
from tests.helpers.certs import CertificateAuthority

ECHO = "/pagewire.test.Echo/Ping"


def _register_echo(server: grpc.Server) -> None:
    handler = grpc.unary_unary_rpc_method_handler(lambda request, _context: request)
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("pagewire.test.Echo", {"Ping": handler})]
    )


def _serve(options: ServerOptions) -> GrpcService:
    return start_server(options, _register_echo, ["pagewire.test.Echo"])


def _ping(channel: grpc.Channel) -> bytes:
    return channel.unary_unary(ECHO)(b"hello", timeout=5)


@pytest.fixture()
def ca(tmp_path: Path) -> CertificateAuthority:
    return CertificateAuthority(tmp_path)


@pytest.fixture()
def token_server() -> Iterator[GrpcService]:
    service = _serve(ServerOptions(auth_tokens=("s3cret",)))
    yield service
    service.stop(0)


def test_token_required(token_server: GrpcService) -> None:
    address = f"127.0.0.1:{token_server.port}"
    with open_channel(address) as channel, pytest.raises(grpc.RpcError) as refused:
        _ping(channel)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "bearer token" in (refused.value.details() or "")
    with open_channel(address, token="wrong") as channel, pytest.raises(grpc.RpcError) as wrong:
        _ping(channel)
    assert wrong.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with open_channel(address, token="s3cret") as channel:
        assert _ping(channel) == b"hello"


def test_health_needs_no_token(token_server: GrpcService) -> None:
    with open_channel(f"127.0.0.1:{token_server.port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_tls(ca: CertificateAuthority) -> None:
    server_files = ca.issue("server")
    service = _serve(ServerOptions(tls=ServerTls(str(server_files.cert), str(server_files.key))))
    address = f"localhost:{service.port}"
    try:
        with open_channel(address, tls=ClientTls(str(ca.files.cert))) as channel:
            assert _ping(channel) == b"hello"
        with open_channel(address) as plaintext, pytest.raises(grpc.RpcError) as refused:
            _ping(plaintext)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        service.stop(0)


def test_mutual_tls(ca: CertificateAuthority, tmp_path: Path) -> None:
    server_files, client_files = ca.issue("server"), ca.issue("gateway")
    (tmp_path / "other").mkdir()
    stranger = CertificateAuthority(tmp_path / "other", "other CA").issue("stranger")
    tls = ServerTls(str(server_files.cert), str(server_files.key), str(ca.files.cert))
    service = _serve(ServerOptions(tls=tls))
    address = f"localhost:{service.port}"
    try:
        trusted = ClientTls(str(ca.files.cert), str(client_files.cert), str(client_files.key))
        with open_channel(address, tls=trusted) as channel:
            assert _ping(channel) == b"hello"
        anonymous = ClientTls(str(ca.files.cert))
        with open_channel(address, tls=anonymous) as channel, pytest.raises(grpc.RpcError):
            _ping(channel)
        untrusted = ClientTls(str(ca.files.cert), str(stranger.cert), str(stranger.key))
        with open_channel(address, tls=untrusted) as channel, pytest.raises(grpc.RpcError):
            _ping(channel)
    finally:
        service.stop(0)
