"""Slow and lost calls.

- A Step held up longer than the gateway's deadline (an injected server-side delay) is retried
  with the same step id: the gateway gives up on its StepStream, resends the step as a unary
  Step (itself late, and retried), and the block service applies it once (the late original
  and the retries get one answer); the streams' outputs are unchanged.
- A backend that stays down turns the gateway's health to NOT_SERVING; new requests get
  UNAVAILABLE at once with a message naming the backend, running ones end with UNAVAILABLE
  after the backend-down timeout; health is SERVING again once the backend is back.
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from common.server import ServerOptions
from gateway.client import PagewireClient
from gateway.config import GatewayConfig
from gateway.retry import BACKEND_DOWN_TIMEOUT_ENV
from gateway.server import Gateway
from gateway.tokenizer import Tokenizer
from tests.faults.conftest import (
    LEASE_TTL_MS,
    MAX_TOKENS,
    Stack,
    StreamBatch,
    assert_all_exact,
    make_prompts,
    record_timing,
    run_streams,
    wait_for,
)
from tests.helpers.services import free_port, health_status

STEP_DELAY_MS = 2500
RPC_TIMEOUT_S = 1.5
# The first step (sent on the StepStream) and its first two resends (unary Steps) arrive late.
DELAYED_STEP_CALLS = 3
NUM_DELAYED_STREAMS = 8
STEP_METHOD = "/pagewire.block.v1.BlockService/Step"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
BACKEND_DOWN_TIMEOUT_S = 3.0


def gateway_metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return 0.0


@pytest.fixture
def slow_step_stack(tmp_path: Path, tiny_qwen3: Path, monkeypatch: pytest.MonkeyPatch
                    ) -> Iterator[Stack]:
    """A stack whose block service answers its first Step calls late."""
    monkeypatch.setenv("PAGEWIRE_INJECT_DELAY_MS", str(STEP_DELAY_MS))
    monkeypatch.setenv("PAGEWIRE_INJECT_DELAY_METHODS", "Step,StepStream")
    monkeypatch.setenv("PAGEWIRE_INJECT_DELAY_COUNT", str(DELAYED_STEP_CALLS))
    running = Stack(tmp_path, tiny_qwen3)
    for name in ("MS", "METHODS", "COUNT"):
        monkeypatch.delenv(f"PAGEWIRE_INJECT_DELAY_{name}")  # the runner and gateways: none
    try:
        yield running
    finally:
        running.close()


@pytest.mark.timeout(120)
def test_step_past_its_deadline_is_retried_and_applied_once(slow_step_stack: Stack) -> None:
    stack = slow_step_stack
    metrics_port = free_port()
    _, client = stack.gateway("--metrics-port", str(metrics_port),
                              env={"PAGEWIRE_GATEWAY_RPC_TIMEOUT_S": str(RPC_TIMEOUT_S)})
    prompts = make_prompts(NUM_DELAYED_STREAMS, seed=21)
    started = time.monotonic()
    # The first Step (every admission) is answered after the deadline, twice over.
    faulted = StreamBatch(client, prompts).join()
    faulted_s = time.monotonic() - started
    after_faulted = stack.wait_idle()
    step_calls = stack.block_metric("pagewire_rpc_total", method=STEP_METHOD)
    gateway_steps = gateway_metric(metrics_port, "pagewire_gateway_steps_total")
    # The delays are used up: the same prompts again give the fault-free reference.
    reference = run_streams(client, prompts)

    assert_all_exact(faulted, reference)
    assert all(len(r.tokens) == MAX_TOKENS for r in faulted)
    # The step was sent more than once: the stream's late one again as unary Steps, the first
    # of them late too and retried (every other step went over the stream) ...
    assert step_calls >= DELAYED_STEP_CALLS - 1
    assert gateway_steps > step_calls
    # ... and applied once: each prompt was allocated exactly once, and nothing is left.
    assert after_faulted.prompt_tokens == sum(len(p) for p in prompts)
    assert after_faulted.used_blocks == 0 and after_faulted.total_refs == 0
    assert after_faulted.num_sequences == 0
    record_timing("slow_step", step_delay_s=STEP_DELAY_MS / 1000, rpc_timeout_s=RPC_TIMEOUT_S,
                  step_calls=int(step_calls), gateway_steps=int(gateway_steps),
                  faulted_run_s=round(faulted_s, 3))


@pytest.fixture
def in_process_gateway(stack: Stack, tiny_qwen3: Path, monkeypatch: pytest.MonkeyPatch
                       ) -> Iterator[tuple[Gateway, PagewireClient]]:
    """A gateway in this process, its health wired to its engine's view of the backends."""
    monkeypatch.setenv(BACKEND_DOWN_TIMEOUT_ENV, str(BACKEND_DOWN_TIMEOUT_S))
    config = GatewayConfig(block_service=stack.block_service.address,
                           runners=[stack.runner.address], model=str(tiny_qwen3),
                           lease_ttl_ms=LEASE_TTL_MS)
    gateway = Gateway(config, ServerOptions(port=0, max_workers=32), Tokenizer(tiny_qwen3))
    service = gateway.start(timeout_s=60)
    gateway.engine.set_health_listener(service.set_serving)
    client = PagewireClient(f"127.0.0.1:{service.port}")
    try:
        yield gateway, client
    finally:
        client.close()
        gateway.stop()


@pytest.mark.timeout(120)
def test_backend_down_turns_health_not_serving_and_back(
        stack: Stack, in_process_gateway: tuple[Gateway, PagewireClient]) -> None:
    gateway, client = in_process_gateway
    assert gateway.service is not None
    address = f"127.0.0.1:{gateway.service.port}"
    assert health_status(address) == SERVING
    running = StreamBatch(client, make_prompts(1, seed=5), max_tokens=200)
    running.wait_until_each_has(2)

    killed_at = time.monotonic()
    stack.runner.kill()
    not_serving_at = wait_for(lambda: health_status(address) == NOT_SERVING, timeout_s=10)
    asked_at = time.monotonic()
    with pytest.raises(grpc.RpcError) as refused:
        client.complete(token_ids=[100, 101, 102], max_tokens=4, temperature=0, timeout=10)
    answered_s = time.monotonic() - asked_at
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "runner" in (refused.value.details() or "")
    # The running stream waits for the runner for the backend-down timeout, then fails.
    [record] = running.join(timeout_s=60)
    assert record.error == grpc.StatusCode.UNAVAILABLE, record.error

    stack.restart(stack.runner).wait_serving(120)
    restarted_at = time.monotonic()
    serving_at = wait_for(lambda: health_status(address) == SERVING, timeout_s=10)
    result = client.complete(token_ids=[100, 101, 102], max_tokens=4, temperature=0,
                             ignore_eos=True, timeout=60)
    assert len(result.token_ids[0]) == 4
    assert stack.wait_idle().used_blocks == 0
    record_timing("runner_down", not_serving_after_kill_s=round(not_serving_at - killed_at, 3),
                  refused_new_request_in_s=round(answered_s, 3),
                  running_stream_failed_after_kill_s=round(record.ended_at - killed_at, 3),
                  serving_after_restart_s=round(serving_at - restarted_at, 3))
