"""Control-plane benchmark: the Steps per second one block service answers for many runner loops.

    .venv/bin/python bench/control_plane.py            # the full run (about 15 minutes)
    .venv/bin/python bench/control_plane.py --quick    # fewer points, shorter (about 4)

One `python -m block_service` process (a fresh one per measured point) and R runner loops
stepping against it, for each of the servers compared side by side (SERVERS: the threaded
server with the Python Step path, as the service ran before issue 32, and the grpc.aio server
with the compiled Step, the default now). A runner loop is what one gateway loop sends for its
runner's pool, with the runner simulated by the cost model of bench/sim_runner.py (no
RunnerService is called here: the block service is what is measured):
- set-up: CreatePool "sim-r<i>" (block size 16, epoch 1, room for 256 sequences of the longest
  output), OpenSession, a StepStream, 256 ALLOCATEs of 32-47-token random prompts in 4 Steps;
- then one Step per scheduling step over the stream, packed as gateway/step_builder.py packs
  them (frees, appends, allocates), with the gateway's pipelining (gateway/engine.py): Step N+1
  is sent while Execute N runs, so every decode APPEND carries the token sampled two steps
  back (filling its reserved position), reserves the next position (num_lookahead_slots 1),
  and says num_computed_tokens = the position it fills (what Execute N-1 finished). A decode
  batch is 256 APPENDs of one token each. Each sequence decodes 64-960 tokens (uniform), then
  the Step after its last APPEND FREEs it and ALLOCATEs a new one in its row (about one in two
  Steps has a FREE and an ALLOCATE and 255 APPENDs); its first APPEND only reserves;
- the Steps are recorded once through the service's own code in this process (Python path,
  every answer checked by the bench's rules: the step id, every status OK, one slot per APPEND
  at the offset its position has in its block, a new block exactly when a position starts one,
  whole tables and slots for ALLOCATEs, no block handed out twice) and replayed by every loop
  over its own session, pool and stream; every answer over gRPC must equal the recorded one
  byte for byte (bench/control_plane_load.py says why: planning in Python would cost the load
  generators more CPU than the service spends);
- timing as the gateway's loop: once Step N's answer is in, Execute N starts as soon as the
  simulated runner is free and lasts the cost model's time for its rows; the loop then waits
  for Execute N-1 to end and sends Step N+1. A loop thus steps every step time when the
  answers come back within it (the offered rate is R / step time), and its runner idles when
  they do not ("runner idle": the share of the window the simulated runner waited for Steps).
  Each loop starts at a random phase of its step time.

The loops run in --client-procs load-generator processes (spawned; asyncio and grpc.aio, one
channel each, the loops spread round-robin), a "gateway" each. Before each point the bench
waits (up to --settle-max-s) for the CPUs to be 95% idle, as serve_bench does (bench/w1.py);
every point then runs a warm-up and a measured window: a Step counts when its answer arrives
inside the window, and its latency is send -> answer on the client. Reported per point:
offered and achieved Steps/s, appends/s, latency p50 / p99 / max, runner idle, and the CPU
seconds the block service and the load generators used in the window (from /proc; they share
the machine's cores).

Points, per server: 1, 4, 16, 64 loops at the default cost model (a decode step of 256 rows in
8 ms); 16 and 64 loops offering 5,000 and 2,000 Steps/s in all, and at step time 0 (every loop
as fast as its answers come: saturation); each without a journal and with one (`--journal-dir`,
as `pagewire serve` runs the service) that snapshots every --snapshot-every-records records,
so that every window holds several snapshots (counted); then 16 loops of ONE sequence each at
step time 0: the service's cost per message, whatever it carries. Last, where a Step's CPU
goes inside the service (in-process, the same Steps, both Step paths): reading the request,
the operations and the answer's bytes, publishing filled blocks, and the rest.

Results: bench/results/control_plane.{json,md}; the table is printed as well. Any invalid
answer fails the bench (exit status 1) after the rest has run.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import random
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.control_plane_load import (  # noqa: E402
    BATCH,
    BLOCK_SIZE,
    BLOCKS_PER_SEQUENCE,
    client_main,
    record,
)
from bench.harness import (  # noqa: E402
    RESULTS,
    block_service_pid,
    block_service_process,
    fmt,
    git_state,
    machine_busy_s,
    percentile,
    run_header,
    save_results,
    service_counters,
)
from bench.sim_runner import CostModel  # noqa: E402
from bench.w1 import wait_until_quiet  # noqa: E402
from protos import block_pb2  # noqa: E402

P99_TARGET_S = 0.005
ROUTE_TARGET_US = 200.0
OK = block_pb2.OP_STATUS_OK
TARGET_STEPS_PER_S = 5000.0
SPARE_SERVER_THREADS = 8  # besides one per StepStream (block_service/servicer.py keeps 4)
# The servers compared side by side: `python -m block_service` arguments by name.
SERVERS = {
    "threads + Python": ("--server", "threads", "--step-path", "python"),
    "aio + compiled": ("--server", "aio", "--step-path", "compiled"),
}
RECORDING_MARGIN_S = 2.0  # recorded Steps beyond warm-up and window, per loop
# Recorded Steps are bounded by these rates (a loop that reaches the end of the recording
# stops and its point says "ran out"): one loop never steps faster (a round trip is over
# 0.25 ms here), and all loops together not faster than twice the target.
MAX_STEPS_PER_LOOP_S = 4000.0
MAX_STEPS_S = 2 * TARGET_STEPS_PER_S


# ---- one measured point ------------------------------------------------------------------
@dataclass(frozen=True)
class Point:
    """One configuration: loops, the simulated decode-step time, journal or not, and the
    sequences of each loop (1: the service's cost per message, whatever it carries)."""

    loops: int
    step_ms: float
    journal: bool
    batch: int = BATCH
    server: str = "aio + compiled"  # a name of SERVERS


class Recordings:
    """The recorded Steps (bench/control_plane_load.py) by batch, recorded again, longer,
    when a point needs more than the last recording holds; kept in files for the load
    generators."""

    def __init__(self, folder: Path, seed: int) -> None:
        self.folder = folder
        self.seed = seed
        self.steps: dict[int, int] = {}  # batch -> Steps recorded after the set-up
        self.record_s = 0.0

    def path_for(self, batch: int, num_steps: int) -> Path:
        path = self.folder / f"recording-{batch}.pickle"
        if self.steps.get(batch, -1) < num_steps:
            started = time.monotonic()
            record(batch, self.seed, num_steps).save(path)
            self.record_s += time.monotonic() - started
            self.steps[batch] = num_steps
        return path


def steps_needed(point: Point, warm_s: float, measure_s: float) -> int:
    """Recorded Steps (after the set-up) one loop of `point` may send at most."""
    rate = min(MAX_STEPS_PER_LOOP_S, MAX_STEPS_S / point.loops)
    if point.step_ms:
        rate = min(rate, 1e3 / point.step_ms)
    return int((warm_s + measure_s + RECORDING_MARGIN_S) * rate) + 1


def journal_generation(directory: str) -> int:
    """The newest journal generation in a journal directory (one more per snapshot taken)."""
    numbers = [int(path.stem.split("-")[1]) for path in Path(directory).glob("journal-*.log")]
    return max(numbers, default=0)


def run_point(point: Point, warm_s: float, measure_s: float, client_procs: int,
              recordings: Recordings, journal_root: str | None, settle_max_s: float,
              service_args: tuple[str, ...] = ()) -> dict[str, Any]:
    """Waits for a quiet machine (bench/w1.py's settle, up to settle_max_s), starts a block
    service, runs the loops of `point` against it, returns its figures."""
    recording = recordings.path_for(point.batch, steps_needed(point, warm_s, measure_s))
    settle_s = wait_until_quiet(settle_max_s) if settle_max_s > 0 else 0.0
    procs = max(1, min(client_procs, point.loops))
    server_args = ["--max-workers", str(point.loops + SPARE_SERVER_THREADS),
                   *SERVERS[point.server], *service_args]
    directory = ""
    with contextlib.ExitStack() as stack:
        if point.journal:
            directory = stack.enter_context(tempfile.TemporaryDirectory(dir=journal_root))
            server_args += ["--journal-dir", directory]
        address = stack.enter_context(block_service_process(tuple(server_args)))
        pid = block_service_pid()
        context = multiprocessing.get_context("spawn")
        pipes, children = [], []
        for proc in range(procs):
            parent_end, child_end = context.Pipe()
            child = context.Process(
                target=client_main, daemon=True,
                args=(child_end, address, list(range(proc, point.loops, procs)),
                      point.step_ms / 1e3, str(recording)))
            child.start()
            stack.callback(stop_child, child)
            pipes.append(parent_end)
            children.append(child)
        for pipe in pipes:
            kind, detail = receive(pipe, 120.0)
            if kind != "ready":
                raise RuntimeError(f"a load generator failed: {detail}")
        start_at = time.monotonic() + 0.2
        window = (start_at + warm_s, start_at + warm_s + measure_s)
        for pipe in pipes:
            pipe.send((start_at, window))
        time.sleep(max(0.0, window[0] - time.monotonic()))
        before = (*service_counters(pid), machine_busy_s(), time.process_time())
        generation = journal_generation(directory) if directory else 0
        time.sleep(max(0.0, window[1] - time.monotonic()))
        after = (*service_counters(pid), machine_busy_s(), time.process_time())
        if directory:
            generation = journal_generation(directory) - generation
        reports = [receive(pipe, 60.0 + measure_s)[1] for pipe in pipes]
    row = summarise(point, procs, measure_s, reports,
                    [b - a for a, b in zip(before, after, strict=True)])
    row["settle_s"] = settle_s
    row["snapshots"] = generation if point.journal else None
    return row


def receive(pipe: Connection, timeout_s: float) -> tuple[str, Any]:
    if not pipe.poll(timeout_s):
        raise RuntimeError(f"a load generator did not answer within {timeout_s:.0f} s")
    return pipe.recv()  # type: ignore[no-any-return]


def stop_child(child: multiprocessing.process.BaseProcess) -> None:
    child.join(timeout=10)
    if child.is_alive():
        child.terminate()
        child.join(timeout=5)


def summarise(point: Point, procs: int, measure_s: float, reports: list[dict[str, Any]],
              cpu: list[float]) -> dict[str, Any]:
    server_cpu_s, server_kernel_s, server_python_s, switches, machine_cpu_s, parent_cpu_s = cpu
    loops = [loop for report in reports for loop in report["loops"]]
    latencies = [t for loop in loops for t in loop["latencies"]]
    steps = len(latencies)
    clients_cpu_s = sum(report["cpu_s"] for report in reports)
    step_s = point.step_ms / 1e3
    busy = sum(loop["runner_busy_s"] for loop in loops)
    idle = sum(loop["runner_idle_s"] for loop in loops)
    errors = [error for loop in loops for error in loop["errors"]]
    return {
        "server": point.server,
        "loops": point.loops, "step_ms": point.step_ms, "journal": point.journal,
        "batch": point.batch, "ran_out": sum(loop["ran_out"] for loop in loops),
        "client_procs": procs, "measure_s": measure_s,
        "offered_steps_per_s": point.loops / step_s if step_s else None,
        "steps": steps, "steps_per_s": steps / measure_s,
        "appends_per_s": sum(loop["appends"] for loop in loops) / measure_s,
        "appends_per_step": sum(loop["appends"] for loop in loops) / max(steps, 1),
        "allocates": sum(loop["allocates"] for loop in loops),
        "frees": sum(loop["frees"] for loop in loops),
        "p50_ms": percentile(latencies, 0.5) * 1e3 if latencies else None,
        "p99_ms": percentile(latencies, 0.99) * 1e3 if latencies else None,
        "max_ms": max(latencies) * 1e3 if latencies else None,
        "runner_idle": idle / (idle + busy) if step_s and idle + busy else None,
        "answers_checked": sum(loop["checked"] for loop in loops),
        "bad_answers": len(errors), "errors": errors[:5],
        "server_cpu_s": server_cpu_s, "server_python_threads_cpu_s": server_python_s,
        "clients_cpu_s": clients_cpu_s,
        "machine_cpu_s": machine_cpu_s,
        "other_cpu_s": machine_cpu_s - server_cpu_s - clients_cpu_s - parent_cpu_s,
        "server_cpu_us_per_step": server_cpu_s / max(steps, 1) * 1e6,
        "server_python_us_per_step": server_python_s / max(steps, 1) * 1e6,
        "server_kernel_us_per_step": server_kernel_s / max(steps, 1) * 1e6,
        "server_switches_per_step": switches / max(steps, 1),
        "clients_cpu_us_per_step": clients_cpu_s / max(steps, 1) * 1e6,
    }


# ---- Route -----------------------------------------------------------------------------------
ROUTE_POOLS = 16
ROUTE_PROMPT_TOKENS = 1000
ROUTE_RUNNING = 256  # sequences running on every pool (their load is summed on each Route)


def route_point(server: str, num_routes: int, seed: int) -> dict[str, Any]:
    """The service's CPU per Route of a 1,000-token prompt over 16 registered pools, each
    running 256 sequences; half the pools hold a cached prefix of the prompt (100-1,000
    tokens), and each Route marks the chosen pool's prefix pending for the next (the
    binary-search case). Unary calls from one client thread, one after another."""
    import grpc

    from protos import block_pb2_grpc

    rng = random.Random(seed)
    prompt = [rng.randrange(32000) for _ in range(ROUTE_PROMPT_TOKENS)]
    with block_service_process(SERVERS[server]) as address, \
            grpc.insecure_channel(address) as channel:
        pid = block_service_pid()
        stub = block_pb2_grpc.BlockServiceStub(channel)
        session = stub.OpenSession(block_pb2.OpenSessionRequest(
            client_name="route bench", lease_ttl_ms=300_000)).session_id
        for index in range(ROUTE_POOLS):
            pool_id = f"r{index}"
            stub.RegisterRunner(block_pb2.RegisterRunnerRequest(
                pool_id=pool_id, address=f"127.0.0.1:{40000 + index}", num_blocks=20_000,
                block_size=BLOCK_SIZE, epoch=1, lease_ttl_ms=300_000))
            request = block_pb2.StepRequest(session_id=session, pool_id=pool_id,
                                            step_id=2 * index + 1, epoch=1)
            for seq in range(ROUTE_RUNNING):
                tokens = [rng.randrange(32000) for _ in range(rng.randrange(32, 600))]
                request.op_kinds.append(block_pb2.OP_KIND_ALLOCATE)
                request.seq_ids.append(index * 10_000 + seq)
                request.token_counts.append(len(tokens))
                request.token_ids.extend(tokens)
                request.parent_seq_ids.append(0)
                request.num_computed_tokens.append(-1)
            if index % 2 == 0:  # a cached prefix: computed, then freed (kept in the cache)
                held = rng.randrange(100, ROUTE_PROMPT_TOKENS)
                for kind, tokens, computed in ((block_pb2.OP_KIND_ALLOCATE, prompt[:held], -1),
                                               (block_pb2.OP_KIND_FREE, [], held)):
                    request.op_kinds.append(kind)
                    request.seq_ids.append(index * 10_000 + 9_999)
                    request.token_counts.append(len(tokens))
                    request.token_ids.extend(tokens)
                    request.parent_seq_ids.append(0)
                    request.num_computed_tokens.append(computed)
            answer = stub.Step(request)
            if any(status != OK for status in answer.op_statuses):
                raise RuntimeError(f"route bench set-up: {dict(answer.errors)}")
        route = block_pb2.RouteRequest(client_name="route bench", token_ids=prompt)
        for _ in range(50):
            stub.Route(route)
        before = service_counters(pid).cpu_s
        started = time.monotonic()
        for _ in range(num_routes):
            chosen = stub.Route(route)
        seconds = time.monotonic() - started
        cpu_s = service_counters(pid).cpu_s - before
    return {"server": server, "routes": num_routes, "pools": ROUTE_POOLS,
            "prompt_tokens": ROUTE_PROMPT_TOKENS, "running_per_pool": ROUTE_RUNNING,
            "cpu_us_per_route": cpu_s / num_routes * 1e6,
            "round_trip_us": seconds / num_routes * 1e6,
            "last_cached_tokens": max(c.num_cached_tokens for c in chosen.candidates)}


# ---- where a Step's CPU goes inside the service -------------------------------------------
PROFILE_PARTS = {
    "parse": "read the request (block_service/step_wire.py parse_step)",
    "operations": "the operations and the answer's bytes (C: _stepwire.run; Python: run_step "
                  "and step_response + SerializeToString), less publishing",
    "publish": "publishing the blocks decode fills (PoolManager.set_computed: hashes, "
               "prefix cache, KV events)",
    "rest": "the rest of BlockServiceCore.step_wire: checks, lock, session, journal record",
    "total": "in-process total",
}


def profile_steps(num_steps: int, journal_root: str | None, seed: int) -> dict[str, Any]:
    """The recorded Steps of one loop through BlockServiceCore.step_wire in this process, on
    the compiled and the Python path, without and with a journal; this thread's CPU time per
    part, mean microseconds per Step."""
    recording = record(BATCH, seed, num_steps + 200)
    figures: dict[str, Any] = {}
    for compiled in (True, False):
        for journal in (False, True):
            with tempfile.TemporaryDirectory(dir=journal_root) as directory:
                name = ("compiled" if compiled else "Python") + (", journal" if journal else "")
                figures[name] = _profile_one(recording, num_steps, compiled,
                                             directory if journal else None)
    return figures


def _profile_one(recording: Any, num_steps: int, compiled: bool, journal_dir: str | None,
                 warm_steps: int = 200) -> dict[str, Any]:
    from unittest import mock

    from bench.control_plane_load import header
    from block_service import core as core_module
    from block_service import step_wire
    from block_service.core import BlockServiceCore
    from block_service.journal import Journal, JournalPolicy
    from block_service.pool_manager import PoolManager

    core = BlockServiceCore(compiled_steps=compiled)
    journal = None
    if journal_dir is not None:  # no snapshot during the Steps
        journal, _ = Journal.open(journal_dir, JournalPolicy(False, 10**9, 1e9))
        core.attach_journal(journal)
    spent = dict.fromkeys(["parse", "operations", "publish", "total"], 0.0)

    def timed(part: str, work: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            started = time.thread_time()
            try:
                return work(*args, **kwargs)
            finally:
                spent[part] += time.thread_time() - started
        return run

    pool_id = "sim-r0"
    core.create_pool(pool_id, recording.batch * BLOCKS_PER_SEQUENCE, BLOCK_SIZE, 1)
    session_id, _ = core.open_session("profile", 300_000)
    prefix = header(session_id, pool_id)
    operations = core_module.compiled_step.run if compiled else core_module.run_step
    with mock.patch.object(core_module, "parse_step", timed("parse", step_wire.parse_step)), \
            mock.patch.object(PoolManager, "set_computed",
                              timed("publish", PoolManager.set_computed)), \
            mock.patch.object(core_module, "answer_bytes",
                              timed("operations", step_wire.answer_bytes)), \
            (mock.patch.object(core_module.compiled_step, "run", timed("operations", operations))
             if compiled else
             mock.patch.object(core_module, "run_step", timed("operations", operations))):
        for index, step in enumerate(recording.steps[:warm_steps + num_steps]):
            if index == warm_steps:
                spent.update(dict.fromkeys(spent, 0.0))
            started = time.thread_time()
            answer = core.step_wire(prefix + step.request)
            spent["total"] += time.thread_time() - started
            if answer != step.answer:
                raise RuntimeError(f"profile: step {index + 1} answered differently")
    if journal is not None:
        journal.close()
    spent["operations"] -= spent["publish"]  # set_computed runs inside the operations
    spent["rest"] = spent["total"] - spent["parse"] - spent["operations"] - spent["publish"]
    return {"steps": num_steps,
            "us_per_step": {part: spent[part] / num_steps * 1e6 for part in PROFILE_PARTS}}


# ---- results ---------------------------------------------------------------------------------
def points(args: argparse.Namespace, journals: list[bool]) -> list[Point]:
    """Per server: the base points, then per sweep loop count the offered rates (as step
    times) and the shorter step times (down to saturation); then the per-message floor."""
    chosen: list[Point] = []
    for server in args.servers:
        for count in args.loops:
            chosen += [Point(count, args.step_ms, journal, server=server)
                       for journal in journals]
        for count in args.sweep_loops:
            steps_ms = [round(count * 1e3 / rate, 3) for rate in args.sweep_offered]
            for ms in steps_ms + args.sweep_step_ms:
                chosen += [Point(count, ms, journal, server=server) for journal in journals]
        chosen += [Point(count, 0.0, False, batch=1, server=server)
                   for count in args.floor_loops]
    unique: list[Point] = []
    for point in chosen:
        if point not in unique:
            unique.append(point)
    return unique


def held(row: dict[str, Any]) -> bool:
    """Whether a point answered every Step validly, ran to its end, with p99 in the target."""
    return row["bad_answers"] == 0 and not row["ran_out"] and row["p99_ms"] is not None \
        and row["p99_ms"] <= P99_TARGET_S * 1e3


def best(rows: list[dict[str, Any]], server: str, journal: bool, min_loops: int = 1
         ) -> dict[str, Any] | None:
    candidates = [row for row in rows if row["server"] == server and row["journal"] == journal
                  and row["batch"] == BATCH and row["loops"] >= min_loops and held(row)]
    return max(candidates, key=lambda row: row["steps_per_s"], default=None)


def looped(count: int) -> str:
    return f"{count} loop" + ("" if count == 1 else "s")


def table(rows: list[dict[str, Any]]) -> list[str]:
    header = ["server", "loops", "batch", "step ms", "journal (snapshots)", "offered Steps/s",
              "Steps/s", "appends/s", "p50 ms", "p99 ms", "max ms", "p99 ≤ 5 ms",
              "runner idle", "service CPU µs/Step", "clients CPU µs/Step",
              "CPU s: service / clients / other", "checked (bad)"]
    lines = ["| " + " | ".join(header) + " |",
             "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---|---:|"]
    for row in rows:
        journal = "no" if not row["journal"] else f"yes ({row.get('snapshots', 0)})"
        cells = [
            row["server"], f"{row['loops']}", f"{row['batch']}", f"{row['step_ms']:g}",
            journal, fmt(row["offered_steps_per_s"], ",.0f"),
            f"{row['steps_per_s']:,.0f}", f"{row['appends_per_s']:,.0f}",
            fmt(row["p50_ms"], ".2f"), fmt(row["p99_ms"], ".2f"), fmt(row["max_ms"], ".1f"),
            ("yes" if held(row) else "NO") + (" (ran out)" if row["ran_out"] else ""),
            fmt(row["runner_idle"], ".1%"), f"{row['server_cpu_us_per_step']:,.0f}",
            f"{row['clients_cpu_us_per_step']:,.0f}",
            f"{row['server_cpu_s']:.1f} / {row['clients_cpu_s']:.1f} / "
            f"{max(row['other_cpu_s'], 0.0):.1f}",
            f"{row['answers_checked']:,} ({row['bad_answers']})"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def markdown(data: dict[str, Any]) -> str:
    rows = data["points"]
    cost = data["cost_model"]
    lines = [
        "# Control plane: Steps per second from one block service",
        "",
        f"`{data['command']}` — {data['measured_at']}, {data['cpus']} CPUs, load average "
        f"{data['load_average_before']:.2f} before the run, git {data['git']}; "
        f"{data['warm_s']:g} s warm-up and {data['measure_s']:g} s measured per point, "
        f"{data['seconds']:.0f} s in all ({data.get('record_s', 0.0):.0f} s of it recording)"
        + (f"; service arguments added: `{data['service_args']}`." if data.get("service_args")
           else "."),
        "",
        "What runs: `python -m block_service` (a fresh one per point; `--max-workers` loops + "
        f"{SPARE_SERVER_THREADS}), one of the servers compared ("
        + "; ".join(f"{name}: `{' '.join(args)}`" for name, args in SERVERS.items())
        + f"), and R runner loops in up to {data['client_procs']} spawned load-generator "
        "processes (asyncio + grpc.aio, one channel each), every loop a pool of its own with "
        f"{BATCH} sequences decoding over a StepStream as the gateway does. A decode Step is "
        "256 APPENDs of one token with a reserved next position; about one Step in two frees "
        "a finished sequence and allocates its successor instead of one APPEND. The loops "
        "replay one loop's Steps recorded through the service's code in-process (Python path, "
        "every answer checked by the bench's own rules: bench/control_plane_load.py), and "
        "every answer over gRPC must equal the recorded one byte for byte; Steps are counted "
        "on the client when their answer arrives in the window. Journal points snapshot every "
        f"{data.get('snapshot_every_records', 0):,} records: '(snapshots)' is how many began "
        "in the window, and 'max ms' the longest Step.",
        "",
        f"Cost model (bench/sim_runner.py `CostModel`, an assumption): Execute = "
        f"{cost['fixed_s'] * 1e3:g} ms + {cost['per_decode_row_s'] * 1e6:.1f} µs × decode rows "
        f"+ {cost['per_prefill_token_s'] * 1e6:g} µs × prefill tokens: a decode step of 256 "
        "rows in 8.0 ms (H200, 0.6B model, ~1k-token contexts), scaled to other step times. "
        "Offered rate = loops / step time; the loop sends Step N+1 once Execute N-1 has ended "
        "(one Execute in flight).",
        "",
        "CPU: the service's and the load generators' CPU seconds in the window (/proc); "
        "'other' is the rest of the machine's busy time then. The machine has "
        f"{data['cpus']} cores for all of it, so the rates are lower bounds for a service "
        "with cores of its own; the service's CPU per Step is what carries over.",
        "",
    ]
    lines += table(rows)
    lines += target_lines(rows)
    lines += route_lines(data.get("routes", []))
    lines += compared_lines(rows)
    profile = data.get("profile")
    if profile:
        lines += profile_markdown(profile)
    lines += runs_lines(data)
    return "\n".join(lines) + "\n"


def target_lines(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["", "## Against the target", "",
             f"≥ {TARGET_STEPS_PER_S:,.0f} Steps/s of 256 appends at p99 ≤ 5 ms from 16 and 64 "
             f"loops; ≤ {1e6 / TARGET_STEPS_PER_S:.0f} µs of service CPU per Step.", ""]
    for server in SERVERS:
        for journal in (False, True):
            name = f"{server}, {'with' if journal else 'without'} a journal"
            top = best(rows, server, journal, min_loops=16)
            saturated = [row for row in rows if row["server"] == server
                         and row["journal"] == journal and row["batch"] == BATCH
                         and row["step_ms"] == 0 and row["steps"]]
            cpu = min((row["server_cpu_us_per_step"] for row in saturated), default=None)
            if top is None:
                lines.append(f"- {name}: no point of 16 or more loops held p99 ≤ 5 ms.")
                continue
            lines.append(
                f"- {name}: {top['steps_per_s']:,.0f} Steps/s held at p99 "
                f"{top['p99_ms']:.2f} ms ({looped(top['loops'])} at {top['step_ms']:g} ms; "
                f"{top['steps_per_s'] / TARGET_STEPS_PER_S:.2f}× the target); service CPU per "
                f"Step at saturation {fmt(cpu, ',.0f')} µs, so one core of its own would "
                f"answer about {fmt(1e6 / cpu if cpu else None, ',.0f')} Steps/s.")
    return lines


def route_lines(routes: list[dict[str, Any]]) -> list[str]:
    if not routes:
        return []
    first = routes[0]
    lines = ["", "## Route", "",
             f"`Route` of a {first['prompt_tokens']:,}-token prompt over {first['pools']} "
             f"registered pools running {first['running_per_pool']} sequences each, half of "
             "them holding a cached prefix of it (route_point): the service's CPU per call "
             f"(target ≤ {ROUTE_TARGET_US:.0f} µs) and the client's round trip, "
             f"{first['routes']:,} calls one after another.", "",
             "| server | service CPU µs per Route | round trip µs |", "|---|---:|---:|"]
    lines += [f"| {row['server']} | {row['cpu_us_per_route']:,.0f} | "
              f"{row['round_trip_us']:,.0f} |" for row in routes]
    return lines


def compared_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The servers side by side at each point both ran."""
    names = list(SERVERS)
    pairs = []
    for row in rows:
        if row["server"] != names[0] or not row["steps"]:
            continue
        twin = [other for other in rows if other["server"] == names[1] and other["steps"]
                and all(other[key] == row[key] for key in ("loops", "step_ms", "batch",
                                                           "journal"))]
        if twin:
            pairs.append((row, twin[0]))
    if not pairs:
        return []
    lines = ["", f"## {names[1]} against {names[0]}", "",
             "| loops | batch | step ms | journal | Steps/s | ratio | p99 ms | service CPU "
             "µs/Step | ratio |", "|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for old, new in pairs:
        lines.append(
            f"| {old['loops']} | {old['batch']} | {old['step_ms']:g} | "
            f"{'yes' if old['journal'] else 'no'} | {old['steps_per_s']:,.0f} → "
            f"{new['steps_per_s']:,.0f} | {new['steps_per_s'] / old['steps_per_s']:.2f}× | "
            f"{fmt(old['p99_ms'], '.2f')} → {fmt(new['p99_ms'], '.2f')} | "
            f"{old['server_cpu_us_per_step']:,.0f} → {new['server_cpu_us_per_step']:,.0f} | "
            f"{old['server_cpu_us_per_step'] / new['server_cpu_us_per_step']:.2f}× less |")
    return lines


def profile_markdown(profile: dict[str, Any]) -> list[str]:
    modes = list(profile)
    lines = ["", "## Where a Step's CPU goes inside the service", "",
             f"The recorded Steps of one loop through BlockServiceCore.step_wire in-process, "
             f"this thread's CPU time, mean of {profile[modes[0]]['steps']:,} Steps after 200 "
             "warm-up ones (without and with a journal, no snapshot); µs per Step:", "",
             "| part | " + " | ".join(modes) + " |", "|---|" + "---:|" * len(modes)]
    for part, name in PROFILE_PARTS.items():
        lines.append(f"| {name} | " + " | ".join(
            f"{profile[mode]['us_per_step'][part]:.0f}" for mode in modes) + " |")
    return lines


def run_summary(data: dict[str, Any]) -> dict[str, Any]:
    """A run's headline figures, to compare runs."""
    rows = data["points"]
    summary: dict[str, Any] = {"measured_at": data["measured_at"], "servers": {}}
    for server in SERVERS:
        for journal in (False, True):
            top = best(rows, server, journal, min_loops=16)
            saturated = [row for row in rows if row["server"] == server
                         and row["journal"] == journal and row["batch"] == BATCH
                         and row["step_ms"] == 0 and row["steps"]]
            summary["servers"][f"{server}, journal {'yes' if journal else 'no'}"] = {
                "held_steps_per_s": top["steps_per_s"] if top else None,
                "held_at": f"{looped(top['loops'])} at {top['step_ms']:g} ms" if top else None,
                "saturation_cpu_us_per_step": min(
                    (row["server_cpu_us_per_step"] for row in saturated), default=None)}
    return summary


def runs_lines(data: dict[str, Any]) -> list[str]:
    """This run beside the earlier ones kept in its data (--previous)."""
    runs = [*data.get("previous_runs", []), run_summary(data)]
    runs = [run for run in runs if "servers" in run]  # runs of this bench's current form
    if len(runs) < 2:
        return []
    lines = ["", "## Runs compared", "",
             "| run | server, journal | held with p99 ≤ 5 ms (16+ loops) | service CPU "
             "µs/Step at saturation |", "|---|---|---:|---:|"]
    for run in runs:
        for name, figures in run["servers"].items():
            lines.append(f"| {run['measured_at']} | {name} | "
                         f"{fmt(figures['held_steps_per_s'], ',.0f')} ({figures['held_at']}) | "
                         f"{fmt(figures['saturation_cpu_us_per_step'], ',.0f')} |")
    return lines


def print_table(rows: list[dict[str, Any]]) -> None:
    print("\n".join(table(rows)))
    sys.stdout.flush()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])

    def numbers(kind: Callable[[str], Any]) -> Callable[[str], list[Any]]:
        return lambda text: [kind(part) for part in text.split(",") if part.strip()]

    def servers(text: str) -> list[str]:
        names = [name.strip() for name in text.split(",") if name.strip()]
        unknown = [name for name in names if name not in SERVERS]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown servers {unknown}: {list(SERVERS)}")
        return names

    parser.add_argument("--quick", action="store_true",
                        help="1 s warm-up, 3 s measured, loops 1 and 16, sweeps offering "
                             "5000 Steps/s and a step time of 0")
    parser.add_argument("--servers", type=servers, default=list(SERVERS),
                        help="which servers to measure, comma-separated: "
                             + ", ".join(SERVERS))
    parser.add_argument("--loops", type=numbers(int), default=None,
                        help="loop counts at --step-ms (default 1,4,16,64; --quick 1,16)")
    parser.add_argument("--step-ms", type=float, default=8.0,
                        help="the simulated decode step of 256 rows (cost model)")
    parser.add_argument("--sweep-loops", type=numbers(int), default=[16, 64])
    parser.add_argument("--sweep-offered", type=numbers(float), default=None,
                        help="Steps/s offered by the sweep loops in all, as step times "
                             "(default 5000,2000; --quick 5000)")
    parser.add_argument("--sweep-step-ms", type=numbers(float), default=[0.0],
                        help="more step times for the sweep loops (default 0: every loop as "
                             "fast as its answers come)")
    parser.add_argument("--floor-loops", type=numbers(int), default=[16],
                        help="also run this many loops of ONE sequence each, step time 0, "
                             "no journal: the service's cost per message (empty: none)")
    parser.add_argument("--journal", choices=["off", "on", "both"], default="both")
    parser.add_argument("--snapshot-every-records", type=int, default=2000,
                        help="the journal points' snapshot interval: small, so that a window "
                             "holds several snapshots")
    parser.add_argument("--warm-s", type=float, default=None, help="default 3 (--quick 1)")
    parser.add_argument("--measure-s", type=float, default=None,
                        help="default 10 (--quick 3)")
    parser.add_argument("--client-procs", type=int, default=2,
                        help="load-generator processes (at most one per loop)")
    parser.add_argument("--settle-max-s", type=float, default=20.0,
                        help="before each point, wait up to this long for the CPUs to be 95%% "
                             "idle (bench/w1.py; 0: no wait)")
    parser.add_argument("--service-args", default="",
                        help="more arguments for `python -m block_service`")
    parser.add_argument("--routes", type=int, default=2000,
                        help="Route calls measured per server (0: none)")
    parser.add_argument("--profile-steps", type=int, default=2000,
                        help="Steps of the in-process profile (0: none)")
    parser.add_argument("--journal-root", default=None,
                        help="where journal directories are made (default: the temp dir)")
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="folder of control_plane.{json,md}")
    parser.add_argument("--previous", type=Path, default=None,
                        help="the control_plane.json of an earlier run: its headline figures "
                             "are kept in this run's results and compared")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.loops is None:
        args.loops = [1, 16] if args.quick else [1, 4, 16, 64]
    if args.sweep_offered is None:
        args.sweep_offered = [5000.0] if args.quick else [5000.0, 2000.0]
    if args.warm_s is None:
        args.warm_s = 1.0 if args.quick else 3.0
    if args.measure_s is None:
        args.measure_s = 3.0 if args.quick else 10.0
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    journals = {"off": [False], "on": [True], "both": [False, True]}[args.journal]
    data: dict[str, Any] = {
        **run_header("bench/control_plane.py", argv),
        "cpus": os.cpu_count(), "load_average_before": os.getloadavg()[0],
        "git": git_state(), "warm_s": args.warm_s, "measure_s": args.measure_s,
        "client_procs": args.client_procs, "settle_max_s": args.settle_max_s,
        "service_args": args.service_args,
        "snapshot_every_records": args.snapshot_every_records,
        "cost_model": asdict(CostModel()),
        "target": {"steps_per_s": TARGET_STEPS_PER_S, "p99_ms": P99_TARGET_S * 1e3},
        "points": []}
    extra = tuple(shlex.split(args.service_args))
    with tempfile.TemporaryDirectory() as folder:
        recordings = Recordings(Path(folder), args.seed)
        for point in points(args, journals):
            service_args = extra + (("--snapshot-every-records",
                                     str(args.snapshot_every_records)) if point.journal else ())
            row = run_point(point, args.warm_s, args.measure_s, args.client_procs, recordings,
                            args.journal_root, args.settle_max_s, service_args)
            data["points"].append(row)
            print(table([row])[-1], flush=True)
            for error in row["errors"]:
                print(f"  invalid answer: {error}", file=sys.stderr)
        data["record_s"] = recordings.record_s
    if args.routes:
        data["routes"] = [route_point(server, args.routes, args.seed) for server in args.servers]
        for row in data["routes"]:
            print(f"Route ({row['server']}): {row['cpu_us_per_route']:,.0f} µs of service CPU, "
                  f"{row['round_trip_us']:,.0f} µs round trip", flush=True)
    if args.profile_steps:
        data["profile"] = profile_steps(args.profile_steps, args.journal_root, args.seed)
    data["seconds"] = time.monotonic() - started
    if args.previous is not None:
        earlier = json.loads(args.previous.read_text())
        # A run from before the servers were compared has no summary of this form.
        current_form = all("server" in row for row in earlier["points"])
        data["previous_runs"] = [*earlier.get("previous_runs", []),
                                 *([run_summary(earlier)] if current_form else [])]
    save_results(args.results, "control_plane", data, markdown(data))
    return 1 if any(row["bad_answers"] for row in data["points"]) else 0


if __name__ == "__main__":
    sys.exit(main())
