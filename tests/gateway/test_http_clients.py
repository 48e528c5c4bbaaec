"""The clients people use, unchanged: the request bodies GuideLLM, `vllm bench serve`, the
`openai` SDK and LangChain send with their defaults (captured from the real clients:
tests/fixtures/client_bodies/README.md) are served with 2xx and well-formed answers; vLLM's
extras are taken at the values that ask for nothing and refused, naming the field, at any
other; every refusal leaves a log line and a count.

A real gateway (HTTP API on loopback) over the fake runner, serving the fixtures' model name.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from gateway import metrics, refusals
from gateway.tokenizer import Tokenizer
from protos import gateway_pb2
from tests.gateway.stack import Stack
from tests.helpers.services import ServiceProcess, free_port

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "client_bodies"
FIXTURE_FILES = sorted(FIXTURES.glob("*.json"))
MODEL = "SmolLM2-135M-Instruct"  # what the captured clients were told to ask for
# Headers a replay must not copy: the transport's own, and encodings httpx may not decode.
_SKIPPED_HEADERS = {"host", "content-length", "accept-encoding", "connection"}
MAX_NEW_TOKENS = 24


@pytest.fixture(scope="module")
def stack(tokenizer: Tokenizer, block_service: ServiceProcess) -> Iterator[Stack]:
    # The operator's cap on an unset max_tokens keeps the bodies that set none short (the
    # fake runner never ends an output by itself).
    s = Stack(tokenizer, block_service, num_blocks=256, epoch=43, http_port=free_port(),
              served_model_name=MODEL,
              override_generation_config={"max_new_tokens": MAX_NEW_TOKENS})
    yield s
    s.close()


@pytest.fixture(scope="module")
def http(stack: Stack) -> Iterator[httpx.Client]:
    with stack.http_client() as client:
        yield client


def replay(http: httpx.Client, fixture: dict[str, Any]) -> httpx.Response:
    """The captured request as its client sent it: method, path, headers and bytes."""
    headers = {k: v for k, v in fixture.get("headers", {}).items()
               if k.lower() not in _SKIPPED_HEADERS}
    raw = fixture.get("raw_body")
    return http.request(fixture["method"], fixture["path"], headers=headers,
                        content=raw.encode() if raw is not None else None)


def sse_chunks(text: str) -> list[dict[str, Any]]:
    """The JSON chunks of an event stream, checked to end with [DONE]."""
    events = [line.removeprefix("data: ") for line in text.split("\n\n") if line]
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(event) for event in events[:-1]]


def max_tokens_of(body: dict[str, Any]) -> int | None:
    return body.get("max_completion_tokens") or body.get("max_tokens")


@pytest.mark.parametrize("path", FIXTURE_FILES, ids=[p.stem for p in FIXTURE_FILES])
def test_captured_client_request_is_served(http: httpx.Client, path: Path) -> None:
    fixture = json.loads(path.read_text())
    response = replay(http, fixture)
    assert response.is_success, (response.status_code, response.text)
    body = fixture.get("body")
    if fixture["method"] == "GET":
        if fixture["path"] == "/v1/models":  # clients take the first entry's id
            assert response.json()["data"][0]["id"] == MODEL
        return
    chat = fixture["path"] == "/v1/chat/completions"
    wanted = max_tokens_of(body) or MAX_NEW_TOKENS
    if not body.get("stream"):
        answer = response.json()
        assert answer["model"] == MODEL and answer["choices"]
        first = answer["choices"][0]
        assert (first["message"]["content"] if chat else first["text"])
        assert answer["usage"]["completion_tokens"] == wanted * body.get("n", 1)
        return
    chunks = sse_chunks(response.text)
    options = body.get("stream_options") or {}
    with_choices = [c for c in chunks if c["choices"]]
    assert with_choices and all(c["model"] == MODEL for c in chunks)
    if options.get("continuous_usage_stats"):
        # vLLM's continuous usage: the usage so far in every chunk, growing to the total.
        so_far = [c["usage"]["completion_tokens"] for c in with_choices]
        assert so_far == sorted(so_far) and so_far[0] >= 1
        assert all(c["usage"]["prompt_tokens"] > 0 and c["usage"]["total_tokens"] ==
                   c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"]
                   for c in with_choices)
    if options.get("include_usage"):
        usage = chunks[-1]["usage"]
        assert chunks[-1]["choices"] == [] and usage["completion_tokens"] >= 1
        if options.get("continuous_usage_stats"):
            assert so_far[-1] == usage["completion_tokens"]
        assert usage["completion_tokens"] == wanted
    else:
        assert all(c.get("usage") is None for c in chunks)


def test_the_captured_requests_cover_each_client() -> None:
    """The replays above have fixtures to replay (a glob that found nothing would prove
    nothing): every client's chat and completions bodies."""
    stems = {p.stem for p in FIXTURE_FILES}
    for client in ("guidellm", "openai_sdk", "vllm_bench"):
        assert {f"{client}__chat__stream", f"{client}__completions__stream"} <= stems, client
    assert {"langchain__chat__stream", "langchain__chat__nostream"} <= stems


