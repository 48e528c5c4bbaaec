"""The scheduling state of one output sequence.

A request with `n` outputs has `n` sequences. A sequence's tokens are its prompt followed by
what it has generated; the scheduler tracks how many of them the block service knows
(`num_registered`, plus a position it holds `reserved` for a token not sampled yet), how many
have their KV written by the runner (`num_computed`) or are being written by the Execute in
flight (`num_scheduled`), and whether that Execute samples its next token (`num_pending`).
"""

from __future__ import annotations

import enum
import sys
from dataclasses import dataclass, field

# What a prompt's first cached block would hold: its cache salt and first block_size tokens.
FirstBlock = tuple[str, tuple[int, ...]]


class SeqStatus(enum.Enum):
    """Where a sequence is in its life."""

    WAITING = "waiting"  # queued for admission (new, or preempted for recompute)
    FORK_PENDING = "fork_pending"  # a child that will be forked from its parent's prompt
    RUNNING = "running"  # holds blocks in the block service
    FINISHED = "finished"  # done or aborted; its blocks are (being) freed


@dataclass
class SamplingConfig:
    """Validated sampling parameters of one request (defaults filled in)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None
    presence_penalty: float = 0.0  # OpenAI's, over output tokens; 0 = off
    frequency_penalty: float = 0.0  # OpenAI's, over output tokens; 0 = off
    repetition_penalty: float = 1.0  # transformers', over prompt and output; 1 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), sorted by token id

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)


@dataclass(eq=False)
class Sequence:
    """One output of a request, as the scheduler sees it.

    `eq=False` keeps identity semantics: sequences are used as dict keys and list members.
    """

    request_id: str
    index: int  # which output of its request (0 .. n-1)
    token_ids: list[int]  # prompt followed by generated tokens
    prompt_len: int
    seed: int
    # Prefixes are shared only between sequences with the same salt: the client's, with the
    # adapter's digest folded in for an adapter's (gateway/adapters.py effective_salt).
    cache_salt: str = ""
    adapter: str = ""  # the LoRA adapter its tokens run through, by name; "": the base model
    status: SeqStatus = SeqStatus.WAITING
    # Children to fork once this sequence's prompt (but its last token) is computed.
    pending_children: list[Sequence] = field(default_factory=list)
    admit_order: int = -1  # increases with each admission; preemption picks the largest
    block_seq_id: int = 0  # the id of the current allocation in the block service; 0: none
    num_registered: int = 0  # leading tokens the block service holds (values known to it)
    num_computed: int = 0  # leading tokens whose KV the runner has written (confirmed)
    num_scheduled: int = 0  # leading tokens computed or being computed by the Execute in flight
    # Tokens that scheduled Executes will sample and have not returned yet. When a step is
    # planned, at most the one in flight: 0, or 1 for the token after num_tokens.
    num_pending: int = 0
    num_committed: int = 0  # num_computed as last told to the block service
    # Replaced, never changed in place: step_builder keeps its encoding below by identity.
    block_table: list[int] = field(default_factory=list)
    # The block table as an ExecuteRequest's block_tables field, and the table list it
    # encodes (step_builder.table_wire): re-encoded only when the table is replaced.
    table_wire: bytes = b""
    table_wire_of: list[int] | None = None
    # Slots of the positions slot_start .. num_registered - 1, from the allocation.
    prefill_slots: list[int] = field(default_factory=list)
    prefill_slot_start: int = 0
    # The prompt's cache hit at admission; a fork child's is its parent's (set at the fork).
    num_cached_at_admission: int | None = None
    # Its length when it ends by length (max_tokens, or the model's length): a decode whose
    # pending token reaches it is not planned (it would compute a token nobody takes).
    max_num_tokens: int = sys.maxsize
    num_preemptions: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def alloc_len(self) -> int:
        """How many tokens an admission allocates.

        A parent with children to fork stops one short: its last prompt token is computed by
        each output separately, with that output's own seed, after the fork.
        """
        if self.pending_children:
            return self.num_tokens - 1
        return self.num_tokens

    def first_block(self, block_size: int) -> FirstBlock | None:
        """Its salt and first `block_size` tokens: what its first cached block would hold
        (None when it has no full block to share)."""
        if not 0 < block_size < self.num_tokens:
            return None
        return self.cache_salt, tuple(self.token_ids[:block_size])

    @property
    def reserved(self) -> bool:
        """Whether the block service also holds position num_registered, whose token it has
        not been told: scheduled while that token was still being sampled, its APPEND
        reserved it (the next APPEND fills it in). Nothing else schedules past what the
        block service knows."""
        return self.num_scheduled > self.num_registered

    @property
    def is_prefilling(self) -> bool:
        return self.num_scheduled < self.num_registered

    @property
    def is_decode_ready(self) -> bool:
        """Every position the block service holds is scheduled (a reserved one included),
        and one more token (known, or being sampled by the Execute in flight) awaits its
        slot."""
        scheduled = self.num_scheduled
        return (0 <= scheduled - self.num_registered <= 1
                and scheduled < len(self.token_ids) + self.num_pending)

    def decode_append(self) -> tuple[int, int]:
        """Its next decode's APPEND as (register_end, lookahead): one position, whose token's
        value is known, or which the Execute in flight samples (then the APPEND reserves the
        position and the next one fills it in)."""
        scheduled, num_tokens = self.num_scheduled, len(self.token_ids)
        return min(num_tokens, scheduled + 1), int(scheduled == num_tokens)

    @property
    def reportable_computed(self) -> int:
        """How many of its tokens the block service may be told are computed: a reserved
        position's value is unknown to it."""
        return min(self.num_computed, self.num_registered)

    @property
    def is_last_token_pending(self) -> bool:
        """The Execute in flight samples the token that ends this sequence by length."""
        return self.num_pending > 0 and self.num_tokens + self.num_pending >= self.max_num_tokens

    def forget_allocation(self) -> None:
        """Back to the state of a sequence that holds no blocks (kept tokens: recompute)."""
        self.block_seq_id = 0
        self.num_registered = 0
        self.num_computed = 0
        self.num_scheduled = 0
        self.num_pending = 0
        self.num_committed = 0
        self.block_table = []
        self.prefill_slots = []
        self.prefill_slot_start = 0
