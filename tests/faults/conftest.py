"""Fault tests: the three services as real processes on a small random Qwen3, killed with
SIGKILL mid-generation and restarted on the same port.

Every test runs a fault-free reference through the same stack first, then the same 32 greedy
streams (ignore_eos, fixed max_tokens) with a fault in the middle, and compares token for
token. Recovery times are logged (logger `faults`) and appended as JSON lines to the file
named by PAGEWIRE_FAULT_TIMINGS when it is set (docs/reliability.md quotes them).
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from gateway.client import PagewireClient
from protos import block_pb2, block_pb2_grpc
from tests.helpers.services import GatewayProcess, ServiceProcess, free_port, scrape_metric
from tests.helpers.tiny_models import make_tiny_model

BLOCK_SIZE = 16
NUM_BLOCKS = 512
MAX_MODEL_LEN = 256
# The tiny Qwen3: 4 layers x (K, V) x 2 KV heads x 32 dims x 4 bytes (float32) per token.
KV_BYTES_PER_TOKEN = 4 * 2 * 2 * 32 * 4
LEASE_TTL_MS = 2000
# A Cluster's runners register under this lease: one gone this long loses its requests.
REGISTRATION_LEASE_MS = 1000
NUM_STREAMS = 32
MAX_TOKENS = 64
VOCAB_LOW, VOCAB_HIGH = 100, 40000  # prompt token ids: plain tokens, no special ones

TIMINGS_ENV = "PAGEWIRE_FAULT_TIMINGS"


def record_timing(test: str, **values: float | int | str) -> None:
    """Logs a measured recovery and appends it to $PAGEWIRE_FAULT_TIMINGS (JSON lines)."""
    line = json.dumps({"test": test, **values})
    print(f"[fault timing] {line}", flush=True)
    path = os.environ.get(TIMINGS_ENV)
    if path:
        with open(path, "a") as out:
            out.write(line + "\n")


def make_prompts(count: int = NUM_STREAMS, seed: int = 8) -> list[list[int]]:
    """`count` token-id prompts of 5 to 40 tokens (distinct, so no stream is another's
    prefix-cache twin by accident)."""
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(rng.randint(5, 40))]
            for _ in range(count)]


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("qwen3", Path(tmp_path_factory.mktemp("models")) / "qwen3")


@dataclass
class StreamRecord:
    """What one Generate stream delivered, and when."""

    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # time.monotonic() of each token
    finish: str = ""
    error: grpc.StatusCode | None = None
    error_message: str = ""
    ended_at: float = 0.0  # time.monotonic() when the stream ended (last message or error)

    def longest_gap(self, start: float, end: float) -> float:
        """The longest wait between two consecutive tokens that overlaps [start, end]: how
        long this stream stalled across a fault (killed at `start`, back at `end`)."""
        longest = 0.0
        for before, after in zip(self.times, self.times[1:], strict=False):
            if before <= end and after >= start:
                longest = max(longest, after - before)
        return longest


def consume(client: PagewireClient, prompt: Sequence[int], record: StreamRecord,
            max_tokens: int = MAX_TOKENS) -> StreamRecord:
    """Runs one greedy stream to its end, recording each token's arrival."""
    try:
        for message in client.generate(token_ids=prompt, max_tokens=max_tokens,
                                       temperature=0, ignore_eos=True, timeout=180):
            now = time.monotonic()
            for output in message.outputs:
                record.tokens.extend(output.token_ids)
                record.times.extend([now] * len(output.token_ids))
                if output.finish_reason:
                    record.finish = str(output.finish_reason)
    except grpc.RpcError as error:
        record.error = error.code()
        record.error_message = error.details() or ""
    finally:
        record.ended_at = time.monotonic()
    return record


