"""`pagewire serve` supervision: the launcher restarts a service that dies (on the same port,
the block service from its journal), logs why it died, and requests work again."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from gateway.client import PagewireClient
from gateway.launcher import (
    SERVICES_NICE,
    Backoff,
    Child,
    LaunchConfig,
    Launcher,
    exit_reason,
    is_serving,
)
from protos import block_pb2, block_pb2_grpc
from tests.faults.conftest import BLOCK_SIZE, KV_BYTES_PER_TOKEN, MAX_MODEL_LEN, record_timing
from tests.helpers.services import free_port


@pytest.mark.timeout(10)
def test_exit_reason_names_signals_and_codes() -> None:
    assert exit_reason(-9) == "signal SIGKILL"
    assert exit_reason(-15) == "signal SIGTERM"
    assert exit_reason(3) == "exit code 3"


@pytest.mark.timeout(10)
def test_backoff_doubles_while_dying_fast_and_resets_after_a_stable_run() -> None:
    backoff = Backoff(first_s=0.5, max_s=4.0, stable_after_s=60.0)
    assert [backoff.delay_after(1.0) for _ in range(5)] == [0.5, 1.0, 2.0, 4.0, 4.0]
    assert backoff.delay_after(61.0) == 0.5


@pytest.fixture
def launcher(tmp_path: Path, tiny_qwen3: Path) -> Iterator[Launcher]:
    running = Launcher(LaunchConfig(
        model=str(tiny_qwen3), port=free_port(), block_size=BLOCK_SIZE,
        kv_cache_memory=256 * BLOCK_SIZE * KV_BYTES_PER_TOKEN, max_model_len=MAX_MODEL_LEN,
        runner_args=["--num-threads", "1"], log_dir=tmp_path / "logs", startup_timeout_s=120))
    supervisor: threading.Thread | None = None
    try:
        running.start()
        supervisor = threading.Thread(target=running.supervise, daemon=True)
        supervisor.start()
        yield running
    finally:
        running.request_stop()
        if supervisor is not None:
            supervisor.join(10)
        running.stop()


def child(launcher: Launcher, name: str) -> Child:
    return next(c for c in launcher.children if c.name == name)


def complete_when_back(client: PagewireClient, prompt: list[int]) -> list[int]:
    """Greedy tokens of `prompt`, retrying UNAVAILABLE (the gateway refuses new requests
    until it has seen the restarted backend) as a client should."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return client.complete(token_ids=prompt, max_tokens=8, temperature=0,
                                   ignore_eos=True, timeout=60).token_ids[0]
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def idle_used_blocks(launcher: Launcher, timeout_s: float = 10.0) -> int:
    """The pool's referenced blocks once the gateway has sent its last frees."""
    pool_id = child(launcher, "gpu_runner").address  # the gateway's default pool name
    with grpc.insecure_channel(child(launcher, "block_service").address) as channel:
        stub = block_pb2_grpc.BlockServiceStub(channel)
        deadline = time.monotonic() + timeout_s
        while True:
            used = stub.GetStats(block_pb2.GetStatsRequest(pool_id=pool_id),
                                 timeout=5).stats.used_blocks
            if used == 0 or time.monotonic() > deadline:
                return int(used)
            time.sleep(0.05)


def kill_and_wait_restarted(launcher: Launcher, name: str) -> float:
    """SIGKILLs a child, waits until the launcher has it serving again; returns how long."""
    target = child(launcher, name)
    assert target.process is not None
    killed_at = time.monotonic()
    target.process.kill()
    deadline = killed_at + 60
    while target.restarts == 0 or not is_serving(target.address):
        assert time.monotonic() < deadline, f"{name} was not restarted"
        time.sleep(0.05)
    # The gateway turns NOT_SERVING while a backend is down, SERVING once it is back.
    while not is_serving(launcher.gateway_address):
        assert time.monotonic() < deadline, "the gateway did not turn SERVING again"
        time.sleep(0.05)
    return time.monotonic() - killed_at