def test_continuous_usage_is_each_chunk_s_choice_s_so_far(http: httpx.Client) -> None:
    """Two prompts, two outputs each: every chunk holds one choice, and its usage counts that
    choice's prompt and the tokens of that choice the client has received (counted from the
    chunks' logprobs, one entry per token)."""
    prompts = [[300 + i for i in range(5)], [400 + i for i in range(9)]]
    response = http.post("/v1/completions", json={
        "model": MODEL, "prompt": prompts, "n": 2, "max_tokens": 6, "logprobs": 0,
        "stream": True, "stream_options": {"include_usage": True,
                                           "continuous_usage_stats": True}})
    chunks = sse_chunks(response.text)
    received = [0] * 4
    for chunk in chunks[:-1]:
        [choice] = chunk["choices"]
        index = choice["index"]
        received[index] += len(choice["logprobs"]["tokens"])
        prompt = len(prompts[index // 2])
        assert chunk["usage"] == {"prompt_tokens": prompt, "completion_tokens": received[index],
                                  "total_tokens": prompt + received[index]}
    assert received == [6, 6, 6, 6]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 24
    assert chunks[-1]["usage"]["prompt_tokens"] == 5 + 9


# vLLM's extras at the values that ask for nothing (served), and at one that asks for
# something pagewire does not do (refused, naming the field).
NO_OP_EXTRAS: list[tuple[str, str, Any, Any]] = [
    ("both", "min_tokens", 0, 4),
    ("both", "use_beam_search", False, True),
    ("both", "length_penalty", 1.0, 0.5),
    ("both", "include_stop_str_in_output", False, True),
    ("both", "skip_special_tokens", True, False),
    ("both", "spaces_between_special_tokens", True, False),
    ("both", "priority", 0, 1),
    ("both", "prompt_logprobs", None, 1),
    ("both", "truncate_prompt_tokens", None, 8),
    ("both", "bad_words", [], ["no"]),
    ("both", "allowed_token_ids", None, [1, 2]),
    ("both", "verbosity", None, "low"),
    ("chat", "add_generation_prompt", True, False),
    ("chat", "continue_final_message", False, True),
    ("chat", "add_special_tokens", False, True),
    ("chat", "echo", False, True),
    ("chat", "chat_template_kwargs", {}, {"enable_thinking": False}),
    ("completions", "add_special_tokens", True, False),
]


def _request(http: httpx.Client, endpoint: str, extra: dict[str, Any]) -> httpx.Response:
    if endpoint == "chat":
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        path = "/v1/chat/completions"
    else:
        body = {"model": MODEL, "prompt": "hi"}
        path = "/v1/completions"
    return http.post(path, json={**body, "max_tokens": 2, **extra})


@pytest.mark.parametrize(("endpoints", "name", "no_op", "other"), NO_OP_EXTRAS,
                         ids=[f"{e}-{n}" for e, n, _, _ in NO_OP_EXTRAS])
def test_vllm_extras_are_served_at_their_no_op_value_and_refused_otherwise(
        http: httpx.Client, endpoints: str, name: str, no_op: Any, other: Any) -> None:
    for endpoint in (["chat", "completions"] if endpoints == "both" else [endpoints]):
        served = _request(http, endpoint, {name: no_op})
        assert served.status_code == 200, (endpoint, served.text)
        refused = _request(http, endpoint, {name: other})
        assert refused.status_code == 400, (endpoint, refused.text)
        error = refused.json()["error"]
        assert error["param"] == name and name in error["message"]


def test_stream_options_takes_its_two_fields_and_nothing_else(http: httpx.Client) -> None:
    refused = _request(http, "completions", {"stream": True, "stream_options": {
        "include_usage": True, "usage_every": 3}})
    assert refused.status_code == 400
    assert refused.json()["error"]["message"] == (
        "stream_options takes continuous_usage_stats and include_usage")
    # continuous_usage_stats without include_usage asks for no usage at all (as vLLM).
    chunks = sse_chunks(_request(http, "completions", {"stream": True, "stream_options": {
        "continuous_usage_stats": True}}).text)
    assert all(c.get("usage") is None for c in chunks)


def refusal_count(api: str, status: str, reason: str) -> float:
    counter = metrics.REFUSED_REQUESTS.labels(api=api, status=status, reason=reason)
    return float(counter._value.get())


def test_refusals_are_logged_with_reason_and_client_and_counted(
        http: httpx.Client, stack: Stack, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A log budget of its own: the tests before this one used up the shared one.
    monkeypatch.setattr(refusals, "REFUSALS", refusals.Refusals())
    before = {key: refusal_count(*key) for key in [
        ("http", "400", "temperature"), ("http", "400", "unknown_field"),
        ("http", "404", "model_not_found"), ("http", "404", "no_endpoint"),
        ("grpc", "INVALID_ARGUMENT", "temperature")]}
    with caplog.at_level(logging.WARNING, logger="gateway.refusals"):
        assert _request(http, "chat", {"temperature": -1}).status_code == 400
        assert _request(http, "chat", {"mystery_knob": 1}).status_code == 400
        assert _request(http, "chat", {"model": "gpt-4o"}).status_code == 404
        assert http.get("/v2/nothing").status_code == 404
        with pytest.raises(grpc.RpcError) as error:
            list(stack.client.generate("hi", temperature=-1.0))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        lines = [r.getMessage() for r in caplog.records if r.name == "gateway.refusals"]
    assert len(lines) == 5, lines
    assert lines[0].startswith("refused http request from 127.0.0.1:")
    assert "400 temperature: temperature must be finite and >= 0, got -1.0" in lines[0]
    assert "400 unknown_field: unknown field 'mystery_knob'" in lines[1]
    assert "404 model_not_found: the model 'gpt-4o' does not exist" in lines[2]
    assert "404 no_endpoint: no endpoint /v2/nothing" in lines[3]
    assert lines[4].startswith("refused grpc request from ipv")
    assert "INVALID_ARGUMENT temperature: temperature" in lines[4]
    for key, count in before.items():
        assert refusal_count(*key) == count + 1, key
    # A request gRPC refused changed nothing: the next one is served.
    assert stack.client.complete("hi", max_tokens=2).texts


def test_model_info_shows_defaults_and_chat_template(stack: Stack) -> None:
    info = stack.client.model_info()
    assert info.model == MODEL and info.has_chat_template
    # The default model's generation config (its model card's sampling), and the override.
    expected = gateway_pb2.SamplingParams(temperature=0.2, top_p=0.9, max_tokens=MAX_NEW_TOKENS)
    assert info.default_sampling_params == expected


def sampled_rows(stack: Stack, send: Any) -> set[tuple[float, float]]:
    """The (temperature, top_p) of every row the runner sampled for what `send` sends."""
    stack.wait_idle()
    stack.runner.batches.clear()
    send()
    return {(round(t, 5), round(p, 5)) for batch in stack.runner.batches
            for t, p, sample in zip(batch.temperatures, batch.top_ps, batch.do_sample,
                                    strict=True) if sample}


def test_a_request_s_own_sampling_beats_the_model_s_which_beats_openai_s(
        stack: Stack, http: httpx.Client) -> None:
    """What reaches the runner: the generation config's 0.2 / 0.9 for a request that says
    nothing, the request's own values (0 included) where it says them, over both APIs."""
    model_defaults = {(0.2, 0.9)}
    assert sampled_rows(stack, lambda: _request(http, "completions", {})) == model_defaults
    assert sampled_rows(stack, lambda: stack.client.complete("hi", max_tokens=2)) == (
        model_defaults)
    assert sampled_rows(stack, lambda: _request(http, "chat", {"temperature": 0.7})) == {
        (0.7, 0.9)}
    assert sampled_rows(stack, lambda: stack.client.complete(
        "hi", max_tokens=2, temperature=0.0, top_p=1.0)) == {(0.0, 1.0)}

