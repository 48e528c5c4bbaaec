"""paged_prefill_attention: varlen causal attention of new tokens over their paged KV cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_runner.kernels._launch import (
    check_cache_args,
    dot_config,
    is_power_of_two,
    kernel_for,
    padded_dim,
)
from gpu_runner.kernels.decode_attention import LOG2E


@triton.jit
def _prefill_kernel(
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    context_lens_ptr,
    out_ptr,
    qk_scale_log2,
    stride_q_token,
    stride_q_head,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    stride_table_seq,
    stride_out_token,
    stride_out_head,
    head_dim,
    GROUPS: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    q_head = tl.program_id(1)
    q_tile = tl.program_id(2)
    kv_head = q_head // GROUPS
    # Lengths may come as int32 or int64; the kernels compute in int32.
    query_start = tl.load(query_start_loc_ptr + seq).to(tl.int32)
    query_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int32) - query_start
    context_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    prefix_len = context_len - query_len

    rows = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = rows < query_len
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < head_dim
    q_mask = row_valid[:, None] & dim_valid[None, :]
    token_rows = (query_start + rows).to(tl.int64)
    query = tl.load(
        query_ptr + token_rows[:, None] * stride_q_token + q_head * stride_q_head + dims[None, :],
        mask=q_mask,
        other=0.0,
    )
    if UPCAST_DOT:
        query = query.to(tl.float32)
    positions = prefix_len + rows

    # Causal: this tile's last row sees positions up to prefix_len + its index. A tile past
    # the sequence's new tokens runs no iteration and stores nothing (no early return).
    kv_end = tl.minimum(context_len, prefix_len + (q_tile + 1) * BLOCK_M)
    kv_end = tl.where(q_tile * BLOCK_M < query_len, kv_end, 0)

    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_table_seq
    for tile_start in range(0, kv_end, BLOCK_N):
        kv_positions = tile_start + tl.arange(0, BLOCK_N)
        kv_valid = kv_positions < kv_end
        blocks = tl.load(table_row + kv_positions // BLOCK_SIZE, mask=kv_valid, other=0)
        token_offsets = (
            blocks.to(tl.int64) * stride_cache_block
            + (kv_positions % BLOCK_SIZE) * stride_cache_offset
            + kv_head * stride_cache_head
        )
        kv_mask = kv_valid[:, None] & dim_valid[None, :]
        kv_offsets = token_offsets[:, None] + dims[None, :]
        keys = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        values = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        if UPCAST_DOT:
            keys = keys.to(tl.float32)
            values = values.to(tl.float32)

        scores = tl.dot(query, tl.trans(keys), input_precision=DOT_PRECISION) * qk_scale_log2
        visible = (kv_positions[None, :] <= positions[:, None]) & kv_valid[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        # Position 0 is in the first tile and visible to every row, so row_max is finite
        # from then on; a fully masked row in a later tile just adds exp2(-inf) = 0.
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        rescale = tl.exp2(row_max - new_max)
        probs = tl.exp2(scores - new_max[:, None])
        row_sum = row_sum * rescale + tl.sum(probs, axis=1)
        acc = acc * rescale[:, None] + tl.dot(
            probs.to(values.dtype), values, input_precision=DOT_PRECISION
        )
        row_max = new_max

    out_values = acc / tl.maximum(row_sum, 1e-30)[:, None]
    tl.store(
        out_ptr + token_rows[:, None] * stride_out_token + q_head * stride_out_head + dims[None, :],
        out_values.to(out_ptr.dtype.element_ty),
        mask=q_mask,
    )


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    block_m: int = 64,
    block_n: int = 64,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Causal attention of packed new tokens over their sequences' paged KV cache.

    query: [T, q_heads, head_dim], the new tokens of all B sequences packed; sequence b owns
    rows query_start_loc[b] : query_start_loc[b + 1] (query_start_loc: [B + 1] int32).
    context_lens: [B] int32, each sequence's total length including its new tokens, whose K/V
    are already in the cache. New token i of sequence b sits at position
    context_lens[b] - q_len_b + i and attends to every position <= its own (cached prefix and
    new tokens alike), read through block_tables [B, max_blocks] int32. GQA as in decode.
    The integer tensors may also be int64.
    Returns [T, q_heads, head_dim] in the query dtype; online softmax in float32 with
    ``tl.dot`` over [block_m, block_n] tiles.

    Grid: (B, q_heads, ceil(max_query_len / block_m)); one program per query tile of one
    head of one sequence; tiles past a sequence's end do nothing. `max_query_len` sizes the
    grid and must be >= every query length (default: the largest, read from query_start_loc,
    a host sync).
    """
    _check_prefill_args(query, k_cache, v_cache, block_tables, query_start_loc, context_lens)
    for name, size in (("block_m", block_m), ("block_n", block_n)):
        if not (is_power_of_two(size) and size >= 16):
            raise ValueError(f"{name} must be a power of two >= 16; got {size}")
    num_tokens, num_q_heads, head_dim = query.shape
    output = torch.empty_like(query, memory_format=torch.contiguous_format)
    num_seqs = context_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return output
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item())
    num_q_tiles = max(1, -(-max_query_len // block_m))
    dot = dot_config(_prefill_kernel, query.dtype)
    kernel_for(_prefill_kernel, query.device)[(num_seqs, num_q_heads, num_q_tiles)](
        query, k_cache, v_cache, block_tables, query_start_loc, context_lens, output,
        scale * LOG2E,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        output.stride(0), output.stride(1),
        head_dim,
        GROUPS=num_q_heads // k_cache.shape[2],
        HEAD_DIM_PAD=padded_dim(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        UPCAST_DOT=dot.upcast,
        DOT_PRECISION=dot.precision,
    )  # fmt: skip
    return output


def _check_prefill_args(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
) -> None:
    check_cache_args(query, k_cache, v_cache)
    num_seqs = context_lens.shape[0] if context_lens.dim() == 1 else -1
    if num_seqs < 0 or query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(
            f"context_lens must be [B] and query_start_loc [B + 1]; got "
            f"{tuple(context_lens.shape)} and {tuple(query_start_loc.shape)}"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables must be [{num_seqs}, max_blocks]; got {tuple(block_tables.shape)}"
        )
