"""Runner membership and request placement (docs/scaling.md).

A runner's pool is *registered* when it carries a lease (RegisterRunner); it is live while
the lease runs. The registry keeps the lease deadlines and the soft load figures routers
compare; the pools themselves stay in the core. Nothing here is journaled: after a restart
every registered pool gets a fresh lease (as sessions do) and the load figures fill in again
from the next Steps.

Load of a pool, in tokens (what `load_tokens` reports):
    queued = waiting reported by each session stepping the pool (StepRequest
             num_waiting_tokens, its latest)
           + what routes placed there since the router's own loop last stepped the pool
           + the uncomputed tokens of the pool's live sequences
    load   = queued + DECODE_WEIGHT_TOKENS x live sequences
Policies (RoutingPolicy): `prefix` picks the lowest
    cost = prompt tokens - max(cached, pending) + max(0, load - pending)
where `cached` is the pool's computed cached prefix of the prompt and `pending` its pending
prefix: the leading full blocks of prompts routed there in the last PENDING_PREFIX_TTL_S,
which it is computing now (queued work this request shares, so it leaves the load too).
Without it, a burst of requests with a new shared prefix would be spread by load and every
runner would compute the prefix. `least-loaded` picks the lowest load, `round-robin` each
live pool in turn. Ties go to the pool after the last one chosen, so equal runners take turns.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from block_service.pool_manager import PoolManager

POLICY_PREFIX = 1
POLICY_LEAST_LOADED = 2
POLICY_ROUND_ROBIN = 3
POLICIES = (POLICY_PREFIX, POLICY_LEAST_LOADED, POLICY_ROUND_ROBIN)

# A running sequence weighs like this many queued prompt tokens: it holds a batch row and
# KV reads for every step it has left. Chosen so that a cached prefix of a few hundred tokens
# outweighs a handful of extra running sequences (docs/scaling.md, "Routing").
DECODE_WEIGHT_TOKENS = 16
# A route's addition to a pool's load counts until the router's loop for that pool steps
# (its report then includes the request), or this long at most (a router that died).
ROUTED_FIGURE_TTL_S = 5.0
# A routed prompt's blocks count as held by its pool this long (it computes them meanwhile,
# then they are cached for real) or until another route places them elsewhere.
PENDING_PREFIX_TTL_S = 10.0


@dataclass(frozen=True)
class Candidate:
    """One live pool as a route saw it."""

    pool_id: str
    num_cached_tokens: int
    load_tokens: int
    cost: int
    num_pending_tokens: int = 0


@dataclass(frozen=True)
class RunnerLoad:
    """A live pool's load figures (ListRunners)."""

    free_blocks: int
    num_sequences: int
    queued_tokens: int
    load_tokens: int


