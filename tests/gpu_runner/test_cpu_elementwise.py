"""The fused C++ elementwise kernels against float64 references written from the formulas
(x / sqrt(mean(x^2) + eps) * w; x * sigmoid(x) * up), not against torch's own ops."""

from __future__ import annotations

import pytest
import torch

from gpu_runner import cpu_kernels


@pytest.fixture(scope="module", autouse=True)
def _kernels() -> None:
    if not cpu_kernels.available():
        pytest.skip(f"C++ CPU kernels unavailable: {cpu_kernels.failure_reason()}")


def rms_norm_reference(residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    r = residual.double()
    return r / torch.sqrt((r * r).mean(-1, keepdim=True) + eps) * weight.double()


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.double().chunk(2, dim=-1)
    return gate / (1 + torch.exp(-gate)) * up


@pytest.mark.parametrize("rows", [1, 3, 32, 2048])
@pytest.mark.parametrize("width", [576, 5, 17, 64])
def test_add_rms_norm(rows: int, width: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + width)
    x = torch.randn(rows, width, generator=gen)
    residual = torch.randn(rows, width, generator=gen) * 3
    weight = torch.randn(width, generator=gen)
    expected_residual = residual + x  # float32 addition, rounded once, as in the kernel
    out = cpu_kernels.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(residual, expected_residual)
    torch.testing.assert_close(out.double(), rms_norm_reference(expected_residual, weight, 1e-5),
                               rtol=1e-5, atol=1e-5)


def test_add_rms_norm_on_row_views() -> None:
    # Rows of a wider buffer (row stride != width), as a slice of a fused projection would be.
    wide = torch.randn(6, 40)
    x, residual = wide[:, :16], torch.randn(6, 24)[:, 4:20]
    expected_residual = residual + x
    weight = torch.rand(16) + 0.5
    out = cpu_kernels.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(residual, expected_residual)
    torch.testing.assert_close(out.double(), rms_norm_reference(expected_residual, weight, 1e-6),
                               rtol=1e-5, atol=1e-5)


def test_add_rms_norm_of_zeros_is_zero() -> None:
    x, residual = torch.zeros(2, 32), torch.zeros(2, 32)
    assert torch.equal(cpu_kernels.add_rms_norm(x, residual, torch.ones(32), 1e-5),
                       torch.zeros(2, 32))


@pytest.mark.parametrize("rows", [1, 7, 2048])
@pytest.mark.parametrize("width", [1536, 9, 16])
def test_silu_and_mul(rows: int, width: int) -> None:
    gen = torch.Generator().manual_seed(rows + width)
    gate_up = torch.randn(rows, 2 * width, generator=gen) * 4
    out = cpu_kernels.silu_and_mul(gate_up)
    assert out.shape == (rows, width)
    torch.testing.assert_close(out.double(), silu_and_mul_reference(gate_up), rtol=1e-5,
                               atol=1e-6)


def test_silu_at_extremes() -> None:
    gate = torch.tensor([[0.0, -0.0, 1e-30, -1e-30, 20.0, -20.0, 88.0, -88.0, 100.0, -100.0,
                          1e4, -1e4, 3e38, -3e38, 0.5, -0.5]])
    out = cpu_kernels.silu_and_mul(torch.cat((gate, torch.ones_like(gate)), dim=1))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), silu_and_mul_reference(
        torch.cat((gate, torch.ones_like(gate)), dim=1)), rtol=1e-5, atol=1e-30)


@pytest.mark.parametrize("call", [
    lambda: cpu_kernels.add_rms_norm(torch.zeros(2, 4).double(), torch.zeros(2, 4).double(),
                                     torch.ones(4).double(), 1e-5),
    lambda: cpu_kernels.add_rms_norm(torch.zeros(2, 4), torch.zeros(3, 4), torch.ones(4), 1e-5),
    lambda: cpu_kernels.add_rms_norm(torch.zeros(2, 4), torch.zeros(2, 4), torch.ones(5), 1e-5),
    lambda: cpu_kernels.add_rms_norm(torch.zeros(2, 2, 4), torch.zeros(2, 2, 4), torch.ones(4),
                                     1e-5),
    lambda: cpu_kernels.add_rms_norm(torch.zeros(4, 2).t(), torch.zeros(2, 4), torch.ones(4),
                                     1e-5),
    lambda: cpu_kernels.silu_and_mul(torch.zeros(2, 5)),
    lambda: cpu_kernels.silu_and_mul(torch.zeros(2, 4).half()),
    lambda: cpu_kernels.add_rms_norm(torch.zeros(2, 4).bfloat16(), torch.zeros(2, 4),
                                     torch.ones(4), 1e-5),
], ids=["float64", "rows", "weight", "3-D", "column-major", "odd-width", "float16",
        "mixed-dtypes"])
