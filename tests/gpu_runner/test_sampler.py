"""Sampler tests on fixed logits. Expected values come from outside the sampler: torch.argmax /
log_softmax / topk, published SplitMix64 outputs, a pure-Python rendering of the documented
hash, and distributions computed here from the definitions of temperature, top-k, top-p and
min-p, checked with a chi-square test (fixed seeds, so every run draws the same tokens)."""

from __future__ import annotations

import math

import pytest
import torch

from gpu_runner.sampler import (
    SamplingTensors,
    first_argmax,
    row_keys,
    sample,
    top_window,
    uniforms,
)

NUM_DRAWS = 20_000  # positions 0..NUM_DRAWS-1 serve as independent draws
STAT_VOCAB = 300  # > 2 race blocks of 128, the last one partial


def make_params(
    n: int,
    temperature: float | list[float] = 0.0,
    top_p: float | list[float] = 1.0,
    top_k: int | list[int] = 0,
    min_p: float | list[float] = 0.0,
    seeds: int | list[int] = 0,
    positions: list[int] | torch.Tensor | None = None,
    num_logprobs: list[int] | None = None,
) -> SamplingTensors:
    def column(value: float | list, dtype: torch.dtype) -> torch.Tensor:
        if isinstance(value, list):
            return torch.tensor(value, dtype=dtype)
        return torch.full((n,), value, dtype=dtype)

    return SamplingTensors(
        temperatures=column(temperature, torch.float32),
        top_ps=column(top_p, torch.float32),
        top_ks=column(top_k, torch.int64),
        min_ps=column(min_p, torch.float32),
        seeds=column(seeds, torch.int64),
        positions=torch.arange(n) if positions is None else torch.as_tensor(positions),
        num_logprobs=None if num_logprobs is None else torch.tensor(num_logprobs),
    )


