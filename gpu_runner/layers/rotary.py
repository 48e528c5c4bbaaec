"""Rotary position embedding (the "rotate half" layout of Hugging Face Llama/Qwen).

cos/sin are tabulated once for every position up to max_position_embeddings; a forward
gathers the rows of its tokens' positions, so mixed batches need no per-sequence work.
"""

from __future__ import annotations

import math

import torch
from torch import nn

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

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin rows for `positions`, shaped [tokens, 1, head_dim / 2]: computed once
        per forward and shared by every layer."""
        return self.cos_half[positions].unsqueeze(1), self.sin_half[positions].unsqueeze(1)


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
