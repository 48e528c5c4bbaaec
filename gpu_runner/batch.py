"""An Execute batch: its columns, their full validation, and the tensors built from them.

Validation runs on the host with numpy, entirely before anything touches the KV cache, so a
rejected batch changes nothing. Every check is vectorised over tokens and sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from gpu_runner import penalties
from gpu_runner.attention.metadata import AttentionMetadata
from gpu_runner.masks import check_masks
from gpu_runner.merging import BatchError  # torch-free, for the runners that import no torch
from gpu_runner.sampler import SamplingTensors
from protos import runner_pb2

MAX_LOGPROBS = 20


def _ints(values: object = ()) -> np.ndarray:
    return np.asarray(values, dtype=np.int64).reshape(-1)


def _floats(values: object = ()) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).reshape(-1)


@dataclass
class ExecuteBatch:
    """The columns of a pagewire.runner.v1.ExecuteRequest as numpy arrays (see runner.proto)."""

    num_new_tokens: np.ndarray
    start_positions: np.ndarray
    token_ids: np.ndarray
    slot_mapping: np.ndarray
    block_table_lens: np.ndarray
    block_tables: np.ndarray
    do_sample: np.ndarray
    temperatures: np.ndarray
    top_ps: np.ndarray
    top_ks: np.ndarray
    min_ps: np.ndarray
    seeds: np.ndarray  # uint64
    num_logprobs: np.ndarray = field(default_factory=_ints)  # empty: no logprobs
    copy_src_block_ids: np.ndarray = field(default_factory=_ints)
    copy_dst_block_ids: np.ndarray = field(default_factory=_ints)
    # Penalties and logit bias (see runner.proto): empty columns when no sequence uses them.
    presence_penalties: np.ndarray = field(default_factory=_floats)
    frequency_penalties: np.ndarray = field(default_factory=_floats)
    repetition_penalties: np.ndarray = field(default_factory=_floats)
    prompt_lens: np.ndarray = field(default_factory=_ints)
    penalty_history_lens: np.ndarray = field(default_factory=_ints)
    penalty_token_ids: np.ndarray = field(default_factory=_ints)
    logit_bias_counts: np.ndarray = field(default_factory=_ints)
    logit_bias_token_ids: np.ndarray = field(default_factory=_ints)
    logit_bias_values: np.ndarray = field(default_factory=_floats)
    # Structured output: the sequences whose next token is masked, and their packed masks
    # (empty with masks_follow: they come in a SupplyMasks call; gpu_runner/masks.py).
    mask_seq_indices: np.ndarray = field(default_factory=_ints)
    masks: bytes = b""
    masks_follow: bool = False
    # Per sequence, its LoRA adapter's name ("" for the base model); empty: all base.
    adapters: tuple[str, ...] = ()
    epoch: int = 0
    client_id: str = ""
    step_id: int = 0

    @classmethod
    def from_proto(cls, request: runner_pb2.ExecuteRequest) -> ExecuteBatch:
        """Reads an ExecuteRequest (no checks yet: see validate_batch)."""
        r = request
        return cls(
            num_new_tokens=_ints(r.num_new_tokens),
            start_positions=_ints(r.start_positions),
            token_ids=_ints(r.token_ids),
            slot_mapping=_ints(r.slot_mapping),
            block_table_lens=_ints(r.block_table_lens),
            block_tables=_ints(r.block_tables),
            do_sample=np.asarray(list(r.do_sample), dtype=np.bool_).reshape(-1),
            temperatures=_floats(r.temperatures),
            top_ps=_floats(r.top_ps),
            top_ks=_ints(r.top_ks),
            min_ps=_floats(r.min_ps),
            seeds=np.asarray(r.seeds, dtype=np.uint64).reshape(-1),
            num_logprobs=_ints(r.num_logprobs),
            copy_src_block_ids=_ints(r.copy_src_block_ids),
            copy_dst_block_ids=_ints(r.copy_dst_block_ids),
            presence_penalties=_floats(r.presence_penalties),
            frequency_penalties=_floats(r.frequency_penalties),
            repetition_penalties=_floats(r.repetition_penalties),
            prompt_lens=_ints(r.prompt_lens),
            penalty_history_lens=_ints(r.penalty_history_lens),
            penalty_token_ids=_ints(r.penalty_token_ids),
            logit_bias_counts=_ints(r.logit_bias_counts),
            logit_bias_token_ids=_ints(r.logit_bias_token_ids),
            logit_bias_values=_floats(r.logit_bias_values),
            mask_seq_indices=_ints(r.mask_seq_indices),
            masks=bytes(r.masks),
            masks_follow=bool(r.masks_follow),
            adapters=tuple(r.adapters),
            epoch=int(r.epoch),
            client_id=str(r.client_id),
            step_id=int(r.step_id),
        )

    @property
    def num_seqs(self) -> int:
        return int(self.num_new_tokens.shape[0])

    @property
    def has_penalties(self) -> bool:
        """Whether any penalty column is sent (then prompt_lens and the histories are too)."""
        return bool(self.presence_penalties.size or self.frequency_penalties.size
                    or self.repetition_penalties.size)

    def per_seq(self, name: str, neutral: float) -> np.ndarray:
        """An optional per-sequence column, `neutral` for every sequence when it is empty."""
        values: np.ndarray = getattr(self, name)
        return values if values.size else np.full(self.num_seqs, neutral, values.dtype)


@dataclass(frozen=True)
class BatchLimits:
    """What the runner can hold."""

    num_blocks: int
    block_size: int
    vocab_size: int
    max_model_len: int
    max_num_tokens: int = 65536  # new tokens per batch (bounds one forward's memory)


def validate_batch(batch: ExecuteBatch, limits: BatchLimits) -> None:
    """Raises BatchError unless the batch is well formed for a runner with `limits`."""
    _check_column_lengths(batch)
    _check_lengths(batch, limits)
    _check_values_in_range(batch, limits)
    _check_slots_match_tables(batch, limits.block_size)
    _check_sampling(batch)
    _check_penalties(batch, limits.vocab_size)
    _check_masks(batch, limits.vocab_size)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise BatchError(message)


def _check_column_lengths(b: ExecuteBatch) -> None:
    n = b.num_seqs
    for name in ("start_positions", "block_table_lens", "do_sample", "temperatures", "top_ps",
                 "top_ks", "min_ps", "seeds"):
        size = getattr(b, name).shape[0]
        _require(size == n, f"{name} has {size} entries, expected one per sequence ({n})")
    _require(b.num_logprobs.shape[0] in (0, n),
             f"num_logprobs has {b.num_logprobs.shape[0]} entries: send none or {n}")
    _require(len(b.adapters) in (0, n),
             f"adapters has {len(b.adapters)} entries: send none or {n}")
    _require(b.copy_src_block_ids.shape[0] == b.copy_dst_block_ids.shape[0],
             f"copy_src_block_ids has {b.copy_src_block_ids.shape[0]} entries but "
             f"copy_dst_block_ids {b.copy_dst_block_ids.shape[0]}")
    _require(bool(np.all(b.num_new_tokens >= 1)), "num_new_tokens must be >= 1 per sequence")
    tokens = int(b.num_new_tokens.sum())
    for name in ("token_ids", "slot_mapping"):
        size = getattr(b, name).shape[0]
        _require(size == tokens, f"{name} has {size} entries, expected sum(num_new_tokens) "
                                 f"= {tokens}")
    table_total = int(b.block_table_lens.sum())
    _require(b.block_tables.shape[0] == table_total,
             f"block_tables has {b.block_tables.shape[0]} entries, expected "
             f"sum(block_table_lens) = {table_total}")


def _check_lengths(b: ExecuteBatch, limits: BatchLimits) -> None:
    tokens = int(b.num_new_tokens.sum())
    _require(tokens <= limits.max_num_tokens,
             f"{tokens} new tokens in one batch; the runner takes at most {limits.max_num_tokens}")
    negative = np.nonzero(b.start_positions < 0)[0]
    _require(negative.size == 0, _first_bad(
        negative, lambda i: f"start_positions[{i}] = {b.start_positions[i]} is negative"))
    ends = b.start_positions + b.num_new_tokens
    too_long = np.nonzero(ends > limits.max_model_len)[0]
    _require(too_long.size == 0, _first_bad(
        too_long, lambda i: f"sequence {i} reaches length {ends[i]} > max_model_len "
                            f"{limits.max_model_len}"))
    needed = -(-ends // limits.block_size)
    short = np.nonzero(b.block_table_lens < needed)[0]
    _require(short.size == 0, _first_bad(
        short, lambda i: f"sequence {i}: block table of {b.block_table_lens[i]} blocks does not "
                         f"cover positions 0..{ends[i] - 1} ({needed[i]} blocks needed)"))
    max_table = -(-limits.max_model_len // limits.block_size)
    long = np.nonzero(b.block_table_lens > max_table)[0]
    _require(long.size == 0, _first_bad(
        long, lambda i: f"sequence {i}: block table of {b.block_table_lens[i]} blocks exceeds "
                        f"max_model_len / block_size = {max_table}"))


def _first_bad(bad: np.ndarray, describe: object) -> str:
    """The message for the first offending index (only built when there is one)."""
    return describe(int(bad[0])) if bad.size else ""  # type: ignore[operator]


def _check_values_in_range(b: ExecuteBatch, limits: BatchLimits) -> None:
    _check_range("token_ids", b.token_ids, limits.vocab_size)
    _check_range("block_tables", b.block_tables, limits.num_blocks)
    _check_range("copy_src_block_ids", b.copy_src_block_ids, limits.num_blocks)
    _check_range("copy_dst_block_ids", b.copy_dst_block_ids, limits.num_blocks)
    _check_range("slot_mapping", b.slot_mapping, limits.num_blocks * limits.block_size)
    unique = np.unique(b.slot_mapping)
    _require(unique.shape[0] == b.slot_mapping.shape[0],
             "slot_mapping writes one slot twice in the same batch")


def _check_range(name: str, values: np.ndarray, upper: int) -> None:
    bad = np.nonzero((values < 0) | (values >= upper))[0]
    _require(bad.size == 0, _first_bad(
        bad, lambda i: f"{name}[{i}] = {values[i]} is outside [0, {upper})"))


def token_positions(b: ExecuteBatch) -> tuple[np.ndarray, np.ndarray]:
    """(sequence index, position) of every new token, in packed order."""
    seq_of_token = np.repeat(np.arange(b.num_seqs), b.num_new_tokens)
    query_starts = np.cumsum(b.num_new_tokens) - b.num_new_tokens
    offsets = np.arange(seq_of_token.shape[0]) - query_starts[seq_of_token]
    return seq_of_token, b.start_positions[seq_of_token] + offsets


def _check_slots_match_tables(b: ExecuteBatch, block_size: int) -> None:
    seq_of_token, positions = token_positions(b)
    table_starts = np.cumsum(b.block_table_lens) - b.block_table_lens
    blocks = b.block_tables[table_starts[seq_of_token] + positions // block_size]
    expected = blocks * block_size + positions % block_size
    bad = np.nonzero(expected != b.slot_mapping)[0]
    _require(bad.size == 0, _first_bad(
        bad, lambda j: f"slot_mapping[{j}] = {b.slot_mapping[j]} but sequence "
                       f"{seq_of_token[j]}'s block table puts position {positions[j]} at slot "
                       f"{expected[j]}"))


def _check_sampling(b: ExecuteBatch) -> None:
    checks = (
        ("temperatures", b.temperatures, np.isfinite(b.temperatures) & (b.temperatures >= 0),
         "a finite value >= 0"),
        ("top_ps", b.top_ps, (b.top_ps > 0) & (b.top_ps <= 1), "in (0, 1]"),
        ("min_ps", b.min_ps, (b.min_ps >= 0) & (b.min_ps <= 1), "in [0, 1]"),
        ("top_ks", b.top_ks, b.top_ks >= 0, ">= 0"),
        ("num_logprobs", b.num_logprobs,
         (b.num_logprobs >= 0) & (b.num_logprobs <= MAX_LOGPROBS), f"in [0, {MAX_LOGPROBS}]"),
    )
    for name, values, ok, rule in checks:
        bad = np.nonzero(~ok)[0]
        _require(bad.size == 0, _first_bad(
            bad, lambda i, n=name, v=values, r=rule: f"{n}[{i}] = {v[i]} must be {r}"))


def _check_masks(b: ExecuteBatch, vocab_size: int) -> None:
    """Masked sequences: distinct, sampled; their masks inline (one row each) or following."""
    indices = b.mask_seq_indices
    if not indices.size:
        _require(not b.masks and not b.masks_follow,
                 "masks / masks_follow without mask_seq_indices")
        return
    _check_range("mask_seq_indices", indices, b.num_seqs)
    _require(np.unique(indices).shape[0] == indices.shape[0],
             "mask_seq_indices names a sequence twice")
    unsampled = np.nonzero(~b.do_sample[indices])[0]
    _require(unsampled.size == 0, _first_bad(
        unsampled, lambda j: f"mask_seq_indices[{j}] = {indices[j]} names a sequence without "
                             "do_sample"))
    if b.masks_follow:
        _require(not b.masks, "masks_follow with inline masks: send one or the other")
        return
    try:
        check_masks(b.masks, indices.shape[0], vocab_size)
    except ValueError as error:
        raise BatchError(str(error)) from None


def _check_penalties(b: ExecuteBatch, vocab_size: int) -> None:
    """The penalty and logit-bias columns (all optional, see runner.proto)."""
    columns = ("presence_penalties", "frequency_penalties", "repetition_penalties",
               "logit_bias_counts", "prompt_lens", "penalty_history_lens", "penalty_token_ids",
               "logit_bias_token_ids", "logit_bias_values")
    if not any(getattr(b, name).shape[0] for name in columns):
        return  # the common batch: none sent, nothing to check
    n = b.num_seqs
    penalty_sent = b.has_penalties
    for name in ("presence_penalties", "frequency_penalties", "repetition_penalties",
                 "logit_bias_counts"):
        size = getattr(b, name).shape[0]
        _require(size in (0, n), f"{name} has {size} entries: send none or {n}")
    for name in ("prompt_lens", "penalty_history_lens"):
        size = getattr(b, name).shape[0]
        expected = n if penalty_sent else 0
        _require(size == expected, f"{name} has {size} entries, expected {expected} (one per "
                                   f"sequence when a penalty column is sent, else none)")
    history = int(b.penalty_history_lens.sum())
    _require(b.penalty_token_ids.shape[0] == history,
             f"penalty_token_ids has {b.penalty_token_ids.shape[0]} entries, expected "
             f"sum(penalty_history_lens) = {history}")
    num_bias = int(b.logit_bias_counts.sum())
    for name in ("logit_bias_token_ids", "logit_bias_values"):
        size = getattr(b, name).shape[0]
        _require(size == num_bias, f"{name} has {size} entries, expected "
                                   f"sum(logit_bias_counts) = {num_bias}")
    checks = (
        ("presence_penalties", b.presence_penalties, np.isfinite(b.presence_penalties),
         "finite"),
        ("frequency_penalties", b.frequency_penalties, np.isfinite(b.frequency_penalties),
         "finite"),
        ("repetition_penalties", b.repetition_penalties,
         np.isfinite(b.repetition_penalties) & (b.repetition_penalties > 0), "finite and > 0"),
        # A sampling row's prompt fits in what it has computed (a prompt chunk's need not).
        ("prompt_lens", b.prompt_lens,
         (b.prompt_lens >= 0) & (~b.do_sample
                                 | (b.prompt_lens <= b.start_positions + b.num_new_tokens))
         if penalty_sent else b.prompt_lens >= 0,
         ">= 0, and for a sampling sequence <= start_positions + num_new_tokens"),
        ("logit_bias_counts", b.logit_bias_counts,
         (b.logit_bias_counts >= 0) & (b.logit_bias_counts <= vocab_size),
         f"in [0, vocab_size {vocab_size}]"),
        ("logit_bias_values", b.logit_bias_values, np.isfinite(b.logit_bias_values), "finite"),
    )
    for name, values, ok, rule in checks:
        bad = np.nonzero(~ok)[0]
        _require(bad.size == 0, _first_bad(
            bad, lambda i, n=name, v=values, r=rule: f"{n}[{i}] = {v[i]} must be {r}"))
    _check_range("penalty_token_ids", b.penalty_token_ids, vocab_size)
    _check_range("logit_bias_token_ids", b.logit_bias_token_ids, vocab_size)
    if num_bias:
        seq_of_entry = np.repeat(np.arange(n), b.logit_bias_counts)
        keys = seq_of_entry * vocab_size + b.logit_bias_token_ids
        _require(np.unique(keys).shape[0] == keys.shape[0],
                 "logit_bias_token_ids lists a token twice for one sequence")
    if penalty_sent:
        lens = b.penalty_history_lens
        whole = lens == b.start_positions
        _require(bool(np.all(whole | (lens == 0))), _first_bad(
            np.nonzero(~(whole | (lens == 0)))[0],
            lambda i: f"penalty_history_lens[{i}] = {lens[i]} must be 0 or start_positions[{i}]"
                      f" = {b.start_positions[i]}"))
        on = b.do_sample & ((b.per_seq("presence_penalties", 0.0) != 0)
                            | (b.per_seq("frequency_penalties", 0.0) != 0)
                            | (b.per_seq("repetition_penalties", 1.0) != 1))
        missing = np.nonzero(on & ~whole)[0]
        _require(missing.size == 0, _first_bad(
            missing, lambda i: f"sequence {i} samples with a penalty but penalty_history_lens"
                               f"[{i}] = {lens[i]}: its history (start_positions[{i}] = "
                               f"{b.start_positions[i]} tokens) is needed"))


@dataclass(frozen=True)
class ModelInputs:
    """Tensors for one forward and its sampling, on the model's device."""

    token_ids: torch.Tensor
    meta: AttentionMetadata
    sampling: SamplingTensors | None  # None when no sequence samples
    copy_src: torch.Tensor
    copy_dst: torch.Tensor


