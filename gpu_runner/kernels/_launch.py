"""What the Triton kernels share: interpreter detection, tl.dot settings, padded sizes.

Triton picks between compiling and interpreting when ``triton`` itself is imported: with
``TRITON_INTERPRET=1`` in the environment at that moment, every ``@triton.jit`` function
(triton's own ``tl.zeros``, ``tl.max``... included) becomes an interpreted one. The variable
must therefore be set before anything in the process imports triton; setting it later leaves
compiled-only kernels that cannot run on CPU tensors. `kernel_for` turns that mistake into a
clear error instead of a failure deep inside Triton.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction


def is_interpreted(kernel: Any) -> bool:
    """Whether `kernel` (a ``@triton.jit`` function) runs through the Triton interpreter."""
    return isinstance(kernel, InterpretedFunction)


def kernel_for(kernel: Any, device: torch.device) -> Any:
    """`kernel`, checked to be able to run on tensors of `device`."""
    if device.type != "cuda" and not is_interpreted(kernel):
        raise RuntimeError(
            f"Triton kernels need CUDA tensors, or the Triton interpreter for {device.type} "
            "tensors: set TRITON_INTERPRET=1 before triton is first imported in this process"
        )
    return kernel


@dataclass(frozen=True)
class DotConfig:
    """How the attention kernels feed ``tl.dot``.

    ``upcast``: convert both operands to float32 first. The interpreter needs it (it
    multiplies bfloat16 wrongly inside ``tl.dot``), and for float32 data it changes nothing;
    compiled float16/bfloat16 kernels keep native operands, the tensor cores' fast path, and
    accumulate in float32 all the same.
    ``precision``: float32 operands use "ieee" so float32 results are not rounded to TF32.
    """

    upcast: bool
    precision: str


def dot_config(kernel: Any, dtype: torch.dtype) -> DotConfig:
    """The ``tl.dot`` settings of `kernel` over `dtype` tensors."""
    upcast = is_interpreted(kernel) or dtype == torch.float32
    return DotConfig(upcast=upcast, precision="ieee" if upcast else "tf32")


def padded_dim(size: int, minimum: int = 16) -> int:
    """`size` rounded up to a power of two, at least `minimum` (tl.dot needs 16 on GPUs)."""
    return max(minimum, triton.next_power_of_2(size))


def is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


ATTENTION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_cache_args(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Shape checks shared by the attention kernels (query: [tokens, q_heads, head_dim])."""
    if query.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(
            "query must be [tokens, q_heads, head_dim] and the caches [num_blocks, block_size, "
            f"kv_heads, head_dim]; got {tuple(query.shape)} and {tuple(k_cache.shape)}"
        )
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and layout")
    if query.dtype not in ATTENTION_DTYPES or k_cache.dtype != query.dtype:
        raise ValueError(
            f"query and caches must share one of {ATTENTION_DTYPES}; got {query.dtype} and "
            f"{k_cache.dtype}"
        )
    if query.device != k_cache.device:
        raise ValueError(f"query is on {query.device} but the caches on {k_cache.device}")
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if query.shape[2] != head_dim or query.shape[1] % num_kv_heads:
        raise ValueError(
            f"query {tuple(query.shape)} does not fit a cache of {num_kv_heads} kv heads "
            f"of size {head_dim} (q_heads must be a multiple of kv_heads)"
        )
    if not is_power_of_two(k_cache.shape[1]):
        raise ValueError(f"block_size must be a power of two; got {k_cache.shape[1]}")
    if query.stride(2) != 1 or k_cache.stride(3) != 1:
        raise ValueError("the head_dim dimension of query and caches must be dense")
