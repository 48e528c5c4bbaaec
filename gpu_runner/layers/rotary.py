"""Rotary position embedding.

cos/sin are tabulated once for every position up to max_position_embeddings; a forward
gathers the rows of its tokens' positions (a `Rotation`, shared by every layer), so mixed
batches need no per-sequence work.

Two layouts of a head's dimensions, the same rotation:
- rotate-half (Hugging Face Llama/Qwen as loaded): pair i is (x[i], x[i + head_dim/2]);
- interleaved: pair i is (x[2i], x[2i+1]), so a pair is one complex number and the rotation
  is one complex multiply instead of six real operations. The model reorders its q/k
  projection rows into this layout once after loading (`LlamaForCausalLM.interleave_rotary`);
  q.k is unchanged because q and k are permuted alike. float32 only (torch has no bfloat16
  complex type), so other dtypes keep rotate-half: on the CPU one C++ pass
  (cpu_kernels.rotate_half) with Hugging Face's roundings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from gpu_runner import cpu_kernels
from gpu_runner.config import RopeScaling


def inverse_frequencies(head_dim: int, rope: RopeScaling) -> torch.Tensor:
    """The per-pair rotation speeds, with Llama 3 scaling applied when configured."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.kind == "llama3":
        inv_freq = _llama3_scaled(inv_freq, rope)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, rope: RopeScaling) -> torch.Tensor:
    # Same rule as Meta's reference: long wavelengths slowed by `factor`, short ones kept,
    # the band in between interpolated smoothly.
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotates query and key heads by their token's position."""

    cos_half: torch.Tensor
    sin_half: torch.Tensor

    def __init__(self, head_dim: int, max_positions: int, rope: RopeScaling) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, rope)
        positions = torch.arange(max_positions, dtype=torch.float32)
        angles = positions[:, None] * inv_freq[None, :]  # [max_positions, head_dim / 2]
        self.register_buffer("cos_half", angles.cos(), persistent=False)
        self.register_buffer("sin_half", angles.sin(), persistent=False)

        # Set by LlamaForCausalLM.interleave_rotary once the q/k rows are reordered.
        self.interleaved = False

    def rotation(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotation:
        """The rotation of the tokens at `positions` for activations of `dtype`: computed once
        per forward and shared by every layer (cos/sin rounded to `dtype`, as Hugging Face
        rounds them, once rather than in every layer)."""
        cos = self.cos_half[positions].unsqueeze(1)  # [tokens, 1, head_dim / 2]
        sin = self.sin_half[positions].unsqueeze(1)
        if self.interleaved:
            return Rotation(cos=None, sin=None, turns=torch.complex(cos.float(), sin.float()))
        return Rotation(cos=cos.to(dtype), sin=sin.to(dtype), turns=None)


@dataclass(frozen=True)
class Rotation:
    """One forward's rotation: cos/sin rows (rotate-half layout) or unit complex numbers
    cos + i sin (interleaved layout), each [tokens, 1, head_dim / 2]."""

    cos: torch.Tensor | None
    sin: torch.Tensor | None
    turns: torch.Tensor | None

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x: [tokens, heads, head_dim] (any strides, last dimension contiguous) -> a new
        contiguous tensor."""
        if self.turns is not None:
            pairs = torch.view_as_complex(x.unflatten(-1, (-1, 2)))
            return torch.view_as_real(pairs * self.turns).flatten(-2)
        assert self.cos is not None and self.sin is not None
        if cpu_kernels.supports(x, self.cos, self.sin) and cpu_kernels.available():
            return cpu_kernels.rotate_half(x, self.cos, self.sin)
        return apply_rotary(x, self.cos, self.sin)


def interleaving_order(head_dim: int) -> torch.Tensor:
    """Row order taking one head from rotate-half to interleaved: [0, h, 1, h + 1, ...]
    with h = head_dim / 2."""
    half = torch.arange(head_dim // 2)
    return torch.stack((half, half + head_dim // 2), dim=1).flatten()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim] (any strides) -> a new contiguous tensor.

    Same arithmetic as Hugging Face's x*cos + rotate_half(x)*sin, written straight into the
    two halves of the output (no concatenation)."""
    first, second = x.chunk(2, dim=-1)
    cos = cos.to(x.dtype)
    sin = sin.to(x.dtype)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out_first, out_second = out.chunk(2, dim=-1)
    torch.mul(first, cos, out=out_first).sub_(second * sin)
    torch.mul(second, cos, out=out_second).add_(first * sin)
    return out
