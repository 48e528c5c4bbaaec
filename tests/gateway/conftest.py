"""Fixtures of the gateway tests: the default tokenizer, a real block-service process, an
in-process fake runner and in-process gateways on free loopback ports."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from common.model_store import resolve_model
from common.server import GrpcService, ServerOptions, start_server
from gateway.config import GatewayConfig
from gateway.server import Gateway
from gateway.tokenizer import Tokenizer
from protos import runner_pb2, runner_pb2_grpc
from tests.gateway.fake_runner import FakeRunner
from tests.helpers.services import ServiceProcess

RUNNER_SERVICE = runner_pb2.DESCRIPTOR.services_by_name["RunnerService"].full_name


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return Tokenizer(resolve_model(None))


@pytest.fixture(scope="module")
def block_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    logs = tmp_path_factory.mktemp("block_service_logs")
    process = ServiceProcess("block_service").start(Path(logs)).wait_serving(60)
    yield process
    process.terminate()


def start_fake_runner(runner: FakeRunner) -> GrpcService:
    return start_server(
        ServerOptions(port=0),
        lambda server: runner_pb2_grpc.add_RunnerServiceServicer_to_server(runner, server),
        [RUNNER_SERVICE],
    )


def start_gateway(tokenizer: Tokenizer, block_address: str, runner_address: str | None,
                  **settings: object) -> Gateway:
    """A gateway serving one runner (None: every runner registered with the block service)."""
    runners = [runner_address] if runner_address else []
    config = GatewayConfig(block_service=block_address, runners=runners,
                           **settings)  # type: ignore[arg-type]
    gateway = Gateway(config, ServerOptions(port=0, max_workers=64), tokenizer)
    gateway.start(timeout_s=30)
    return gateway
