"""A test-side scheduler for the runner: it assigns blocks itself (a tiny allocator with ref
counts and copy-on-write) and packs Execute batches, so runner tests need no block service.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from gpu_runner.batch import ExecuteBatch

# Runs one batch and returns the sampled token ids (one per sequence that samples).
ExecuteFn = Callable[[ExecuteBatch], np.ndarray]


class BlockPool:
    """Free list plus reference counts."""

    def __init__(self, num_blocks: int) -> None:
        self.free = list(range(num_blocks - 1, -1, -1))
        self.refs = [0] * num_blocks

    def take(self) -> int:
        if not self.free:
            raise RuntimeError("test block pool exhausted")
        block = self.free.pop()
        self.refs[block] = 1
        return block

    def share(self, block: int) -> None:
        self.refs[block] += 1

    def release(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.free.append(block)


@dataclass(eq=False)
class Seq:
    """A sequence: every token so far, its block table, how many tokens the cache holds."""

    tokens: list[int]
    table: list[int] = field(default_factory=list)
    computed: int = 0
    prompt_len: int = 0
    adapter: str = ""  # its LoRA adapter's name; "" for the base model

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]


@dataclass
class _Planned:
    seq: Seq
    count: int
    slots: list[int]


class PagedDriver:
    """Packs batches for sequences, allocating blocks and copy-on-write copies as it goes."""

    def __init__(self, execute: ExecuteFn, block_size: int, num_blocks: int) -> None:
        self.execute = execute
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.epoch = 0
        self.last_batch: ExecuteBatch | None = None

    def add(self, prompt: Sequence[int]) -> Seq:
        return Seq(tokens=list(prompt), prompt_len=len(prompt))

    def add_with_cached_prefix(self, prompt: Sequence[int], source: Seq) -> Seq:
        """A new sequence whose leading full blocks are shared with `source` (same tokens),
        so only the rest is computed."""
        shared = 0
        limit = min(len(prompt) - 1, source.computed) // self.block_size
        while shared < limit and self._same_block(prompt, source, shared):
            shared += 1
        seq = Seq(tokens=list(prompt), prompt_len=len(prompt))
        for block in source.table[:shared]:
            self.pool.share(block)
            seq.table.append(block)
        seq.computed = shared * self.block_size
        return seq

    def _same_block(self, prompt: Sequence[int], source: Seq, index: int) -> bool:
        lo, hi = index * self.block_size, (index + 1) * self.block_size
        return list(prompt[lo:hi]) == source.tokens[lo:hi]

    def fork(self, parent: Seq) -> Seq:
        """A child sharing every block of `parent` (ref counts up; copy-on-write later)."""
        for block in parent.table:
            self.pool.share(block)
        return Seq(tokens=list(parent.tokens), table=list(parent.table),
                   computed=parent.computed, prompt_len=parent.prompt_len)

    def free(self, seq: Seq) -> None:
        for block in seq.table:
            self.pool.release(block)
        seq.table.clear()

    def step(self, seqs: Sequence[Seq], chunk: dict[int, int] | None = None) -> list[Seq]:
        """Computes every pending token of each sequence (at most chunk[i] for sequence i),
        samples greedily where a sequence reaches its end, and appends the sampled tokens.
        Returns the sequences that sampled."""
        batch, sampled = self.build(seqs, chunk)
        self.last_batch = batch
        token_ids = self.execute(batch)
        for seq, token in zip(sampled, token_ids.tolist(), strict=True):
            seq.tokens.append(int(token))
        return sampled

    def build(
        self, seqs: Sequence[Seq], chunk: dict[int, int] | None = None
    ) -> tuple[ExecuteBatch, list[Seq]]:
        """The batch for one step (allocating blocks), and the sequences that will sample."""
        copies: list[tuple[int, int]] = []
        planned = []
        for index, seq in enumerate(seqs):
            pending = len(seq.tokens) - seq.computed
            count = min(pending, (chunk or {}).get(index, pending))
            planned.append(_Planned(seq, count, self._slots(seq, count, copies)))
        batch = self._pack(planned, copies)
        for plan in planned:
            plan.seq.computed += plan.count
        sampled = [p.seq for p in planned if p.seq.computed == len(p.seq.tokens)]
        return batch, sampled

    def _slots(self, seq: Seq, count: int, copies: list[tuple[int, int]]) -> list[int]:
        slots = []
        for position in range(seq.computed, seq.computed + count):
            index, offset = divmod(position, self.block_size)
            if index == len(seq.table):
                seq.table.append(self.pool.take())
            elif self.pool.refs[seq.table[index]] > 1:
                # First write into a shared block: copy it first (copy-on-write).
                fresh = self.pool.take()
                copies.append((seq.table[index], fresh))
                self.pool.release(seq.table[index])
                seq.table[index] = fresh
            slots.append(seq.table[index] * self.block_size + offset)
        return slots

    def _pack(self, planned: list[_Planned], copies: list[tuple[int, int]]) -> ExecuteBatch:
        n = len(planned)
        return ExecuteBatch(
            num_new_tokens=np.array([p.count for p in planned], dtype=np.int64),
            start_positions=np.array([p.seq.computed for p in planned], dtype=np.int64),
            token_ids=np.array([t for p in planned
                                for t in p.seq.tokens[p.seq.computed:p.seq.computed + p.count]],
                               dtype=np.int64),
            slot_mapping=np.array([s for p in planned for s in p.slots], dtype=np.int64),
            block_table_lens=np.array([len(p.seq.table) for p in planned], dtype=np.int64),
            block_tables=np.array([b for p in planned for b in p.seq.table], dtype=np.int64),
            do_sample=np.array([p.seq.computed + p.count == len(p.seq.tokens) for p in planned]),
            temperatures=np.zeros(n, dtype=np.float32),
            top_ps=np.ones(n, dtype=np.float32),
            top_ks=np.zeros(n, dtype=np.int64),
            min_ps=np.zeros(n, dtype=np.float32),
            seeds=np.zeros(n, dtype=np.uint64),
            copy_src_block_ids=np.array([c[0] for c in copies], dtype=np.int64),
            copy_dst_block_ids=np.array([c[1] for c in copies], dtype=np.int64),
            adapters=tuple(p.seq.adapter for p in planned)
            if any(p.seq.adapter for p in planned) else (),
            epoch=self.epoch,
        )

    def run_staggered(self, prompts: Sequence[Sequence[int]], steps: int,
                      join_at: int = 2) -> list[Seq]:
        """Generates `steps` tokens for every prompt. The first half starts at once, the
        second half joins at step `join_at`, so batches mix prefills and decodes; a sequence
        leaves the batch once it has its tokens."""
        seqs = [self.add(prompt) for prompt in prompts]
        first_wave = (len(seqs) + 1) // 2
        step = 0
        while True:
            started = seqs if step >= join_at else seqs[:first_wave]
            active = [seq for seq in started if len(seq.generated) < steps]
            if not active:
                return seqs
            self.step(active)
            step += 1


def batch_to_proto(batch: ExecuteBatch) -> object:
    """The ExecuteRequest carrying `batch` (for driving a runner over gRPC)."""
    from protos import runner_pb2

    return runner_pb2.ExecuteRequest(
        epoch=batch.epoch,
        client_id=batch.client_id,
        step_id=batch.step_id,
        copy_src_block_ids=batch.copy_src_block_ids.tolist(),
        copy_dst_block_ids=batch.copy_dst_block_ids.tolist(),
        num_new_tokens=batch.num_new_tokens.tolist(),
        start_positions=batch.start_positions.tolist(),
        token_ids=batch.token_ids.tolist(),
        slot_mapping=batch.slot_mapping.tolist(),
        block_table_lens=batch.block_table_lens.tolist(),
        block_tables=batch.block_tables.tolist(),
        do_sample=batch.do_sample.tolist(),
        temperatures=batch.temperatures.tolist(),
        top_ps=batch.top_ps.tolist(),
        top_ks=batch.top_ks.tolist(),
        min_ps=batch.min_ps.tolist(),
        seeds=batch.seeds.tolist(),
        num_logprobs=batch.num_logprobs.tolist(),
        presence_penalties=batch.presence_penalties.tolist(),
        frequency_penalties=batch.frequency_penalties.tolist(),
        repetition_penalties=batch.repetition_penalties.tolist(),
        prompt_lens=batch.prompt_lens.tolist(),
        penalty_history_lens=batch.penalty_history_lens.tolist(),
        penalty_token_ids=batch.penalty_token_ids.tolist(),
        logit_bias_counts=batch.logit_bias_counts.tolist(),
        logit_bias_token_ids=batch.logit_bias_token_ids.tolist(),
        logit_bias_values=batch.logit_bias_values.tolist(),
        adapters=list(batch.adapters),
    )


@dataclass
class Penalties:
    """One sequence's penalties and logit bias (defaults: off)."""

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    bias: dict[int, float] = field(default_factory=dict)

    @property
    def penalised(self) -> bool:
        return self.presence != 0 or self.frequency != 0 or self.repetition != 1


