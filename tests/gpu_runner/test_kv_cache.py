"""KV cache sizing and copy-on-write block copies, against hand-computed expectations."""

from __future__ import annotations

import pytest
import torch

from gpu_runner.config import ModelConfig, RopeScaling
from gpu_runner.kv_cache import CacheSizeError, bytes_per_block, copy_blocks, num_blocks_for_budget
from gpu_runner.runner import new_epoch

CONFIG = ModelConfig(
    architecture="LlamaForCausalLM", vocab_size=100, hidden_size=64, intermediate_size=128,
    num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
    rope=RopeScaling(theta=1e4), max_position_embeddings=2048, tie_word_embeddings=True,
    attention_bias=False, qk_norm=False,
)


def test_bytes_per_block_counts_k_and_v_of_every_layer() -> None:
    # 30 layers x (K, V) x 16 tokens x 3 heads x 64 dims x 4 bytes
    assert bytes_per_block(CONFIG, 16, torch.float32) == 30 * 2 * 16 * 3 * 64 * 4 == 737280
    assert bytes_per_block(CONFIG, 16, torch.bfloat16) == 368640


def test_num_blocks_is_the_budget_divided_by_block_bytes() -> None:
    assert num_blocks_for_budget(CONFIG, 16, torch.float32, 737280 * 10 + 5, 160) == 10


def test_budget_too_small_for_one_sequence_is_refused() -> None:
    with pytest.raises(CacheSizeError, match="max_model_len=161"):
        num_blocks_for_budget(CONFIG, 16, torch.float32, 737280 * 10, 161)


def _cache(blocks: int) -> torch.Tensor:
    # [layers, 2, blocks, block_size, kv_heads, head_dim]; block b holds the value b.
    cache = torch.zeros(2, 2, blocks, 4, 1, 2)
    for block in range(blocks):
        cache[:, :, block] = block
    return cache


def test_copies_apply_in_order_when_they_chain() -> None:
    cache = _cache(4)
    copy_blocks(cache, torch.tensor([0, 1]), torch.tensor([1, 2]))
    # 0 -> 1 first, then the new block 1 (a copy of 0) -> 2.
    assert [cache[0, 0, b, 0, 0, 0].item() for b in range(4)] == [0, 0, 0, 3]


def test_independent_copies() -> None:
    cache = _cache(5)
    copy_blocks(cache, torch.tensor([3, 0]), torch.tensor([1, 4]))
    assert [cache[1, 1, b, 2, 0, 1].item() for b in range(5)] == [0, 3, 2, 3, 0]


def test_epochs_are_random_and_never_zero() -> None:
    epochs = {new_epoch() for _ in range(1000)}
    assert len(epochs) == 1000 and 0 not in epochs
    assert all(0 < epoch < 2**64 for epoch in epochs)
