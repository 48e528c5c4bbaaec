"""SiLU-and-multiply, the gate of Llama's MLP."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from gpu_runner import cpu_kernels


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up = [gate | up] along the last dimension -> silu(gate) * up.

    On the CPU in float32 or bfloat16 (cpu_kernels.supports), one fused C++ pass; elsewhere
    in place in gate_up's first half (the caller's fresh projection output)."""
    if gate_up.dim() == 2 and cpu_kernels.supports(gate_up) and cpu_kernels.available():
        return cpu_kernels.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate, inplace=True).mul_(up)
