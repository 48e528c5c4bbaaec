"""The CPU GEMM dispatch of gpu_runner/layers/linear.py: plain F.linear, MKL-packed weights,
or the panel kernel, chosen by row count. Oracles: float64 matmuls, hand-computed bucket
indices, and transformers' greedy generate for the default model run entirely through MKL-packed
weights, and entirely through the panels."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from gpu_runner import cpu_kernels
from gpu_runner.layers import linear as linear_module
from gpu_runner.layers.embedding import LMHead
from gpu_runner.layers.linear import (
    ALWAYS_MKL_PACKED,
    ALWAYS_PLAIN,
    MIN_GAIN,
    ONEDNN_MAX_ROWS,
    ROW_BUCKETS,
    Gemm,
    GemmPolicy,
    GemmShape,
    Linear,
    MergedLinear,
    PackedWeight,
    PolicyCache,
    candidate_kernels,
    install_linear_backend,
    linear,
    onednn_supported,
    pack_weight,
    packing_supported,
    panel_rows,
    panels_then_plain,
    reorder_for_onednn,
    resolve_linear_backend,
    unmeasured_panel_rows,
)
from gpu_runner.runner import ModelRunner, RunnerOptions
from tests.gpu_runner.conftest import Oracle, runner_driver
from tests.gpu_runner.test_parity import smol_prompts

CPU = torch.device("cpu")
needs_mkl = pytest.mark.skipif(not packing_supported(CPU, torch.float32),
                               reason="this torch has no MKL packed sgemm")
needs_kernels = pytest.mark.skipif(not cpu_kernels.available(),
                                   reason="the C++ CPU kernels cannot be built here")
# Two float32 GEMMs of K <= 1536 with O(1) inputs differ from the float64 result by ~1e-5
# at most; 1e-4 leaves room for either accumulation order, not for a wrong result.
ATOL = 1e-4


def _f64_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                ) -> torch.Tensor:
    out = x.double() @ weight.double().T
    return out if bias is None else out + bias.double()


# ---- the bucket lookup (hand-computed) ----


@pytest.mark.parametrize(("rows", "bucket"), [
    (1, 0), (2, 1), (3, 2), (4, 2), (5, 3), (8, 3), (9, 4), (33, 6), (128, 7), (129, 8),
    (256, 8), (257, 9), (2048, 11),
])
def test_rows_round_up_to_a_power_of_two_bucket(rows: int, bucket: int) -> None:
    policy = GemmPolicy(tuple(Gemm.PANELS if i == bucket else Gemm.PLAIN
                              for i in range(len(ROW_BUCKETS))))
    assert policy.kernel(rows) is Gemm.PANELS
    assert policy.kernel(ROW_BUCKETS[bucket - 1] if bucket else 2**bucket + 1) is Gemm.PLAIN


def test_beyond_the_last_bucket_the_last_kernel_and_plain_for_zero_rows() -> None:
    assert ROW_BUCKETS[-1] == 2048
    policy = GemmPolicy((Gemm.PANELS,) * (len(ROW_BUCKETS) - 1) + (Gemm.MKL_PACKED,))
    assert policy.kernel(1) is policy.kernel(1024) is Gemm.PANELS
    assert policy.kernel(1025) is policy.kernel(2049) is policy.kernel(8192) is Gemm.MKL_PACKED
    assert policy.kernel(0) is Gemm.PLAIN
    assert ALWAYS_MKL_PACKED.kernel(4096) is Gemm.MKL_PACKED


def test_describe_names_the_row_ranges_of_each_kernel() -> None:
    policy = GemmPolicy((Gemm.PANELS,) * 7 + (Gemm.MKL_PACKED,) * 2 + (Gemm.PLAIN,) * 3)
    assert policy.describe() == "rows 1-64: panels, 65-256: mkl-packed, 257-2048: plain"
    assert ALWAYS_PLAIN.describe() == "rows 1-2048: plain"


# ---- numerics: every kernel == float64 within float32 rounding ----


def _layouts(kernel: Gemm, weight: torch.Tensor) -> PackedWeight:
    """`weight` prepared for `kernel` at every row count (skips where it is unavailable)."""
    if kernel is Gemm.MKL_PACKED and not packing_supported(CPU, torch.float32):
        pytest.skip("this torch has no MKL packed sgemm")
    if kernel is Gemm.PANELS and not cpu_kernels.available():
        pytest.skip("the C++ CPU kernels cannot be built here")
    return PackedWeight(
        pack_weight(weight) if kernel is Gemm.MKL_PACKED else None,
        GemmPolicy((kernel,) * len(ROW_BUCKETS)),
        cpu_kernels.pack_panels(weight) if kernel is Gemm.PANELS else None)


KERNELS = [Gemm.MKL_PACKED, Gemm.PANELS]


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.value)
@pytest.mark.parametrize("rows", [*ROW_BUCKETS, 3, 37, 300, 2049])
@pytest.mark.parametrize(("out_features", "in_features", "with_bias"),
                         [(96, 64, False), (64, 160, True), (257, 48, False)])
def test_every_kernel_matches_float64_at_every_bucket(
        kernel: Gemm, rows: int, out_features: int, in_features: int, with_bias: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=generator) / in_features**0.5
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    x = torch.randn(rows, in_features, generator=generator)
    layouts = _layouts(kernel, weight)

    def no_fallback(*_args: object) -> torch.Tensor:
        raise AssertionError(f"{kernel.value} fell back to F.linear")

    expected = _f64_linear(x, weight, bias).float()
    torch.testing.assert_close(F.linear(x, weight, bias), expected, rtol=0, atol=ATOL)
    monkeypatch.setattr(linear_module.F, "linear", no_fallback)
    torch.testing.assert_close(linear(x, weight, bias, layouts), expected, rtol=0, atol=ATOL)


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.value)
def test_every_kernel_accepts_a_3d_input(kernel: Gemm) -> None:
    weight = torch.randn(40, 24)
    x = torch.randn(2, 3, 24)
    out = linear(x, weight, None, _layouts(kernel, weight))
    assert out.shape == (2, 3, 40)
    torch.testing.assert_close(out, _f64_linear(x, weight, None).float(), rtol=0, atol=ATOL)


# ---- choosing the backend ----


def test_auto_is_plain_off_cpu_and_in_float16() -> None:
    assert resolve_linear_backend("auto", torch.device("cuda"), torch.float32) == "plain"
    assert resolve_linear_backend("auto", torch.device("cuda"), torch.bfloat16) == "plain"
    assert resolve_linear_backend("auto", CPU, torch.float16) == "plain"
    assert resolve_linear_backend("plain", CPU, torch.float32) == "plain"


@needs_kernels
def test_auto_in_bf16_on_this_cpu() -> None:
    native = cpu_kernels.bf16_native()
    assert resolve_linear_backend("auto", CPU, torch.bfloat16) == ("auto" if native else "plain")


@pytest.mark.usefixtures("forced_bf16_fallback")
def test_auto_in_bf16_without_bf16_instructions_is_plain() -> None:
    assert resolve_linear_backend("auto", CPU, torch.bfloat16) == "plain"


def test_forced_packed_off_cpu_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="float32 on a CPU"):
        resolve_linear_backend("packed", torch.device("cuda"), torch.float32)
    with pytest.raises(ValueError, match="float32 on a CPU"):
        resolve_linear_backend("packed", CPU, torch.bfloat16)
    with pytest.raises(ValueError, match="unknown linear backend 'fast'"):
        resolve_linear_backend("fast", CPU, torch.float32)


@needs_mkl
def test_auto_on_cpu_float32_stays_auto() -> None:
    assert resolve_linear_backend("auto", CPU, torch.float32) == "auto"


# ---- installing into a model ----


class _TwoLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = MergedLinear(32, [16, 16], bias=True)
        self.second = Linear(32, 32)
        self.third = Linear(32, 32)  # the same shape as `second`: one measurement
        self.head = LMHead(100, 32)
        for parameter in self.parameters():
            parameter.data.normal_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.third(self.second(self.first(x))))


def _projections(model: torch.nn.Module) -> list[Linear]:
    return [m for m in model.modules() if isinstance(m, Linear)]


def test_plain_attaches_nothing_and_equals_f_linear() -> None:
    model = _TwoLayers()
    policies = install_linear_backend(model, "plain")
    assert policies == {}
    assert all(m.packed is None for m in _projections(model))
    x = torch.randn(4, 32)
    expected = F.linear(x, model.first.weight, model.first.bias)
    assert torch.equal(model.first(x), expected)  # the very same kernel: bitwise equal


@needs_mkl
def test_packed_attaches_to_every_projection_including_the_head() -> None:
    model = _TwoLayers()
    x = torch.randn(5, 32)
    with torch.inference_mode():
        expected = model(x)  # nothing installed yet: plain
        install_linear_backend(model, "packed")
        assert all(m.packed is not None and m.packed.policy == ALWAYS_MKL_PACKED
                   for m in _projections(model))
        torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-3)
        install_linear_backend(model, "plain")  # switching back removes the packed copies
    assert all(m.packed is None for m in _projections(model))


@needs_mkl
def test_auto_measures_each_shape_once_and_shares_the_policy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    measured: list[tuple[int, int]] = []
    chosen = GemmPolicy(tuple(Gemm.MKL_PACKED if rows <= 2 else Gemm.PLAIN
                              for rows in ROW_BUCKETS))
    panel_rows_seen: set[range] = set()

    def fake_tune(weight: torch.Tensor, candidates: dict[Gemm, object],
                  panel_rows: range = range(0)) -> GemmPolicy:
        measured.append(tuple(weight.shape))  # type: ignore[arg-type]
        panel_rows_seen.add(panel_rows)
        assert (Gemm.PANELS in candidates) == cpu_kernels.available()
        return chosen

    monkeypatch.setattr(linear_module, "tune_policy", fake_tune)
    cache = PolicyCache()
    model = _TwoLayers()
    policies = install_linear_backend(model, "auto", cache)
    assert sorted(measured) == [(32, 32), (32, 32), (100, 32)]  # (32,32) with and w/o bias
    assert len(policies) == 3
    assert model.second.packed is not None and model.third.packed is not None
    assert model.second.packed.policy is model.third.packed.policy
    assert model.second.packed.packed is not None  # the policy uses MKL's layout...
    assert model.second.packed.panels is None  # ...and not the panels
    install_linear_backend(_TwoLayers(), "auto", cache)  # a second model: all cached
    assert len(measured) == 3
    # With the panel kernel, the other kernels are not measured at the rows it takes.
    assert panel_rows_seen == ({unmeasured_panel_rows()} if cpu_kernels.available()
                               else {range(0)})


@needs_mkl
def test_a_shape_that_never_leaves_plain_keeps_no_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linear_module, "tune_policy", lambda *_args, **_kwargs: ALWAYS_PLAIN)
    model = _TwoLayers()
    install_linear_backend(model, "auto", PolicyCache())
    assert all(m.packed is None for m in _projections(model))


@needs_mkl
def test_real_tuning_returns_one_kernel_per_bucket() -> None:
    weight = torch.randn(64, 32)
    candidates = candidate_kernels(weight, None, None)
    policy = linear_module.tune_policy(weight, candidates, rounds=1)
    assert len(policy.kernels) == len(ROW_BUCKETS)
    assert set(policy.kernels) <= set(candidates)
    shape = GemmShape(64, 32, False, torch.get_num_threads(), False)
    assert shape == GemmShape(64, 32, False, torch.get_num_threads(), False)  # hashable key


needs_onednn = pytest.mark.skipif(not onednn_supported(CPU, torch.float32),
                                  reason="this torch has no oneDNN matmul")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 33, 64])
def test_onednn_kernel_matches_float64_at_exact_and_padded_row_counts(rows: int) -> None:
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(48, 32, generator=generator)
    bias = torch.randn(48, generator=generator)
    policy = GemmPolicy(tuple(Gemm.ONEDNN for _ in ROW_BUCKETS))
    packed = PackedWeight(None, policy, None, reorder_for_onednn(weight))
    x = torch.randn(2, rows, 32, generator=generator)  # leading dims kept
    out = linear(x, weight, bias, packed)
    assert out.shape == (2, rows, 48)
    torch.testing.assert_close(out.double(), _f64_linear(x, weight, bias), rtol=1e-5, atol=ATOL)


@needs_onednn
def test_tuning_offers_onednn_only_up_to_its_rows() -> None:
    timed: dict[Gemm, list[int]] = {Gemm.PLAIN: [], Gemm.ONEDNN: []}

    def recording(kernel: Gemm):  # type: ignore[no-untyped-def]
        return lambda x: timed[kernel].append(x.shape[0])

    weight = torch.randn(16, 16)
    linear_module.tune_policy(weight, {kernel: recording(kernel) for kernel in timed}, rounds=1)
    assert max(timed[Gemm.ONEDNN]) == ONEDNN_MAX_ROWS
    assert max(timed[Gemm.PLAIN]) == ROW_BUCKETS[-1]


def test_tuning_gives_the_panels_their_rows_unmeasured_and_extends_past_the_budget(
        monkeypatch: pytest.MonkeyPatch) -> None:
    timed_rows: list[int] = []

    def fake_best_of(runs, rounds):  # type: ignore[no-untyped-def]
        timed_rows.append(runs[0].args[0].shape[0])  # the x of partial(run, x)
        return [1.0, 0.5]  # the second candidate always wins where measured

    monkeypatch.setattr(linear_module, "best_of_interleaved", fake_best_of)
    monkeypatch.setattr(linear_module, "TUNE_MAX_MACS", 512 * 8 * 4)
    weight = torch.randn(8, 4)
    candidates = {Gemm.PLAIN: lambda x: x, Gemm.MKL_PACKED: lambda x: x}
    policy = linear_module.tune_policy(weight, candidates, panel_rows=range(1, 65))
    # Buckets 1-64 hold rows 1-64 (all the panels'); 128 holds 65-128; over 512 rows the
    # budget is exceeded and the kernel of bucket 512 carries on.
    assert timed_rows == [128, 256, 512]
    assert [policy.kernel(rows) for rows in (1, 64, 65, 512, 513, 2048, 4096)] == [
        Gemm.PANELS, Gemm.PANELS, Gemm.MKL_PACKED, Gemm.MKL_PACKED, Gemm.MKL_PACKED,
        Gemm.MKL_PACKED, Gemm.MKL_PACKED]


@pytest.mark.parametrize(("seconds", "expected"), [
    ({Gemm.PLAIN: 1.0, Gemm.PANELS: 0.5}, Gemm.PANELS),
    ({Gemm.PLAIN: 0.4, Gemm.PANELS: 0.5}, Gemm.PLAIN),
    ({Gemm.PLAIN: 1.0, Gemm.PANELS: 0.5, Gemm.MKL_PACKED: 0.5 * (1 - MIN_GAIN / 2)},
     Gemm.PANELS),
    ({Gemm.PLAIN: 1.0, Gemm.PANELS: 0.5, Gemm.MKL_PACKED: 0.5 * (1 - 2 * MIN_GAIN)},
     Gemm.MKL_PACKED),
    ({Gemm.PLAIN: 0.5, Gemm.MKL_PACKED: 0.9}, Gemm.PLAIN),
])
def test_mkl_packed_must_win_by_min_gain_the_others_by_anything(
        seconds: dict[Gemm, float], expected: Gemm) -> None:
    assert linear_module._fastest(seconds) is expected


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 31, 32, 33, 64, 65, 200])
@pytest.mark.parametrize("shape", [(100, 32), (16, 7), (33, 40), (960, 576)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_panel_kernel_matches_float64(rows: int, shape: tuple[int, int],
                                      with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows * 7 + shape[0])
    weight = torch.randn(*shape, generator=gen)
    bias = torch.randn(shape[0], generator=gen) if with_bias else None
    x = torch.randn(rows, shape[1], generator=gen)
    out = cpu_kernels.panel_linear(x, cpu_kernels.pack_panels(weight), bias, shape[0])
    torch.testing.assert_close(out.double(), _f64_linear(x, weight, bias), rtol=1e-5,
                               atol=1e-4)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 7, 8, 9, 33, 64])
@pytest.mark.parametrize("shape", [(100, 32), (16, 7), (960, 576)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_panel_kernel_rounds_the_float64_product_once(rows: int, shape: tuple[int, int],
                                                           with_bias: bool) -> None:
    # bfloat16 weights, x and bias, multiplied and summed in float32, rounded once: within a
    # bfloat16 rounding (2^-9 relative) of the exact product of the same bfloat16 values.
    gen = torch.Generator().manual_seed(rows * 5 + shape[0])
    weight = torch.randn(*shape, generator=gen).bfloat16()
    bias = torch.randn(shape[0], generator=gen).bfloat16() if with_bias else None
    x = torch.randn(rows, shape[1], generator=gen).bfloat16()
    out = cpu_kernels.panel_linear(x, cpu_kernels.pack_panels(weight), bias, shape[0])
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), _f64_linear(x, weight, bias), rtol=2**-8,
                               atol=1e-3)


@needs_kernels
def test_panel_kernel_keeps_leading_dimensions_and_reads_views() -> None:
    weight = torch.randn(48, 24)
    x = torch.randn(2, 3, 50)[..., 10:34]  # rows of a wider buffer
    out = cpu_kernels.panel_linear(x, cpu_kernels.pack_panels(weight), None, 48)
    assert out.shape == (2, 3, 48)
    torch.testing.assert_close(out.double(), _f64_linear(x, weight, None), rtol=1e-5,
                               atol=1e-4)


@needs_kernels
@pytest.mark.parametrize("call", [
    lambda: cpu_kernels.panel_linear(torch.randn(2, 8), cpu_kernels.pack_panels(
        torch.randn(20, 8)), None, 40),
    lambda: cpu_kernels.panel_linear(torch.randn(2, 9), cpu_kernels.pack_panels(
        torch.randn(20, 8)), None, 20),
    lambda: cpu_kernels.panel_linear(torch.randn(2, 8), cpu_kernels.pack_panels(
        torch.randn(20, 8)), torch.randn(19), 20),
    lambda: cpu_kernels.panel_linear(torch.randn(2, 8).double(), cpu_kernels.pack_panels(
        torch.randn(20, 8)), None, 20),
    lambda: cpu_kernels.pack_panels(torch.randn(20, 8).double()),
], ids=["features", "width", "bias", "float64", "pack-float64"])
def test_panel_kernel_refuses_bad_inputs(call) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(RuntimeError):
        call()


@needs_kernels
@needs_mkl
def test_auto_uses_the_panels_up_to_their_rows_unmeasured(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model = _TwoLayers()
    rows_of_panels = unmeasured_panel_rows()
    if not rows_of_panels:
        pytest.skip("built for AVX2: auto measures every row count")
    install_linear_backend(model, "auto", PolicyCache())
    assert model.first.packed is not None
    assert [model.first.packed.policy.kernel(rows) for rows in rows_of_panels] == (
        [Gemm.PANELS] * len(rows_of_panels))
    calls: list[int] = []
    real = cpu_kernels.panel_linear

    def counting(x, panels, bias, out_features):  # type: ignore[no-untyped-def]
        calls.append(x.shape[0])
        return real(x, panels, bias, out_features)

    monkeypatch.setattr(cpu_kernels, "panel_linear", counting)
    for rows in (rows_of_panels.start, rows_of_panels.stop - 1):
        x = torch.randn(rows, 32)
        torch.testing.assert_close(model.first(x).double(),
                                   _f64_linear(x, model.first.weight, model.first.bias),
                                   rtol=1e-5, atol=1e-4)
    assert calls == [rows_of_panels.start, rows_of_panels.stop - 1]


@needs_kernels
def test_panels_backend_measures_nothing_panels_then_plain(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def no_tuning(*_args: object, **_kwargs: object) -> GemmPolicy:
        raise AssertionError("the panels backend measured a kernel")

    monkeypatch.setattr(linear_module, "tune_policy", no_tuning)
    assert resolve_linear_backend("panels", CPU, torch.float32) == "panels"
    model = _TwoLayers()
    policies = install_linear_backend(model, "panels", PolicyCache())
    policy = panels_then_plain()
    assert set(policies.values()) == {policy}
    for module in _projections(model):
        assert module.packed is not None and module.packed.packed is None  # no MKL copy
        assert module.packed.panels is not None
    last = panel_rows().stop - 1
    assert [policy.kernel(rows) for rows in (1, last, last + 1, 2048)] == [
        Gemm.PANELS, Gemm.PANELS, Gemm.PLAIN, Gemm.PLAIN]
    for rows in (3, 100):  # a panel row count and a plain one
        x = torch.randn(rows, 32)
        torch.testing.assert_close(model.first(x).double(),
                                   _f64_linear(x, model.first.weight, model.first.bias),
                                   rtol=1e-5, atol=1e-4)


def test_panels_backend_is_plain_where_the_panels_cannot_run() -> None:
    assert resolve_linear_backend("panels", torch.device("cuda"), torch.float32) == "plain"
    assert resolve_linear_backend("panels", CPU, torch.float16) == "plain"


# ---- the runner ----


def _runner(folder: Path, backend: str) -> ModelRunner:
    return ModelRunner(RunnerOptions(model=str(folder), block_size=16,
                                     kv_cache_memory=48 << 20, max_model_len=256,
                                     linear_backend=backend))


def test_runner_switch_off_uses_plain(tiny_model_dirs: dict[str, Path]) -> None:
    runner = _runner(tiny_model_dirs["qwen2"], "plain")
    assert runner.linear_backend == "plain" and runner.linear_policies == {}
    assert all(m.packed is None for m in _projections(runner.model))


def test_runner_refuses_an_unknown_backend(tiny_model_dirs: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="unknown linear backend"):
        _runner(tiny_model_dirs["llama"], "fastest")


def _force_kernel(runner: ModelRunner, kernel: Gemm) -> None:
    for module in _projections(runner.model):
        module.packed = _layouts(kernel, module.weight)


@pytest.mark.parametrize("kernel", [Gemm.MKL_PACKED, Gemm.PANELS], ids=lambda k: k.value)
def test_default_model_through_one_kernel_matches_generate(
        kernel: Gemm, default_model_dir: Path, smol_oracle: Oracle) -> None:
    """Every projection on one kernel at every row count (whatever auto would pick on this
    machine): greedy tokens of a mixed batch equal transformers' generate, first-step logits
    within 1e-4."""
    runner = _runner(default_model_dir, "plain")
    _force_kernel(runner, kernel)
    prompts = smol_prompts(default_model_dir)[:5]  # natural text, as in test_parity
    steps = 8
    expected = [smol_oracle.generate(prompt, steps) for prompt in prompts]
    driver = runner_driver(runner)
    seqs = [driver.add(prompt) for prompt in prompts]
    batch, _ = driver.build(seqs)
    logits = runner.forward_logits(batch)
    for row, (_, first_logits) in enumerate(expected):
        torch.testing.assert_close(logits[row], first_logits, rtol=0, atol=1e-4)
    generated = runner_driver(runner).run_staggered(prompts, steps)
    assert [seq.generated for seq in generated] == [tokens for tokens, _ in expected]


# ---- the interleaved rotary layout (float32 models run in it, see layers/rotary.py) ----


def test_interleaved_rotation_equals_rotate_half_reordered() -> None:
    from gpu_runner.layers.rotary import Rotation, interleaving_order

    generator = torch.Generator().manual_seed(7)
    tokens, heads, head_dim = 5, 3, 8
    x = torch.randn(tokens, heads, head_dim, generator=generator)
    angles = torch.rand(tokens, 1, head_dim // 2, generator=generator) * 6.28
    cos, sin = angles.cos(), angles.sin()
    # Oracle: Hugging Face's rotate-half formula in float64.
    x64, cos64, sin64 = x.double(), torch.cat((cos, cos), -1).double(), torch.cat((sin, sin), -1)
    rotated_half = torch.cat((-x64[..., head_dim // 2:], x64[..., : head_dim // 2]), -1)
    expected = x64 * cos64 + rotated_half * sin64.double()
    order = interleaving_order(head_dim)
    assert order.tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    turns = torch.complex(cos, sin)
    interleaved = Rotation(cos=None, sin=None, turns=turns).apply(x[..., order])
    torch.testing.assert_close(interleaved.double(), expected[..., order], rtol=0, atol=1e-6)
    half = Rotation(cos=cos, sin=sin, turns=None).apply(x)
    torch.testing.assert_close(half.double(), expected, rtol=0, atol=1e-6)


# ---- bfloat16 through oneDNN: row counts padded to a few primitives ----


@pytest.mark.parametrize(("rows", "padded"), [
    (1, 1), (16, 16), (17, 32), (32, 32), (33, 48), (256, 256), (257, 320), (2048, 2048),
    (2049, 2112)])
def test_onednn_rows_round_up_to_their_step(rows: int, padded: int) -> None:
    assert linear_module.onednn_rows(rows) == padded


def test_onednn_rows_bound_the_primitives_of_a_shape() -> None:
    assert len({linear_module.onednn_rows(rows) for rows in range(1, 2049)}) == 59


@pytest.mark.parametrize("rows", [3, 17, 40, 300])
def test_bf16_plain_linear_pads_rows_without_changing_them(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=gen).bfloat16()
    bias = torch.randn(96, generator=gen).bfloat16()
    x = torch.randn(2, rows, 40, generator=gen).bfloat16()
    out = linear(x, weight, bias, None)
    assert out.shape == (2, rows, 96) and out.dtype == torch.bfloat16
    # Each output row depends on its own input row only: padding leaves the real rows as an
    # unpadded product makes them (oneDNN's blocking may differ by a rounding).
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=2**-7, atol=2**-7)
