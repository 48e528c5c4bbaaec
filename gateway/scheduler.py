"""Continuous-batching policy: which sequences compute how many tokens in the next step.

Pure Python, no gRPC: the engine turns a `StepPlan` into one block-service Step, hands the
per-operation results back to `apply_results`, and executes the `Work` it returns.

Policy (as vLLM's V1 scheduler):
- running sequences first, in admission order: decode tokens, then the next chunk of prompts
  being prefilled, all under the token budget (`max_num_batched_tokens`);
- then FCFS admission of waiting sequences while the budget and `max_num_seqs` allow; a prompt
  longer than the remaining budget is prefilled in chunks over several steps;
- LoRA (as vLLM's): a step names at most `max_loras` distinct adapters. A waiting sequence
  whose adapter is not among the running ones while they already name `max_loras` is skipped
  (it keeps its place) until a running adapter's sequences have all finished; behind it base
  sequences go on being admitted but no adapter sequence does (one on a running adapter would
  keep that adapter running, and the skipped one waiting, for as long as such traffic lasts);
- when the block service has no block for a decode, the most recently admitted running
  sequence is preempted: its blocks are freed and it goes back to the FRONT of the queue with
  its prompt and every token generated so far, to be recomputed (its output is unchanged).
"""

from __future__ import annotations

import enum
import itertools
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from gateway.sequence import FirstBlock, SeqStatus, Sequence

# How many first blocks the scheduler remembers as computed (a key is a salt and block_size
# token ids): enough for the system prompts of a busy server, bounded for a long-lived one.
MAX_COMPUTED_FIRST_BLOCKS = 4096


class OpOutcome(enum.Enum):
    """The block service's answer to one operation, as the policy needs it."""

    OK = "ok"
    NO_SPACE = "no_space"
    STALE = "stale"  # the pool lost its contents (runner restart): recompute everything
    FAILED = "failed"  # any other per-operation error: the request cannot go on


@dataclass(slots=True)
class OpResult:
    """One operation's result: its outcome and what changed in the sequence's table."""

    outcome: OpOutcome
    table_start: int = 0
    table_ids: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    error: str = ""


@dataclass(slots=True)
class FreeOp:
    """A sequence allocation to free in the next Step."""

    block_seq_id: int
    num_computed: int


@dataclass(slots=True)
class Grant:
    """A sequence allowed to compute up to `num_tokens` tokens this step.

    A decode's APPEND registers tokens num_registered .. register_end - 1 (a reserved
    position's value first) and, with `lookahead`, reserves the position of the token the
    Execute in flight is sampling.
    """

    seq: Sequence
    num_tokens: int
    register_end: int = 0
    lookahead: int = 0


# The order in which a Step carries its plan's operation groups, and its answer their results:
# frees first (their blocks serve the rest of the Step), commits, forks (a child exists before
# its APPEND), appends (running sequences before newcomers), allocates (admissions take what
# is left). Said here only: step_builder packs by it, apply_results reads by it, and
# bench/control_plane.py's stand-in follows it (tests/bench/test_control_plane.py checks).
OPERATION_ORDER = ("frees", "commits", "forks", "appends", "allocates")


@dataclass
class StepPlan:
    """Every block-service operation of one step, grouped by kind (sent in OPERATION_ORDER)."""

    frees: list[FreeOp] = field(default_factory=list)
    commits: list[Sequence] = field(default_factory=list)
    forks: list[tuple[Sequence, Sequence]] = field(default_factory=list)  # (parent, child)
    appends: list[Grant] = field(default_factory=list)  # decodes: new tokens get slots
    prefills: list[Grant] = field(default_factory=list)  # next chunks of allocated prompts
    allocates: list[Grant] = field(default_factory=list)  # admissions

    @property
    def num_ops(self) -> int:
        return (len(self.frees) + len(self.commits) + len(self.forks) + len(self.appends)
                + len(self.allocates))

    def split_results(self, results: list[OpResult]) -> dict[str, list[OpResult]]:
        """A Step's answer (one result per operation, in OPERATION_ORDER) by group."""
        if len(results) != self.num_ops:
            raise ValueError(f"{len(results)} results for {self.num_ops} operations")
        by_group: dict[str, list[OpResult]] = {}
        start = 0
        for group in OPERATION_ORDER:
            end = start + len(getattr(self, group))
            by_group[group] = results[start:end]
            start = end
        return by_group

    @property
    def is_empty(self) -> bool:
        return self.num_ops == 0 and not self.prefills

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(g.num_tokens for g in (*self.appends, *self.prefills, *self.allocates))


