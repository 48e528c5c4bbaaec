"""Paged attention in plain torch: the CPU path and the reference for faster backends.

Per layer the new tokens' K/V are first written at their slots. On the CPU in float32 (and
in bfloat16 where the CPU multiplies it: `cpu_kernels.kernel_dtype`) the C++ kernel
(gpu_runner/cpu_kernels.py) then attends every sequence in one call, reading the cache in
place (where the kernels are built for AVX2, not AVX-512, only decode batches: see
`_kernel_attends`). Elsewhere (or when the kernel cannot be built) the batch's sequences are
attended in up to three padded groups, each one batched call:
- decode: sequences with one new token (decodes, one-token chunks); their blocks are gathered
  and the query rows of a KV head attend together (no K/V repetition for GQA);
- fresh prefill: prompts starting at position 0; they attend to their own new K/V with a
  causal mask only (no gather from the cache);
- continued prefill: chunks after a cached prefix or an earlier chunk; their blocks are
  gathered and an explicit causal mask offsets each query by its start position.
The gathers, masks and padding indices do not depend on the layer: the plan builds them once
per batch, on first use (the kernel needs none of them). No Python loop runs over tokens or
sequences.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
from torch.nn import functional as F

from gpu_runner import cpu_kernels
from gpu_runner.attention.metadata import AttentionMetadata


@dataclass(frozen=True)
class _Group:
    """A set of sequences attended together with padded shapes."""

    token_index: torch.Tensor  # [seqs, max_q] packed token index; padding -> num_tokens
    valid: torch.Tensor  # [seqs, max_q] bool: a real token (not padding)
    out_index: torch.Tensor  # [real tokens] packed index of each valid entry, row-major
    flat_blocks: torch.Tensor  # [seqs * blocks] block ids to gather, row by row
    context_lens: torch.Tensor  # [seqs] keys per sequence, the new tokens' included
    mask: torch.Tensor | None  # [seqs, 1, rows, keys] bool (None: plain causal)
    max_q: int
    # Every sequence of the batch, all with max_q tokens: token_index is a plain reshape of
    # the packed tokens and the output needs no scatter.
    covers_batch_in_order: bool


@dataclass(frozen=True)
class _Groups:
    """The batch's sequences by kind (None: the batch has none of that kind)."""

    decode: _Group | None
    fresh: _Group | None
    continued: _Group | None


class TorchAttentionPlan:
    """Everything the layers of one forward share."""

    def __init__(self, backend: TorchAttentionBackend, meta: AttentionMetadata) -> None:
        self.meta = meta
        self._backend = backend

    @cached_property
    def decode_only(self) -> bool:
        return self.meta.is_decode_only

    @cached_property
    def groups(self) -> _Groups:
        """The padded groups of the torch path: built on the first layer that needs them."""
        return self._backend.group_sequences(self.meta)