def test_bad_inputs_are_refused(call) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(RuntimeError):
        call()


# ---- bfloat16: against Hugging Face's own modules run in bfloat16 (the parity oracle) ----


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bfloat16 steps between two bfloat16 tensors of one sign pattern."""
    bits = [t.view(torch.int16).int() for t in (a, b)]
    return (bits[0] - bits[1]).abs()


@pytest.mark.parametrize("rows", [1, 3, 2048])
@pytest.mark.parametrize("width", [576, 17])
def test_bf16_add_rms_norm_is_hugging_face_arithmetic(rows: int, width: int) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(rows + width)
    x = torch.randn(rows, width, generator=gen).bfloat16()
    residual = (torch.randn(rows, width, generator=gen) * 3).bfloat16()
    norm = LlamaRMSNorm(width, eps=1e-5).to(torch.bfloat16)
    norm.weight.data = (torch.rand(width, generator=gen) + 0.5).bfloat16()
    expected_residual = residual + x  # bfloat16 addition, as the decoder layer adds
    with torch.no_grad():
        expected = norm(expected_residual)
    out = cpu_kernels.add_rms_norm(x, residual, norm.weight.data, 1e-5)
    assert out.dtype == torch.bfloat16
    assert torch.equal(residual, expected_residual)
    # The sum of squares runs in another order than torch's mean: a value on a rounding
    # boundary may land one bfloat16 step away; nearly all are equal.
    steps = _bf16_ulps(out, expected)
    assert int(steps.max()) <= 1
    assert float((steps == 0).float().mean()) > 0.99


@pytest.mark.parametrize("rows", [1, 7, 2048])
def test_bf16_silu_and_mul_is_hugging_face_arithmetic(rows: int) -> None:
    from transformers.activations import ACT2FN

    gen = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * 1536, generator=gen) * 4).bfloat16()
    gate, up = gate_up.chunk(2, dim=-1)
    expected = ACT2FN["silu"](gate) * up  # Llama's MLP in bfloat16
    out = cpu_kernels.silu_and_mul(gate_up)
    assert out.dtype == torch.bfloat16
    steps = _bf16_ulps(out, expected)
    assert int(steps.max()) <= 1  # exp's polynomial vs torch's: a boundary case may differ
    assert float((steps == 0).float().mean()) > 0.99


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("tokens", [1, 5, 300])
@pytest.mark.parametrize("dim", [64, 40])  # 40: vector steps and a scalar tail
def test_rotate_half_is_hugging_face_arithmetic(dtype: torch.dtype, tokens: int,
                                                dim: int) -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(tokens)
    heads, kv_heads = 9, 3
    # q and k side by side in a fused projection's output, as the decoder passes them.
    fused = torch.randn(tokens, heads + 2 * kv_heads, dim, generator=gen).to(dtype)
    angles = torch.rand(tokens, dim // 2, generator=gen) * 100
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    qk = fused[:, : heads + kv_heads]
    out = cpu_kernels.rotate_half(qk, cos, sin)
    assert out.is_contiguous() and out.dtype == dtype
    # transformers' layout: [batch, heads, tokens, dim] with full-width cos/sin.
    full_cos, full_sin = torch.cat((cos, cos), -1)[None], torch.cat((sin, sin), -1)[None]
    q, k = (part.transpose(0, 1)[None] for part in (qk[:, :heads], qk[:, heads:]))
    expected_q, expected_k = apply_rotary_pos_emb(q, k, full_cos, full_sin)
    assert torch.equal(out[:, :heads], expected_q[0].transpose(0, 1))
    assert torch.equal(out[:, heads:], expected_k[0].transpose(0, 1))
