"""The paged KV cache: one tensor [layers, 2, num_blocks, block_size, kv_heads, head_dim].

Its size comes from a byte budget (--kv-cache-memory), or on CUDA from
--gpu-memory-utilization: the share of the device's memory left after the weights and a
profiling forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_runner.config import ModelConfig


class CacheSizeError(ValueError):
    """The budget does not hold even one block per sequence of max_model_len tokens."""


@dataclass(frozen=True)
class CacheShape:
    """Dimensions of the cache tensor."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int

    def as_tuple(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads,
                self.head_dim)


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of every layer for block_size tokens."""
    element = torch.tensor([], dtype=dtype).element_size()
    return config.num_layers * 2 * block_size * config.num_kv_heads * config.head_dim * element


def num_blocks_for_budget(
    config: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int,
    max_model_len: int,
) -> int:
    """How many blocks fit in budget_bytes; at least one sequence of max_model_len must fit."""
    blocks = int(budget_bytes) // bytes_per_block(config, block_size, dtype)
    needed = -(-max_model_len // block_size)
    if blocks < needed:
        raise CacheSizeError(
            f"KV cache budget of {budget_bytes} bytes holds {blocks} blocks of {block_size} "
            f"tokens; one sequence of max_model_len={max_model_len} needs {needed}"
        )
    return blocks


def cuda_budget_bytes(device: torch.device, utilization: float) -> int:
    """Bytes left for the cache under `utilization` of the device's memory, after what the
    process has already used at its peak (weights and a profiling forward)."""
    total = torch.cuda.get_device_properties(device).total_memory
    peak = torch.cuda.max_memory_allocated(device)
    return max(0, int(total * utilization) - peak)


def allocate_cache(shape: CacheShape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The zero-filled cache tensor."""
    return torch.zeros(shape.as_tuple(), dtype=dtype, device=device)


def copy_blocks(cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy-on-write: block src[j] onto block dst[j] in every layer, in order.

    Copies are applied one after another when a destination is later read as a source, so
    the result matches doing them in order; otherwise one vectorised copy does them all."""
    if src.numel() == 0:
        return
    if _chained(src, dst):
        for s, d in zip(src.tolist(), dst.tolist(), strict=True):
            cache[:, :, d] = cache[:, :, s]
        return
    cache[:, :, dst] = cache[:, :, src]


def _chained(src: torch.Tensor, dst: torch.Tensor) -> bool:
    # A destination that is also a source (or written twice) makes the order matter.
    dst_set = set(dst.tolist())
    return len(dst_set) != dst.numel() or bool(dst_set & set(src.tolist()))
