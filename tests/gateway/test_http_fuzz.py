"""Hostile bodies over real HTTP: /v1/completions, /v1/chat/completions, /tokenize, /detokenize.

Each body is built from the endpoint's valid field set, then sent as it is (a valid body: it
must be served, 200), with some fields changed to junk (wrong types, out-of-range and huge
numbers, NaN / Infinity, nested junk, unknown and unserved fields, a field left out), or
replaced by bytes that are no JSON object (truncated or corrupted JSON, non-UTF-8, empty,
deep nesting, a body over the message limit). No answer may be a 5xx; a 200 of a
generation endpoint must have OpenAI's shape, and a streamed one end with `data: [DONE]`.
The fuzz counts the bodies that reached generation (a 200 from a completion endpoint, each
also counted as submitted to the engine) and those refused with a 4xx, and asserts both are
a fair share, so it demonstrably reaches the engine and the checks. Afterwards the gateway
must hold no block and no stream slot, and serve a request as the fake model's oracle says.
PAGEWIRE_FUZZ_EXAMPLES raises the example counts (`make fuzz`), as in test_fuzz.py.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.tokenizer import Tokenizer
from tests.gateway.conftest import SubmitCounter
from tests.gateway.fake_runner import VOCAB, expected_tokens
from tests.gateway.stack import BLOCK_SIZE, Stack
from tests.helpers.services import ServiceProcess, free_port

# 1000 in make test (the share checks hold from 50 on); make fuzz runs 20000.
EXAMPLES = int(os.environ.get("PAGEWIRE_FUZZ_EXAMPLES", "1000"))
MODEL = "fake"
NUM_BLOCKS = 64  # 256 tokens: prompt and output of each sequence fit, several at once
MAX_TOKENS = 4  # in valid bodies: each costs a few steps
LIMITS = dict(max_tokens_limit=16, max_prompt_tokens=NUM_BLOCKS * BLOCK_SIZE, max_n=8,
              max_num_seqs=8, max_num_batched_tokens=64)
GENERATION = ("/v1/completions", "/v1/chat/completions")
# Shares of the generation bodies that must reach the engine (200) and be refused (4xx).
MIN_SHARE = 0.10
MIN_EXAMPLES_FOR_SHARE = 50
BIG_BODY = b'{"prompt": "' + b"x" * (4 * 1024 * 1024 + 10) + b'"}'  # over the 4 MiB default


# ----- valid bodies ------------------------------------------------------------------------

# Short text of characters that take a token or two each: a chat of three messages stays
# well under the 256 tokens the gateway serves.
TEXT = st.text(st.characters(min_codepoint=32, max_codepoint=0x2FF), min_size=1, max_size=20)
TOKEN = st.integers(16, VOCAB - 1)
TOKEN_IDS = st.lists(TOKEN, min_size=1, max_size=8)
PROMPTS = st.one_of(TEXT, st.lists(TEXT, min_size=1, max_size=3), TOKEN_IDS,
                    st.lists(TOKEN_IDS, min_size=1, max_size=3))
ROLES = st.sampled_from(["system", "developer", "user", "assistant"])
CONTENT = st.one_of(TEXT, st.lists(st.builds(lambda t: {"type": "text", "text": t}, TEXT),
                                   min_size=1, max_size=2))
MESSAGES = st.lists(st.fixed_dictionaries({"role": ROLES, "content": CONTENT}), min_size=1,
                    max_size=3)
SAMPLING = {
    "model": st.just(MODEL),
    "temperature": st.one_of(st.just(0.0), st.floats(0, 2)),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 100),
    "min_p": st.floats(0, 1),
    "n": st.integers(1, 3),
    "seed": st.integers(-(2**63), 2**64 - 1),
    "stop": st.one_of(st.text(min_size=1, max_size=5),
                      st.lists(st.text(min_size=1, max_size=5), max_size=3)),
    "stop_token_ids": st.lists(TOKEN, max_size=3),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.1, 2),
    "logit_bias": st.dictionaries(st.builds(str, TOKEN), st.floats(-100, 100), max_size=3),
    "ignore_eos": st.booleans(),
    "user": st.text(max_size=20),
    "cache_salt": st.text(max_size=20),
}


@st.composite
def valid_completion(draw: st.DrawFn) -> dict[str, Any]:
    body = draw(st.fixed_dictionaries({"prompt": PROMPTS, "max_tokens": st.integers(1, MAX_TOKENS)},
                                      optional=SAMPLING))
    if draw(st.booleans()):
        body["echo"] = True
    elif draw(st.booleans()):
        body["logprobs"] = draw(st.integers(0, 5))
    _stream(draw, body)
    return body


@st.composite
def valid_chat(draw: st.DrawFn) -> dict[str, Any]:
    max_key = draw(st.sampled_from(["max_tokens", "max_completion_tokens"]))
    body = draw(st.fixed_dictionaries({"messages": MESSAGES,
                                       max_key: st.integers(1, MAX_TOKENS)}, optional=SAMPLING))
    if draw(st.booleans()):
        body["logprobs"] = True
        if draw(st.booleans()):
            body["top_logprobs"] = draw(st.integers(0, 5))
    _stream(draw, body)
    return body


def _stream(draw: st.DrawFn, body: dict[str, Any]) -> None:
    if draw(st.booleans()):
        body["stream"] = True
        if draw(st.booleans()):
            body["stream_options"] = {"include_usage": draw(st.booleans())}


VALID = {
    "/v1/completions": valid_completion(),
    "/v1/chat/completions": valid_chat(),
    "/tokenize": st.one_of(st.fixed_dictionaries({"prompt": TEXT},
                                                 optional={"model": st.just(MODEL)}),
                           st.fixed_dictionaries({"messages": MESSAGES})),
    "/detokenize": st.fixed_dictionaries({"tokens": st.lists(st.integers(0, VOCAB - 1),
                                                             min_size=1, max_size=10)},
                                         optional={"model": st.just(MODEL)}),
}

# ----- junk --------------------------------------------------------------------------------

HUGE_NUMBERS = st.sampled_from([
    -1, 0, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63) - 1,
    10**30, 10**300, -(10**300), 1e308, -1e308, 1e-320, 0.5, -0.0, 3.4e38, 3.5e38,
    float("nan"), float("inf"), float("-inf"),  # sent as NaN / Infinity / -Infinity
])
SCALARS = st.one_of(st.none(), st.booleans(), HUGE_NUMBERS, st.integers(), st.floats(),
                    st.text(max_size=30),
                    st.sampled_from(["", "fake", "x" * 70_000, "\x00", "\ud800", "a\udfffb"]))
JUNK = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=10)
FIELD_NAMES = st.sampled_from([
    # the served fields
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
    "top_p", "top_k", "min_p", "n", "seed", "stop", "stop_token_ids", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "logit_bias", "ignore_eos", "user", "echo",
    "logprobs", "top_logprobs", "stream", "stream_options", "cache_salt", "tokens",
    # unserved and unknown ones
    "tools", "tool_choice", "response_format", "suffix", "best_of", "functions", "store",
    "metadata", "service_tier", "audio", "modalities", "", "Prompt", "prompt ", "\x00",
])


@st.composite
def mutated(draw: st.DrawFn, body: dict[str, Any]) -> dict[str, Any]:
    body = dict(body)
    for _ in range(draw(st.integers(1, 3))):
        action = draw(st.sampled_from(["set", "set", "set", "drop", "nest"]))
        if action == "drop" and body:
            body.pop(draw(st.sampled_from(sorted(body))))
        elif action == "nest" and isinstance(body.get("messages"), list) and body["messages"] \
                and isinstance(body["messages"][0], dict):
            messages = list(body["messages"])
            messages[0] = {**messages[0], draw(st.sampled_from(["role", "content", "name"])):
                           draw(JUNK)}
            body["messages"] = messages
        else:
            body[draw(FIELD_NAMES)] = draw(JUNK)
    return body


def _corrupt(data: bytes, position: int, byte: int) -> bytes:
    position %= max(1, len(data))
    return data[:position] + bytes([byte]) + data[position + 1:]


def raw_junk(valid_bytes: bytes) -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.sampled_from([b"", b"{", b"}", b"null", b"[]", b"true", b"0", b'"x"',
                         b'{"prompt": NaN}', b'{"prompt": "x", "max_tokens": Infinity}',
                         b"\xff\xfe\x00", b"\xef\xbb\xbf{}", b'{"prompt": "\xc3\x28"}',
                         b'{"a": 1} {"b": 2}', b"[" * 100_000, b'{"n": 1' + b"0" * 5000 + b"}",
                         BIG_BODY]),
        st.binary(max_size=200),
        st.builds(lambda n: valid_bytes[:n], st.integers(0, max(0, len(valid_bytes) - 1))),
        st.builds(lambda p, b: _corrupt(valid_bytes, p, b), st.integers(0, 10_000),
                  st.sampled_from([0x00, 0x22, 0x7B, 0x5D, 0x80, 0xC3, 0xFF])),
    )


@dataclass(frozen=True)
class Body:
    path: str
    data: bytes
    kind: str  # valid / mutated / raw
    choices: int  # choices of a 200 answer to a valid generation body (0: not known)


def _choices(path: str, body: dict[str, Any]) -> int:
    n = body.get("n", 1)
    if path == "/v1/chat/completions":
        return int(n)
    prompt = body["prompt"]
    many = isinstance(prompt, list) and not isinstance(prompt[0], int)
    return int(n) * (len(prompt) if many else 1)


@st.composite
def bodies(draw: st.DrawFn, paths: tuple[str, ...]) -> Body:
    path = draw(st.sampled_from(paths))
    body = draw(VALID[path])
    kind = draw(st.sampled_from(["valid", "valid", "mutated", "mutated", "raw"]))
    if kind == "valid":
        choices = _choices(path, body) if path in GENERATION else 0
        return Body(path, json.dumps(body).encode(), kind, choices)
    if kind == "mutated":
        return Body(path, json.dumps(draw(mutated(body))).encode(), kind, 0)
    return Body(path, draw(raw_junk(json.dumps(body).encode())), kind, 0)


# ----- running them ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stack(tokenizer: Tokenizer, block_service: ServiceProcess) -> Iterator[Stack]:
    s = Stack(tokenizer, block_service, num_blocks=NUM_BLOCKS, epoch=47, http_port=free_port(),
              **LIMITS)
    yield s
    s.close()


@pytest.fixture(scope="module")
def http(stack: Stack) -> Iterator[httpx.Client]:
    with stack.http_client() as client:
        yield client


def run_examples(share: float, strategy: st.SearchStrategy[Body],
                 body: Callable[[Body], None]) -> int:
    """Runs `body` on Hypothesis examples and returns how many ran, asserting that it is
    every example the settings allow (a shortfall means a strategy went wrong)."""
    config = settings(max_examples=max(1, int(EXAMPLES * share)), deadline=None,
                      database=None, suppress_health_check=list(HealthCheck))
    runs = 0

    @config
    @given(example=strategy)
    def run(example: Body) -> None:
        nonlocal runs
        runs += 1
        body(example)

    run()
    assert runs == config.max_examples, f"ran {runs} examples of {config.max_examples}"
    return runs


def check_generation(example: Body, response: httpx.Response) -> None:
    """A 200 of /v1/completions or /v1/chat/completions: OpenAI's shape, whole or streamed."""
    chat = example.path == "/v1/chat/completions"
    if response.headers["content-type"].startswith("text/event-stream"):
        text = response.text
        assert text.endswith("data: [DONE]\n\n"), text[-300:]
        events = text.split("\n\n")[:-2]
        chunks = [json.loads(e.removeprefix("data: ")) for e in events]
        assert all("error" not in c for c in chunks), chunks
        assert len({c["id"] for c in chunks}) <= 1
        indexes = {ch["index"] for c in chunks for ch in c["choices"]}
        finished = [ch["index"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
        assert sorted(finished) == sorted(indexes), chunks
    else:
        answer = response.json()
        assert answer["object"] == ("chat.completion" if chat else "text_completion")
        indexes = {c["index"] for c in answer["choices"]}
        assert all(c["finish_reason"] in ("stop", "length") for c in answer["choices"])
        usage = answer["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert usage["prompt_tokens"] > 0
    assert indexes == set(range(len(indexes)))
    if example.choices:
        assert len(indexes) == example.choices


def send(http: httpx.Client, example: Body) -> httpx.Response:
    return http.post(example.path, content=example.data,
                     headers={"content-type": "application/json"})


def assert_serving_and_clean(stack: Stack, http: httpx.Client) -> None:
    stats = stack.wait_idle()
    assert (stats.used_blocks, stats.num_sequences) == (0, 0), stats
    assert stack.gateway.http is not None
    streams = stack.gateway.http.api.streams
    deadline = time.monotonic() + 5
    while streams.open_streams and time.monotonic() < deadline:
        time.sleep(0.01)
    assert streams.open_streams == 0, "a stream slot leaked"
    assert http.get("/health").json() == {"status": "SERVING"}
    prompt = list(range(300, 310))
    response = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": MAX_TOKENS,
                                                  "temperature": 0, "logprobs": 0})
    assert response.status_code == 200, response.text
    tokens = response.json()["choices"][0]["logprobs"]["tokens"]
    expected = expected_tokens(prompt, MAX_TOKENS)
    assert tokens == [stack.gateway.tokenizer.decode([t], skip_special_tokens=False)
                      for t in expected]


def send_and_tally(http: httpx.Client, example: Body, outcomes: Counter[str]
                   ) -> httpx.Response:
    """Sends one body and counts its outcome; no body gets a 5xx, no valid one is refused."""
    response = send(http, example)
    status = response.status_code
    outcomes[f"{example.kind} {status}"] += 1
    assert status < 500, f"{status} for {example.data[:300]!r}: {response.text[:300]}"
    if example.kind == "valid":
        assert status == 200, f"a valid body was refused: {response.text[:300]}"
    return response


def test_generation_endpoints_with_hostile_bodies(stack: Stack, submits: SubmitCounter,
                                                  http: httpx.Client) -> None:
    outcomes: Counter[str] = Counter()
    submitted_before = submits.count

    def run(example: Body) -> None:
        response = send_and_tally(http, example, outcomes)
        if response.status_code == 200:
            check_generation(example, response)
        else:
            assert 400 <= response.status_code < 500
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}

    runs = run_examples(0.75, bodies(GENERATION), run)
    reached = sum(count for key, count in outcomes.items() if key.endswith(" 200"))
    refused = runs - reached
    assert submits.count - submitted_before >= reached  # each 200 submitted 1+ requests
    if runs >= MIN_EXAMPLES_FOR_SHARE:
        assert reached >= MIN_SHARE * runs, f"{reached} of {runs} were served: {outcomes}"
        assert refused >= MIN_SHARE * runs, f"{refused} of {runs} were refused: {outcomes}"
    assert_serving_and_clean(stack, http)


def test_tokenize_endpoints_with_hostile_bodies(stack: Stack, http: httpx.Client) -> None:
    outcomes: Counter[str] = Counter()

    def run(example: Body) -> None:
        send_and_tally(http, example, outcomes)

    runs = run_examples(0.25, bodies(("/tokenize", "/detokenize")), run)
    served = sum(count for key, count in outcomes.items() if key.endswith(" 200"))
    if runs >= MIN_EXAMPLES_FOR_SHARE:
        assert MIN_SHARE * runs <= served <= (1 - MIN_SHARE) * runs, outcomes
    assert_serving_and_clean(stack, http)
