"""Hostile input over real gRPC: every GenerationService RPC, valid-shaped and raw bytes.

Each call must end with a status of the documented set (docs/security.md, "Hostile input"):
OK, INVALID_ARGUMENT (bad input, or bytes that do not parse) or RESOURCE_EXHAUSTED (a limit);
never UNKNOWN (an unhandled exception) or INTERNAL. The gateway keeps serving and leaves no
block referenced. PAGEWIRE_FUZZ_EXAMPLES raises the example counts (`make fuzz`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gateway.client import build_request
from gateway.tokenizer import Tokenizer
from protos import gateway_pb2
from tests.gateway.fake_runner import VOCAB, expected_tokens
from tests.gateway.stack import Stack
from tests.helpers.services import ServiceProcess

EXAMPLES = int(os.environ.get("PAGEWIRE_FUZZ_EXAMPLES", "2000"))
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
           grpc.StatusCode.RESOURCE_EXHAUSTED}
SERVICE = "/pagewire.gateway.v1.GenerationService/"
LIMITS = dict(max_tokens_limit=4, max_prompt_tokens=64, max_n=3, max_num_seqs=8,
              max_num_batched_tokens=64)


def fuzz_settings(share: float) -> settings:
    return settings(max_examples=max(1, int(EXAMPLES * share)), deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def stack(tokenizer: Tokenizer, block_service: ServiceProcess) -> Iterator[Stack]:
    s = Stack(tokenizer, block_service, num_blocks=64, epoch=31, **LIMITS)
    yield s
    # The service survived: a plain request is served right, and nothing stays referenced.
    prompt = [300, 301, 302]
    assert s.client.complete(token_ids=prompt, max_tokens=3, temperature=0).token_ids[0] == \
        expected_tokens(prompt, 3)
    assert s.wait_idle().used_blocks == 0
    s.close()


HOSTILE_FLOATS = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 0.0, 1.0, -1.0, 3.4e38, -3.4e38,
                     1e-45]),
    st.floats(width=32, allow_nan=True, allow_infinity=True),
)
U32 = st.one_of(st.sampled_from([0, 1, 2, 3, 4, 5, 2**31 - 1, 2**32 - 1]),
                st.integers(0, 2**32 - 1))
I32 = st.one_of(st.sampled_from([-(2**31), -1, 0, 1, VOCAB - 1, VOCAB, 2**31 - 1]),
                st.integers(-(2**31), 2**31 - 1), st.integers(0, 300))
TEXT = st.text(max_size=200)
# Around the limits of request_id (256 characters) and cache_salt (1024 bytes).
LONG_OR_SHORT = st.one_of(st.text(max_size=40), st.text(min_size=250, max_size=1100))
ROLES = st.one_of(st.sampled_from(["system", "user", "assistant", "", "tool", "USER",
                                   "user\x00"]), st.text(max_size=10))


@st.composite
def sampling_params(draw: st.DrawFn) -> gateway_pb2.SamplingParams:
    params = gateway_pb2.SamplingParams()
    for name, strategy in (("max_tokens", U32), ("temperature", HOSTILE_FLOATS),
                           ("top_p", HOSTILE_FLOATS), ("top_k", U32), ("min_p", HOSTILE_FLOATS),
                           ("seed", st.integers(0, 2**64 - 1)), ("n", U32),
                           ("logprobs", U32)):
        if draw(st.booleans()):
            setattr(params, name, draw(strategy))
    params.stop.extend(draw(st.lists(st.text(max_size=300), max_size=20)))
    params.stop_token_ids.extend(draw(st.lists(I32, max_size=20)))
    params.ignore_eos = draw(st.booleans())
    return params


@st.composite
def generate_requests(draw: st.DrawFn) -> gateway_pb2.GenerateRequest:
    request = gateway_pb2.GenerateRequest(request_id=draw(LONG_OR_SHORT),
                                          cache_salt=draw(LONG_OR_SHORT))
    which = draw(st.sampled_from(["prompt", "messages", "token_ids", "none"]))
    if which == "prompt":
        request.prompt = draw(TEXT)
    elif which == "messages":
        request.messages.SetInParent()
        for role, content in draw(st.lists(st.tuples(ROLES, TEXT), max_size=5)):
            request.messages.messages.add(role=role, content=content)
    elif which == "token_ids":
        request.prompt_token_ids.SetInParent()
        size = draw(st.sampled_from([0, 1, 5, 30, 64, 65, 2000]))
        request.prompt_token_ids.token_ids.extend(draw(st.lists(I32, min_size=size,
                                                                max_size=size)))
    if draw(st.booleans()):
        request.sampling_params.CopyFrom(draw(sampling_params()))
    return request


def _code(call: Any) -> grpc.StatusCode:
    """The status `call` ends with (asserted to be documented); an event for the statistics."""
    try:
        call()
    except grpc.RpcError as error:
        code = error.code()
        assert code in ALLOWED, f"{code}: {error.details()}"
    else:
        code = grpc.StatusCode.OK
    event(code.name)
    return code


@fuzz_settings(0.45)
@given(request=generate_requests())
def test_generate_with_hostile_requests(stack: Stack, request: gateway_pb2.GenerateRequest
                                        ) -> None:
    code = _code(lambda: list(stack.client.stub.Generate(request, timeout=30)))
    if request.sampling_params.HasField("max_tokens") and request.sampling_params.max_tokens > 4:
        assert code == grpc.StatusCode.INVALID_ARGUMENT  # over --max-tokens-limit


@fuzz_settings(0.15)
@given(prompt=st.one_of(TEXT, st.none()),
       messages=st.lists(st.tuples(ROLES, TEXT), max_size=5))
def test_tokenize_with_hostile_requests(stack: Stack, prompt: str | None,
                                        messages: list[tuple[str, str]]) -> None:
    request = gateway_pb2.TokenizeRequest()
    if prompt is not None:
        request.prompt = prompt
    elif messages:
        request.messages.CopyFrom(build_request(messages=messages).messages)
    _code(lambda: stack.client.stub.Tokenize(request, timeout=30))


@fuzz_settings(0.4)
@given(method=st.sampled_from(["Generate", "Tokenize", "GetModelInfo"]),
       data=st.one_of(st.binary(max_size=300),
                      st.sampled_from([b"\x12\x02\xff\xfe", b"\x0a\x03\xc3\x28\x41",
                                       b"\xff" * 10, b"\x22\x05\x08\xff\xff\xff\xff"])))
def test_raw_bytes_as_requests(stack: Stack, method: str, data: bytes) -> None:
    def identity(value: bytes) -> bytes:
        return value
    path = SERVICE + method
    channel = stack.client.channel
    if method == "Generate":
        call = channel.unary_stream(path, request_serializer=identity,
                                    response_deserializer=identity)
        _code(lambda: list(call(data, timeout=30)))
    else:
        unary = channel.unary_unary(path, request_serializer=identity,
                                    response_deserializer=identity)
        _code(lambda: unary(data, timeout=30))


def test_invalid_utf8_in_a_prompt_is_invalid_argument(stack: Stack) -> None:
    """A string field with invalid UTF-8 cannot be built as a proto: sent as raw bytes."""
    channel = stack.client.channel
    call = channel.unary_stream(SERVICE + "Generate", request_serializer=lambda b: b,
                                response_deserializer=lambda b: b)
    with pytest.raises(grpc.RpcError) as error:
        list(call(b"\x12\x02\xc3\x28", timeout=10))  # field 2 (prompt) = b"\xc3\x28"
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed GenerateRequest" in str(error.value.details())
