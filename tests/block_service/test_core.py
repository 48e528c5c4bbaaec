"""Unit tests of the block service core: the seed's examples, prefix caching, bad input.

Expected values are computed by hand from the rules in protos/block.proto.
"""

from __future__ import annotations

import struct
import sys
from typing import Any

import pytest
import xxhash

from block_service.core import BlockServiceCore, Limits
from block_service.hashing import ROOT_HASH, block_hash, chain_hashes, root_hash
from block_service.ops import (
    OP_ALLOCATE,
    OP_APPEND,
    OP_COMMIT,
    OP_FORK,
    OP_FREE,
    STATUS_ALREADY_EXISTS,
    STATUS_INVALID_ARGUMENT,
    STATUS_NO_SPACE,
    STATUS_NOT_FOUND,
    STATUS_OK,
    STATUS_STALE,
    BlockServiceError,
    ErrorCode,
    StepResult,
)
from block_service.sequence import slot_of, slots_for

P = "pool"


def step(core: BlockServiceCore, session: str, step_id: int,
         ops: list[tuple[Any, ...]], epoch: int = 0, salts: dict[int, str] | None = None
         ) -> StepResult:
    """Runs a Step from (kind, seq_id, tokens[, parent[, num_computed]]) tuples."""
    defaults = (0, -1)  # parent_seq_id, num_computed_tokens
    ops = [(*op, *defaults[len(op) - 3:]) for op in ops]
    return core.step(session, P, step_id, epoch, [op[0] for op in ops], [op[1] for op in ops],
                     [len(op[2]) for op in ops], [t for op in ops for t in op[2]],
                     [op[3] for op in ops], [op[4] for op in ops], salts)


def setup(make_core, num_blocks: int = 64, block_size: int = 4, **pool_kwargs: Any
          ) -> tuple[BlockServiceCore, str]:
    core = make_core()
    session, _ = core.open_session("test")
    core.create_pool(P, num_blocks, block_size, 1, **pool_kwargs)
    return core, session


def used(core: BlockServiceCore) -> int:
    return core.stats(P).used_blocks


def table(core: BlockServiceCore, session: str, seq_id: int) -> list[int]:
    return list(core.pools[P].seqs[session][seq_id].block_table)


# ---- the seed's examples ----------------------------------------------------------------------

def test_slot_arithmetic_of_the_seed_example():
    # Token 300 with block size 256 is in table index 1 (block 12) at offset 44.
    assert slot_of([47, 12, 83], 256, 300) == 12 * 256 + 44 == 3116
    assert slots_for([47, 12, 83], 256, 299, 302) == [3115, 3116, 3117]
    assert slots_for([47, 12, 83], 256, 254, 258) == [47 * 256 + 254, 47 * 256 + 255, 3072, 3073]


def test_seed_table_through_allocate(make_core):
    order = [47, 12, 83] + [b for b in range(100) if b not in (47, 12, 83)]
    core, session = setup(make_core, num_blocks=100, block_size=256, free_order=order)
    prompt = list(range(1000, 1600))  # 600 tokens: three blocks of 256
    result = core.allocate(session, P, 1, prompt)
    assert result.table_block_ids == [47, 12, 83]
    assert result.num_cached_tokens == 0
    assert len(result.slots) == 600
    assert result.slots[300] == 3116
    assert result.slots[0] == 47 * 256 and result.slots[599] == 83 * 256 + 599 - 512


def test_fork_shares_then_each_new_token_gets_own_block_5_blocks(make_core):
    # A prompt filling exactly 2 blocks, three sequences: 2 blocks, ref count 3.
    core, session = setup(make_core, block_size=4)
    core.allocate(session, P, 1, [1, 2, 3, 4, 5, 6, 7, 8])
    core.fork(session, P, 1, 2)
    core.fork(session, P, 1, 3)
    assert used(core) == 2
    assert all(core.pools[P].pool.ref_counts[b] == 3 for b in table(core, session, 1))
    for seq_id, token in ((1, 11), (2, 22), (3, 33)):
        result = core.append(session, P, seq_id, [token], 8)
        assert result.copies == []
    assert used(core) == 5  # 2 shared + 1 new block each; not 6
    assert core.stats(P).total_refs == 3 * 2 + 3


