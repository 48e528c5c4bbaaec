"""TLS end to end with certificates made in the test: the gateway serves TLS to clients, and
gateway <-> block service / runner is mutual TLS (the backends want a client certificate)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from common.security import ClientTls, open_channel
from gateway.client import PagewireClient
from protos import block_pb2, block_pb2_grpc, runner_pb2, runner_pb2_grpc
from tests.helpers.certs import CertificateAuthority
from tests.security.conftest import ProcessStack


@dataclass
class TlsStack:
    stack: ProcessStack
    ca: CertificateAuthority
    gateway_client: ClientTls  # the gateway's own identity towards its backends
    public_client: ClientTls  # what a public client needs: the CA only


@pytest.fixture(scope="module")
def tls(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsStack]:
    folder = tmp_path_factory.mktemp("tls")
    ca = CertificateAuthority(folder)
    backend = ca.issue("backend")
    public = ca.issue("public-gateway")
    gateway_identity = ca.issue("gateway-client")
    backend_flags = ["--tls-cert", str(backend.cert), "--tls-key", str(backend.key),
                     "--tls-client-ca", str(ca.files.cert)]
    gateway_client = ClientTls(str(ca.files.cert), str(gateway_identity.cert),
                               str(gateway_identity.key))
    public_client = ClientTls(str(ca.files.cert))
    stack = ProcessStack(
        tiny_model, folder, block_flags=backend_flags, runner_flags=backend_flags,
        gateway_flags=["--tls-cert", str(public.cert), "--tls-key", str(public.key),
                       "--backend-tls-ca", str(ca.files.cert),
                       "--backend-tls-cert", str(gateway_identity.cert),
                       "--backend-tls-key", str(gateway_identity.key)],
        backend_tls=gateway_client, gateway_tls=public_client).start()
    yield TlsStack(stack, ca, gateway_client, public_client)
    stack.stop()


def refusal(call: Callable[[], object]) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as error:
        call()
    return error.value.code()


def test_a_tls_client_is_served_through_mutual_tls_backends(tls: TlsStack) -> None:
    with PagewireClient(tls.stack.gateway.address, tls=tls.public_client) as client:
        result = client.complete(token_ids=[5, 6, 7], max_tokens=4, temperature=0)
        assert len(result.token_ids[0]) == 4 and result.finish_reasons == ["length"]


def test_a_plaintext_client_gets_nothing_from_the_gateway(tls: TlsStack) -> None:
    with PagewireClient(tls.stack.gateway.address) as client:
        assert refusal(lambda: client.model_info()) == grpc.StatusCode.UNAVAILABLE


def test_a_client_that_does_not_trust_the_ca_is_refused(tls: TlsStack, tmp_path: Path) -> None:
    other = CertificateAuthority(tmp_path, name="other CA")
    with PagewireClient(tls.stack.gateway.address, tls=ClientTls(str(other.files.cert))) as c:
        assert refusal(lambda: c.model_info()) == grpc.StatusCode.UNAVAILABLE


def _backend_calls(channel: grpc.Channel) -> list[Callable[[], object]]:
    blocks = block_pb2_grpc.BlockServiceStub(channel)
    runner = runner_pb2_grpc.RunnerServiceStub(channel)
    return [lambda: blocks.GetStats(block_pb2.GetStatsRequest(pool_id="x"), timeout=5),
            lambda: runner.Info(runner_pb2.InfoRequest(), timeout=5)]


@pytest.mark.parametrize("backend", ["blocks", "runner"])
def test_backends_refuse_a_client_without_a_certificate(tls: TlsStack, backend: str,
                                                       tmp_path: Path) -> None:
    address = getattr(tls.stack, backend).address
    call = 0 if backend == "blocks" else 1
    other = CertificateAuthority(tmp_path, name="rogue CA")
    rogue = other.issue("rogue")
    for client in (tls.public_client,  # trusts the server, shows no certificate
                   ClientTls(str(tls.ca.files.cert), str(rogue.cert), str(rogue.key)),
                   None):  # plaintext
        with open_channel(address, client) as channel:
            assert refusal(_backend_calls(channel)[call]) == grpc.StatusCode.UNAVAILABLE
    with open_channel(address, tls.gateway_client) as channel:  # the gateway's identity works
        if backend == "blocks":
            assert refusal(_backend_calls(channel)[0]) == grpc.StatusCode.NOT_FOUND
        else:
            assert _backend_calls(channel)[1]() is not None
