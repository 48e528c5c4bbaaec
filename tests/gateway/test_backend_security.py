"""The gateway reaches a block service and a runner that require TLS and a bearer token."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest

from common.security import ClientTls, ServerTls, open_channel
from common.server import ServerOptions, start_server
from gateway.client import PagewireClient
from gateway.tokenizer import Tokenizer
from protos import block_pb2, block_pb2_grpc, runner_pb2_grpc
from tests.gateway.conftest import RUNNER_SERVICE, start_gateway
from tests.gateway.fake_runner import FakeRunner, expected_tokens
from tests.helpers.certs import CertificateAuthority
from tests.helpers.services import ServiceProcess

TOKEN = "s3cret-token"


def test_gateway_talks_tls_and_tokens_to_its_backends(tokenizer: Tokenizer,
                                                      tmp_path: Path) -> None:
    ca = CertificateAuthority(tmp_path)
    server_cert = ca.issue("backend")
    tokens = tmp_path / "tokens.txt"
    tokens.write_text(TOKEN + "\n")
    blocks = ServiceProcess("block_service", [
        "--tls-cert", str(server_cert.cert), "--tls-key", str(server_cert.key),
        "--auth-token-file", str(tokens)]).start(tmp_path)
    runner = FakeRunner(num_blocks=64, block_size=4)
    runner_server = start_server(
        ServerOptions(port=0, tls=ServerTls(str(server_cert.cert), str(server_cert.key)),
                      auth_tokens=(TOKEN,)),
        lambda server: runner_pb2_grpc.add_RunnerServiceServicer_to_server(runner, server),
        [RUNNER_SERVICE])
    gateway = None
    try:
        tls = ClientTls(str(ca.files.cert))
        with open_channel(blocks.address, tls, TOKEN) as channel:
            _wait_ready(channel)
        runner_address = f"127.0.0.1:{runner_server.port}"
        gateway = start_gateway(tokenizer, blocks.address, runner_address,
                                backend_tls_ca=str(ca.files.cert), backend_token=TOKEN)
        assert gateway.service is not None
        with PagewireClient(f"127.0.0.1:{gateway.service.port}") as client:
            result = client.complete(token_ids=[40, 41, 42], max_tokens=5, temperature=0)
        assert result.token_ids[0] == expected_tokens([40, 41, 42], 5)
        with pytest.raises(grpc.RpcError):  # and without the token, nothing gets through
            start_gateway(tokenizer, blocks.address, runner_address,
                          backend_tls_ca=str(ca.files.cert), rpc_timeout_s=2.0)
    finally:
        if gateway is not None:
            gateway.stop()
        runner_server.stop(0)
        blocks.terminate()


def _wait_ready(channel: grpc.Channel) -> None:
    stub = block_pb2_grpc.BlockServiceStub(channel)
    for _ in range(300):
        try:
            stub.GetStats(block_pb2.GetStatsRequest(pool_id="none"), timeout=1)
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.NOT_FOUND:
                return
        time.sleep(0.1)
    raise TimeoutError("block service did not start")