def fixed_logits(rows: int, vocab: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


# ---- greedy ---------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [100, 1000, 3001, 49152])
def test_greedy_is_torch_argmax_with_ties_to_lowest_index(vocab: int) -> None:
    logits = fixed_logits(6, vocab, seed=1)
    top = logits.max() + 1
    logits[0, [vocab - 1, 3, vocab // 2]] = top  # tie across blocks: lowest wins
    logits[1, [vocab - 2, vocab - 1]] = top  # tie inside the (partial) last block
    logits[2, :] = 0.5  # all tied
    logits[3, 0] = top
    logits[4, vocab - 1] = top
    result = sample(logits, make_params(6)).token_ids
    assert result.dtype == torch.int64
    assert result.tolist()[:5] == [3, vocab - 2, 0, 0, vocab - 1]
    assert torch.equal(result, logits.argmax(-1))


def test_first_argmax_matches_torch_argmax_and_argmin() -> None:
    # Small integers make ties frequent.
    values = torch.randint(0, 5, (50, 3001), generator=torch.Generator().manual_seed(2)).float()
    assert torch.equal(first_argmax(values), values.argmax(-1))
    assert torch.equal(first_argmax(values, largest=False), values.argmin(-1))


def test_non_finite_rows_do_not_crash_and_never_pick_nan() -> None:
    vocab = 1000
    logits = fixed_logits(8, vocab, seed=3)
    logits[0] = float("-inf")
    logits[1] = float("nan")
    logits[2, :500] = float("nan")  # the finite half decides
    logits[3] = float("-inf")
    logits[4] = float("nan")
    logits[5, ::2] = float("nan")
    logits[6, 7] = float("inf")
    greedy = sample(logits, make_params(8)).token_ids
    assert greedy[:2].tolist() == [0, 0]
    assert greedy[2].item() == 500 + logits[2, 500:].argmax().item()
    assert greedy[6].item() == 7
    sampled = sample(
        logits,
        make_params(
            8,
            temperature=1.0,
            top_p=[1, 1, 1, 0.9, 0.9, 0.9, 1, 1],
            top_k=[0, 0, 0, 5, 0, 0, 0, 0],
            seeds=4,
        ),
    ).token_ids
    assert sampled[[0, 1, 3, 4]].tolist() == [0, 0, 0, 0]
    assert sampled[2].item() >= 500
    assert sampled[5].item() % 2 == 1
    assert sampled[6].item() == 7
    with_logprobs = sample(logits, make_params(8, num_logprobs=[2] * 8))
    assert torch.isnan(with_logprobs.logprobs[1])  # the fault stays visible


def test_logits_are_left_untouched() -> None:
    logits = fixed_logits(4, 1000, seed=13)
    logits[1, 5] = float("nan")
    before = logits.clone()
    params = make_params(4, temperature=[0.0, 0.8, 1.0, 1.0], top_k=[0, 0, 5, 0], min_p=0.1)
    params.num_logprobs = torch.tensor([1, 1, 1, 1])
    sample(logits, params)
    assert torch.equal(logits.isnan(), before.isnan())
    assert torch.equal(logits.nan_to_num(0.0), before.nan_to_num(0.0))


def test_empty_batch() -> None:
    out = sample(torch.empty(0, 50), make_params(0, temperature=1.0, num_logprobs=[]))
    assert out.token_ids.shape == (0,)
    assert out.top_token_ids is not None and out.top_token_ids.shape == (0, 0)


# ---- the counter-based random numbers --------------------------------------------------------

MASK64 = (1 << 64) - 1
MASK32 = (1 << 32) - 1
GOLDEN64 = 0x9E3779B97F4A7C15


def reference_mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def reference_uniform(seed: int, position: int, token_id: int) -> float:
    """The module docstring's definition, in Python integers."""
    stream = reference_mix64((seed + GOLDEN64) & MASK64)
    key = reference_mix64((stream + (position + 1) * GOLDEN64) & MASK64)
    low, high = key & MASK32, key >> 32
    x = (token_id * 0x9E3779B9 + low) & MASK32
    x ^= x >> 16
    x = (x * 0x21F0AAAD) & MASK32
    x ^= x >> 15
    x = (((x + high) & MASK32) * 0x735A2D97) & MASK32
    x ^= x >> 15
    return ((x >> 9) + 0.5) / 2**23


def test_reference_mix64_is_splitmix64() -> None:
    # Published first outputs of SplitMix64 seeded with 0.
    outputs = [reference_mix64((i * GOLDEN64) & MASK64) for i in (1, 2, 3)]
    assert outputs == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]


def test_uniforms_follow_the_documented_hash() -> None:
    seeds = [0, 1, 42, 2**63 - 1, 2**64 - 1, 2**63, 123456789012345]
    positions = [0, 1, 7, 4095, 131071, 10**9, 3]
    token_ids = torch.tensor([0, 1, 2, 127, 128, 300, 49151, 151935, 2**31 - 1])
    signed = [s - 2**64 if s >= 2**63 else s for s in seeds]  # how uint64 seeds arrive
    key_lo, key_hi = row_keys(torch.tensor(signed), torch.tensor(positions))
    got = uniforms(key_lo, key_hi, token_ids[None, :].expand(len(seeds), -1))
    expected = torch.tensor(
        [
            [reference_uniform(s, p, int(t)) for t in token_ids]
            for s, p in zip(seeds, positions, strict=True)
        ]
    )
    assert torch.equal(got, expected)
    assert float(got.min()) > 0 and float(got.max()) < 1


# ---- reproducibility -------------------------------------------------------------------------

ROW_SETTINGS = [  # (temperature, top_p, top_k, min_p): one row per code path
    (0.0, 1.0, 0, 0.0),
    (1.0, 1.0, 0, 0.0),
    (0.7, 1.0, 0, 0.1),
    (1.0, 1.0, 5, 0.0),
    (1.2, 0.8, 0, 0.0),
    (0.9, 0.9, 40, 0.05),
    (1.0, 1.0, 3000, 0.0),  # a wide window for every row batched with it
    (1.5, 0.999, 0, 0.0),  # needs most of the vocabulary
]


def settings_params(
    settings: list[tuple[float, float, int, float]], seeds: list[int], positions: list[int]
) -> SamplingTensors:
    return make_params(
        len(settings),
        temperature=[s[0] for s in settings],
        top_p=[s[1] for s in settings],
        top_k=[s[2] for s in settings],
        min_p=[s[3] for s in settings],
        seeds=seeds,
        positions=positions,
    )


def test_a_seed_reproduces_and_seeds_differ() -> None:
    logits = fixed_logits(1, 4000, seed=5, scale=1.0).expand(64, -1)
    params = make_params(64, temperature=1.0, seeds=list(range(64)), positions=[9] * 64)
    first = sample(logits, params).token_ids
    assert torch.equal(first, sample(logits, params).token_ids)
    assert len(set(first.tolist())) > 40  # 64 seeds over a flat 4000-token distribution
    same_seed = make_params(64, temperature=1.0, seeds=7, positions=[9] * 64)
    assert len(set(sample(logits, same_seed).token_ids.tolist())) == 1


def test_token_depends_on_seed_and_position_not_on_the_batch() -> None:
    vocab = 5000
    logits = fixed_logits(len(ROW_SETTINGS), vocab, seed=6, scale=1.5)
    seeds = [11, 12, 13, 14, 15, 16, 17, 18]
    positions = [5, 100, 7, 0, 12, 99, 3, 64]
    alone = [
        sample(
            logits[i : i + 1], settings_params([ROW_SETTINGS[i]], [seeds[i]], [positions[i]])
        ).token_ids.item()
        for i in range(len(ROW_SETTINGS))
    ]
    batched = sample(logits, settings_params(ROW_SETTINGS, seeds, positions)).token_ids
    assert batched.tolist() == alone
    order = [5, 2, 7, 0, 3, 6, 1, 4]
    shuffled = sample(
        logits[order],
        settings_params(
            [ROW_SETTINGS[i] for i in order],
            [seeds[i] for i in order],
            [positions[i] for i in order],
        ),
    ).token_ids
    assert shuffled.tolist() == [alone[i] for i in order]
    # Twice the rows, the copies with other seeds.
    doubled = sample(
        torch.cat([logits, logits]),
        settings_params(ROW_SETTINGS * 2, seeds + [s + 100 for s in seeds], positions * 2),
    ).token_ids
    assert doubled[: len(alone)].tolist() == alone


# ---- distributions ---------------------------------------------------------------------------


def expected_distribution(
    logits: torch.Tensor,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    slack: float = 0.0,
) -> torch.Tensor:
    """HF's warpers, straight from their definitions, in float64. Without ``slack`` the logits
    must not sit within float32 rounding of a top-p / min-p cut; with it, the cuts move that
    much outwards (a superset of the tokens, for vocabularies too large to avoid the edge)."""
    scaled = logits.double() / temperature
    if top_k:
        kth = scaled.sort(descending=True).values[top_k - 1]
        scaled = scaled.masked_fill(scaled < kth, -math.inf)
    if top_p < 1:
        probs = scaled.softmax(-1)
        order = probs.argsort(descending=True)
        mass_before = probs[order].cumsum(0) - probs[order]
        if not slack:
            assert (mass_before - top_p).abs().min() > 1e-5, "test logits sit on the top-p cut"
        drop = order[mass_before >= top_p + slack]
        scaled[drop] = -math.inf
    if min_p:
        probs = scaled.softmax(-1)
        if not slack:
            assert ((probs / probs.max() - min_p).abs() > 1e-5).all(), "logits on the min-p cut"
        scaled = scaled.masked_fill(probs < (min_p - slack) * probs.max(), -math.inf)
    return scaled.softmax(-1)


def chi_square_critical(degrees: int, z: float = 3.719) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile; z = 3.719 is p = 1e-4."""
    h = 2.0 / (9.0 * degrees)
    return degrees * (1.0 - h + z * math.sqrt(h)) ** 3


def chi_square(observed: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Statistic and degrees of freedom over tokens with probability > 0; tokens expected
    fewer than 5 times are pooled into one bin."""
    expected = probs * observed.sum()
    support = probs > 0
    large = support & (expected >= 5)
    observed_bins = [float(x) for x in observed[large]]
    expected_bins = [float(x) for x in expected[large]]
    pooled = support & ~large
    if bool(pooled.any()):
        observed_bins.append(float(observed[pooled].sum()))
        expected_bins.append(float(expected[pooled].sum()))
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed_bins, expected_bins, strict=True))
    return statistic, len(observed_bins) - 1


