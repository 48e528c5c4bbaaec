"""Control-plane benchmark: the Steps per second one block service answers for many runner loops.

    .venv/bin/python bench/control_plane.py            # the full run (about 12 minutes)
    .venv/bin/python bench/control_plane.py --quick    # fewer points, shorter (about 3)

One `python -m block_service` process (a fresh one per measured point, with one server thread
per StepStream and some to spare: `--max-workers loops + 8`) and R runner loops stepping
against it. A runner loop is what one gateway loop sends for its runner's pool, with the
runner simulated by the cost model of bench/sim_runner.py (no RunnerService is called here:
the block service is what is measured):
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
- timing as the gateway's loop: once Step N's answer is in, Execute N starts as soon as the
  simulated runner is free and lasts the cost model's time for its rows; the loop then waits
  for Execute N-1 to end and sends Step N+1. A loop thus steps every step time when the
  answers come back within it (the offered rate is R / step time), and its runner idles when
  they do not ("runner idle": the share of the window the simulated runner waited for Steps).
  Each loop starts at a random phase of its step time: runners are independent (in step,
  their Steps would all arrive at once);
- every answer is checked on the client: the step id, every status OK, one slot per APPEND
  at the offset its position has in its block, a new block exactly when a position starts
  one and the slot in it, whole tables and slots for ALLOCATEs, and no block handed out
  while another of the loop's sequences holds it; Steps are counted there.

The loops run in --client-procs load-generator processes (spawned; asyncio and grpc.aio, one
channel each, the loops spread round-robin), a "gateway" each. Before each point the bench
waits (up to --settle-max-s) for the CPUs to be 95% idle, as serve_bench does (bench/w1.py);
every point then runs a warm-up and a measured window: a Step counts when its answer arrives
inside the window, and its latency is send -> answer on the client. Reported per point:
offered and achieved Steps/s, appends/s, latency p50 / p99 / max, runner idle, and the CPU
seconds the block service (all of it, and its Python threads) and the load generators used
in the window (from /proc; the load generators share the machine's cores with the service,
and on a 2-core machine they take a large part of them).

Points: 1, 4, 16, 64 loops at the default cost model (a decode step of 256 rows in 8 ms:
bench/sim_runner.py, CostModel); then, for the highest achieved rate whose p99 is at most
5 ms, at 1, 16 and 64 loops the step time swept up (runners offering 2000, 1500, 1000, 750,
500 Steps/s in all, where that is 8 ms or slower) and down (2 ms, and 0: every loop as fast
as its answers come, the saturation point); each without a journal and with one
(`--journal-dir`, as `pagewire serve` runs the service), one after the other. Then 16 loops
of ONE sequence each at step time 0: the service's cost per message, whatever it carries
(the per-message floor). Last, where a Step's time goes inside the service (in-process, the
same Steps): parsing the request, its columns to lists, the core, building and serialising
the answer. The service's CPU per Step is also split into kernel time and context switches.

Results: bench/results/control_plane.{json,md}; the table is printed as well. Any invalid
answer fails the bench (exit status 1) after the rest has run.
"""

from __future__ import annotations

import argparse
import asyncio
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
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

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
from protos import block_pb2, block_pb2_grpc  # noqa: E402

