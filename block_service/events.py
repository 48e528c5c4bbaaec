"""KV events: the blocks a pool's prefix cache gained and lost, in numbered batches.

Producers and consumers:
- The pool (BlockPool.publish, BlockPool._forget, PoolManager.new_epoch) reports every change
  to its `EventSink` (block_service/event_sink.py) under the core's lock. The default sink,
  NO_EVENTS, drops them: a pool records nothing until its first subscriber attaches a
  `PoolEvents` to it. No subscriber can miss those earlier events, because a first
  subscription starts with a snapshot.
- A `PoolEvents` appends raw events (plain tuples: the hot path pays a list append) to an open
  batch; the core closes it at the end of every state-changing call (`KvEventLogs.flush`, from
  `BlockServiceCore._record`) as batch 1, 2, ... (only non-empty batches get numbers) and
  keeps the last `replay_batches` of them (at most `replay_events` events, but always the
  newest batch) for subscribers that resume.
- Subscribers read from other threads (`Subscription.batches`), under the log's own condition;
  only a snapshot takes the core's lock, to copy the pool's cached blocks in one consistent view.

Lock order: the core's lock, then a log's condition; never the other way round.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

from block_service.block_pool import BlockPool
from block_service.event_sink import EventSink, RawEvent, Stored
from block_service.ops import BlockServiceError, ErrorCode, shown

DEFAULT_REPLAY_BATCHES = 4096
# Also bounded by events, for memory: one batch may hold thousands (a step admitting long
# prompts), and a buffered event keeps its hash and tokens alive after the block is evicted.
DEFAULT_REPLAY_EVENTS = 1 << 18
POLL_S = 0.5  # how often a waiting subscriber checks whether it is still wanted


class LoggedPool(Protocol):
    """What an event log reads of the pool it follows (a PoolManager): read at each use, as
    a new epoch changes `epoch` and puts a new BlockPool in `pool`."""

    pool_id: str
    epoch: int
    pool: BlockPool


@dataclass
class BlockStored:
    """Consecutive blocks of one chain became prefix-cache entries."""

    block_hashes: list[bytes]
    parent_block_hash: bytes
    token_ids: list[int]  # block_size per block, concatenated
    block_size: int


@dataclass
class BlockRemoved:
    """Blocks left the prefix cache (evicted)."""

    block_hashes: list[bytes]


@dataclass
class AllBlocksCleared:
    """Every block left the prefix cache (a new epoch, or the pool was dropped)."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class EventBatch:
    """One message of the stream (see the proto's KvEventBatch)."""

    sequence: int
    pool_id: str
    epoch: int
    instance_id: str
    snapshot: bool
    events: list[KvEvent]
    timestamp_ms: int


@dataclass(frozen=True, slots=True)
class RawBatch:
    """A closed batch as the log keeps it; its events list is never changed again."""

    sequence: int
    epoch: int
    timestamp_ms: int
    events: list[RawEvent]


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def merged(events: Iterable[RawEvent]) -> list[KvEvent]:
    """Raw events as KvEvents: consecutive stored blocks of one chain become one BlockStored,
    consecutive removals one BlockRemoved."""
    out: list[KvEvent] = []
    for event in events:
        last = out[-1] if out else None
        if event is None:
            out.append(AllBlocksCleared())
        elif isinstance(event, bytes):
            if isinstance(last, BlockRemoved):
                last.block_hashes.append(event)
            else:
                out.append(BlockRemoved([event]))
        else:
            block_hash, parent_hash, tokens = event
            if isinstance(last, BlockStored) and last.block_hashes[-1] == parent_hash:
                last.block_hashes.append(block_hash)
                last.token_ids.extend(tokens)
            else:
                out.append(BlockStored([block_hash], parent_hash, list(tokens), len(tokens)))
    return out


def chain_order(blocks: list[Stored]) -> list[Stored]:
    """Cached blocks with every parent before its children, each chain's blocks in a row.

    The blocks form a forest: each hash covers its parent's, so no chain loops back. A block
    whose parent is not cached (a root or salt hash, or a parent evicted first) starts a tree.
    """
    hashes = {block_hash for block_hash, _, _ in blocks}
    children: dict[bytes, list[Stored]] = {}
    for block in blocks:
        children.setdefault(block[1], []).append(block)
    stack = [block for block in reversed(blocks) if block[1] not in hashes]
    ordered: list[Stored] = []
    while stack:  # depth first, so that a block's first child follows it (one BlockStored)
        block = stack.pop()
        ordered.append(block)
        stack.extend(reversed(children.get(block[0], ())))
    return ordered


