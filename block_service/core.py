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
)
from block_service.pool_manager import PoolManager, bad_tokens
from block_service.sessions import LeasePolicy, Session, SessionTable
from block_service.step import HeldElsewhere, apply_op, run_step

MAX_POOL_ID_BYTES = 256
MAX_BLOCK_SIZE = 65536
DEFAULT_MAX_OPS_PER_STEP = 65536
DEFAULT_MAX_POOL_BLOCKS = 1 << 24


def invalid(message: str) -> BlockServiceError:
    """An INVALID_ARGUMENT error."""
    return BlockServiceError(ErrorCode.INVALID_ARGUMENT, message)


def raise_failure(result: OpResult) -> OpResult:
    """Raises the whole-call error of a failed single operation (NO_SPACE is an answer)."""
    if result.status in (STATUS_OK, STATUS_NO_SPACE):
        return result
    raise BlockServiceError(STATUS_ERROR_CODES[result.status], result.error)


def check_pool_shape(pool_id: str, num_blocks: int, block_size: int, epoch: int,
                     max_blocks: int) -> None:
    """Raises INVALID_ARGUMENT for a malformed CreatePool."""
    if not pool_id or len(pool_id.encode("utf-8")) > MAX_POOL_ID_BYTES:
        raise invalid(f"pool_id must be 1 to {MAX_POOL_ID_BYTES} bytes")
    if not 1 <= num_blocks <= max_blocks:
        raise invalid(f"num_blocks {num_blocks} is outside 1 .. {max_blocks}")
    if not 1 <= block_size <= MAX_BLOCK_SIZE or block_size & (block_size - 1):
        raise invalid(f"block_size {block_size} is not a power of two in 1 .. {MAX_BLOCK_SIZE}")
    if epoch <= 0:
        raise invalid("epoch must be non-zero")


