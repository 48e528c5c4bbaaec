"""pagewire as a cluster, end to end: runners register themselves with the block service
(--block-service), gateways started without --runner serve every registered runner, and the
block service's Route places each request (prefix policy). Greedy outputs equal transformers'
generate for each prompt alone, wherever the request ran."""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from common.model_store import resolve_model
from gateway.client import Completion
from gateway.tokenizer import ChatMessage, Tokenizer
from protos import block_pb2
from tests.e2e.conftest import MAX_MODEL_LEN, Backend, Services
from tests.e2e.oracle import greedy
from tests.e2e.prompts import PROMPTS
from tests.faults.conftest import BLOCK_SIZE, VOCAB_HIGH, VOCAB_LOW, Cluster, wait_for
from tests.helpers.services import ServiceProcess
from tests.helpers.tiny_models import make_tiny_model

MAX_TOKENS = 32
PREFIX_TOKENS = 160  # shared by NUM_SHARED prompts: 10 full blocks
NUM_SHARED = 6
NUM_UNRELATED = 18
SMOL_MAX_TOKENS = 16  # the default model is slow on two cores


def random_tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(count)]


@pytest.fixture
def tiny_cluster(tmp_path: Path) -> Iterator[Cluster]:
    """Two runners of a small random Qwen3 and two gateways serving both."""
    model = make_tiny_model("qwen3", tmp_path / "qwen3")
    logs = tmp_path / "logs"
    logs.mkdir()
    cluster = Cluster(logs, model)
    try:
        cluster.start_runners(2)
        cluster.start_gateways(2)
        yield cluster
    finally:
        cluster.close()


def test_two_runners_two_gateways_place_by_prefix_and_equal_transformers(
        tiny_cluster: Cluster) -> None:
    cluster = tiny_cluster
    rng = random.Random(7)
    prefix = random_tokens(rng, PREFIX_TOKENS)
    warm_up, *shared = [prefix + random_tokens(rng, rng.randint(3, 8))
                        for _ in range(NUM_SHARED + 1)]
    unrelated = [random_tokens(rng, rng.randint(8, 40)) for _ in range(NUM_UNRELATED)]
    runners = cluster.runners

    def expected(prompt: list[int]) -> list[int]:
        return greedy(prompt, MAX_TOKENS, cluster.model)

    # The warm-up computes the prefix on one runner, which then holds it in its cache.
    before = {r.address: cluster.stats(r) for r in runners}
    first = cluster.gateways[0].client.complete(token_ids=warm_up, max_tokens=MAX_TOKENS,
                                                temperature=0)
    assert first.token_ids[0] == expected(warm_up)
    grew = [r for r in runners
            if cluster.stats(r).prompt_tokens > before[r.address].prompt_tokens]
    assert len(grew) == 1, "the warm-up ran on one runner"
    holder = grew[0]
    other = next(r for r in runners if r is not holder)

    # 24 streams at once, shared-prefix and unrelated ones mixed, over both gateways.
    prompts = [*shared, *unrelated]
    order = list(range(len(prompts)))
    rng.shuffle(order)
    before = {r.address: cluster.stats(r) for r in runners}

    def run(slot: int) -> Completion:
        gateway = cluster.gateways[slot % len(cluster.gateways)]
        return gateway.client.complete(token_ids=prompts[order[slot]],
                                       max_tokens=MAX_TOKENS, temperature=0)

    with ThreadPoolExecutor(len(prompts)) as pool:
        by_slot = list(pool.map(run, range(len(prompts))))
    results: list[Completion] = [Completion()] * len(prompts)
    for slot, result in enumerate(by_slot):
        results[order[slot]] = result
    after = {r.address: cluster.stats(r) for r in runners}

    for i, (prompt, result) in enumerate(zip(prompts, results, strict=True)):
        assert result.token_ids[0] == expected(prompt), f"prompt {i}"
        assert result.usage is not None and result.usage.prompt_tokens == len(prompt)
    # Every shared-prefix request ran where the prefix is cached: its full blocks were hits.
    full_prefix = PREFIX_TOKENS // BLOCK_SIZE * BLOCK_SIZE
    for i, result in enumerate(results[:NUM_SHARED]):
        assert result.usage is not None
        assert result.usage.cached_tokens >= full_prefix, f"shared prompt {i} missed the cache"

    def grown(runner: ServiceProcess, counter: str) -> int:
        return int(getattr(after[runner.address], counter)
                   - getattr(before[runner.address], counter))

    assert grown(holder, "cached_prompt_tokens") >= NUM_SHARED * full_prefix
    assert grown(other, "cached_prompt_tokens") == 0  # nothing of the prefix went there
    # The unrelated requests spread over both runners (each prompt allocated once).
    unrelated_tokens = sum(len(p) for p in unrelated)
    on_holder = grown(holder, "prompt_tokens") - sum(len(p) for p in shared)
    on_other = grown(other, "prompt_tokens")
    assert on_holder + on_other == unrelated_tokens
    assert min(on_holder, on_other) >= unrelated_tokens / 4, (on_holder, on_other)
    for runner in runners:
        stats = cluster.wait_idle(runner)
        assert stats.used_blocks == 0 and stats.num_sequences == 0, stats


def test_default_model_two_runners_one_gateway_equal_transformers(
        services: Services, block_service: ServiceProcess, block_stub) -> None:  # type: ignore[no-untyped-def]
    # --linear-backend plain: no GEMM tuning at start (~10 s a runner on two cores).
    runners = [services.runner(64, MAX_MODEL_LEN, "--block-service", block_service.address,
                               "--num-threads", "1", "--linear-backend", "plain")
               for _ in range(2)]
    for runner in runners:
        runner.wait_serving(300)
    wait_for(lambda: {r.address for r in runners} <= {
        r.pool.address for r in block_stub.ListRunners(block_pb2.ListRunnersRequest()).runners
    }, 10)
    gateway = services.gateway(block_service, None)  # serves every registered runner
    tokenizer = Tokenizer(resolve_model(None))
    chats = [[("user", "What is the capital of Italy?")],
             [("user", "Name one primary color.")]]
    requests = [{"prompt": PROMPTS[0]}, {"prompt": PROMPTS[4]},
                *({"messages": chat} for chat in chats)]
    with ThreadPoolExecutor(len(requests)) as pool:
        results = list(pool.map(
            lambda kwargs: gateway.client.complete(max_tokens=SMOL_MAX_TOKENS, temperature=0,
                                                   **kwargs), requests))
    prompt_ids = [tokenizer.encode(PROMPTS[0]), tokenizer.encode(PROMPTS[4]),
                  *(tokenizer.encode_chat([ChatMessage(*m) for m in chat]) for chat in chats)]
    for ids, result in zip(prompt_ids, results, strict=True):
        assert result.token_ids[0] == greedy(ids, SMOL_MAX_TOKENS), tokenizer.decode(ids)
    backends = [Backend(runner, block_stub) for runner in runners]
    # Placed on both runners (equal load: they take turns), and every block free after.
    assert all(backend.stats().prompt_tokens > 0 for backend in backends)
    for backend in backends:
        wait_for(lambda backend=backend: backend.stats().used_blocks == 0, 10)
        assert backend.stats().num_sequences == 0
