"""paged_decode_attention: one new query token per sequence over its paged KV cache.

Flash-decoding: a sequence's context is cut into partitions of `partition_size` tokens, each
handled by its own program, which writes its running max, its softmax sum and its normalised
partial output; a second kernel merges the partitions. With one partition the first kernel
writes the final output itself and the reduce kernel is not launched.
"""

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

# exp(x) == exp2(x * LOG2E): the kernels work in base 2 (cheaper on GPUs).
LOG2E = 1.4426950408889634


@triton.jit
def _decode_partition_kernel(
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    part_max_ptr,
    part_sum_ptr,
    part_out_ptr,
    qk_scale_log2,
    stride_q_seq,
    stride_q_head,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    stride_table_seq,
    stride_out_seq,
    stride_out_head,
    head_dim,
    max_partitions,
    GROUPS: tl.constexpr,
    GROUPS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    WRITE_FINAL: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    partition = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    start = partition * PARTITION_SIZE
    # A partition past the sequence's end (or a padded slot with context 0) runs no tile and
    # stores nothing; the reduce kernel only reads partitions inside the context.
    end = tl.minimum(start + PARTITION_SIZE, context_len)
    # Query heads to store: none for a partition without tokens. (A scalar condition is
    # folded into a count: the interpreter turns `block_mask & scalar_bool` into int32.)
    groups_to_store = tl.where(start < context_len, GROUPS, 0)

    groups = tl.arange(0, GROUPS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    q_heads = kv_head * GROUPS + groups
    q_mask = (groups[:, None] < GROUPS) & (dims[None, :] < head_dim)
    query = tl.load(
        query_ptr
        + seq.to(tl.int64) * stride_q_seq
        + q_heads[:, None] * stride_q_head
        + dims[None, :],
        mask=q_mask,
        other=0.0,
    )
    if UPCAST_DOT:
        query = query.to(tl.float32)

    row_max = tl.full([GROUPS_PAD], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([GROUPS_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUPS_PAD, HEAD_DIM_PAD], dtype=tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_table_seq
    for tile_start in range(start, end, TILE_N):
        positions = tile_start + tl.arange(0, TILE_N)
        in_context = positions < end
        # Tokens are gathered one by one through the block table, so a tile may span
        # several blocks (small block sizes) or part of one (large block sizes).
        blocks = tl.load(table_row + positions // BLOCK_SIZE, mask=in_context, other=0)
        token_offsets = (
            blocks.to(tl.int64) * stride_cache_block
            + (positions % BLOCK_SIZE) * stride_cache_offset
            + kv_head * stride_cache_head
        )
        kv_mask = in_context[:, None] & (dims[None, :] < head_dim)
        kv_offsets = token_offsets[:, None] + dims[None, :]
        keys = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        values = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        if UPCAST_DOT:
            keys = keys.to(tl.float32)
            values = values.to(tl.float32)

        scores = tl.dot(query, tl.trans(keys), input_precision=DOT_PRECISION) * qk_scale_log2
        scores = tl.where(in_context[None, :], scores, float("-inf"))
        # Every tile holds at least one position in context, so new_max is finite.
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        rescale = tl.exp2(row_max - new_max)
        probs = tl.exp2(scores - new_max[:, None])
        row_sum = row_sum * rescale + tl.sum(probs, axis=1)
        acc = acc * rescale[:, None] + tl.dot(
            probs.to(values.dtype), values, input_precision=DOT_PRECISION
        )
        row_max = new_max

    # An empty context leaves row_sum at 0: the output is then 0, never NaN.
    out_values = acc / tl.maximum(row_sum, 1e-30)[:, None]
    if WRITE_FINAL:
        tl.store(
            out_ptr
            + seq.to(tl.int64) * stride_out_seq
            + q_heads[:, None] * stride_out_head
            + dims[None, :],
            out_values.to(out_ptr.dtype.element_ty),
            mask=q_mask,
        )
    else:
        # Partial buffers: [seqs, q_heads, max_partitions] and [..., HEAD_DIM_PAD], fp32.
        stat_rows = (seq * GROUPS * tl.num_programs(1) + q_heads).to(tl.int64)
        stat_offsets = stat_rows * max_partitions + partition
        group_mask = groups < groups_to_store
        tl.store(part_max_ptr + stat_offsets, row_max, mask=group_mask)
        tl.store(part_sum_ptr + stat_offsets, row_sum, mask=group_mask)
        tl.store(
            part_out_ptr + stat_offsets[:, None] * HEAD_DIM_PAD + dims[None, :],
            out_values,
            mask=group_mask[:, None],
        )


@triton.jit
def _decode_reduce_kernel(
    out_ptr,
    part_max_ptr,
    part_sum_ptr,
    part_out_ptr,
    context_lens_ptr,
    stride_out_seq,
    stride_out_head,
    head_dim,
    max_partitions,
    PARTITION_SIZE: tl.constexpr,
    PARTITIONS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    q_head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    num_partitions = tl.cdiv(context_len, PARTITION_SIZE)

    parts = tl.arange(0, PARTITIONS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    # Never past the buffers, even if a caller's max_context_len undercounted a context.
    valid = parts < tl.minimum(num_partitions, max_partitions)
    base = (seq * tl.num_programs(1) + q_head).to(tl.int64) * max_partitions
    part_max = tl.load(part_max_ptr + base + parts, mask=valid, other=float("-inf"))
    part_sum = tl.load(part_sum_ptr + base + parts, mask=valid, other=0.0)
    part_out = tl.load(
        part_out_ptr + (base + parts)[:, None] * HEAD_DIM_PAD + dims[None, :],
        mask=valid[:, None],
        other=0.0,
    )
    global_max = tl.max(part_max, axis=0)
    # Each partition's weight is its softmax sum rebased to the global max.
    weights = tl.where(valid, part_sum * tl.exp2(part_max - global_max), 0.0)
    total = tl.sum(weights, axis=0)
    merged = tl.sum(weights[:, None] * part_out, axis=0) / tl.maximum(total, 1e-30)
    tl.store(
        out_ptr + seq.to(tl.int64) * stride_out_seq + q_head * stride_out_head + dims,
        merged.to(out_ptr.dtype.element_ty),
        mask=dims < head_dim,
    )


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    partition_size: int = 512,
    tile_size: int = 64,
    max_context_len: int | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its cached context.

    query: [B, q_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, kv_heads,
    head_dim] (block_size a power of two); block_tables: [B, max_blocks]; context_lens: [B],
    the number of cached tokens each query attends to (its own included; 0 gives a zero
    output, for padded batch slots); both int32 (or int64). q_heads = groups * kv_heads;
    query head h reads kv head h // groups. Returns softmax(scale * q·K) V as
    [B, q_heads, head_dim] in the query dtype, accumulated in float32.

    Grid of the partition kernel: (B, kv_heads, ceil(max_context_len / partition_size)); one
    program computes all `groups` query heads of a kv head over one partition, in tiles of
    `tile_size` tokens. With more than one partition a reduce kernel, grid (B, q_heads),
    merges them. `max_context_len` sizes the grid and must be >= every context length
    (default: read from context_lens, a host sync; CUDA graphs pass a fixed bound instead).
    """
    _check_decode_args(query, k_cache, v_cache, block_tables, context_lens)
    _check_tiling(partition_size, tile_size)
    num_seqs, num_q_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    output = torch.empty((num_seqs, num_q_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return output
    if max_context_len is None:
        max_context_len = int(context_lens.max().item())
    num_partitions = max(1, triton.cdiv(max_context_len, partition_size))
    head_dim_pad = padded_dim(head_dim)
    parts_shape = (num_seqs, num_q_heads, num_partitions)
    # With one partition the partial buffers are never touched: one-element placeholders.
    part_max = part_sum = part_out = torch.empty(1, dtype=torch.float32, device=query.device)
    if num_partitions > 1:
        part_max = torch.empty(parts_shape, dtype=torch.float32, device=query.device)
        part_sum = torch.empty_like(part_max)
        part_out = torch.empty(
            (*parts_shape, head_dim_pad), dtype=torch.float32, device=query.device
        )
    dot = dot_config(_decode_partition_kernel, query.dtype)
    groups = num_q_heads // num_kv_heads
    kernel_for(_decode_partition_kernel, query.device)[(num_seqs, num_kv_heads, num_partitions)](
        query, k_cache, v_cache, block_tables, context_lens,
        output, part_max, part_sum, part_out,
        scale * LOG2E,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        output.stride(0), output.stride(1),
        head_dim,
        num_partitions,
        GROUPS=groups,
        GROUPS_PAD=padded_dim(groups),
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=k_cache.shape[1],
        PARTITION_SIZE=partition_size,
        TILE_N=tile_size,
        WRITE_FINAL=num_partitions == 1,
        UPCAST_DOT=dot.upcast,
        DOT_PRECISION=dot.precision,
    )  # fmt: skip
    if num_partitions > 1:
        kernel_for(_decode_reduce_kernel, query.device)[(num_seqs, num_q_heads)](
            output, part_max, part_sum, part_out, context_lens,
            output.stride(0), output.stride(1),
            head_dim,
            num_partitions,
            PARTITION_SIZE=partition_size,
            PARTITIONS_PAD=padded_dim(num_partitions, minimum=1),
            HEAD_DIM_PAD=head_dim_pad,
        )  # fmt: skip
    return output


def _check_tiling(partition_size: int, tile_size: int) -> None:
    if not (is_power_of_two(tile_size) and tile_size >= 16):
        raise ValueError(f"tile_size must be a power of two >= 16; got {tile_size}")
    if partition_size < tile_size or partition_size % tile_size:
        raise ValueError(
            f"partition_size ({partition_size}) must be a multiple of tile_size ({tile_size})"
        )


def _check_decode_args(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> None:
    check_cache_args(query, k_cache, v_cache)
    if block_tables.dim() != 2 or block_tables.shape[0] != query.shape[0]:
        raise ValueError(
            f"block_tables must be [{query.shape[0]}, max_blocks]; got {tuple(block_tables.shape)}"
        )
    if context_lens.shape != (query.shape[0],):
        raise ValueError(
            f"context_lens must be [{query.shape[0]}]; got {tuple(context_lens.shape)}"
        )
