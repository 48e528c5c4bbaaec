"""Greedy generation with Hugging Face transformers: the outside oracle of the e2e tests."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from common.model_store import resolve_model

# Computing a few more tokens than asked lets tests that want fewer share one generation.
_MIN_NEW_TOKENS = 24
# (model folder, prompt) -> (tokens generated, max_new_tokens they were generated with)
_generated: dict[tuple[Path | None, tuple[int, ...]], tuple[list[int], int]] = {}


@functools.cache
def _model(path: Path | None) -> AutoModelForCausalLM:
    # One thread: the services under test share the CPU, and torch's thread pool spins
    # badly when oversubscribed (several times slower than a single thread).
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(path or resolve_model(None),
                                                 dtype=torch.float32)
    model.eval()
    return model


def greedy(prompt_ids: Sequence[int], max_new_tokens: int,
           model: Path | None = None) -> list[int]:
    """transformers' greedy generate for one prompt alone (stops after EOS, like pagewire),
    with the model in folder `model` (default: the default model)."""
    key = (model, tuple(prompt_ids))
    known = _generated.get(key)
    if known is None or known[1] < max_new_tokens:
        budget = max(max_new_tokens, _MIN_NEW_TOKENS)
        known = (_generate(model, key[1], budget), budget)
        _generated[key] = known
    return known[0][:max_new_tokens]


def _generate(path: Path | None, prompt_ids: tuple[int, ...],
              max_new_tokens: int) -> list[int]:
    model = _model(path)
    with torch.no_grad():
        output = model.generate(
            torch.tensor([list(prompt_ids)]), max_new_tokens=max_new_tokens, do_sample=False,
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        )
    return [int(t) for t in output[0, len(prompt_ids):]]
