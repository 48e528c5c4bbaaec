"""The three services as real processes, and the transformers oracle, for end-to-end tests."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from gateway.client import PagewireClient
from protos import block_pb2, block_pb2_grpc, runner_pb2, runner_pb2_grpc
from tests.helpers.services import GatewayProcess, ServiceProcess, free_port

BLOCK_SIZE = 16
MAX_MODEL_LEN = 512
# SmolLM2-135M in float32: 30 layers x (K, V) x 3 KV heads x 64 dims x 4 bytes per token.
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4


def kv_bytes_for_blocks(num_blocks: int) -> int:
    return num_blocks * BLOCK_SIZE * KV_BYTES_PER_TOKEN


@dataclass
class Backend:
    """A runner and the pool it has in the shared block service."""

    runner: ServiceProcess
    blocks: block_pb2_grpc.BlockServiceStub

    @property
    def pool_id(self) -> str:
        return self.runner.address

    def stats(self) -> block_pb2.Stats:
        return self.blocks.GetStats(block_pb2.GetStatsRequest(pool_id=self.pool_id)).stats

    def info(self) -> runner_pb2.InfoResponse:
        with grpc.insecure_channel(self.runner.address) as channel:
            return runner_pb2_grpc.RunnerServiceStub(channel).Info(runner_pb2.InfoRequest())


class Services:
    """Starts processes in a log folder and stops them all at the end."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.processes: list[ServiceProcess] = []

    def start(self, module: str, *args: str, env: dict[str, str] | None = None
              ) -> ServiceProcess:
        """`python -m <module> <args>`, with `env` added to this process's environment."""
        process = ServiceProcess(module, list(args), env=env or {}).start(self.log_dir)
        self.processes.append(process)
        return process

    def runner(self, num_blocks: int, max_model_len: int = MAX_MODEL_LEN,
               *args: str) -> ServiceProcess:
        """A runner of the default model (`args`: more flags, e.g. --block-service)."""
        # The runner wants its pool to hold at least one max_model_len sequence.
        return self.start("gpu_runner", "--model", "default", "--block-size", str(BLOCK_SIZE),
                          "--kv-cache-memory", str(kv_bytes_for_blocks(num_blocks)),
                          "--max-model-len", str(max_model_len), *args)

    def gateway(self, block_service: ServiceProcess, runner: ServiceProcess | None,
                *args: str, wait: bool = True) -> GatewayProcess:
        """A gateway serving `runner`, or, when None, every runner registered with the block
        service (`wait=False`: started, not yet waited for; it waits for its runner itself)."""
        metrics_port = free_port()
        runner_flags = ["--runner", runner.address] if runner is not None else []
        process = self.start("gateway", "--block-service", block_service.address,
                             *runner_flags, "--model", "default",
                             "--metrics-port", str(metrics_port), *args)
        if wait:
            process.wait_serving(180)
        return GatewayProcess(process, metrics_port, PagewireClient(process.address))

    def stop(self) -> None:
        for process in reversed(self.processes):
            if process.process is not None:
                try:
                    process.terminate()
                except Exception:
                    process.kill()


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Services]:
    running = Services(Path(tmp_path_factory.mktemp("e2e_logs")))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def block_service(services: Services) -> ServiceProcess:
    return services.start("block_service").wait_serving(60)


@pytest.fixture(scope="module")
def block_stub(block_service: ServiceProcess) -> Iterator[block_pb2_grpc.BlockServiceStub]:
    with grpc.insecure_channel(block_service.address) as channel:
        yield block_pb2_grpc.BlockServiceStub(channel)
