"""Fixtures for runner tests: model folders, runners, and transformers as the oracle."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from gpu_runner import cpu_kernels
from gpu_runner.batch import ExecuteBatch
from gpu_runner.runner import ModelRunner, RunnerOptions
from tests.helpers.paged_driver import PagedDriver
from tests.helpers.tiny_models import TINY_ARCHS, make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_models")
    return {
        arch: make_tiny_model(arch, root / arch, seed=index)
        for index, arch in enumerate(TINY_ARCHS)
    }


@dataclass
class Oracle:
    """transformers' own model and greedy generate, for one model folder."""

    model: torch.nn.Module

    def generate(self, prompt: Sequence[int], steps: int) -> tuple[list[int], torch.Tensor]:
        """Greedy tokens generated after `prompt` (EOS does not stop it) and the logits of
        the first step."""
        with torch.inference_mode():
            out = self.model.generate(
                torch.tensor([list(prompt)]),
                max_new_tokens=steps,
                min_new_tokens=0,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
        return out.sequences[0, len(prompt) :].tolist(), out.logits[0][0].float()


def load_oracle(folder: Path) -> Oracle:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return Oracle(model)


def make_runner(
    folder: Path, block_size: int = 16, cache_bytes: int = 96 << 20, max_model_len: int = 1024
) -> ModelRunner:
    return ModelRunner(
        RunnerOptions(
            model=str(folder),
            block_size=block_size,
            kv_cache_memory=cache_bytes,
            max_model_len=max_model_len,
        )
    )


def runner_driver(runner: ModelRunner) -> PagedDriver:
    def execute(batch: ExecuteBatch) -> np.ndarray:
        return runner.execute(batch).token_ids

    return PagedDriver(execute, runner.block_size, runner.num_blocks)


@pytest.fixture(scope="session")
def smol_runner(default_model_dir: Path) -> ModelRunner:
    return make_runner(default_model_dir)


@pytest.fixture(scope="session")
def smol_oracle(default_model_dir: Path) -> Oracle:
    return load_oracle(default_model_dir)


@pytest.fixture
def forced_bf16_fallback(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A CPU without bfloat16 instructions, as PAGEWIRE_FORCE_BF16_FALLBACK simulates it (the
    decision is cached per process: cleared before and after)."""
    monkeypatch.setenv(cpu_kernels.FORCE_BF16_FALLBACK_ENV, "1")
    cpu_kernels.bf16_fallback_reason.cache_clear()
    yield
    monkeypatch.delenv(cpu_kernels.FORCE_BF16_FALLBACK_ENV)
    cpu_kernels.bf16_fallback_reason.cache_clear()
