"""Every malformed batch is refused with BatchError and leaves the KV cache bit-identical."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from gpu_runner.batch import MAX_LOGPROBS, BatchError, ExecuteBatch
from gpu_runner.runner import ModelRunner
from tests.gpu_runner.conftest import make_runner, runner_driver
from tests.helpers.paged_driver import PagedDriver


@pytest.fixture(scope="module")
def runner(tiny_model_dirs: dict[str, Path]) -> ModelRunner:
    return make_runner(tiny_model_dirs["qwen3"], block_size=16, cache_bytes=4 << 20,
                       max_model_len=256)


@pytest.fixture()
def driver_and_batch(runner: ModelRunner) -> tuple[PagedDriver, ExecuteBatch]:
    """A driver whose sequences are in the cache, and a valid next batch for them: one
    decode, one prompt, and a fork's copy-on-write copy."""
    driver = runner_driver(runner)
    decoding = driver.add(list(range(5, 25)))
    driver.step([decoding])
    child = driver.fork(decoding)
    prompt = driver.add(list(range(30, 41)))
    batch, _ = driver.build([decoding, child, prompt])
    assert batch.copy_src_block_ids.size == 1
    batch.num_logprobs = np.array([0, 2, 1])
    return driver, batch


def _with(batch: ExecuteBatch, **changes: object) -> ExecuteBatch:
    return dataclasses.replace(batch, **{k: np.asarray(v) for k, v in changes.items()})


def _edited(column: str, edit: Callable[[np.ndarray], object]) -> Callable[..., ExecuteBatch]:
    def make(batch: ExecuteBatch, runner: ModelRunner) -> ExecuteBatch:
        values = getattr(batch, column).copy()
        result = edit(values)
        return _with(batch, **{column: values if result is None else result})
    return make


def _set(column: str, index: int, value: object) -> Callable[..., ExecuteBatch]:
    def edit(values: np.ndarray) -> None:
        values[index] = value
    return _edited(column, edit)


def _pool_slot(batch: ExecuteBatch, runner: ModelRunner) -> ExecuteBatch:
    return _set("slot_mapping", 0, runner.num_blocks * runner.block_size)(batch, runner)


def _pool_block(batch: ExecuteBatch, runner: ModelRunner) -> ExecuteBatch:
    return _set("block_tables", 0, runner.num_blocks)(batch, runner)


def _copy_block(batch: ExecuteBatch, runner: ModelRunner) -> ExecuteBatch:
    return _set("copy_dst_block_ids", 0, runner.num_blocks)(batch, runner)


def _vocab(batch: ExecuteBatch, runner: ModelRunner) -> ExecuteBatch:
    return _set("token_ids", 0, runner.config.vocab_size)(batch, runner)


def _too_long(batch: ExecuteBatch, runner: ModelRunner) -> ExecuteBatch:
    return _set("start_positions", 0, runner.max_model_len)(batch, runner)


def _short_table(batch: ExecuteBatch, runner: ModelRunner) -> ExecuteBatch:
    # Drop the last block of sequence 2's table (its prompt needs it).
    lens = batch.block_table_lens.copy()
    lens[2] -= 1
    return _with(batch, block_table_lens=lens, block_tables=batch.block_tables[:-1])


def _duplicate_slot(batch: ExecuteBatch, runner: ModelRunner) -> ExecuteBatch:
    # Sequence 1 (the fork) writes where sequence 0 writes: same block, same offset.
    slots, tables, lens = (batch.slot_mapping.copy(), batch.block_tables.copy(),
                           batch.block_table_lens)
    starts = np.cumsum(lens) - lens
    tables[starts[1]:starts[1] + lens[1]] = tables[starts[0]:starts[0] + lens[0]]
    slots[1] = slots[0]
    return _with(batch, slot_mapping=slots, block_tables=tables)


BAD_BATCHES: dict[str, Callable[..., ExecuteBatch]] = {
    "slot outside the pool": _pool_slot,
    "block outside the pool": _pool_block,
    "copy destination outside the pool": _copy_block,
    "slot disagrees with block table": _edited("slot_mapping", lambda v: v + 1),
    "block table does not cover the positions": _short_table,
    "two tokens write one slot": _duplicate_slot,
    "token id >= vocab": _vocab,
    "negative token id": _set("token_ids", 1, -1),
    "length > max_model_len": _too_long,
    "negative start position": _set("start_positions", 2, -1),
    "zero new tokens": _set("num_new_tokens", 0, 0),
    "short sampling column": _edited("temperatures", lambda v: v[:-1]),
    "extra token id": _edited("token_ids", lambda v: np.append(v, 7)),
    "copy columns differ": _edited("copy_src_block_ids", lambda v: np.append(v, 0)),
    "negative temperature": _set("temperatures", 0, -0.5),
    "NaN temperature": _set("temperatures", 1, np.nan),
    "top_p 0": _set("top_ps", 0, 0.0),
    "top_p above 1": _set("top_ps", 2, 1.5),
    "min_p above 1": _set("min_ps", 0, 1.01),
    "negative top_k": _set("top_ks", 0, -1),
    "too many logprobs": _set("num_logprobs", 1, MAX_LOGPROBS + 1),
    "num_logprobs column of the wrong length": _edited("num_logprobs", lambda v: v[:2]),
}


@pytest.mark.parametrize("case", list(BAD_BATCHES))
def test_rejected_batch_leaves_cache_untouched(
    runner: ModelRunner, driver_and_batch: tuple[PagedDriver, ExecuteBatch], case: str
) -> None:
    _, valid = driver_and_batch
    bad = BAD_BATCHES[case](valid, runner)
    before = runner.kv_cache.clone()
    with pytest.raises(BatchError):
        runner.execute(bad)
    assert torch.equal(runner.kv_cache, before)


def test_valid_batch_is_accepted_and_writes(
    runner: ModelRunner, driver_and_batch: tuple[PagedDriver, ExecuteBatch]
) -> None:
    # The control: the unmodified batch passes and does change the cache.
    _, valid = driver_and_batch
    before = runner.kv_cache.clone()
    result = runner.execute(valid)
    assert result.token_ids.shape == (3,)
    assert result.top_counts is not None and result.top_counts.tolist() == [0, 2, 1]
    assert not torch.equal(runner.kv_cache, before)


def test_error_message_names_the_column(
    runner: ModelRunner, driver_and_batch: tuple[PagedDriver, ExecuteBatch]
) -> None:
    _, valid = driver_and_batch
    with pytest.raises(BatchError, match=r"token_ids\[0\]"):
        runner.execute(_vocab(valid, runner))
    with pytest.raises(BatchError, match=r"slot_mapping\[\d+\]"):
        runner.execute(_edited("slot_mapping", lambda v: v + 1)(valid, runner))
