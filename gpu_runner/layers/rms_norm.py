"""RMSNorm as Llama and Qwen define it (float32 statistics, weight applied last)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from gpu_runner import cpu_kernels


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, over the last dimension."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # torch's own op: the same arithmetic as Hugging Face's (bit for bit in float32),
            # one call instead of six (per-op overhead adds up at small decode batches).
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Same arithmetic as Hugging Face's (bit for bit), with fewer temporaries.
        dtype = x.dtype
        x32 = x.float()
        inverse_rms = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True).add_(self.eps))
        return (x32 * inverse_rms).to(dtype).mul_(self.weight)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual += x (in place: the forward's own running sum), then the norm of the new
        residual as a new tensor. On the CPU in float32 or bfloat16 (cpu_kernels.supports),
        one fused C++ pass."""
        if (x.dim() == 2 and cpu_kernels.supports(x, residual, self.weight)
                and cpu_kernels.available()):
            return cpu_kernels.add_rms_norm(x, residual, self.weight, self.eps)
        return self(residual.add_(x))
