"""store_kv: write new tokens' keys and values into the paged KV cache at their slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_runner.kernels._launch import kernel_for, padded_dim


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    num_kv_heads,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    # Slot -1 marks a padded token: it writes no head. (The scalar condition is folded into
    # a count because the interpreter turns `block_mask & scalar_bool` into int32.)
    heads_to_write = tl.where(slot >= 0, num_kv_heads, 0)
    mask = (heads[:, None] < heads_to_write) & (dims[None, :] < head_dim)

    row = token.to(tl.int64)
    key = tl.load(
        key_ptr + row * stride_key_token + heads[:, None] * stride_key_head + dims[None, :],
        mask=mask,
    )
    value = tl.load(
        value_ptr + row * stride_value_token + heads[:, None] * stride_value_head + dims[None, :],
        mask=mask,
    )
    cache_offsets = (
        block * stride_cache_block
        + offset * stride_cache_offset
        + heads[:, None] * stride_cache_head
        + dims[None, :]
    )
    tl.store(k_cache_ptr + cache_offsets, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_offsets, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write row j of `key`/`value` at slot ``slot_mapping[j]`` of `k_cache`/`v_cache`.

    key, value: [N, kv_heads, head_dim], any strides with a unit last stride.
    k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim], same strides as each other;
    slot = block_id * block_size + offset. slot_mapping: [N] integers; slot -1 is skipped.
    Grid: (N,), one program per token, writing all its heads as one
    [kv_heads, head_dim] tile padded to powers of two and masked (any head_dim works).
    """
    _check_store_args(key, value, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    kernel_for(_store_kv_kernel, key.device)[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        num_kv_heads,
        head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        HEADS_PAD=padded_dim(num_kv_heads, minimum=1),
        HEAD_DIM_PAD=padded_dim(head_dim, minimum=1),
    )


def _check_store_args(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(
            f"key and value must both be [N, kv_heads, head_dim]; got {tuple(key.shape)} "
            f"and {tuple(value.shape)}"
        )
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError(
            "k_cache and v_cache must be [num_blocks, block_size, kv_heads, head_dim] with the "
            f"same layout; got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if tuple(k_cache.shape[2:]) != tuple(key.shape[1:]):
        raise ValueError(
            f"key rows {tuple(key.shape[1:])} do not match cache rows {tuple(k_cache.shape[2:])}"
        )
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must be [{key.shape[0]}]; got {tuple(slot_mapping.shape)}")
    if key.stride(2) != 1 or value.stride(2) != 1 or k_cache.stride(3) != 1:
        raise ValueError("the last (head_dim) dimension of key, value and caches must be dense")
