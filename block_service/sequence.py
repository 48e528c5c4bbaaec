"""A sequence's state in a pool, and the token position -> slot arithmetic."""

from __future__ import annotations

from collections.abc import Sequence as Seq

# The token value of a reserved position: its slot is handed out, its token not sampled yet.
RESERVED = -1


class Sequence:
    """One sequence: its tokens, block table and how far its KV is computed and published.

    Plain attributes with __slots__ because the Step fast path touches them per token.
    """

    __slots__ = ("block_table", "hashes", "num_computed", "num_published", "publishing", "root",
                 "tokens")

    def __init__(self, tokens: list[int], block_table: list[int], num_computed: int,
                 hashes: list[bytes], root: bytes) -> None:
        self.tokens = tokens
        self.block_table = block_table
        # Tokens whose KV the runner has written (reported by the client); never decreases.
        self.num_computed = num_computed
        # hashes[i] is the chained hash of full block i, for i < num_published.
        self.hashes = hashes
        self.num_published = len(hashes)
        self.root = root
        # False after a hash collision: no later block of this sequence is published.
        self.publishing = True

    @property
    def reserved(self) -> bool:
        """Whether the last position is reserved for a token not sampled yet."""
        return self.tokens[-1] == RESERVED

    @property
    def num_known(self) -> int:
        """Tokens whose values are known (all but a reserved last position)."""
        return len(self.tokens) - self.reserved

    def fork(self) -> Sequence:
        """A child with the same tokens and blocks (the caller adds the block references)."""
        child = Sequence(list(self.tokens), list(self.block_table), self.num_computed,
                         list(self.hashes), self.root)
        child.publishing = self.publishing
        return child


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


def slot_of(block_table: Seq[int], block_size: int, position: int) -> int:
    """The KV-cache row of the token at `position`: block_id * block_size + offset."""
    return block_table[position // block_size] * block_size + position % block_size


def slots_for(block_table: Seq[int], block_size: int, start: int, end: int) -> list[int]:
    """Slots of positions start .. end - 1, built one block-sized range at a time."""
    slots: list[int] = []
    position = start
    while position < end:
        index = position // block_size
        block_start = index * block_size
        stop = min(end, block_start + block_size)
        base = block_table[index] * block_size - block_start
        slots.extend(range(base + position, base + stop))
        position = stop
    return slots
