"""The foundation's promises: current generated code, a clean contract, well-behaved processes."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from protos import (
    block_pb2,
    block_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    runner_pb2,
    runner_pb2_grpc,
)
from tests.helpers.services import ROOT, ServiceProcess, health_status

PROTOS = ["block", "runner", "gateway"]
DELAY_MS = 1500


def test_generated_code_is_current(tmp_path: Path) -> None:
    """The committed *_pb2*.py(i) files are exactly what `make proto` would write."""
    (tmp_path / "protos").mkdir()
    for name in PROTOS:
        shutil.copy(ROOT / "protos" / f"{name}.proto", tmp_path / "protos")
    sources = [f"protos/{name}.proto" for name in PROTOS]
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I.", "--python_out=.", "--pyi_out=.",
         "--grpc_python_out=.", *sources],
        cwd=tmp_path, check=True,
    )
    for name in PROTOS:
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            generated = (tmp_path / "protos" / f"{name}{suffix}").read_text()
            committed = (ROOT / "protos" / f"{name}{suffix}").read_text()
            assert generated == committed, f"protos/{name}{suffix} is stale: run `make proto`"


def test_buf_lint_is_clean() -> None:
    buf = Path(sys.executable).with_name("buf")
    result = subprocess.run([str(buf), "lint"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def _listed_services(address: str) -> set[str]:
    with grpc.insecure_channel(address) as channel:
        return set(ProtoReflectionDescriptorDatabase(channel).get_services())


def _assert_graceful_stop(service: ServiceProcess, slow_call: Callable[[grpc.Channel], object]):
    """SIGTERM while `slow_call` (delayed by the fault interceptor) is in flight: the call
    completes and the process exits 0 within 5 s."""
    outcome: dict[str, object] = {}

    def call() -> None:
        with grpc.insecure_channel(service.address) as channel:
            try:
                outcome["reply"] = slow_call(channel)
            except grpc.RpcError as error:
                outcome["error"] = error

    caller = threading.Thread(target=call)
    caller.start()
    time.sleep(DELAY_MS / 3000)  # the call is now inside the server, sleeping
    started = time.monotonic()
    code = service.terminate(timeout_s=5.0)
    elapsed = time.monotonic() - started
    caller.join(5.0)
    assert code == 0, service.log()
    assert elapsed < 5.0
    assert "error" not in outcome, outcome.get("error")
    assert "reply" in outcome


def _delayed(methods: str) -> dict[str, str]:
    return {"PAGEWIRE_INJECT_DELAY_MS": str(DELAY_MS), "PAGEWIRE_INJECT_DELAY_METHODS": methods}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.helpers.tiny_models import make_tiny_model

    return make_tiny_model("qwen3", tmp_path_factory.mktemp("tiny") / "qwen3")


def _runner_args(model: Path) -> list[str]:
    return ["--model", str(model), "--block-size", "16", "--kv-cache-memory", str(8 << 20)]


def test_block_service_process(tmp_path: Path) -> None:
    service = ServiceProcess("block_service", env=_delayed("GetStats")).start(tmp_path)
    try:
        service.wait_serving(30)
        assert "pagewire.block.v1.BlockService" in _listed_services(service.address)
        with grpc.insecure_channel(service.address) as channel:
            stub = block_pb2_grpc.BlockServiceStub(channel)
            stub.CreatePool(block_pb2.CreatePoolRequest(
                pool_id="p", num_blocks=8, block_size=16, epoch=1))
        _assert_graceful_stop(
            service,
            lambda ch: block_pb2_grpc.BlockServiceStub(ch).GetStats(
                block_pb2.GetStatsRequest(pool_id="p"), timeout=10),
        )
    finally:
        service.kill()


def test_runner_process(tmp_path: Path, tiny_model: Path) -> None:
    service = ServiceProcess("gpu_runner", _runner_args(tiny_model), _delayed("Info"))
    service.start(tmp_path)
    try:
        service.wait_serving(120)
        assert "pagewire.runner.v1.RunnerService" in _listed_services(service.address)
        _assert_graceful_stop(
            service,
            lambda ch: runner_pb2_grpc.RunnerServiceStub(ch).Info(
                runner_pb2.InfoRequest(), timeout=10),
        )
    finally:
        service.kill()


def test_gateway_process(tmp_path: Path, tiny_model: Path) -> None:
    block = ServiceProcess("block_service").start(tmp_path)
    runner = ServiceProcess("gpu_runner", _runner_args(tiny_model)).start(tmp_path)
    gateway = None
    try:
        block.wait_serving(30)
        runner.wait_serving(120)
        gateway = ServiceProcess(
            "gateway",
            ["--block-service", block.address, "--runner", runner.address,
             "--model", str(tiny_model)],
            _delayed("GetModelInfo"),
        ).start(tmp_path)
        gateway.wait_serving(60)
        assert health_status(gateway.address) == health_pb2.HealthCheckResponse.SERVING
        assert "pagewire.gateway.v1.GenerationService" in _listed_services(gateway.address)
        _assert_graceful_stop(
            gateway,
            lambda ch: gateway_pb2_grpc.GenerationServiceStub(ch).GetModelInfo(
                gateway_pb2.GetModelInfoRequest(), timeout=10),
        )
    finally:
        for service in (gateway, runner, block):
            if service is not None:
                service.kill()
