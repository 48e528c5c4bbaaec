"""Preemption end to end: a KV pool too small for 16 concurrent requests; outputs still equal
transformers' greedy generate (with repetition_penalty for every other request: the runner
keeps no history, so a recomputed sequence must be penalised exactly as before), and the
gateway reports the preemptions it made."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from common.model_store import resolve_model
from gateway.tokenizer import Tokenizer
from tests.e2e.conftest import BLOCK_SIZE, Backend, Services
from tests.e2e.oracle import generate, greedy
from tests.e2e.prompts import PROMPTS
from tests.helpers.services import ServiceProcess

MAX_TOKENS = 24
NUM_BLOCKS = 12  # 192 tokens for 16 requests of ~10 prompt + 24 output tokens (~550)
MAX_MODEL_LEN = 128  # what one sequence may use: 8 of the 12 blocks
REPETITION_PENALTY = 1.3  # for the odd-numbered prompts


def test_small_pool_forces_preemption_and_outputs_stay_exact(
        services: Services, block_service: ServiceProcess, block_stub) -> None:  # type: ignore[no-untyped-def]
    runner = services.runner(num_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN).wait_serving(300)
    backend = Backend(runner, block_stub)
    assert backend.info().num_blocks <= NUM_BLOCKS
    gateway = services.gateway(block_service, runner)
    tokenizer = Tokenizer(resolve_model(None))
    penalties = [REPETITION_PENALTY if i % 2 else 1.0 for i in range(len(PROMPTS))]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(
            lambda p, r: gateway.client.complete(p, max_tokens=MAX_TOKENS, temperature=0,
                                                 ignore_eos=True, repetition_penalty=r),
            PROMPTS, penalties))
    assert gateway.metric("pagewire_gateway_preemptions_total") > 0
    for prompt, result, penalty in zip(PROMPTS, results, penalties, strict=True):
        ids = tokenizer.encode(prompt)
        expected = (greedy(ids, MAX_TOKENS) if penalty == 1.0
                    else generate(ids, MAX_TOKENS, repetition_penalty=penalty))
        # ignore_eos: pagewire goes on past an EOS where transformers stops.
        assert result.token_ids[0][:len(expected)] == expected, prompt
        assert len(result.token_ids[0]) == MAX_TOKENS
    deadline = time.monotonic() + 10
    while backend.stats().used_blocks and time.monotonic() < deadline:
        time.sleep(0.05)  # the last frees ride on the gateway's next step
    stats = backend.stats()
    assert stats.used_blocks == 0 and stats.no_space > 0
    assert sum(len(tokenizer.encode(p)) + MAX_TOKENS for p in PROMPTS) > BLOCK_SIZE * NUM_BLOCKS
