"""The load of bench/control_plane.py: what one gateway runner loop sends, recorded once and
replayed by every loop.

A `RunnerLoop` is what one gateway loop sends for its runner's pool, with 256 sequences in rows
(bench/control_plane.py's docstring says what its Steps hold): `plan_step` makes the next Step,
`check` verifies its answer and moves the state on.

Replaying instead of planning: planning and checking a Step in Python costs a load generator
~700 us of CPU, more than the service's own work per Step, and the machine's cores are shared:
at a few thousand Steps per second the load generators, not the service, would be measured.
So `record` runs one loop's Steps once, before any point, through the block service's code in
this process (BlockServiceCore.step_wire on the Python path, `check` verifying every answer),
and keeps each Step's request bytes (without its session and pool) and answer bytes. Every
loop then replays that same stream over its own StepStream, session and pool (a fresh service
per point: the same requests get the same answers): a Step is its session and pool fields
followed by the recorded bytes (protobuf reads concatenated fields as one message), and its
answer must equal the recorded one byte for byte, so every answer is checked in full against
the in-process Python path. A loop that reaches the end of the recording stops and says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import random
import time
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import grpc

from bench.sim_runner import CostModel
from protos import block_pb2, block_pb2_grpc

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
OK = block_pb2.OP_STATUS_OK
APPEND, ALLOCATE, FREE = (block_pb2.OP_KIND_APPEND, block_pb2.OP_KIND_ALLOCATE,
                          block_pb2.OP_KIND_FREE)
STEP_STREAM = "/pagewire.block.v1.BlockService/StepStream"


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
        self.checked = 0

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
        self.checked += 1
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


# ---- recording -------------------------------------------------------------------------------
@dataclass
class RecordedStep:
    """One Step of the recording."""

    request: bytes  # the StepRequest without session_id and pool_id
    answer: bytes  # its StepResponse
    rows: int  # APPENDs (decode rows: the cost model's input)
    prefill_tokens: int
    allocates: int
    frees: int


@dataclass
class Recording:
    """One loop's Steps from the first: `set_up` of them allocate every row."""

    batch: int
    seed: int
    set_up: int
    steps: list[RecordedStep]

    def save(self, path: Path) -> None:
        path.write_bytes(pickle.dumps(self, protocol=pickle.HIGHEST_PROTOCOL))

    @staticmethod
    def load(path: Path) -> Recording:
        recording = pickle.loads(path.read_bytes())
        assert isinstance(recording, Recording)
        return recording


def header(session_id: str, pool_id: str) -> bytes:
    """A StepRequest's fields 1 and 2: what makes a recorded Step one loop's."""
    return block_pb2.StepRequest(session_id=session_id, pool_id=pool_id).SerializeToString()


def record(batch: int, seed: int, num_steps: int) -> Recording:
    """`num_steps` Steps of one loop (beyond the set-up), through the service's own code here
    on its Python path, every answer checked."""
    from block_service.core import BlockServiceCore  # the service's code, in this process

    core = BlockServiceCore(compiled_steps=False)
    loop = RunnerLoop(0, seed, batch)
    core.create_pool(loop.pool_id, loop.pool_blocks, BLOCK_SIZE, 1)
    session_id, _ = core.open_session("control-plane recording", 3_600_000)
    prefix = header(session_id, loop.pool_id)
    steps: list[RecordedStep] = []
    set_up = 0
    while not set_up or len(steps) < set_up + num_steps:
        if not set_up and loop.allocated:  # and this Step makes the last rows' first APPENDs
            set_up = len(steps) + 1
        plan = loop.plan_step()
        plan.request.ClearField("pool_id")  # the header gives them (the last one wins)
        plan.request.ClearField("session_id")
        request = plan.request.SerializeToString()
        answer = core.step_wire(prefix + request)
        loop.check(block_pb2.StepResponse.FromString(answer), plan)
        steps.append(RecordedStep(request, answer, len(plan.rows), plan.prefill_tokens,
                                  len(plan.allocates), len(plan.frees)))
    return Recording(batch, seed, set_up, steps)


# ---- replaying over gRPC ----------------------------------------------------------------------
@dataclass
class LoopFigures:
    """What one loop measured inside the window (every answer is compared)."""

    latencies: list[float] = field(default_factory=list)  # seconds, per Step answered
    appends: int = 0
    allocates: int = 0
    frees: int = 0
    runner_busy_s: float = 0.0  # simulated Execute time that fell in the window
    runner_idle_s: float = 0.0  # simulated runner waiting for a Step answer, in the window
    checked: int = 0  # answers compared, set-up and warm-up included
    ran_out: bool = False  # the recording ended before the window did
    errors: list[str] = field(default_factory=list)