class StreamBatch:
    """Streams running in threads, with their records visible while they run."""

    def __init__(self, client: PagewireClient, prompts: Sequence[Sequence[int]],
                 max_tokens: int = MAX_TOKENS) -> None:
        self.records = [StreamRecord() for _ in prompts]
        self._pool = ThreadPoolExecutor(len(prompts))
        self._futures = [self._pool.submit(consume, client, prompt, record, max_tokens)
                         for prompt, record in zip(prompts, self.records, strict=True)]

    def wait_until_each_has(self, num_tokens: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while min(len(r.tokens) for r in self.records) < num_tokens:
            failed = [r for r in self.records if r.error is not None]
            assert not failed, f"a stream failed before the fault: {failed[0].error_message}"
            assert time.monotonic() < deadline, "streams did not start in time"
            time.sleep(0.005)

    def join(self, timeout_s: float = 120.0) -> list[StreamRecord]:
        for future in self._futures:
            future.result(timeout=timeout_s)
        self._pool.shutdown()
        return self.records


def run_streams(client: PagewireClient, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    """Fault-free run: each stream's tokens (every stream must finish with max_tokens)."""
    records = StreamBatch(client, prompts).join()
    for record in records:
        assert record.error is None, record.error_message
        assert len(record.tokens) == MAX_TOKENS
    return [record.tokens for record in records]


class Stack:
    """Block service (journaled), runner and gateways as processes in one log folder."""

    def __init__(self, log_dir: Path, model: Path,
                 runner_flags: list[str] | None = None) -> None:
        """`runner_flags`: the runners' model and cache flags (default: runner_args, sized
        for the tiny models)."""
        self.log_dir = log_dir
        self.model = model
        self.runner_flags = runner_flags or runner_args(model)
        self.journal_dir = log_dir / "journal"
        self.processes: list[ServiceProcess] = []
        self.block_service = self._start(ServiceProcess("block_service", [
            "--journal-dir", str(self.journal_dir), "--reap-interval-s", "0.05",
            "--min-lease-ttl-s", "0.5", "--metrics-port", str(free_port())]))
        self.block_service.wait_serving(60)
        self.runner = self._start(ServiceProcess("gpu_runner", runner_args(model)))
        self.runner.wait_serving(120)
        self._block_channel = grpc.insecure_channel(self.block_service.address)
        self.blocks = block_pb2_grpc.BlockServiceStub(self._block_channel)
        self.clients: list[PagewireClient] = []
        self._restarts = 0

    def _start(self, process: ServiceProcess, log_dir: Path | None = None) -> ServiceProcess:
        process.start(log_dir or self.log_dir)
        self.processes.append(process)
        return process

    def gateway(self, *args: str, env: dict[str, str] | None = None
                ) -> tuple[ServiceProcess, PagewireClient]:
        process = self._start(ServiceProcess("gateway", [
            "--block-service", self.block_service.address, "--runner", self.runner.address,
            "--model", str(self.model), "--lease-ttl-ms", str(LEASE_TTL_MS), *args],
            env=env or {}))
        process.wait_serving(120)
        client = PagewireClient(process.address)
        self.clients.append(client)
        return process, client

    def restart(self, process: ServiceProcess) -> ServiceProcess:
        """The same service again on the same port (logs in a folder of their own)."""
        self._restarts += 1
        log_dir = self.log_dir / f"restart-{self._restarts}"
        log_dir.mkdir()
        again = ServiceProcess(process.module, process.args, process.env, port=process.port)
        self._start(again, log_dir)
        if process is self.block_service:
            self.block_service = again
        elif process is self.runner:
            self.runner = again
        return again

    @property
    def pool_id(self) -> str:
        return self.runner.address  # the gateways' default pool name

    def stats(self) -> block_pb2.Stats:
        return pool_stats(self.blocks, self.pool_id)

    def wait_idle(self, timeout_s: float = 10.0) -> block_pb2.Stats:
        """Stats once no block is referenced (the last frees ride on a gateway's next step)."""
        return wait_pool_idle(self.blocks, self.pool_id, timeout_s)

    def block_metric(self, name: str, **labels: str) -> float:
        """Sum of a metric's samples on the block service's /metrics (matching `labels`)."""
        port = self.block_service.args[self.block_service.args.index("--metrics-port") + 1]
        return scrape_metric(port, name, **labels)

    def close(self) -> None:
        for client in self.clients:
            client.close()
        self._block_channel.close()
        stop_all(self.processes)


def runner_args(model: Path) -> list[str]:
    """The flags of a runner of the tiny model (its pool: NUM_BLOCKS blocks of BLOCK_SIZE)."""
    return ["--model", str(model), "--block-size", str(BLOCK_SIZE),
            "--kv-cache-memory", str(NUM_BLOCKS * BLOCK_SIZE * KV_BYTES_PER_TOKEN),
            "--max-model-len", str(MAX_MODEL_LEN), "--num-threads", "1"]


def pool_stats(blocks: block_pb2_grpc.BlockServiceStub, pool_id: str) -> block_pb2.Stats:
    return blocks.GetStats(block_pb2.GetStatsRequest(pool_id=pool_id), timeout=5).stats


def wait_pool_idle(blocks: block_pb2_grpc.BlockServiceStub, pool_id: str,
                   timeout_s: float = 10.0) -> block_pb2.Stats:
    """A pool's stats once none of its blocks is referenced (or after `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = pool_stats(blocks, pool_id)
        if stats.used_blocks == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def stop_all(processes: Sequence[ServiceProcess]) -> None:
    """Stops every process still running, gateways first: their streams end before their
    backends go."""
    gateways_first = sorted(reversed(processes), key=lambda p: p.module != "gateway")
    for process in gateways_first:
        if process.process is not None and process.process.poll() is None:
            try:
                process.terminate(10)
            except Exception:
                process.kill()


class Cluster:
    """A block service, runners that register themselves with it (--block-service, a lease
    of REGISTRATION_LEASE_MS) and gateways that serve every registered runner (no --runner),
    as processes in one log folder. A runner's pool id is its address.

    The runners skip the GEMM tuning (--linear-backend plain): it costs ~14 s per start on
    two cores, and these tests are about where requests run, not how fast."""

    def __init__(self, log_dir: Path, model: Path,
                 runner_flags: list[str] | None = None) -> None:
        """`runner_flags`: the runners' model and cache flags (default: runner_args, sized
        for the tiny models)."""
        self.log_dir = log_dir
        self.model = model
        self.runner_flags = runner_flags or runner_args(model)
        self.processes: list[ServiceProcess] = []
        self.runners: list[ServiceProcess] = []
        self.gateways: list[GatewayProcess] = []
        self.block_service = self._start(ServiceProcess("block_service", [
            "--reap-interval-s", "0.05", "--min-lease-ttl-s", "0.5"]))
        self.block_service.wait_serving(60)
        self._block_channel = grpc.insecure_channel(self.block_service.address)
        self.blocks = block_pb2_grpc.BlockServiceStub(self._block_channel)

    def _start(self, process: ServiceProcess) -> ServiceProcess:
        process.start(self.log_dir)
        self.processes.append(process)
        return process

    def start_runner(self) -> ServiceProcess:
        """Starts a runner that registers itself (returns at once: wait_serving waits)."""
        runner = self._start(ServiceProcess("gpu_runner", [
            *self.runner_flags, "--linear-backend", "plain",
            "--block-service", self.block_service.address,
            "--registration-lease-ms", str(REGISTRATION_LEASE_MS)]))
        self.runners.append(runner)
        return runner

    def start_runners(self, count: int) -> list[ServiceProcess]:
        """`count` runners, serving and registered."""
        runners = [self.start_runner() for _ in range(count)]
        for runner in runners:
            runner.wait_serving(120)
        wait_for(lambda: {r.address for r in runners} <= self.live_runners(), 10)
        return runners

    def start_gateways(self, count: int, *args: str) -> list[GatewayProcess]:
        """`count` gateways serving every registered runner (`args`: more flags)."""
        started = []
        for _ in range(count):
            metrics_port = free_port()
            process = self._start(ServiceProcess("gateway", [
                "--block-service", self.block_service.address, "--model", str(self.model),
                "--lease-ttl-ms", str(LEASE_TTL_MS), "--metrics-port", str(metrics_port),
                *args]))
            started.append((process, metrics_port))
        gateways = []
        for process, metrics_port in started:
            process.wait_serving(120)
            gateways.append(GatewayProcess(process, metrics_port,
                                           PagewireClient(process.address)))
        self.gateways.extend(gateways)
        return gateways

    def live_runners(self) -> set[str]:
        """The addresses of the runners registered now (ListRunners)."""
        reply = self.blocks.ListRunners(block_pb2.ListRunnersRequest(), timeout=5)
        return {runner.pool.address for runner in reply.runners}

    def stats(self, runner: ServiceProcess) -> block_pb2.Stats:
        """The counters of a runner's pool."""
        return pool_stats(self.blocks, runner.address)

    def wait_idle(self, runner: ServiceProcess, timeout_s: float = 10.0) -> block_pb2.Stats:
        return wait_pool_idle(self.blocks, runner.address, timeout_s)

    def placed(self, runner: ServiceProcess) -> float:
        """Requests the gateways placed on `runner` (moved ones count again)."""
        return sum(g.metric("pagewire_gateway_placed_requests_total", runner=runner.address)
                   for g in self.gateways)

    def close(self) -> None:
        for gateway in self.gateways:
            gateway.client.close()
        self._block_channel.close()
        stop_all(self.processes)


@pytest.fixture
def stack(tmp_path: Path, tiny_qwen3: Path) -> Iterator[Stack]:
    running = Stack(tmp_path, tiny_qwen3)
    try:
        yield running
    finally:
        running.close()


@pytest.fixture
def cluster(tmp_path: Path, tiny_qwen3: Path) -> Iterator[Cluster]:
    """A Cluster with its block service only: the test starts runners and gateways."""
    running = Cluster(tmp_path, tiny_qwen3)
    try:
        yield running
    finally:
        running.close()


def assert_all_exact(records: Sequence[StreamRecord], reference: Sequence[list[int]]) -> None:
    """Every stream ended without error, with exactly the fault-free run's tokens."""
    for i, (record, expected) in enumerate(zip(records, reference, strict=True)):
        assert record.error is None, f"stream {i}: {record.error}: {record.error_message}"
        assert record.tokens == expected, f"stream {i} differs from the fault-free run"


def resumed_after(records: Sequence[StreamRecord], moment: float) -> float:
    """How long after `moment` the LAST stream got its first token (every stream has
    resumed by then); 0 for streams that had ended before."""
    waits = [min((t for t in r.times if t > moment), default=moment) - moment for r in records]
    return max(waits)


def wait_for(condition: object, timeout_s: float, poll_s: float = 0.02) -> float:
    """Polls `condition()` until true; returns when (time.monotonic()); fails on timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        if condition():  # type: ignore[operator]
            return time.monotonic()
        assert time.monotonic() < deadline, f"condition not met within {timeout_s} s"
        time.sleep(poll_s)
