"""Fixtures of the gateway tests: the default tokenizer, a real block-service process, an
in-process fake runner and in-process gateways on free loopback ports."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from common.model_store import resolve_model
from common.server import GrpcService, ServerOptions, start_server
from gateway.config import GatewayConfig
from gateway.engine import Engine
from gateway.request import Request
from gateway.server import Gateway
from gateway.tokenizer import Tokenizer
from protos import runner_pb2, runner_pb2_grpc
from tests.gateway.fake_runner import FakeRunner
from tests.helpers.services import ServiceProcess

if TYPE_CHECKING:  # stack.py imports this module
    from tests.gateway.stack import Stack

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


class SubmitCounter:
    """Counts the requests the engine accepted: they passed validation and were queued for
    the scheduler (wraps the engine's submit, which the gRPC servicer and the HTTP API call
    once per request, after every check).
    A request submitted while a backend is down also returns normally, failed UNAVAILABLE,
    but that status fails the fuzz on its own."""

    def __init__(self, engine: Engine) -> None:
        self.count = 0
        self._lock = threading.Lock()  # submit runs on the server's worker threads
        self._submit = engine.submit

        def submit(request: Request) -> None:
            self._submit(request)  # raises when the queue is full: not counted
            with self._lock:
                self.count += 1
        self.submit = submit


@pytest.fixture(scope="module")
def submits(stack: Stack) -> Iterator[SubmitCounter]:
    """Counts the submits of the module's `stack` fixture."""
    engine = stack.gateway.engine
    counter = SubmitCounter(engine)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine, "submit", counter.submit)
        yield counter
