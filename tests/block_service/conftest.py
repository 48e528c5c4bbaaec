"""Fixtures of the block service tests: a core on a fake clock and a full-state snapshot."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from block_service.core import BlockServiceCore
from block_service.sessions import LeasePolicy

from .invariants import cached_blocks


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def snapshot(core: BlockServiceCore) -> dict[str, Any]:
    """Every piece of state of the core (counters excluded), as comparable plain data."""
    pools = {}
    for pool_id, pm in core.pools.items():
        pool = pm.pool
        pools[pool_id] = {
            "epoch": pm.epoch,
            "refs": list(pool.ref_counts),
            "uncached": list(pool._uncached),
            "evictable": list(pool._evictable),
            "hash_to_block": dict(pool.hash_to_block),
            "blocks": cached_blocks(pool),
            "seqs": {
                sid: {
                    seq_id: (list(seq.tokens), list(seq.block_table), seq.num_computed,
                             seq.num_published, list(seq.hashes), seq.publishing)
                    for seq_id, seq in seqs.items()
                }
                for sid, seqs in pm.seqs.items() if seqs
            },
            "stale": {sid: set(ids) for sid, ids in pm.stale.items() if ids},
        }
    sessions = {sid: (s.last_step_id, s.expires_at) for sid, s in core.sessions.open.items()}
    return {"pools": pools, "sessions": sessions}


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def make_core(clock: FakeClock) -> Callable[..., BlockServiceCore]:
    def make(**kwargs: Any) -> BlockServiceCore:
        kwargs.setdefault("lease_policy", LeasePolicy(10.0, 1.0, 60.0))
        return BlockServiceCore(clock=clock, **kwargs)
    return make


@pytest.fixture
def state_of() -> Callable[[BlockServiceCore], dict[str, Any]]:
    return snapshot