def test_copy_on_write_last_writer_keeps_the_original(make_core):
    # A 2-block prompt whose second block is partly filled (6 tokens, block size 4).
    core, session = setup(make_core, block_size=4)
    core.allocate(session, P, 1, [1, 2, 3, 4, 5, 6])
    core.fork(session, P, 1, 2)
    core.fork(session, P, 1, 3)
    first, shared_last = table(core, session, 1)
    assert used(core) == 2
    copies = []
    for seq_id, token in ((1, 11), (2, 22), (3, 33)):
        copies.append(core.append(session, P, seq_id, [token]).copies)
    # Two writers copy; the third finds ref count 1 and writes in place.
    assert [len(c) for c in copies] == [1, 1, 0]
    assert copies[0][0][0] == shared_last and copies[1][0][0] == shared_last
    assert table(core, session, 3) == [first, shared_last]
    assert used(core) == 4
    assert core.stats(P).copies == 2
    # Each sequence's token 6 slot lies in its own block.
    slots = {table(core, session, s)[1] * 4 + 2 for s in (1, 2, 3)}
    assert len(slots) == 3


def test_step_reports_copy_and_only_the_changed_tail(make_core):
    core, session = setup(make_core, block_size=4)
    first = step(core, session, 1, [(OP_ALLOCATE, 1, [1, 2, 3, 4, 5, 6]),
                                    (OP_FORK, 2, [], 1, -1)])
    assert first.op_statuses == [STATUS_OK, STATUS_OK]
    assert first.table_starts == [0, 0] and first.table_counts == [2, 2]
    parent_table = first.table_block_ids[:2]
    assert first.table_block_ids[2:] == parent_table
    assert first.slot_counts == [6, 0]
    second = step(core, session, 2, [(OP_APPEND, 1, [7], 0, 6), (OP_APPEND, 2, [8], 0, 6),
                                     (OP_APPEND, 1, [9, 10], 0, -1)])
    assert second.op_statuses == [STATUS_OK] * 3
    copy_block = second.table_block_ids[0]
    assert second.copies == [(parent_table[1], copy_block)]
    # seq 1 copied its last block (index 1); seq 2 then holds the original alone; seq 1's
    # third op fills block 1 and starts block 2.
    assert second.table_starts == [1, 2, 2]
    assert second.table_counts == [1, 0, 1]
    new_block = second.table_block_ids[1]
    assert second.slot_mapping == [copy_block * 4 + 2, parent_table[1] * 4 + 2,
                                   copy_block * 4 + 3, new_block * 4]


# ---- prefix caching ---------------------------------------------------------------------------

def test_prefix_reuse_after_commit(make_core):
    core, session = setup(make_core, block_size=16)
    prompt = list(range(100, 140))  # 40 tokens: 2 full blocks + 8
    a = step(core, session, 1, [(OP_ALLOCATE, 1, prompt)])
    a_table = a.table_block_ids
    step(core, session, 2, [(OP_COMMIT, 1, [], 0, 40)])
    b = step(core, session, 3, [(OP_ALLOCATE, 2, prompt)])
    assert b.num_cached_tokens == [32]
    assert b.table_block_ids[:2] == a_table[:2] and b.table_block_ids[2] != a_table[2]
    assert b.slot_mapping == [b.table_block_ids[2] * 16 + i for i in range(8)]
    stats = core.stats(P)
    assert (stats.prompt_tokens, stats.cached_prompt_tokens) == (80, 32)
    assert core.pools[P].pool.ref_counts[a_table[0]] == 2


def test_prompt_is_never_entirely_cached(make_core):
    core, session = setup(make_core, block_size=16)
    prompt = list(range(32))  # exactly 2 blocks
    core.allocate(session, P, 1, prompt)
    core.free(session, P, 1, 32)
    assert core.match_prefix(P, prompt) == 32
    again = core.allocate(session, P, 2, prompt)
    assert again.num_cached_tokens == 16  # the last token is always computed
    assert again.slots == [again.table_block_ids[1] * 16 + i for i in range(16)]


def test_cache_hit_only_once_computed(make_core):
    core, session = setup(make_core, block_size=4)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    core.allocate(session, P, 1, prompt)
    assert core.allocate(session, P, 2, prompt).num_cached_tokens == 0  # nothing computed
    step(core, session, 1, [(OP_COMMIT, 1, [], 0, 6)])  # block 0 computed, block 1 not
    assert core.allocate(session, P, 3, prompt).num_cached_tokens == 4
    step(core, session, 2, [(OP_COMMIT, 1, [], 0, 9)])
    assert core.allocate(session, P, 4, prompt).num_cached_tokens == 8
    # A computed prefix published by Free counts too.
    core.allocate(session, P, 5, [1, 1, 1, 1, 2])
    core.free(session, P, 5, 5)
    assert core.match_prefix(P, [1, 1, 1, 1, 2]) == 4


