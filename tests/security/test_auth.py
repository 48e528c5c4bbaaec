"""Bearer tokens at the service level: the public token on the gateway, and a separate
internal token that only gateways hold for the block service and the runner."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from common.security import open_channel
from gateway.client import PagewireClient
from protos import block_pb2, block_pb2_grpc, runner_pb2, runner_pb2_grpc
from tests.security.conftest import ProcessStack

PUBLIC_TOKEN = "public-client-token"
INTERNAL_TOKEN = "internal-gateway-token"


@pytest.fixture(scope="module")
def stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProcessStack]:
    folder = tmp_path_factory.mktemp("auth")
    public = folder / "public.txt"
    public.write_text(f"{PUBLIC_TOKEN}\nsecond-client-token\n")
    internal = folder / "internal.txt"
    internal.write_text(INTERNAL_TOKEN + "\n")
    internal_flags = ["--auth-token-file", str(internal)]
    s = ProcessStack(tiny_model, folder, block_flags=internal_flags,
                     runner_flags=internal_flags,
                     gateway_flags=["--auth-token-file", str(public),
                                    "--backend-auth-token-file", str(internal)]).start()
    yield s
    s.stop()


def refusal(call: Callable[[], object]) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as error:
        call()
    return error.value.code()


@pytest.mark.parametrize("token", [None, "wrong-token", INTERNAL_TOKEN])
def test_gateway_refuses_a_client_without_the_public_token(stack: ProcessStack,
                                                           token: str | None) -> None:
    with PagewireClient(stack.gateway.address, token=token) as client:
        assert refusal(client.model_info) == grpc.StatusCode.UNAUTHENTICATED
        assert refusal(lambda: client.tokenize(prompt="hi")) == grpc.StatusCode.UNAUTHENTICATED
        assert refusal(lambda: client.complete(token_ids=[5, 6], max_tokens=2)) == \
            grpc.StatusCode.UNAUTHENTICATED


def test_gateway_logs_a_refused_token(stack: ProcessStack) -> None:
    """A call refused for its token leaves a line in the gateway's log (gateway/refusals.py)."""
    with PagewireClient(stack.gateway.address, token="a-guess") as client:
        assert refusal(client.model_info) == grpc.StatusCode.UNAUTHENTICATED
    assert stack.gateway.log_path is not None
    deadline = time.monotonic() + 10
    wanted = "refused grpc request from ipv"
    while not any(wanted in line and "UNAUTHENTICATED unauthorized: missing or invalid bearer "
                  "token" in line for line in stack.gateway.log_path.read_text().splitlines()):
        assert time.monotonic() < deadline, stack.gateway.log()
        time.sleep(0.05)


def test_gateway_serves_a_client_with_the_token(stack: ProcessStack) -> None:
    """...and it reaches its backends with the internal token, which the client never sees."""
    with PagewireClient(stack.gateway.address, token=PUBLIC_TOKEN) as client:
        result = client.complete(token_ids=[5, 6, 7], max_tokens=4, temperature=0)
        assert len(result.token_ids[0]) == 4
        assert client.model_info().architecture == "LlamaForCausalLM"


@pytest.mark.parametrize("token", [None, PUBLIC_TOKEN])
def test_block_service_refuses_a_non_gateway_client(stack: ProcessStack,
                                                    token: str | None) -> None:
    with open_channel(stack.blocks.address, None, token) as channel:
        stub = block_pb2_grpc.BlockServiceStub(channel)
        assert refusal(lambda: stub.GetStats(block_pb2.GetStatsRequest(pool_id="x"))) == \
            grpc.StatusCode.UNAUTHENTICATED
        assert refusal(lambda: stub.OpenSession(block_pb2.OpenSessionRequest())) == \
            grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("token", [None, PUBLIC_TOKEN])
def test_runner_refuses_a_non_gateway_client(stack: ProcessStack, token: str | None) -> None:
    with open_channel(stack.runner.address, None, token) as channel:
        stub = runner_pb2_grpc.RunnerServiceStub(channel)
        assert refusal(lambda: stub.Info(runner_pb2.InfoRequest())) == \
            grpc.StatusCode.UNAUTHENTICATED
        assert refusal(lambda: stub.Execute(runner_pb2.ExecuteRequest())) == \
            grpc.StatusCode.UNAUTHENTICATED


def test_internal_token_opens_the_backends(stack: ProcessStack) -> None:
    """The refusals above are about the credential, not a broken service."""
    with open_channel(stack.runner.address, None, INTERNAL_TOKEN) as channel:
        info = runner_pb2_grpc.RunnerServiceStub(channel).Info(runner_pb2.InfoRequest())
    assert info.architecture == "LlamaForCausalLM"
