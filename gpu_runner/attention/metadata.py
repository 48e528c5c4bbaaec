"""What attention needs to know about a batch, built once per batch and passed explicitly.

Tokens are packed sequence after sequence: sequence i owns the tokens
query_start_locs[i] .. query_start_locs[i + 1] - 1, at positions
context_lens[i] - query_lens[i] .. context_lens[i] - 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Per-token and per-sequence tensors on the model's device, plus host copies of the
    lengths so that backends can plan without reading the device."""

    positions: torch.Tensor  # [tokens] int64
    slot_mapping: torch.Tensor  # [tokens] int64: flat slot (block * block_size + offset)
    block_tables: torch.Tensor  # [seqs, max_blocks] int64, padded with block 0
    query_lens: torch.Tensor  # [seqs] int64: new tokens per sequence
    context_lens: torch.Tensor  # [seqs] int64: cached + new tokens per sequence
    query_start_locs: torch.Tensor  # [seqs + 1] int64
    logits_indices: torch.Tensor  # [sampled seqs] int64: packed index of each last token
    query_lens_host: np.ndarray  # [seqs] int64
    context_lens_host: np.ndarray  # [seqs] int64
    block_table_lens_host: np.ndarray  # [seqs] int64
    block_size: int

    @property
    def num_seqs(self) -> int:
        return int(self.query_lens_host.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def is_decode_only(self) -> bool:
        """Every sequence computes exactly one new token."""
        return bool(np.all(self.query_lens_host == 1))
