"""The blocks of one KV pool: free list, reference counts and the prefix-hash map.

A block is in exactly one of three states:
- referenced: ref count > 0 (held by one or more block tables);
- free, never cached (or its hash was dropped): on `_uncached`, a stack (O(1) pop/push);
- free but cached: ref count 0 and still holding a published hash, on `_evictable`, an
  OrderedDict in the order the blocks were freed (LRU: the oldest is evicted first).
New blocks come from `_uncached` first; only when it is empty is the oldest evictable block
evicted (its hash dropped). A cache hit on an evictable block takes it out of `_evictable`.
A block holds a published hash while its `CachedBlock` record is set.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Sequence
from typing import cast

from block_service.event_sink import NO_EVENTS, EventSink


class Publish(enum.Enum):
    """What publishing a block's hash did."""

    REGISTERED = 1  # the block is now the canonical block of the hash
    DUPLICATE = 2  # another block with the same tokens already holds the hash; it stays canonical
    COLLISION = 3  # another block holds the hash with different tokens or parent: nothing done


class CachedBlock:
    """What a block holding a published hash holds: the hash, and the parent hash and tokens
    that the collision guard compares before a hit.

    Never changed once made (a block's record is replaced or dropped instead), so that a
    reader may copy the records under the core's lock and read them after it
    (PoolEvents.snapshot).
    """

    __slots__ = ("block_hash", "parent_hash", "token_ids")

    def __init__(self, block_hash: bytes, parent_hash: bytes, token_ids: tuple[int, ...]) -> None:
        self.block_hash = block_hash
        self.parent_hash = parent_hash
        self.token_ids = token_ids

    def __reduce__(self) -> tuple[type[CachedBlock], tuple[bytes, bytes, tuple[int, ...]]]:
        # Pickled as its three values, without the slot names (journal snapshots hold one
        # per cached block).
        return CachedBlock, (self.block_hash, self.parent_hash, self.token_ids)


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
        self._cached: list[CachedBlock | None] = [None] * num_blocks
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

    def cached_block(self, block: int) -> CachedBlock | None:
        """What `block` holds while it holds a published hash, else None."""
        return self._cached[block]

    def cached_blocks(self) -> list[CachedBlock]:
        """Every cached block's record, in the order they were published.

        A copy without an object per block (the records themselves are never changed), so
        cheap enough to take under the core's lock.
        """
        return cast("list[CachedBlock]",
                    list(map(self._cached.__getitem__, self.hash_to_block.values())))

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
        if self._cached[block] is None:
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
        cached = self._cached[block]
        # Never None for a block in hash_to_block; the test is for the type checker.
        if cached is None or cached.parent_hash != parent_hash \
                or cached.token_ids != tuple(token_ids):
            return None
        return block

    def cached_run(self, parent_hash: bytes, block_hashes: Sequence[bytes],
                   block_tokens: Sequence[tuple[int, ...]]) -> int:
        """How many leading blocks of a chain (each block's hash and tokens, the first one's
        parent `parent_hash`) are cached here: `lookup` block after block, with the hashes
        and token tuples made once by the caller for every pool it asks."""
        hash_to_block, cached_blocks = self.hash_to_block, self._cached
        for index, block_hash in enumerate(block_hashes):
            block = hash_to_block.get(block_hash)
            cached = None if block is None else cached_blocks[block]
            if cached is None or cached.parent_hash != parent_hash \
                    or cached.token_ids != block_tokens[index]:
                return index
            parent_hash = block_hash
        return len(block_hashes)

    def publish(
        self, block: int, block_hash: bytes, parent_hash: bytes, token_ids: Sequence[int]
    ) -> Publish:
        """Makes a full, computed block a prefix-cache entry unless the hash is taken."""
        own = self._cached[block]
        if own is not None:  # already cached (a shared block): only its own hash fits
            return Publish.DUPLICATE if own.block_hash == block_hash else Publish.COLLISION
        holder = self.hash_to_block.get(block_hash)
        tokens = tuple(token_ids)
        if holder is None:
            self.hash_to_block[block_hash] = block
            self._cached[block] = CachedBlock(block_hash, parent_hash, tokens)
            self.events.stored(block_hash, parent_hash, tokens)
            return Publish.REGISTERED
        if self.lookup(parent_hash, block_hash, tokens) is not None:  # the holder is a twin
            return Publish.DUPLICATE
        return Publish.COLLISION

    def _forget(self, block: int) -> None:
        """Drops a block's hash (it is about to hold other data)."""
        cached = self._cached[block]
        if cached is not None:
            del self.hash_to_block[cached.block_hash]
            self._cached[block] = None
            self.events.removed(cached.block_hash)

    def __getstate__(self) -> dict[str, object]:
        """Pickled (in journal snapshots) without its event log: the log holds a lock and
        its subscribers' place, which mean nothing to another process."""
        state = self.__dict__.copy()
        state.pop("events", None)
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        """Also loads a snapshot written before CachedBlock, which kept three per-block lists
        (hash, parent hash, tokens; None where no hash was published)."""
        if "block_hashes" in state:
            hashes = cast("list[bytes | None]", state.pop("block_hashes"))
            parents = cast("list[bytes]", state.pop("block_parents"))
            tokens = cast("list[tuple[int, ...]]", state.pop("block_tokens"))
            state["_cached"] = [
                None if block_hash is None else CachedBlock(block_hash, parent, block_tokens)
                for block_hash, parent, block_tokens in zip(hashes, parents, tokens, strict=True)]
        self.__dict__.update(state)