class ReplayLoop:
    """One runner loop over gRPC: its own pool, session and StepStream, the recorded Steps."""

    def __init__(self, index: int, recording: Recording) -> None:
        self.recording = recording
        self.pool_id = f"sim-r{index}"
        self.rng = random.Random(recording.seed * 100_003 + index)
        self.session_id = ""
        self.prefix = b""
        self.next = 0  # index of the next recorded Step
        self.figures = LoopFigures()

    async def set_up(self, stub: Any, channel: grpc.aio.Channel) -> None:
        """Pool, session, stream, and the set-up Steps (ALLOCATEs of every row)."""
        await stub.CreatePool(block_pb2.CreatePoolRequest(
            pool_id=self.pool_id, num_blocks=self.recording.batch * BLOCKS_PER_SEQUENCE,
            block_size=BLOCK_SIZE, epoch=1))
        opened = await stub.OpenSession(block_pb2.OpenSessionRequest(
            client_name=f"control-plane {self.pool_id}", lease_ttl_ms=120_000))
        self.session_id = opened.session_id
        self.prefix = header(self.session_id, self.pool_id)
        # No serializers: the Steps go as the recorded bytes, the answers come as bytes.
        self.stream = channel.stream_stream(STEP_STREAM)()
        while self.next < self.recording.set_up:
            await self.exchange(self.recording.steps[self.next])

    async def exchange(self, step: RecordedStep) -> float:
        """Sends the next recorded Step, compares its answer; returns when it came."""
        self.next += 1
        await self.stream.write(self.prefix + step.request)
        answer = await self.stream.read()
        answered = time.monotonic()
        if answer is grpc.aio.EOF:
            raise BadAnswer(f"the StepStream ended at step {self.next}")
        self.figures.checked += 1
        if answer != step.answer:
            raise BadAnswer(f"step {self.next}: the answer differs from the in-process one: "
                            f"{describe_difference(answer, step.answer)}")
        return answered

    async def run(self, cost: CostModel, start_at: float, window: tuple[float, float]) -> None:
        """Steps until the window ends, as the gateway's loop paces them (bench/control_plane.py's
        docstring)."""
        figures = self.figures
        steps = self.recording.steps
        window_start, window_end = window
        # Runners are not in step with each other: each starts at a random phase of its step.
        phase = self.rng.random() * cost.step_time_s(self.recording.batch)
        await asyncio.sleep(max(0.0, start_at + phase - time.monotonic()))
        runner_free_at = time.monotonic()  # the end of the last simulated Execute
        while time.monotonic() < window_end:
            if self.next >= len(steps):
                figures.ran_out = True
                return
            step = steps[self.next]
            sent = time.monotonic()
            answered = await self.exchange(step)
            begins = max(answered, runner_free_at)
            previous_end = runner_free_at
            runner_free_at = begins + cost.step_time_s(step.rows, step.prefill_tokens)
            if window_start <= answered < window_end:
                figures.latencies.append(answered - sent)
                figures.appends += step.rows
                figures.allocates += step.allocates
                figures.frees += step.frees
                figures.runner_idle_s += overlap(previous_end, begins, window)
                figures.runner_busy_s += overlap(begins, runner_free_at, window)
            # Keep one Execute in flight: wait for the one before this step's to end.
            delay = previous_end - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)

    async def close(self, stub: Any) -> None:
        await self.stream.done_writing()
        await stub.CloseSession(block_pb2.CloseSessionRequest(session_id=self.session_id))


def describe_difference(got: bytes, wanted: bytes) -> str:
    try:
        got_message = block_pb2.StepResponse.FromString(got)
    except Exception as error:  # any parse failure is the finding
        return f"unparsable answer ({error})"
    wanted_message = block_pb2.StepResponse.FromString(wanted)
    if got_message == wanted_message:
        return "same message, other bytes"
    fields = [f.name for f in block_pb2.StepResponse.DESCRIPTOR.fields
              if getattr(got_message, f.name) != getattr(wanted_message, f.name)]
    errors = dict(got_message.errors)
    return f"fields {fields} differ" + (f"; errors {list(errors.items())[:2]}" if errors else "")


def overlap(start: float, end: float, window: tuple[float, float]) -> float:
    """How much of [start, end) lies inside the window."""
    return max(0.0, min(end, window[1]) - max(start, window[0]))


# ---- the load-generator processes ----------------------------------------------------------
def client_main(conn: Connection, address: str, indices: list[int], step_s: float,
                recording_path: str) -> None:
    """A load-generator process ("gateway"): its loops over one channel."""
    recording = Recording.load(Path(recording_path))
    asyncio.run(_client(conn, address, indices, CostModel.for_decode_step(step_s), recording))


async def _client(conn: Connection, address: str, indices: list[int], cost: CostModel,
                  recording: Recording) -> None:
    loop = asyncio.get_running_loop()
    loops = [ReplayLoop(index, recording) for index in indices]
    async with grpc.aio.insecure_channel(address) as channel:
        stub = block_pb2_grpc.BlockServiceStub(channel)
        try:
            await asyncio.gather(*(runner.set_up(stub, channel) for runner in loops))
        except Exception as error:  # reported to the parent, which fails the point
            conn.send(("failed", f"set-up: {error!r}"))
            return
        conn.send(("ready", None))
        start_at, window = await loop.run_in_executor(None, conn.recv)
        cpu: dict[str, float] = {}
        # The event loop's clock is time.monotonic, the same in every process.
        loop.call_at(window[0], lambda: cpu.__setitem__("start", time.process_time()))
        loop.call_at(window[1], lambda: cpu.__setitem__("end", time.process_time()))

        async def run(runner: ReplayLoop) -> None:
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
