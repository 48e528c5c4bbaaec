"""bench/timing.py's load generator (one asyncio loop, a stream per request) against a real
gateway and block service with the checking fake runner."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bench.timing import run_workload
from bench.workloads import BenchRequest
from gateway.tokenizer import Tokenizer
from tests.gateway.stack import Stack
from tests.helpers.services import ServiceProcess


@pytest.fixture(scope="module")
def stack(tokenizer: Tokenizer, block_service: ServiceProcess) -> Iterator[Stack]:
    s = Stack(tokenizer, block_service, num_blocks=128, epoch=21)
    yield s
    s.close()


class Progress:
    def __init__(self) -> None:
        self.done = 0

    def update(self, count: int) -> None:
        self.done += count


def test_every_request_is_timed_and_streams_all_its_tokens(stack: Stack) -> None:
    requests = [BenchRequest([300 + i, 301 + i, 302 + i], max_tokens=4 + i,
                             arrival_s=0.1 * i) for i in range(4)]
    progress = Progress()
    summary = run_workload(f"127.0.0.1:{stack.gateway.service.port}", requests, progress)
    assert summary.errors == 0 and progress.done == 4
    assert [t.output_tokens for t in summary.timings] == [4, 5, 6, 7]
    assert [t.messages for t in summary.timings] == [4, 5, 6, 7]  # a message per token
    assert summary.output_tokens == 22
    for request, timing in zip(requests, summary.timings, strict=True):
        # Sent at its arrival time (not all at once), first token before the end.
        assert timing.sent - summary.timings[0].sent >= request.arrival_s - 0.01
        assert 0 < timing.ttft <= timing.latency
    assert summary.seconds >= 0.3


def test_a_failing_request_is_reported_not_raised(stack: Stack) -> None:
    requests = [BenchRequest([], max_tokens=3)]  # no prompt: INVALID_ARGUMENT
    summary = run_workload(f"127.0.0.1:{stack.gateway.service.port}", requests)
    assert summary.errors == 1 and "INVALID_ARGUMENT" in summary.timings[0].error


def test_a_final_only_request_counts_its_tokens_from_one_message(stack: Stack) -> None:
    requests = [BenchRequest([400, 401], max_tokens=6, final_only=True)]
    summary = run_workload(f"127.0.0.1:{stack.gateway.service.port}", requests)
    timing = summary.timings[0]
    assert summary.errors == 0 and timing.output_tokens == 6 and timing.messages == 1


def test_a_stream_past_its_deadline_is_an_error_not_a_hang(stack: Stack) -> None:
    requests = [BenchRequest([500, 501], max_tokens=8)]
    summary = run_workload(f"127.0.0.1:{stack.gateway.service.port}", requests,
                           timeout_s=1e-6)
    assert summary.errors == 1 and "DEADLINE_EXCEEDED" in summary.timings[0].error
