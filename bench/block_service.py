"""Block service benchmark: a serving trace replayed in-process and a Step over loopback gRPC.

    .venv/bin/python bench/block_service.py [--quick]

Trace: 256 sequences; prompts of 100-1024 tokens, a quarter of them starting with the same
512-token system prompt; outputs of 100-1024 tokens. Each scheduling step the trace admits
waiting prompts (ALLOCATE, then a COMMIT of their computed prompt in the next step), appends
one token to every running sequence (APPEND with num_computed_tokens = length before it) and
frees the finished ones (FREE), as the gateway does. Reported for block sizes 16 and 256:
- core: decode appends per second through BlockServiceCore.step (the in-process hot path) over
  all pure decode steps (wall clock), for the median step, and by this thread's CPU time; and
  all operations per second over the whole trace;
- gRPC: p50 / p99 latency of one Step carrying 256 decode appends, client and server in two
  processes on loopback (the server is `python -m block_service`), as a unary Step and over a
  StepStream (the gateway's way: no per-call set-up), alternately; then N clients (threads of
  this process, each its own session and 256 sequences) stepping at once: their total appends
  per second and their p50, which shows the server's one lock and GIL at work; and the mean
  time the server spent in its Step handler (from its metrics port), which splits a call's
  latency into the service's own work and gRPC's on both ends.
On a shared machine the wall-clock figures drop with other load; the load average is printed.

    .venv/bin/python bench/block_service.py --journal [--quick] [--journal-root DIR]

The journaling cost instead (docs/block_service.md, "Crash recovery"): one Step of 256 decode
appends (block size 16) without a journal, with a journal (os.write to the page cache) and
with a journal and fdatasync per record; in-process (the core call) and over gRPC (p50, p99);
plus the record size, the replay rate at start, and the snapshot size and time for that state.
The journal directories are made under --journal-root (default: the system's temp directory;
use a directory on the disk the service would journal to, fsync costs depend on it).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.harness import block_service_process, free_port, percentile, scrape  # noqa: E402
from block_service.core import BlockServiceCore  # noqa: E402
from block_service.ops import OP_ALLOCATE, OP_APPEND, OP_COMMIT, OP_FREE  # noqa: E402
from gateway.step_stream import StepStreamClient  # noqa: E402

NUM_SEQUENCES = 256
SYSTEM_PROMPT_TOKENS = 512
VOCAB = 32000
MAX_BATCH = 256
ADMIT_PER_STEP = 32


@dataclass
class TraceSeq:
    """One request of the trace."""

    seq_id: int
    prompt: list[int]
    output_len: int
    generated: int = 0
    length: int = field(init=False)

    def __post_init__(self) -> None:
        self.length = len(self.prompt)


def make_trace(rng: random.Random) -> list[TraceSeq]:
    """256 requests; every fourth one starts with the shared system prompt."""
    system = [rng.randrange(VOCAB) for _ in range(SYSTEM_PROMPT_TOKENS)]
    trace = []
    for seq_id in range(NUM_SEQUENCES):
        length = rng.randint(100, 1024)
        if seq_id % 4 == 0:
            length = max(length, SYSTEM_PROMPT_TOKENS + 1)
            prompt = system + [rng.randrange(VOCAB) for _ in range(length - SYSTEM_PROMPT_TOKENS)]
        else:
            prompt = [rng.randrange(VOCAB) for _ in range(length)]
        trace.append(TraceSeq(seq_id, prompt, rng.randint(100, 1024)))
    return trace


@dataclass
class StepColumns:
    """A Step request being built, column by column."""

    kinds: list[int] = field(default_factory=list)
    seq_ids: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    computed: list[int] = field(default_factory=list)

    def add(self, kind: int, seq_id: int, tokens: list[int], computed: int) -> None:
        self.kinds.append(kind)
        self.seq_ids.append(seq_id)
        self.counts.append(len(tokens))
        self.tokens.extend(tokens)
        self.parents.append(0)
        self.computed.append(computed)


@dataclass
class CoreFigures:
    """What the in-process replay measured (wall clock, and this thread's CPU time, which a
    busy shared machine does not inflate)."""

    decode_appends: int
    decode_seconds: float
    decode_cpu_seconds: float
    decode_step_rates: list[float]  # appends/s of each pure decode step
    ops: int
    seconds: float
    cached_fraction: float


def replay_core(block_size: int, trace: list[TraceSeq], rng: random.Random) -> CoreFigures:
    """Replays the trace through BlockServiceCore.step, timing only the core calls."""
    core = BlockServiceCore()
    session, _ = core.open_session("bench")
    max_tokens = max(len(s.prompt) + s.output_len for s in trace)
    num_blocks = NUM_SEQUENCES * (-(-max_tokens // block_size) + 1)
    core.create_pool("bench", num_blocks, block_size, 1)
    waiting = list(trace)
    running: list[TraceSeq] = []
    just_admitted: list[TraceSeq] = []
    step_id = ops = decode_appends = 0
    seconds = decode_seconds = decode_cpu_seconds = 0.0
    step_rates: list[float] = []
    while waiting or running or just_admitted:
        step = StepColumns()
        for seq in just_admitted:  # their prompt is computed now
            step.add(OP_COMMIT, seq.seq_id, [], seq.length)
        running.extend(just_admitted)
        just_admitted = []
        still_running = []
        for seq in running:
            if seq.generated == seq.output_len:
                step.add(OP_FREE, seq.seq_id, [], seq.length)
                continue
            step.add(OP_APPEND, seq.seq_id, [rng.randrange(VOCAB)], seq.length)
            seq.length += 1
            seq.generated += 1
            still_running.append(seq)
        running = still_running
        decodes = len(running)
        while waiting and len(just_admitted) < ADMIT_PER_STEP and \
                len(running) + len(just_admitted) < MAX_BATCH:
            seq = waiting.pop(0)
            step.add(OP_ALLOCATE, seq.seq_id, seq.prompt, -1)
            just_admitted.append(seq)
        step_id += 1
        start, start_cpu = time.perf_counter(), time.thread_time()
        result = core.step(session, "bench", step_id, 1, step.kinds, step.seq_ids, step.counts,
                           step.tokens, step.parents, step.computed)
        elapsed, cpu = time.perf_counter() - start, time.thread_time() - start_cpu
        assert all(status == 1 for status in result.op_statuses), result.errors
        seconds += elapsed
        ops += len(step.kinds)
        if decodes == len(step.kinds):  # a pure decode step
            decode_seconds += elapsed
            decode_cpu_seconds += cpu
            decode_appends += decodes
            step_rates.append(decodes / elapsed)
    stats = core.stats("bench")
    return CoreFigures(decode_appends, decode_seconds, decode_cpu_seconds, step_rates, ops, seconds,
                       stats.cached_prompt_tokens / stats.prompt_tokens)


class DecodeClient:
    """One gateway-like client: a session, its sequences, and Steps of one decode token each."""

    def __init__(self, address: str, pool_id: str, prompts: dict[int, list[int]],
                 rng: random.Random) -> None:
        import grpc

        from protos import block_pb2, block_pb2_grpc

        self.pb = block_pb2
        self.channel = grpc.insecure_channel(address)
        self.stub = block_pb2_grpc.BlockServiceStub(self.channel)
        self.pool_id = pool_id
        self.rng = rng
        self.session = self.stub.OpenSession(block_pb2.OpenSessionRequest(
            client_name="bench", lease_ttl_ms=300_000)).session_id
        self.lengths = {}
        for seq_id, prompt in prompts.items():
            answer = self.stub.Allocate(block_pb2.AllocateRequest(
                session_id=self.session, pool_id=pool_id, seq_id=seq_id, token_ids=prompt))
            assert answer.allocated
            self.lengths[seq_id] = len(prompt)
        self.step_id = 0
        self.stream: StepStreamClient | None = None

    def step(self) -> float:
        """One Step appending a token to every sequence; returns its latency in seconds."""
        return self._timed(self.stub.Step)

    def stream_step(self) -> float:
        """The same over the client's StepStream (opened on first use), as the gateway sends
        it; returns its latency in seconds."""
        if self.stream is None:
            self.stream = StepStreamClient(self.stub, timeout_s=30.0)
        return self._timed(self.stream.step)

    def _timed(self, send: Callable[[Any], Any]) -> float:
        seq_ids = list(self.lengths)
        self.step_id += 1
        request = self.pb.StepRequest(
            session_id=self.session, pool_id=self.pool_id, step_id=self.step_id, epoch=1,
            op_kinds=[OP_APPEND] * len(seq_ids), seq_ids=seq_ids,
            token_counts=[1] * len(seq_ids),
            token_ids=[self.rng.randrange(VOCAB) for _ in seq_ids],
            parent_seq_ids=[0] * len(seq_ids),
            num_computed_tokens=[self.lengths[seq_id] for seq_id in seq_ids])
        start = time.perf_counter()
        answer = send(request)
        elapsed = time.perf_counter() - start
        assert len(answer.slot_mapping) == len(seq_ids)
        for seq_id in seq_ids:
            self.lengths[seq_id] += 1
        return elapsed

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
        self.channel.close()


def create_pool(address: str, pool_id: str, num_blocks: int, block_size: int) -> None:
    import grpc

    from protos import block_pb2, block_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        block_pb2_grpc.BlockServiceStub(channel).CreatePool(block_pb2.CreatePoolRequest(
            pool_id=pool_id, num_blocks=num_blocks, block_size=block_size, epoch=1))


def step_handler_totals(metrics_port: int) -> tuple[float, float]:
    """(seconds, calls) the server has spent in its Step handler, from its /metrics."""
    totals = {"sum": 0.0, "count": 0.0}
    for name, value in scrape(metrics_port, timeout_s=10).items():
        if name.startswith("pagewire_rpc_seconds_") and "BlockService/Step" in name:
            kind = name.split("{", 1)[0].rsplit("_", 1)[-1]
            if kind in totals:
                totals[kind] = value
    return totals["sum"], totals["count"]


@dataclass
class GrpcFigures:
    """Step latencies of one client, and the throughput of several at once."""

    latencies: list[float]
    stream_latencies: list[float]  # the same Steps over a StepStream, interleaved with them
    # Mean time inside the server's Step handler (request lists to response message, the
    # service's own metrics); the rest of a call's latency is gRPC on both ends.
    handler_mean: float
    concurrent_clients: int
    concurrent_appends_per_s: float
    concurrent_p50: float


def measure_grpc(block_size: int, trace: list[TraceSeq], num_steps: int, clients: int,
                 rng: random.Random) -> GrpcFigures:
    """One client's Step(256 appends) latencies, then `clients` clients stepping at once."""
    warm_steps = min(20, num_steps // 10)
    longest = max(len(s.prompt) for s in trace) + warm_steps + 2 * num_steps + 1
    per_client = NUM_SEQUENCES * (-(-longest // block_size) + 1)
    prompts = {seq.seq_id: seq.prompt for seq in trace}
    metrics_port = free_port()
    with block_service_process(("--metrics-port", str(metrics_port))) as address:
        create_pool(address, "bench", per_client * (1 + clients), block_size)
        single = DecodeClient(address, "bench", prompts, rng)
        for _ in range(warm_steps):
            single.step()  # the first Step publishes every prompt's blocks: not a decode step
        single.stream_step()  # opens the stream
        latencies, stream_latencies = [], []
        spent_before, calls_before = step_handler_totals(metrics_port)
        for _ in range(num_steps):  # alternately, so that both see the same machine
            latencies.append(single.step())
            stream_latencies.append(single.stream_step())
        spent_after, calls_after = step_handler_totals(metrics_port)
        single.close()
        group = [DecodeClient(address, "bench", {seq_id + 1000 * (c + 1): p
                                                 for seq_id, p in prompts.items()},
                              random.Random(c)) for c in range(clients)]
        steps_each = max(50, num_steps // clients)
        results: list[list[float]] = [[] for _ in group]
        threads = [threading.Thread(target=lambda c=c: results[c].extend(
            group[c].step() for _ in range(steps_each))) for c in range(clients)]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.perf_counter() - start
        for client in group:
            client.close()
    together = [t for r in results for t in r]
    handler_mean = (spent_after - spent_before) / max(1.0, calls_after - calls_before)
    return GrpcFigures(latencies, stream_latencies, handler_mean, clients,
                       clients * steps_each * NUM_SEQUENCES / elapsed,
                       percentile(together, 0.5))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a shorter run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clients", type=int, default=4, help="concurrent gRPC clients")
    parser.add_argument("--journal", action="store_true",
                        help="measure the cost of the crash-recovery journal instead")
    parser.add_argument("--journal-root", default=None,
                        help="where the journal directories are made (--journal)")
    args = parser.parse_args()
    if args.journal:
        return journal_main(args)
    num_steps = 300 if args.quick else 2000
    rows = []
    for block_size in (16, 256):
        rng = random.Random(args.seed)
        trace = make_trace(rng)
        if args.quick:
            for seq in trace:
                seq.output_len = min(seq.output_len, 200)
        core = replay_core(block_size, trace, rng)
        grpc_figures = measure_grpc(block_size, make_trace(random.Random(args.seed)),
                                    num_steps, args.clients, rng)
        rows.append((block_size, core, grpc_figures))
    print_table(rows)
    return 0


def print_table(rows: list[tuple[int, CoreFigures, GrpcFigures]]) -> None:
    print("core: BlockServiceCore.step in-process, serving trace; gRPC: Step of 256 decode "
          "appends, client and `python -m block_service` on loopback")
    print(f"{'block':>5} | {'decode appends/s':>16} | {'median step':>11} | {'CPU time':>9} | "
          f"{'trace ops/s':>11} | "
          f"{'prefix hit':>10} | {'Step p50':>8} | {'Step p99':>8} | {'in server':>9} | "
          f"{'stream p50':>10} | {'stream p99':>10} | "
          f"{'N clients appends/s':>19} | {'their p50':>9}")
    print("-" * 175)
    for block_size, core, grpc_figures in rows:
        latencies = grpc_figures.latencies
        print(f"{block_size:>5} | {core.decode_appends / core.decode_seconds:>16,.0f} | "
              f"{percentile(core.decode_step_rates, 0.5):>11,.0f} | "
              f"{core.decode_appends / core.decode_cpu_seconds:>9,.0f} | "
              f"{core.ops / core.seconds:>11,.0f} | {core.cached_fraction:>10.1%} | "
              f"{percentile(latencies, 0.5) * 1e3:>5.2f} ms | "
              f"{percentile(latencies, 0.99) * 1e3:>5.2f} ms | "
              f"{grpc_figures.handler_mean * 1e3:>6.2f} ms | "
              f"{percentile(grpc_figures.stream_latencies, 0.5) * 1e3:>7.2f} ms | "
              f"{percentile(grpc_figures.stream_latencies, 0.99) * 1e3:>7.2f} ms | "
              f"{grpc_figures.concurrent_appends_per_s:>10,.0f} "
              f"(N={grpc_figures.concurrent_clients}) | "
              f"{grpc_figures.concurrent_p50 * 1e3:>6.2f} ms")
    print("in server: mean time in the Step handler (the service's own metrics); the rest of "
          "a call is gRPC on both ends")
    print("stream: the same Steps over one StepStream (what the gateway sends), alternating "
          "with the unary ones")
    print("targets: core >= 500,000 decode appends/s; Step(256 appends) p50 <= 1 ms, "
          "p99 <= 3 ms")
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end "
          "(wall-clock figures shrink when other work shares the CPUs; CPU time does not)")


# ---- --journal: the cost of crash recovery ------------------------------------------------
JOURNAL_MODES = {"none": None, "journal": False, "journal+fsync": True}  # name -> fsync
JOURNAL_BLOCK_SIZE = 16
JOURNAL_MAX_PROMPT = 600


def journal_pool_blocks(num_steps: int) -> int:
    """Blocks for 256 sequences of up to JOURNAL_MAX_PROMPT + num_steps tokens."""
    return NUM_SEQUENCES * (-(-(JOURNAL_MAX_PROMPT + num_steps) // JOURNAL_BLOCK_SIZE) + 1)


@dataclass
class JournalFigures:
    """One journal mode: Step(256 appends) times in-process and over gRPC."""

    mode: str
    core_times: list[float]
    grpc_times: list[float]


class DecodeCore:
    """A core with 256 running sequences, journaling into `directory` unless None."""

    def __init__(self, directory: Path | None, fsync: bool, num_steps: int,
                 rng: random.Random) -> None:
        from block_service.journal import Journal, JournalPolicy

        self.core = BlockServiceCore()
        self.journal = None
        if directory is not None:
            # No snapshot during the timed steps: their cost is measured on its own.
            self.journal, _ = Journal.open(directory, JournalPolicy(fsync, 10**9, 1e9))
            self.core.attach_journal(self.journal)
        self.session, _ = self.core.open_session("bench")
        self.core.create_pool("bench", journal_pool_blocks(num_steps), JOURNAL_BLOCK_SIZE, 1)
        self.lengths = {}
        for seq_id in range(NUM_SEQUENCES):
            prompt = [rng.randrange(VOCAB)
                      for _ in range(rng.randrange(100, JOURNAL_MAX_PROMPT))]
            self.core.allocate(self.session, "bench", seq_id, prompt)
            self.lengths[seq_id] = len(prompt)
        self.rng = rng
        self.step_id = 0

    def step(self) -> float:
        """One Step appending a token to every sequence; returns the core call's seconds."""
        seq_ids = list(self.lengths)
        tokens = [self.rng.randrange(VOCAB) for _ in seq_ids]
        computed = [self.lengths[seq_id] for seq_id in seq_ids]
        self.step_id += 1
        start = time.perf_counter()
        result = self.core.step(self.session, "bench", self.step_id, 1,
                                [OP_APPEND] * len(seq_ids), seq_ids, [1] * len(seq_ids),
                                tokens, [0] * len(seq_ids), computed)
        elapsed = time.perf_counter() - start
        assert all(status == 1 for status in result.op_statuses), result.errors
        for seq_id in seq_ids:
            self.lengths[seq_id] += 1
        return elapsed

    def close(self) -> None:
        if self.journal is not None:
            self.journal.close()


def interleaved(steppers: list[Callable[[], float]], num_steps: int) -> list[list[float]]:
    """Each stepper's times, taking turns step by step (load from other work on the machine
    then hits every mode alike)."""
    times: list[list[float]] = [[] for _ in steppers]
    for _ in range(num_steps):
        for index, step in enumerate(steppers):
            times[index].append(step())
    warm = min(20, num_steps // 10)
    return [mode_times[warm:] for mode_times in times]


def recovery_figures(directory: Path) -> tuple[float, int, float, float, int]:
    """(records replayed per second, log bytes per record, replay seconds, snapshot seconds,
    snapshot bytes) for the journal left in `directory`."""
    from block_service.journal import Journal, log_name

    log_bytes = (directory / log_name(0)).stat().st_size
    start = time.perf_counter()
    journal, recovered = Journal.open(directory)
    core = BlockServiceCore()
    core.replay(recovered.state, recovered.records)
    replay_s = time.perf_counter() - start
    core.attach_journal(journal)
    start = time.perf_counter()
    core.snapshot_now()
    snapshot_s = time.perf_counter() - start
    journal.close()
    records = len(recovered.records)
    return (records / replay_s, log_bytes // records, replay_s, snapshot_s,
            (directory / "snapshot").stat().st_size)


def journal_main(args: argparse.Namespace) -> int:
    import tempfile

    num_steps = 300 if args.quick else 1500
    with tempfile.TemporaryDirectory(dir=args.journal_root) as name:
        root = Path(name)
        directories = {mode: None if fsync is None else root / f"core-{index}"
                       for index, (mode, fsync) in enumerate(JOURNAL_MODES.items())}
        cores = [DecodeCore(directories[mode], bool(fsync), num_steps, random.Random(args.seed))
                 for mode, fsync in JOURNAL_MODES.items()]
        core_times = interleaved([core.step for core in cores], num_steps)
        for core in cores:
            core.close()
        recovery = recovery_figures(directories["journal"])  # type: ignore[arg-type]
        with contextlib.ExitStack() as stack:
            clients = []
            for index, fsync in enumerate(JOURNAL_MODES.values()):
                extra = () if fsync is None else (
                    "--journal-dir", str(root / f"grpc-{index}"),
                    *(("--journal-fsync",) if fsync else ()))
                address = stack.enter_context(block_service_process(extra))
                clients.append(journal_client(address, num_steps, random.Random(args.seed)))
            grpc_times = interleaved([client.step for client in clients], num_steps)
            for client in clients:
                client.close()
    rows = [JournalFigures(mode, core_times[index], grpc_times[index])
            for index, mode in enumerate(JOURNAL_MODES)]
    print_journal_table(rows, recovery)
    return 0


def journal_client(address: str, num_steps: int, rng: random.Random) -> DecodeClient:
    """A client with 256 sequences on a fresh pool of the server at `address`."""
    prompts = {seq_id: [rng.randrange(VOCAB)
                        for _ in range(rng.randrange(100, JOURNAL_MAX_PROMPT))]
               for seq_id in range(NUM_SEQUENCES)}
    create_pool(address, "bench", journal_pool_blocks(num_steps), JOURNAL_BLOCK_SIZE)
    return DecodeClient(address, "bench", prompts, rng)


def print_journal_table(rows: list[JournalFigures],
                        recovery: tuple[float, int, float, float, int] | None) -> None:
    print(f"Step of {NUM_SEQUENCES} decode appends (block size {JOURNAL_BLOCK_SIZE}): "
          "in-process core call and gRPC round trip on loopback")
    print(f"{'mode':>14} | {'core p50':>9} | {'core p99':>9} | {'+ per Step':>10} | "
          f"{'gRPC p50':>9} | {'gRPC p99':>9} | {'+ per Step':>10}")
    print("-" * 88)
    base = rows[0]
    for row in rows:
        core_p50 = percentile(row.core_times, 0.5)
        grpc_p50 = percentile(row.grpc_times, 0.5)
        print(f"{row.mode:>14} | {core_p50 * 1e3:>6.3f} ms | "
              f"{percentile(row.core_times, 0.99) * 1e3:>6.3f} ms | "
              f"{(core_p50 - percentile(base.core_times, 0.5)) * 1e6:>7.0f} us | "
              f"{grpc_p50 * 1e3:>6.3f} ms | {percentile(row.grpc_times, 0.99) * 1e3:>6.3f} ms | "
              f"{(grpc_p50 - percentile(base.grpc_times, 0.5)) * 1e6:>7.0f} us")
    if recovery is not None:
        rate, record_bytes, replay_s, snapshot_s, snapshot_bytes = recovery
        print(f"record: {record_bytes:,} bytes per Step; replay at start: {rate:,.0f} Step "
              f"records/s ({replay_s:.2f} s for this log); snapshot of this state "
              f"({NUM_SEQUENCES} sequences): {snapshot_bytes / 1e6:.1f} MB in "
              f"{snapshot_s * 1e3:.0f} ms")
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    sys.exit(main())