class TorchAttentionBackend:
    """Stores K/V in the paged cache and attends over it."""

    name = "torch"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_per_kv = num_heads // num_kv_heads
        self.scale = head_dim**-0.5

    # ---- planning (once per batch) ----

    def plan(self, meta: AttentionMetadata) -> TorchAttentionPlan:
        return TorchAttentionPlan(self, meta)

    def group_sequences(self, meta: AttentionMetadata) -> _Groups:
        query_lens = meta.query_lens_host
        starts = meta.context_lens_host - query_lens
        single = query_lens == 1
        fresh = ~single & (starts == 0)
        continued = ~single & (starts > 0)
        return _Groups(
            decode=self._group(meta, np.nonzero(single)[0], with_mask=True),
            fresh=self._group(meta, np.nonzero(fresh)[0], with_mask=False),
            continued=self._group(meta, np.nonzero(continued)[0], with_mask=True),
        )

    def _group(self, meta: AttentionMetadata, seqs: np.ndarray, with_mask: bool
               ) -> _Group | None:
        if seqs.size == 0:
            return None
        device = meta.positions.device
        query_lens = meta.query_lens_host[seqs]
        max_q = int(query_lens.max())
        max_blocks = int(meta.block_table_lens_host[seqs].max())
        seq_index = torch.from_numpy(seqs).to(device)
        offsets = torch.arange(max_q, device=device)
        q_lens = torch.from_numpy(query_lens).to(device)
        valid = offsets[None, :] < q_lens[:, None]
        starts = meta.query_start_locs[seq_index]
        token_index = torch.where(valid, starts[:, None] + offsets[None, :], meta.num_tokens)
        out_index = token_index[valid]
        in_order = len(seqs) == meta.num_seqs and bool(np.all(query_lens == max_q))
        mask = None
        ctx = torch.from_numpy(meta.context_lens_host[seqs]).to(device)
        if with_mask:
            mask = self._mask(ctx, q_lens, offsets, valid, max_blocks * meta.block_size)
        flat_blocks = meta.block_tables[seq_index, :max_blocks].reshape(-1)
        return _Group(
            token_index=token_index,
            valid=valid,
            out_index=out_index,
            flat_blocks=flat_blocks,
            context_lens=ctx,
            mask=mask,
            max_q=max_q,
            covers_batch_in_order=in_order,
        )

    def _mask(self, ctx: torch.Tensor, q_lens: torch.Tensor, offsets: torch.Tensor,
              valid: torch.Tensor, num_keys: int) -> torch.Tensor:
        # Query j of a sequence sits at position context_len - query_len + j and sees every
        # key position up to its own. Padding rows see position 0 only (no all-masked rows).
        seqs, max_q = valid.shape
        query_pos = torch.where(valid, (ctx - q_lens)[:, None] + offsets[None, :], 0)
        key_pos = torch.arange(num_keys, device=ctx.device)
        mask = key_pos[None, None, :] <= query_pos[:, :, None]  # [seqs, max_q, keys]
        if max_q == 1:
            return mask.view(seqs, 1, 1, num_keys)  # broadcast over a KV head's query rows
        # Query rows are laid out [kv_head, (q_per_kv, max_q)]: repeat the mask per group.
        return mask.unsqueeze(1).repeat(1, 1, self.q_per_kv, 1)

    # ---- per layer ----

    def forward(
        self,
        query: torch.Tensor,  # [tokens, heads, head_dim]
        key: torch.Tensor,  # [tokens, kv_heads, head_dim]
        value: torch.Tensor,
        layer_cache: torch.Tensor,  # [2, blocks, block_size, kv_heads, head_dim]
        plan: TorchAttentionPlan,
    ) -> torch.Tensor:
        """Returns [tokens, heads * head_dim]."""
        meta = plan.meta
        store_kv(layer_cache, key, value, meta.slot_mapping)
        if self._kernel_attends(plan, query, layer_cache):
            out = cpu_kernels.paged_attention(
                query, layer_cache[0], layer_cache[1], meta.block_tables, meta.context_lens,
                meta.query_start_locs, self.scale)
        else:
            out = self._attend_groups(query, key, value, layer_cache, plan.groups,
                                      meta.num_tokens)
        return out.reshape(meta.num_tokens, self.num_heads * self.head_dim)

    @staticmethod
    def _kernel_attends(plan: TorchAttentionPlan, query: torch.Tensor,
                        layer_cache: torch.Tensor) -> bool:
        """The C++ kernel takes every batch where it is built for AVX-512; built for AVX2 only
        decode batches: its prefill tiles spill there and SDPA is 3-4x faster (8 x 256 tokens
        of SmolLM2, 30 layers, 2 cores: 295 vs 936 ms; decodes within 0.7-1.2x of torch, 2.8x
        faster at 1024 tokens of context: bench/cpu_attention.py)."""
        if not (cpu_kernels.supports(query, layer_cache) and cpu_kernels.available()):
            return False
        return plan.decode_only or cpu_kernels.wide_vectors()

    def _attend_groups(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       layer_cache: torch.Tensor, groups: _Groups, num_tokens: int
                       ) -> torch.Tensor:
        parts = []
        if groups.decode is not None:
            parts.append((groups.decode, self._decode(query, layer_cache, groups.decode)))
        if groups.fresh is not None:
            parts.append((groups.fresh, self._fresh_prefill(query, key, value, groups.fresh)))
        if groups.continued is not None:
            parts.append((groups.continued,
                          self._continued_prefill(query, layer_cache, groups.continued)))
        if len(parts) == 1 and parts[0][0].covers_batch_in_order:
            return parts[0][1]
        out = query.new_empty(num_tokens, self.num_heads, self.head_dim)
        for group, result in parts:
            out.index_copy_(0, group.out_index, result)
        return out

    def _gather_kv(self, layer_cache: torch.Tensor, group: _Group
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        # Only the group's blocks, as [seqs, kv_heads, keys, head_dim] views. K and V are
        # gathered in one index_select over the rows of a [2 * blocks, rest] view (V's block b
        # is row blocks + b): row gathers of a 2-D view are the fastest torch has on CPU
        # (multi-threaded; index_select over dim 1 of a 3-D view runs on one thread).
        seqs = group.token_index.shape[0]
        num_blocks = layer_cache.shape[1]
        kv_rows = torch.cat((group.flat_blocks, group.flat_blocks + num_blocks))
        rows = layer_cache.view(2 * num_blocks, -1).index_select(0, kv_rows)
        kv = rows.view(2, seqs, -1, self.num_kv_heads, self.head_dim).transpose(2, 3)
        return kv[0], kv[1]

    def _decode(self, query: torch.Tensor, layer_cache: torch.Tensor, group: _Group
                ) -> torch.Tensor:
        q = query if group.covers_batch_in_order else query[group.token_index[:, 0]]
        keys, values = self._gather_kv(layer_cache, group)
        seqs = keys.shape[0]
        q = q.reshape(seqs, self.num_kv_heads, self.q_per_kv, self.head_dim)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=group.mask,
                                             scale=self.scale)
        return out.reshape(seqs, self.num_heads, self.head_dim)

    def _padded(self, x: torch.Tensor, group: _Group) -> torch.Tensor:
        """[tokens, heads, dim] -> [seqs, heads, max_q, dim] (padding rows are zeros)."""
        seqs, max_q = group.token_index.shape
        if group.covers_batch_in_order:
            return x.reshape(seqs, max_q, *x.shape[1:]).transpose(1, 2)
        padded = torch.cat((x, x.new_zeros(1, *x.shape[1:])))[group.token_index]
        return padded.transpose(1, 2)

    def _unpadded(self, out: torch.Tensor, group: _Group) -> torch.Tensor:
        """[seqs, heads, max_q, dim] -> [real tokens, heads, dim] in packed order."""
        out = out.transpose(1, 2)
        if group.covers_batch_in_order:
            return out.reshape(-1, self.num_heads, self.head_dim)
        return out[group.valid]

    def _fresh_prefill(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       group: _Group) -> torch.Tensor:
        # Keys are this batch's own: padding sits after each prompt's end, where the causal
        # mask hides it from every real query.
        q, k, v = (self._padded(x, group) for x in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                             enable_gqa=self.q_per_kv > 1)
        return self._unpadded(out, group)

    def _continued_prefill(self, query: torch.Tensor, layer_cache: torch.Tensor,
                           group: _Group) -> torch.Tensor:
        keys, values = self._gather_kv(layer_cache, group)
        seqs, max_q = group.token_index.shape
        q = self._padded(query, group)  # [seqs, heads, max_q, dim]
        q = q.reshape(seqs, self.num_kv_heads, self.q_per_kv * max_q, self.head_dim)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=group.mask,
                                             scale=self.scale)
        return self._unpadded(out.view(seqs, self.num_heads, max_q, self.head_dim), group)


def store_kv(
    layer_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor
) -> None:
    """Writes each token's K and V at its slot (flat index over blocks x block_size)."""
    kv_heads, head_dim = key.shape[1], key.shape[2]
    layer_cache[0].view(-1, kv_heads, head_dim).index_copy_(0, slots, key.to(layer_cache.dtype))
    layer_cache[1].view(-1, kv_heads, head_dim).index_copy_(
        0, slots, value.to(layer_cache.dtype)
    )