def test_same_prefix_twins_in_one_step_keep_one_canonical_block(make_core):
    core, session = setup(make_core, block_size=4)
    prompt = list(range(10))
    twins = step(core, session, 1, [(OP_ALLOCATE, 1, prompt), (OP_ALLOCATE, 2, prompt)])
    assert twins.num_cached_tokens == [0, 0]
    t1, t2 = twins.table_block_ids[:3], twins.table_block_ids[3:]
    assert not set(t1) & set(t2)
    step(core, session, 2, [(OP_COMMIT, 1, [], 0, 10), (OP_COMMIT, 2, [], 0, 10)])
    pool = core.pools[P].pool
    assert sorted(pool.hash_to_block.values()) == sorted(t1[:2])  # the first stays canonical
    assert core.allocate(session, P, 3, prompt).table_block_ids[:2] == t1[:2]
    # The twin's blocks hold no hash: freed, they go back as never-cached blocks.
    core.free(session, P, 2)
    assert pool.num_evictable() == 0
    core.free(session, P, 1)
    core.free(session, P, 3)
    assert pool.num_evictable() == 2


def test_cache_salt_separates_tenants(make_core):
    core, session = setup(make_core, block_size=4)
    prompt = list(range(9))
    step(core, session, 1, [(OP_ALLOCATE, 1, prompt)], salts={0: "tenant-a"})
    step(core, session, 2, [(OP_COMMIT, 1, [], 0, 9)])
    assert core.allocate(session, P, 2, prompt).num_cached_tokens == 0
    assert core.allocate(session, P, 3, prompt, cache_salt="tenant-b").num_cached_tokens == 0
    assert core.allocate(session, P, 4, prompt, cache_salt="tenant-a").num_cached_tokens == 8


def test_hash_collision_is_not_a_hit(make_core, monkeypatch):
    from block_service import pool_manager
    monkeypatch.setattr(pool_manager, "block_hash", lambda parent, tokens: b"\x00" * 16)
    core, session = setup(make_core, block_size=4)
    core.allocate(session, P, 1, [1, 2, 3, 4, 5])
    core.free(session, P, 1, 5)
    assert core.allocate(session, P, 2, [9, 9, 9, 9, 5]).num_cached_tokens == 0
    assert core.allocate(session, P, 3, [1, 2, 3, 4, 5]).num_cached_tokens == 4
    # Publishing other tokens under a taken hash registers nothing and stops that sequence.
    core.free(session, P, 2, 5)
    pool = core.pools[P].pool
    assert list(pool.hash_to_block.values()) == [table(core, session, 3)[0]]
    core.allocate(session, P, 4, [7, 7, 7, 7, 8, 8, 8, 8, 9])
    step(core, session, 1, [(OP_COMMIT, 4, [], 0, 9)])
    assert core.pools[P].seqs[session][4].publishing is False
    assert len(pool.hash_to_block) == 1


# ---- free list, eviction, all-or-nothing -----------------------------------------------------

def test_never_cached_blocks_first_then_oldest_cached(make_core):
    core, session = setup(make_core, num_blocks=6, block_size=2)
    a = core.allocate(session, P, 1, [1, 2, 3]).table_block_ids  # blocks 0, 1
    b = core.allocate(session, P, 2, [4, 5, 6]).table_block_ids  # blocks 2, 3
    core.free(session, P, 1, 3)  # block 0 cached (full, computed); 1 never cached
    core.free(session, P, 2, 3)  # block 2 cached; 3 never cached
    pool = core.pools[P].pool
    assert pool.num_evictable() == 2
    # Free: 4, 5 (never used), then 1, 3 (freed, never cached); cached 0 then 2 come last.
    c = core.allocate(session, P, 3, [7, 7, 7, 7, 7, 7, 7, 7]).table_block_ids
    assert sorted(c) == sorted([4, 5, 3, 1])
    assert pool.num_evictable() == 2 and core.stats(P).evictions == 0
    d = core.allocate(session, P, 4, [8]).table_block_ids
    assert d == [a[0]]  # the oldest cached block is evicted first
    assert core.stats(P).evictions == 1
    assert core.match_prefix(P, [1, 2, 3]) == 0 and core.match_prefix(P, [4, 5, 6]) == 2
    assert core.allocate(session, P, 5, [9]).table_block_ids == [b[0]]


