"""The blocks of one KV pool: free list, reference counts and the prefix-hash map.

A block is in exactly one of three states:
- referenced: ref count > 0 (held by one or more block tables);
- free, never cached (or its hash was dropped): on `_uncached`, a stack (O(1) pop/push);
- free but cached: ref count 0 and still holding a published hash, on `_evictable`, an
  OrderedDict in the order the blocks were freed (LRU: the oldest is evicted first).
New blocks come from `_uncached` first; only when it is empty is the oldest evictable block
evicted (its hash dropped). A cache hit on an evictable block takes it out of `_evictable`.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Sequence

from block_service.event_sink import NO_EVENTS, EventSink


class Publish(enum.Enum):
    """What publishing a block's hash did."""

    REGISTERED = 1  # the block is now the canonical block of the hash
    DUPLICATE = 2  # another block with the same tokens already holds the hash; it stays canonical
    COLLISION = 3  # another block holds the hash with different tokens or parent: nothing done


class BlockPool:
    """Free list, ref counts and hash -> block map of `num_blocks` blocks of `block_size`."""

    # Told of every hash published or dropped (block_service/events.py). A class default, so
    # that an unpickled pool, which has none of its own, reports to nobody until a
    # subscriber attaches a log.
    events: EventSink = NO_EVENTS

    def __init__(
        self, num_blocks: int, block_size: int, free_order: Sequence[int] | None = None
    ) -> None:
        """`free_order` (a permutation of the block ids) is the order new blocks are handed
        out in; by default 0, 1, 2, ..."""
        if free_order is None:
            order = list(range(num_blocks))
        else:
            order = list(free_order)
            if sorted(order) != list(range(num_blocks)):
                raise ValueError("free_order must be a permutation of range(num_blocks)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self._uncached = order[::-1]  # a stack: the next block to hand out is at the end
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.hash_to_block: dict[bytes, int] = {}
        # Per block, while it holds a published hash: the hash, its parent's hash and tokens.
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self.block_parents: list[bytes | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.evictions = 0

    def num_free(self) -> int:
        """Blocks with ref count 0 (never cached plus cached-evictable)."""
        return len(self._uncached) + len(self._evictable)

    def num_evictable(self) -> int:
        """Free blocks that still hold a cached prefix."""
        return len(self._evictable)

    def is_evictable(self, block: int) -> bool:
        """Whether `block` is free but still cached."""
        return block in self._evictable

    def free_block_ids(self) -> list[int]:
        """Every free block id (for invariant checks)."""
        return [*self._uncached, *self._evictable]

    def take(self) -> int:
        """Hands out one free block with ref count 1; the caller has checked num_free()."""
        if self._uncached:
            block = self._uncached.pop()
        else:
            block, _ = self._evictable.popitem(last=False)
            self._forget(block)
            self.evictions += 1
        self.ref_counts[block] = 1
        return block

    def acquire(self, block: int) -> None:
        """Adds a reference to a block already holding data (a cache hit or a fork)."""
        if self.ref_counts[block] == 0:
            del self._evictable[block]
        self.ref_counts[block] += 1

    def release(self, block: int) -> bool:
        """Drops one reference; returns whether the block became free."""
        refs = self.ref_counts[block] - 1
        self.ref_counts[block] = refs
        if refs:
            return False
        if self.block_hashes[block] is None:
            self._uncached.append(block)
        else:
            self._evictable[block] = None
        return True

    def lookup(self, parent_hash: bytes, block_hash: bytes, token_ids: Sequence[int]) -> int | None:
        """The cached block holding exactly these tokens after this parent, or None.

        Collision guard: the hash must map to a block whose stored tokens and parent hash
        equal the ones looked up.
        """
        block = self.hash_to_block.get(block_hash)
        if block is None:
            return None
        if self.block_parents[block] != parent_hash or self.block_tokens[block] != tuple(token_ids):
            return None
        return block

    def publish(
        self, block: int, block_hash: bytes, parent_hash: bytes, token_ids: Sequence[int]
    ) -> Publish:
        """Makes a full, computed block a prefix-cache entry unless the hash is taken."""
        own_hash = self.block_hashes[block]
        if own_hash is not None:  # already cached (a shared block): only its own hash fits
            return Publish.DUPLICATE if own_hash == block_hash else Publish.COLLISION
        holder = self.hash_to_block.get(block_hash)
        tokens = tuple(token_ids)
        if holder is None:
            self.hash_to_block[block_hash] = block
            self.block_hashes[block] = block_hash
            self.block_parents[block] = parent_hash
            self.block_tokens[block] = tokens
            self.events.stored(block_hash, parent_hash, tokens)
            return Publish.REGISTERED
        if self.block_parents[holder] == parent_hash and self.block_tokens[holder] == tokens:
            return Publish.DUPLICATE
        return Publish.COLLISION

    def _forget(self, block: int) -> None:
        """Drops a block's hash (it is about to hold other data)."""
        block_hash = self.block_hashes[block]
        if block_hash is not None:
            del self.hash_to_block[block_hash]
            self.block_hashes[block] = None
            self.block_parents[block] = None
            self.block_tokens[block] = None
            self.events.removed(block_hash)

    def __getstate__(self) -> dict[str, object]:
        """Pickled (in journal snapshots) without its event log: the log holds a lock and
        its subscribers' place, which mean nothing to another process."""
        state = self.__dict__.copy()
        state.pop("events", None)
        return state
