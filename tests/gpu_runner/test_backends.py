"""Attention backends inside the runner: Triton (interpreted on CPU) against the torch backend
on the same mixed batches, backend selection, and the flash-attn block-size check.

The torch backend is the oracle here (it is itself checked against transformers in
test_parity.py). The Triton runs happen in a spawned worker that sets TRITON_INTERPRET=1
before anything imports triton (see tests/gpu_runner/kernels/conftest.py for why).
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from gpu_runner.attention.flash_attn_backend import block_size_problem
from gpu_runner.attention.selection import BackendSelectionError, choose_backend
from gpu_runner.batch import ExecuteBatch
from tests.gpu_runner.kernels.interpreter_worker import enable_interpreter

LOGITS_ATOL = 1e-3
STEPS = 4
PROMPT_LENGTHS = (5, 17, 33, 8)


@dataclass
class Comparison:
    """Per step: the largest |logit difference| and both backends' greedy tokens."""

    max_diffs: list[float]
    reference_tokens: list[list[int]]
    candidate_tokens: list[list[int]]
    batch_kinds: list[str]


def _prompts(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 1000, size=n).tolist() for n in PROMPT_LENGTHS]


def _batch_kind(num_new_tokens: np.ndarray) -> str:
    if np.all(num_new_tokens == 1):
        return "decode"
    return "mixed" if np.any(num_new_tokens == 1) else "prefill"


def compare_backends(folder: str, backend: str, device: str = "cpu", dtype: str = "float32",
                     block_size: int = 16) -> Comparison:
    """Runs the same staggered batches (prefills joining decodes, then a cached-prefix
    continuation) through a torch-backend runner and a `backend` runner."""
    from gpu_runner.runner import ModelRunner, RunnerOptions
    from tests.helpers.paged_driver import PagedDriver

    def runner_with(name: str) -> ModelRunner:
        runner = ModelRunner(RunnerOptions(model=folder, device=device, dtype=dtype,
                                           block_size=block_size, kv_cache_memory=16 << 20,
                                           max_model_len=512, num_threads=1,
                                           attention_backend=name, enforce_eager=True))
        assert runner.info().attention_backend == name
        return runner

    reference, candidate = runner_with("torch"), runner_with(backend)
    result = Comparison([], [], [], [])

    def execute(batch: object) -> np.ndarray:
        expected = reference.forward_logits(batch)
        actual = candidate.forward_logits(batch)
        result.max_diffs.append(float((expected.float() - actual.float()).abs().max()))
        result.reference_tokens.append(expected.argmax(-1).tolist())
        result.candidate_tokens.append(actual.argmax(-1).tolist())
        result.batch_kinds.append(_batch_kind(batch.num_new_tokens))
        return expected.argmax(-1).cpu().numpy()

    driver = PagedDriver(execute, block_size, reference.num_blocks)
    seqs = driver.run_staggered(_prompts(seed=7), STEPS, join_at=1)
    # A prompt sharing its first two blocks with a finished sequence: a continued prefill.
    source = seqs[2]
    reuser = driver.add_with_cached_prefix([*source.tokens[:32], 11, 12, 13], source)
    while len(reuser.generated) < 2:
        driver.step([reuser])
    return result


@pytest.fixture(scope="module")
def interpreter() -> Iterator[ProcessPoolExecutor]:
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context,
                             initializer=enable_interpreter) as executor:
        yield executor


def _assert_close(comparison: Comparison, atol: float) -> None:
    assert {"prefill", "mixed", "decode"} <= set(comparison.batch_kinds)
    assert max(comparison.max_diffs) <= atol, comparison.max_diffs
    assert comparison.candidate_tokens == comparison.reference_tokens


@pytest.mark.parametrize("arch,block_size", [("qwen3", 16), ("qwen2", 16), ("qwen3", 256)])
def test_triton_backend_matches_torch_in_runner(
    interpreter: ProcessPoolExecutor, tiny_model_dirs: dict[str, Path], arch: str,
    block_size: int
) -> None:
    comparison = interpreter.submit(compare_backends, str(tiny_model_dirs[arch]), "triton",
                                    "cpu", "float32", block_size).result()
    _assert_close(comparison, LOGITS_ATOL)


# ---- selection ----


def test_auto_on_cpu_is_torch() -> None:
    assert choose_backend("auto", torch.device("cpu"), 16) == "torch"


def test_forced_backends_are_kept() -> None:
    assert choose_backend("triton", torch.device("cpu"), 16) == "triton"
    assert choose_backend("torch", torch.device("cpu"), 16) == "torch"


def test_unknown_backend_is_refused() -> None:
    with pytest.raises(BackendSelectionError, match="unknown attention backend 'xformers'"):
        choose_backend("xformers", torch.device("cpu"), 16)


@pytest.mark.parametrize("block_size", [16, 128, 255, 300])
def test_flash_attn_refuses_block_sizes_not_multiple_of_256(block_size: int) -> None:
    problem = block_size_problem(block_size)
    assert problem is not None and "multiple of 256" in problem and str(block_size) in problem
    with pytest.raises(BackendSelectionError, match="multiple of 256"):
        choose_backend("flash_attn", torch.device("cuda"), block_size)


@pytest.mark.parametrize("block_size", [256, 512])
def test_flash_attn_accepts_multiples_of_256(block_size: int) -> None:
    assert block_size_problem(block_size) is None