def test_cached_blocks_of_a_freed_sequence_evict_tail_first(make_core):
    core, session = setup(make_core, num_blocks=3, block_size=2)
    core.allocate(session, P, 1, [1, 2, 3, 4, 5, 6])
    core.free(session, P, 1, 6)  # three cached blocks, released tail first
    core.allocate(session, P, 2, [9])  # evicts the prefix's tail
    assert core.match_prefix(P, [1, 2, 3, 4, 5, 6]) == 4


def test_allocation_is_all_or_nothing(make_core, state_of):
    core, session = setup(make_core, num_blocks=5, block_size=4)
    core.allocate(session, P, 1, list(range(8)))  # 2 blocks
    before = state_of(core)
    result = core.allocate(session, P, 2, list(range(16)))  # needs 4, 3 free
    assert result.status == STATUS_NO_SPACE
    assert state_of(core) == before
    assert core.stats(P).no_space == 1
    answer = step(core, session, 1, [(OP_ALLOCATE, 3, list(range(13)))])
    assert answer.op_statuses == [STATUS_NO_SPACE] and answer.slot_mapping == []
    ok = core.allocate(session, P, 4, list(range(12)))  # exactly the 3 free blocks
    assert ok.status == STATUS_OK and core.stats(P).free_blocks == 0
    assert core.append(session, P, 4, [1]).status == STATUS_NO_SPACE


def test_cache_hits_on_free_blocks_count_against_space(make_core):
    core, session = setup(make_core, num_blocks=3, block_size=2)
    core.allocate(session, P, 1, [1, 2, 3, 4, 5])
    core.free(session, P, 1, 5)  # blocks [1,2] and [3,4] cached and free; 3 free in all
    # Needs 3 blocks: 2 hits (taken off the free list) + 1 new: fits exactly.
    result = core.allocate(session, P, 2, [1, 2, 3, 4, 9])
    assert result.status == STATUS_OK and result.num_cached_tokens == 4


def test_free_releases_and_keeps_computed_blocks_cached(make_core):
    core, session = setup(make_core, block_size=4)
    core.allocate(session, P, 1, list(range(10)))
    core.fork(session, P, 1, 2)
    assert core.free(session, P, 1).num_released_blocks == 0
    assert core.free(session, P, 2, 10).num_released_blocks == 3
    stats = core.stats(P)
    assert stats.used_blocks == 0 and stats.cached_evictable_blocks == 2
    assert stats.total_refs == 0


# ---- steps, leases, epochs ----------------------------------------------------------------------

def test_retried_step_is_applied_once(make_core, state_of):
    core, session = setup(make_core)
    first = step(core, session, 7, [(OP_ALLOCATE, 1, [1, 2, 3])])
    after = state_of(core)
    again = step(core, session, 7, [(OP_ALLOCATE, 1, [1, 2, 3])])
    assert again == first and again.op_statuses == [STATUS_OK]
    assert state_of(core) == after
    with pytest.raises(BlockServiceError) as error:
        step(core, session, 6, [(OP_FREE, 1, [])])
    assert error.value.code is ErrorCode.FAILED_PRECONDITION
    assert state_of(core) == after