def build_inputs(b: ExecuteBatch, block_size: int, device: torch.device) -> ModelInputs:
    """Vectorised construction of the model's inputs from a validated batch."""
    _, positions = token_positions(b)
    return ModelInputs(
        token_ids=_tensor(b.token_ids, device),
        meta=_attention_metadata(b, positions, block_size, device),
        sampling=_sampling_tensors(b, device),
        copy_src=_tensor(b.copy_src_block_ids, device),
        copy_dst=_tensor(b.copy_dst_block_ids, device),
    )


def _tensor(values: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(values)).to(device)


def _padded_tables(b: ExecuteBatch) -> np.ndarray:
    width = max(int(b.block_table_lens.max(initial=0)), 1)
    padded = np.zeros((b.num_seqs, width), dtype=np.int64)
    seq_of_entry = np.repeat(np.arange(b.num_seqs), b.block_table_lens)
    table_starts = np.cumsum(b.block_table_lens) - b.block_table_lens
    column = np.arange(seq_of_entry.shape[0]) - table_starts[seq_of_entry]
    padded[seq_of_entry, column] = b.block_tables
    return padded


def _attention_metadata(
    b: ExecuteBatch, positions: np.ndarray, block_size: int, device: torch.device
) -> AttentionMetadata:
    query_lens = b.num_new_tokens.astype(np.int64)
    context_lens = (b.start_positions + b.num_new_tokens).astype(np.int64)
    query_start_locs = np.concatenate(([0], np.cumsum(query_lens))).astype(np.int64)
    logits_indices = query_start_locs[1:][b.do_sample] - 1
    return AttentionMetadata(
        positions=_tensor(positions, device),
        slot_mapping=_tensor(b.slot_mapping, device),
        block_tables=_tensor(_padded_tables(b), device),
        query_lens=_tensor(query_lens, device),
        context_lens=_tensor(context_lens, device),
        query_start_locs=_tensor(query_start_locs, device),
        logits_indices=_tensor(logits_indices, device),
        query_lens_host=query_lens,
        context_lens_host=context_lens,
        block_table_lens_host=b.block_table_lens.astype(np.int64),
        block_size=block_size,
    )