class PoolEvents(EventSink):
    """The event log of one pool: the open batch, the replay buffer and their subscribers.

    `stored`, `removed`, `cleared`, `flush` and `close` run under the core's lock; `follow`
    and `wake` from any thread. `newest` changes under both locks, so either may read it.
    """

    def __init__(self, logs: KvEventLogs, pm: LoggedPool, first_sequence: int) -> None:
        self.pool_id = pm.pool_id
        self.instance_id = logs.instance_id
        self.newest = first_sequence  # the last batch's number
        self.closed = False
        self.pending: list[RawEvent] = []  # the open batch
        self._pm = pm
        self._core_lock = logs.lock
        self._dirty = logs.dirty
        self._batches: deque[RawBatch] = deque()  # the replay buffer: newest - len + 1 .. newest
        self._buffered_events = 0
        self._max_batches = logs.replay_batches
        self._max_events = logs.replay_events
        self._changed = threading.Condition()

    # ---- the pool's side (under the core's lock) ----------------------------------------
    def stored(self, block_hash: bytes, parent_hash: bytes, token_ids: tuple[int, ...]) -> None:
        if not self.pending:
            self._dirty.append(self)
        self.pending.append((block_hash, parent_hash, token_ids))

    def removed(self, block_hash: bytes) -> None:
        if not self.pending:
            self._dirty.append(self)
        self.pending.append(block_hash)

    def cleared(self) -> None:
        if not self.pending:
            self._dirty.append(self)
        self.pending.append(None)

    def flush(self) -> None:
        """Closes the open batch, if it holds any event, as the next numbered one."""
        events = self.pending
        if not events:
            return
        self.pending = []
        batch = RawBatch(self.newest + 1, self._pm.epoch, now_ms(), events)
        with self._changed:
            batches = self._batches
            batches.append(batch)
            self._buffered_events += len(events)
            while len(batches) > 1 and (len(batches) > self._max_batches
                                        or self._buffered_events > self._max_events):
                self._buffered_events -= len(batches.popleft().events)
            self.newest = batch.sequence
            self._changed.notify_all()

    def close(self) -> None:
        """The pool is being dropped: a last batch clears it, then every stream ends."""
        self.cleared()
        self.flush()
        with self._changed:
            self.closed = True
            self._changed.notify_all()

    # ---- subscribers' side ----------------------------------------------------------------
    def wake(self) -> None:
        """Makes every waiting subscriber check again whether it is still wanted."""
        with self._changed:
            self._changed.notify_all()

    def follow(self, cursor: int | None, stopped: Callable[[], bool],
               poll_s: float) -> Iterator[EventBatch]:
        """Every batch after `cursor` exactly once and in order, waiting for new ones; a
        snapshot first when `cursor` is None, and again whenever the next batch has left the
        buffer. Returns when `stopped()`; after the last batch of a closed log, raises
        NOT_FOUND."""
        while True:
            if cursor is None:
                snapshot = self.snapshot()
                cursor = snapshot.sequence
                yield snapshot
            with self._changed:
                while self.newest == cursor and not self.closed and not stopped():
                    self._changed.wait(poll_s)
                if stopped():
                    return
                if self.newest == cursor:
                    raise BlockServiceError(ErrorCode.NOT_FOUND,
                                            f"pool {shown(self.pool_id)} was dropped")
                if cursor < self.newest - len(self._batches):  # its next batch is gone
                    cursor = None
                    continue
                # Batches cursor + 1 .. newest are the last newest - cursor ones.
                ready = [self._batches[index] for index in range(cursor - self.newest, 0)]
            for raw in ready:
                yield EventBatch(raw.sequence, self.pool_id, raw.epoch, self.instance_id,
                                 False, merged(raw.events), raw.timestamp_ms)
            cursor = ready[-1].sequence

    def snapshot(self) -> EventBatch:
        """AllBlocksCleared, then every cached block (parents first), as of the newest batch.

        Under the core's lock only the list of the pool's cached-block records is copied
        (a C-level copy, no object per block: making one there would set the garbage collector
        going while every Step waits); the events are built after.
        """
        with self._core_lock:
            # Every state-changing call flushes before it returns, so nothing is pending here
            # unless a call failed half-way; a flush makes this snapshot cover that too.
            self.flush()
            cached = [] if self.closed else self._pm.pool.cached_blocks()
            sequence, epoch = self.newest, self._pm.epoch
        blocks: list[Stored] = [(block.block_hash, block.parent_hash, block.token_ids)
                                for block in cached]
        events: list[KvEvent] = [AllBlocksCleared(), *merged(chain_order(blocks))]
        return EventBatch(sequence, self.pool_id, epoch, self.instance_id, True, events,
                          now_ms())