class BlockServiceCore:
    """Every pool and session of one block service."""

    def __init__(self, lease_policy: LeasePolicy | None = None,
                 max_ops_per_step: int = DEFAULT_MAX_OPS_PER_STEP,
                 max_pool_blocks: int = DEFAULT_MAX_POOL_BLOCKS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self.pools: dict[str, PoolManager] = {}
        self.sessions = SessionTable(lease_policy or LeasePolicy(), clock)
        self.max_ops_per_step = max_ops_per_step
        self.max_pool_blocks = max_pool_blocks

    # ---- sessions ------------------------------------------------------------------------
    def open_session(self, client_name: str, lease_ttl_ms: int = 0) -> tuple[str, int]:
        """Opens a lease; returns (session_id, granted TTL in ms)."""
        with self._lock:
            session = self.sessions.start(client_name, lease_ttl_ms)
            return session.session_id, round(session.ttl_s * 1000)

    def keep_alive(self, session_id: str) -> int:
        """Renews a lease; returns the granted TTL in ms."""
        with self._lock:
            return round(self._live_session(session_id).ttl_s * 1000)

    def close_session(self, session_id: str) -> int:
        """Ends a lease and frees its sequences; returns how many were freed."""
        with self._lock:
            self._live_session(session_id)
            return self._end_session(session_id, expired=False)

    def reap_expired(self) -> int:
        """Expires every overdue session (freeing its sequences); returns how many."""
        with self._lock:
            overdue = self.sessions.overdue_ids()
            for session_id in overdue:
                self._end_session(session_id, expired=True)
            return len(overdue)

    def _live_session(self, session_id: str) -> Session:
        """The session, renewed; an overdue one is expired here and FAILED_PRECONDITION."""
        session = self.sessions.find(session_id)
        if self.sessions.overdue(session):
            self._end_session(session_id, expired=True)
            self.sessions.find(session_id)  # raises FAILED_PRECONDITION (expired)
        self.sessions.renew(session)
        return session

    def _end_session(self, session_id: str, expired: bool) -> int:
        self.sessions.end(session_id, expired)
        return sum(pm.free_session(session_id) for pm in self.pools.values())

    # ---- pools ---------------------------------------------------------------------------
    def create_pool(self, pool_id: str, num_blocks: int, block_size: int, epoch: int,
                    free_order: Sequence[int] | None = None) -> PoolInfo:
        """Creates or confirms a pool; a new epoch empties it (its sequences become stale).

        `free_order` (tests only) is the order a new pool hands its blocks out in.
        """
        check_pool_shape(pool_id, num_blocks, block_size, epoch, self.max_pool_blocks)
        with self._lock:
            pm = self.pools.get(pool_id)
            if pm is None:
                pm = self.pools[pool_id] = PoolManager(pool_id, num_blocks, block_size, epoch,
                                                       free_order)
            elif pm.epoch != epoch:
                pm.new_epoch(epoch, num_blocks, block_size)
            elif (pm.pool.num_blocks, pm.block_size) != (num_blocks, block_size):
                raise BlockServiceError(
                    ErrorCode.FAILED_PRECONDITION,
                    f"pool {pool_id!r} epoch {epoch} has {pm.pool.num_blocks} blocks of "
                    f"{pm.block_size}; a new shape needs a new epoch")
            return self._info(pm)

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
                copies=pm.copies, no_space=pm.no_space, total_refs=sum(pool.ref_counts))

    def match_prefix(self, pool_id: str, token_ids: Sequence[int], cache_salt: str = "") -> int:
        """Leading tokens of `token_ids` held by computed cached blocks."""
        with self._lock:
            pm = self._pool(pool_id)
            if token_ids and bad_tokens(token_ids):
                raise invalid(bad_tokens(token_ids))
            return pm.match_prefix(token_ids, cache_salt)

    def _pool(self, pool_id: str) -> PoolManager:
        pm = self.pools.get(pool_id)
        if pm is None:
            raise BlockServiceError(ErrorCode.NOT_FOUND, f"pool {pool_id!r} not found")
        return pm

    @staticmethod
    def _info(pm: PoolManager) -> PoolInfo:
        return PoolInfo(pm.pool_id, pm.pool.num_blocks, pm.block_size, pm.epoch)

    def _held_elsewhere(self, session_id: str, here: PoolManager) -> HeldElsewhere:
        others = [pm for pm in self.pools.values() if pm is not here]
        return lambda seq_id: any(pm.holds(session_id, seq_id) for pm in others)

    # ---- single operations ---------------------------------------------------------------
    def _single(self, session_id: str, pool_id: str, kind: int, seq_id: int,
                token_ids: Sequence[int] = (), parent_id: int = 0,
                num_computed: int = NOT_CHANGED, cache_salt: str = "") -> OpResult:
        """One operation as its own RPC: failures raise, NO_SPACE is returned."""
        with self._lock:
            self._live_session(session_id)
            pm = self._pool(pool_id)
            result = apply_op(pm, session_id, kind, seq_id, token_ids, parent_id, num_computed,
                              cache_salt, self._held_elsewhere(session_id, pm))
            if kind == OP_APPEND and result.status == STATUS_OK:
                # Append as its own RPC returns the whole table.
                seq = pm.seqs[session_id][seq_id]
                result.table_start, result.table_block_ids = 0, list(seq.block_table)
            return raise_failure(result)

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
             cache_salts: Mapping[int, str] | None = None) -> StepResult:
        """Applies a scheduling step's operations in order (see the proto's StepRequest).

        The same step_id as the session's last Step returns that Step's result unchanged.
        """
        salts = cache_salts or {}
        self._check_columns(kinds, seq_ids, token_counts, token_ids, parent_ids, computed,
                            salts)
        with self._lock:
            session = self._live_session(session_id)
            if step_id == session.last_step_id and session.last_step is not None:
                return session.last_step
            if step_id < session.last_step_id:
                raise BlockServiceError(
                    ErrorCode.FAILED_PRECONDITION,
                    f"step_id {step_id} is older than the session's last ({session.last_step_id})")
            pm = self._pool(pool_id)
            if epoch and epoch != pm.epoch:
                raise BlockServiceError(
                    ErrorCode.FAILED_PRECONDITION,
                    f"step built for epoch {epoch}; pool {pool_id!r} is at epoch {pm.epoch}")
            result = run_step(pm, session_id, step_id, kinds, seq_ids, token_counts, token_ids,
                              parent_ids, computed, salts, self._held_elsewhere(session_id, pm))
            session.last_step_id, session.last_step = step_id, result
            return result

    def _check_columns(self, kinds: Sequence[int], seq_ids: Sequence[int],
                       token_counts: Sequence[int], token_ids: Sequence[int],
                       parent_ids: Sequence[int], computed: Sequence[int],
                       salts: Mapping[int, str]) -> None:
        """Raises INVALID_ARGUMENT unless the columns describe len(kinds) operations."""
        num_ops = len(kinds)
        if num_ops > self.max_ops_per_step:
            raise invalid(f"{num_ops} operations; at most {self.max_ops_per_step} per step")
        lengths = {"seq_ids": len(seq_ids), "token_counts": len(token_counts),
                   "parent_seq_ids": len(parent_ids), "num_computed_tokens": len(computed)}
        for name, length in lengths.items():
            if length != num_ops:
                raise invalid(f"{name} has {length} entries for {num_ops} operations")
        if sum(token_counts) != len(token_ids):
            raise invalid(f"token_counts add up to {sum(token_counts)}, token_ids has "
                          f"{len(token_ids)}")
        if any(index >= num_ops for index in salts):
            raise invalid("cache_salts names an operation index past the last operation")
