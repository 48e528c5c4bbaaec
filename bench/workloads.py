"""Seeded benchmark workloads: token-id prompts with fixed output lengths."""

from __future__ import annotations

import random
from dataclasses import dataclass

# Ordinary vocabulary ids of SmolLM2 (below are byte and special tokens).
_TOKEN_LOW, _TOKEN_HIGH = 1000, 40000


@dataclass(frozen=True)
class BenchRequest:
    """One request: its prompt, its output length and (online) when it arrives."""

    prompt_token_ids: list[int]
    max_tokens: int
    arrival_s: float = 0.0
    cache_salt: str = ""
    final_only: bool = False  # the whole completion in one message (no time to first token)
    model: str = ""  # a LoRA adapter's name; "" for the base model


def _tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(_TOKEN_LOW, _TOKEN_HIGH) for _ in range(count)]


def offline_throughput(num_requests: int = 32, seed: int = 0) -> list[BenchRequest]:
    """W1, nano-vLLM's benchmark scaled to a CPU: prompts of 64-256 random tokens, outputs of
    32-128 tokens, all submitted at once."""
    rng = random.Random(seed)
    return [
        BenchRequest(_tokens(rng, rng.randint(64, 256)), rng.randint(32, 128))
        for _ in range(num_requests)
    ]


def shared_prefix(
    num_requests: int = 64, prefix_len: int = 512, question_len: int = 32, seed: int = 1
) -> list[BenchRequest]:
    """W2: one shared system prompt followed by a unique question; 32 output tokens each."""
    rng = random.Random(seed)
    prefix = _tokens(rng, prefix_len)
    return [BenchRequest(prefix + _tokens(rng, question_len), 32) for _ in range(num_requests)]


def online(rate_per_s: float, duration_s: float, seed: int = 2) -> list[BenchRequest]:
    """W3: Poisson arrivals at `rate_per_s` for `duration_s`; prompts 64-256, outputs 32-64."""
    rng = random.Random(seed)
    requests: list[BenchRequest] = []
    clock = rng.expovariate(rate_per_s)
    while clock < duration_s:
        requests.append(
            BenchRequest(_tokens(rng, rng.randint(64, 256)), rng.randint(32, 64), clock)
        )
        clock += rng.expovariate(rate_per_s)
    return requests


@dataclass(frozen=True)
class ManyPrefixes:
    """W4's requests and the system prompts they start with."""

    requests: list[BenchRequest]
    prefixes: list[list[int]]
    prefix_of: list[int]  # per request, the index of its prefix


def many_prefixes(num_prefixes: int = 16, per_prefix: int = 8, rate_per_s: float = 2.0,
                  seed: int = 4) -> ManyPrefixes:
    """W4: `num_prefixes` system prompts of 512-1024 tokens; `per_prefix` requests each with
    one of them plus its own 32-64-token suffix, outputs 32-64 tokens, in random order,
    arriving as a Poisson process at `rate_per_s`."""
    rng = random.Random(seed)
    prefixes = [_tokens(rng, rng.randint(512, 1024)) for _ in range(num_prefixes)]
    order = [index for index in range(num_prefixes) for _ in range(per_prefix)]
    rng.shuffle(order)
    requests: list[BenchRequest] = []
    clock = 0.0
    for index in order:
        clock += rng.expovariate(rate_per_s)
        requests.append(BenchRequest(prefixes[index] + _tokens(rng, rng.randint(32, 64)),
                                     rng.randint(32, 64), clock))
    return ManyPrefixes(requests, prefixes, order)