def _sampling_tensors(b: ExecuteBatch, device: torch.device) -> SamplingTensors | None:
    rows = b.do_sample
    if not rows.any():
        return None
    ends = (b.start_positions + b.num_new_tokens)[rows]
    return SamplingTensors(
        temperatures=_tensor(b.temperatures[rows], device),
        top_ps=_tensor(b.top_ps[rows], device),
        top_ks=_tensor(b.top_ks[rows], device),
        min_ps=_tensor(b.min_ps[rows], device),
        # uint64 seeds as their two's-complement int64 pattern (what the sampler expects).
        seeds=_tensor(b.seeds[rows].view(np.int64), device),
        # The sampled token will sit at position start + num_new_tokens.
        positions=_tensor(ends.astype(np.int64), device),
        num_logprobs=_tensor(b.num_logprobs[rows], device) if b.num_logprobs.size else None,
        penalties=_penalty_tensors(b, device),
    )


def _penalty_tensors(b: ExecuteBatch, device: torch.device) -> penalties.PenaltyTensors | None:
    """The sampled rows' bias and penalties, their histories being the sent prefix followed
    by the new tokens (None, at no cost, when the batch has no such column)."""
    if not (b.has_penalties or b.logit_bias_counts.size):
        return None
    history_lens = b.per_seq("penalty_history_lens", 0)
    # Each sequence's history as one stream: its sent prefix, then its new tokens.
    lens = history_lens + b.num_new_tokens
    starts = np.cumsum(lens) - lens
    new_starts = np.cumsum(b.num_new_tokens) - b.num_new_tokens
    ids = np.empty(int(lens.sum()), dtype=np.int64)
    ids[penalties.ranges(starts, history_lens)] = b.penalty_token_ids
    ids[penalties.ranges(starts + history_lens, b.num_new_tokens)] = (
        b.token_ids[penalties.ranges(new_starts, b.num_new_tokens)])
    # A sequence sent without its prefix (no penalty on) starts at start_positions[i]:
    # shifting its prompt length keeps prompt and output apart all the same.
    prompt_lens = b.per_seq("prompt_lens", 0) - np.where(history_lens == 0, b.start_positions, 0)
    bias_counts = b.per_seq("logit_bias_counts", 0)
    keep = np.nonzero(b.do_sample)[0]
    return penalties.pack(
        presence=b.per_seq("presence_penalties", 0.0)[keep],
        frequency=b.per_seq("frequency_penalties", 0.0)[keep],
        repetition=b.per_seq("repetition_penalties", 1.0)[keep],
        history_starts=starts[keep],
        history_lens=lens[keep],
        history_ids=ids,
        prompt_lens=prompt_lens[keep],
        bias_starts=(np.cumsum(bias_counts) - bias_counts)[keep],
        bias_counts=bias_counts[keep],
        bias_token_ids=b.logit_bias_token_ids,
        bias_values=b.logit_bias_values,
        device=device,
    )
