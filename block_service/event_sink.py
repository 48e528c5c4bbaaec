"""Where a pool reports its prefix-cache changes, and the raw events it reports.

Its own module because both sides need it: the pool (block_pool.py) reports to an
`EventSink`, and the event log (events.py), which also reads the pool, is one.
"""

from __future__ import annotations

# Raw events as the pool reports them, cheap to make: a stored block is
# (hash, parent hash, tokens), a removed one its hash, and a cleared pool None.
Stored = tuple[bytes, bytes, tuple[int, ...]]
RawEvent = Stored | bytes | None


class EventSink:
    """Where a pool reports its prefix-cache changes: this default drops them (no subscriber
    has attached a PoolEvents yet)."""

    def stored(self, block_hash: bytes, parent_hash: bytes, token_ids: tuple[int, ...]) -> None:
        """A block now holds a published hash."""

    def removed(self, block_hash: bytes) -> None:
        """A block's hash was dropped (the block was evicted)."""

    def cleared(self) -> None:
        """Every block's hash was dropped."""


NO_EVENTS = EventSink()
