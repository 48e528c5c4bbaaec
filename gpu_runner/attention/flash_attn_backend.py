"""Paged attention with flash-attn (CUDA only; used when the `flash_attn` package imports).

K/V are written by pagewire's Triton store kernel; prefill (any batch with more than one
new token in some sequence) runs `flash_attn_varlen_func` with the block table, decode-only
batches `flash_attn_with_kvcache`. flash-attn's paged KV cache requires blocks of a multiple
of 256 tokens: `block_size_problem` says so before the runner allocates anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_runner.attention.metadata import AttentionMetadata

FLASH_ATTN_BLOCK_MULTIPLE = 256


def block_size_problem(block_size: int) -> str | None:
    """Why flash-attn cannot use `block_size`, or None when it can."""
    if block_size <= 0 or block_size % FLASH_ATTN_BLOCK_MULTIPLE:
        return (
            f"the flash_attn backend needs --block-size to be a multiple of "
            f"{FLASH_ATTN_BLOCK_MULTIPLE} (its paged KV cache layout); got {block_size}. "
            "Use --block-size 256, or --attention-backend triton for smaller blocks"
        )
    return None


@dataclass(frozen=True)
class FlashAttentionPlan:
    """What every layer of one forward shares."""

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor  # [seqs, max_blocks] int32
    context_lens: torch.Tensor  # [seqs] int32
    cu_query_lens: torch.Tensor  # [seqs + 1] int32
    cu_context_lens: torch.Tensor  # [seqs + 1] int32
    num_tokens: int
    decode_only: bool
    max_query_len: int
    max_context_len: int


class FlashAttentionBackend:
    """Store kernel + flash-attn's paged varlen prefill and kv-cache decode."""

    name = "flash_attn"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5

    def plan(self, meta: AttentionMetadata) -> FlashAttentionPlan:
        problem = block_size_problem(meta.block_size)
        if problem is not None:
            raise ValueError(problem)
        context_lens = meta.context_lens.to(torch.int32)
        zero = torch.zeros(1, dtype=torch.int32, device=context_lens.device)
        return FlashAttentionPlan(
            slot_mapping=meta.slot_mapping,
            block_tables=meta.block_tables.to(torch.int32),
            context_lens=context_lens,
            cu_query_lens=meta.query_start_locs.to(torch.int32),
            cu_context_lens=torch.cat((zero, context_lens.cumsum(0, dtype=torch.int32))),
            num_tokens=meta.num_tokens,
            decode_only=meta.is_decode_only,
            max_query_len=int(meta.query_lens_host.max(initial=1)),
            max_context_len=int(meta.context_lens_host.max(initial=1)),
        )

    def forward(
        self,
        query: torch.Tensor,  # [tokens, heads, head_dim]
        key: torch.Tensor,
        value: torch.Tensor,
        layer_cache: torch.Tensor,  # [2, blocks, block_size, kv_heads, head_dim]
        plan: FlashAttentionPlan,
    ) -> torch.Tensor:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        from gpu_runner.kernels import store_kv

        k_cache, v_cache = layer_cache[0], layer_cache[1]
        store_kv(key, value, k_cache, v_cache, plan.slot_mapping)
        if plan.decode_only:
            out = flash_attn_with_kvcache(
                query.unsqueeze(1), k_cache, v_cache,
                cache_seqlens=plan.context_lens, block_table=plan.block_tables,
                softmax_scale=self.scale, causal=True,
            )
        else:
            out = flash_attn_varlen_func(
                query, k_cache, v_cache,
                cu_seqlens_q=plan.cu_query_lens, cu_seqlens_k=plan.cu_context_lens,
                max_seqlen_q=plan.max_query_len, max_seqlen_k=plan.max_context_len,
                softmax_scale=self.scale, causal=True, block_table=plan.block_tables,
            )
        return out.reshape(plan.num_tokens, self.num_heads * self.head_dim)