def test_per_op_errors_change_nothing_and_others_apply(make_core, state_of):
    core, session = setup(make_core, num_blocks=8, block_size=4)
    core.allocate(session, P, 1, [1, 2, 3])
    core.fork(session, P, 1, 2)
    before = state_of(core)
    bad_ops = [
        ((OP_ALLOCATE, 1, [1]), STATUS_ALREADY_EXISTS),  # allocate of an existing sequence
        ((OP_ALLOCATE, 9, []), STATUS_INVALID_ARGUMENT),  # empty prompt
        ((OP_ALLOCATE, 9, [1, -5]), STATUS_INVALID_ARGUMENT),  # negative token id
        ((OP_ALLOCATE, 9, list(range(33))), STATUS_INVALID_ARGUMENT),  # more than the pool
        ((OP_APPEND, 9, [1]), STATUS_NOT_FOUND),  # unknown sequence
        ((OP_APPEND, 1, [-1]), STATUS_INVALID_ARGUMENT),
        ((OP_APPEND, 1, []), STATUS_INVALID_ARGUMENT),
        ((OP_APPEND, 1, [4], 0, 4), STATUS_INVALID_ARGUMENT),  # computed past the length
        ((OP_APPEND, 1, [4], 0, -2), STATUS_INVALID_ARGUMENT),
        ((OP_APPEND, 1, list(range(30))), STATUS_INVALID_ARGUMENT),  # oversize
        ((OP_FREE, 9, []), STATUS_NOT_FOUND),
        ((OP_FREE, 1, [3]), STATUS_INVALID_ARGUMENT),  # FREE takes no tokens
        ((OP_FORK, 2, [], 1, -1), STATUS_ALREADY_EXISTS),  # fork onto an existing child
        ((OP_FORK, 5, [], 9, -1), STATUS_NOT_FOUND),  # unknown parent
        ((OP_COMMIT, 1, [], 0, 7), STATUS_INVALID_ARGUMENT),
        ((0, 1, []), STATUS_INVALID_ARGUMENT),  # unknown op kind
        ((99, 1, []), STATUS_INVALID_ARGUMENT),
    ]
    for index, (op, status) in enumerate(bad_ops, start=1):
        result = step(core, session, index, [op])
        assert result.op_statuses == [status], op
        assert result.errors[0], op
        assert (result.table_counts, result.slot_counts, result.copies) == ([0], [0], []), op
        assert state_of(core) | {"sessions": None} == before | {"sessions": None}, op
    mixed = step(core, session, 100, [(OP_FREE, 9, []), (OP_APPEND, 1, [4], 0, 3)])
    assert mixed.op_statuses == [STATUS_NOT_FOUND, STATUS_OK]
    assert list(mixed.errors) == [0]


def test_double_free_is_not_found(make_core, state_of):
    core, session = setup(make_core)
    core.allocate(session, P, 1, [1, 2, 3])
    core.free(session, P, 1)
    before = state_of(core)
    with pytest.raises(BlockServiceError) as error:
        core.free(session, P, 1)
    assert error.value.code is ErrorCode.NOT_FOUND
    assert state_of(core) == before


@pytest.mark.parametrize("call, code", [
    (lambda c, s: c.allocate("nope", P, 1, [1]), ErrorCode.NOT_FOUND),
    (lambda c, s: c.allocate(s, "nope", 1, [1]), ErrorCode.NOT_FOUND),
    (lambda c, s: c.allocate(s, P, 1, [1]), ErrorCode.ALREADY_EXISTS),
    (lambda c, s: c.allocate(s, P, 2, []), ErrorCode.INVALID_ARGUMENT),
    (lambda c, s: c.allocate(s, P, 2, [3, -1]), ErrorCode.INVALID_ARGUMENT),
    (lambda c, s: c.allocate(s, P, 2, [2**31]), ErrorCode.INVALID_ARGUMENT),
    (lambda c, s: c.allocate(s, P, 2, [1] * 257), ErrorCode.INVALID_ARGUMENT),
    (lambda c, s: c.append(s, P, 2, [1]), ErrorCode.NOT_FOUND),
    (lambda c, s: c.append(s, P, 1, [1], 99), ErrorCode.INVALID_ARGUMENT),
    (lambda c, s: c.free(s, P, 2), ErrorCode.NOT_FOUND),
    (lambda c, s: c.fork(s, P, 1, 1), ErrorCode.ALREADY_EXISTS),
    (lambda c, s: c.fork(s, P, 2, 3), ErrorCode.NOT_FOUND),
    (lambda c, s: c.create_pool("p2", 10, 3, 1), ErrorCode.INVALID_ARGUMENT),
    (lambda c, s: c.create_pool("p2", 10, 0, 1), ErrorCode.INVALID_ARGUMENT),
    (lambda c, s: c.create_pool("p2", 10, 2**17, 1), ErrorCode.INVALID_ARGUMENT),
    (lambda c, s: c.create_pool("p2", 0, 16, 1), ErrorCode.INVALID_ARGUMENT),
    (lambda c, s: c.create_pool("p2", 10, 16, 0), ErrorCode.INVALID_ARGUMENT),
    (lambda c, s: c.create_pool("", 10, 16, 1), ErrorCode.INVALID_ARGUMENT),
    (lambda c, s: c.create_pool("x" * 257, 10, 16, 1), ErrorCode.INVALID_ARGUMENT),
    (lambda c, s: c.create_pool(P, 17, 16, 1), ErrorCode.FAILED_PRECONDITION),
    (lambda c, s: c.get_pool("nope"), ErrorCode.NOT_FOUND),
    (lambda c, s: c.stats("nope"), ErrorCode.NOT_FOUND),
    (lambda c, s: c.match_prefix(P, [-1]), ErrorCode.INVALID_ARGUMENT),
    (lambda c, s: c.keep_alive("nope"), ErrorCode.NOT_FOUND),
    (lambda c, s: c.close_session("nope"), ErrorCode.NOT_FOUND),
])
def test_bad_single_calls(make_core, state_of, call, code):
    core, session = setup(make_core, num_blocks=16, block_size=16)
    core.allocate(session, P, 1, [1, 2, 3])
    before = state_of(core)
    with pytest.raises(BlockServiceError) as error:
        call(core, session)
    assert error.value.code is code
    assert error.value.message
    assert state_of(core) == before