@dataclass(slots=True)
class Work:
    """What the runner computes for one sequence this step."""

    seq: Sequence
    start: int  # position of the first new token
    num_tokens: int
    slots: list[int]
    do_sample: bool
    # The allocation the work was planned for: a sequence preempted (or reset) while the
    # work ran holds another one, or none, when its results come back.
    block_seq_id: int = field(init=False)

    def __post_init__(self) -> None:
        self.block_seq_id = self.seq.block_seq_id


@dataclass
class StepOutcome:
    """What `apply_results` decided."""

    work: list[Work] = field(default_factory=list)
    failed: list[tuple[Sequence, str]] = field(default_factory=list)  # requests to abort
    stale: bool = False  # the pool was reset: the engine must recompute every sequence
    preempted: list[Sequence] = field(default_factory=list)
    newly_cached: list[tuple[Sequence, int]] = field(default_factory=list)  # first admissions


class Scheduler:
    """Holds the waiting queue and the running set; plans steps and applies their results."""

    def __init__(self, max_num_batched_tokens: int, max_num_seqs: int,
                 block_size: int = 0, max_loras: int = 0) -> None:
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        # Distinct LoRA adapters the runner takes in one batch (0: it serves none, and no
        # sequence names one).
        self.max_loras = max_loras
        # The runner's block size (0: unknown, no prompt waits for another's first block).
        self.block_size = block_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self._pending_frees: list[FreeOp] = []
        self._admit_counter = itertools.count(1)
        self._block_seq_ids = itertools.count(1)
        self._preempted_last_step = False
        self.num_preemptions = 0
        # First blocks an Execute has computed (so published, unless evicted since): a prompt
        # starting with one gets it from the prefix cache and holds nobody back.
        self._computed_first_blocks: OrderedDict[FirstBlock, None] = OrderedDict()

    # ----- queue changes -------------------------------------------------------------------

    def add(self, seqs: Iterable[Sequence]) -> None:
        """Queues new sequences at the back (children to fork ride on their parent)."""
        for seq in seqs:
            seq.status = SeqStatus.WAITING
            self.waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Takes a sequence out (finished or aborted); its blocks are freed in the next Step."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self._queue_free(seq)
        elif seq.status is SeqStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        for child in seq.pending_children:
            child.status = SeqStatus.FINISHED
        seq.pending_children = []
        seq.status = SeqStatus.FINISHED

    def abandon(self, plan: StepPlan) -> None:
        """The plan's Step (or Execute) failed: admissions not applied go back to the front
        and children planned for a fork are still to fork. The engine then resets."""
        for grant in reversed(plan.allocates):
            seq = grant.seq
            if seq.status is SeqStatus.WAITING and seq not in self.waiting:
                seq.block_seq_id = 0
                self.waiting.appendleft(seq)
        for _parent, child in plan.forks:
            if child.status is SeqStatus.FORK_PENDING:
                child.forget_allocation()
        self._pending_frees = [*plan.frees, *self._pending_frees]

    def reset_all(self) -> list[Sequence]:
        """The pool lost every block: running sequences go back to the queue to recompute.

        Their allocations are gone with the pool, so nothing is freed.
        """
        requeued = list(self.running)
        for seq in reversed(requeued):
            seq.forget_allocation()
            for child in seq.pending_children:
                child.forget_allocation()
            seq.status = SeqStatus.WAITING
            self.waiting.appendleft(seq)
        self.running = []
        self._pending_frees = []
        self._computed_first_blocks.clear()
        return requeued

    @property
    def num_running_seqs(self) -> int:
        """Running sequences plus the children they will fork (both hold a seat)."""
        return sum(1 + len(seq.pending_children) for seq in self.running)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._pending_frees)

    # ----- planning ------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Plans the next step: frees, commits, forks, decodes, prefill chunks, admissions."""
        plan = StepPlan(frees=self._pending_frees)
        self._pending_frees = []
        budget = self.max_num_batched_tokens
        budget = self._schedule_decodes(plan, budget)
        budget = self._schedule_prefills(plan, budget)
        # Right after a preemption the pool is short: admitting now would only thrash.
        if not self._preempted_last_step:
            self._schedule_admissions(plan, budget)
        self._preempted_last_step = False
        return plan

    def _schedule_decodes(self, plan: StepPlan, budget: int) -> int:
        appends = plan.appends
        for seq in self.running:
            if seq.pending_children:
                budget = self._schedule_fork(plan, seq, budget)
                continue
            if budget < 1:
                break
            if seq.is_decode_ready and not seq.is_last_token_pending:
                appends.append(Grant(seq, 1, *seq.decode_append()))
                budget -= 1
        return budget

    def _schedule_fork(self, plan: StepPlan, seq: Sequence, budget: int) -> int:
        """A parent whose prompt is computed forks its children and all decode together."""
        group = [seq, *seq.pending_children]
        if not seq.is_decode_ready or budget < len(group):
            return budget
        for child in seq.pending_children:
            # The child starts where its parent is: it appends the same last token.
            child.block_seq_id = next(self._block_seq_ids)
            child.num_registered = seq.num_registered
            child.num_computed = child.num_committed = seq.num_computed
            child.num_scheduled = seq.num_scheduled
            plan.forks.append((seq, child))
        for member in group:
            plan.appends.append(Grant(member, 1, *member.decode_append()))
        return budget - len(group)

    def _schedule_prefills(self, plan: StepPlan, budget: int) -> int:
        for seq in self.running:
            if not seq.is_prefilling:
                continue
            if seq.num_computed > seq.num_committed:
                plan.commits.append(seq)
            if budget == 0:
                continue
            chunk = min(seq.num_registered - seq.num_scheduled, budget)
            plan.prefills.append(Grant(seq, chunk))
            budget -= chunk
        return budget

    def _schedule_admissions(self, plan: StepPlan, budget: int) -> None:
        seats = self.max_num_seqs - self.num_running_seqs
        computing = self._first_blocks_computing()
        adapters = {seq.adapter for seq in self.running if seq.adapter}
        skipped: list[Sequence] = []  # waiting for a LoRA slot: they keep their places
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if self._waits_for_lora(seq, adapters) or (skipped and seq.adapter):
                # Behind a sequence waiting for a slot, no adapter sequence passes (base ones
                # may): the running adapters drain, so the slot comes.
                skipped.append(self.waiting.popleft())
                continue
            need_seats = 1 + len(seq.pending_children)
            if need_seats > seats:
                break  # FCFS: nobody overtakes the head of the queue (but LoRA waits)
            if self._waits_for_prefix(seq, computing):
                break
            self.waiting.popleft()
            if seq.adapter:
                adapters.add(seq.adapter)
            seq.block_seq_id = next(self._block_seq_ids)
            # The prefix-cache hit is unknown until the block service answers, so the grant
            # assumes none; apply_results starts it after the cached tokens.
            grant = min(seq.alloc_len, budget)
            plan.allocates.append(Grant(seq, grant))
            budget -= grant
            seats -= need_seats
        self.waiting.extendleft(reversed(skipped))

    def _waits_for_lora(self, seq: Sequence, adapters: set[str]) -> bool:
        """Whether admitting `seq` would make the running set name more than max_loras
        distinct adapters (`adapters`: those it names, admissions of this step included)."""
        return (bool(seq.adapter) and seq.adapter not in adapters
                and 0 < self.max_loras <= len(adapters))

    def _waits_for_prefix(self, seq: Sequence, computing: dict[FirstBlock, list[int]]) -> bool:
        """Whether the queue head waits for a prefix that a running prompt (or one admitted in
        this step) is computing and has not confirmed: admitted a step or two later, it would
        take that prefix from the cache instead of computing it again.

        Only a prompt that is mostly that prefix waits: recomputing the prefix would then more
        than double its own work. A prompt that merely starts alike (a chat template's first
        block before different questions) is admitted at once, as many per step as the budget
        holds; waiting would cost it two steps to save a block or two.
        """
        key = seq.first_block(self.block_size)
        if key is None or key in self._computed_first_blocks:
            return False  # nothing to share, or the first block is in the cache already
        other = computing.get(key)
        if other is None:
            computing[key] = seq.token_ids
            return False
        return 2 * self._shared_blocks_len(seq, other) >= seq.alloc_len

    def _shared_blocks_len(self, seq: Sequence, other: list[int]) -> int:
        """How many of `seq`'s leading tokens, in whole blocks short of its last token, are
        `other`'s too (both have the same salt: their first blocks matched)."""
        size = self.block_size
        mine = seq.token_ids
        limit = min(seq.num_tokens - 1, len(other)) // size * size
        shared = size  # the first block matched
        while shared < limit and mine[shared:shared + size] == other[shared:shared + size]:
            shared += size
        return shared

    # ----- results -------------------------------------------------------------------------

    def apply_results(self, plan: StepPlan, results: list[OpResult]) -> StepOutcome:
        """Applies the block service's per-operation results (one per operation of the plan,
        in OPERATION_ORDER)."""
        outcome = StepOutcome()
        if any(r.outcome is OpOutcome.STALE for r in results):
            outcome.stale = True
            return outcome
        by_group = plan.split_results(results)
        for seq, result in zip(plan.commits, by_group["commits"], strict=True):
            self._apply_commit(seq, result, outcome)
        forked_parents: dict[Sequence, list[Sequence]] = {}
        for (parent, child), result in zip(plan.forks, by_group["forks"], strict=True):
            if self._apply_fork(parent, child, result, outcome):
                forked_parents.setdefault(parent, []).append(child)
        for parent, children in forked_parents.items():
            parent.pending_children = [c for c in parent.pending_children if c not in children]
        no_space: list[Sequence] = []
        appended: dict[Sequence, list[int]] = {}
        for grant, result in zip(plan.appends, by_group["appends"], strict=True):
            if grant.seq.status is not SeqStatus.RUNNING:
                continue  # its fork failed
            if result.outcome is OpOutcome.OK:
                self._apply_append(grant, result)
                appended[grant.seq] = result.slots
            elif result.outcome is OpOutcome.NO_SPACE:
                no_space.append(grant.seq)
            else:
                outcome.failed.append((grant.seq, result.error))
        admitted: list[Grant] = []
        unadmitted: list[Sequence] = []
        for grant, result in zip(plan.allocates, by_group["allocates"], strict=True):
            self._apply_allocate(grant, result, admitted, unadmitted, outcome)
        # Back to the front in their queue order; preempted sequences go before them.
        for seq in reversed(unadmitted):
            self.waiting.appendleft(seq)
        victims = self._preempt_for(no_space, outcome)
        self._collect_work(plan, appended, admitted, victims, no_space, outcome)
        return outcome

    def _apply_commit(self, seq: Sequence, result: OpResult, outcome: StepOutcome) -> None:
        if result.outcome is OpOutcome.OK:
            seq.num_committed = seq.num_computed
        else:
            outcome.failed.append((seq, result.error))

    def _apply_fork(self, parent: Sequence, child: Sequence, result: OpResult,
                    outcome: StepOutcome) -> bool:
        if result.outcome is not OpOutcome.OK or parent.status is not SeqStatus.RUNNING:
            outcome.failed.append((child, result.error or "fork failed"))
            return False
        child.block_table = list(result.table_ids)
        # The child was admitted with its parent: a later re-admission (after preemption)
        # must not report a cache hit that counts the child's own generated tokens.
        child.num_cached_at_admission = parent.num_cached_at_admission
        child.admit_order = next(self._admit_counter)
        child.status = SeqStatus.RUNNING
        self.running.append(child)
        return True

    @staticmethod
    def _apply_append(grant: Grant, result: OpResult) -> None:
        seq = grant.seq
        if result.table_ids or result.table_start != len(seq.block_table):
            seq.block_table = [*seq.block_table[:result.table_start], *result.table_ids]
        seq.num_committed = seq.num_computed
        seq.num_registered = grant.register_end

    def _apply_allocate(self, grant: Grant, result: OpResult, admitted: list[Grant],
                        unadmitted: list[Sequence], outcome: StepOutcome) -> None:
        seq = grant.seq
        if result.outcome is OpOutcome.NO_SPACE:
            seq.block_seq_id = 0
            seq.status = SeqStatus.WAITING
            unadmitted.append(seq)
            return
        if result.outcome is not OpOutcome.OK:
            seq.block_seq_id = 0
            seq.status = SeqStatus.FINISHED
            outcome.failed.append((seq, result.error))
            return
        seq.block_table = list(result.table_ids)
        seq.num_registered = seq.alloc_len
        seq.num_computed = seq.num_scheduled = result.num_cached_tokens
        seq.num_committed = result.num_cached_tokens
        seq.prefill_slot_start = result.num_cached_tokens
        seq.prefill_slots = list(result.slots)
        seq.admit_order = next(self._admit_counter)
        seq.status = SeqStatus.RUNNING
        if result.num_cached_tokens >= self.block_size > 0:
            self._first_block_computed(seq)  # by another replica, or before an eviction
        if seq.num_cached_at_admission is None:
            seq.num_cached_at_admission = result.num_cached_tokens
            outcome.newly_cached.append((seq, result.num_cached_tokens))
        self.running.append(seq)
        admitted.append(grant)

    def _first_blocks_computing(self) -> dict[FirstBlock, list[int]]:
        """The prompts of running sequences whose first block is being computed and not yet
        confirmed, by that block: the block service publishes a block once an Execute that
        computed it has returned, so a prompt admitted meanwhile would compute it again."""
        size = self.block_size
        return {key: seq.token_ids for seq in self.running
                if seq.num_computed < size <= seq.num_scheduled
                and (key := seq.first_block(size)) is not None}

    def _preempt_for(self, no_space: list[Sequence], outcome: StepOutcome) -> set[Sequence]:
        """Preempts running sequences, newest first, until the blocks they hold would cover a
        block for each decode that found none (a victim among those needs none any more).

        One victim per such decode would be too many: when every running sequence crosses
        into a new block in the same step, all of them would go, the samples of the step in
        flight with them, and their recompute would end the same way, forever.
        """
        victims: set[Sequence] = set()
        needed = len(no_space)
        freed = 0
        while freed < needed:
            candidates = [s for s in self.running if s not in victims]
            if not candidates:
                break
            victim = max(candidates, key=lambda s: s.admit_order)
            victims.add(victim)
            # Shared blocks (prefixes, forks) stay held: an estimate, the next Step corrects it.
            freed += len(victim.block_table)
            needed -= victim in no_space
        # Re-queue oldest-admitted first at the very front so FCFS order is kept.
        for victim in sorted(victims, key=lambda s: s.admit_order, reverse=True):
            self.running.remove(victim)
            self._queue_free(victim)
            victim.forget_allocation()
            victim.status = SeqStatus.WAITING
            victim.num_preemptions += 1
            self.waiting.appendleft(victim)
            outcome.preempted.append(victim)
        if victims:
            self.num_preemptions += len(victims)
            self._preempted_last_step = True
        return victims

    def _collect_work(self, plan: StepPlan, appended: dict[Sequence, list[int]],
                      admitted: list[Grant], victims: set[Sequence], no_space: list[Sequence],
                      outcome: StepOutcome) -> None:
        failed = {seq for seq, _ in outcome.failed}
        skip = victims | failed | set(no_space)
        work, scheduled = outcome.work, self._scheduled
        for seq, slots in appended.items():  # in the plan's order
            if seq not in skip:
                work.append(scheduled(Work(seq, seq.num_scheduled, len(slots), slots, True)))
        for grant in [*plan.prefills, *admitted]:
            seq = grant.seq
            if seq in skip or seq.status is not SeqStatus.RUNNING:
                continue
            outcome.work.append(self._scheduled(self._prefill_work(seq, grant.num_tokens)))

    @staticmethod
    def _prefill_work(seq: Sequence, granted: int) -> Work:
        start = seq.num_scheduled
        count = min(granted, seq.num_registered - start)
        offset = start - seq.prefill_slot_start
        slots = seq.prefill_slots[offset:offset + count]
        # Sample only when this chunk reaches the last known token (a fork parent stops short).
        do_sample = start + count == seq.num_tokens
        return Work(seq, start, count, slots, do_sample)

    @staticmethod
    def _scheduled(item: Work) -> Work:
        """Counts the work as under way: the next step is planned from there, while it runs."""
        item.seq.num_scheduled = item.start + item.num_tokens
        item.seq.num_pending += item.do_sample
        return item

    def on_executed(self, work: list[Work]) -> None:
        """The runner wrote the KV of every token in `work` (and sampled what it samples)."""
        size = self.block_size
        for item in work:
            seq = item.seq
            if seq.block_seq_id != item.block_seq_id:
                continue  # preempted or reset meanwhile: that allocation is gone
            seq.num_computed = max(seq.num_computed, item.start + item.num_tokens)
            seq.num_pending -= item.do_sample
            if item.start < size <= item.start + item.num_tokens:
                self._first_block_computed(seq)

    def _first_block_computed(self, seq: Sequence) -> None:
        key = seq.first_block(self.block_size)
        if key is None:
            return
        computed = self._computed_first_blocks
        computed[key] = None
        computed.move_to_end(key)
        if len(computed) > MAX_COMPUTED_FIRST_BLOCKS:
            computed.popitem(last=False)

    def _queue_free(self, seq: Sequence) -> None:
        if seq.block_seq_id:
            self._pending_frees.append(FreeOp(seq.block_seq_id, seq.reportable_computed))
