"""Greedy parity with Hugging Face transformers (float32, CPU), driven through the runner core
by a test-side scheduler that assigns blocks itself. transformers' `generate` on each prompt
alone is the oracle."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch

from gpu_runner import cpu_kernels
from gpu_runner.runner import ModelRunner
from tests.gpu_runner.conftest import Oracle, load_oracle, make_runner, runner_driver

STEPS = 32
LOGITS_ATOL = 1e-4
SMOL_TEXTS = (
    "Hi",
    "The capital of France is",
    "Write a haiku about the sea and the wind.",
    "List three prime numbers greater than ten, then explain why each one is prime.",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "clockmaker who",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n'
    "        return n\n",
    "Photosynthesis is the process by which green plants and some other organisms use "
    "sunlight to synthesize foods from carbon dioxide and water. In plants it generally "
    "involves the green pigment chlorophyll and generates oxygen as a byproduct. Summarise",
    "The history of computing spans centuries, from the abacus and mechanical calculators of "
    "Pascal and Leibniz to Babbage's analytical engine, Turing's theoretical machines, the "
    "vacuum-tube computers of the 1940s, transistors, integrated circuits, and finally the "
    "microprocessor. Each step made machines smaller, faster and cheaper. In one paragraph, "
    "describe what came next:",
)
TINY_LENGTHS = (1, 3, 9, 16, 17, 31, 48, 77)


def smol_prompts(folder: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    return [tokenizer(text)["input_ids"] for text in SMOL_TEXTS]


def random_prompts(lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 49152, size=length).tolist() for length in lengths]


@cache
def _oracle(folder: Path) -> Oracle:
    return load_oracle(folder)


@cache
def _expected(folder: Path, prompt: tuple[int, ...], steps: int) -> tuple[list[int], torch.Tensor]:
    return _oracle(folder).generate(prompt, steps)


def expected_tokens(folder: Path, prompt: list[int], steps: int = STEPS) -> list[int]:
    return _expected(folder, tuple(prompt), steps)[0]


def assert_first_logits(runner: ModelRunner, folder: Path, prompts: list[list[int]]) -> None:
    driver = runner_driver(runner)
    seqs = [driver.add(prompt) for prompt in prompts]
    batch, _ = driver.build(seqs)
    logits = runner.forward_logits(batch)
    for row, prompt in enumerate(prompts):
        reference = _expected(folder, tuple(prompt), STEPS)[1]
        torch.testing.assert_close(logits[row], reference, rtol=0, atol=LOGITS_ATOL)


def assert_mixed_batch_parity(runner: ModelRunner, folder: Path, prompts: list[list[int]]) -> None:
    seqs = runner_driver(runner).run_staggered(prompts, STEPS)
    for prompt, seq in zip(prompts, seqs, strict=True):
        assert seq.generated == expected_tokens(folder, prompt), f"prompt of {len(prompt)}"


# ---- the default model, SmolLM2-135M-Instruct ----


def test_smollm2_first_step_logits(smol_runner: ModelRunner, default_model_dir: Path) -> None:
    assert_first_logits(smol_runner, default_model_dir, smol_prompts(default_model_dir))


def test_smollm2_mixed_batch_matches_generate(
    smol_runner: ModelRunner, default_model_dir: Path
) -> None:
    prompts = smol_prompts(default_model_dir)
    assert len({len(p) for p in prompts}) == len(prompts) >= 8
    assert_mixed_batch_parity(smol_runner, default_model_dir, prompts)


# ---- small random Qwen2 (q/k/v bias), Qwen3 (q/k norm), Llama ----


@pytest.fixture(scope="module")
def tiny_runners(tiny_model_dirs: dict[str, Path]) -> dict[tuple[str, int], ModelRunner]:
    return {
        (arch, bs): make_runner(folder, block_size=bs, cache_bytes=16 << 20)
        for arch, folder in tiny_model_dirs.items()
        for bs in (16, 256)
    }


@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_tiny_mixed_batch_matches_generate(
    tiny_runners: dict, tiny_model_dirs: dict[str, Path], arch: str, block_size: int
) -> None:
    runner = tiny_runners[(arch, block_size)]
    prompts = random_prompts(TINY_LENGTHS, seed=block_size)
    assert_first_logits(runner, tiny_model_dirs[arch], prompts)
    assert_mixed_batch_parity(runner, tiny_model_dirs[arch], prompts)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_torch_paths_without_the_cpp_kernels_match_generate(
    tiny_runners: dict, tiny_model_dirs: dict[str, Path], arch: str,
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gather + SDPA attention and the torch norms and activation, used where the C++
    kernels cannot be built."""
    monkeypatch.setattr(cpu_kernels, "available", lambda device="cpu": False)
    runner = tiny_runners[(arch, 16)]
    prompts = random_prompts(TINY_LENGTHS, seed=3)
    assert_mixed_batch_parity(runner, tiny_model_dirs[arch], prompts)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_cached_prefix_computes_only_the_suffix(
    tiny_runners: dict, tiny_model_dirs: dict[str, Path], arch: str
) -> None:
    runner, folder = tiny_runners[(arch, 16)], tiny_model_dirs[arch]
    driver = runner_driver(runner)
    first = random_prompts((50,), seed=1)[0]
    second = first[:40] + random_prompts((13,), seed=2)[0]
    source = driver.add(first)
    driver.step([source])
    reuser = driver.add_with_cached_prefix(second, source)
    assert reuser.computed == 32 and reuser.table == source.table[:2]
    driver.step([reuser])
    assert driver.last_batch is not None
    assert driver.last_batch.num_new_tokens.tolist() == [len(second) - 32]
    while len(reuser.generated) < STEPS or len(source.generated) < STEPS:
        driver.step([seq for seq in (source, reuser) if len(seq.generated) < STEPS])
    assert reuser.generated == expected_tokens(folder, second)
    assert source.generated == expected_tokens(folder, first)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_prompt_prefilled_in_three_chunks(
    tiny_runners: dict, tiny_model_dirs: dict[str, Path], arch: str
) -> None:
    runner, folder = tiny_runners[(arch, 16)], tiny_model_dirs[arch]
    driver = runner_driver(runner)
    long_prompt, *others = random_prompts((100, 7, 23), seed=3)
    long_seq = driver.add(long_prompt)
    other_seqs = [driver.add(prompt) for prompt in others]
    driver.step(other_seqs)  # the others are decoding while the long one is chunked
    for chunk in (37, 37, 26):
        sampled = driver.step([long_seq, *other_seqs], chunk={0: chunk})
        assert (long_seq in sampled) == (chunk == 26)
    while len(long_seq.generated) < STEPS:
        driver.step([long_seq])
    assert long_seq.generated == expected_tokens(folder, long_prompt)
    for prompt, seq in zip(others, other_seqs, strict=True):
        assert seq.generated == expected_tokens(folder, prompt)[: len(seq.generated)]


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_fork_with_copy_on_write(
    tiny_runners: dict, tiny_model_dirs: dict[str, Path], arch: str
) -> None:
    runner, folder = tiny_runners[(arch, 16)], tiny_model_dirs[arch]
    driver = runner_driver(runner)
    prompt = random_prompts((21,), seed=4)[0]  # the last block is shared and partly full
    parent = driver.add(prompt)
    driver.step([parent])
    child = driver.fork(parent)
    alternative = (parent.tokens[-1] + 1) % 49152
    child.tokens[-1] = alternative  # the child took another first token (as with n > 1)
    steps_left = STEPS - 1
    for step in range(steps_left):
        driver.step([parent, child])
        if step == 0:
            assert driver.last_batch is not None
            assert driver.last_batch.copy_src_block_ids.size == 1  # one copy-on-write
            assert parent.table[-1] != child.table[-1]
    assert parent.generated == expected_tokens(folder, prompt)
    assert child.generated[1:] == expected_tokens(folder, [*prompt, alternative], steps_left)