@dataclass
class RunnerRegistry:
    """Lease deadlines of registered pools and the load figures of every pool."""

    clock: Callable[[], float] = time.monotonic
    lease_ttl_s: dict[str, float] = field(default_factory=dict)
    deadline: dict[str, float] = field(default_factory=dict)
    # session id -> (pool id, its waiting tokens as last reported in a Step)
    waiting: dict[str, tuple[str, int]] = field(default_factory=dict)
    # (router client name, pool id) -> (tokens routed there since its loop stepped, when)
    routed: dict[tuple[str, str], tuple[int, float]] = field(default_factory=dict)
    # block hash -> {pool id: when} of the full blocks of recently routed prompts
    pending: dict[bytes, dict[str, float]] = field(default_factory=dict)
    last_chosen: str = ""

    # ---- leases --------------------------------------------------------------------------
    def renew(self, pool_id: str, ttl_s: float | None = None) -> float:
        """Extends a pool's lease by its TTL (a new TTL when given); returns the TTL."""
        if ttl_s is not None:
            self.lease_ttl_s[pool_id] = ttl_s
        ttl = self.lease_ttl_s[pool_id]
        self.deadline[pool_id] = self.clock() + ttl
        return ttl

    def is_live(self, pool_id: str) -> bool:
        deadline = self.deadline.get(pool_id)
        return deadline is not None and deadline > self.clock()

    def overdue(self) -> list[str]:
        """Registered pools whose lease has run out."""
        now = self.clock()
        return [pool_id for pool_id, deadline in self.deadline.items() if deadline <= now]

    def forget(self, pool_id: str) -> None:
        """Drops everything known of a pool (it left)."""
        self.lease_ttl_s.pop(pool_id, None)
        self.deadline.pop(pool_id, None)
        for key in [key for key in self.routed if key[1] == pool_id]:
            del self.routed[key]
        for pools in self.pending.values():
            pools.pop(pool_id, None)

    # ---- load figures --------------------------------------------------------------------
    def report(self, session_id: str, client_name: str, pool_id: str, tokens: int) -> None:
        """A Step's load report replaces the session's last one and what its router placed
        on the pool since."""
        self.waiting[session_id] = (pool_id, tokens)
        self.routed.pop((client_name, pool_id), None)

    def end_session(self, session_id: str) -> None:
        self.waiting.pop(session_id, None)

    def loads(self, pms: Sequence[PoolManager]) -> list[RunnerLoad]:
        """The load figures of these pools (the reports and routes summed in one pass for
        all of them: Route and ListRunners ask for every pool at once)."""
        now = self.clock()
        queued: dict[str, int] = {}
        for pool_id, tokens in self.waiting.values():
            queued[pool_id] = queued.get(pool_id, 0) + tokens
        for (_, pool_id), (tokens, at) in self.routed.items():
            if now - at < ROUTED_FIGURE_TTL_S:
                queued[pool_id] = queued.get(pool_id, 0) + tokens
        loads = []
        for pm in pms:
            tokens = queued.get(pm.pool_id, 0) + pm.uncomputed_tokens
            num_seqs = pm.num_sequences()
            loads.append(RunnerLoad(pm.pool.num_free(), num_seqs, tokens,
                                    tokens + DECODE_WEIGHT_TOKENS * num_seqs))
        return loads

    # ---- placement -----------------------------------------------------------------------
    def choose(self, policy: int, candidates: Sequence[Candidate]) -> Candidate:
        """The policy's pick among candidates sorted by pool id (non-empty)."""
        # Start looking after the last pool chosen: ties (and round-robin) take turns.
        start = next((i + 1 for i, c in enumerate(candidates)
                      if c.pool_id == self.last_chosen), 0)
        turn = [*candidates[start:], *candidates[:start]]
        if policy == POLICY_ROUND_ROBIN:
            chosen = turn[0]
        elif policy == POLICY_LEAST_LOADED:
            chosen = min(turn, key=lambda c: c.load_tokens)
        else:
            chosen = min(turn, key=lambda c: (c.cost, c.load_tokens))
        self.last_chosen = chosen.pool_id
        return chosen

    def pending_blocks(self, hashes: Sequence[bytes]) -> dict[str, int]:
        """Per pool, how many leading blocks of a prompt (by chained hash) are pending there
        (pools with none are left out).

        A pool's pending blocks of a chain are a prefix of it, fresher towards its start:
        add_pending marks a routed prompt's blocks from the first on with one time, and a
        chained hash names its whole prefix, so whatever marks block k marked blocks 0..k-1
        then or later (and expiry drops the oldest first). So each pool pending on the first
        block needs a binary search, not a walk along the prompt.
        """
        now = self.clock()
        pending = self.pending
        first = pending.get(hashes[0]) if hashes else None
        if not first:
            return {}
        counts: dict[str, int] = {}
        for pool, at in first.items():
            if now - at >= PENDING_PREFIX_TTL_S:
                continue
            low, high = 1, len(hashes)  # blocks 0 .. low-1 are pending
            while low < high:
                middle = (low + high + 1) // 2
                marked = pending.get(hashes[middle - 1], {}).get(pool)
                if marked is not None and now - marked < PENDING_PREFIX_TTL_S:
                    low = middle
                else:
                    high = middle - 1
            counts[pool] = low
        return counts

    def add_pending(self, pool_id: str, hashes: Sequence[bytes]) -> None:
        """Marks a routed prompt's blocks as being computed on the pool."""
        now = self.clock()
        if len(self.pending) > 2 * len(hashes) + 65536:  # drop the expired now and then
            self.pending = {digest: fresh for digest, pools in self.pending.items()
                            if (fresh := {pool: at for pool, at in pools.items()
                                          if now - at < PENDING_PREFIX_TTL_S})}
        for digest in hashes:
            self.pending.setdefault(digest, {})[pool_id] = now

    def add_routed(self, client_name: str, pool_id: str, tokens: int) -> None:
        """Counts a placed request in the pool's load until the router's loop reports."""
        key = (client_name, pool_id)
        previous, at = self.routed.get(key, (0, 0.0))
        now = self.clock()
        if now - at >= ROUTED_FIGURE_TTL_S:
            previous = 0
        self.routed[key] = (previous + tokens, now)
