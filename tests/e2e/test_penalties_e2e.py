"""Presence / frequency / repetition penalties and logit bias through the three services
(default model, float32): greedy outputs equal transformers' generate with
repetition_penalty and a reference greedy loop of OpenAI's formula over transformers' logits;
a request's tokens are the same alone and in a mixed concurrent batch."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from common.model_store import resolve_model
from gateway.tokenizer import Tokenizer
from tests.e2e.conftest import Backend, GatewayProcess, Services
from tests.e2e.oracle import generate, greedy, greedy_openai_penalties
from tests.helpers.services import ServiceProcess

MAX_TOKENS = 12
# The first one's greedy continuation repeats tokens (so that every penalty changes it).
PROMPTS = ["def fibonacci(n):", "The quick brown fox"]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(resolve_model(None))


@pytest.fixture(scope="module")
def gateway(services: Services, block_service: ServiceProcess,
            block_stub) -> GatewayProcess:  # type: ignore[no-untyped-def]
    runner = services.runner(num_blocks=128).wait_serving(300)
    Backend(runner, block_stub)
    return services.gateway(block_service, runner)


def complete(gateway: GatewayProcess, prompt: str, **params: Any) -> list[int]:
    params.setdefault("max_tokens", MAX_TOKENS)
    result = gateway.client.complete(prompt, timeout=120, **params)
    return result.token_ids[0]


def test_greedy_repetition_penalty_equals_transformers_generate(
        gateway: GatewayProcess, tokenizer: Tokenizer) -> None:
    changed = 0
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        expected = generate(ids, MAX_TOKENS, repetition_penalty=1.3)
        assert complete(gateway, prompt, temperature=0, repetition_penalty=1.3) == expected
        changed += expected != greedy(ids, MAX_TOKENS)
    assert changed  # the penalty did change some output


def test_greedy_presence_frequency_penalties_equal_the_openai_formula(
        gateway: GatewayProcess, tokenizer: Tokenizer) -> None:
    changed = 0
    for prompt, presence, frequency in zip(PROMPTS, (1.0, 1.5), (1.0, -0.5), strict=True):
        ids = tokenizer.encode(prompt)
        expected = greedy_openai_penalties(ids, MAX_TOKENS, presence, frequency)
        got = complete(gateway, prompt, temperature=0, presence_penalty=presence,
                       frequency_penalty=frequency)
        assert got == expected, prompt
        changed += expected != greedy(ids, MAX_TOKENS)
    assert changed


def test_logit_bias_forces_and_forbids_tokens(gateway: GatewayProcess,
                                              tokenizer: Tokenizer) -> None:
    prompt = PROMPTS[1]
    ids = tokenizer.encode(prompt)
    forced = tokenizer.encode(" Paris")[0]
    assert complete(gateway, prompt, temperature=0, max_tokens=6,
                    logit_bias={forced: 100.0}) == [forced] * 6  # max_tokens overrides 16
    first = greedy(ids, 1)[0]
    got = complete(gateway, prompt, temperature=0, logit_bias={first: -100.0})
    assert got[0] != first
    assert got == greedy_openai_penalties(ids, MAX_TOKENS, logit_bias={first: -100.0})


CASES: list[dict[str, Any]] = [
    dict(temperature=0),
    dict(temperature=0, repetition_penalty=1.3),
    dict(temperature=0, presence_penalty=0.8, frequency_penalty=0.6),
    dict(temperature=0.8, seed=7, repetition_penalty=1.2, presence_penalty=0.5,
         logit_bias={13: 2.0}),
    dict(temperature=0.8, seed=7),
    dict(temperature=1.0, top_p=0.9, seed=11, frequency_penalty=1.0, ignore_eos=True),
]


def test_mixed_concurrent_batch_gives_each_request_its_tokens_alone(
        gateway: GatewayProcess) -> None:
    runs = [(PROMPTS[0], case) for case in CASES]
    alone = [complete(gateway, prompt, **case) for prompt, case in runs]
    with ThreadPoolExecutor(len(runs)) as pool:
        together = list(pool.map(lambda run: complete(gateway, run[0], **run[1]), runs))
    assert together == alone
    # Seeded sampling with penalties is reproducible, and differs from without them.
    assert complete(gateway, PROMPTS[0], **CASES[3]) == alone[3]
    assert alone[3] != alone[4]
    assert gateway.metric("pagewire_gateway_batch_sequences_sum") > gateway.metric(
        "pagewire_gateway_batch_sequences_count")  # some batches held several sequences
