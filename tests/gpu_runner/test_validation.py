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
from tests.helpers.paged_driver import PagedDriver, Penalties, with_penalties


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


# ---- penalty and logit-bias columns -----------------------------------------------------------


@pytest.fixture()
def penalised_batch(runner: ModelRunner) -> ExecuteBatch:
    """A valid batch whose decode has penalties (history sent), whose fork child has a logit
    bias, and whose prompt has neither."""
    driver = runner_driver(runner)
    decoding = driver.add(list(range(5, 25)))
    driver.step([decoding])
    child = driver.fork(decoding)
    prompt = driver.add(list(range(30, 41)))
    seqs = [decoding, child, prompt]
    batch, _ = driver.build(seqs)
    batch = with_penalties(batch, seqs, [Penalties(0.5, 0.5, 1.2), Penalties(bias={3: 2.0}),
                                         Penalties()])
    assert batch.penalty_history_lens.tolist() == [20, 0, 0]
    return batch


def _short_history(batch: ExecuteBatch) -> ExecuteBatch:
    """Sequence 0 sends 3 tokens of its 20-token history (lengths and tokens agree)."""
    return _with(batch, penalty_history_lens=[3, 0, 0],
                 penalty_token_ids=batch.penalty_token_ids[:3])


BAD_PENALTY_BATCHES: dict[str, Callable[..., ExecuteBatch]] = {
    "presence column of the wrong length": _edited("presence_penalties", lambda v: v[:2]),
    "NaN presence": _set("presence_penalties", 0, np.nan),
    "infinite frequency": _set("frequency_penalties", 1, np.inf),
    "zero repetition": _set("repetition_penalties", 0, 0.0),
    "negative repetition": _set("repetition_penalties", 2, -1.0),
    "prompt_lens missing": _edited("prompt_lens", lambda v: v[:0]),
    # Counting output tokens as prompt would silently switch presence/frequency off.
    "prompt longer than the sequence": lambda b, r: _set(
        "prompt_lens", 0, int(b.start_positions[0] + b.num_new_tokens[0]) + 1)(b, r),
    "history length neither 0 nor start": lambda b, r: _short_history(b),
    "penalised sampler without history": _edited(
        "penalty_history_lens", lambda v: np.zeros_like(v)),
    "history token outside the vocabulary": lambda b, r: _set(
        "penalty_token_ids", 4, r.config.vocab_size)(b, r),
    "history shorter than its lengths": _edited("penalty_token_ids", lambda v: v[:-1]),
    "bias counts of the wrong length": _edited("logit_bias_counts", lambda v: v[:1]),
    "bias token outside the vocabulary": _set("logit_bias_token_ids", 0, -1),
    "NaN bias": _set("logit_bias_values", 0, np.nan),
    "bias values short": _edited("logit_bias_values", lambda v: v[:0]),
    "one token biased twice": lambda b, r: _with(
        b, logit_bias_counts=[0, 2, 0], logit_bias_token_ids=[3, 3],
        logit_bias_values=[1.0, 1.0]),
}


@pytest.mark.parametrize("case", list(BAD_PENALTY_BATCHES))
def test_rejected_penalty_batch_leaves_cache_untouched(
        runner: ModelRunner, penalised_batch: ExecuteBatch, case: str) -> None:
    bad = BAD_PENALTY_BATCHES[case](penalised_batch, runner)
    before = runner.kv_cache.clone()
    with pytest.raises(BatchError):
        runner.execute(bad)
    assert torch.equal(runner.kv_cache, before)


def test_valid_penalty_batch_is_accepted(runner: ModelRunner,
                                         penalised_batch: ExecuteBatch) -> None:
    assert runner.execute(penalised_batch).token_ids.shape == (3,)
    with pytest.raises(BatchError, match=r"penalty_history_lens\[0\]"):
        runner.execute(_short_history(penalised_batch))
    with pytest.raises(BatchError, match=r"logit_bias_values\[0\]"):
        runner.execute(_set("logit_bias_values", 0, np.inf)(penalised_batch, runner))