def draw_counts(logits: torch.Tensor, seed: int, **settings: float) -> torch.Tensor:
    params = make_params(NUM_DRAWS, seeds=seed, positions=torch.arange(NUM_DRAWS), **settings)
    tokens = sample(logits[None, :].expand(NUM_DRAWS, -1), params).token_ids
    return torch.bincount(tokens, minlength=logits.shape[0])


STAT_CASES = {
    "temperature": dict(temperature=0.8),
    "hot": dict(temperature=2.5),
    "top_k": dict(temperature=1.0, top_k=12),
    "top_p": dict(temperature=1.0, top_p=0.7),
    "min_p": dict(temperature=0.9, min_p=0.08),
    "all": dict(temperature=1.3, top_k=30, top_p=0.85, min_p=0.05),
    "wide_top_p": dict(temperature=2.0, top_p=0.97),  # past the windows: full sort
    "wide_top_k_top_p": dict(temperature=2.0, top_k=200, top_p=0.97),  # one full-width pass
}


@pytest.mark.parametrize("name", list(STAT_CASES))
def test_frequencies_match_the_definition(name: str) -> None:
    settings = STAT_CASES[name]
    logits = fixed_logits(1, STAT_VOCAB, seed=7)[0]
    probs = expected_distribution(logits, **settings)
    counts = draw_counts(logits, seed=1000 + len(name), **settings)
    assert int(counts[probs == 0].sum()) == 0, "a filtered-out token was sampled"
    statistic, degrees = chi_square(counts, probs)
    assert degrees >= 5
    assert statistic < chi_square_critical(degrees), (statistic, degrees)


