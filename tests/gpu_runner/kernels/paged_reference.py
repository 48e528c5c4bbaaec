"""Paged KV caches for the kernel tests and a plain torch (float64) attention reference."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

# Padding of block-table rows past a sequence's blocks: never a valid block, so a kernel that
# read it would fail or read garbage.
TABLE_PADDING = -1
NUM_LAYERS = 2

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# Devices the kernel tests run on: the interpreter on CPU always, compiled kernels on CUDA.
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, CUDA])]


@dataclass
class PagedCache:
    """One layer of a runner-shaped cache whose sequences own scattered, shuffled blocks."""

    k_cache: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with TABLE_PADDING
    context_lens: torch.Tensor  # [B] int32


def cdiv(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def build_paged_cache(
    context_lens: list[int],
    block_size: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    generator: torch.Generator,
    device: str = "cpu",
) -> PagedCache:
    """Random K/V in every slot (unused ones too: garbage the kernels must not read)."""
    blocks_per_seq = [cdiv(length, block_size) for length in context_lens]
    num_blocks = sum(blocks_per_seq) + 3  # a few blocks nobody owns
    # The runner's layout: [layers, 2, num_blocks, block_size, kv_heads, head_dim]; the
    # tests use the last layer, a view at a nonzero offset like the runner's.
    cache = torch.randn(
        (NUM_LAYERS, 2, num_blocks, block_size, kv_heads, head_dim), generator=generator
    ).to(dtype)
    shuffled = torch.randperm(num_blocks, generator=generator).tolist()
    max_blocks = max(blocks_per_seq, default=0) + 1
    tables = torch.full((len(context_lens), max_blocks), TABLE_PADDING, dtype=torch.int32)
    taken = 0
    for seq, count in enumerate(blocks_per_seq):
        tables[seq, :count] = torch.tensor(shuffled[taken : taken + count], dtype=torch.int32)
        taken += count
    cache = cache.to(device)
    return PagedCache(
        k_cache=cache[NUM_LAYERS - 1, 0],
        v_cache=cache[NUM_LAYERS - 1, 1],
        block_tables=tables.to(device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
    )


def gather_sequence(paged: PagedCache, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V of sequence `seq`, in position order: [context_len, kv_heads, head_dim]."""
    block_size = paged.k_cache.shape[1]
    positions = torch.arange(int(paged.context_lens[seq]), device=paged.k_cache.device)
    blocks = paged.block_tables[seq].long()[positions // block_size]
    offsets = positions % block_size
    return paged.k_cache[blocks, offsets], paged.v_cache[blocks, offsets]


def reference_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    query_positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal softmax attention in float64: query [n, q_heads, D] at `query_positions` [n],
    keys/values [L, kv_heads, D] at positions 0..L-1; returns [n, q_heads, D] float64."""
    groups = query.shape[1] // keys.shape[1]
    keys = keys.double().repeat_interleave(groups, dim=1)
    values = values.double().repeat_interleave(groups, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", query.double(), keys) * scale
    key_positions = torch.arange(keys.shape[0], device=keys.device)
    hidden = key_positions[None, :] > query_positions[:, None].to(keys.device)
    scores = scores.masked_fill(hidden[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", torch.softmax(scores, dim=-1), values)


def reference_decode(query: torch.Tensor, paged: PagedCache, scale: float) -> torch.Tensor:
    """One query per sequence at its last position; a context of 0 (a padded batch slot)
    must give zeros."""
    outputs = []
    for seq in range(query.shape[0]):
        keys, values = gather_sequence(paged, seq)
        if keys.shape[0] == 0:
            outputs.append(torch.zeros_like(query[seq : seq + 1], dtype=torch.float64))
            continue
        last = torch.tensor([keys.shape[0] - 1])
        outputs.append(reference_attention(query[seq : seq + 1], keys, values, last, scale))
    return torch.cat(outputs)


def reference_prefill(
    query: torch.Tensor, paged: PagedCache, query_start_loc: list[int], scale: float
) -> torch.Tensor:
    outputs = []
    for seq in range(len(query_start_loc) - 1):
        start, stop = query_start_loc[seq], query_start_loc[seq + 1]
        keys, values = gather_sequence(paged, seq)
        positions = torch.arange(keys.shape[0] - (stop - start), keys.shape[0])
        outputs.append(reference_attention(query[start:stop], keys, values, positions, scale))
    return torch.cat(outputs)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest absolute error relative to the largest reference magnitude (NaN fails)."""
    difference = (actual.double().cpu() - expected.double().cpu()).abs().max()
    return float(difference / expected.abs().max().cpu())