def columns(ops: int = 1) -> dict[str, list[int]]:
    return {"kinds": [OP_APPEND] * ops, "seq_ids": [1] * ops, "token_counts": [1] * ops,
            "token_ids": [5] * ops, "parent_ids": [0] * ops, "computed": [-1] * ops}


@pytest.mark.parametrize("change, code", [
    ({"seq_ids": [1, 1]}, ErrorCode.INVALID_ARGUMENT),
    ({"token_counts": []}, ErrorCode.INVALID_ARGUMENT),
    ({"parent_ids": []}, ErrorCode.INVALID_ARGUMENT),
    ({"computed": [-1, -1]}, ErrorCode.INVALID_ARGUMENT),
    ({"token_ids": [5, 6]}, ErrorCode.INVALID_ARGUMENT),
    ({"token_counts": [2]}, ErrorCode.INVALID_ARGUMENT),
    ({"cache_salts": {1: "x"}}, ErrorCode.INVALID_ARGUMENT),
    ({"session_id": "nope"}, ErrorCode.NOT_FOUND),
    ({"pool_id": "nope"}, ErrorCode.NOT_FOUND),
    ({"epoch": 2}, ErrorCode.FAILED_PRECONDITION),
    ({"step_id": 3}, ErrorCode.FAILED_PRECONDITION),
])
def test_bad_steps_change_nothing(make_core, state_of, change, code):
    core, session = setup(make_core)
    core.allocate(session, P, 1, [1, 2, 3])
    step(core, session, 4, [(OP_APPEND, 1, [4])])
    before = state_of(core)
    args = {"session_id": session, "pool_id": P, "step_id": 5, "epoch": 1, **columns(),
            "cache_salts": None, **change}
    with pytest.raises(BlockServiceError) as error:
        core.step(**args)
    assert error.value.code is code
    assert state_of(core) == before


def test_too_many_ops_per_step(make_core, state_of):
    core = make_core(limits=Limits(max_ops_per_step=4))
    session, _ = core.open_session("t")
    core.create_pool(P, 8, 4, 1)
    before = state_of(core)
    with pytest.raises(BlockServiceError) as error:
        core.step(session, P, 1, 0, **columns(5))
    assert error.value.code is ErrorCode.INVALID_ARGUMENT
    assert state_of(core) == before


def test_fast_and_slow_append_paths_agree(make_core):
    # The same appends, one token each (Step's inline path) and via Append (the full path).
    results = []
    for inline in (True, False):
        core, session = setup(make_core, block_size=4)
        core.allocate(session, P, 1, [1, 2, 3])
        slots = []
        for i, token in enumerate(range(10, 20)):
            computed = 3 + i
            if inline:
                slots += step(core, session, i + 1, [(OP_APPEND, 1, [token], 0, computed)]
                              ).slot_mapping
            else:
                slots += core.append(session, P, 1, [token], computed).slots
        results.append((slots, table(core, session, 1), core.pools[P].pool.hash_to_block))
    assert results[0] == results[1]
    assert len(results[0][2]) == 3  # 12 computed tokens: 3 full blocks published


