"""The compiled Step (block_service/_stepwire.c) against the Python semantics.

Differential tests, each counting how many of its inputs reached the code under test:
- the same random operation streams (allocate, append with and without lookahead, fork, free,
  commit, bad values, unknown sequences, retried and stale step ids, epoch changes, lease
  expiry, a pool small enough to evict and run out) go to three cores: the compiled path,
  the Python path (block_service.step.run_step with its own decode fast path), and a
  reference that applies every operation alone through block_service.step.apply_op (the
  one source of truth). Every answer (bytes parsed as StepResponse, or the whole-call
  error) and the whole state after every Step must be equal;
- the C reader of StepRequest bytes against protobuf's parser on valid messages written in
  unusual ways (fields in any order and repeated, unpacked columns, unknown fields, maps)
  and on broken ones: whatever the C reader accepts, it reads as protobuf does, and it
  accepts nothing protobuf refuses.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from itertools import count
from typing import Any
from unittest import mock

from google.protobuf.message import DecodeError

from block_service import core as core_module
from block_service.core import BlockServiceCore, Limits
from block_service.ops import (
    OP_ALLOCATE,
    OP_APPEND,
    OP_COMMIT,
    OP_FORK,
    OP_FREE,
    STATUS_OK,
    BlockServiceError,
    OpResult,
    StepResult,
)
from block_service.pool_manager import PoolManager
from block_service.sequence import RESERVED
from block_service.sessions import LeasePolicy
from block_service.step import SessionScope, apply_op
from block_service.step_wire import answer_result, compiled_step, parse_step
from protos import block_pb2

from .conftest import FakeClock
from .invariants import check_invariants, full_state

POOLS = {"a": (160, 4), "b": (96, 2)}  # pool id -> (blocks, block size): small, to run out
VOCAB = 6  # few token values: prompts share prefixes, so the cache hits and evicts


def test_the_compiled_step_is_built() -> None:
    # `make setup` builds it (setup.py); the differential tests below would prove nothing
    # against a missing module, so its absence fails here rather than skipping them.
    assert compiled_step is not None, "block_service._stepwire is not built: run make setup"


# ---- the reference: every operation alone through apply_op ----------------------------------
def reference_run_step(pm: PoolManager, session_id: str, step_id: int, kinds: Sequence[int],
                       seq_ids: Sequence[int], token_counts: Sequence[int],
                       token_ids: Sequence[int], parent_ids: Sequence[int],
                       computed: Sequence[int], cache_salts: dict[int, str],
                       scope: SessionScope, lookaheads: Sequence[int] = ()) -> StepResult:
    results: list[OpResult] = []
    offset = 0
    for i, kind in enumerate(kinds):
        tokens = list(token_ids[offset:offset + token_counts[i]])
        offset += token_counts[i]
        results.append(apply_op(pm, session_id, kind, seq_ids[i], tokens, parent_ids[i],
                                computed[i], cache_salts.get(i, ""), scope,
                                lookaheads[i] if lookaheads else 0))
    ok = [r.status == STATUS_OK for r in results]
    return StepResult(
        step_id, pm.epoch, [r.status for r in results],
        [r.num_cached_tokens if good else 0 for r, good in zip(results, ok, strict=True)],
        [r.table_start if good else 0 for r, good in zip(results, ok, strict=True)],
        [len(r.table_block_ids) if good else 0 for r, good in zip(results, ok, strict=True)],
        [b for r, good in zip(results, ok, strict=True) if good for b in r.table_block_ids],
        [len(r.slots) if good else 0 for r, good in zip(results, ok, strict=True)],
        [s for r, good in zip(results, ok, strict=True) if good for s in r.slots],
        [c for r, good in zip(results, ok, strict=True) if good for c in r.copies],
        {i: r.error for i, r in enumerate(results) if r.status != STATUS_OK})


class Counted:
    """block_service._stepwire with its run counted: appends done in C, operations in all."""

    def __init__(self) -> None:
        self.fast = self.ops = self.new_blocks = 0

    def parse(self, data: bytes) -> Any:
        return compiled_step.parse(data)

    def run(self, parsed: Any, *args: Any) -> tuple[bytes, int, int]:
        answer, fast, computed = compiled_step.run(parsed, *args)
        message = block_pb2.StepResponse.FromString(answer)
        self.fast += fast
        self.ops += len(message.op_statuses)
        return answer, fast, computed


class Engines:
    """The three cores on one fake clock, with the same session ids."""

    def __init__(self, clock: FakeClock) -> None:
        policy = LeasePolicy(10.0, 1.0, 60.0)
        limits = Limits(max_seqs_per_session=16)
        self.compiled = BlockServiceCore(policy, limits, clock, compiled_steps=True)
        self.python = BlockServiceCore(policy, limits, clock, compiled_steps=False)
        self.reference = BlockServiceCore(policy, limits, clock, compiled_steps=False)
        self.all = (self.compiled, self.python, self.reference)
        for core in self.all:
            ids = (f"session-{n}" for n in count())
            core.sessions.new_id = lambda ids=ids: next(ids)  # type: ignore[method-assign]
        self.counted = Counted()

    @contextmanager
    def _as(self, core: BlockServiceCore) -> Iterator[None]:
        if core is self.reference:
            with mock.patch.object(core_module, "run_step", reference_run_step):
                yield
        elif core is self.compiled:
            with mock.patch.object(core_module, "compiled_step", self.counted):
                yield
        else:
            yield

    def each(self, call: Callable[[BlockServiceCore], Any]) -> Any:
        """`call` on every core: the same outcome everywhere (a value or an error)."""
        outcomes = []
        for core in self.all:
            with self._as(core):
                try:
                    outcomes.append(("ok", call(core)))
                except BlockServiceError as error:
                    outcomes.append(("error", (error.code, error.message)))
                except DecodeError:
                    outcomes.append(("error", "DecodeError"))
        kinds = {kind for kind, _ in outcomes}
        assert len(kinds) == 1, outcomes
        return outcomes

    def step(self, data: bytes) -> block_pb2.StepResponse | None:
        outcomes = self.each(lambda core: core.step_wire(data))
        if outcomes[0][0] == "error":
            assert outcomes[0] == outcomes[1] == outcomes[2]
            return None
        answers = [block_pb2.StepResponse.FromString(value) for _, value in outcomes]
        assert answers[0] == answers[1] == answers[2], answers
        return answers[0]

    def same_state(self) -> None:
        states = []
        for core in self.all:
            for pm in core.pools.values():  # the routing load figure, kept step by step
                assert pm.uncomputed_tokens == sum(
                    len(seq.tokens) - seq.num_computed
                    for seqs in pm.seqs.values() for seq in seqs.values())
            state = full_state(core)
            for pool in state["pools"].values():  # a session's empty dict is made on first use
                pool["seqs"] = {sid: seqs for sid, seqs in pool["seqs"].items() if seqs}
            state["sessions"] = {
                sid: (*rest, None if last is None else answer_result(last))
                for sid, (*rest, last) in state["sessions"].items()}
            states.append(state)
        assert states[0] == states[1] == states[2]


def decode_batch(rng: random.Random, seqs: dict[int, Any], request: block_pb2.StepRequest) -> None:
    """APPENDs of one token to most live sequences, as a pipelined decode step sends them:
    fill the reserved position and reserve the next one, or a plain append; now and then a
    wrong lookahead, an old or impossible num_computed, a bad token."""
    for seq_id, seq in seqs.items():
        if rng.random() < 0.1:
            continue
        if len(seq.tokens) > rng.randrange(20, 80):  # finished
            add_op(request, OP_FREE, seq_id, computed=rng.choice([-1, len(seq.tokens) - 1]))
            continue
        reserved = seq.tokens[-1] == RESERVED
        position = len(seq.tokens)
        lookahead = int(reserved) if rng.random() < 0.9 else 1 - int(reserved)
        computed = rng.choice([position - 1, position - 1, position, -1,
                               rng.randrange(0, position + 1), position + 1])
        token = rng.randrange(VOCAB) if rng.random() < 0.97 else -rng.randrange(1, 5)
        add_op(request, OP_APPEND, seq_id, [token], computed=computed, lookahead=lookahead)


def add_op(request: block_pb2.StepRequest, kind: int, seq_id: int, tokens: Sequence[int] = (),
           parent: int = 0, computed: int = -1, lookahead: int = 0) -> None:
    request.op_kinds.append(kind)  # type: ignore[arg-type]
    request.seq_ids.append(seq_id)
    request.token_counts.append(len(tokens))
    request.token_ids.extend(tokens)
    request.parent_seq_ids.append(parent)
    request.num_computed_tokens.append(computed)
    request.num_lookahead_slots.append(lookahead)


def mixed_ops(rng: random.Random, seqs: dict[int, Any], next_id: Iterator[int],
              request: block_pb2.StepRequest) -> None:
    """A few operations of every kind, valid and not."""
    live = list(seqs)
    for _ in range(rng.randrange(1, 8)):
        roll = rng.random()
        seq_id = rng.choice(live) if live and rng.random() < 0.85 else rng.randrange(1, 200)
        if roll < 0.3:
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 14))]
            if rng.random() < 0.2:
                request.cache_salts[len(request.op_kinds)] = rng.choice(["", "t1", "t2"])
            add_op(request, OP_ALLOCATE, next(next_id), prompt)
        elif roll < 0.5:
            tokens = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 4))]
            add_op(request, OP_APPEND, seq_id, tokens,
                   computed=rng.choice([-1, 0, 3, 100]), lookahead=rng.choice([0, 0, 1, 2]))
        elif roll < 0.65:
            add_op(request, OP_FREE, seq_id, computed=rng.choice([-1, 2, 50]))
        elif roll < 0.8:
            add_op(request, OP_FORK, next(next_id), parent=seq_id)
        elif roll < 0.9:
            add_op(request, OP_COMMIT, seq_id, computed=rng.choice([-1, 1, 4, 8, 99]))
        else:
            add_op(request, rng.choice([0, 6, 99]), seq_id, rng.choice([[], [1]]),
                   lookahead=rng.choice([0, 1]))


def test_compiled_python_and_reference_steps_agree(clock: FakeClock) -> None:
    rng = random.Random(20261207)
    engines = Engines(clock)
    epochs = dict.fromkeys(POOLS, 1)
    for pool_id, (blocks, size) in POOLS.items():
        engines.each(lambda core, p=pool_id, b=blocks, s=size: core.create_pool(p, b, s, 1))
    sessions = [engines.each(lambda core: core.open_session("c", 10_000))[0][1][0]
                for _ in range(2)]
    step_ids = dict.fromkeys(sessions, 0)
    next_id = count(1000)
    events = {"retried": 0, "epoch": 0, "expired": 0, "whole-call errors": 0}
    for _ in range(2000):
        session_id = rng.choice(sessions)
        pool_id = rng.choice(list(POOLS))
        pm = engines.compiled.pools[pool_id]
        seqs = pm.seqs.get(session_id, {})
        request = block_pb2.StepRequest(session_id=session_id, pool_id=pool_id,
                                        epoch=rng.choice([0, epochs[pool_id]] * 9 + [7]))
        roll = rng.random()
        if roll < 0.06 and step_ids[session_id]:  # a retry, or a stale step id
            request.step_id = step_ids[session_id] - rng.choice([0, 0, 1])
            events["retried"] += 1
        else:
            step_ids[session_id] += 1
            request.step_id = step_ids[session_id]
        if rng.random() < 0.75 and seqs:
            decode_batch(rng, seqs, request)
        if rng.random() < 0.4 or len(seqs) < 4:
            mixed_ops(rng, seqs, next_id, request)
        if rng.random() < 0.3:
            del request.num_lookahead_slots[:]  # the column may be left out when all 0
        if engines.step(request.SerializeToString()) is None:
            events["whole-call errors"] += 1
        engines.same_state()
        if rng.random() < 0.01:  # the runner restarts: a new epoch, its sequences go stale
            epochs[pool_id] += 1
            engines.each(lambda core, p=pool_id: core.create_pool(
                p, POOLS[p][0], POOLS[p][1], epochs[p]))
            events["epoch"] += 1
        if rng.random() < 0.004:  # the clients go away: their leases run out
            clock.advance(11.0)
            engines.each(lambda core: core.reap_expired())
            engines.same_state()
            sessions = [engines.each(lambda core: core.open_session("c", 10_000))[0][1][0]
                        for _ in range(2)]
            step_ids.update(dict.fromkeys(sessions, 0))
            events["expired"] += 1
    for core in engines.all:
        check_invariants(core)
    counted = engines.counted
    # The inputs reached both halves of the compiled path, and the unusual cases happened.
    assert counted.fast > 3500, counted.fast
    assert counted.ops - counted.fast > 3000, (counted.ops, counted.fast)
    assert all(n > 0 for n in events.values()), events
    assert events["whole-call errors"] > 40, events


# ---- the C reader against protobuf's -----------------------------------------------------------
def field_bytes(message: block_pb2.StepRequest) -> dict[str, list[bytes]]:
    """The message as encoded pieces by field (one per map entry), which protobuf merges in
    any order into the same message."""
    pieces: dict[str, list[bytes]] = {}
    for descriptor, value in message.ListFields():
        name = descriptor.name
        part = block_pb2.StepRequest()
        if name == "cache_salts":
            for key, text in value.items():
                part = block_pb2.StepRequest()
                part.cache_salts[key] = text
                pieces.setdefault(name, []).append(part.SerializeToString())
        elif descriptor.is_repeated:
            getattr(part, name).extend(value)
            pieces[name] = [part.SerializeToString()]
        else:
            pieces[name] = [block_pb2.StepRequest(**{name: value}).SerializeToString()]
    return pieces


def varint(value: int) -> bytes:
    value &= (1 << 64) - 1
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def unpacked(number: int, values: Sequence[int]) -> bytes:
    return b"".join(varint(number << 3) + varint(v) for v in values)


def random_request(rng: random.Random) -> block_pb2.StepRequest:
    """Mostly a well-formed Step (columns of one length, token counts adding up), with
    extreme values in every column; now and then columns of any length."""
    n = rng.randrange(0, 6)
    shaped = rng.random() < 0.8

    def length() -> int:
        return n if shaped else rng.randrange(0, 6)

    request = block_pb2.StepRequest(
        session_id=rng.choice(["", "s", "sé-🙂"]), pool_id=rng.choice(["", "p"]),
        step_id=rng.choice([0, 1, 2**63, 2**64 - 1]), epoch=rng.choice([0, 3]),
        num_waiting_tokens=rng.choice([0, 17]))
    request.op_kinds.extend(rng.choice([0, 1, 2, 5, 99, -3]) for _ in range(n))
    request.seq_ids.extend(rng.choice([0, 5, 2**64 - 1]) for _ in range(length()))
    request.token_counts.extend(rng.randrange(0, 3) for _ in range(length()))
    num_tokens = sum(request.token_counts) if shaped else rng.randrange(0, 8)
    request.token_ids.extend(rng.choice([0, 7, -1, 2**31 - 1, -2**31])
                             for _ in range(num_tokens))
    request.parent_seq_ids.extend(rng.choice([0, 9]) for _ in range(length()))
    request.num_computed_tokens.extend(rng.choice([-1, 0, 2**62, -2**63])
                                       for _ in range(length()))
    request.num_lookahead_slots.extend(rng.choice([0, 1, 2**32 - 1])
                                       for _ in range(rng.choice([0, length()])))
    for _ in range(rng.randrange(0, 3)):
        request.cache_salts[rng.choice([0, 1, 2**32 - 1])] = rng.choice(["", "x", "ü"])
    return request


def written_oddly(rng: random.Random, request: block_pb2.StepRequest) -> bytes:
    by_field = field_bytes(request)
    if rng.random() < 0.5 and request.token_ids:  # columns not packed
        by_field["token_ids"] = [unpacked(8, request.token_ids)]
    if rng.random() < 0.3 and request.seq_ids:  # one column in two packed halves
        half = len(request.seq_ids) // 2
        by_field["seq_ids"] = [
            block_pb2.StepRequest(seq_ids=request.seq_ids[:half]).SerializeToString(),
            unpacked(6, request.seq_ids[half:])]
    pieces = [piece for parts in by_field.values() for piece in parts]
    if rng.random() < 0.3:  # unknown fields of every wire type
        pieces.append(varint(99 << 3) + varint(5))
        pieces.append(varint((100 << 3) | 2) + varint(3) + b"abc")
        pieces.append(varint((101 << 3) | 1) + bytes(8))
        pieces.append(varint((102 << 3) | 5) + bytes(4))
    rng.shuffle(pieces)
    if rng.random() < 0.3 and pieces:  # a scalar given twice: the last one wins
        pieces.append(block_pb2.StepRequest(step_id=rng.randrange(1, 9)).SerializeToString())
    return b"".join(pieces)


def broken(rng: random.Random, data: bytes) -> bytes:
    roll = rng.random()
    if roll < 0.3 and data:
        return data[:rng.randrange(len(data))]  # cut short
    if roll < 0.5:
        return data + varint((1 << 3) | 2) + varint(2) + b"\xff\xfe"  # invalid UTF-8
    if roll < 0.6:
        return data + varint((3 << 3) | 2) + varint(1) + b"\x01"  # a scalar with a wrong type
    if roll < 0.7:
        return data + varint((5 << 3) | 3)  # a group
    if roll < 0.75:
        return data + b"\xff" * 11  # a varint too long
    if roll < 0.8:  # a tag protobuf refuses: a field number past 32 bits, or 6 bytes long
        tag = rng.choice([varint(((1 << 32) + 1) << 3 | 2), b"\x8a\x80\x80\x80\x80\x00"])
        if rng.random() < 0.5:  # inside a cache_salts entry: its key's tag 6 bytes long
            entry = b"\x88\x80\x80\x80\x80\x00" + b"\x01" + b"\x12\x01a"
            return data + varint(11 << 3 | 2) + varint(len(entry)) + entry
        return data + tag + b"\x01x"
    mutated = bytearray(data or b"\x00")
    for _ in range(rng.randrange(1, 4)):
        mutated[rng.randrange(len(mutated))] = rng.randrange(256)
    return bytes(mutated)


def read_by_protobuf(data: bytes) -> Any:
    try:
        wire = parse_step(data, compiled=False)
    except DecodeError:
        return "DecodeError"
    columns = wire.columns
    assert columns is not None
    return (wire.session_id, wire.pool_id, wire.step_id, wire.epoch, wire.num_waiting_tokens,
            wire.lengths, wire.token_sum, wire.salts,
            [list(c) for c in (columns.kinds, columns.seq_ids, columns.token_counts,
                               columns.token_ids, columns.parent_ids, columns.computed,
                               columns.lookaheads)])


def read_by_c(data: bytes) -> Any:
    fields = compiled_step.parse(data)
    if fields is None:
        return None
    *header, parsed = fields
    # What the C arrays hold, through run's own reading of them: run a Step over no
    # sequences where every operation goes to `slow`, which records its arguments.
    seen: list[tuple[int, ...]] = []

    def slow(index: int, kind: int, seq_id: int, tokens: list[int], parent: int, computed: int,
             lookahead: int) -> OpResult:
        seen.append((index, kind, seq_id, *tokens, parent, computed, lookahead))
        return OpResult(status=3, error="x")

    lengths = header[5]
    if len(set(lengths[:3]) | {lengths[4], lengths[5]}) == 1 and \
            lengths[6] in (0, lengths[0]) and header[6] == lengths[3]:
        compiled_step.run(parsed, {}, [], lambda: 0, lambda: 0, lambda s, n: None, 1, 1, slow,
                          0, 0)
    return (*header, seen)


def test_the_c_reader_reads_as_protobuf_does() -> None:
    rng = random.Random(7)
    tally = {"valid, read by C": 0, "valid, left to protobuf": 0, "broken, refused": 0,
             "operations read back": 0}
    for _ in range(3000):
        request = random_request(rng)
        data = written_oddly(rng, request) if rng.random() < 0.7 else request.SerializeToString()
        if rng.random() < 0.35:
            data = broken(rng, data)
        expected = read_by_protobuf(data)
        got = read_by_c(data)
        if expected == "DecodeError":
            assert got is None, data  # C takes nothing protobuf refuses
            tally["broken, refused"] += 1
            continue
        if got is None:
            tally["valid, left to protobuf"] += 1
            continue
        tally["valid, read by C"] += 1
        assert tuple(got[:8]) == expected[:8], data
        columns = expected[8]
        if got[8]:  # the operations as run() read them
            offsets = [0]
            for n in columns[2]:
                offsets.append(offsets[-1] + n)
            want = [(i, columns[0][i], columns[1][i],
                     *columns[3][offsets[i]:offsets[i + 1]], columns[4][i], columns[5][i],
                     columns[6][i] if columns[6] else 0)
                    for i in range(len(columns[0]))]
            assert got[8] == want, data
            tally["operations read back"] += len(want)
    assert tally["valid, read by C"] > 1500, tally
    assert tally["operations read back"] > 500, tally
    assert tally["broken, refused"] > 300, tally


SLOTS_REBOUND = """
import sys
from block_service import _stepwire
from block_service.sequence import Sequence
from protos import block_pb2

