"""Every invalid request is INVALID_ARGUMENT over real gRPC, before any work starts."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from gateway.client import PagewireClient
from gateway.sequence import SamplingConfig
from gateway.tokenizer import Tokenizer
from gateway.validation import InvalidRequest, Limits, check_identifiers, sampling_config
from protos import gateway_pb2
from tests.gateway.fake_runner import VOCAB
from tests.gateway.stack import Stack
from tests.helpers.services import ServiceProcess

MAX_MODEL_LEN = 2048


@pytest.fixture(scope="module")
def stack(tokenizer: Tokenizer, block_service: ServiceProcess) -> Iterator[Stack]:
    s = Stack(tokenizer, block_service, num_blocks=1024, epoch=21, max_n=4)
    yield s
    s.close()


OK_IDS = [11, 12, 13]
INVALID: list[tuple[str, dict[str, Any]]] = [
    ("empty token ids", {"token_ids": []}),
    ("empty text", {"prompt": ""}),
    ("empty messages", {"messages": []}),
    ("unknown role", {"messages": [("wizard", "hi")]}),
    ("token id = vocab", {"token_ids": [1, VOCAB]}),
    ("negative token id", {"token_ids": [1, -1]}),
    ("prompt at max_model_len", {"token_ids": [5] * MAX_MODEL_LEN}),
    ("max_tokens past max_model_len", {"max_tokens": MAX_MODEL_LEN}),
    ("max_tokens 0", {"max_tokens": 0}),
    ("negative temperature", {"temperature": -0.1}),
    ("nan temperature", {"temperature": math.nan}),
    ("infinite temperature", {"temperature": math.inf}),
    ("top_p 0", {"top_p": 0.0}),
    ("top_p above 1", {"top_p": 1.5}),
    ("top_p nan", {"top_p": math.nan}),
    ("top_k above vocab", {"top_k": VOCAB + 1}),
    ("min_p above 1", {"min_p": 1.01}),
    ("negative min_p", {"min_p": -0.5}),
    ("n 0", {"n": 0}),
    ("n above the limit", {"n": 5}),
    ("logprobs above 20", {"logprobs": 21}),
    ("empty stop string", {"stop": [""]}),
    ("stop token id outside the vocabulary", {"stop_token_ids": [VOCAB]}),
    ("presence penalty above 2", {"presence_penalty": 2.01}),
    ("presence penalty below -2", {"presence_penalty": -2.5}),
    ("nan presence penalty", {"presence_penalty": math.nan}),
    ("frequency penalty above 2", {"frequency_penalty": 3.0}),
    ("infinite frequency penalty", {"frequency_penalty": -math.inf}),
    ("repetition penalty 0", {"repetition_penalty": 0.0}),
    ("negative repetition penalty", {"repetition_penalty": -1.0}),
    ("repetition penalty above 2", {"repetition_penalty": 2.5}),
    ("nan repetition penalty", {"repetition_penalty": math.nan}),
    ("logit bias token = vocab", {"logit_bias": {VOCAB: 1.0}}),
    ("negative logit bias token", {"logit_bias": {-1: 1.0}}),
    ("nan logit bias", {"logit_bias": {5: math.nan}}),
    ("infinite logit bias", {"logit_bias": {5: math.inf}}),
    ("too many logit biases", {"logit_bias": {i: 1.0 for i in range(1025)}}),
]


def send(client: PagewireClient, case: dict[str, Any]) -> None:
    case = dict(case)
    if not {"token_ids", "prompt", "messages"} & case.keys():
        case["token_ids"] = OK_IDS
    client.complete(**case)


@pytest.mark.parametrize(("name", "case"), INVALID, ids=[name for name, _ in INVALID])
def test_invalid_request_is_invalid_argument_and_changes_nothing(
        stack: Stack, name: str, case: dict[str, Any]) -> None:
    batches_before = len(stack.runner.batches)
    stats_before = stack.stats()
    with pytest.raises(grpc.RpcError) as error:
        send(stack.client, case)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
    assert error.value.details()
    assert len(stack.runner.batches) == batches_before
    assert stack.stats().prompt_tokens == stats_before.prompt_tokens


def test_a_text_without_tokens_says_so(stack: Stack) -> None:
    # SmolLM2's vocabulary has no token for these control characters: the tokenizer drops them.
    with pytest.raises(grpc.RpcError) as error:
        stack.client.complete(prompt="\x04\x06", max_tokens=2)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "no tokens after tokenization" in (error.value.details() or "")


def test_no_input_at_all_is_invalid_argument(stack: Stack) -> None:
    with pytest.raises(grpc.RpcError) as error:
        list(stack.client.stub.Generate(gateway_pb2.GenerateRequest()))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_limits_themselves_are_accepted(stack: Stack) -> None:
    result = stack.client.complete(token_ids=[5] * (MAX_MODEL_LEN - 2), max_tokens=2,
                                   temperature=0, top_p=1.0, top_k=VOCAB, min_p=1.0, n=4,
                                   logprobs=20)
    assert [len(ids) for ids in result.token_ids] == [2, 2, 2, 2]


def _config(**fields: Any) -> SamplingConfig:
    limits = Limits(vocab_size=VOCAB, max_len=MAX_MODEL_LEN, max_n=4)
    return sampling_config(gateway_pb2.SamplingParams(**fields), 3, limits, random_seed=1)


def test_penalties_and_logit_bias_are_validated_clamped_and_sorted() -> None:
    assert _config().logit_bias == () and not _config().has_penalties
    config = _config(presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=2.0,
                     logit_bias={9: 1e30, 3: -250.0, 7: 0.5, 0: -100.0})
    assert (config.presence_penalty, config.frequency_penalty,
            config.repetition_penalty) == (-2.0, 2.0, 2.0)
    assert config.logit_bias == ((0, -100.0), (3, -100.0), (7, 0.5), (9, 100.0))
    assert config.has_penalties
    assert len(_config(logit_bias={i: 1.0 for i in range(1024)}).logit_bias) == 1024
    for name, message in (("presence_penalty", r"presence_penalty must be in \[-2, 2\]"),
                          ("repetition_penalty", r"repetition_penalty must be in \(0, 2\]")):
        with pytest.raises(InvalidRequest, match=message):
            _config(**{name: 3.0})
    with pytest.raises(InvalidRequest, match=r"logit_bias has 1025 entries"):
        _config(logit_bias={i: 1.0 for i in range(1025)})
    with pytest.raises(InvalidRequest, match=rf"logit_bias: token id {VOCAB} is outside"):
        _config(logit_bias={VOCAB: 1.0})


def test_penalised_request_is_served(stack: Stack) -> None:
    result = stack.client.complete(token_ids=OK_IDS, max_tokens=3, temperature=0,
                                   presence_penalty=2.0, frequency_penalty=-2.0,
                                   repetition_penalty=2.0, logit_bias={5: 1000.0})
    assert len(result.token_ids[0]) == 3
    batch = stack.runner.batches[-1]
    assert list(batch.logit_bias_token_ids) == [5]
    assert list(batch.logit_bias_values) == [100.0]  # clamped
    assert list(batch.repetition_penalties) == [2.0] and list(batch.prompt_lens) == [3]
    assert list(batch.penalty_history_lens) == list(batch.start_positions)
    assert stack.runner.penalty_rows > 0 and not stack.runner.penalty_error


def test_tokenize_matches_the_tokenizer(stack: Stack, tokenizer: Tokenizer) -> None:
    reply = stack.client.stub.Tokenize(gateway_pb2.TokenizeRequest(prompt="Hello world"))
    assert list(reply.token_ids) == tokenizer.encode("Hello world")
    assert "".join(reply.tokens).replace("Ġ", " ") == "Hello world"
    chat = stack.client.tokenize(messages=[("user", "Hi")])
    assert tokenizer.decode(chat, skip_special_tokens=False).endswith(
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_a_client_salt_cannot_pose_as_an_adapters() -> None:
    """An adapter request's prefixes are hashed under "lora:<digest>..." (gateway/adapters.py):
    a base request with such a salt could share, and read, an adapter's cached KV."""
    with pytest.raises(InvalidRequest, match="must not start with 'lora:'"):
        check_identifiers("", "lora:0123abcd")
    check_identifiers("", "team-lora:a")  # elsewhere in the salt it is only text