def with_penalties(batch: ExecuteBatch, seqs: Sequence[Seq],
                   penalties: Sequence[Penalties]) -> ExecuteBatch:
    """`batch` (built for `seqs`) with the penalty and bias columns filled in as the gateway
    fills them: a history for each sampling sequence with a penalty on, 0 for the others;
    empty columns for a feature no sequence uses."""
    starts = batch.start_positions.tolist()
    changes: dict[str, np.ndarray] = {}
    if any(p.penalised for p in penalties):
        history = [p.penalised and bool(sample) for p, sample in zip(
            penalties, batch.do_sample.tolist(), strict=True)]
        changes.update(
            presence_penalties=np.array([p.presence for p in penalties], np.float32),
            frequency_penalties=np.array([p.frequency for p in penalties], np.float32),
            repetition_penalties=np.array([p.repetition for p in penalties], np.float32),
            prompt_lens=np.array([s.prompt_len for s in seqs], np.int64),
            penalty_history_lens=np.array(
                [start if h else 0 for start, h in zip(starts, history, strict=True)], np.int64),
            penalty_token_ids=np.array(
                [t for s, start, h in zip(seqs, starts, history, strict=True) if h
                 for t in s.tokens[:start]], np.int64))
    if any(p.bias for p in penalties):
        changes.update(
            logit_bias_counts=np.array([len(p.bias) for p in penalties], np.int64),
            logit_bias_token_ids=np.array([t for p in penalties for t in p.bias], np.int64),
            logit_bias_values=np.array([v for p in penalties for v in p.bias.values()],
                                       np.float32))
    return dataclasses.replace(batch, **changes)
