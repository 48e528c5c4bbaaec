"""Token sampling for a batch of sequences, each with its own parameters, in one vectorised pass.

Semantics (those of Hugging Face ``generate`` and vLLM):

0. **Bias and penalties.** Rows with ``logit_bias`` or a presence / frequency / repetition
   penalty first get them applied (``gpu_runner/penalties.py``: bias, then repetition over
   prompt + output tokens, then frequency and presence over output tokens, vLLM's order);
   everything below, greedy included, works on those processed logits. Only those rows are
   copied (processed in place, their raw values put back before logprobs), and when no row
   uses them (``penalties is None``) nothing runs.
1. **Greedy.** A row with ``temperature == 0`` takes ``argmax`` of its logits (as step 0 left
   them); ties go to the lowest token id exactly as ``torch.argmax`` does, so greedy decoding
   matches transformers.
   When every row is greedy nothing else runs.
2. **Temperature.** Other rows divide their logits by their temperature. Every filter below
   works on these scaled logits, in this order:
3. **Top-k** (``top_k > 0``): keep the tokens whose scaled logit is at least the k-th largest.
   Tokens tied with the k-th one are all kept (the value-threshold rule of HF and vLLM), so the
   result never depends on how a sort orders equal values.
4. **Top-p** (``top_p < 1``): over the distribution left by top-k (renormalised), keep token i
   when the probability of the tokens strictly more likely than it is below ``top_p``. That is
   HF's "drop a token once the sorted cumulative mass before it reaches top_p" with ties kept
   together; the most likely token is always kept.
5. **Min-p** (``min_p > 0``): keep tokens whose probability is at least ``min_p`` times the
   most likely token's, compared as ``logit - max_logit >= log(min_p)`` (renormalising after
   top-k/top-p does not change the ratio).
6. **Draw.** Exponential race (the Gumbel-max trick in probability space): the token is the
   ``argmax`` over the kept tokens of ``p_i / E_i`` with ``E_i = -log(U_i) ~ Exp(1)``, which
   picks token i with probability p_i. Exact ties of ``p_i / E_i`` go to the lowest token id.

**Reproducibility without state.** ``U`` is a counter-based hash of (seed, position, counter)
alone, the counter being a token id (or a block id, below), so a seed gives the same token at
a position whatever else is in the batch, in whatever row order, with no generator objects
carried between steps:

- ``key = mix64(mix64(seed + G64) + (position + 1) * G64)``: output ``position + 1`` of a
  SplitMix64 stream whose state is the first SplitMix64 output of ``seed`` (``mix64`` is the
  SplitMix64 finaliser, ``G64 = 0x9E3779B97F4A7C15``; all arithmetic mod 2**64, the seed taken
  as its 64-bit two's-complement pattern, so uint64 seeds map one to one).
- ``k1, k2`` = low and high 32 bits of ``key``. Per counter ``j`` (mod 2**32, logical shifts):
  ``x = j * 0x9E3779B9 + k1; x ^= x >> 16; x *= 0x21F0AAAD; x ^= x >> 15; x += k2;
  x *= 0x735A2D97; x ^= x >> 15``; then ``U = ((x >> 9) + 0.5) / 2**23``, in (0, 1).

The per-counter hash runs on int32 tensors (4-10x faster than int64 on CPU); signed
wrap-around multiplication is modular arithmetic, and logical shifts are arithmetic shifts
plus a mask. The row keys are computed in int64 (one per row).

**Two routes, chosen by a row's own parameters only** (so never by its batch):

- *Temperature-only rows* race in two stages: blocks of 128 token ids race weighted by
  their probability mass (block b uses counter ``-1 - b``), then the tokens of the winning
  block race (counter = token id). That draws token i with probability exactly p_i while
  hashing ~vocab/128 + 128 counters a row instead of vocab.
- *Top-k / top-p / min-p rows* look only at a window of their largest logits (a top-k: 64
  wide at first, times 8 while a kept token might lie outside it, a full sort past a quarter
  of the vocabulary) and race there in one stage (counter = token id). Window sizes depend on
  the batch, the result does not: the hash depends on the token id, not on where it sits in a
  tensor, and cut-offs come from sequential cumulative sums over the sorted values. (A row's
  total mass is a reduction whose float rounding may vary with the batch shape; that can move
  a top-p cut only when a token sits within rounding, ~1e-7 relative, of it.)

All-greedy and all-same-route batches copy no rows. ``exp`` runs on arguments clamped at -87
(torch's CPU exp is 30-100x slower where float32 underflows); the weight 1.6e-38 this leaves
a -inf logit provably never wins a race (see ``_exp_``), so -inf tokens are never drawn.
On CUDA the same code runs with ``torch.argmax`` / ``torch.topk`` in place of the CPU
shortcuts; each call synchronises a few times (route choice, window growth).

**Logprobs** describe the model's own distribution: ``log_softmax`` of the raw logits, before
bias, penalties, temperature and filters (what vLLM returns by default). ``logprobs`` is the
sampled token's; ``top_token_ids`` / ``top_logprobs`` hold the ``k_max = max(num_logprobs)``
most likely tokens, most likely first (tied values in unspecified order); a row asking for
fewer uses a prefix.

**Broken logits.** NaN logits are never picked: a NaN counts as ``-inf`` (greedy and sampled
alike) and a warning is logged; ``+inf`` counts as the largest float (those tokens share the
draw). A row with no finite or ``+inf`` logit at all yields token 0.
Its logprobs are reported as computed (NaN when the row holds a NaN), so the fault stays
visible. Parameter validation is the caller's job.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from gpu_runner.penalties import PenaltyTensors, penalised

logger = logging.getLogger(__name__)

_NEG_INF = float("-inf")
# Argmax runs as a max over blocks of this many logits, then an argmax inside one block:
# torch's CPU argmax is ~10x slower than its max reduction.
_ARGMAX_BLOCK = 128
# First candidate window for top-k/top-p/min-p rows, and how fast it grows when too small.
_MIN_WINDOW = 64
_WINDOW_GROWTH = 8
# Block size of top_window's pre-selection.
_WINDOW_BLOCK = 32
# Block size of the two-stage race over the whole vocabulary.
_RACE_BLOCK = 128
_EXP_FLOOR = -87.0  # exp(-87) = 1.6e-38 is still a normal float32

_GOLDEN64 = 0x9E3779B97F4A7C15
_MIX64_M1 = 0xBF58476D1CE4E5B9
_MIX64_M2 = 0x94D049BB133111EB
_GOLDEN32 = 0x9E3779B9
_HASH32_M1 = 0x21F0AAAD
_HASH32_M2 = 0x735A2D97
_UNIFORM_BITS = 23  # U = (k + 0.5) / 2**23 is exact in float32 and never 0 or 1


@dataclass
class SamplingTensors:
    """Per-row sampling parameters, each a [n] tensor (on any device; moved to the logits')."""

    temperatures: torch.Tensor  # float32, 0 = greedy
    top_ps: torch.Tensor  # float32, 1 = off
    top_ks: torch.Tensor  # int64, 0 = off
    min_ps: torch.Tensor  # float32, 0 = off
    seeds: torch.Tensor  # int64 (a uint64 seed's two's-complement pattern)
    positions: torch.Tensor  # int64: position of the token being sampled
    num_logprobs: torch.Tensor | None  # int64, None = no logprobs for any row
    penalties: PenaltyTensors | None = None  # None = no row has a bias or a penalty
    masks: TokenMasks | None = None  # None = no row is masked


@dataclass
class TokenMasks:
    """Structured output: the rows whose token must be one their mask allows."""

    rows: torch.Tensor  # int64 [m]: indices into the sampled rows
    allowed: torch.Tensor  # bool [m, vocab]


@dataclass
class SamplerOutput:
    """One sampled token per row, with logprobs when they were asked for."""

    token_ids: torch.Tensor  # [n] int64
    logprobs: torch.Tensor | None  # [n] float32: the sampled token's logprob
    top_token_ids: torch.Tensor | None  # [n, k_max] int64, most likely first
    top_logprobs: torch.Tensor | None  # [n, k_max] float32


@dataclass
class _RowParams:
    """Sampling parameters of the rows at hand, on the logits' device, in canonical dtypes."""

    temperatures: torch.Tensor
    top_ps: torch.Tensor
    top_ks: torch.Tensor
    min_ps: torch.Tensor
    seeds: torch.Tensor
    positions: torch.Tensor

    def select(self, rows: torch.Tensor) -> _RowParams:
        return _RowParams(*(getattr(self, name)[rows] for name in _ROW_FIELDS))


_ROW_FIELDS = ("temperatures", "top_ps", "top_ks", "min_ps", "seeds", "positions")


def sample(logits: torch.Tensor, params: SamplingTensors) -> SamplerOutput:
    """Samples one token per row of ``logits`` [n, vocab] with that row's parameters.
    ``logits`` is left as it was (rows with penalties are changed only while sampling)."""
    logits = logits.float()
    device = logits.device
    row_params = _RowParams(
        temperatures=params.temperatures.to(device, torch.float32),
        top_ps=params.top_ps.to(device, torch.float32),
        top_ks=params.top_ks.to(device, torch.int64),
        min_ps=params.min_ps.to(device, torch.float32),
        seeds=params.seeds.to(device, torch.int64),
        positions=params.positions.to(device, torch.int64),
    )
    with masked(logits, params.masks):
        if params.penalties is None:
            token_ids = _sample_tokens(logits, row_params)
        else:  # the rows with a bias or a penalty processed in place, then restored
            with penalised(logits, params.penalties):
                token_ids = _sample_tokens(logits, row_params)
    if params.num_logprobs is None:
        return SamplerOutput(token_ids, None, None, None)
    return _with_logprobs(logits, token_ids, params.num_logprobs.to(device, torch.int64))


def unpack_masks(data: bytes, num_rows: int, vocab_size: int, device: torch.device
                 ) -> torch.Tensor:
    """runner.proto's packed mask rows -> bool [num_rows, vocab_size], True where allowed."""
    packed = np.frombuffer(data, dtype=np.uint8).reshape(num_rows, -1)
    bits = np.unpackbits(packed, axis=1, bitorder="little")[:, :vocab_size]
    return torch.from_numpy(bits.astype(np.bool_)).to(device)


@contextmanager
def masked(logits: torch.Tensor, masks: TokenMasks | None) -> Iterator[None]:
    """Within the block, the masked rows of ``logits`` hold -inf at every token their mask
    does not allow (before the bias and the penalties, which keep -inf as it is); on leaving,
    those rows get their raw values back, which logprobs are computed from."""
    if masks is None:
        yield
        return
    rows = masks.rows.to(logits.device)
    raw = logits.index_select(0, rows)
    allowed = masks.allowed.to(logits.device)
    # A row that allows nothing is left unmasked rather than sampled from nothing.
    allowed = allowed | ~allowed.any(dim=1, keepdim=True)
    logits.index_copy_(0, rows, raw.masked_fill(~allowed, _NEG_INF))
    try:
        yield
    finally:
        logits.index_copy_(0, rows, raw)


def _sample_tokens(logits: torch.Tensor, params: _RowParams) -> torch.Tensor:
    greedy = params.temperatures <= 0
    if bool(greedy.all()):
        return greedy_tokens(logits)
    if not bool(greedy.any()):
        return _sample_random(logits, params)
    token_ids = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    greedy_rows = greedy.nonzero().squeeze(1)
    random_rows = (~greedy).nonzero().squeeze(1)
    token_ids[greedy_rows] = greedy_tokens(logits.index_select(0, greedy_rows))
    token_ids[random_rows] = _sample_random(
        logits.index_select(0, random_rows), params.select(random_rows)
    )
    return token_ids


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``torch.argmax`` per row (first index among ties), with NaN counted as ``-inf``."""
    token_ids = first_argmax(logits)
    picked = logits.gather(1, token_ids[:, None]).squeeze(1)
    broken = torch.isnan(picked) | (picked == _NEG_INF)
    if bool(broken.any()):
        # torch.argmax returns the first NaN; redo those rows with NaN as -inf. A row of only
        # -inf (or NaN) then yields token 0.
        rows = broken.nonzero().squeeze(1)
        logger.warning("sampler: %d row(s) with NaN or no finite logit", rows.numel())
        token_ids[rows] = first_argmax(_finite_or_neg_inf_(logits[rows]))
    return token_ids


def first_argmax(values: torch.Tensor, largest: bool = True) -> torch.Tensor:
    """Same result as ``values.argmax(-1)`` (``argmin`` when not ``largest``) for a 2-D tensor,
    ties and NaN included, faster on CPU: the extreme over blocks, the first block holding the
    row's extreme, then an argmax inside that block only."""
    vocab = values.shape[1]
    arg_extreme = torch.argmax if largest else torch.argmin
    if vocab <= 2 * _ARGMAX_BLOCK or values.device.type != "cpu":
        return arg_extreme(values, dim=-1)
    reduce = torch.amax if largest else torch.amin
    whole = (vocab // _ARGMAX_BLOCK) * _ARGMAX_BLOCK
    blocks = values[:, :whole].unflatten(1, (whole // _ARGMAX_BLOCK, _ARGMAX_BLOCK))
    block_extreme = reduce(blocks, dim=-1)
    if whole < vocab:
        tail = reduce(values[:, whole:], dim=-1, keepdim=True)
        block_extreme = torch.cat([block_extreme, tail], dim=1)
    best_block = arg_extreme(block_extreme, dim=-1)
    # The last block may be partial: clamping repeats the last id, after the real ones, so the
    # first extreme inside the block still maps to the lowest token id.
    offsets = torch.arange(_ARGMAX_BLOCK, device=values.device)
    ids = (best_block[:, None] * _ARGMAX_BLOCK + offsets).clamp_(max=vocab - 1)
    inside = arg_extreme(values.gather(1, ids), dim=-1, keepdim=True)
    return ids.gather(1, inside).squeeze(1)


def _finite_or_neg_inf_(values: torch.Tensor) -> torch.Tensor:
    """In place: NaN becomes -inf, +inf the largest float (so that ``x - max`` is defined)."""
    return values.nan_to_num_(nan=_NEG_INF, posinf=torch.finfo(values.dtype).max, neginf=_NEG_INF)


def _sample_random(logits: torch.Tensor, params: _RowParams) -> torch.Tensor:
    """Temperature, filters and the exponential race for rows with temperature > 0."""
    scaled = logits / params.temperatures[:, None]
    vocab = scaled.shape[1]
    row_max = scaled.amax(-1)  # NaN if the row holds one
    broken = ~torch.isfinite(row_max)
    if bool(broken.any()):  # rare: clean just those rows
        rows = broken.nonzero().squeeze(1)
        scaled[rows] = _finite_or_neg_inf_(scaled[rows])
        row_max[rows] = scaled[rows].amax(-1)
    dead = row_max == _NEG_INF  # nothing finite left: token 0
    if bool(dead.any()):
        logger.warning("sampler: %d row(s) with NaN or no finite logit", int(dead.sum()))
    # log(0) = -inf: min_p = 0 keeps everything; above 1 would drop even the top token.
    log_min_ps = torch.log(params.min_ps.clamp(max=1.0))
    key_lo, key_hi = row_keys(params.seeds, params.positions)
    top_k_on = (params.top_ks > 0) & (params.top_ks < vocab)
    # Min-p keeps at most 1 / min_p tokens: a window is cheaper than a masked full pass.
    windowed = (top_k_on | (params.top_ps < 1) | (params.min_ps > 0)) & ~dead
    whole_vocab = ~windowed & ~dead
    # The common cases, every row on one path, need no row copies.
    if bool(whole_vocab.all()):
        return _race_whole_vocab_(scaled, row_max, key_lo, key_hi)
    if bool(windowed.all()):
        return _sample_windowed(scaled, params, row_max + log_min_ps, key_lo, key_hi)
    token_ids = torch.zeros(scaled.shape[0], dtype=torch.int64, device=scaled.device)
    rows = windowed.nonzero().squeeze(1)
    if rows.numel():  # before the whole-vocabulary race, which overwrites its input
        token_ids[rows] = _sample_windowed(
            scaled.index_select(0, rows),
            params.select(rows),
            row_max[rows] + log_min_ps[rows],
            key_lo[rows],
            key_hi[rows],
        )
    rows = whole_vocab.nonzero().squeeze(1)
    if rows.numel():
        token_ids[rows] = _race_whole_vocab_(
            scaled.index_select(0, rows), row_max[rows], key_lo[rows], key_hi[rows]
        )
    return token_ids


def _race_whole_vocab_(
    scaled: torch.Tensor, row_max: torch.Tensor, key_lo: torch.Tensor, key_hi: torch.Tensor
) -> torch.Tensor:
    """Two-stage exponential race over the whole vocabulary; overwrites ``scaled``. A block of
    ``_RACE_BLOCK`` token ids wins a race among blocks weighted by their probability mass, then
    a token wins a race inside that block: exactly p_i overall, while hashing only
    vocab / _RACE_BLOCK + _RACE_BLOCK counters a row instead of vocab."""
    # What _exp_ leaves of -inf is 1.6e-38: it can never win (see _exp_), so no mask pass.
    weights = _exp_(scaled.sub_(row_max[:, None]))  # p_i / p_max
    vocab = weights.shape[1]
    num_blocks = -(-vocab // _RACE_BLOCK)
    block_ids = torch.arange(num_blocks, device=weights.device)
    block = _race(_block_sums(weights), key_lo, key_hi, _block_counter(block_ids)[None, :])
    offsets = torch.arange(_RACE_BLOCK, device=weights.device)
    ids = block[:, None] * _RACE_BLOCK + offsets
    inside = ids < vocab  # the last block may be partial
    ids = torch.where(inside, ids, 0)
    block_weights = weights.gather(1, ids).masked_fill_(~inside, 0.0)
    return ids.gather(1, _race(block_weights, key_lo, key_hi, ids)[:, None]).squeeze(1)


def _exp_(values: torch.Tensor) -> torch.Tensor:
    """In place ``exp``, with arguments below -87 raised to -87 first: torch's CPU exp is
    30-100x slower where float32 underflows, which temperatures below 1 make common. A weight
    (relative to the top token's 1) left at exp(-87) = 1.6e-38 never wins a race: its score is
    at most 1.6e-38 / 6e-8 (the smallest E), the top token's at least 1 / 16.7 (the largest).
    In the two-stage race a block of only such weights cannot win, and a block that wins has
    mass >= 6e-8 / 16.7, so holds a token that outscores them. -inf logits are never drawn."""
    return values.clamp_(min=_EXP_FLOOR).exp_()


def _log_sum_exp(values: torch.Tensor) -> torch.Tensor:
    """``torch.logsumexp(values, -1)`` for 2-D ``values``, without exp's slow underflow path;
    NaN stays NaN, a row of -inf gives NaN."""
    row_max = values.amax(-1)
    return row_max + _exp_(values - row_max[:, None]).sum(-1).log_()


def _block_sums(weights: torch.Tensor) -> torch.Tensor:
    """Sum of ``weights`` over each block of ``_RACE_BLOCK`` columns (the last may be partial)."""
    vocab = weights.shape[1]
    whole = (vocab // _RACE_BLOCK) * _RACE_BLOCK
    sums = weights[:, :whole].unflatten(1, (whole // _RACE_BLOCK, _RACE_BLOCK)).sum(-1)
    if whole < vocab:
        sums = torch.cat([sums, weights[:, whole:].sum(-1, keepdim=True)], dim=1)
    return sums


def _block_counter(block_ids: torch.Tensor) -> torch.Tensor:
    """Hash counters for blocks: -1, -2, ... (2**32 - 1, ... mod 2**32), never a token id."""
    return -1 - block_ids


def _race(
    weights: torch.Tensor, key_lo: torch.Tensor, key_hi: torch.Tensor, counters: torch.Tensor
) -> torch.Tensor:
    """Column index of the winner of ``argmax weights / Exp(1)`` per row, the noise hashed from
    the row key and ``counters``; ties go to the first column."""
    scores = weights.div(log_uniforms(key_lo, key_hi, counters))  # -w / E: lowest wins
    return first_argmax(scores, largest=False)


def _sample_windowed(
    scaled: torch.Tensor,
    params: _RowParams,
    min_p_threshold: torch.Tensor,
    key_lo: torch.Tensor,
    key_hi: torch.Tensor,
) -> torch.Tensor:
    """Top-k / top-p / min-p rows: find each row's threshold inside a window of its largest logits,
    widening the window for rows where kept tokens might lie outside it, then race there.
    Rows still open when the window would pass a quarter of the vocabulary get a full sort
    (~1 ms a row on this CPU with NumPy's; bisection on the cut measured slower)."""
    vocab = scaled.shape[1]
    token_ids = torch.empty(scaled.shape[0], dtype=torch.int64, device=scaled.device)
    top_k_on = (params.top_ks > 0) & (params.top_ks < vocab)
    # Top-p without top-k renormalises over the whole row: its mass relative to the top token.
    row_mass = torch.ones_like(min_p_threshold)
    whole_row = ~top_k_on & (params.top_ps < 1)
    if bool(whole_row.all()):
        row_mass = _relative_mass(scaled)
    elif bool(whole_row.any()):
        rows = whole_row.nonzero().squeeze(1)
        row_mass[rows] = _relative_mass(scaled[rows])
    pending = torch.arange(scaled.shape[0], device=scaled.device)
    pending_all = True  # rows still without a threshold are all rows: no copy needed
    largest_k = int(torch.where(top_k_on, params.top_ks, 0).max())
    width = min(max(_MIN_WINDOW, largest_k + 1), vocab)
    while pending.numel():
        if width * 4 >= vocab:  # past a quarter of the vocabulary: one full sort
            width = vocab
        values, ids = top_window(scaled if pending_all else scaled[pending], width)
        threshold = _window_threshold(
            values,
            params.top_ks[pending],
            top_k_on[pending],
            params.top_ps[pending],
            row_mass[pending],
            min_p_threshold[pending],
            complete=width == vocab,
        )
        done = (values[:, -1] < threshold) | (width == vocab)
        if bool(done.all()):  # no row copies
            token_ids[pending] = _race_candidates(
                values, ids, threshold, key_lo[pending], key_hi[pending]
            )
            break
        done_at = done.nonzero().squeeze(1)
        rows = pending[done_at]
        token_ids[rows] = _race_candidates(
            values[done_at], ids[done_at], threshold[done_at], key_lo[rows], key_hi[rows]
        )
        pending = pending[~done]
        pending_all = False
        width *= _WINDOW_GROWTH
    return token_ids


def _relative_mass(scaled: torch.Tensor) -> torch.Tensor:
    """Per row, sum of exp(x - max(x)): the row's mass in units of its top token's."""
    return _exp_(scaled - scaled.amax(-1, keepdim=True)).sum(-1)


def top_window(values: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``values.topk(width)`` as (values, ids), sorted descending. On CPU, small widths first
    keep only the ``width`` blocks with the largest maxima (the ``width`` largest values all
    lie in them), larger ones use NumPy's SIMD partition and sort (3-6x faster than torch's
    CPU topk / sort here). Among tied values the ids chosen may differ from topk's."""
    vocab = values.shape[1]
    whole = (vocab // _WINDOW_BLOCK) * _WINDOW_BLOCK
    num_blocks = whole // _WINDOW_BLOCK
    if values.device.type != "cpu":
        return values.topk(width, dim=-1)
    if width * 4 > num_blocks:
        return _top_window_numpy(values, width)
    block_max = values[:, :whole].unflatten(1, (num_blocks, _WINDOW_BLOCK)).amax(-1)
    top_blocks = block_max.topk(width, dim=-1).indices
    offsets = torch.arange(_WINDOW_BLOCK, device=values.device)
    ids = (top_blocks[:, :, None] * _WINDOW_BLOCK + offsets).flatten(1)
    if whole < vocab:  # the partial last block is always a candidate
        tail = torch.arange(whole, vocab, device=values.device).expand(values.shape[0], -1)
        ids = torch.cat([ids, tail], dim=1)
    top_values, at = values.gather(1, ids).topk(width, dim=-1)
    return top_values, ids.gather(1, at)


def _top_window_numpy(values: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    negated = np.negative(values.detach().numpy())  # ascending -x is descending x
    if width < negated.shape[1]:
        ids = np.argpartition(negated, width - 1, axis=-1)[:, :width]
        ids = np.take_along_axis(ids, np.argsort(np.take_along_axis(negated, ids, -1), -1), -1)
    else:
        ids = np.argsort(negated, axis=-1)
    top_ids = torch.from_numpy(ids)
    return values.gather(1, top_ids), top_ids


def _window_threshold(
    values: torch.Tensor,
    top_ks: torch.Tensor,
    top_k_on: torch.Tensor,
    top_ps: torch.Tensor,
    row_mass: torch.Tensor,
    min_p_threshold: torch.Tensor,
    complete: bool,
) -> torch.Tensor:
    """The lowest kept scaled logit per row, from the row's ``values`` sorted descending.
    Exact when every token at or above it lies in the window (the caller checks that). Masses
    are relative to the top token and summed by cumsum, a sequential scan, so the answer does
    not depend on the window's width (nor, through it, on the rest of the batch)."""
    width = values.shape[1]
    k_index = (top_ks - 1).clamp(0, width - 1)
    top_k_threshold = torch.where(top_k_on, values.gather(1, k_index[:, None]).squeeze(1), _NEG_INF)
    weights = _exp_(values - values[:, :1])
    kept_by_k = values >= top_k_threshold[:, None]
    weights.masked_fill_(~kept_by_k, 0.0)
    mass_through = weights.cumsum(-1)
    mass_before = torch.cat([torch.zeros_like(mass_through[:, :1]), mass_through[:, :-1]], 1)
    # Top-p renormalises over what top-k kept; all of it is in the window when it matters.
    total = torch.where(top_k_on, mass_through[:, -1], row_mass)
    num_kept = (mass_before < (top_ps * total)[:, None]).sum(-1)
    # The cut is known when the window holds a token that top-p drops (or holds everything).
    cut_known = (num_kept < width) | complete
    top_p_index = (num_kept - 1).clamp(0, width - 1)
    top_p_threshold = torch.where(
        (top_ps < 1) & cut_known, values.gather(1, top_p_index[:, None]).squeeze(1), _NEG_INF
    )
    return torch.maximum(torch.maximum(top_k_threshold, top_p_threshold), min_p_threshold)


def _race_candidates(
    values: torch.Tensor,
    ids: torch.Tensor,
    threshold: torch.Tensor,
    key_lo: torch.Tensor,
    key_hi: torch.Tensor,
) -> torch.Tensor:
    """Exponential race among window tokens at or above ``threshold``; exact ties of the score
    go to the lowest token id, as in the whole-vocabulary race."""
    weights = _exp_(values - values[:, :1])
    weights.masked_fill_(values < threshold[:, None], 0.0)
    scores = weights.div_(log_uniforms(key_lo, key_hi, ids))  # -p_i / E_i: lowest wins
    best = scores.amin(-1, keepdim=True)
    no_id = torch.iinfo(torch.int64).max
    return torch.where(scores == best, ids, no_id).amin(-1)


def _with_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: torch.Tensor
) -> SamplerOutput:
    """Logprobs of the raw logits: the sampled token's and the ``max(num_logprobs)`` best.
    ``x - logsumexp(x)`` is log_softmax without materialising it for the whole vocabulary."""
    log_norm = _log_sum_exp(logits)[:, None]
    sampled = (logits.gather(1, token_ids[:, None]) - log_norm).squeeze(1)
    k_max = min(int(num_logprobs.max()), logits.shape[1]) if num_logprobs.numel() else 0
    if k_max == 0:
        empty = logits.new_empty(logits.shape[0], 0)
        return SamplerOutput(token_ids, sampled, empty.long(), empty)
    top_values, top_token_ids = top_window(logits, k_max)
    return SamplerOutput(token_ids, sampled, top_token_ids, top_values - log_norm)


# ---- counter-based random numbers -----------------------------------------------------------


def _signed(value: int, bits: int) -> int:
    """The two's-complement reading of an unsigned ``bits``-bit constant."""
    return value - (1 << bits) if value >= 1 << (bits - 1) else value


def _shift_right_logical(values: torch.Tensor, shift: int, bits: int) -> torch.Tensor:
    # torch's >> is arithmetic on signed integers; the mask clears the copied sign bits.
    return (values >> shift) & ((1 << (bits - shift)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 tensors (wrap-around multiplication is mod 2**64)."""
    z = (z ^ _shift_right_logical(z, 30, 64)) * _signed(_MIX64_M1, 64)
    z = (z ^ _shift_right_logical(z, 27, 64)) * _signed(_MIX64_M2, 64)
    return z ^ _shift_right_logical(z, 31, 64)


def _low32_as_int32(values: torch.Tensor) -> torch.Tensor:
    """Bits 0-31 of int64 ``values`` as int32 (explicit wrap: out-of-range casts are not)."""
    low = values & 0xFFFFFFFF
    return (low - ((low >> 31) << 32)).to(torch.int32)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two 32-bit halves of each row's key, [n, 1] int32 each (see the module docstring)."""
    golden = _signed(_GOLDEN64, 64)
    stream = _mix64(seeds.to(torch.int64) + golden)
    key = _mix64(stream + (positions.to(torch.int64) + 1) * golden)
    low = _low32_as_int32(key)
    high = _low32_as_int32(_shift_right_logical(key, 32, 64))
    return low[:, None], high[:, None]


def hash_bits(key_lo: torch.Tensor, key_hi: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """The 23 random bits for each (row key, token id), int32, broadcast to ``token_ids``."""
    x = (token_ids.to(torch.int32) * _signed(_GOLDEN32, 32)) + key_lo
    scratch = torch.empty_like(x)
    _xor_shift_right_(x, 16, scratch)
    x.mul_(_HASH32_M1)
    _xor_shift_right_(x, 15, scratch)
    x.add_(key_hi).mul_(_signed(_HASH32_M2, 32))
    _xor_shift_right_(x, 15, scratch)
    torch.bitwise_right_shift(x, 32 - _UNIFORM_BITS, out=scratch)
    return scratch.bitwise_and_((1 << _UNIFORM_BITS) - 1)


def uniforms(key_lo: torch.Tensor, key_hi: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """U = (bits + 0.5) / 2**23 in (0, 1), float32 (exact)."""
    bits = hash_bits(key_lo, key_hi, token_ids)
    return bits.to(torch.float32).add_(0.5).mul_(2.0**-_UNIFORM_BITS)


def log_uniforms(
    key_lo: torch.Tensor, key_hi: torch.Tensor, token_ids: torch.Tensor
) -> torch.Tensor:
    """log(U) < 0. (Not log(bits + 0.5) - 23 log 2, which rounds to 0 for U near 1.)"""
    return uniforms(key_lo, key_hi, token_ids).log_()


def _xor_shift_right_(x: torch.Tensor, shift: int, scratch: torch.Tensor) -> None:
    """``x ^= x >> shift`` (logical, 32-bit) in place, using ``scratch`` for the shifted copy."""
    torch.bitwise_right_shift(x, shift, out=scratch)
    scratch.bitwise_and_((1 << (32 - shift)) - 1)
    x.bitwise_xor_(scratch)