@pytest.mark.parametrize("top_k", [0, 250])
def test_minus_infinity_is_never_drawn_even_when_hot(top_k: int) -> None:
    logits = fixed_logits(1, STAT_VOCAB, seed=12)[0]
    logits[::3] = float("-inf")
    counts = draw_counts(logits, seed=5, temperature=50.0, top_k=top_k)
    assert int(counts[::3].sum()) == 0
    assert int((counts > 0).sum()) > 150


def test_chi_square_check_rejects_a_slightly_wrong_distribution() -> None:
    # The test above must be able to fail: temperature 0.8 draws against 0.88's distribution.
    logits = fixed_logits(1, STAT_VOCAB, seed=7)[0]
    counts = draw_counts(logits, seed=99, temperature=0.8)
    statistic, degrees = chi_square(counts, expected_distribution(logits, temperature=0.88))
    assert statistic > chi_square_critical(degrees)


def test_filters_on_a_large_vocabulary_never_let_a_dropped_token_through() -> None:
    vocab = 49152
    logits = fixed_logits(1, vocab, seed=8, scale=3.0)[0]
    for settings in (
        dict(temperature=1.0, top_k=20),
        dict(temperature=1.0, top_p=0.6),
        dict(temperature=2.0, top_p=0.5),
        dict(temperature=3.0, top_p=0.7),  # past the windows: full sort
        dict(temperature=0.7, min_p=0.02),
    ):
        # Too many tokens near the cut to avoid it: allow those within 1e-4 of it.
        allowed = expected_distribution(logits, **settings, slack=1e-4) > 0
        assert int(allowed.sum()) > 3, settings
        params = make_params(64, seeds=3, positions=torch.arange(64), **settings)
        tokens = sample(logits[None, :].expand(64, -1), params).token_ids
        assert bool(allowed[tokens].all()), settings
        assert len(set(tokens.tolist())) > 1


# ---- logprobs --------------------------------------------------------------------------------


def test_logprobs_are_log_softmax_of_the_raw_logits() -> None:
    vocab = 49152
    logits = fixed_logits(5, vocab, seed=9, scale=3.0)
    params = make_params(
        5,
        temperature=[0.0, 0.5, 1.0, 2.0, 0.7],
        top_k=[0, 0, 10, 0, 0],
        top_p=[1.0, 0.9, 1.0, 1.0, 1.0],
        seeds=1,
        num_logprobs=[3, 0, 5, 1, 2],
    )
    out = sample(logits, params)
    reference = torch.log_softmax(logits.double(), dim=-1)
    assert out.logprobs is not None and out.top_logprobs is not None
    assert out.top_token_ids is not None
    expected_sampled = reference.gather(1, out.token_ids[:, None]).squeeze(1)
    assert torch.allclose(out.logprobs.double(), expected_sampled, atol=1e-5)
    expected_top = reference.topk(5, dim=-1)
    assert out.top_token_ids.shape == (5, 5) and out.top_logprobs.shape == (5, 5)
    assert torch.equal(out.top_token_ids, expected_top.indices)
    assert torch.allclose(out.top_logprobs.double(), expected_top.values, atol=1e-5)
    assert bool((out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all())


def test_no_logprobs_when_not_asked() -> None:
    out = sample(fixed_logits(2, 100, seed=10), make_params(2, temperature=1.0))
    assert out.logprobs is None and out.top_token_ids is None and out.top_logprobs is None


@pytest.mark.parametrize("width", [1, 5, 64, 200, 5000])
def test_top_window_values_match_topk(width: int) -> None:
    values = torch.randint(0, 50, (20, 5000), generator=torch.Generator().manual_seed(11))
    values = values.float()
    top_values, ids = top_window(values, width)
    assert torch.equal(top_values, values.topk(width, dim=-1).values)
    assert torch.equal(values.gather(1, ids), top_values)
    assert all(len(set(row)) == width for row in ids.tolist())
