"""Checks shared by the block service tests: the core's invariants and its full state.

`check_invariants` derives everything it expects from the sequences' own tokens and block
tables (an oracle independent of the pool's bookkeeping): reference counts equal the number of
tables holding a block, every block is free xor referenced, the stats add up, every
published hash is the chained hash of its sequence's known tokens, and a reserved position is
the last one, never computed, in a block no other sequence holds.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from block_service.block_pool import BlockPool
from block_service.core import BlockServiceCore
from block_service.hashing import chain_hashes
from block_service.pool_manager import PoolManager
from block_service.sequence import RESERVED


def check_invariants(core: BlockServiceCore, check_hashes: bool = True) -> None:
    """Asserts the invariants of every pool of `core` (`check_hashes`: recompute every live
    sequence's hash chain too, which costs a pass over all tokens)."""
    for pool_id, pm in core.pools.items():
        check_blocks(pm)
        check_sequences(pm, check_hashes)
        stats = core.stats(pool_id)
        assert stats.free_blocks + stats.used_blocks == stats.total_blocks == pm.pool.num_blocks
        assert stats.total_refs == sum(pm.pool.ref_counts)


def check_blocks(pm: PoolManager) -> None:
    """Ref counts equal the tables holding each block; free xor referenced; hashes consistent."""
    pool = pm.pool
    holders: Counter[int] = Counter()
    for seqs in pm.seqs.values():
        for seq in seqs.values():
            holders.update(seq.block_table)
    free = pool.free_block_ids()
    free_set = set(free)
    assert len(free) == len(free_set), "a block is on the free lists twice"
    for block in range(pool.num_blocks):
        assert pool.ref_counts[block] == holders[block], f"block {block} ref count"
        assert (block in free_set) != (holders[block] > 0), f"block {block} free and held"
    assert set(holders) <= set(range(pool.num_blocks)), "a table names a block out of range"
    for digest, block in pool.hash_to_block.items():
        cached = pool.cached_block(block)
        assert cached is not None and cached.block_hash == digest
    for block in range(pool.num_blocks):
        cached = pool.cached_block(block)
        assert cached is None or pool.hash_to_block.get(cached.block_hash) == block
    for block in free:
        assert pool.is_evictable(block) == (pool.cached_block(block) is not None)


def check_sequences(pm: PoolManager, check_hashes: bool = True) -> None:
    """Each live sequence's table fits its tokens and its hashes chain over its known tokens.

    A reserved position (token RESERVED: its slot handed out, its token not sampled yet) may
    only be the last one; it is never computed (nor hashed), and its block is held by that
    sequence alone (a fork of a reserved sequence is refused, reserving into a shared block
    copies it), so no other sequence can write its slot.
    """
    size = pm.block_size
    holders: Counter[int] = Counter()
    for seqs in pm.seqs.values():
        for seq in seqs.values():
            holders.update(seq.block_table)
    assert pm.uncomputed_tokens == sum(len(seq.tokens) - seq.num_computed
                                       for seqs in pm.seqs.values() for seq in seqs.values())
    for seqs in pm.seqs.values():
        for seq in seqs.values():
            tokens = seq.tokens
            assert tokens, "a sequence without tokens"
            # Counted here from the tokens, not with Sequence.num_known.
            num_known = len(tokens) - (tokens[-1] == RESERVED)
            assert min(tokens[:num_known], default=0) >= 0, "a reserved token before the last"
            assert len(seq.block_table) == -(-len(tokens) // size)
            assert 0 <= seq.num_computed <= num_known
            assert seq.num_published == len(seq.hashes) <= seq.num_computed // size
            if num_known < len(tokens):
                reserved_block = seq.block_table[(len(tokens) - 1) // size]
                assert holders[reserved_block] == 1, "a reserved slot's block is shared"
            if check_hashes:
                assert seq.hashes == chain_hashes(tokens[:num_known], size, len(seq.hashes),
                                                  seq.root)


def cached_blocks(pool: BlockPool) -> list[tuple[bytes, bytes, tuple[int, ...]] | None]:
    """Per block: its hash, parent hash and tokens while it holds a published hash."""
    return [None if cached is None else (cached.block_hash, cached.parent_hash, cached.token_ids)
            for cached in map(pool.cached_block, range(pool.num_blocks))]


def full_state(core: BlockServiceCore) -> dict[str, Any]:
    """Every piece of the core's state, counters included, lease deadlines excluded (a
    restart renews every lease), as comparable plain data."""
    pools: dict[str, dict[str, Any]] = {}
    for pool_id, pm in core.pools.items():
        pool = pm.pool
        pools[pool_id] = {
            "shape": (pm.epoch, pool.num_blocks, pm.block_size),
            "refs": list(pool.ref_counts),
            "uncached": list(pool._uncached),
            "evictable": list(pool._evictable),
            "hash_to_block": dict(pool.hash_to_block),
            "blocks": cached_blocks(pool),
            "seqs": {
                sid: {seq_id: (list(seq.tokens), list(seq.block_table), seq.num_computed,
                               seq.num_published, list(seq.hashes), seq.publishing, seq.root)
                      for seq_id, seq in seqs.items()}
                for sid, seqs in pm.seqs.items()
            },
            "stale": {sid: set(ids) for sid, ids in pm.stale.items()},
            "counters": (pm.prompt_tokens, pm.cached_prompt_tokens, pm.copies, pm.no_space,
                         pool.evictions),
        }
    sessions = {sid: (s.client_name, s.ttl_s, s.last_step_id, s.last_step)
                for sid, s in core.sessions.open.items()}
    return {"pools": pools, "sessions": sessions, "expired": core.sessions.expired_ids()}