@pytest.mark.timeout(150)
def test_launcher_restarts_killed_services_and_serving_goes_on(
        launcher: Launcher, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pagewire")
    prompt = [100, 200, 300, 400, 500]
    with PagewireClient(launcher.gateway_address) as client:
        before = complete_when_back(client, prompt)
        assert len(before) == 8
        timings = {}
        for name in ("gpu_runner", "block_service"):
            timings[f"{name}_back_s"] = round(kill_and_wait_restarted(launcher, name), 3)
            again = complete_when_back(client, prompt)
            assert again == before  # same greedy tokens after the restart
    assert idle_used_blocks(launcher) == 0
    text = caplog.text
    assert "gpu_runner died (signal SIGKILL)" in text
    assert "block_service died (signal SIGKILL)" in text
    assert "--journal-dir" in " ".join(child(launcher, "block_service").command)
    record_timing("launcher_restart", **timings)


def test_the_gateway_and_block_service_give_way_to_the_runner(launcher: Launcher) -> None:
    """They run at LaunchConfig.services_nice (all their threads), the runner at 0."""
    def nice_of_every_thread(name: str) -> set[int]:
        pid = child(launcher, name).process.pid  # type: ignore[union-attr]
        return {os.getpriority(os.PRIO_PROCESS, int(tid))
                for tid in os.listdir(f"/proc/{pid}/task")}

    assert nice_of_every_thread("gateway") == {SERVICES_NICE}
    assert nice_of_every_thread("block_service") == {SERVICES_NICE}
    assert nice_of_every_thread("gpu_runner") == {0}


@pytest.mark.timeout(180)
def test_serve_starts_many_runners_and_gateways(tmp_path: Path, tiny_qwen3: Path) -> None:
    """`pagewire serve --runners 2 --gateways 2`: both runners register, each gateway serves
    both, and the same greedy prompt gives the same tokens through either gateway."""
    config = LaunchConfig(
        model=str(tiny_qwen3), port=free_port(), block_size=BLOCK_SIZE,
        kv_cache_memory=256 * BLOCK_SIZE * KV_BYTES_PER_TOKEN, max_model_len=MAX_MODEL_LEN,
        runners=2, gateways=2, routing="round-robin", runner_args=["--linear-backend", "plain"],
        log_dir=tmp_path / "logs", startup_timeout_s=120)
    launcher = Launcher(config)
    try:
        launcher.start()
        names = sorted(c.name for c in launcher.children)
        assert names == ["block_service", "gateway-0", "gateway-1", "gpu_runner-0",
                         "gpu_runner-1"]
        runners = [c for c in launcher.children if c.name.startswith("gpu_runner")]
        # Two runners share the cores: a thread team each.
        threads = str(max(1, (os.cpu_count() or 1) // 2))
        assert all(c.command[c.command.index("--num-threads") + 1] == threads for c in runners)
        with grpc.insecure_channel(child(launcher, "block_service").address) as channel:
            stub = block_pb2_grpc.BlockServiceStub(channel)
            deadline = time.monotonic() + 10
            while len(stub.ListRunners(block_pb2.ListRunnersRequest()).runners) < 2:
                assert time.monotonic() < deadline, "the runners did not register"
                time.sleep(0.1)
            prompt = [500 + i for i in range(20)]
            outputs = []
            for address in launcher.gateway_addresses:
                with PagewireClient(address) as client:
                    # Round-robin: four requests through each gateway reach both runners.
                    outputs += [complete_when_back(client, prompt) for _ in range(4)]
            assert all(tokens == outputs[0] for tokens in outputs)
            used = [stub.GetStats(block_pb2.GetStatsRequest(pool_id=c.address)).stats
                    for c in runners]
            assert all(stats.prompt_tokens > 0 for stats in used)
    finally:
        launcher.request_stop()
        launcher.stop()
