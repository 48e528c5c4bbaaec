"""BlockPool on its own: what its pickled state must keep loading."""

from __future__ import annotations

import pickle

import pytest

from block_service.block_pool import BlockPool
from block_service.hashing import ROOT_HASH, block_hash

from .invariants import cached_blocks


def old_layout(pool: BlockPool) -> dict[str, object]:
    """A pool's pickled state as written before CachedBlock: three per-block lists (hash,
    parent hash, tokens), None where a block held no published hash."""
    state = {name: value for name, value in vars(pool).items()
             if name not in ("events", "_cached")}
    blocks = cached_blocks(pool)
    state["block_hashes"] = [None if cached is None else cached[0] for cached in blocks]
    state["block_parents"] = [None if cached is None else cached[1] for cached in blocks]
    state["block_tokens"] = [None if cached is None else cached[2] for cached in blocks]
    return state


def test_a_pool_pickled_before_cached_block_records_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = BlockPool(4, 2, free_order=[3, 1, 0, 2])
    head, tail, other = pool.take(), pool.take(), pool.take()
    head_hash = block_hash(ROOT_HASH, [1, 2])
    tail_hash = block_hash(head_hash, [3, 4])
    pool.publish(head, head_hash, ROOT_HASH, [1, 2])
    pool.publish(tail, tail_hash, head_hash, [3, 4])
    pool.release(tail)  # cached at ref count 0: evictable
    pool.release(other)  # never cached
    with monkeypatch.context() as patched:
        patched.setattr(BlockPool, "__getstate__", old_layout)
        old = pickle.dumps(pool, protocol=pickle.HIGHEST_PROTOCOL)
    assert b"block_parents" in old and b"_cached" not in old

    loaded = pickle.loads(old)
    assert cached_blocks(loaded) == cached_blocks(pool)
    assert [(r.block_hash, r.parent_hash, r.token_ids) for r in loaded.cached_blocks()] == \
        [(head_hash, ROOT_HASH, (1, 2)), (tail_hash, head_hash, (3, 4))]
    assert {name: value for name, value in vars(loaded).items() if name != "_cached"} == \
        {name: value for name, value in vars(pool).items() if name != "_cached"}
    assert loaded.lookup(head_hash, tail_hash, [3, 4]) == tail and loaded.is_evictable(tail)
    # It goes on as the live pool does: the never-cached blocks first, then the evictable one.
    taken = [pool.take(), pool.take(), pool.take()]
    assert [loaded.take(), loaded.take(), loaded.take()] == taken == [other, 2, tail]
    assert cached_blocks(loaded) == cached_blocks(pool)
    assert loaded.hash_to_block == pool.hash_to_block == {head_hash: head}
    assert loaded.evictions == pool.evictions == 1