def test_flash_attn_on_cpu_is_refused() -> None:
    with pytest.raises(BackendSelectionError, match="needs a CUDA device"):
        choose_backend("flash_attn", torch.device("cpu"), 256)


# ---- GPU: kernels compiled for real ----

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype,atol", [("float32", 1e-3), ("float16", 2e-2),
                                        ("bfloat16", 1e-1)])
@pytest.mark.parametrize("arch,block_size", [("qwen3", 16), ("qwen2", 16), ("qwen3", 256)])
def test_triton_backend_matches_torch_on_cuda(
    tiny_model_dirs: dict[str, Path], arch: str, block_size: int, dtype: str, atol: float
) -> None:
    comparison = compare_backends(str(tiny_model_dirs[arch]), "triton", device="cuda",
                                  dtype=dtype, block_size=block_size)
    assert max(comparison.max_diffs) <= atol, comparison.max_diffs
    if dtype == "float32":
        assert comparison.candidate_tokens == comparison.reference_tokens


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype,atol", [("float16", 2e-2), ("bfloat16", 1e-1)])
def test_flash_attn_backend_matches_torch_on_cuda(
    tiny_model_dirs: dict[str, Path], dtype: str, atol: float
) -> None:
    pytest.importorskip("flash_attn")
    comparison = compare_backends(str(tiny_model_dirs["qwen3"]), "flash_attn", device="cuda",
                                  dtype=dtype, block_size=256)
    assert max(comparison.max_diffs) <= atol, comparison.max_diffs


def _greedy_tokens(folder: Path, enforce_eager: bool, dtype: str) -> tuple[list[list[int]], int]:
    """Generated tokens of a staggered run on CUDA with the triton backend, and how many
    batches replayed a CUDA graph."""
    from gpu_runner.runner import ModelRunner, RunnerOptions
    from tests.helpers.paged_driver import PagedDriver

    runner = ModelRunner(RunnerOptions(model=str(folder), device="cuda", dtype=dtype,
                                       block_size=16, kv_cache_memory=64 << 20,
                                       max_model_len=512, attention_backend="triton",
                                       enforce_eager=enforce_eager))
    driver = PagedDriver(lambda batch: runner.execute(batch).token_ids, runner.block_size,
                         runner.num_blocks)
    # 5 prompts: decode batches of 5 replay the graph of 8 (3 padded slots).
    prompts = [*_prompts(seed=11), list(range(40, 61))]
    seqs = driver.run_staggered(prompts, 12, join_at=2)
    replays = runner.graphs.replays if runner.graphs is not None else 0
    runner.close()
    return [seq.generated for seq in seqs], replays


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graphs_on_and_off_give_the_same_tokens(
    tiny_model_dirs: dict[str, Path], dtype: str
) -> None:
    eager, eager_replays = _greedy_tokens(tiny_model_dirs["qwen3"], True, dtype)
    graphed, replays = _greedy_tokens(tiny_model_dirs["qwen3"], False, dtype)
    assert eager_replays == 0 and replays > 0
    assert graphed == eager


# ---- CUDA graph bookkeeping (runs on CPU) ----


def test_batch_ladder_and_padding_size() -> None:
    from gpu_runner.cuda_graphs import batch_ladder, graph_size

    assert batch_ladder(40) == [1, 2, 4, 8, 16, 32, 40]
    assert batch_ladder(4) == [1, 2, 4]
    ladder = batch_ladder(256)
    assert ladder[:6] == [1, 2, 4, 8, 16, 32] and ladder[-1] == 256
    assert [graph_size(n, ladder) for n in (1, 3, 5, 9, 17, 250)] == [1, 4, 8, 16, 32, 256]
    assert graph_size(257, ladder) is None


def test_stage_batch_pads_with_skipped_slots() -> None:
    from gpu_runner.cuda_graphs import StaticInputs, stage_batch

    host = StaticInputs.allocate(8, 4, torch.device("cpu"), pinned=False)
    host.slot_mapping.fill_(99)  # stale values from an earlier, larger batch
    host.block_tables.fill_(77)
    batch = ExecuteBatch(
        num_new_tokens=np.array([1, 1, 1]), start_positions=np.array([5, 0, 20]),
        token_ids=np.array([11, 12, 13]), slot_mapping=np.array([21, 48, 84]),
        block_table_lens=np.array([2, 1, 2]), block_tables=np.array([3, 5, 6, 2, 9]),
        do_sample=np.array([True, True, True]), temperatures=np.zeros(3, np.float32),
        top_ps=np.ones(3, np.float32), top_ks=np.zeros(3, np.int64),
        min_ps=np.zeros(3, np.float32), seeds=np.zeros(3, np.uint64))
    stage_batch(host, batch, size=4)
    assert host.token_ids[:4].tolist() == [11, 12, 13, 0]
    assert host.positions[:4].tolist() == [5, 0, 20, 0]
    assert host.slot_mapping[:4].tolist() == [21, 48, 84, -1]
    assert host.context_lens[:4].tolist() == [6, 1, 21, 0]
    assert host.block_tables[:4].tolist() == [[3, 5, 0, 0], [6, 0, 0, 0], [2, 9, 0, 0],
                                              [0, 0, 0, 0]]
