"""Paged attention with pagewire's Triton kernels (gpu_runner/kernels).

Per layer: the store kernel writes the new tokens' K/V at their slots (slot -1 is skipped,
which CUDA graphs use for padded batch slots), then
- a decode-only batch (one new token per sequence) runs the split-K paged decode kernel;
- any other batch runs the varlen prefill kernel over every sequence: it attends new tokens
  to the cached prefix and to each other causally, so one-token sequences mixed into a
  prefill batch are handled by the same launch.
`plan` converts the integer metadata to int32 once per batch and reads the grid bounds from
the host copies of the lengths (no device sync per layer).

On CPU tensors the kernels need the Triton interpreter (TRITON_INTERPRET=1 before triton is
imported); this module imports the kernels lazily so that merely selecting a backend does not
import triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_runner.attention.metadata import AttentionMetadata


@dataclass(frozen=True)
class TritonAttentionPlan:
    """What every layer of one forward shares."""

    slot_mapping: torch.Tensor  # [tokens] int64 (-1: skip)
    block_tables: torch.Tensor  # [seqs, max_blocks] int32
    context_lens: torch.Tensor  # [seqs] int32
    query_start_locs: torch.Tensor  # [seqs + 1] int32
    num_tokens: int
    decode_only: bool
    max_query_len: int
    max_context_len: int


class TritonAttentionBackend:
    """Stores K/V with the store kernel and attends with the paged decode/prefill kernels."""

    name = "triton"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 decode_partition_size: int = 512) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads "
                             f"{num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.decode_partition_size = decode_partition_size

    def plan(self, meta: AttentionMetadata) -> TritonAttentionPlan:
        return TritonAttentionPlan(
            slot_mapping=meta.slot_mapping,
            block_tables=meta.block_tables.to(torch.int32),
            context_lens=meta.context_lens.to(torch.int32),
            query_start_locs=meta.query_start_locs.to(torch.int32),
            num_tokens=meta.num_tokens,
            decode_only=meta.is_decode_only,
            max_query_len=int(meta.query_lens_host.max(initial=1)),
            max_context_len=int(meta.context_lens_host.max(initial=1)),
        )

    def forward(
        self,
        query: torch.Tensor,  # [tokens, heads, head_dim]
        key: torch.Tensor,  # [tokens, kv_heads, head_dim]
        value: torch.Tensor,
        layer_cache: torch.Tensor,  # [2, blocks, block_size, kv_heads, head_dim]
        plan: TritonAttentionPlan,
    ) -> torch.Tensor:
        """Returns [tokens, heads * head_dim]."""
        from gpu_runner.kernels import paged_decode_attention, paged_prefill_attention, store_kv

        k_cache, v_cache = layer_cache[0], layer_cache[1]
        store_kv(key.to(k_cache.dtype), value.to(v_cache.dtype), k_cache, v_cache,
                 plan.slot_mapping)
        query = query.to(k_cache.dtype)
        if plan.decode_only:
            out = paged_decode_attention(
                query, k_cache, v_cache, plan.block_tables, plan.context_lens, self.scale,
                partition_size=self.decode_partition_size,
                max_context_len=plan.max_context_len,
            )
        else:
            out = paged_prefill_attention(
                query, k_cache, v_cache, plan.block_tables, plan.query_start_locs,
                plan.context_lens, self.scale, max_query_len=plan.max_query_len,
            )
        return out.reshape(plan.num_tokens, self.num_heads * self.head_dim)
