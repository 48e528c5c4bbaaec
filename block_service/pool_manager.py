"""One pool's sequences: allocate / append / fork / commit / free with copy-on-write.

Every operation validates everything and checks for space before it changes anything, so a
failed operation (any status but OK) leaves the pool as it was. A refused operation (a bad
value, an unknown or stale sequence) raises `_Refused` wherever that is found, and its public
method answers it; no space is the one failure an operation returns as such.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Concatenate, ParamSpec

from block_service.block_pool import BlockPool, Publish
from block_service.hashing import block_hash, root_hash
from block_service.ops import (
    INT32_MAX,
    NOT_CHANGED,
    STATUS_INVALID_ARGUMENT,
    STATUS_NO_SPACE,
    STATUS_NOT_FOUND,
    STATUS_STALE,
    OpResult,
)
from block_service.sequence import RESERVED, Sequence, num_blocks_for, slots_for


def failed(status: int, error: str) -> OpResult:
    """The result of an operation that changed nothing."""
    return OpResult(status=status, error=error)


class _Refused(Exception):
    """An operation refused before it changed anything: its status and error message."""

    def __init__(self, status: int, error: str) -> None:
        super().__init__(error)
        self.status = status
        self.error = error


P = ParamSpec("P")


def _answers_refusals(
    operation: Callable[Concatenate[PoolManager, P], OpResult]
) -> Callable[Concatenate[PoolManager, P], OpResult]:
    """A public operation that answers a `_Refused` raised inside it as its failed result."""

    @functools.wraps(operation)
    def answered(pm: PoolManager, /, *args: P.args, **kwargs: P.kwargs) -> OpResult:
        try:
            return operation(pm, *args, **kwargs)
        except _Refused as refused:
            return failed(refused.status, refused.error)

    return answered


def bad_tokens(token_ids: Seq[int]) -> str:
    """Why these tokens are not acceptable, or "" when they are."""
    if not token_ids:
        return "token_ids is empty"
    if min(token_ids) < 0:
        return f"negative token id {min(token_ids)}"
    if max(token_ids) > INT32_MAX:
        return f"token id {max(token_ids)} does not fit in int32"
    return ""


class PoolManager:
    """The sequences of one pool (by session, then seq id) over a BlockPool."""

    # Tokens appended since start (a class default: snapshots from before it load).
    appended_tokens = 0

    def __init__(self, pool_id: str, num_blocks: int, block_size: int, epoch: int,
                 free_order: Seq[int] | None = None) -> None:
        self.pool_id = pool_id
        self.epoch = epoch
        self.pool = BlockPool(num_blocks, block_size, free_order)
        self.block_size = block_size
        self.shift = block_size.bit_length() - 1  # block_size is a power of two
        self.seqs: dict[str, dict[int, Sequence]] = {}
        # Sequences of an earlier epoch, by session: their next operation answers STALE.
        self.stale: dict[str, set[int]] = {}
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self.copies = 0
        self.no_space = 0
        # Positions of live sequences whose KV is not computed (a routing load figure), kept
        # as they change: summing them over every sequence on each Route was its main cost.
        self.uncomputed_tokens = 0

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        if "uncomputed_tokens" not in state:  # a snapshot from before the counter
            self.uncomputed_tokens = sum(len(seq.tokens) - seq.num_computed
                                         for seqs in self.seqs.values() for seq in seqs.values())

    # ---- lookups -------------------------------------------------------------------------
    def session_seqs(self, session_id: str) -> dict[int, Sequence]:
        """The (live) sequences a session holds here, created empty on first use."""
        seqs = self.seqs.get(session_id)
        if seqs is None:
            seqs = self.seqs[session_id] = {}
        return seqs

    def holds(self, session_id: str, seq_id: int) -> bool:
        """Whether the session has a live sequence `seq_id` here."""
        return seq_id in self.seqs.get(session_id, ())

    def num_sequences(self) -> int:
        """Live sequences of every session."""
        return sum(len(seqs) for seqs in self.seqs.values())

    def _find(self, session_id: str, seq_id: int) -> Sequence:
        """The live sequence; refused STALE (then forgotten) or NOT_FOUND."""
        seq = self.seqs.get(session_id, {}).get(seq_id)
        if seq is not None:
            return seq
        stale = self.stale.get(session_id)
        if stale is not None and seq_id in stale:
            stale.discard(seq_id)
            raise _Refused(STATUS_STALE, f"sequence {seq_id} was lost with an earlier epoch of "
                                         f"pool {self.pool_id!r}; allocate it again")
        raise _Refused(STATUS_NOT_FOUND, f"sequence {seq_id} not found in pool {self.pool_id!r}")

    def _bad_computed(self, seq: Sequence, num_computed: int, num_known: int) -> str:
        """Why a reported num_computed_tokens is not acceptable, or "" (`num_known`: the
        sequence's tokens whose values are known at that point)."""
        if num_computed < NOT_CHANGED or num_computed > num_known:
            what = "known tokens" if num_known < len(seq.tokens) else "the sequence's length"
            return (f"num_computed_tokens {num_computed} is outside -1 .. {num_known} "
                    f"({what})")
        return ""

    def _too_big(self, num_tokens: int) -> str:
        """Why a sequence of `num_tokens` can never fit in this pool, or ""."""
        needed = num_blocks_for(num_tokens, self.block_size)
        if needed > self.pool.num_blocks:
            return (f"{num_tokens} tokens need {needed} blocks; pool {self.pool_id!r} has "
                    f"only {self.pool.num_blocks}")
        return ""

    # ---- prefix cache --------------------------------------------------------------------
    def match(self, token_ids: Seq[int], parent: bytes, max_blocks: int) -> tuple[
            list[int], list[bytes]]:
        """The longest run of cached blocks (at most max_blocks) and their hashes."""
        size = self.block_size
        lookup = self.pool.lookup
        blocks: list[int] = []
        hashes: list[bytes] = []
        for index in range(max_blocks):
            tokens = token_ids[index * size:(index + 1) * size]
            digest = block_hash(parent, tokens)
            block = lookup(parent, digest, tokens)
            if block is None:
                break
            blocks.append(block)
            hashes.append(digest)
            parent = digest
        return blocks, hashes

    def match_prefix(self, token_ids: Seq[int], cache_salt: str) -> int:
        """Leading tokens held by computed cached blocks (whole blocks; may be all of them)."""
        blocks, _ = self.match(token_ids, root_hash(cache_salt), len(token_ids) >> self.shift)
        return len(blocks) * self.block_size

    def set_computed(self, seq: Sequence, num_computed: int) -> None:
        """Records computed tokens and publishes the full blocks they complete."""
        if num_computed <= seq.num_computed:
            return  # -1 (unchanged) or an old report: num_computed never decreases
        self.uncomputed_tokens -= num_computed - seq.num_computed
        seq.num_computed = num_computed
        if seq.publishing and num_computed >> self.shift > seq.num_published:
            self._publish(seq, num_computed >> self.shift)

    def _publish(self, seq: Sequence, num_full: int) -> None:
        """Publishes blocks num_published .. num_full - 1 of `seq`.

        A hash already held by another block keeps that block canonical (twins admitted in the
        same step); on a collision the sequence stops publishing.
        """
        size = self.block_size
        parent = seq.hashes[-1] if seq.hashes else seq.root
        for index in range(seq.num_published, num_full):
            tokens = seq.tokens[index * size:(index + 1) * size]
            digest = block_hash(parent, tokens)
            if self.pool.publish(seq.block_table[index], digest, parent, tokens) is \
                    Publish.COLLISION:
                seq.publishing = False
                break
            seq.hashes.append(digest)
            parent = digest
        seq.num_published = len(seq.hashes)

    # ---- operations ----------------------------------------------------------------------
    @_answers_refusals
    def allocate(self, session_id: str, seq_id: int, token_ids: Seq[int],
                 cache_salt: str = "") -> OpResult:
        """A new sequence for a prompt: the longest cached prefix, then new blocks.

        The caller has checked that the session holds no sequence `seq_id` (in any pool).
        """
        error = bad_tokens(token_ids) or self._too_big(len(token_ids))
        if error:
            raise _Refused(STATUS_INVALID_ARGUMENT, error)
        size, pool = self.block_size, self.pool
        num_tokens = len(token_ids)
        root = root_hash(cache_salt)
        # Never the whole prompt: the last token is always computed.
        cached, hashes = self.match(token_ids, root, (num_tokens - 1) >> self.shift)
        needed = num_blocks_for(num_tokens, size) - len(cached)
        hits_on_free = sum(1 for block in cached if pool.ref_counts[block] == 0)
        if needed > pool.num_free() - hits_on_free:
            self.no_space += 1
            return failed(STATUS_NO_SPACE, f"{needed} blocks needed, "
                                           f"{pool.num_free() - hits_on_free} free")
        for block in cached:
            pool.acquire(block)
        table = cached + [pool.take() for _ in range(needed)]
        num_cached = len(cached) * size
        self.session_seqs(session_id)[seq_id] = Sequence(
            list(token_ids), table, num_cached, hashes, root)
        self.uncomputed_tokens += num_tokens - num_cached
        self.stale.get(session_id, set()).discard(seq_id)
        self.prompt_tokens += num_tokens
        self.cached_prompt_tokens += num_cached
        return OpResult(num_cached_tokens=num_cached, table_start=0, table_block_ids=list(table),
                        slots=slots_for(table, size, num_cached, num_tokens))

    @_answers_refusals
    def append(self, session_id: str, seq_id: int, token_ids: Seq[int],
               num_computed: int = NOT_CHANGED, lookahead: int = 0) -> OpResult:
        """Appends tokens: new blocks past a boundary, a private copy of a shared last block.

        A reserved last position is filled with the first token (its slot was handed out
        with the reservation); `lookahead` 1 reserves one position after the tokens. The
        result's table change starts at the first index that changed (len(table) and no ids
        when none did).
        """
        seq = self._find(session_id, seq_id)
        old_len = len(seq.tokens)
        filling = seq.reserved and bool(token_ids)
        new_len = old_len - filling + len(token_ids) + lookahead
        error = (self._bad_append(seq, token_ids, lookahead)
                 or self._bad_computed(seq, num_computed, old_len if filling else seq.num_known)
                 or self._too_big(new_len))
        if error:
            raise _Refused(STATUS_INVALID_ARGUMENT, error)
        pool, table = self.pool, seq.block_table
        new_blocks = num_blocks_for(new_len, self.block_size) - len(table)
        # Writing into a partly filled block that a fork shares: copy it first.
        copy_last = (new_len > old_len and old_len % self.block_size != 0
                     and pool.ref_counts[table[-1]] > 1)
        if new_blocks + copy_last > pool.num_free():
            self.no_space += 1
            return failed(STATUS_NO_SPACE, f"{new_blocks + copy_last} blocks needed, "
                                           f"{pool.num_free()} free")
        if filling:
            seq.tokens[-1] = token_ids[0]
        self.set_computed(seq, num_computed)
        start = len(table)
        copies: list[tuple[int, int]] = []
        if copy_last:
            start -= 1
            source, copy = table[-1], pool.take()
            pool.release(source)  # still referenced by the other sharers
            table[-1] = copy
            copies.append((source, copy))
            self.copies += 1
        table.extend(pool.take() for _ in range(new_blocks))
        seq.tokens.extend(token_ids[filling:])
        seq.tokens.extend([RESERVED] * lookahead)
        self.uncomputed_tokens += new_len - old_len
        self.appended_tokens += len(token_ids)
        return OpResult(table_start=start, table_block_ids=table[start:], copies=copies,
                        slots=slots_for(table, self.block_size, old_len, new_len))

    @staticmethod
    def _bad_append(seq: Sequence, token_ids: Seq[int], lookahead: int) -> str:
        """Why an APPEND's tokens and reservation are not acceptable, or ""."""
        if lookahead not in (0, 1):
            return f"num_lookahead_slots {lookahead} is not 0 or 1"
        if token_ids or not lookahead:
            return bad_tokens(token_ids)
        if seq.reserved:  # a reservation alone, on top of one
            return "the sequence's last position is reserved already: fill it first"
        return ""

    def _find_and_commit(self, session_id: str, seq_id: int, num_computed: int) -> Sequence:
        """The sequence with a reported num_computed_tokens recorded."""
        seq = self._find(session_id, seq_id)
        error = self._bad_computed(seq, num_computed, seq.num_known)
        if error:
            raise _Refused(STATUS_INVALID_ARGUMENT, error)
        self.set_computed(seq, num_computed)
        return seq

    @_answers_refusals
    def commit(self, session_id: str, seq_id: int, num_computed: int) -> OpResult:
        """Only records num_computed_tokens (publishing the full blocks it completes)."""
        seq = self._find_and_commit(session_id, seq_id, num_computed)
        return OpResult(table_start=len(seq.block_table))

    @_answers_refusals
    def free(self, session_id: str, seq_id: int, num_computed: int = NOT_CHANGED) -> OpResult:
        """Drops the sequence; its blocks' refs go down, computed full blocks stay cached.

        Blocks are released tail first so that, among equally old cached blocks, a prefix's
        tail is evicted before its head.
        """
        seq = self._find_and_commit(session_id, seq_id, num_computed)
        release = self.pool.release
        released = sum(release(block) for block in reversed(seq.block_table))
        del self.seqs[session_id][seq_id]
        self.uncomputed_tokens -= len(seq.tokens) - seq.num_computed
        return OpResult(num_released_blocks=released)

    @_answers_refusals
    def fork(self, session_id: str, parent_id: int, child_id: int,
             num_computed: int = NOT_CHANGED) -> OpResult:
        """A child sharing every block of the parent (copy-on-write on its first write).

        `num_computed` is the parent's, recorded first. The caller has checked that the
        session holds no sequence `child_id` (in any pool).
        """
        if self._find(session_id, parent_id).reserved:
            # Both would write the one reserved slot.
            raise _Refused(STATUS_INVALID_ARGUMENT, f"sequence {parent_id} has a reserved "
                                                    "position: fill it before forking")
        parent = self._find_and_commit(session_id, parent_id, num_computed)
        child = parent.fork()
        for block in child.block_table:
            self.pool.acquire(block)
        self.session_seqs(session_id)[child_id] = child
        self.uncomputed_tokens += len(child.tokens) - child.num_computed
        self.stale.get(session_id, set()).discard(child_id)
        return OpResult(table_start=0, table_block_ids=list(child.block_table))

    # ---- whole-pool changes --------------------------------------------------------------
    def free_session(self, session_id: str) -> int:
        """Frees every sequence of a session (lease ended); returns how many."""
        seqs = self.seqs.get(session_id, {})
        seq_ids = list(seqs)
        for seq_id in seq_ids:
            self.free(session_id, seq_id)
        self.seqs.pop(session_id, None)
        self.stale.pop(session_id, None)
        return len(seq_ids)

    def new_epoch(self, epoch: int, num_blocks: int, block_size: int) -> None:
        """The runner lost its KV: every block is free and uncached, every sequence stale."""
        for session_id, seqs in self.seqs.items():
            self.stale.setdefault(session_id, set()).update(seqs)
        self.seqs = {}
        self.uncomputed_tokens = 0
        self.epoch = epoch
        events = self.pool.events  # the pool's subscribers follow it into the new epoch
        self.pool = BlockPool(num_blocks, block_size)
        self.pool.events = events
        events.cleared()
        self.block_size = block_size
        self.shift = block_size.bit_length() - 1
