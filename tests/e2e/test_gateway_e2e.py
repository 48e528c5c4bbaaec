"""pagewire end to end: block service, runner and gateways as processes, default model,
float32; greedy outputs are compared with transformers' generate on the same weights."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from common.model_store import resolve_model
from gateway.client import collect
from gateway.tokenizer import Tokenizer
from tests.e2e.conftest import MAX_MODEL_LEN, Backend, GatewayProcess, Services
from tests.e2e.oracle import greedy
from tests.e2e.prompts import PROMPTS
from tests.helpers.services import ServiceProcess

MAX_TOKENS = 16
CHUNK_TOKENS = 16


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(resolve_model(None))


@pytest.fixture(scope="module")
def backend(services: Services, block_service: ServiceProcess, block_stub) -> Backend:  # type: ignore[no-untyped-def]
    runner = services.runner(num_blocks=256).wait_serving(300)
    return Backend(runner, block_stub)


@pytest.fixture(scope="module")
def gateway_a(services: Services, block_service: ServiceProcess,
              backend: Backend) -> GatewayProcess:
    return services.gateway(block_service, backend.runner)


@pytest.fixture(scope="module")
def gateway_b(services: Services, block_service: ServiceProcess,
              backend: Backend) -> GatewayProcess:
    """A second gateway on the same pool, prefilling in chunks of 16 tokens (and so running
    at most 16 sequences: every decode must fit in a step's budget)."""
    return services.gateway(block_service, backend.runner,
                            "--max-num-batched-tokens", str(CHUNK_TOKENS),
                            "--max-num-seqs", str(CHUNK_TOKENS))


def wait_idle(backend: Backend, timeout_s: float = 10.0) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        used = backend.stats().used_blocks
        if used == 0 or time.monotonic() > deadline:
            return used
        time.sleep(0.05)


def test_sixteen_concurrent_streams_equal_transformers(
        gateway_a: GatewayProcess, tokenizer: Tokenizer, backend: Backend) -> None:
    # Every other request asks for the whole completion in one message.
    final_only = [i % 2 == 0 for i in range(len(PROMPTS))]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(
            lambda p, f: gateway_a.client.complete(p, max_tokens=MAX_TOKENS, temperature=0,
                                                   final_only=f),
            PROMPTS, final_only))
    for prompt, result, final in zip(PROMPTS, results, final_only, strict=True):
        expected = greedy(tokenizer.encode(prompt), MAX_TOKENS)
        assert result.token_ids[0] == expected, prompt
        assert result.texts[0] == tokenizer.decode(expected)
        assert result.num_messages == (1 if final else len(expected))  # streamed: per token
        assert result.usage.prompt_tokens == len(tokenizer.encode(prompt))
        assert result.usage.completion_tokens == len(expected)
    assert gateway_a.metric("pagewire_gateway_batch_sequences_sum") > gateway_a.metric(
        "pagewire_gateway_batch_sequences_count")  # some batches held several sequences
    assert wait_idle(backend) == 0


def test_chunked_prefill_equals_transformers(
        gateway_b: GatewayProcess, tokenizer: Tokenizer) -> None:
    long_prompt = " ".join(PROMPTS[:10])  # 77 tokens: five chunks of 16
    prompts = [long_prompt, PROMPTS[6], PROMPTS[7]]
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(
            lambda p: gateway_b.client.complete(p, max_tokens=8, temperature=0), prompts))
    assert len(tokenizer.encode(long_prompt)) > 3 * CHUNK_TOKENS
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids[0] == greedy(tokenizer.encode(prompt), 8), prompt
    # Every batch held at most 16 tokens.
    batches = gateway_b.metric("pagewire_gateway_batch_tokens_count")
    assert batches > 0
    assert gateway_b.metric('pagewire_gateway_batch_tokens_bucket{le="16.0"}') == batches


def test_second_gateway_hits_the_prefix_cached_through_the_first(
        gateway_a: GatewayProcess, gateway_b: GatewayProcess, tokenizer: Tokenizer) -> None:
    prefix = ("You are a careful assistant. Answer briefly and precisely, and never make "
              "things up. If you do not know, say so. Question: ")
    first = gateway_a.client.complete(prefix + "What is the boiling point of water?",
                                      max_tokens=4, temperature=0)
    second_prompt = prefix + "Which ocean is the largest?"
    second = gateway_b.client.complete(second_prompt, max_tokens=6, temperature=0)
    assert first.usage.cached_tokens == 0
    assert second.usage.cached_tokens >= 16
    assert second.token_ids[0] == greedy(tokenizer.encode(second_prompt), 6)


def test_n3_sampling_is_reproducible_and_children_share_the_prompt_blocks(
        gateway_a: GatewayProcess, backend: Backend) -> None:
    params = dict(max_tokens=24, temperature=0.8, seed=1234, n=3, ignore_eos=True)
    prompt = "Write a sentence about the sea. It is a long prompt so that blocks are shared."
    stream = gateway_a.client.generate(prompt, **params)
    messages = [next(stream)]
    shared = backend.stats()
    messages.extend(stream)
    tokens = collect(messages).token_ids
    again = gateway_a.client.complete(prompt, **params)
    assert tokens == again.token_ids
    assert all(len(t) == 24 for t in tokens)
    assert len({tuple(t) for t in tokens}) > 1  # three seeds, (almost surely) three outputs
    # Mid-stream, the three outputs held the prompt's full blocks together.
    assert shared.num_sequences >= 3
    assert shared.total_refs > shared.used_blocks


