"""The OpenAI HTTP API end to end: a gateway process with --http-port over a runner of a small
random model. Greedy outputs over HTTP equal the same requests over gRPC, whose token ids
equal transformers' generate; alone and in a mixed concurrent batch."""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from tests.e2e.oracle import generate, greedy, greedy_openai_penalties
from tests.faults.conftest import VOCAB_HIGH, VOCAB_LOW, Cluster
from tests.helpers.services import GatewayProcess, free_port
from tests.helpers.tiny_models import make_tiny_model

MAX_TOKENS = 12
MODEL_NAME = "tiny-qwen2"


@dataclass
class HttpStack:
    cluster: Cluster
    gateway: GatewayProcess
    client: openai.OpenAI
    model: Path


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpStack]:
    root = tmp_path_factory.mktemp("http_e2e")
    model = make_tiny_model("qwen2", root / "qwen2")
    logs = root / "logs"
    logs.mkdir()
    cluster = Cluster(logs, model)
    http_port = free_port()
    try:
        cluster.start_runners(1)
        [gateway] = cluster.start_gateways(1, "--http-port", str(http_port),
                                           "--served-model-name", MODEL_NAME)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="none",
                               max_retries=0, timeout=120)
        yield HttpStack(cluster, gateway, client, model)
        client.close()
    finally:
        cluster.close()


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(rng.randint(4, 40))]
            for _ in range(count)]


def _http_completion(stack: HttpStack, prompt: list[int], stream: bool) -> tuple[str, int]:
    """Text and completion tokens of a greedy /v1/completions request."""
    if not stream:
        answer = stack.client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"ignore_eos": True})
        assert answer.usage is not None and answer.usage.prompt_tokens == len(prompt)
        return answer.choices[0].text, answer.usage.completion_tokens
    texts = []
    usage = None
    for chunk in stack.client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
        texts.extend(choice.text for choice in chunk.choices)
        usage = chunk.usage or usage
    assert usage is not None
    return "".join(texts), usage.completion_tokens


def test_greedy_completions_over_http_equal_grpc_and_transformers(stack: HttpStack) -> None:
    grpc_client = stack.gateway.client
    for i, prompt in enumerate(_prompts(4, seed=1)):
        expected_ids = greedy(prompt, MAX_TOKENS, model=stack.model)
        over_grpc = grpc_client.complete(token_ids=prompt, max_tokens=MAX_TOKENS,
                                         temperature=0, ignore_eos=True)
        assert over_grpc.token_ids[0] == expected_ids  # the outside oracle
        text, completion_tokens = _http_completion(stack, prompt, stream=i % 2 == 1)
        assert text == over_grpc.texts[0]
        assert completion_tokens == MAX_TOKENS


def test_concurrent_http_requests_equal_each_alone(stack: HttpStack) -> None:
    """A mixed batch (streamed and whole, text and token prompts) gives each request the
    tokens it gets alone (transformers' greedy tokens)."""
    prompts = _prompts(8, seed=2)
    alone = []
    for prompt in prompts:
        over_grpc = stack.gateway.client.complete(token_ids=prompt, max_tokens=MAX_TOKENS,
                                                  temperature=0, ignore_eos=True)
        assert over_grpc.token_ids[0] == greedy(prompt, MAX_TOKENS, model=stack.model)
        alone.append(over_grpc.texts[0])
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda ip: _http_completion(stack, ip[1], stream=ip[0] % 2 == 0),
                                enumerate(prompts)))
    assert [text for text, _ in answers] == alone
    assert all(completion_tokens == MAX_TOKENS for _, completion_tokens in answers)


def test_chat_over_http_equals_grpc_chat(stack: HttpStack) -> None:
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name three colours."}]
    over_grpc = stack.gateway.client.complete(
        messages=[(m["role"], m["content"]) for m in messages], max_tokens=MAX_TOKENS,
        temperature=0, ignore_eos=True)
    prompt_ids = stack.gateway.client.tokenize(
        messages=[(m["role"], m["content"]) for m in messages])
    assert over_grpc.token_ids[0] == greedy(prompt_ids, MAX_TOKENS, model=stack.model)
    answer = stack.client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_completion_tokens=MAX_TOKENS, temperature=0,
        extra_body={"ignore_eos": True})
    assert answer.choices[0].message.content == over_grpc.texts[0]
    assert answer.usage is not None and answer.usage.prompt_tokens == len(prompt_ids)
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in stack.client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
            stream=True, extra_body={"ignore_eos": True})
        if chunk.choices)
    assert streamed == over_grpc.texts[0]


def test_penalties_and_logit_bias_over_http_equal_the_oracles(stack: HttpStack) -> None:
    """OpenAI's penalties and logit_bias, and the repetition_penalty extra, as the openai client
    sends them, reach the sampler: greedy outputs equal transformers' generate
    (repetition_penalty) and a reference loop of OpenAI's formula."""
    prompts = _prompts(3, seed=3)
    changed = 0
    for prompt in prompts:
        repeated = generate(prompt, MAX_TOKENS, model=stack.model, repetition_penalty=0.5)
        changed += repeated != greedy(prompt, MAX_TOKENS, model=stack.model)
        over_grpc = stack.gateway.client.complete(token_ids=prompt, max_tokens=MAX_TOKENS,
                                                  temperature=0, repetition_penalty=0.5)
        assert over_grpc.token_ids[0] == repeated
        answer = stack.client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"repetition_penalty": 0.5})
        assert answer.choices[0].text == over_grpc.texts[0]
    # Below 1 the penalty favours the prompt's tokens: the tiny model's decisive logits give way
    # (above 1 it never bites here: this model does not repeat itself).
    assert changed == len(prompts)

    prompt = prompts[0]
    first = greedy(prompt, 1, model=stack.model)[0]
    bias = {first: -100.0, VOCAB_LOW: 5.0}
    expected = greedy_openai_penalties(prompt, MAX_TOKENS, presence_penalty=1.5,
                                       frequency_penalty=0.7, logit_bias=bias,
                                       model=stack.model)
    over_grpc = stack.gateway.client.complete(
        token_ids=prompt, max_tokens=MAX_TOKENS, temperature=0, presence_penalty=1.5,
        frequency_penalty=0.7, logit_bias=bias)
    assert over_grpc.token_ids[0] == expected
    assert expected[0] != first  # the bias bites
    answer = stack.client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
        presence_penalty=1.5, frequency_penalty=0.7,
        logit_bias={str(token): value for token, value in bias.items()})
    assert answer.choices[0].text == over_grpc.texts[0]
