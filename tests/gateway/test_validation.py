"""Every invalid request is INVALID_ARGUMENT over real gRPC, before any work starts."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from gateway.client import PagewireClient
from gateway.tokenizer import Tokenizer
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


def test_tokenize_matches_the_tokenizer(stack: Stack, tokenizer: Tokenizer) -> None:
    reply = stack.client.stub.Tokenize(gateway_pb2.TokenizeRequest(prompt="Hello world"))
    assert list(reply.token_ids) == tokenizer.encode("Hello world")
    assert "".join(reply.tokens).replace("Ġ", " ") == "Hello world"
    chat = stack.client.tokenize(messages=[("user", "Hi")])
    assert tokenizer.decode(chat, skip_special_tokens=False).endswith(
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