def test_cancel_mid_stream_frees_every_block(
        gateway_a: GatewayProcess, backend: Backend) -> None:
    stream = gateway_a.client.generate("Count from one to one thousand: one, two,",
                                       max_tokens=400, temperature=0, ignore_eos=True)
    next(stream)
    next(stream)
    assert backend.stats().used_blocks > 0
    stream.cancel()
    assert wait_idle(backend) == 0
    assert backend.stats().num_sequences == 0


def test_stop_string_across_tokens_is_cut_with_everything_after(
        gateway_a: GatewayProcess, tokenizer: Tokenizer) -> None:
    prompt = PROMPTS[2]
    expected = greedy(tokenizer.encode(prompt), MAX_TOKENS)
    pieces = [tokenizer.decode([t]) for t in expected]
    # From the middle of one token's text to the start of the next token's text.
    index = next(i for i in range(3, len(pieces) - 1)
                 if len(pieces[i].strip()) >= 2 and pieces[i + 1].strip())
    stop = pieces[index][1:] + pieces[index + 1][:2]
    full_text = tokenizer.decode(expected)
    result = gateway_a.client.complete(prompt, max_tokens=MAX_TOKENS, temperature=0,
                                       stop=[stop])
    assert result.finish_reasons == ["stop"]
    assert result.texts[0] == full_text[:full_text.index(stop)]
    assert stop not in result.texts[0]


def test_stop_token_ids_max_tokens_and_eos(
        gateway_a: GatewayProcess, tokenizer: Tokenizer) -> None:
    prompt = PROMPTS[0]
    expected = greedy(tokenizer.encode(prompt), MAX_TOKENS)
    stopped = gateway_a.client.complete(prompt, max_tokens=MAX_TOKENS, temperature=0,
                                        stop_token_ids=[expected[3]])
    first_at = expected.index(expected[3])
    assert stopped.token_ids[0] == expected[:first_at + 1]
    assert stopped.finish_reasons == ["stop"]
    assert stopped.texts[0] == tokenizer.decode(expected[:first_at])
    short = gateway_a.client.complete(prompt, max_tokens=3, temperature=0)
    assert short.token_ids[0] == expected[:3] and short.finish_reasons == ["length"]
    # A chat answer ends with the model's end-of-sequence token.
    messages = [("user", "Say only the word: hello")]
    chat_ids = tokenizer.encode_chat([_message(*m) for m in messages])
    oracle = greedy(chat_ids, 48)
    eos = gateway_a.client.model_info().eos_token_ids
    assert oracle[-1] in eos  # the oracle ended with EOS: the case is meaningful
    answer = gateway_a.client.complete(messages=messages, max_tokens=48, temperature=0)
    assert answer.token_ids[0] == oracle
    assert answer.finish_reasons == ["stop"]
    assert answer.texts[0] == tokenizer.decode(oracle[:-1])


def _message(role: str, content: str):  # type: ignore[no-untyped-def]
    from gateway.tokenizer import ChatMessage

    return ChatMessage(role, content)


@pytest.mark.parametrize("params", [
    {"temperature": -1.0}, {"top_p": 0.0}, {"n": 0}, {"max_tokens": 0}, {"min_p": 2.0},
    {"logprobs": 21}, {"top_k": 10 ** 6}, {"max_tokens": MAX_MODEL_LEN},
])
def test_invalid_parameters_over_grpc(gateway_a: GatewayProcess, params: dict) -> None:  # type: ignore[type-arg]
    with pytest.raises(grpc.RpcError) as error:
        gateway_a.client.complete("Hello", **params)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_invalid_prompts_over_grpc(gateway_a: GatewayProcess) -> None:
    for kwargs in ({"token_ids": [1, 10 ** 6]}, {"token_ids": [7] * MAX_MODEL_LEN},
                   {"prompt": ""}, {"messages": [("robot", "hi")]}):
        with pytest.raises(grpc.RpcError) as error:
            gateway_a.client.complete(**kwargs)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, kwargs


def test_model_info_is_the_runner_s(gateway_a: GatewayProcess, backend: Backend) -> None:
    info = gateway_a.client.model_info()
    runner = backend.info()
    assert (info.vocab_size, info.max_model_len, info.num_blocks, info.block_size) == (
        runner.vocab_size, runner.max_model_len, runner.num_blocks, runner.block_size)
    assert info.dtype == "float32"


@pytest.fixture(autouse=True)
def _no_leak(backend: Backend) -> Iterator[None]:
    yield
    assert wait_idle(backend) == 0


def test_logprobs_of_greedy_tokens_are_the_top_ones(gateway_a: GatewayProcess) -> None:
    result = gateway_a.client.complete(PROMPTS[3], max_tokens=4, temperature=0, logprobs=3)
    assert len(result.logprobs[0]) == len(result.token_ids[0]) == 4
    for position, token in zip(result.logprobs[0], result.token_ids[0], strict=True):
        assert position.token.token_id == token
        assert position.token.logprob <= 0.0
        assert len(position.top) == 3
        assert position.top[0].token_id == token  # greedy picks the most likely token
        values = [t.logprob for t in position.top]
        assert values == sorted(values, reverse=True)
        assert abs(position.top[0].logprob - position.token.logprob) < 1e-4
