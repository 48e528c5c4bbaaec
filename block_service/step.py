"""Applying one Step: every operation of a scheduling step, in order, one result each.

The hot path of a serving step is a decode append of one token: into the sequence's last
block when it has room and is not shared, or into a new block when the token starts one.
`run_step` handles exactly those cases inline (no per-operation call or object); every other
operation, or anything unusual about those (unknown sequence, copy-on-write, no free block,
a bad value), goes through `apply_op` and the PoolManager methods, which validate fully.
Both ways do the same checks, so an operation gets the same answer on either.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from block_service.ops import (
    INT32_MAX,
    NOT_CHANGED,
    OP_ALLOCATE,
    OP_APPEND,
    OP_COMMIT,
    OP_FORK,
    OP_FREE,
    STATUS_ALREADY_EXISTS,
    STATUS_INVALID_ARGUMENT,
    STATUS_OK,
    OpResult,
    StepResult,
)
from block_service.pool_manager import PoolManager, failed
from block_service.sequence import RESERVED


@dataclass(frozen=True)
class SessionScope:
    """What an operation must know of its session beyond the pool it runs in."""

    # Whether the session holds this seq id in another pool (seq ids are unique per session).
    held_elsewhere: Callable[[int], bool]
    # Live sequences of the session in every pool, and how many it may hold.
    num_seqs: Callable[[], int]
    max_seqs: int


def new_seq_refused(pm: PoolManager, session_id: str, seq_id: int,
                    scope: SessionScope) -> OpResult | None:
    """Why a new sequence (ALLOCATE, FORK child) may not be created, or None."""
    if pm.holds(session_id, seq_id) or scope.held_elsewhere(seq_id):
        return failed(STATUS_ALREADY_EXISTS, f"sequence {seq_id} already exists")
    held = scope.num_seqs()
    if held >= scope.max_seqs:
        return failed(STATUS_INVALID_ARGUMENT,
                      f"the session holds {held} sequences: the limit is {scope.max_seqs} "
                      "(max_seqs_per_session)")
    return None


def apply_op(pm: PoolManager, session_id: str, kind: int, seq_id: int, token_ids: Sequence[int],
             parent_id: int, num_computed: int, cache_salt: str, scope: SessionScope,
             lookahead: int = 0) -> OpResult:
    """One operation through the fully validating PoolManager methods."""
    if num_computed < NOT_CHANGED:
        return failed(STATUS_INVALID_ARGUMENT, f"num_computed_tokens {num_computed} < -1")
    if kind == OP_APPEND:
        return pm.append(session_id, seq_id, token_ids, num_computed, lookahead)
    if lookahead:
        return failed(STATUS_INVALID_ARGUMENT, f"num_lookahead_slots {lookahead} on op kind "
                                               f"{kind}: only APPEND reserves positions")
    if kind == OP_ALLOCATE:
        return (new_seq_refused(pm, session_id, seq_id, scope)
                or pm.allocate(session_id, seq_id, token_ids, cache_salt))
    if kind not in (OP_FREE, OP_FORK, OP_COMMIT):
        return failed(STATUS_INVALID_ARGUMENT, f"unknown op kind {kind}")
    if token_ids:
        return failed(STATUS_INVALID_ARGUMENT, f"op kind {kind} takes no tokens "
                                               f"(token_count {len(token_ids)})")
    if kind == OP_FREE:
        return pm.free(session_id, seq_id, num_computed)
    if kind == OP_COMMIT:
        return pm.commit(session_id, seq_id, num_computed)
    return (new_seq_refused(pm, session_id, seq_id, scope)
            or pm.fork(session_id, parent_id, seq_id, num_computed))


def run_step(pm: PoolManager, session_id: str, step_id: int, kinds: Sequence[int],
             seq_ids: Sequence[int], token_counts: Sequence[int], token_ids: Sequence[int],
             parent_ids: Sequence[int], computed: Sequence[int],
             cache_salts: Mapping[int, str], scope: SessionScope,
             lookaheads: Sequence[int] = ()) -> StepResult:
    """Applies the (already shape-checked) columns of a Step in order (`lookaheads` empty:
    no operation reserves a position)."""
    num_ops = len(kinds)
    lookaheads = lookaheads or [0] * num_ops
    statuses = [STATUS_OK] * num_ops
    cached = [0] * num_ops
    starts = [0] * num_ops
    table_counts = [0] * num_ops
    slot_counts = list(token_counts)  # right for every successful op but ALLOCATE
    block_ids: list[int] = []
    slots: list[int] = []
    copies: list[tuple[int, int]] = []
    errors: dict[int, str] = {}
    # Bound once: the fast paths below run per decode token.
    seqs_get = pm.session_seqs(session_id).get
    pool = pm.pool
    refs = pool.ref_counts
    take = pool.take
    num_free = pool.num_free
    capacity = pool.num_blocks
    set_computed = pm.set_computed
    shift = pm.shift
    mask = pm.block_size - 1
    add_slot = slots.append
    add_block = block_ids.append
    offset = 0
    fast_appends = 0
    computed_here = 0  # num_computed raised here, not through set_computed
    for i, kind, count, seq_id, num_computed, lookahead in zip(
            range(num_ops), kinds, token_counts, seq_ids, computed, lookaheads, strict=True):
        if count == 1 and kind == OP_APPEND:
            seq = seqs_get(seq_id)
            if seq is not None:
                token = token_ids[offset]
                tokens = seq.tokens
                # One new position either way: the token itself, or (when it fills a
                # reservation) the position reserved after it.
                filling = tokens[-1] == RESERVED
                position = len(tokens)
                if (filling == lookahead and 0 <= token <= INT32_MAX
                        and NOT_CHANGED <= num_computed <= position):
                    new_token = RESERVED if filling else token
                    table = seq.block_table
                    column = position & mask  # 0: the new position starts a new block
                    if column:
                        last = table[-1]
                        if refs[last] == 1:  # not shared: write in place
                            if filling:
                                tokens[-1] = token
                            if num_computed > seq.num_computed:
                                if num_computed >> shift > seq.num_published:
                                    set_computed(seq, num_computed)  # publishes blocks
                                else:
                                    computed_here += num_computed - seq.num_computed
                                    seq.num_computed = num_computed
                            tokens.append(new_token)
                            starts[i] = len(table)
                            add_slot((last << shift) | column)
                            offset += 1
                            fast_appends += 1
                            continue
                    elif len(table) < capacity and num_free():
                        if filling:
                            tokens[-1] = token
                        set_computed(seq, num_computed)
                        block = take()
                        starts[i] = len(table)
                        table_counts[i] = 1
                        table.append(block)
                        tokens.append(new_token)
                        add_block(block)
                        add_slot(block << shift)
                        offset += 1
                        fast_appends += 1
                        continue
        result = apply_op(pm, session_id, kind, seq_id, token_ids[offset:offset + count],
                          parent_ids[i], num_computed, cache_salts.get(i, ""), scope, lookahead)
        offset += count
        statuses[i] = result.status
        if result.status != STATUS_OK:
            errors[i] = result.error
            slot_counts[i] = 0
            continue
        cached[i] = result.num_cached_tokens
        starts[i] = result.table_start
        table_counts[i] = len(result.table_block_ids)
        block_ids.extend(result.table_block_ids)
        slot_counts[i] = len(result.slots)
        slots.extend(result.slots)
        copies.extend(result.copies)
    pm.appended_tokens += fast_appends
    pm.uncomputed_tokens += fast_appends - computed_here
    return StepResult(step_id, pm.epoch, statuses, cached, starts, table_counts, block_ids,
                      slot_counts, slots, copies, errors)