def test_lease_expiry_frees_sequences(make_core, clock):
    core, session = setup(make_core, block_size=4)
    other, _ = core.open_session("other", 60_000)
    core.allocate(session, P, 1, list(range(9)))
    core.allocate(other, P, 1, list(range(5)))
    clock.advance(5)
    core.keep_alive(session)
    clock.advance(9)
    assert core.reap_expired() == 0
    clock.advance(1.5)
    assert core.reap_expired() == 1
    assert core.stats(P).used_blocks == 2  # only the other session's sequence
    with pytest.raises(BlockServiceError) as error:
        core.keep_alive(session)
    assert error.value.code is ErrorCode.FAILED_PRECONDITION


def test_overdue_session_expires_on_its_next_call(make_core, clock):
    core, session = setup(make_core, block_size=4)
    core.allocate(session, P, 1, list(range(9)))
    clock.advance(11)
    with pytest.raises(BlockServiceError) as error:
        step(core, session, 1, [(OP_APPEND, 1, [1])])
    assert error.value.code is ErrorCode.FAILED_PRECONDITION
    assert core.stats(P).used_blocks == 0


def test_lease_ttl_is_clamped(make_core):
    core = make_core()
    assert core.open_session("a", 0)[1] == 10_000
    assert core.open_session("b", 10)[1] == 1_000
    assert core.open_session("c", 10**9)[1] == 60_000
    session, _ = core.open_session("d", 2_500)
    assert core.keep_alive(session) == 2_500


def test_close_session_frees_in_every_pool(make_core):
    core, session = setup(make_core, block_size=4)
    core.create_pool("other", 8, 4, 1)
    core.allocate(session, P, 1, [1, 2, 3])
    core.allocate(session, "other", 2, [1, 2, 3])
    with pytest.raises(BlockServiceError) as error:  # seq ids are unique per session
        core.allocate(session, "other", 1, [1])
    assert error.value.code is ErrorCode.ALREADY_EXISTS
    assert core.close_session(session) == 2
    assert core.stats(P).used_blocks == core.stats("other").used_blocks == 0


def test_new_epoch_empties_the_pool_and_makes_sequences_stale(make_core, state_of):
    core, session = setup(make_core, num_blocks=8, block_size=4)
    core.allocate(session, P, 1, list(range(9)))
    core.allocate(session, P, 2, list(range(9)))
    core.free(session, P, 2, 9)
    assert core.create_pool(P, 8, 4, 1).epoch == 1  # idempotent
    assert core.stats(P).used_blocks == 3
    info = core.create_pool(P, 16, 8, 2)
    assert (info.num_blocks, info.block_size, info.epoch) == (16, 8, 2)
    stats = core.stats(P)
    assert (stats.free_blocks, stats.cached_evictable_blocks, stats.num_sequences) == (16, 0, 0)
    assert core.match_prefix(P, list(range(9))) == 0
    with pytest.raises(BlockServiceError) as error:
        step(core, session, 1, [(OP_APPEND, 1, [3])], epoch=1)
    assert error.value.code is ErrorCode.FAILED_PRECONDITION
    answer = step(core, session, 1, [(OP_APPEND, 1, [3])], epoch=2)
    assert answer.op_statuses == [STATUS_STALE] and answer.epoch == 2
    again = step(core, session, 2, [(OP_APPEND, 1, [3])])
    assert again.op_statuses == [STATUS_NOT_FOUND]  # forgotten after STALE
    core.allocate(session, P, 3, [1])
    core.create_pool(P, 16, 8, 3)
    with pytest.raises(BlockServiceError) as error:
        core.append(session, P, 3, [1])
    assert error.value.code is ErrorCode.FAILED_PRECONDITION
    assert core.allocate(session, P, 3, [1]).status == STATUS_OK  # re-allocate to recompute


def test_block_hash_is_xxh3_128_of_parent_and_int32_tokens():
    endian = "<" if sys.byteorder == "little" else ">"
    first = xxhash.xxh3_128_digest(bytes(16) + struct.pack(f"{endian}4i", 1, 2, 3, 4))
    second = xxhash.xxh3_128_digest(first + struct.pack(f"{endian}4i", 5, 6, 7, 8))
    assert bytes(16) == ROOT_HASH
    assert block_hash(ROOT_HASH, [1, 2, 3, 4]) == first
    assert chain_hashes(list(range(1, 10)), 4, 2, ROOT_HASH) == [first, second]
    assert root_hash("") == ROOT_HASH
    assert root_hash("a") != root_hash("b") != ROOT_HASH