class Subscription:
    """One subscriber's stream of a pool's batches."""

    def __init__(self, log: PoolEvents, cursor: int | None) -> None:
        self._log = log
        self._cursor = cursor  # None: a snapshot first
        self._cancelled = threading.Event()

    def batches(self, still_wanted: Callable[[], bool] = lambda: True,
                poll_s: float = POLL_S) -> Iterator[EventBatch]:
        """The stream (see PoolEvents.follow): it ends within `poll_s` of `still_wanted()`
        turning False, and at once on `cancel`."""
        cancelled = self._cancelled
        return self._log.follow(self._cursor,
                                lambda: cancelled.is_set() or not still_wanted(), poll_s)

    def cancel(self) -> None:
        """Ends the stream (from any thread: the client went away)."""
        self._cancelled.set()
        self._log.wake()


class KvEventLogs:
    """The event logs of one core's pools and the instance id they share.

    `flush`, `subscribe` and `close` run under the core's lock (`lock`).
    """

    def __init__(self, lock: threading.Lock, replay_batches: int = DEFAULT_REPLAY_BATCHES,
                 replay_events: int = DEFAULT_REPLAY_EVENTS) -> None:
        self.lock = lock
        # Each pool's replay buffer bounds, read when its log is attached.
        self.replay_batches = replay_batches
        self.replay_events = replay_events
        # New with every core, so with every start: batch numbers of an earlier process (or
        # of a core rebuilt from its journal) mean nothing to this one.
        self.instance_id = uuid.uuid4().hex
        self.dirty: list[PoolEvents] = []  # logs with an open batch that holds events
        # The newest batch number of each dropped pool's log: a pool created again under the
        # same id numbers on from there, so that no old number names one of its batches.
        self._dropped: dict[str, int] = {}

    def flush(self) -> None:
        """Closes the open batch of every pool that has events (the end of a core call)."""
        if self.dirty:
            for log in self.dirty:
                log.flush()
            self.dirty.clear()

    def subscribe(self, pm: LoggedPool, after_sequence: int,
                  instance_id: str) -> Subscription:
        """A subscription to `pm`'s events after batch `after_sequence` of `instance_id`.

        OUT_OF_RANGE for a number of this instance past the newest batch.
        """
        log = pm.pool.events
        if not isinstance(log, PoolEvents):
            # The first number is 0, or, for a pool id dropped before, one past that log's
            # newest: it stands for what happened in between, which only a snapshot gives.
            log = PoolEvents(self, pm, self._dropped.pop(pm.pool_id, -1) + 1)
            pm.pool.events = log
        if instance_id != self.instance_id or after_sequence == 0:
            return Subscription(log, None)
        if after_sequence > log.newest:
            raise BlockServiceError(
                ErrorCode.OUT_OF_RANGE,
                f"after_sequence {after_sequence} is past the newest batch of pool "
                f"{shown(pm.pool_id)} ({log.newest}); subscribe with 0 for a snapshot")
        return Subscription(log, after_sequence)

    def close(self, pm: LoggedPool) -> None:
        """`pm` is being dropped: its subscribers get a last AllBlocksCleared batch, then
        their streams end with NOT_FOUND."""
        log = pm.pool.events
        if isinstance(log, PoolEvents):
            log.close()
            self._dropped[pm.pool_id] = log.newest
