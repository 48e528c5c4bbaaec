"""SiLU-and-multiply, the gate of Llama's MLP."""

from __future__ import annotations

import torch
from torch.nn import functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up = [gate | up] along the last dimension -> silu(gate) * up.

    Works in place in gate_up's first half (the caller's fresh projection output)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate, inplace=True).mul_(up)
