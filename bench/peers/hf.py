"""Hugging Face transformers as benchmark peers: static batching and continuous batching.

Both run greedy, float32, on the CPU, with EOS ignored, over the same token-id prompts and
output lengths as pagewire. Throughput counts only the tokens each request asked for.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class PeerResult:
    """Wall time and useful output tokens of one peer run."""

    seconds: float
    output_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def _load(model_dir: Path, attn_implementation: str = "sdpa"):  # -> PreTrainedModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=attn_implementation
    )
    return model.eval()


def static_batching(model_dir: Path, prompts: list[list[int]], max_tokens: list[int]) -> PeerResult:
    """`generate` over one left-padded batch of every request, up to the longest output."""
    model = _load(model_dir)
    pad = model.config.eos_token_id
    pad = pad[0] if isinstance(pad, list) else pad
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    longest = max(max_tokens)
    with torch.inference_mode():
        model.generate(input_ids[:1, -8:], attention_mask=mask[:1, -8:], max_new_tokens=2,
                       do_sample=False, pad_token_id=pad)  # warm-up
        start = time.perf_counter()
        model.generate(input_ids, attention_mask=mask, max_new_tokens=longest,
                       min_new_tokens=longest, do_sample=False, pad_token_id=pad)
        seconds = time.perf_counter() - start
    return PeerResult(seconds, sum(max_tokens))


def continuous_batching(
    model_dir: Path, prompts: list[list[int]], max_tokens: list[int]
) -> PeerResult:
    """transformers' ContinuousBatchingManager, each request with its own output length."""
    from transformers import GenerationConfig

    model = _load(model_dir, attn_implementation="paged|sdpa")
    config = GenerationConfig(
        max_new_tokens=max(max_tokens), do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    try:
        start = time.perf_counter()
        ids = [
            manager.add_request(p, max_new_tokens=n, eos_token_id=-1)
            for p, n in zip(prompts, max_tokens, strict=True)
        ]
        produced = 0
        for request_id in ids:
            for result in manager.request_id_iter(request_id):
                if result.is_finished():
                    produced += len(result.generated_tokens)
        seconds = time.perf_counter() - start
    finally:
        manager.stop(block=True, timeout=10)
    return PeerResult(seconds, produced)
