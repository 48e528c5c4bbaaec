"""BlockServiceCore: pools, sessions and Step, safe to call from many threads.

Thread safety: one lock (`self._lock`) around every public method. Each call is short (a
Step of 256 decode appends holds it for well under a millisecond), the state is a web of
plain Python objects that must change together, and under CPython's GIL finer locks would not
run the work in parallel anyway. A gRPC server with many worker threads therefore serialises
on this lock; request parsing and response building happen in the servicer, outside it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from block_service.events import KvEventLogs, Subscription
from block_service.hashing import chain_hashes, root_hash
from block_service.journal import Journal
from block_service.ops import (
    NOT_CHANGED,
    OP_ALLOCATE,
    OP_APPEND,
    OP_FORK,
    OP_FREE,
    STATUS_ERROR_CODES,
    STATUS_NO_SPACE,
    STATUS_OK,
    BlockServiceError,
    ErrorCode,
    OpResult,
    PoolInfo,
    PoolStats,
    StepResult,
    shown,
)
from block_service.pool_manager import PoolManager, bad_tokens
from block_service.registry import (
    DECODE_WEIGHT_TOKENS,
    POLICIES,
    Candidate,
    RunnerLoad,
    RunnerRegistry,
)
from block_service.sessions import LeasePolicy, Session, SessionTable
from block_service.step import SessionScope, apply_op, run_step
from block_service.step_wire import (
    WireStep,
    answer_bytes,
    answer_result,
    compiled_step,
    parse_step,
)

MAX_POOL_ID_BYTES = 256
MAX_CLIENT_NAME_BYTES = 256
MAX_CACHE_SALT_BYTES = 1024
MAX_BLOCK_SIZE = 65536

# Journal record kinds: each names one state change and the arguments that replay it.
REC_OPEN = 1  # (session_id, client_name, ttl_s)
REC_CLOSE = 2  # (session_id,)
REC_EXPIRE = 3  # (session_id,)
REC_CREATE_POOL = 4  # (pool_id, num_blocks, block_size, epoch, free_order)
REC_OP = 5  # the arguments of _apply_single
REC_STEP = 6  # the arguments of _apply_step
REC_REGISTER = 7  # the arguments of _apply_register
REC_DROP_POOL = 8  # (pool_id,)
REC_STEP_WIRE = 9  # (StepRequest bytes,): a Step as it arrived (BlockServiceCore.step_wire)


@dataclass(frozen=True)
class Limits:
    """Bounds on what clients may ask for (each error message names the one it hit)."""

    max_ops_per_step: int = 65536
    max_tokens_per_request: int = 1 << 22
    max_pool_blocks: int = 1 << 24
    max_pools: int = 64
    max_sessions: int = 1024
    max_seqs_per_session: int = 16384


@dataclass
class CoreState:
    """Everything a snapshot holds: the pools and the sessions (leases are renewed on load)."""

    pools: dict[str, PoolManager]
    sessions: dict[str, Session]
    expired_ids: list[str]
    # Registered pools: pool id -> (runner address, lease TTL in s). Leases are renewed on load.
    runners: dict[str, tuple[str, float]] = field(default_factory=dict)


def invalid(message: str) -> BlockServiceError:
    """An INVALID_ARGUMENT error."""
    return BlockServiceError(ErrorCode.INVALID_ARGUMENT, message)


def exhausted(message: str) -> BlockServiceError:
    """A RESOURCE_EXHAUSTED error."""
    return BlockServiceError(ErrorCode.RESOURCE_EXHAUSTED, message)


def check_text(what: str, text: str, max_bytes: int) -> None:
    """INVALID_ARGUMENT when a client-supplied string is longer than its limit."""
    if len(text) > max_bytes or len(text.encode("utf-8", "surrogatepass")) > max_bytes:
        raise invalid(f"{what} is longer than {max_bytes} bytes")


def check_tokens_per_request(num_tokens: int, limits: Limits) -> None:
    """INVALID_ARGUMENT when one request carries more tokens than allowed."""
    if num_tokens > limits.max_tokens_per_request:
        raise invalid(f"{num_tokens} tokens in one request: the limit is "
                      f"{limits.max_tokens_per_request} (max_tokens_per_request)")


def raise_failure(result: OpResult) -> OpResult:
    """Raises the whole-call error of a failed single operation (NO_SPACE is an answer)."""
    if result.status in (STATUS_OK, STATUS_NO_SPACE):
        return result
    raise BlockServiceError(STATUS_ERROR_CODES[result.status], result.error)


def check_pool_shape(pool_id: str, num_blocks: int, block_size: int, epoch: int,
                     max_blocks: int) -> None:
    """Raises INVALID_ARGUMENT for a malformed CreatePool."""
    if not pool_id:
        raise invalid("pool_id is empty")
    check_text("pool_id", pool_id, MAX_POOL_ID_BYTES)
    if not 1 <= num_blocks <= max_blocks:
        raise invalid(f"num_blocks {num_blocks} is outside 1 .. {max_blocks} (max_pool_blocks)")
    if not 1 <= block_size <= MAX_BLOCK_SIZE or block_size & (block_size - 1):
        raise invalid(f"block_size {block_size} is not a power of two in 1 .. {MAX_BLOCK_SIZE}")
    if epoch <= 0:
        raise invalid("epoch must be non-zero")


class BlockServiceCore:
    """Every pool and session of one block service.

    With a journal attached (`attach_journal`), every state change appends one record under the
    lock before its call returns, and `replay` rebuilds the state by sending the same records
    through the same `_apply_*` methods the live calls use. The only decisions that are not a
    function of the records are the new session ids (recorded) and lease times (not recorded:
    replay never expires a lease from the clock, expiries are records, and every session gets
    a fresh lease after replay).
    """

    def __init__(self, lease_policy: LeasePolicy | None = None, limits: Limits | None = None,
                 clock: Callable[[], float] = time.monotonic, compiled_steps: bool = True) -> None:
        self._lock = threading.Lock()
        # Whether step_wire runs Steps through block_service._stepwire where it is built
        # (False: the Python path, as a reference and for comparison).
        self.compiled_steps = compiled_steps
        self.kv_events = KvEventLogs(self._lock)
        self.pools: dict[str, PoolManager] = {}
        self.sessions = SessionTable(lease_policy or LeasePolicy(), clock)
        self.limits = limits or Limits()
        self.registry = RunnerRegistry(clock)
        self.runner_addresses: dict[str, str] = {}  # registered pool id -> runner address
        self._journal: Journal | None = None

    # ---- journal -------------------------------------------------------------------------
    def attach_journal(self, journal: Journal) -> None:
        """Records every later state change in `journal` (after `replay` of its contents)."""
        with self._lock:
            self._journal = journal

    def _record(self, kind: int, args: tuple[Any, ...]) -> None:
        """Journals one state change (under the lock, before the call answers)."""
        self.kv_events.flush()  # the call's KV events become one numbered batch per pool
        journal = self._journal
        if journal is None:
            return
        journal.append(kind, args)
        if journal.snapshot_due():
            # Starts the next log and forks a child that pickles the state as it is now: the
            # lock is held for that only, not while the state is written (journal.py).
            journal.start_snapshot(self._state)

    def _state(self) -> CoreState:
        """What a snapshot holds. Called in the snapshot's forked child (a copy of the state at
        the fork, so no lock is needed there), or under the lock where none can be forked."""
        runners = {pool_id: (address, self.registry.lease_ttl_s[pool_id])
                   for pool_id, address in self.runner_addresses.items()}
        return CoreState(self.pools, self.sessions.open, self.sessions.expired_ids(), runners)

    def snapshot_now(self) -> bool:
        """Writes a snapshot now and waits for it (after a replay, so that the next start
        replays little); whether it succeeded. The lock is held only to start it, as for a due
        snapshot; one already running is waited for first, outside the lock."""
        while True:
            with self._lock:
                journal = self._journal
                if journal is None or journal.closed:
                    return False
                if not journal.snapshot_running:
                    journal.start_snapshot(self._state)
                    break
            journal.wait_snapshot()
        return journal.wait_snapshot() is True

    def replay(self, state: CoreState | None, records: Sequence[tuple[int, Any]]) -> None:
        """Rebuilds the state from a snapshot and the records journaled after it.

        No lease runs out during replay: the `_apply_*` methods never look at lease times
        (expiries are records of their own). Afterwards every session gets a fresh full lease.
        Records are applied without journaling them again.
        """
        with self._lock:
            journal, self._journal = self._journal, None
            try:
                if state is not None:
                    self.pools = state.pools
                    self.sessions.restore(state.sessions, state.expired_ids)
                    # A snapshot from before the registry has no `runners`.
                    for pool_id, (address, ttl_s) in getattr(state, "runners", {}).items():
                        self.runner_addresses[pool_id] = address
                        self.registry.lease_ttl_s[pool_id] = ttl_s
                for kind, args in records:
                    self._replay_one(kind, args)
            finally:
                self._journal = journal
            self.sessions.renew_all()
            for pool_id in self.runner_addresses:
                self.registry.renew(pool_id)

    def _replay_one(self, kind: int, args: tuple[Any, ...]) -> None:
        """Applies one record. Every record was applied once without a whole-call error (the
        checks that can fail run before the `_apply_*` methods), so an error here means the
        journal does not fit this code: starting from a wrong state would be worse."""
        appliers: dict[int, Callable[..., object]] = {
            REC_OPEN: self.sessions.start, REC_CLOSE: self._close_session,
            REC_EXPIRE: self._expire, REC_CREATE_POOL: self._apply_create_pool,
            REC_OP: self._apply_single, REC_STEP: self._apply_step,
            REC_REGISTER: self._apply_register, REC_DROP_POOL: self._drop_pool,
            REC_STEP_WIRE: self._replay_wire}
        try:
            appliers[kind](*args)
        except (BlockServiceError, KeyError, TypeError) as error:
            raise RuntimeError(f"journal record of kind {kind} does not replay: {error}") \
                from error

    # ---- sessions ------------------------------------------------------------------------
    def open_session(self, client_name: str, lease_ttl_ms: int = 0) -> tuple[str, int]:
        """Opens a lease; returns (session_id, granted TTL in ms)."""
        check_text("client_name", client_name, MAX_CLIENT_NAME_BYTES)
        with self._lock:
            if len(self.sessions.open) >= self.limits.max_sessions:
                raise exhausted(f"{len(self.sessions.open)} sessions are open: the limit is "
                                f"{self.limits.max_sessions} (max_sessions)")
            session_id = self.sessions.new_id()
            ttl_s = self.sessions.policy.grant(lease_ttl_ms)
            self.sessions.start(session_id, client_name, ttl_s)
            self._record(REC_OPEN, (session_id, client_name, ttl_s))
            return session_id, round(ttl_s * 1000)

    def keep_alive(self, session_id: str) -> int:
        """Renews a lease; returns the granted TTL in ms.

        Not journaled: a lease time is not replayed (every session gets a fresh lease after a
        restart); an expiry found here is journaled by `_expire`.
        """
        with self._lock:
            return round(self._live_session(session_id).ttl_s * 1000)

    def close_session(self, session_id: str) -> int:
        """Ends a lease and frees its sequences; returns how many were freed."""
        with self._lock:
            self._live_session(session_id)
            freed = self._close_session(session_id)
            self._record(REC_CLOSE, (session_id,))
            return freed

    def _close_session(self, session_id: str) -> int:
        return self._end_session(session_id, expired=False)

    def reap_expired(self) -> int:
        """Expires every overdue session (freeing its sequences) and drops every registered
        pool whose lease ran out; returns how many of both."""
        with self._lock:
            overdue = self.sessions.overdue_ids()
            for session_id in overdue:
                self._expire(session_id)
                self._record(REC_EXPIRE, (session_id,))
            gone = self.registry.overdue()
            for pool_id in gone:
                self._drop_pool(pool_id)
                self._record(REC_DROP_POOL, (pool_id,))
            return len(overdue) + len(gone)

    def _live_session(self, session_id: str) -> Session:
        """The session, renewed; an overdue one is expired here and FAILED_PRECONDITION."""
        session = self.sessions.find(session_id)
        if self.sessions.overdue(session):
            self._expire(session_id)
            self._record(REC_EXPIRE, (session_id,))
            self.sessions.find(session_id)  # raises FAILED_PRECONDITION (expired)
        self.sessions.renew(session)
        return session

    def _expire(self, session_id: str) -> int:
        return self._end_session(session_id, expired=True)

    def _end_session(self, session_id: str, expired: bool) -> int:
        self.sessions.end(session_id, expired)
        self.registry.end_session(session_id)
        return sum(pm.free_session(session_id) for pm in self.pools.values())

    # ---- pools ---------------------------------------------------------------------------
    def create_pool(self, pool_id: str, num_blocks: int, block_size: int, epoch: int,
                    free_order: Sequence[int] | None = None) -> PoolInfo:
        """Creates or confirms a pool; a new epoch empties it (its sequences become stale).

        `free_order` (tests only) is the order a new pool hands its blocks out in.
        """
        check_pool_shape(pool_id, num_blocks, block_size, epoch, self.limits.max_pool_blocks)
        with self._lock:
            pm = self.pools.get(pool_id)
            if pm is None and len(self.pools) >= self.limits.max_pools:
                raise exhausted(f"{len(self.pools)} pools exist: the limit is "
                                f"{self.limits.max_pools} (max_pools)")
            if pm is not None and pm.epoch == epoch:
                if (pm.pool.num_blocks, pm.block_size) != (num_blocks, block_size):
                    raise BlockServiceError(
                        ErrorCode.FAILED_PRECONDITION,
                        f"pool {pool_id!r} epoch {epoch} has {pm.pool.num_blocks} blocks of "
                        f"{pm.block_size}; a new shape needs a new epoch")
                return self._info(pm)  # confirmed: nothing changes, nothing to journal
            order = None if free_order is None else list(free_order)
            info = self._apply_create_pool(pool_id, num_blocks, block_size, epoch, order)
            self._record(REC_CREATE_POOL, (pool_id, num_blocks, block_size, epoch, order))
            return info

    def _apply_create_pool(self, pool_id: str, num_blocks: int, block_size: int, epoch: int,
                           free_order: list[int] | None) -> PoolInfo:
        """A new pool, or a new epoch of an existing one."""
        pm = self.pools.get(pool_id)
        if pm is None:
            pm = self.pools[pool_id] = PoolManager(pool_id, num_blocks, block_size, epoch,
                                                   free_order)
        else:
            pm.new_epoch(epoch, num_blocks, block_size)
        return self._info(pm)

    # ---- runners: membership and routing (block_service/registry.py) ---------------------
    def register_runner(self, pool_id: str, address: str, num_blocks: int, block_size: int,
                        epoch: int, lease_ttl_ms: int = 0) -> tuple[PoolInfo, int]:
        """Registers a runner's pool (created or confirmed as by create_pool) or renews its
        lease; returns the pool and the lease granted in ms."""
        check_pool_shape(pool_id, num_blocks, block_size, epoch, self.limits.max_pool_blocks)
        if not address:
            raise invalid("address is empty")
        check_text("address", address, MAX_POOL_ID_BYTES)
        with self._lock:
            pm = self.pools.get(pool_id)
            if pm is None and len(self.pools) >= self.limits.max_pools:
                raise exhausted(f"{len(self.pools)} pools exist: the limit is "
                                f"{self.limits.max_pools} (max_pools)")
            same_epoch = pm is not None and pm.epoch == epoch
            if pm is not None and same_epoch and \
                    (pm.pool.num_blocks, pm.block_size) != (num_blocks, block_size):
                raise BlockServiceError(
                    ErrorCode.FAILED_PRECONDITION,
                    f"pool {pool_id!r} epoch {epoch} has {pm.pool.num_blocks} blocks of "
                    f"{pm.block_size}; a new shape needs a new epoch")
            ttl_s = self.sessions.policy.grant(lease_ttl_ms)
            if not same_epoch or self.runner_addresses.get(pool_id) != address or \
                    self.registry.lease_ttl_s.get(pool_id) != ttl_s:
                args = (pool_id, address, num_blocks, block_size, epoch, ttl_s)
                self._apply_register(*args)
                self._record(REC_REGISTER, args)
            self.registry.renew(pool_id)
            return self._info(self.pools[pool_id]), round(ttl_s * 1000)

    def unregister_runner(self, pool_id: str, epoch: int) -> None:
        """A registered runner leaves now (its pool is dropped as at the end of its lease)."""
        check_text("pool_id", pool_id, MAX_POOL_ID_BYTES)
        with self._lock:
            if pool_id not in self.runner_addresses:
                raise BlockServiceError(ErrorCode.NOT_FOUND,
                                        f"no runner registered as {shown(pool_id)}")
            if self.pools[pool_id].epoch != epoch:
                raise BlockServiceError(
                    ErrorCode.FAILED_PRECONDITION,
                    f"runner {shown(pool_id)} is registered at epoch "
                    f"{self.pools[pool_id].epoch}, not {epoch}")
            self._drop_pool(pool_id)
            self._record(REC_DROP_POOL, (pool_id,))

    def _apply_register(self, pool_id: str, address: str, num_blocks: int, block_size: int,
                        epoch: int, ttl_s: float) -> None:
        pm = self.pools.get(pool_id)
        if pm is None or pm.epoch != epoch:
            self._apply_create_pool(pool_id, num_blocks, block_size, epoch, None)
        self.runner_addresses[pool_id] = address
        self.registry.renew(pool_id, ttl_s)

    def _drop_pool(self, pool_id: str) -> None:
        """A registered runner left (its lease ran out): its pool and every sequence in it
        are gone; their sessions' next operations on it answer NOT_FOUND."""
        pm = self.pools.pop(pool_id, None)
        if pm is not None:
            self.kv_events.close(pm)  # a last AllBlocksCleared; its subscribers then end
        self.runner_addresses.pop(pool_id, None)
        self.registry.forget(pool_id)

    def list_runners(self) -> list[tuple[PoolInfo, RunnerLoad]]:
        """Every live registered pool with its load figures, by pool id."""
        with self._lock:
            pools = self._live_pools()
            return [(self._info(pm), load)
                    for pm, load in zip(pools, self.registry.loads(pools), strict=True)]

    def _live_pools(self) -> list[PoolManager]:
        return [self.pools[pool_id] for pool_id in sorted(self.runner_addresses)
                if self.registry.is_live(pool_id)]

    def route(self, client_name: str, token_ids: Sequence[int], cache_salt: str = "",
              policy: int = 0, num_seqs: int = 1, pool_ids: Sequence[str] = ()
              ) -> tuple[Candidate, list[Candidate]]:
        """Places a request on one live runner (see registry.py); returns the choice and
        every candidate. Raises the choice's load at once by what the request adds."""
        check_text("client_name", client_name, MAX_CLIENT_NAME_BYTES)
        check_text("cache_salt", cache_salt, MAX_CACHE_SALT_BYTES)
        check_tokens_per_request(len(token_ids), self.limits)
        error = bad_tokens(token_ids)
        if error:
            raise invalid(error)
        if policy and policy not in POLICIES:
            raise invalid(f"unknown routing policy {policy}")
        for pool_id in pool_ids:
            check_text("pool_ids entry", pool_id, MAX_POOL_ID_BYTES)
        num_seqs = max(num_seqs, 1)
        allowed = set(pool_ids)
        with self._lock:
            pools = [pm for pm in self._live_pools() if not allowed or pm.pool_id in allowed]
            if not pools:
                raise BlockServiceError(ErrorCode.NOT_FOUND, "no live runner to route to" + (
                    f" among the {len(allowed)} pools named" if allowed else ""))
            root = root_hash(cache_salt)
            # By block size, made once for all its pools: the prompt's full blocks (chained
            # hashes, token tuples) and how many of them are pending on each pool.
            chains: dict[int, tuple[list[bytes], list[tuple[int, ...]], dict[str, int]]] = {}
            candidates = []
            for pm, load in zip(pools, self.registry.loads(pools), strict=True):
                size = pm.block_size
                if size not in chains:
                    num_full = len(token_ids) // size
                    hashes = chain_hashes(token_ids, size, num_full, root)
                    chains[size] = (hashes, [tuple(token_ids[i * size:(i + 1) * size])
                                             for i in range(num_full)],
                                    self.registry.pending_blocks(hashes))
                hashes, block_tokens, pending_blocks = chains[size]
                cached = size * pm.pool.cached_run(root, hashes, block_tokens)
                pending = size * pending_blocks.get(pm.pool_id, 0)
                # A pending prefix is queued work this request shares, not a wait in front
                # of it: it leaves the pool's load as it leaves the prompt.
                cost = len(token_ids) - max(cached, pending) \
                    + max(0, load.load_tokens - pending)
                candidates.append(Candidate(pm.pool_id, cached, load.load_tokens, cost, pending))
            chosen = self.registry.choose(policy, candidates)
            # What the request adds there: the prompt tokens it computes, and its outputs.
            held = max(chosen.num_cached_tokens, chosen.num_pending_tokens)
            self.registry.add_routed(client_name, chosen.pool_id, len(token_ids) - held
                                     + DECODE_WEIGHT_TOKENS * num_seqs)
            self.registry.add_pending(chosen.pool_id,
                                      chains[self.pools[chosen.pool_id].block_size][0])
            return chosen, candidates

    def get_pool(self, pool_id: str) -> PoolInfo:
        """A pool's shape and epoch."""
        with self._lock:
            return self._info(self._pool(pool_id))

    def stats(self, pool_id: str) -> PoolStats:
        """A pool's counters."""
        with self._lock:
            pm = self._pool(pool_id)
            pool = pm.pool
            free = pool.num_free()
            return PoolStats(
                pool_id=pool_id, epoch=pm.epoch, total_blocks=pool.num_blocks,
                free_blocks=free, used_blocks=pool.num_blocks - free,
                cached_evictable_blocks=pool.num_evictable(), num_sequences=pm.num_sequences(),
                num_sessions=len(self.sessions.open), prompt_tokens=pm.prompt_tokens,
                cached_prompt_tokens=pm.cached_prompt_tokens, evictions=pool.evictions,
                copies=pm.copies, no_space=pm.no_space, total_refs=sum(pool.ref_counts),
                appended_tokens=pm.appended_tokens)

    def match_prefix(self, pool_id: str, token_ids: Sequence[int], cache_salt: str = "") -> int:
        """Leading tokens of `token_ids` held by computed cached blocks."""
        check_tokens_per_request(len(token_ids), self.limits)
        check_text("cache_salt", cache_salt, MAX_CACHE_SALT_BYTES)
        with self._lock:
            pm = self._pool(pool_id)
            if token_ids and bad_tokens(token_ids):
                raise invalid(bad_tokens(token_ids))
            return pm.match_prefix(token_ids, cache_salt)

    def _pool(self, pool_id: str) -> PoolManager:
        pm = self.pools.get(pool_id)
        if pm is None:
            raise BlockServiceError(ErrorCode.NOT_FOUND, f"pool {shown(pool_id)} not found")
        return pm

    def _info(self, pm: PoolManager) -> PoolInfo:
        return PoolInfo(pm.pool_id, pm.pool.num_blocks, pm.block_size, pm.epoch,
                        self.runner_addresses.get(pm.pool_id, ""))

    def _scope(self, session_id: str, here: PoolManager) -> SessionScope:
        others = [pm for pm in self.pools.values() if pm is not here]
        return SessionScope(
            held_elsewhere=lambda seq_id: any(pm.holds(session_id, seq_id) for pm in others),
            num_seqs=lambda: sum(len(pm.seqs.get(session_id, ())) for pm in self.pools.values()),
            max_seqs=self.limits.max_seqs_per_session)

    # ---- single operations ---------------------------------------------------------------
    def _single(self, session_id: str, pool_id: str, kind: int, seq_id: int,
                token_ids: Sequence[int] = (), parent_id: int = 0,
                num_computed: int = NOT_CHANGED, cache_salt: str = "") -> OpResult:
        """One operation as its own RPC: failures raise, NO_SPACE is returned."""
        check_tokens_per_request(len(token_ids), self.limits)
        check_text("cache_salt", cache_salt, MAX_CACHE_SALT_BYTES)
        args = (session_id, pool_id, kind, seq_id, list(token_ids), parent_id, num_computed,
                cache_salt)
        with self._lock:
            self._live_session(session_id)
            self._pool(pool_id)
            result = self._apply_single(*args)
            # Journaled whatever the status: a failed operation may still have changed state
            # (a stale sequence is forgotten, a NO_SPACE is counted).
            self._record(REC_OP, args)
            return raise_failure(result)

    def _apply_single(self, session_id: str, pool_id: str, kind: int, seq_id: int,
                      token_ids: list[int], parent_id: int, num_computed: int,
                      cache_salt: str) -> OpResult:
        """One operation on an open session's existing pool."""
        pm = self._pool(pool_id)
        result = apply_op(pm, session_id, kind, seq_id, token_ids, parent_id, num_computed,
                          cache_salt, self._scope(session_id, pm))
        if kind == OP_APPEND and result.status == STATUS_OK:
            # Append as its own RPC returns the whole table.
            seq = pm.seqs[session_id][seq_id]
            result.table_start, result.table_block_ids = 0, list(seq.block_table)
        return result

    def allocate(self, session_id: str, pool_id: str, seq_id: int, token_ids: Sequence[int],
                 cache_salt: str = "") -> OpResult:
        """Allocate one sequence (status NO_SPACE when the pool is full)."""
        return self._single(session_id, pool_id, OP_ALLOCATE, seq_id, token_ids,
                            cache_salt=cache_salt)

    def append(self, session_id: str, pool_id: str, seq_id: int, token_ids: Sequence[int],
               num_computed: int = NOT_CHANGED) -> OpResult:
        """Append to one sequence; the result carries its whole table."""
        return self._single(session_id, pool_id, OP_APPEND, seq_id, token_ids,
                            num_computed=num_computed)

    def free(self, session_id: str, pool_id: str, seq_id: int,
             num_computed: int = NOT_CHANGED) -> OpResult:
        """Free one sequence."""
        return self._single(session_id, pool_id, OP_FREE, seq_id, num_computed=num_computed)

    def fork(self, session_id: str, pool_id: str, parent_id: int, child_id: int) -> OpResult:
        """Fork `parent_id` into `child_id`."""
        return self._single(session_id, pool_id, OP_FORK, child_id, parent_id=parent_id)

    # ---- Step ----------------------------------------------------------------------------
    def step(self, session_id: str, pool_id: str, step_id: int, epoch: int,
             kinds: Sequence[int], seq_ids: Sequence[int], token_counts: Sequence[int],
             token_ids: Sequence[int], parent_ids: Sequence[int], computed: Sequence[int],
             cache_salts: Mapping[int, str] | None = None,
             lookaheads: Sequence[int] = (), num_waiting_tokens: int = 0) -> StepResult:
        """Applies a scheduling step's operations in order (see the proto's StepRequest).

        The same step_id as the session's last Step returns that Step's result unchanged.
        `num_waiting_tokens` is the client's load report for the pool (not journaled: load
        figures are soft state).
        """
        salts = dict(cache_salts or {})
        lookaheads = list(lookaheads)
        self._check_shape(
            (len(kinds), len(seq_ids), len(token_counts), len(token_ids), len(parent_ids),
             len(computed), len(lookaheads)), sum(token_counts), salts)
        with self._lock:
            session, kept = self._begin_step(session_id, pool_id, step_id, epoch)
            if kept is not None:
                return answer_result(kept)
            args = (session_id, pool_id, step_id, kinds, seq_ids, token_counts, token_ids,
                    parent_ids, computed, salts, lookaheads)
            result = self._apply_step(*args)
            self._record(REC_STEP, args)
            self.registry.report(session_id, session.client_name, pool_id, num_waiting_tokens)
            return result

    def step_wire(self, data: bytes) -> bytes:
        """`step` for a StepRequest's wire bytes, answering the StepResponse's
        (block_service/step_wire.py); protobuf's DecodeError if the request does not parse."""
        wire = parse_step(data, self.compiled_steps)
        self._check_shape(wire.lengths, wire.token_sum, wire.salts)
        with self._lock:
            session, kept = self._begin_step(wire.session_id, wire.pool_id, wire.step_id,
                                             wire.epoch)
            if kept is not None:
                return answer_bytes(kept)
            answer = self._apply_wire(wire)
            # The request's own bytes: cheaper to journal than its columns, and replayed by
            # the same code.
            self._record(REC_STEP_WIRE, (data,))
            self.registry.report(wire.session_id, session.client_name, wire.pool_id,
                                 wire.num_waiting_tokens)
            return answer

    def _begin_step(self, session_id: str, pool_id: str, step_id: int,
                    epoch: int) -> tuple[Session, StepResult | bytes | None]:
        """Checks a Step against its session and pool (under the lock): the session, and the
        kept answer of a retried step_id (None for a new step)."""
        session = self._live_session(session_id)
        if step_id == session.last_step_id and session.last_step is not None:
            return session, session.last_step
        if step_id < session.last_step_id:
            raise BlockServiceError(
                ErrorCode.FAILED_PRECONDITION,
                f"step_id {step_id} is older than the session's last ({session.last_step_id})")
        pm = self._pool(pool_id)
        if epoch and epoch != pm.epoch:
            raise BlockServiceError(
                ErrorCode.FAILED_PRECONDITION,
                f"step built for epoch {epoch}; pool {pool_id!r} is at epoch {pm.epoch}")
        return session, None

    def _apply_wire(self, wire: WireStep) -> bytes:
        """A checked Step in wire form; its answer bytes are kept for a retry."""
        if wire.parsed is None:  # parsed by protobuf: the Python path
            columns = wire.columns
            assert columns is not None
            return answer_bytes(self._apply_step(
                wire.session_id, wire.pool_id, wire.step_id, columns.kinds, columns.seq_ids,
                columns.token_counts, columns.token_ids, columns.parent_ids, columns.computed,
                wire.salts, columns.lookaheads))
        session_id, salts = wire.session_id, wire.salts
        session = self.sessions.find(session_id)
        pm = self._pool(wire.pool_id)
        scope = self._scope(session_id, pm)

        def slow(index: int, kind: int, seq_id: int, token_ids: list[int], parent_id: int,
                 num_computed: int, lookahead: int) -> OpResult:
            return apply_op(pm, session_id, kind, seq_id, token_ids, parent_id, num_computed,
                            salts.get(index, ""), scope, lookahead)

        pool = pm.pool
        answer, fast_appends, computed_here = compiled_step.run(
            wire.parsed, pm.session_seqs(session_id), pool.ref_counts, pool.take,
            pool.num_free, pm.set_computed, pm.shift, pool.num_blocks, slow, wire.step_id,
            pm.epoch)
        pm.appended_tokens += fast_appends
        pm.uncomputed_tokens += fast_appends - computed_here
        session.last_step_id, session.last_step = wire.step_id, answer
        return answer

    def _replay_wire(self, data: bytes) -> None:
        self._apply_wire(parse_step(data, self.compiled_steps))

    def _apply_step(self, session_id: str, pool_id: str, step_id: int, kinds: Sequence[int],
                    seq_ids: Sequence[int], token_counts: Sequence[int],
                    token_ids: Sequence[int], parent_ids: Sequence[int],
                    computed: Sequence[int], salts: Mapping[int, str],
                    lookaheads: Sequence[int] = ()) -> StepResult:
        """A checked Step's operations; the answer is kept for a retry of the same step_id.

        (`lookaheads` defaults to none so that records journaled before it existed replay.)
        """
        session = self.sessions.find(session_id)
        pm = self._pool(pool_id)
        result = run_step(pm, session_id, step_id, kinds, seq_ids, token_counts, token_ids,
                          parent_ids, computed, salts, self._scope(session_id, pm), lookaheads)
        session.last_step_id, session.last_step = step_id, result
        return result

    def _check_shape(self, lengths: Sequence[int], token_sum: int,
                     salts: Mapping[int, str]) -> None:
        """Raises INVALID_ARGUMENT unless the columns (their `lengths`: kinds, seq_ids,
        token_counts, token_ids, parent_seq_ids, num_computed_tokens, num_lookahead_slots)
        describe len(kinds) operations."""
        num_ops, num_seqs, num_counts, num_tokens, num_parents, num_computed, num_lookaheads = \
            lengths
        if num_ops > self.limits.max_ops_per_step:
            raise invalid(f"{num_ops} operations in one step: the limit is "
                          f"{self.limits.max_ops_per_step} (max_ops_per_step)")
        check_tokens_per_request(num_tokens, self.limits)
        named = {"seq_ids": num_seqs, "token_counts": num_counts,
                 "parent_seq_ids": num_parents, "num_computed_tokens": num_computed}
        for name, length in named.items():
            if length != num_ops:
                raise invalid(f"{name} has {length} entries for {num_ops} operations")
        if num_lookaheads and num_lookaheads != num_ops:
            raise invalid(f"num_lookahead_slots has {num_lookaheads} entries for {num_ops} "
                          "operations (or none)")
        if token_sum != num_tokens:
            raise invalid(f"token_counts add up to {token_sum}, token_ids has {num_tokens}")
        if any(index >= num_ops for index in salts):
            raise invalid("cache_salts names an operation index past the last operation")
        for salt in salts.values():
            check_text("cache_salt", salt, MAX_CACHE_SALT_BYTES)

    # ---- KV events (block_service/events.py, docs/kv_events.md) ---------------------------
    def subscribe_events(self, pool_id: str, after_sequence: int,
                         instance_id: str) -> Subscription:
        """A pool's KV event batches after `after_sequence` of `instance_id`: a snapshot
        first for 0, another instance, or a number the replay buffer no longer holds.

        NOT_FOUND for an unknown pool, OUT_OF_RANGE for a number past the newest batch.
        """
        check_text("pool_id", pool_id, MAX_POOL_ID_BYTES)
        with self._lock:
            return self.kv_events.subscribe(self._pool(pool_id), after_sequence, instance_id)
