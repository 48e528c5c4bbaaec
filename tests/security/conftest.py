"""Fixtures of the service-level security tests: a tiny model and whole stacks of processes."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.security import ClientTls, open_channel
from tests.helpers.services import ServiceProcess
from tests.helpers.tiny_models import make_tiny_model

RUNNER_FLAGS = ["--kv-cache-memory", str(4 << 20), "--max-model-len", "256", "--block-size", "16"]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("security_model") / "llama")


def wait_serving(process: ServiceProcess, tls: ClientTls | None = None,
                 timeout_s: float = 120.0) -> ServiceProcess:
    """Waits for health SERVING over `tls` (health needs no token); fails with the log."""
    deadline = time.monotonic() + timeout_s
    with open_channel(process.address, tls) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            assert process.process is not None
            if process.process.poll() is not None:
                raise RuntimeError(f"{process.module} exited:\n{process.log()}")
            try:
                reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return process
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    raise TimeoutError(f"{process.module} not SERVING:\n{process.log()}")


@dataclass
class ProcessStack:
    """Block service, runner and gateway processes, started with the given flags."""

    model: Path
    logs: Path
    block_flags: list[str] = field(default_factory=list)
    runner_flags: list[str] = field(default_factory=list)
    gateway_flags: list[str] = field(default_factory=list)
    backend_tls: ClientTls | None = None  # how the test reaches the backends' health
    gateway_tls: ClientTls | None = None

    def start(self) -> ProcessStack:
        self.blocks = ServiceProcess("block_service", self.block_flags).start(self.logs)
        self.runner = ServiceProcess("gpu_runner", ["--model", str(self.model), *RUNNER_FLAGS,
                                                    *self.runner_flags]).start(self.logs)
        try:
            wait_serving(self.blocks, self.backend_tls)
            wait_serving(self.runner, self.backend_tls)
            self.gateway = ServiceProcess("gateway", [
                "--model", str(self.model), "--block-service", self.blocks.address,
                "--runner", self.runner.address, *self.gateway_flags]).start(self.logs)
            wait_serving(self.gateway, self.gateway_tls)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for name in ("gateway", "runner", "blocks"):
            process = getattr(self, name, None)
            if process is not None:
                process.kill()