BATCH = 256
BLOCK_SIZE = 16
SHIFT = BLOCK_SIZE.bit_length() - 1
MASK = BLOCK_SIZE - 1
PROMPT_TOKENS = (32, 47)  # uniform: block boundaries spread over the batch
OUTPUT_TOKENS = (64, 960)  # uniform
ALLOCATE_STEPS = 4  # the initial 256 ALLOCATEs are spread over this many Steps
VOCAB = 32000
# Room for 256 sequences of the longest prompt and output, plus a reserved position.
BLOCKS_PER_SEQUENCE = -(-(PROMPT_TOKENS[1] + OUTPUT_TOKENS[1] + 2) // BLOCK_SIZE) + 1
P99_TARGET_S = 0.005
TARGET_STEPS_PER_S = 2000.0
SPARE_SERVER_THREADS = 8  # besides one per StepStream (block_service/servicer.py keeps 4)
OK = block_pb2.OP_STATUS_OK
APPEND, ALLOCATE, FREE = (block_pb2.OP_KIND_APPEND, block_pb2.OP_KIND_ALLOCATE,
                          block_pb2.OP_KIND_FREE)


# ---- one runner loop: the Steps a gateway sends for one pool ----------------------------------
class BadAnswer(Exception):
    """An answer that is not what the Step asked for."""


@dataclass
class Plan:
    """What one Step asks for, and what its answer must hold."""

    request: block_pb2.StepRequest
    frees: list[int]  # rows freed (their new sequence is allocated in the same Step)
    rows: list[int]  # rows appended to, in op order
    positions: list[int]  # per APPEND: the position it reserves
    allocates: list[tuple[int, int]]  # (row, prompt length)
    slot_counts: list[int]
    table_counts: list[int]
    prefill_tokens: int


@dataclass
class LoopFigures:
    """What one loop measured inside the window (its checks cover every answer)."""

    latencies: list[float] = field(default_factory=list)  # seconds, per Step answered
    appends: int = 0
    allocates: int = 0
    frees: int = 0
    runner_busy_s: float = 0.0  # simulated Execute time that fell in the window
    runner_idle_s: float = 0.0  # simulated runner waiting for a Step answer, in the window
    checked: int = 0  # answers checked, warm-up and set-up included
    errors: list[str] = field(default_factory=list)


class RunnerLoop:
    """One gateway loop for its own pool, 256 sequences in rows; transport-free: `plan_step`
    makes the next Step, `check` verifies its answer and moves the state on."""

    def __init__(self, index: int, seed: int, batch: int = BATCH) -> None:
        self.batch = batch
        self.pool_blocks = batch * BLOCKS_PER_SEQUENCE
        self.pool_id = f"sim-r{index}"
        self.rng = random.Random(seed * 100_003 + index)
        self.session_id = ""
        self.step_id = 0
        self.next_seq_id = 1
        self.seq_ids = [0] * batch
        # Per row: the position its last APPEND reserved (prompt length - 1 right after its
        # ALLOCATE: its first APPEND then reserves the prompt length).
        self.positions = [0] * batch
        self.bases = [0] * batch  # per row: the sequence's token values derive from it
        self.tables: list[list[int]] = [[] for _ in range(batch)]  # per row: its block table
        self.in_use: set[int] = set()  # blocks in the tables of this loop's sequences
        self.fresh: set[int] = set()  # rows allocated by the last Step: no token to fill yet
        self.unallocated = list(range(batch))[::-1]  # rows still to allocate (set-up)
        self.finishing: dict[int, list[int]] = {}  # step id -> rows freed by that Step
        self.figures = LoopFigures()

    @property
    def allocated(self) -> bool:
        return not self.unallocated

    def plan_step(self) -> Plan:
        """The next Step: frees of finished rows, an APPEND per other allocated row, then
        ALLOCATEs (the freed rows' new sequences, or rows of the set-up): the gateway's order
        (gateway/scheduler.py OPERATION_ORDER; tests/bench checks that they agree)."""
        self.step_id += 1
        frees = self.finishing.pop(self.step_id, [])
        rows = list(range(self.batch - len(self.unallocated)))  # allocated in order: 0, 1, ...
        alloc_rows = list(frees)
        if self.unallocated:
            chunk = min(-(-self.batch // ALLOCATE_STEPS), len(self.unallocated))
            alloc_rows += [self.unallocated.pop() for _ in range(chunk)]
        if frees:
            freed = set(frees)
            rows = [row for row in rows if row not in freed]
        old = self.positions
        positions = [old[row] + 1 for row in rows]
        computed = [old[row] for row in rows]
        bases = self.bases
        tokens = [(bases[row] + old[row] * 31) % VOCAB for row in rows]
        counts = [1] * len(rows)
        if self.fresh:  # their first APPEND reserves a position and fills none
            for op in sorted((i for i, row in enumerate(rows) if row in self.fresh),
                             reverse=True):
                counts[op] = 0
                computed[op] = 0
                del tokens[op]
            self.fresh = set()
        n_frees = len(frees)
        kinds = [FREE] * n_frees + [APPEND] * len(rows)
        seq_ids = [self.seq_ids[row] for row in frees]
        seq_ids += [self.seq_ids[row] for row in rows]
        all_counts = [0] * n_frees + counts
        all_computed = [old[row] for row in frees] + computed
        lookaheads = [0] * n_frees + [1] * len(rows)
        allocates = []
        for row in alloc_rows:
            length = self.rng.randint(*PROMPT_TOKENS)
            prompt = [self.rng.randrange(VOCAB) for _ in range(length)]
            self.seq_ids[row] = self.next_seq_id
            self.next_seq_id += 1
            kinds.append(ALLOCATE)
            seq_ids.append(self.seq_ids[row])
            all_counts.append(length)
            tokens += prompt
            all_computed.append(-1)
            lookaheads.append(0)
            allocates.append((row, length))
        request = block_pb2.StepRequest(
            session_id=self.session_id, pool_id=self.pool_id, step_id=self.step_id, epoch=1,
            op_kinds=kinds, seq_ids=seq_ids, token_counts=all_counts, token_ids=tokens,
            parent_seq_ids=[0] * len(kinds), num_computed_tokens=all_computed,
            num_lookahead_slots=lookaheads)
        return Plan(request, frees, rows, positions, allocates,
                    slot_counts=[0] * n_frees + [1] * len(rows)
                    + [length for _, length in allocates],
                    table_counts=[0] * n_frees + [int(not p & MASK) for p in positions]
                    + [-(-length // BLOCK_SIZE) for _, length in allocates],
                    prefill_tokens=sum(length for _, length in allocates))

    def check(self, answer: block_pb2.StepResponse, plan: Plan) -> None:
        """Verifies the answer to `plan` and applies it to the rows; BadAnswer if wrong."""
        self.figures.checked += 1
        n_ops = len(plan.slot_counts)
        if answer.step_id != self.step_id:
            raise BadAnswer(f"answer for step {answer.step_id}, sent {self.step_id}")
        if list(answer.op_statuses) != [OK] * n_ops:
            failed = [i for i, status in enumerate(answer.op_statuses) if status != OK]
            detail = answer.errors.get(failed[0], "") if failed else "wrong count"
            raise BadAnswer(f"step {self.step_id}: {len(failed)} of {n_ops} ops failed, "
                            f"{len(answer.op_statuses)} statuses: {detail}")
        if list(answer.slot_counts) != plan.slot_counts:
            raise BadAnswer(f"step {self.step_id}: slot counts differ from one per new position")
        if list(answer.table_counts) != plan.table_counts:
            raise BadAnswer(f"step {self.step_id}: new blocks where no position starts one "
                            "(or none where one does)")
        slots = answer.slot_mapping
        starts = answer.table_starts
        block_ids = answer.table_block_ids
        n_frees = len(plan.frees)
        tables, in_use = self.tables, self.in_use
        for row in plan.frees:
            in_use.difference_update(tables[row])
        expected = [(tables[row][-1] << SHIFT) | (position & MASK)
                    for row, position in zip(plan.rows, plan.positions, strict=True)]
        cursor = 0  # into block_ids
        for op in (i for i, count in enumerate(plan.table_counts) if count):
            if op >= n_frees + len(plan.rows):
                break  # the ALLOCATEs follow
            index = op - n_frees
            row, position = plan.rows[index], plan.positions[index]
            if starts[op] != position >> SHIFT:
                raise BadAnswer(f"step {self.step_id}: new block at table index {starts[op]}")
            block = block_ids[cursor]
            if block in in_use:
                raise BadAnswer(f"step {self.step_id}: block {block} handed out again while a "
                                "sequence holds it")
            in_use.add(block)
            tables[row].append(block)
            expected[index] = block << SHIFT
            cursor += 1
        if list(slots[:len(expected)]) != expected:
            raise BadAnswer(f"step {self.step_id}: an APPEND's slot is not in its last block "
                            "at its position's offset")
        slot_cursor = len(expected)
        for index, (row, length) in enumerate(plan.allocates):
            op = n_frees + len(plan.rows) + index
            table = block_ids[cursor:cursor + plan.table_counts[op]]
            cursor += plan.table_counts[op]
            wanted = [(table[k >> SHIFT] << SHIFT) | (k & MASK) for k in range(length)]
            if starts[op] != 0 or answer.num_cached_tokens[op] != 0 or \
                    list(slots[slot_cursor:slot_cursor + length]) != wanted:
                raise BadAnswer(f"step {self.step_id}: ALLOCATE of {length} tokens answered "
                                "another table or other slots")
            slot_cursor += length
            if len(set(table)) != len(table) or not in_use.isdisjoint(table):
                raise BadAnswer(f"step {self.step_id}: ALLOCATE got blocks a sequence holds")
            in_use.update(table)
            tables[row] = list(table)
            self.positions[row] = length - 1
            self.bases[row] = self.rng.randrange(VOCAB)
            self.fresh.add(row)
            # Its first APPEND reserves at the next Step; it frees after its last one.
            output = self.rng.randint(*OUTPUT_TOKENS)
            self.finishing.setdefault(self.step_id + output + 1, []).append(row)
        if cursor != len(block_ids) or slot_cursor != len(slots):
            raise BadAnswer(f"step {self.step_id}: more block ids or slots than asked for")
        positions = self.positions
        for row, position in zip(plan.rows, plan.positions, strict=True):
            positions[row] = position

    # -- over gRPC (grpc.aio) --------------------------------------------------------------
    async def set_up(self, stub: Any) -> None:
        """Pool, session, stream, and the ALLOCATE Steps of all 256 rows."""
        await stub.CreatePool(block_pb2.CreatePoolRequest(
            pool_id=self.pool_id, num_blocks=self.pool_blocks, block_size=BLOCK_SIZE,
            epoch=1))
        opened = await stub.OpenSession(block_pb2.OpenSessionRequest(
            client_name=f"control-plane {self.pool_id}", lease_ttl_ms=120_000))
        self.session_id = opened.session_id
        self.stream = stub.StepStream()
        while not self.allocated or self.fresh:
            await self.exchange(self.plan_step())

    async def exchange(self, plan: Plan) -> float:
        """Sends the Step, checks its answer; returns when it came (monotonic)."""
        await self.stream.write(plan.request)
        answer = await self.stream.read()
        answered = time.monotonic()
        if answer is grpc.aio.EOF:
            raise BadAnswer(f"the StepStream ended at step {self.step_id}")
        self.check(answer, plan)
        return answered

    async def run(self, cost: CostModel, start_at: float, window: tuple[float, float]) -> None:
        """Steps until the window ends, as the gateway's loop paces them (module docstring)."""
        figures = self.figures
        window_start, window_end = window
        # Runners are not in step with each other: each starts at a random phase of its step.
        phase = self.rng.random() * cost.step_time_s(self.batch)
        await asyncio.sleep(max(0.0, start_at + phase - time.monotonic()))
        runner_free_at = time.monotonic()  # the end of the last simulated Execute
        while time.monotonic() < window_end:
            plan = self.plan_step()
            sent = time.monotonic()
            answered = await self.exchange(plan)
            begins = max(answered, runner_free_at)
            previous_end = runner_free_at
            runner_free_at = begins + cost.step_time_s(len(plan.rows), plan.prefill_tokens)
            if window_start <= answered < window_end:
                figures.latencies.append(answered - sent)
                figures.appends += len(plan.rows)
                figures.allocates += len(plan.allocates)
                figures.frees += len(plan.frees)
                figures.runner_idle_s += overlap(previous_end, begins, window)
                figures.runner_busy_s += overlap(begins, runner_free_at, window)
            # Keep one Execute in flight: wait for the one before this step's to end.
            delay = previous_end - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)

    async def close(self, stub: Any) -> None:
        await self.stream.done_writing()
        await stub.CloseSession(block_pb2.CloseSessionRequest(session_id=self.session_id))


def overlap(start: float, end: float, window: tuple[float, float]) -> float:
    """How much of [start, end) lies inside the window."""
    return max(0.0, min(end, window[1]) - max(start, window[0]))


# ---- the load-generator processes ----------------------------------------------------------
def client_main(conn: Connection, address: str, indices: list[int], step_s: float,
                seed: int, batch: int) -> None:
    """A load-generator process ("gateway"): its loops over one channel."""
    asyncio.run(_client(conn, address, indices, CostModel.for_decode_step(step_s), seed,
                        batch))


async def _client(conn: Connection, address: str, indices: list[int], cost: CostModel,
                  seed: int, batch: int) -> None:
    loop = asyncio.get_running_loop()
    loops = [RunnerLoop(index, seed, batch) for index in indices]
    async with grpc.aio.insecure_channel(address) as channel:
        stub = block_pb2_grpc.BlockServiceStub(channel)
        try:
            await asyncio.gather(*(runner.set_up(stub) for runner in loops))
        except Exception as error:  # reported to the parent, which fails the point
            conn.send(("failed", f"set-up: {error!r}"))
            return
        conn.send(("ready", None))
        start_at, window = await loop.run_in_executor(None, conn.recv)
        cpu: dict[str, float] = {}
        # The event loop's clock is time.monotonic, the same in every process.
        loop.call_at(window[0], lambda: cpu.__setitem__("start", time.process_time()))
        loop.call_at(window[1], lambda: cpu.__setitem__("end", time.process_time()))

        async def run(runner: RunnerLoop) -> None:
            try:
                await runner.run(cost, start_at, window)
            except (BadAnswer, grpc.RpcError) as error:
                runner.figures.errors.append(f"{runner.pool_id}: {error}")

        await asyncio.gather(*(run(runner) for runner in loops))
        await asyncio.sleep(max(0.0, window[1] - time.monotonic() + 0.01))
        for runner in loops:
            with contextlib.suppress(grpc.RpcError):
                await runner.close(stub)
    conn.send(("done", {"cpu_s": cpu.get("end", 0.0) - cpu.get("start", 0.0),
                        "loops": [asdict(runner.figures) for runner in loops]}))


# ---- one measured point ------------------------------------------------------------------
@dataclass(frozen=True)
class Point:
    """One configuration: loops, the simulated decode-step time, journal or not, and the
    sequences of each loop (1: the service's cost per message, whatever it carries)."""

    loops: int
    step_ms: float
    journal: bool
    batch: int = BATCH


def run_point(point: Point, warm_s: float, measure_s: float, client_procs: int, seed: int,
              journal_root: str | None, settle_max_s: float,
              service_args: tuple[str, ...] = ()) -> dict[str, Any]:
    """Waits for a quiet machine (bench/w1.py's settle, up to settle_max_s), starts a block
    service, runs the loops of `point` against it, returns its figures."""
    settle_s = wait_until_quiet(settle_max_s) if settle_max_s > 0 else 0.0
    procs = max(1, min(client_procs, point.loops))
    server_args = ["--max-workers", str(point.loops + SPARE_SERVER_THREADS), *service_args]
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
                      point.step_ms / 1e3, seed, point.batch))
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
        time.sleep(max(0.0, window[1] - time.monotonic()))
        after = (*service_counters(pid), machine_busy_s(), time.process_time())
        reports = [receive(pipe, 60.0 + measure_s)[1] for pipe in pipes]
    row = summarise(point, procs, measure_s, reports,
                    [b - a for a, b in zip(before, after, strict=True)])
    row["settle_s"] = settle_s
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
        "loops": point.loops, "step_ms": point.step_ms, "journal": point.journal,
        "batch": point.batch,
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


def held(row: dict[str, Any]) -> bool:
    """Whether a point answered every Step validly with p99 within the target."""
    return row["bad_answers"] == 0 and row["p99_ms"] is not None and \
        row["p99_ms"] <= P99_TARGET_S * 1e3


# ---- where a Step's time goes inside the service -------------------------------------------
def profile_steps(num_steps: int, journal_root: str | None, seed: int) -> dict[str, Any]:
    """The benchmark's own Steps (one loop) through the service's code in-process: request
    parsing, BlockServicer.Step (its column conversion, the core call, step_response) and the
    answer's serialisation, each timed by this thread's CPU clock; without and with a
    journal. Returns, per mode, mean microseconds per Step of each part."""
    figures = {}
    for journal in (False, True):
        with tempfile.TemporaryDirectory(dir=journal_root) as directory:
            name = "journal" if journal else "no journal"
            figures[name] = _profile_one(num_steps, directory if journal else None, seed)
    return figures


def _profile_one(num_steps: int, journal_dir: str | None, seed: int,
                 warm_steps: int = 200) -> dict[str, Any]:
    from unittest import mock

    from block_service import servicer as servicer_module
    from block_service.core import BlockServiceCore
    from block_service.journal import Journal, JournalPolicy

    core = BlockServiceCore()
    journal = None
    if journal_dir is not None:  # no snapshot during the Steps, as in bench/block_service.py
        journal, _ = Journal.open(journal_dir, JournalPolicy(False, 10**9, 1e9))
        core.attach_journal(journal)
    spent = dict.fromkeys(["parse", "columns", "core", "build", "serialize"], 0.0)

    def timed(part: str, work: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            started = time.thread_time()
            try:
                return work(*args, **kwargs)
            finally:
                spent[part] += time.thread_time() - started
        return run

    servicer = servicer_module.BlockServicer(core, 0)
    runner = RunnerLoop(0, seed)
    core.create_pool(runner.pool_id, runner.pool_blocks, BLOCK_SIZE, 1)
    runner.session_id, _ = core.open_session("profile", 300_000)
    appends = 0
    with mock.patch.object(core, "step", timed("core", core.step)), \
            mock.patch.object(servicer_module, "step_response",
                              timed("build", servicer_module.step_response)):
        for index in range(warm_steps + num_steps):
            if index == warm_steps:
                spent.update(dict.fromkeys(spent, 0.0))
                appends = 0
            plan = runner.plan_step()
            data = plan.request.SerializeToString()
            started = time.thread_time()
            request = block_pb2.StepRequest.FromString(data)
            parsed = time.thread_time()
            answer = servicer.Step(request, None)  # type: ignore[arg-type]
            handled = time.thread_time()
            out = answer.SerializeToString()
            done = time.thread_time()
            spent["parse"] += parsed - started
            spent["columns"] += handled - parsed  # core and build are taken out below
            spent["serialize"] += done - handled
            runner.check(block_pb2.StepResponse.FromString(out), plan)
            appends += len(plan.rows)
    if journal is not None:
        journal.close()
    spent["columns"] -= spent["core"] + spent["build"]
    per_step = {part: seconds / num_steps * 1e6 for part, seconds in spent.items()}
    per_step["total"] = sum(per_step.values())
    return {"steps": num_steps, "appends_per_step": appends / num_steps,
            "us_per_step": per_step, "core_ns_per_append": spent["core"] / appends * 1e9}


# ---- results ---------------------------------------------------------------------------------
def points(args: argparse.Namespace, journals: list[bool]) -> list[Point]:
    """The base points, then per sweep loop count the offered rates (as step times, those at
    least --step-ms: slower runners) and the shorter step times (down to saturation), then
    the per-message floor."""
    chosen: list[Point] = []
    for count in args.loops:
        chosen += [Point(count, args.step_ms, journal) for journal in journals]
    for count in args.sweep_loops:
        slower = [round(count * 1e3 / rate, 3) for rate in args.sweep_offered]
        for ms in [ms for ms in slower if ms >= args.step_ms] + args.sweep_step_ms:
            chosen += [Point(count, ms, journal) for journal in journals]
    floor_loops = args.floor_loops
    chosen += [Point(count, 0.0, False, batch=1) for count in floor_loops]
    unique: list[Point] = []
    for point in chosen:
        if point not in unique:
            unique.append(point)
    return unique


def best(rows: list[dict[str, Any]], journal: bool, min_loops: int = 1
         ) -> dict[str, Any] | None:
    candidates = [row for row in rows if row["journal"] == journal and row["batch"] == BATCH
                  and row["loops"] >= min_loops and held(row)]
    return max(candidates, key=lambda row: row["steps_per_s"], default=None)


def looped(count: int) -> str:
    return f"{count} loop" + ("" if count == 1 else "s")


def table(rows: list[dict[str, Any]]) -> list[str]:
    header = ["loops", "batch", "step ms", "journal", "offered Steps/s", "Steps/s", "appends/s",
              "p50 ms", "p99 ms", "max ms", "p99 ≤ 5 ms", "runner idle",
              "service CPU µs/Step (Python threads)", "clients CPU µs/Step",
              "CPU s: service / clients / other", "checked (bad)"]
    lines = ["| " + " | ".join(header) + " |",
             "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---|---:|"]
    for row in rows:
        cells = [
            f"{row['loops']}", f"{row['batch']}", f"{row['step_ms']:g}",
            "yes" if row["journal"] else "no", fmt(row["offered_steps_per_s"], ",.0f"),
            f"{row['steps_per_s']:,.0f}", f"{row['appends_per_s']:,.0f}",
            fmt(row["p50_ms"], ".2f"), fmt(row["p99_ms"], ".2f"), fmt(row["max_ms"], ".1f"),
            "yes" if held(row) else "NO", fmt(row["runner_idle"], ".1%"),
            f"{row['server_cpu_us_per_step']:,.0f} ({row['server_python_us_per_step']:,.0f})",
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
        f"{data['seconds']:.0f} s in all"
        + (f"; service arguments added: `{data['service_args']}`." if data.get("service_args")
           else "."),
        "",
        "What runs: `python -m block_service` (a fresh one per point; `--max-workers` loops + "
        f"{SPARE_SERVER_THREADS}) and R runner loops in up to {data['client_procs']} spawned "
        "load-generator processes (asyncio + grpc.aio, one channel each), every loop a pool of "
        f"its own with {BATCH} sequences decoding over a StepStream as the gateway does (see "
        "the docstring of bench/control_plane.py). A decode Step is 256 APPENDs of one token "
        "with a reserved next position; about one Step in two frees a finished sequence and "
        "allocates its successor instead of one APPEND. Every answer is checked on the client "
        "(statuses, one slot per APPEND in its block at its offset, new blocks, ALLOCATE "
        "tables); Steps are counted there when their answer arrives in the window.",
        "",
        f"Cost model (bench/sim_runner.py `CostModel`, an assumption): Execute = "
        f"{cost['fixed_s'] * 1e3:g} ms + {cost['per_decode_row_s'] * 1e6:.1f} µs × decode rows "
        f"+ {cost['per_prefill_token_s'] * 1e6:g} µs × prefill tokens: a decode step of 256 "
        "rows in 8.0 ms (H200, 0.6B model, ~1k-token contexts: the KV reads dominate). The "
        "sweep scales it to other decode-step times. Offered rate = loops / step time; the "
        "loop sends Step N+1 once Execute N-1 has ended (one Execute in flight), so with "
        "answers inside the step time it steps every step time exactly.",
        "",
        "CPU: the service's and the load generators' CPU seconds in the window (/proc); "
        "'other' is the rest of the machine's busy time then (this bench's parent, other "
        f"processes). The machine has {data['cpus']} cores for all of it: the load generators "
        "take CPU the service could otherwise use, so the rates are lower bounds for a "
        "service with the cores to itself.",
        "",
    ]
    lines += table(rows)
    waits = [row.get("settle_s", 0.0) for row in rows]
    busy = sum(1 for row in rows if row.get("settle_s", 0.0) >= data["settle_max_s"] - 0.5)
    if data["settle_max_s"] > 0:
        lines += ["", f"Before each point the bench waited for the CPUs to be 95% idle (bench/"
                  f"w1.py): {min(waits):.1f}–{max(waits):.1f} s; {busy} of {len(rows)} points "
                  f"started on a machine still busy after {data['settle_max_s']:g} s (other "
                  "work: see 'other' CPU)."]
    lines += ["", "## Against the target", ""]
    target_rows = [row for row in rows if row["loops"] == 16 and row["step_ms"] == 8]
    for journal in (False, True):
        top = best(rows, journal)
        name = "with a journal" if journal else "without a journal"
        if top is None:
            lines.append(f"- {name}: no point held p99 ≤ 5 ms.")
            continue
        ratio = top["steps_per_s"] / TARGET_STEPS_PER_S
        verdict = "met" if ratio >= 1 else "NOT met"
        lines.append(
            f"- {name}: highest sustained rate with p99 ≤ 5 ms {top['steps_per_s']:,.0f} "
            f"Steps/s ({top['appends_per_s']:,.0f} appends/s; {looped(top['loops'])} at "
            f"{top['step_ms']:g} ms, p99 {top['p99_ms']:.2f} ms): target ≥ 2,000 Steps/s of "
            f"256 appends {verdict}, {ratio:.2f}× the target.")
        many = best(rows, journal, min_loops=16)
        if many is not top:
            lines.append(
                "  With 16 or more runner loops (the target's shape): "
                + (f"{many['steps_per_s']:,.0f} Steps/s ({looped(many['loops'])} at "
                   f"{many['step_ms']:g} ms, p99 {many['p99_ms']:.2f} ms)."
                   if many else "no point held p99 ≤ 5 ms."))
        for row in target_rows:
            if row["journal"] == journal:
                lines.append(
                    f"  The target's own shape, 16 loops every 8 ms (offered 2,000/s): "
                    f"{row['steps_per_s']:,.0f} Steps/s, p99 {fmt(row['p99_ms'], '.2f')} ms, "
                    f"runner idle {fmt(row['runner_idle'], '.1%')}: "
                    f"{'held' if held(row) and row['steps_per_s'] >= 0.99 * 2000 else 'not held'}"
                    ".")
    lines += runs_lines(data)
    lines += journal_lines(rows)
    profile = data.get("profile")
    if profile:
        lines += profile_markdown(profile, rows)
    return "\n".join(lines) + "\n"


def run_summary(data: dict[str, Any]) -> dict[str, Any]:
    """A run's headline figures, to compare runs."""
    rows = data["points"]

    def fastest(journal: bool) -> dict[str, Any] | None:
        return max((row for row in rows if row["journal"] == journal and row["batch"] == BATCH
                    and row["steps"]), key=lambda row: row["steps_per_s"], default=None)

    summary: dict[str, Any] = {"measured_at": data["measured_at"]}
    for journal in (False, True):
        key = "journal" if journal else "no_journal"
        top, sustained = fastest(journal), best(rows, journal)
        shape = [row for row in rows if row["journal"] == journal and row["loops"] == 16
                 and row["step_ms"] == 8 and row["batch"] == BATCH]
        summary[key] = {
            "sustained_steps_per_s": sustained["steps_per_s"] if sustained else None,
            "sustained_at": (f"{looped(sustained['loops'])} at {sustained['step_ms']:g} ms"
                             if sustained else None),
            "saturation_steps_per_s": top["steps_per_s"] if top else None,
            "service_cpu_us_per_step": top["server_cpu_us_per_step"] if top else None,
            "target_shape_steps_per_s": shape[0]["steps_per_s"] if shape else None,
            "target_shape_p99_ms": shape[0]["p99_ms"] if shape else None}
    return summary


def runs_lines(data: dict[str, Any]) -> list[str]:
    """This run beside the earlier ones kept in its data (--previous)."""
    runs = [*data.get("previous_runs", []), run_summary(data)]
    if len(runs) < 2:
        return []
    lines = ["", "## Runs compared", "",
             "| run | journal | highest rate with p99 ≤ 5 ms | saturation Steps/s | "
             "service CPU µs/Step there | 16 loops every 8 ms: Steps/s, p99 ms |",
             "|---|---|---:|---:|---:|---:|"]
    for run in runs:
        for key, name in (("no_journal", "no"), ("journal", "yes")):
            row = run[key]
            lines.append(
                f"| {run['measured_at']} | {name} | "
                f"{fmt(row['sustained_steps_per_s'], ',.0f')} ({row['sustained_at']}) | "
                f"{fmt(row['saturation_steps_per_s'], ',.0f')} | "
                f"{fmt(row['service_cpu_us_per_step'], ',.0f')} | "
                f"{fmt(row['target_shape_steps_per_s'], ',.0f')}, "
                f"{fmt(row['target_shape_p99_ms'], '.1f')} |")
    return lines


def journal_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The journal's cost: each point that ran both ways, side by side."""
    pairs = []
    for row in rows:
        if row["journal"]:
            continue
        twin = [other for other in rows if other["journal"] and all(
            other[key] == row[key] for key in ("loops", "step_ms", "batch"))]
        if twin and row["steps"] and twin[0]["steps"]:
            pairs.append((row, twin[0]))
    if not pairs:
        return []
    saturated = [(a, b) for a, b in pairs if a["step_ms"] == 0]
    worst = max(pairs, key=lambda pair: pair[1]["max_ms"] or 0.0)
    lines = ["", "## The journal", ""]
    if saturated:
        lines.append("At saturation (step time 0) the journal costs "
                     + ", ".join(f"{looped(a['loops'])}: {a['steps_per_s']:,.0f} → "
                                 f"{b['steps_per_s']:,.0f} Steps/s "
                                 f"({b['steps_per_s'] / a['steps_per_s'] - 1:+.0%})"
                                 for a, b in saturated) + ".")
    lines.append(
        f"Its worst pause: max {fmt(worst[1]['max_ms'], '.0f')} ms against "
        f"{fmt(worst[0]['max_ms'], '.0f')} ms without ({looped(worst[0]['loops'])} at "
        f"{worst[0]['step_ms']:g} ms). Maxima that far above the rest are most likely the "
        "journal's snapshots: every 10,000 records the service pickles every pool under its "
        "lock (docs/block_service.md), and here the pools hold loops × 256 sequences; compare "
        "with `--service-args '--snapshot-every-records 1000000'`.")
    return lines


def profile_markdown(profile: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    parts = ["parse", "columns", "core", "build", "serialize", "total"]
    names = {"parse": "parse the request (StepRequest.FromString)",
             "columns": "columns to lists (BlockServicer.Step, less core and build)",
             "core": "core (BlockServiceCore.step: checks, lock, run_step, journal)",
             "build": "build the answer (step_response)",
             "serialize": "serialise the answer", "total": "in-process total"}
    lines = ["", "## Where a Step's time goes inside the service", "",
             f"The same Steps (one loop: 256 APPENDs, now and then a FREE + ALLOCATE), "
             f"in-process through the service's code, this thread's CPU time, mean of "
             f"{profile['no journal']['steps']:,} Steps after 200 warm-up ones:", "",
             "| part | µs per Step, no journal | µs per Step, journal |", "|---|---:|---:|"]
    for part in parts:
        lines.append(f"| {names[part]} | {profile['no journal']['us_per_step'][part]:.0f} | "
                     f"{profile['journal']['us_per_step'][part]:.0f} |")
    lines.append(f"| core per APPEND (ns) | {profile['no journal']['core_ns_per_append']:.0f} | "
                 f"{profile['journal']['core_ns_per_append']:.0f} |")
    in_process = profile["no journal"]["us_per_step"]
    loaded = [row for row in rows if not row["journal"] and row["batch"] == BATCH
              and row["bad_answers"] == 0 and row["steps"]]
    if not loaded:
        return lines
    top = max(loaded, key=lambda row: row["steps_per_s"])
    seconds = top["measure_s"]
    server, python = top["server_cpu_us_per_step"], top["server_python_us_per_step"]
    core_us, handler_us = in_process["core"], in_process["total"]
    floors = [row for row in rows if row["batch"] == 1 and row["steps"]]
    floor_us = floors[0]["server_cpu_us_per_step"] if floors else 0.0
    rest_us = server - handler_us - floor_us
    budget_us = 1e6 / TARGET_STEPS_PER_S
    lines += [
        "",
        "## The bottleneck",
        "",
        f"At the fastest point without a journal ({looped(top['loops'])} at {top['step_ms']:g} "
        f"ms: {top['steps_per_s']:,.0f} Steps/s, p99 {fmt(top['p99_ms'], '.2f')} ms) the "
        f"service process used {top['server_cpu_s'] / seconds:.2f} cores, the load generators "
        f"{top['clients_cpu_s'] / seconds:.2f}, the whole machine "
        f"{top['machine_cpu_s'] / seconds:.2f} of {os.cpu_count()}. The service used "
        f"{server:,.0f} µs of CPU per Step, {python:,.0f} µs of it on its Python threads "
        "(handlers, protobuf, gRPC's Python layer, and gRPC's C core where those threads poll): "
        "work that takes turns on the GIL, so the service does not get much past one core, "
        f"and one core at {server:,.0f} µs per Step is about {1e6 / server:,.0f} Steps/s. "
        f"{top['server_kernel_us_per_step']:,.0f} µs of the {server:,.0f} were in the kernel, "
        f"with {top['server_switches_per_step']:.1f} context switches per Step (a stream's "
        "message passes from the thread that polls gRPC's queue to the stream's thread and "
        "back, and the threads hand the GIL to each other).",
        "",
    ]
    single = [row for row in loaded if row["loops"] == 1 and row["step_ms"] == 0]
    if single:
        one = single[0]
        lines += [
            f"One loop alone stepping as fast as its answers come (closed loop, nothing "
            f"queues): {one['steps_per_s']:,.0f} Steps/s, p50 {fmt(one['p50_ms'], '.2f')} ms, "
            f"p99 {fmt(one['p99_ms'], '.2f')} ms, the service at "
            f"{one['server_cpu_s'] / one['measure_s']:.2f} cores and "
            f"{one['server_cpu_us_per_step']:,.0f} µs per Step: more loops add queueing, "
            "not Steps.",
            ""]
    lines += [
        "Its CPU per Step, split:",
        "",
        "| part | µs per Step |", "|---|---:|",
        f"| the Step's own work, in-process (table above: parse {in_process['parse']:.0f}, "
        f"columns {in_process['columns']:.0f}, core {core_us:.0f}, build "
        f"{in_process['build']:.0f}, serialise {in_process['serialize']:.0f}) | "
        f"{handler_us:,.0f} |",
    ]
    if floors:
        lines.append(
            f"| per message whatever it carries: the service's CPU per Step of ONE operation "
            f"({looped(floors[0]['loops'])}, saturated: {floors[0]['steps_per_s']:,.0f} "
            f"Steps/s): gRPC's stream hand-offs, HTTP/2, the handler's fixed cost | "
            f"{floor_us:,.0f} |")
    lines += [
        f"| the rest: gRPC and protobuf's share of 256 operations on the wire, and what the "
        f"load adds (threads passing the GIL, caches); by difference | {rest_us:,.0f} |",
        f"| **the service's CPU per Step under load** | **{server:,.0f}** |",
        "",
        f"{TARGET_STEPS_PER_S:,.0f} Steps/s from one core leaves {budget_us:.0f} µs per Step; "
        f"today's {server:,.0f} µs is {server / budget_us:.1f}× that. What a compiled Step "
        "core would save, if nothing else changed:",
        f"- the core alone compiled (checks, lock, the loop over the operations, the journal "
        f"record): about {core_us:,.0f} µs (a compiled loop over 256 appends costs a few µs), "
        f"leaving {server - core_us:,.0f} µs: about {1e6 / (server - core_us):,.0f} Steps/s;",
        f"- a compiled Step from the request's bytes to the answer's (parse, columns, core, "
        f"build, serialise): about {handler_us:,.0f} µs, leaving {server - handler_us:,.0f} µs: "
        f"about {1e6 / max(server - handler_us, 1.0):,.0f} Steps/s;",
        f"- neither touches the {server - handler_us:,.0f} µs that are gRPC's "
        f"(per message {floor_us:,.0f} µs, the rest with the message's size and the load). "
        + (f"Even the compiled Step leaves {server - handler_us:,.0f} µs against the "
           f"{budget_us:.0f} µs budget: "
           + ("within this machine's run-to-run spread, so on the edge, and only for a "
              if server - handler_us <= budget_us else "over it, even for a ")
           + "service with a core to itself (here the load generators needed "
           f"{TARGET_STEPS_PER_S * top['clients_cpu_us_per_step'] / 1e6:.1f} cores at "
           f"{TARGET_STEPS_PER_S:,.0f} Steps/s, and the service does not use a whole core: "
           f"{top['server_cpu_s'] / seconds:.2f} at saturation). To reach the target with "
           "room, the transport must shrink as well: fewer messages (one gateway's Steps for "
           "all its runners in one message pays the per-message cost once per gateway, not "
           "per runner), lighter messages (a decode batch's 256 one-token APPENDs as one "
           "packed operation), or a server outside Python (C++/Rust gRPC)."),
    ]
    return lines


def print_table(rows: list[dict[str, Any]]) -> None:
    print("\n".join(table(rows)))
    sys.stdout.flush()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])

    def numbers(kind: Callable[[str], Any]) -> Callable[[str], list[Any]]:
        return lambda text: [kind(part) for part in text.split(",") if part.strip()]

    parser.add_argument("--quick", action="store_true",
                        help="1 s warm-up, 3 s measured, sweeps offering 1000 and 500 "
                             "Steps/s and a step time of 0")
    parser.add_argument("--loops", type=numbers(int), default=[1, 4, 16, 64])
    parser.add_argument("--step-ms", type=float, default=8.0,
                        help="the simulated decode step of 256 rows (cost model)")
    parser.add_argument("--sweep-loops", type=numbers(int), default=[1, 16, 64])
    parser.add_argument("--sweep-offered", type=numbers(float), default=None,
                        help="Steps/s offered by the sweep loops, as longer step times (those "
                             "at least --step-ms; default 2000,1500,1000,750,500)")
    parser.add_argument("--sweep-step-ms", type=numbers(float), default=None,
                        help="shorter step times for the sweep loops (default 2,0; "
                             "--quick 0)")
    parser.add_argument("--floor-loops", type=numbers(int), default=[16],
                        help="also run this many loops of ONE sequence each, step time 0, "
                             "no journal: the service's cost per message (empty: none)")
    parser.add_argument("--journal", choices=["off", "on", "both"], default="both")
    parser.add_argument("--warm-s", type=float, default=None, help="default 3 (--quick 1)")
    parser.add_argument("--measure-s", type=float, default=None,
                        help="default 10 (--quick 3)")
    parser.add_argument("--client-procs", type=int, default=2,
                        help="load-generator processes (at most one per loop)")
    parser.add_argument("--settle-max-s", type=float, default=20.0,
                        help="before each point, wait up to this long for the CPUs to be 95%% "
                             "idle (bench/w1.py; 0: no wait)")
    parser.add_argument("--service-args", default="",
                        help="more arguments for `python -m block_service`, e.g. "
                             "'--snapshot-every-records 1000000'")
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
    if args.sweep_offered is None:
        args.sweep_offered = [1000.0, 500.0] if args.quick else [2000.0, 1500.0, 1000.0,
                                                                   750.0, 500.0]
    if args.sweep_step_ms is None:
        args.sweep_step_ms = [0.0] if args.quick else [2.0, 0.0]
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
        "cost_model": asdict(CostModel()),
        "target": {"steps_per_s": TARGET_STEPS_PER_S, "p99_ms": P99_TARGET_S * 1e3},
        "points": []}
    for point in points(args, journals):
        row = run_point(point, args.warm_s, args.measure_s, args.client_procs, args.seed,
                        args.journal_root, args.settle_max_s,
                        tuple(shlex.split(args.service_args)))
        data["points"].append(row)
        print(table([row])[-1], flush=True)
        for error in row["errors"]:
            print(f"  invalid answer: {error}", file=sys.stderr)
    if args.profile_steps:
        data["profile"] = profile_steps(args.profile_steps, args.journal_root, args.seed)
    data["seconds"] = time.monotonic() - started
    if args.previous is not None:
        earlier = json.loads(args.previous.read_text())
        data["previous_runs"] = [*earlier.get("previous_runs", []), run_summary(earlier)]
    save_results(args.results, "control_plane", data, markdown(data))
    return 1 if any(row["bad_answers"] for row in data["points"]) else 0


if __name__ == "__main__":
    sys.exit(main())
