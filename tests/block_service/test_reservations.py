"""Reserved positions (StepRequest.num_lookahead_slots): an APPEND with lookahead 1 reserves the
slot of a token not sampled yet; the sequence's next APPEND fills it with its first token.

Expected values are worked out by hand from protos/block.proto; a slot is checked against
block_table[p // block_size] * block_size + p % block_size for its position p.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from block_service import step as step_module
from block_service.core import REC_STEP, BlockServiceCore
from block_service.journal import encode_record, log_name, read_journal
from block_service.ops import (
    OP_ALLOCATE,
    OP_APPEND,
    OP_COMMIT,
    OP_FORK,
    OP_FREE,
    STATUS_INVALID_ARGUMENT,
    STATUS_NO_SPACE,
    STATUS_OK,
    BlockServiceError,
    ErrorCode,
    OpResult,
    StepResult,
)
from block_service.sequence import RESERVED, Sequence
from block_service.servicer import SERVICE_NAME, register
from block_service.sessions import LeasePolicy
from block_service.step import apply_op
from common.server import ServerOptions, start_server
from protos import block_pb2, block_pb2_grpc

from .conftest import FakeClock
from .invariants import check_invariants, full_state
from .test_journal import make_core as journaled_core
from .test_journal import reopened

R = RESERVED
P = "pool"
BS = 4
INVALID = STATUS_INVALID_ARGUMENT


class Op(NamedTuple):
    """One Step operation; `lookahead` is its num_lookahead_slots entry."""

    kind: int
    seq_id: int
    tokens: list[int]
    lookahead: int = 0
    computed: int = -1
    parent: int = 0


def allocate(seq_id: int, tokens: list[int]) -> Op:
    return Op(OP_ALLOCATE, seq_id, tokens)


def append(seq_id: int, tokens: list[int], lookahead: int = 0, computed: int = -1) -> Op:
    return Op(OP_APPEND, seq_id, tokens, lookahead, computed)


def reserve(seq_id: int, computed: int = -1) -> Op:
    """An APPEND of no tokens that only reserves the next position."""
    return Op(OP_APPEND, seq_id, [], 1, computed)


def commit(seq_id: int, computed: int) -> Op:
    return Op(OP_COMMIT, seq_id, [], 0, computed)


def free(seq_id: int, computed: int = -1) -> Op:
    return Op(OP_FREE, seq_id, [], 0, computed)


def fork(parent: int, child: int, computed: int = -1) -> Op:
    return Op(OP_FORK, child, [], 0, computed, parent)


@dataclass
class Client:
    """A session of a core, stepping with increasing step ids."""

    core: BlockServiceCore
    session: str
    step_id: int = 0

    def step(self, *ops: Op, lookaheads: list[int] | None = None) -> StepResult:
        """One Step of `ops` (the lookahead column from the ops unless given)."""
        self.step_id += 1
        if lookaheads is None:
            lookaheads = [op.lookahead for op in ops]
        return self.core.step(
            self.session, P, self.step_id, 0, [op.kind for op in ops], [op.seq_id for op in ops],
            [len(op.tokens) for op in ops], [t for op in ops for t in op.tokens],
            [op.parent for op in ops], [op.computed for op in ops], None, lookaheads)

    def seq(self, seq_id: int) -> Sequence:
        return self.core.pools[P].seqs[self.session][seq_id]

    def tokens(self, seq_id: int) -> list[int]:
        return list(self.seq(seq_id).tokens)

    def table(self, seq_id: int) -> list[int]:
        return list(self.seq(seq_id).block_table)


def client(make_core: Callable[..., BlockServiceCore], num_blocks: int = 16) -> Client:
    core = make_core()
    session, _ = core.open_session("test")
    core.create_pool(P, num_blocks, BS, 1)
    return Client(core, session)


def three_token_client(make_core: Callable[..., BlockServiceCore], reserved: bool) -> Client:
    """Sequence 1 allocated with [1, 2, 3], its next position reserved when `reserved`."""
    c = client(make_core)
    ok(c.step(allocate(1, [1, 2, 3])))
    if reserved:
        ok(c.step(reserve(1)))
    return c


def slot(table: list[int], position: int) -> int:
    return table[position // BS] * BS + position % BS


def ok(result: StepResult) -> StepResult:
    assert result.op_statuses == [STATUS_OK] * len(result.op_statuses), result.errors
    return result


def pools(core: BlockServiceCore) -> dict[str, Any]:
    """The full state of the pools (a Step always changes its session's last answer)."""
    return full_state(core)["pools"]


def without_counters(core: BlockServiceCore) -> dict[str, Any]:
    return {pool_id: {**state, "counters": None} for pool_id, state in pools(core).items()}


# ---- reserving and filling ---------------------------------------------------------------------

def test_reserve_only_hands_out_the_slot_of_the_next_position(make_core):
    c = client(make_core)
    ok(c.step(allocate(1, [1, 2, 3]), allocate(2, [1, 2, 3, 4])))
    result = ok(c.step(reserve(1), reserve(2)))
    assert c.tokens(1) == [1, 2, 3, R] and c.tokens(2) == [1, 2, 3, 4, R]
    assert c.seq(1).num_known == 3 and c.seq(2).num_known == 4
    # Position 3 is in seq 1's block 0; position 4 starts seq 2's block 1.
    assert len(c.table(1)) == 1 and len(c.table(2)) == 2
    assert result.slot_counts == [1, 1]
    assert result.slot_mapping == [slot(c.table(1), 3), slot(c.table(2), 4)]
    assert (result.table_starts, result.table_counts) == ([1, 1], [0, 1])
    assert result.table_block_ids == c.table(2)[1:] and result.copies == []
    check_invariants(c.core)


def test_steady_decode_fills_and_reserves_one_slot_per_step_across_blocks(make_core):
    c = client(make_core)
    prompt = [7, 8, 9]
    ok(c.step(allocate(1, prompt)))
    # The prompt's sampled token goes to position 3, position 4 is reserved: two slots.
    first = ok(c.step(append(1, [10], lookahead=1, computed=3)))
    assert first.slot_mapping == [slot(c.table(1), 3), slot(c.table(1), 4)]
    sampled, handed_out = [10], list(first.slot_mapping)
    for token in range(11, 26):  # positions 5 .. 19 reserved: blocks 1 to 4
        position = len(c.tokens(1))  # the reserved position after this step's fill
        table_before = c.table(1)
        result = ok(c.step(append(1, [token], lookahead=1, computed=position - 1)))
        sampled.append(token)
        table = c.table(1)
        assert c.tokens(1) == [*prompt, *sampled, R]
        assert result.slot_counts == [1]
        assert result.slot_mapping == [slot(table, position)]
        new_block = position % BS == 0
        assert table[:len(table_before)] == table_before
        assert len(table) == len(table_before) + new_block
        assert (result.table_starts, result.table_counts) == ([len(table_before)], [new_block])
        assert result.table_block_ids == table[len(table_before):]
        assert c.seq(1).num_computed == position - 1
        handed_out += result.slot_mapping
        check_invariants(c.core)
    assert len(c.table(1)) == 5
    # One slot per position, each handed out once.
    assert handed_out == [slot(c.table(1), p) for p in range(3, 20)]


def test_fill_only_gets_no_slot_and_the_next_append_continues(make_core):
    c = client(make_core)
    ok(c.step(allocate(1, [1, 2, 3]), allocate(2, [1, 2, 3])))
    ok(c.step(reserve(1), reserve(2)))
    tables = c.table(1), c.table(2)
    result = ok(c.step(append(1, [4])))  # lookahead 0: only the reserved position's token
    assert (result.slot_counts, result.slot_mapping) == ([0], [])
    assert (result.table_counts, result.copies) == ([0], [])
    assert c.tokens(1) == [1, 2, 3, 4] and c.table(1) == tables[0]
    after = ok(c.step(append(1, [5])))
    assert after.slot_mapping == [slot(c.table(1), 4)]
    # The single-operation Append RPC fills the same way (and answers the whole table).
    single = c.core.append(c.session, P, 2, [4], 3)
    assert single.slots == [] and single.table_block_ids == tables[1]
    assert c.tokens(2) == [1, 2, 3, 4] and c.seq(2).num_computed == 3
    check_invariants(c.core)


@pytest.mark.parametrize("lookahead", [0, 1])
def test_fill_and_more_tokens_slot_only_the_new_positions(make_core, lookahead):
    c = client(make_core)
    ok(c.step(allocate(1, [1, 2])))
    ok(c.step(reserve(1)))  # position 2
    # 3 fills position 2; 4, 5, 6 go to positions 3, 4, 5 (and 6 is reserved with lookahead).
    result = ok(c.step(append(1, [3, 4, 5, 6], lookahead, computed=3)))
    assert c.tokens(1) == [1, 2, 3, 4, 5, 6] + [R] * lookahead
    assert result.slot_mapping == [slot(c.table(1), p) for p in range(3, 6 + lookahead)]
    assert result.table_counts == [1]
    assert c.seq(1).num_computed == 3  # counts the filled token
    check_invariants(c.core)


# ---- num_computed_tokens ------------------------------------------------------------------------

@pytest.mark.parametrize("reserved, op, status", [
    # Seq 1 has 3 tokens, none reserved: an APPEND counts at most those.
    pytest.param(False, append(1, [9], 1, computed=3), STATUS_OK, id="append-reserve-3"),
    pytest.param(False, append(1, [9], 1, computed=4), INVALID, id="append-reserve-4"),
    pytest.param(False, reserve(1, computed=3), STATUS_OK, id="reserve-only-3"),
    pytest.param(False, reserve(1, computed=4), INVALID, id="reserve-only-4"),
    # Seq 1 has 3 tokens and position 3 reserved: after a fill 4 are known.
    pytest.param(True, append(1, [9], 1, computed=4), STATUS_OK, id="fill-reserve-4"),  # inline
    pytest.param(True, append(1, [9], 1, computed=5), INVALID, id="fill-reserve-5"),
    pytest.param(True, append(1, [9], computed=4), STATUS_OK, id="fill-only-4"),
    pytest.param(True, append(1, [9], computed=5), INVALID, id="fill-only-5"),
    pytest.param(True, append(1, [9, 9], computed=5), INVALID, id="fill-and-one-5"),
    pytest.param(True, commit(1, 3), STATUS_OK, id="commit-3"),
    pytest.param(True, commit(1, 4), INVALID, id="commit-4"),
    pytest.param(True, free(1, 3), STATUS_OK, id="free-3"),
    pytest.param(True, free(1, 4), INVALID, id="free-4"),
])
def test_num_computed_never_counts_a_reserved_or_unfilled_position(make_core, reserved, op,
                                                                     status):
    c = three_token_client(make_core, reserved)
    before = pools(c.core)
    result = c.step(op)
    assert result.op_statuses == [status], result.errors
    if status == INVALID:
        assert "num_computed_tokens" in result.errors[0]
        assert pools(c.core) == before
    elif op.kind != OP_FREE:
        assert c.seq(1).num_computed == op.computed
    check_invariants(c.core)


@pytest.mark.parametrize("fill_lookahead", [1, 0], ids=["fill-and-reserve", "fill-only"])
def test_a_block_is_published_once_its_reserved_position_is_filled_and_computed(
        make_core, fill_lookahead):
    c = client(make_core)
    ok(c.step(allocate(1, [1, 2, 3])))
    ok(c.step(reserve(1, computed=3)))  # position 3 is block 0's last
    ok(c.step(commit(1, 3)))
    pool = c.core.pools[P].pool
    assert pool.hash_to_block == {} and c.seq(1).num_published == 0
    assert c.core.match_prefix(P, [1, 2, 3, 4, 5]) == 0
    ok(c.step(append(1, [4], fill_lookahead, computed=4)))
    block = c.table(1)[0]
    assert c.seq(1).num_published == 1
    assert pool.hash_to_block == {c.seq(1).hashes[0]: block}
    cached = pool.cached_block(block)
    assert cached is not None and cached.token_ids == (1, 2, 3, 4)
    assert c.core.match_prefix(P, [1, 2, 3, 4, 5]) == 4
    other = ok(c.step(allocate(2, [1, 2, 3, 4, 5])))
    assert other.num_cached_tokens == [4] and c.table(2)[0] == block
    check_invariants(c.core)


def test_a_freed_reserved_sequence_publishes_only_its_known_blocks(make_core):
    c = client(make_core)
    ok(c.step(allocate(1, [1, 2, 3, 4, 5, 6, 7])))
    ok(c.step(reserve(1)))  # position 7 ends block 1
    ok(c.step(free(1, 7)))
    pool = c.core.pools[P].pool
    assert len(pool.hash_to_block) == 1
    assert all(R not in cached.token_ids for cached in pool.cached_blocks())
    assert c.core.match_prefix(P, [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 4
    check_invariants(c.core)


# ---- refused operations ------------------------------------------------------------------------

def test_fork_of_a_reserved_parent_is_refused_and_changes_nothing(make_core):
    c = client(make_core)
    ok(c.step(allocate(1, [1, 2, 3, 4, 5])))
    ok(c.step(reserve(1)))
    before = pools(c.core)
    result = c.step(fork(1, 2, computed=4))
    assert result.op_statuses == [INVALID] and "reserved" in result.errors[0]
    assert pools(c.core) == before  # no child, no refs, num_computed not recorded
    with pytest.raises(BlockServiceError) as error:
        c.core.fork(c.session, P, 1, 2)
    assert error.value.code is ErrorCode.INVALID_ARGUMENT
    assert pools(c.core) == before
    ok(c.step(append(1, [6])))  # filled: it forks
    ok(c.step(fork(1, 2)))
    assert c.tokens(2) == [1, 2, 3, 4, 5, 6] and c.table(2) == c.table(1)
    check_invariants(c.core)


def test_a_second_reservation_before_the_fill_is_refused(make_core):
    c = client(make_core)
    ok(c.step(allocate(1, [1, 2, 3])))
    ok(c.step(reserve(1)))
    before = pools(c.core)
    result = c.step(reserve(1))
    assert result.op_statuses == [INVALID] and "reserved" in result.errors[0]
    assert (result.slot_counts, result.slot_mapping) == ([0], [])
    assert pools(c.core) == before
    check_invariants(c.core)


@pytest.mark.parametrize("op", [
    pytest.param(append(1, [9], lookahead=2), id="append-1-token-2"),
    pytest.param(append(1, [], lookahead=2), id="append-no-token-2"),
    pytest.param(append(1, [9, 9], lookahead=2), id="append-2-tokens-2"),
    pytest.param(append(1, [9], lookahead=2**32 - 1), id="append-uint32-max"),
    pytest.param(Op(OP_ALLOCATE, 5, [1, 2], lookahead=1), id="allocate-1"),
    pytest.param(Op(OP_FREE, 1, [], lookahead=1), id="free-1"),
    pytest.param(Op(OP_COMMIT, 1, [], lookahead=1, computed=2), id="commit-1"),
    pytest.param(Op(OP_FORK, 5, [], lookahead=1, parent=1), id="fork-1"),
])
@pytest.mark.parametrize("reserved", [False, True], ids=["plain", "reserved"])
def test_lookahead_other_than_0_or_1_or_on_another_kind_is_refused(make_core, op, reserved):
    c = three_token_client(make_core, reserved)
    before = pools(c.core)
    result = c.step(op)
    assert result.op_statuses == [INVALID]
    assert "num_lookahead_slots" in result.errors[0]
    assert pools(c.core) == before


@pytest.mark.parametrize("lookaheads", [[1], [0, 0, 0]])
def test_a_lookahead_column_of_another_length_fails_the_whole_step(make_core, lookaheads):
    c = client(make_core)
    ok(c.step(allocate(1, [1, 2, 3]), allocate(2, [4, 5])))
    before = full_state(c.core)
    with pytest.raises(BlockServiceError) as error:
        c.step(append(1, [4]), append(2, [6]), lookaheads=lookaheads)
    assert error.value.code is ErrorCode.INVALID_ARGUMENT
    assert "num_lookahead_slots" in error.value.message
    assert full_state(c.core) == before


def test_reserving_a_block_when_none_is_free_is_no_space_and_changes_nothing(make_core):
    c = client(make_core, num_blocks=3)
    ok(c.step(allocate(1, [1, 2, 3, 4]), allocate(2, [5, 6, 7, 8, 9, 10, 11])))  # all 3 blocks
    ok(c.step(reserve(2)))  # position 7: still in block 1 of seq 2
    before = without_counters(c.core)
    refused = [reserve(1), append(1, [5], lookahead=1, computed=4),
               append(2, [12], lookahead=1, computed=8)]  # the fill is not applied either
    for op in refused:
        result = c.step(op)
        assert result.op_statuses == [STATUS_NO_SPACE], op
        assert (result.slot_counts, result.slot_mapping) == ([0], [])
        assert without_counters(c.core) == before
    assert c.tokens(2) == [5, 6, 7, 8, 9, 10, 11, R] and c.seq(2).num_computed == 0
    assert c.core.stats(P).no_space == len(refused)
    ok(c.step(append(2, [12])))  # filling only needs no block
    check_invariants(c.core)


def test_a_reservation_past_the_pool_size_is_invalid_argument(make_core):
    c = client(make_core, num_blocks=2)
    ok(c.step(allocate(1, [1, 2, 3, 4, 5, 6, 7])))
    ok(c.step(append(1, [8])))  # both blocks full
    before = pools(c.core)
    for op in (reserve(1), append(1, [9], lookahead=1)):
        assert c.step(op).op_statuses == [INVALID], op
        assert pools(c.core) == before


# ---- copy-on-write ------------------------------------------------------------------------------

def test_reserving_into_a_block_shared_by_a_fork_copies_it(make_core):
    c = client(make_core)
    ok(c.step(allocate(1, [1, 2, 3, 4, 5, 6])))  # block 1 holds positions 4, 5
    ok(c.step(fork(1, 2)))
    first, shared = c.table(1)
    result = ok(c.step(reserve(2)))  # position 6 of the child
    copy = c.table(2)[1]
    assert copy != shared and result.copies == [(shared, copy)]
    assert (result.table_starts, result.table_counts) == ([1], [1])
    assert result.table_block_ids == [copy]
    assert result.slot_mapping == [copy * BS + 2]
    assert c.table(1) == [first, shared] and c.table(2) == [first, copy]
    # The parent now holds its block alone: its token and reservation are written in place.
    result = ok(c.step(append(1, [7], lookahead=1)))
    assert result.copies == [] and result.slot_mapping == [shared * BS + 2, shared * BS + 3]
    # Filling writes no new position: no slot, no copy.
    result = ok(c.step(append(2, [8])))
    assert (result.slot_counts, result.copies, result.table_counts) == ([0], [], [0])
    # Shared full blocks: new positions start a new block, nothing is copied.
    ok(c.step(append(1, [8]), fork(1, 3)))
    result = ok(c.step(append(3, [9, 10], lookahead=1)))  # positions 8, 9 (+ 10 reserved)
    assert result.copies == []
    assert result.slot_mapping == [slot(c.table(3), p) for p in (8, 9, 10)]
    # A sampled token plus a reservation in a shared partly filled block: one copy for both.
    ok(c.step(append(1, [11]), fork(1, 4)))  # the parent's block 2 holds position 8
    shared = c.table(1)[2]
    result = ok(c.step(append(4, [12], lookahead=1)))
    assert result.copies == [(shared, c.table(4)[2])] and c.table(1)[2] == shared
    assert result.slot_mapping == [slot(c.table(4), 9), slot(c.table(4), 10)]
    check_invariants(c.core)


# ---- the inline path and the full path ---------------------------------------------------------

# (kind, pick, token count, APPEND lookahead, other kinds' lookahead, num_computed): the
# pick chooses a live sequence; the num_computed is set against the sequence's bound.
draw_st = st.tuples(
    st.sampled_from(["append"] * 10 + ["fork", "fork", "free", "commit", "allocate"]),
    st.integers(0, 10**6),
    st.sampled_from([1, 1, 1, 1, 1, 1, 0, 2, 3]),
    st.sampled_from([1, 1, 1, 0, 0, 2]),
    st.sampled_from([0] * 9 + [1]),
    st.sampled_from(["keep", "bound", "bound", "behind", "behind", "over"]),
)
schedule_st = st.lists(st.lists(draw_st, min_size=1, max_size=4), min_size=1, max_size=20)


def concrete(draw: tuple[Any, ...], seqs: dict[int, Sequence], new_ids: Iterator[int],
             new_tokens: Iterator[int]) -> Op:
    """The drawn operation against the sequences as they are before its Step. Every token is
    new, so that the operations that reach apply_op can be told apart by their tokens."""
    name, pick, count, append_lookahead, other_lookahead, how = draw
    live = sorted(seqs)
    seq_id = live[pick % len(live)] if live else 99
    seq = seqs.get(seq_id)
    tokens = [next(new_tokens) for _ in range(count)]
    bound = 0
    if seq is not None:
        reserved = seq.tokens[-1] == R
        known = len(seq.tokens) - reserved
        bound = known + (reserved and name == "append" and bool(tokens))
    computed = {"keep": -1, "bound": bound, "behind": max(0, bound - 1), "over": bound + 1}[how]
    if name == "append":
        return append(seq_id, tokens, append_lookahead, computed)
    if name == "allocate":
        return Op(OP_ALLOCATE, next(new_ids), [next(new_tokens), *tokens], other_lookahead)
    if name == "fork":
        return Op(OP_FORK, next(new_ids), [], other_lookahead, computed, seq_id)
    return Op(OP_FREE if name == "free" else OP_COMMIT, seq_id, [], other_lookahead, computed)


def one_by_one(core: BlockServiceCore, session: str, ops: list[Op]) -> tuple[
        StepResult, list[bool]]:
    """The ops through apply_op one at a time, as the columns a Step answers, and whether each
    one's sequence had its last position reserved just before it."""
    pm = core.pools[P]
    results: list[OpResult] = []
    was_reserved = []
    for op in ops:
        seq = pm.seqs.get(session, {}).get(op.seq_id)
        was_reserved.append(seq is not None and seq.tokens[-1] == R)
        results.append(apply_op(pm, session, op.kind, op.seq_id, list(op.tokens), op.parent,
                                op.computed, "", core._scope(session, pm), op.lookahead))
    good = [r if r.status == STATUS_OK else OpResult(status=r.status, error=r.error)
            for r in results]
    return StepResult(
        0, pm.epoch, [r.status for r in good], [r.num_cached_tokens for r in good],
        [r.table_start for r in good], [len(r.table_block_ids) for r in good],
        [b for r in good for b in r.table_block_ids], [len(r.slots) for r in good],
        [s for r in good for s in r.slots], [c for r in good for c in r.copies],
        {i: r.error for i, r in enumerate(good) if r.status != STATUS_OK}), was_reserved


def test_inline_and_full_paths_agree_on_random_decode_steps(make_core, monkeypatch):
    """Steps of mostly one-token APPENDs with and without lookahead (run_step's inline path
    where it applies) against the same operations through apply_op one at a time (the full
    PoolManager path) on a second core: the same answers and the same state after each."""
    slow_tokens: list[list[int]] = []  # the tokens of every operation run_step hands on

    def recording_apply_op(*args: Any, **kwargs: Any) -> OpResult:
        slow_tokens.append(list(args[4]))
        return apply_op(*args, **kwargs)

    monkeypatch.setattr(step_module, "apply_op", recording_apply_op)
    seen = {"inline fill": 0, "inline plain": 0, "full one-token": 0, "copies": 0,
            "no space": 0}

    @settings(max_examples=150, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(schedule=schedule_st)
    def check(schedule: list[list[tuple[Any, ...]]]) -> None:
        inline_core = Client(make_core(), "s")
        full_core = make_core()
        for core in (inline_core.core, full_core):
            core.sessions.start("s", "test", 10.0)
            core.create_pool(P, 8, BS, 1)
        new_ids, new_tokens = itertools.count(10), itertools.count(100)
        prompts = [allocate(1, [1, 2, 3]), allocate(2, [4, 5, 6, 7]), allocate(3, [8])]
        for index in range(-1, len(schedule)):
            seqs = full_core.pools[P].seqs.get("s", {})
            ops = prompts if index < 0 else [concrete(drawn, seqs, new_ids, new_tokens)
                                             for drawn in schedule[index]]
            slow_tokens.clear()
            inline = inline_core.step(*ops)
            expected, was_reserved = one_by_one(full_core, "s", ops)
            assert inline.op_statuses == expected.op_statuses, ops
            assert inline.errors == expected.errors, ops
            for column in ("num_cached_tokens", "table_starts", "table_counts",
                           "table_block_ids", "slot_counts", "slot_mapping", "copies"):
                assert getattr(inline, column) == getattr(expected, column), (column, ops)
            assert full_state(inline_core.core)["pools"] == full_state(full_core)["pools"]
            check_invariants(inline_core.core)
            handed_on = {token for tokens in slow_tokens for token in tokens}
            for op, reserved in zip(ops, was_reserved, strict=True):
                if op.kind == OP_APPEND and len(op.tokens) == 1:
                    if op.tokens[0] in handed_on:
                        seen["full one-token"] += 1
                    else:
                        seen["inline fill" if reserved else "inline plain"] += 1
            seen["copies"] += len(inline.copies)
            seen["no space"] += inline.op_statuses.count(STATUS_NO_SPACE)

    check()
    assert all(seen.values()), seen  # both paths, and copies and NO_SPACE, were exercised


# ---- journal -------------------------------------------------------------------------------------

def play_reservations(c: Client) -> None:
    """Steps that reserve, fill, refuse and publish, ending with a reserved sequence."""
    ok(c.step(allocate(1, [1, 2, 3]), allocate(2, [4, 5, 6, 7, 8])))
    ok(c.step(append(1, [9], 1, computed=3), reserve(2, computed=5)))
    for token in range(10, 16):
        lengths = [len(c.tokens(seq_id)) for seq_id in (1, 2)]  # the reserved one counted
        ok(c.step(append(1, [token], 1, lengths[0]), append(2, [token], 1, lengths[1] - 1)))
    refused = c.step(fork(1, 3), reserve(2), append(1, [1], lookahead=2))
    assert refused.op_statuses == [INVALID] * 3
    ok(c.step(append(1, [20]), append(2, [21, 22], 1, computed=len(c.tokens(2)))))
    ok(c.step(fork(1, 3), commit(2, len(c.tokens(2)) - 1)))
    ok(c.step(reserve(1), append(3, [23], lookahead=1), free(2, 3)))


@pytest.mark.parametrize("every", [1000, 3])
def test_replay_of_steps_with_reservations_rebuilds_the_state(tmp_path: Path, every: int):
    live = journaled_core(FakeClock(), tmp_path, every)
    live.create_pool(P, 16, BS, 1)
    c = Client(live, live.open_session("t")[0])
    play_reservations(c)
    assert c.tokens(1)[-1] == R and c.tokens(3)[-1] == R
    check_invariants(live)
    rebuilt = reopened(tmp_path, live)
    assert full_state(rebuilt) == full_state(live)
    check_invariants(rebuilt)


def test_a_step_record_from_before_lookaheads_still_replays(tmp_path: Path):
    live = journaled_core(FakeClock(), tmp_path / "live")
    live.create_pool(P, 16, BS, 1)
    c = Client(live, live.open_session("t")[0])
    ok(c.step(allocate(1, [1, 2, 3]), allocate(2, [4, 5, 6, 7, 8]), lookaheads=[]))
    ok(c.step(append(1, [9], computed=3), fork(2, 3), lookaheads=[]))
    ok(c.step(append(3, [10, 11], computed=5), commit(1, 4), lookaheads=[]))
    recovered = read_journal(tmp_path / "live")
    assert recovered.state is None
    steps = [args for kind, args in recovered.records if kind == REC_STEP]
    assert len(steps) == 3 and all(len(args) == 11 and args[-1] == [] for args in steps)
    # The same log with the step records as written before the lookaheads argument existed.
    old = tmp_path / "old"
    old.mkdir()
    (old / log_name(0)).write_bytes(b"".join(
        encode_record(kind, args[:-1] if kind == REC_STEP else args)
        for kind, args in recovered.records))
    assert [len(args) for kind, args in read_journal(old).records if kind == REC_STEP] == [10] * 3
    rebuilt = reopened(old, live)
    assert full_state(rebuilt) == full_state(live)
    check_invariants(rebuilt)


# ---- over gRPC ---------------------------------------------------------------------------------

def test_servicer_passes_num_lookahead_slots_through():
    core = BlockServiceCore(LeasePolicy(10.0, 0.5, 60.0))
    options = ServerOptions(port=0)
    service = start_server(options, register(core, options.max_workers), [SERVICE_NAME])
    channel = grpc.insecure_channel(f"127.0.0.1:{service.port}")
    try:
        stub = block_pb2_grpc.BlockServiceStub(channel)
        stub.CreatePool(block_pb2.CreatePoolRequest(pool_id=P, num_blocks=16, block_size=BS,
                                                    epoch=1))
        session = stub.OpenSession(block_pb2.OpenSessionRequest(client_name="t")).session_id

        def request(step_id: int, kind: block_pb2.OpKind, tokens: list[int],
                    lookaheads: list[int]) -> block_pb2.StepRequest:
            return block_pb2.StepRequest(
                session_id=session, pool_id=P, step_id=step_id, epoch=1, op_kinds=[kind],
                seq_ids=[1], token_counts=[len(tokens)], token_ids=tokens, parent_seq_ids=[0],
                num_computed_tokens=[-1], num_lookahead_slots=lookaheads)

        allocated = stub.Step(request(1, block_pb2.OP_KIND_ALLOCATE, [1, 2, 3], []))
        first = allocated.table_block_ids[0]
        reserving = stub.Step(request(2, block_pb2.OP_KIND_APPEND, [4], [1]))
        assert list(reserving.op_statuses) == [block_pb2.OP_STATUS_OK]
        second = reserving.table_block_ids[0]
        assert list(reserving.slot_mapping) == [first * BS + 3, second * BS]
        filling = stub.Step(request(3, block_pb2.OP_KIND_APPEND, [5], [1]))
        assert list(filling.slot_mapping) == [second * BS + 1]
        assert core.pools[P].seqs[session][1].tokens == [1, 2, 3, 4, 5, R]
        refused = stub.Step(request(4, block_pb2.OP_KIND_APPEND, [6], [2]))
        assert list(refused.op_statuses) == [block_pb2.OP_STATUS_INVALID_ARGUMENT]
        with pytest.raises(grpc.RpcError) as error:
            stub.Step(request(5, block_pb2.OP_KIND_APPEND, [6], [1, 1]))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        check_invariants(core)
    finally:
        channel.close()
        service.stop(grace_s=0)
