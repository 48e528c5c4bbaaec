"""The gateway reaches a block service and a runner that require TLS and a bearer token; its
AdminService takes that internal token only, never a public one."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import httpx
import pytest

from common.security import ClientTls, ServerTls, open_channel
from common.server import ServerOptions, start_server
from gateway.client import PagewireClient
from gateway.config import GatewayConfig
from gateway.server import Gateway, StartError
from gateway.tokenizer import Tokenizer
from protos import block_pb2, block_pb2_grpc, gateway_pb2, gateway_pb2_grpc, runner_pb2_grpc
from tests.gateway.conftest import RUNNER_SERVICE, start_fake_runner, start_gateway
from tests.gateway.fake_runner import FakeRunner, expected_tokens, make_adapter
from tests.helpers.certs import CertificateAuthority
from tests.helpers.services import ServiceProcess, free_port

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


PUBLIC = "public-client-token"


def test_admin_service_takes_the_internal_token_only(tokenizer: Tokenizer,
                                                     block_service: ServiceProcess,
                                                     tmp_path: Path) -> None:
    """The gateway's public token opens GenerationService, not AdminService (it changes what
    the gateway serves); the internal token opens AdminService, not GenerationService."""
    runner = FakeRunner(num_blocks=64, block_size=4, epoch=71, max_loras=2)
    runner_server = start_fake_runner(runner)
    adapter = make_adapter(tmp_path / "sql")
    config = GatewayConfig(block_service=block_service.address,
                           runners=[f"127.0.0.1:{runner_server.port}"], backend_token=TOKEN,
                           http_port=free_port())
    gateway = Gateway(config, ServerOptions(port=0, auth_tokens=(PUBLIC,)), tokenizer)
    try:
        gateway.start(timeout_s=30)
        assert gateway.service is not None and gateway.http is not None
        address = f"127.0.0.1:{gateway.service.port}"
        load = gateway_pb2.LoadLoraAdapterRequest(lora_name="sql", lora_path=str(adapter))
        for token in (None, PUBLIC, "a-guess"):
            with open_channel(address, None, token) as channel:
                with pytest.raises(grpc.RpcError) as error:
                    gateway_pb2_grpc.AdminServiceStub(channel).LoadLoraAdapter(load)
                assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with PagewireClient(address, token=TOKEN) as internal:
            with pytest.raises(grpc.RpcError) as error:
                internal.model_info()
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
            reply = gateway_pb2_grpc.AdminServiceStub(internal.channel).LoadLoraAdapter(load)
            assert reply.adapter.name == "sql"
        with PagewireClient(address, token=PUBLIC) as client:
            assert [a.name for a in client.model_info().adapters] == ["sql"]
            assert client.complete(token_ids=[5, 6, 7], max_tokens=2, model="sql").token_ids
        # The HTTP routes are behind the HTTP API's key, as the other /v1 routes.
        url = f"http://127.0.0.1:{gateway.http.port}/v1/unload_lora_adapter"
        assert httpx.post(url, json={"lora_name": "sql"}).status_code == 401
        assert httpx.post(url, json={"lora_name": "sql"},
                          headers={"Authorization": f"Bearer {PUBLIC}"}).status_code == 200
    finally:
        gateway.stop()
        runner_server.stop(0)


def test_admin_service_is_closed_without_an_internal_token(tokenizer: Tokenizer,
                                                           block_service: ServiceProcess
                                                           ) -> None:
    runner_server = start_fake_runner(FakeRunner(num_blocks=64, block_size=4, epoch=73))
    config = GatewayConfig(block_service=block_service.address,
                           runners=[f"127.0.0.1:{runner_server.port}"])
    gateway = Gateway(config, ServerOptions(port=0, auth_tokens=(PUBLIC,)), tokenizer)
    try:
        gateway.start(timeout_s=30)
        assert gateway.service is not None
        with open_channel(f"127.0.0.1:{gateway.service.port}", None, PUBLIC) as channel:
            with pytest.raises(grpc.RpcError) as error:
                gateway_pb2_grpc.AdminServiceStub(channel).UnloadLoraAdapter(
                    gateway_pb2.UnloadLoraAdapterRequest(lora_name="x"))
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        gateway.stop()
        runner_server.stop(0)


def test_a_lora_module_that_does_not_load_fails_the_start(tokenizer: Tokenizer,
                                                          block_service: ServiceProcess,
                                                          tmp_path: Path) -> None:
    runner_server = start_fake_runner(FakeRunner(num_blocks=64, block_size=4, epoch=75,
                                                 max_loras=2))
    config = GatewayConfig(block_service=block_service.address,
                           runners=[f"127.0.0.1:{runner_server.port}"],
                           lora_modules=[("sql", str(tmp_path / "nothing-here"))])
    gateway = Gateway(config, ServerOptions(port=0), tokenizer)
    try:
        with pytest.raises(StartError, match=r"--lora-modules sql=.*nothing-here: NOT_FOUND"):
            gateway.start(timeout_s=30)
    finally:
        gateway.stop()
        runner_server.stop(0)