seq = Sequence([5, 6, 7, 8], [3], 0, [], bytes(16))
request = block_pb2.StepRequest(op_kinds=[2], seq_ids=[1], token_counts=[1], token_ids=[9],
                                parent_seq_ids=[0], num_computed_tokens=[4])

def set_computed(s, n):  # rebinds the slots the append goes on to use
    s.tokens, s.block_table, s.num_computed = [0] * 5, [0] * 2, n

parsed = _stepwire.parse(request.SerializeToString())[-1]
answer, fast, _ = _stepwire.run(parsed, {1: seq}, [1] * 8, lambda: 4, lambda: 1, set_computed,
                                2, 8, None, 1, 1)
assert fast == 1 and block_pb2.StepResponse.FromString(answer).slot_mapping == [16]
"""


def test_the_compiled_append_holds_what_python_code_could_free_meanwhile() -> None:
    # set_computed and take are Python code that runs in the middle of an append; were the
    # sequence's lists only borrowed there, rebinding them would free what the append then
    # writes. The allocator's debug hooks (PYTHONMALLOC=debug) make such a write crash.
    done = subprocess.run([sys.executable, "-X", "dev", "-c", SLOTS_REBOUND],
                          env={**os.environ, "PYTHONMALLOC": "debug"}, capture_output=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-2000:].decode(errors="replace")
