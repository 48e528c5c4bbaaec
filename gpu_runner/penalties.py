"""Logit bias and the presence / frequency / repetition penalties, applied to the rows that
use them before sampling (see the sampler's module docstring for where this sits).

Per row, on its raw logits, in vLLM's order:

1. **Logit bias**: ``logit[j] += bias[j]`` for the row's biased token ids.
2. **Repetition penalty** ``r`` (transformers' ``RepetitionPenaltyLogitsProcessor``, vLLM):
   for every token that occurs in the prompt or the output, ``logit / r`` when the logit is
   positive, ``logit * r`` otherwise (once per token, however often it occurs).
3. **Frequency and presence penalties** ``f``, ``p`` (OpenAI's formula): for every token,
   ``logit -= count * f + (count > 0) * p`` with ``count`` its occurrences in the output
   (prompt tokens do not count).

Only the rows that use one of them are copied and processed, and everything here is row by
row elementwise arithmetic on exact integer counts, so a row's result depends on its own
inputs alone (not on the batch, nor on the row order). The runner is stateless: a row's
history (prompt and output so far) comes with every batch; ``pack`` turns its columns into
``PenaltyTensors``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class PenaltyTensors:
    """Inputs of the rows that use a penalty or a bias; other rows are left as they are.

    ``rows`` index the sampled rows (the logits' rows); every other tensor is indexed by
    position in ``rows`` (``0 .. m-1``) or is a flat list of (row, token) entries.
    """

    rows: torch.Tensor  # [m] int64, increasing
    presence: torch.Tensor  # [m] float32, 0 = off
    frequency: torch.Tensor  # [m] float32, 0 = off
    repetition: torch.Tensor  # [m] float32, 1 = off
    token_rows: torch.Tensor  # [t] int64 in [0, m): the row of each history token
    token_ids: torch.Tensor  # [t] int64: the history tokens (prompt and output)
    is_output: torch.Tensor  # [t] bool: an output token (counts for presence / frequency)
    bias_rows: torch.Tensor  # [b] int64 in [0, m)
    bias_token_ids: torch.Tensor  # [b] int64, distinct within a row
    bias_values: torch.Tensor  # [b] float32


def rows_in_use(presence: np.ndarray, frequency: np.ndarray, repetition: np.ndarray,
                bias_counts: np.ndarray) -> np.ndarray:
    """Per row: whether it uses a penalty or a bias (all arrays one entry per row)."""
    return (presence != 0) | (frequency != 0) | (repetition != 1) | (bias_counts > 0)


def ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """The concatenation of ``arange(starts[i], starts[i] + lens[i])`` over i, vectorised."""
    total = int(lens.sum())
    offsets = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
    return np.repeat(starts.astype(np.int64), lens) + offsets


def pack(
    presence: np.ndarray,
    frequency: np.ndarray,
    repetition: np.ndarray,
    history_starts: np.ndarray,
    history_lens: np.ndarray,
    history_ids: np.ndarray,
    prompt_lens: np.ndarray,
    bias_starts: np.ndarray,
    bias_counts: np.ndarray,
    bias_token_ids: np.ndarray,
    bias_values: np.ndarray,
    device: torch.device,
) -> PenaltyTensors | None:
    """PenaltyTensors for the rows (one entry per row in every per-row array) that use
    something; None when none does. Row i's history is ``history_ids[history_starts[i]:
    history_starts[i] + history_lens[i]]`` (its tokens at positions 0, 1, ...), its bias
    entries the ``bias_counts[i]`` from ``bias_starts[i]`` of ``bias_token_ids`` /
    ``bias_values``."""
    used = rows_in_use(presence, frequency, repetition, bias_counts)
    rows = np.nonzero(used)[0]
    if rows.size == 0:
        return None
    lens = history_lens[rows]
    token_rows = np.repeat(np.arange(rows.size, dtype=np.int64), lens)
    positions = np.arange(token_rows.size, dtype=np.int64) - np.repeat(np.cumsum(lens) - lens,
                                                                      lens)
    token_ids = history_ids[ranges(history_starts[rows], lens)]
    is_output = positions >= prompt_lens[rows][token_rows]
    counts = bias_counts[rows]
    picked = ranges(bias_starts[rows], counts)

    def tensor(values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(values)).to(device, dtype)

    return PenaltyTensors(
        rows=tensor(rows, torch.int64),
        presence=tensor(presence[rows], torch.float32),
        frequency=tensor(frequency[rows], torch.float32),
        repetition=tensor(repetition[rows], torch.float32),
        token_rows=tensor(token_rows, torch.int64),
        token_ids=tensor(token_ids, torch.int64),
        is_output=tensor(is_output, torch.bool),
        bias_rows=tensor(np.repeat(np.arange(rows.size, dtype=np.int64), counts), torch.int64),
        bias_token_ids=tensor(bias_token_ids[picked], torch.int64),
        bias_values=tensor(bias_values[picked], torch.float32),
    )


@contextmanager
def penalised(logits: torch.Tensor, penalties: PenaltyTensors) -> Iterator[None]:
    """Within the block, ``logits`` [n, vocab] float32 holds the processed values in
    ``penalties.rows``; on leaving, those rows get their raw values back (bit for bit). Only
    those rows are copied: no copy of the whole batch's logits."""
    rows = penalties.rows.to(logits.device)
    raw = logits.index_select(0, rows)
    logits.index_copy_(0, rows, process_rows(raw.clone(), _on(penalties, logits.device)))
    try:
        yield
    finally:
        logits.index_copy_(0, rows, raw)


def process_rows(values: torch.Tensor, p: PenaltyTensors) -> torch.Tensor:
    """Applies bias and penalties in place to ``values`` [m, vocab] (row i is ``p.rows[i]``'s
    logits) and returns it."""
    m, vocab = values.shape
    if p.bias_rows.numel():
        values.index_put_((p.bias_rows, p.bias_token_ids), p.bias_values, accumulate=True)
    repetition = p.repetition[:, None]
    if bool((repetition != 1).any()):
        seen = torch.zeros(m, vocab, dtype=torch.bool, device=values.device)
        seen[p.token_rows, p.token_ids] = True
        penalised = torch.where(values > 0, values / repetition, values * repetition)
        values = torch.where(seen, penalised, values)
    if bool(((p.frequency != 0) | (p.presence != 0)).any()):
        counts = torch.zeros(m, vocab, dtype=torch.float32, device=values.device)
        out_rows, out_ids = p.token_rows[p.is_output], p.token_ids[p.is_output]
        # Counts are small integers: exact in float32 whatever the order of accumulation.
        counts.index_put_((out_rows, out_ids), torch.ones_like(out_ids, dtype=torch.float32),
                          accumulate=True)
        values = values.sub_(counts * p.frequency[:, None] + (counts > 0) * p.presence[:, None])
    return values


def _on(p: PenaltyTensors, device: torch.device) -> PenaltyTensors:
    if p.presence.device == device:
        return p
    return PenaltyTensors(*(getattr(p, name).to(device) for name in _FIELDS))


_FIELDS = ("rows", "presence", "frequency", "repetition", "token_rows", "token_ids",
           "is_output", "bias_rows", "bias_token_ids", "bias_values")
