"""The OpenAI-compatible HTTP API over loopback, against a real gateway on the fake runner.

The official `openai` client talks to it where it applies (raw `httpx` for the wire format,
bodies the client would not send, and disconnects). Outputs are held against the fake
model's oracle (`expected_tokens`, computed apart from the gateway), and against the same
request over gRPC; every refusal against the OpenAI client's exception class and the JSON
error shape; streams against the SSE framing; and a client that goes away against the block
service's count of used blocks.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from common.server import ServerOptions
from gateway.config import GatewayConfig
from gateway.request import output_seed
from gateway.server import Gateway
from gateway.tokenizer import ChatMessage, Tokenizer
from tests.gateway.conftest import start_fake_runner
from tests.gateway.fake_runner import FakeRunner, expected_tokens
from tests.gateway.stack import BLOCK_SIZE, Stack
from tests.helpers.services import ServiceProcess, free_port

MODEL = "fake"  # the fake runner's model name: the served name by default
ERROR_KEYS = {"message", "type", "param", "code"}


def base_url(gateway: Gateway) -> str:
    assert gateway.http is not None
    return f"http://127.0.0.1:{gateway.http.port}"


def openai_client(gateway: Gateway, api_key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url(gateway) + "/v1", api_key=api_key, max_retries=0,
                         timeout=30)


@pytest.fixture(scope="module")
def stack(tokenizer: Tokenizer, block_service: ServiceProcess) -> Iterator[Stack]:
    s = Stack(tokenizer, block_service, num_blocks=256, epoch=41, http_port=free_port())
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[openai.OpenAI]:
    c = openai_client(stack.gateway)
    yield c
    c.close()


@pytest.fixture(scope="module")
def http(stack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url(stack.gateway), timeout=30) as c:
        yield c


def prompt_of(i: int, length: int) -> list[int]:
    """A token-id prompt no other test sends (so no cache hit unless a test makes one)."""
    return [2000 + 53 * i + 7 * j for j in range(length)]


class Oracle:
    """What the gateway must answer, from the fake model and the tokenizer alone."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def ids(self, prompt: str | list[int]) -> list[int]:
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def chat_ids(self, content: str) -> list[int]:
        return self.tokenizer.encode_chat([ChatMessage("user", content)])

    def tokens(self, prompt_ids: list[int], max_tokens: int, seed: int | None = None,
               index: int = 0) -> list[int]:
        """Output `index`'s tokens: greedy when `seed` is None, else seeded per output."""
        return expected_tokens(prompt_ids, max_tokens,
                               None if seed is None else output_seed(seed, index))

    def text(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def piece(self, token_id: int) -> str:
        """One token's text as the logprobs name it."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


@pytest.fixture(scope="module")
def oracle(tokenizer: Tokenizer) -> Oracle:
    return Oracle(tokenizer)


def streamed(chunks: Any) -> dict[int, dict[str, Any]]:
    """A completions stream assembled per choice index: text, finish reason, logprob tokens."""
    choices: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            entry = choices.setdefault(choice.index, {"text": "", "finish_reason": None,
                                                      "tokens": []})
            entry["text"] += choice.text
            entry["finish_reason"] = choice.finish_reason or entry["finish_reason"]
            if choice.logprobs is not None:
                entry["tokens"] += choice.logprobs.tokens
    return choices


def error_of(response: httpx.Response) -> dict[str, Any]:
    """The error of a refused call, checked to be OpenAI's shape with a matching code."""
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == ERROR_KEYS, error
    assert isinstance(error["message"], str) and error["message"]
    return error  # type: ignore[no-any-return]


def wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


# ----- completions ---------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_greedy_completion_matches_the_oracle(client: openai.OpenAI, oracle: Oracle,
                                              stream: bool) -> None:
    prompt = prompt_of(1 + stream, 6)
    expected = oracle.tokens(prompt, 6)
    kwargs: dict[str, Any] = dict(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                  logprobs=1)
    if stream:
        [choice] = streamed(client.completions.create(**kwargs, stream=True)).values()
        text, finish, tokens = choice["text"], choice["finish_reason"], choice["tokens"]
    else:
        result = client.completions.create(**kwargs)
        [one] = result.choices
        assert one.index == 0 and one.logprobs is not None
        text, finish, tokens = one.text, one.finish_reason, one.logprobs.tokens
        assert result.object == "text_completion" and result.model == MODEL
        assert result.usage is not None
        assert (result.usage.prompt_tokens, result.usage.completion_tokens,
                result.usage.total_tokens) == (6, 6, 12)
    assert tokens == [oracle.piece(t) for t in expected]
    assert text == oracle.text(expected)
    assert finish == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_forms_and_n_give_choice_index_prompt_times_n_plus_output(
        client: openai.OpenAI, oracle: Oracle, stream: bool) -> None:
    base = 10 + 10 * stream
    forms: list[Any] = [
        "A string prompt, one of its kind" + " (streamed)" * stream,
        ["the first of two string prompts" + "!" * stream, "and the second one" + "!" * stream],
        prompt_of(base, 5),  # token ids
        [prompt_of(base + 1, 4), prompt_of(base + 2, 7), prompt_of(base + 3, 1)],
    ]
    n, seed, max_tokens = 2, 1234 + stream, 5
    for form in forms:
        prompts = [form] if isinstance(form, str) or isinstance(form[0], int) else form
        kwargs = dict(model=MODEL, prompt=form, n=n, max_tokens=max_tokens, temperature=1.0,
                      seed=seed)
        if stream:
            choices = streamed(client.completions.create(**kwargs, stream=True))
            texts = {i: (c["text"], c["finish_reason"]) for i, c in choices.items()}
        else:
            result = client.completions.create(**kwargs)
            texts = {c.index: (c.text, c.finish_reason) for c in result.choices}
            assert [c.index for c in result.choices] == list(range(len(prompts) * n))
            assert result.usage is not None
            assert result.usage.prompt_tokens == sum(len(oracle.ids(p)) for p in prompts)
            assert result.usage.completion_tokens == len(prompts) * n * max_tokens
        assert sorted(texts) == list(range(len(prompts) * n))
        for p, prompt in enumerate(prompts):
            for o in range(n):
                expected = oracle.tokens(oracle.ids(prompt), max_tokens, seed, o)
                assert texts[p * n + o] == (oracle.text(expected), "length"), (form, p, o)


@pytest.mark.parametrize("stream", [False, True])
def test_echo_puts_the_prompt_before_the_output(client: openai.OpenAI, oracle: Oracle,
                                                stream: bool) -> None:
    text_prompt = "Echo me back, please" + " now" * stream
    ids_prompt = prompt_of(30 + stream, 5)
    for prompt, prompt_text in ((text_prompt, text_prompt),
                                (ids_prompt, oracle.text(ids_prompt))):
        kwargs = dict(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True)
        if stream:
            text = streamed(client.completions.create(**kwargs, stream=True))[0]["text"]
        else:
            text = client.completions.create(**kwargs).choices[0].text
        assert text == prompt_text + oracle.text(oracle.tokens(oracle.ids(prompt), 3))


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_ends_the_text_before_it(client: openai.OpenAI, oracle: Oracle,
                                             stream: bool) -> None:
    prompt = prompt_of(40 + stream, 6)
    expected = oracle.tokens(prompt, 16)
    full = oracle.text(expected)
    stop = next(oracle.piece(t).strip() for t in expected[5:] if len(oracle.piece(t).strip()) > 2)
    cut = full.index(stop)
    assert cut > 0
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stop=[stop, "\x00"])
    if stream:
        choice = streamed(client.completions.create(**kwargs, stream=True))[0]
        text, finish = choice["text"], choice["finish_reason"]
    else:
        result = client.completions.create(**kwargs).choices[0]
        text, finish = result.text, result.finish_reason
    assert (text, finish) == (full[:cut], "stop")


def test_seed_is_reproducible_and_different_seeds_differ(client: openai.OpenAI,
                                                         oracle: Oracle) -> None:
    prompt = "Tell me something random"
    ids = oracle.ids(prompt)

    def completion(seed: int) -> str:
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                         temperature=1.0, seed=seed).choices[0].text

    def chat(seed: int) -> str:
        return client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=8,
            temperature=1.0, seed=seed).choices[0].message.content or ""

    for call, prompt_ids in ((completion, ids), (chat, oracle.chat_ids(prompt))):
        first, again, other = call(99), call(99), call(100)
        assert first == again == oracle.text(oracle.tokens(prompt_ids, 8, 99))
        assert other == oracle.text(oracle.tokens(prompt_ids, 8, 100))
        assert other != first


def test_completion_logprobs_have_tokens_top_dicts_and_offsets(client: openai.OpenAI,
                                                               oracle: Oracle) -> None:
    prompt = prompt_of(50, 5)
    expected = oracle.tokens(prompt, 5)
    k = 3
    result = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5,
                                       temperature=0, logprobs=k)
    logprobs = result.choices[0].logprobs
    assert logprobs is not None
    pieces = [oracle.piece(t) for t in expected]
    assert logprobs.tokens == pieces
    assert logprobs.token_logprobs == [-0.5] * 5  # what the fake runner reports
    # The fake runner's top k of token t are t, t+1, ... with logprobs -0.5, -1.5, ...
    assert logprobs.top_logprobs == [{oracle.piece(t + j): -0.5 - j for j in range(k)}
                                     for t in expected]
    assert all(len(top) == len({oracle.piece(t + j) for j in range(k)})
               for top, t in zip(logprobs.top_logprobs, expected, strict=True))
    offsets = [sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]
    assert logprobs.text_offset == offsets
    # logprobs=0: the chosen tokens' logprobs, no alternatives.
    zero = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0,
                                     logprobs=0).choices[0].logprobs
    assert zero is not None and zero.tokens == pieces
    assert zero.top_logprobs == [{}] * 5


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_and_top_logprobs(client: openai.OpenAI, oracle: Oracle,
                                        stream: bool) -> None:
    content = "Chat with logprobs" + "?" * stream
    expected = oracle.tokens(oracle.chat_ids(content), 4)
    k = 2
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": content}],
                  max_completion_tokens=4, temperature=0, logprobs=True, top_logprobs=k)
    if stream:
        entries: list[Any] = []
        text = ""
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            for choice in chunk.choices:
                text += choice.delta.content or ""
                if choice.logprobs is not None:
                    entries += choice.logprobs.content or []
    else:
        [choice] = client.chat.completions.create(**kwargs).choices
        assert choice.logprobs is not None and choice.logprobs.content is not None
        entries, text = choice.logprobs.content, choice.message.content
    assert text == oracle.text(expected)
    assert [e.token for e in entries] == [oracle.piece(t) for t in expected]
    for entry, token in zip(entries, expected, strict=True):
        assert entry.logprob == -0.5
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert [(t.token, t.logprob) for t in entry.top_logprobs] == [
            (oracle.piece(token + j), -0.5 - j) for j in range(k)]
        assert all(t.bytes == list(t.token.encode("utf-8")) for t in entry.top_logprobs)


def test_chat_streamed_and_whole_agree_and_max_completion_tokens_holds(
        client: openai.OpenAI, oracle: Oracle) -> None:
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hello"},
                                             {"type": "text", "text": "there"}]}]
    prompt_ids = oracle.tokenizer.encode_chat(
        [ChatMessage("system", "Be brief."), ChatMessage("user", "Hello\nthere")])
    expected = oracle.text(oracle.tokens(prompt_ids, 3))
    whole = client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                           max_completion_tokens=3, temperature=0)
    assert whole.object == "chat.completion"
    [choice] = whole.choices
    assert choice.message.role == "assistant" and choice.message.content == expected
    assert choice.finish_reason == "length"
    assert whole.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(prompt_ids), 3)
    deltas = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=3,  # type: ignore[arg-type]
        temperature=0, stream=True))
    assert deltas[0].object == "chat.completion.chunk"
    assert deltas[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in deltas[1:])
    assert "".join(c.choices[0].delta.content or "" for c in deltas) == expected
    assert [c.choices[0].finish_reason for c in deltas][-1] == "length"
    # n outputs of a chat, seeded per output.
    result = client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                            max_completion_tokens=3, temperature=1.0,
                                            seed=5, n=2)
    assert [c.message.content for c in result.choices] == [
        oracle.text(oracle.tokens(prompt_ids, 3, 5, i)) for i in range(2)]
    assert [c.index for c in result.choices] == [0, 1]


def test_usage_counts_tokens_and_a_repeated_prompt_hits_the_prefix_cache(
        client: openai.OpenAI, oracle: Oracle) -> None:
    prompt = "A long prompt of many words that spans several blocks of the cache, once"
    length = len(oracle.ids(prompt))
    assert length >= 2 * BLOCK_SIZE + 1
    cached = []
    for _ in range(2):
        usage = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2,
                                          temperature=0).usage
        assert usage is not None
        assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
            length, 2, length + 2)
        assert usage.prompt_tokens_details is not None
        cached.append(usage.prompt_tokens_details.cached_tokens)
    # Every full block but the one holding the last prompt token (which must be computed).
    assert cached == [0, (length - 1) // BLOCK_SIZE * BLOCK_SIZE]
    assert cached[1] > 0


@pytest.mark.parametrize("chat", [False, True])
def test_include_usage_sends_a_last_chunk_with_usage_and_no_choices(
        client: openai.OpenAI, oracle: Oracle, chat: bool) -> None:
    options = {"include_usage": True}
    if chat:
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "usage please"}],
            max_completion_tokens=4, temperature=0, n=2, stream=True, stream_options=options))
        prompt_tokens = len(oracle.chat_ids("usage please"))
    else:
        chunks = list(client.completions.create(
            model=MODEL, prompt=["usage please", "and again"], max_tokens=4, temperature=0,
            n=2, stream=True, stream_options=options))
        prompt_tokens = len(oracle.ids("usage please")) + len(oracle.ids("and again"))
    *body, last = chunks
    assert body and all(c.usage is None and c.choices for c in body)
    assert last.choices == [] and last.usage is not None
    outputs = 2 if chat else 4
    assert (last.usage.prompt_tokens, last.usage.completion_tokens,
            last.usage.total_tokens) == (prompt_tokens, 4 * outputs, prompt_tokens + 4 * outputs)
    # Without it, no usage in any chunk.
    plain = list(client.completions.create(model=MODEL, prompt="no usage", max_tokens=2,
                                           stream=True))
    assert all(c.usage is None and c.choices for c in plain)


def test_http_output_equals_grpc_output(stack: Stack, client: openai.OpenAI,
                                        oracle: Oracle) -> None:
    prompt = "Same request over both APIs"
    ids = oracle.ids(prompt)
    grpc_result = stack.client.complete(prompt=prompt, max_tokens=7, temperature=0.8, seed=11,
                                        n=2, logprobs=2)
    http_result = client.completions.create(model=MODEL, prompt=prompt, max_tokens=7,
                                            temperature=0.8, seed=11, n=2, logprobs=2)
    assert [c.text for c in http_result.choices] == grpc_result.texts
    assert [c.finish_reason for c in http_result.choices] == grpc_result.finish_reasons
    for choice, token_ids, positions in zip(http_result.choices, grpc_result.token_ids,
                                            grpc_result.logprobs, strict=True):
        assert choice.logprobs is not None
        assert choice.logprobs.tokens == [oracle.piece(t) for t in token_ids]
        assert choice.logprobs.token_logprobs == [p.token.logprob for p in positions]
    assert grpc_result.token_ids == [oracle.tokens(ids, 7, 11, i) for i in range(2)]
    assert grpc_result.usage is not None and http_result.usage is not None
    assert (http_result.usage.prompt_tokens, http_result.usage.completion_tokens) == (
        grpc_result.usage.prompt_tokens, grpc_result.usage.completion_tokens)
    # Chat.
    messages = [("system", "You answer."), ("user", "Same chat over both APIs")]
    grpc_chat = stack.client.complete(messages=messages, max_tokens=5, temperature=0)
    http_chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": r, "content": c} for r, c in messages],  # type: ignore[misc]
        max_tokens=5, temperature=0)
    assert [c.message.content for c in http_chat.choices] == grpc_chat.texts
    assert http_chat.usage is not None and grpc_chat.usage is not None
    assert http_chat.usage.prompt_tokens == grpc_chat.usage.prompt_tokens


def test_models_tokenize_and_detokenize(http: httpx.Client, oracle: Oracle) -> None:
    models = http.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    text = "tokenize these words"
    tokenized = http.post("/tokenize", json={"prompt": text}).json()
    assert tokenized["tokens"] == oracle.ids(text) and tokenized["count"] == len(oracle.ids(text))
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": text}]}).json()
    assert chat["tokens"] == oracle.chat_ids(text)
    assert http.post("/detokenize", json={"tokens": oracle.ids(text)}).json() == {"prompt": text}


# ----- errors --------------------------------------------------------------------------------

BAD_COMPLETIONS: list[tuple[dict[str, Any], str | None]] = [
    (dict(temperature=-1), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(extra_body={"frobnicate": 1}), "frobnicate"),
    (dict(prompt=3.5), "prompt"),
    (dict(prompt=[1, "two"]), "prompt"),
    (dict(prompt=[]), "prompt"),
    (dict(max_tokens="5"), "max_tokens"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(n=2**70), "n"),
    (dict(n=True), "n"),
    (dict(seed=2**64), "seed"),
    (dict(temperature=10**400), "temperature"),
    (dict(logit_bias={"abc": 1}), "logit_bias"),
    (dict(logit_bias={"99999": 1}), "logit_bias"),  # outside the vocabulary
    (dict(stop=[1, 2]), "stop"),
    (dict(echo=True, logprobs=1), "echo"),
    (dict(logprobs=21), "logprobs"),
    (dict(stream_options={"include_usage": True}), "stream_options"),
    (dict(extra_body={"suffix": "after"}), "suffix"),
    (dict(extra_body={"best_of": 2}), "best_of"),
    (dict(prompt=[-1, 5]), "prompt"),
    (dict(prompt=[2**40]), "prompt"),
]


@pytest.mark.parametrize(("change", "param"), BAD_COMPLETIONS,
                         ids=[str(c) for c, _ in BAD_COMPLETIONS])
def test_bad_completion_bodies_are_bad_request_naming_the_field(
        client: openai.OpenAI, change: dict[str, Any], param: str | None) -> None:
    kwargs: dict[str, Any] = dict(model=MODEL, prompt="hello", max_tokens=2)
    kwargs.update(change)
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(**kwargs)
    assert error.value.status_code == 400
    body = error.value.body
    assert isinstance(body, dict) and set(body) == ERROR_KEYS
    assert body["type"] == "invalid_request_error" and body["code"] == 400
    assert body["param"] == param, body


BAD_CHATS: list[tuple[dict[str, Any], str]] = [
    (dict(tools=[{"type": "function", "function": {"name": "f g", "parameters": {}}}]),
     "tools[0].name"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(response_format={"type": "xml"}), "response_format"),
    (dict(messages=[{"role": "tool", "content": "x"}]), "messages[0].tool_call_id"),
    (dict(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role"),
    (dict(messages=[{"role": ["user"], "content": "x"}]), "messages[0].role"),
    (dict(messages=[{"role": "user", "content": 5}]), "messages[0].content"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     "messages[0].content"),
    (dict(messages=[{"role": "user", "content": "x", "name": "me"}]), "messages[0]"),
    (dict(messages=[]), "messages"),
    (dict(top_logprobs=2), "top_logprobs"),
    (dict(logprobs="yes"), "logprobs"),
    (dict(max_completion_tokens=-3), "max_completion_tokens"),
    (dict(user="u" * 300), "user"),
    (dict(extra_body={"audio": {"voice": "x"}}), "audio"),
]


@pytest.mark.parametrize(("change", "param"), BAD_CHATS, ids=[str(c)[:60] for c, _ in BAD_CHATS])
def test_bad_chat_bodies_are_bad_request_naming_the_field(
        client: openai.OpenAI, change: dict[str, Any], param: str) -> None:
    kwargs: dict[str, Any] = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                  max_tokens=2)
    kwargs.update(change)
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(**kwargs)
    body = error.value.body
    assert isinstance(body, dict) and set(body) == ERROR_KEYS
    assert body["param"] == param, body


@pytest.mark.parametrize("raw", [
    b'{"prompt": "x", "temperature": NaN}',
    b'{"prompt": "x", "temperature": Infinity}',
    b'{"prompt": "x", "top_p": -Infinity}',
    b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}",
    b'{"prompt": "x",',
    b'{"prompt": "x"} trailing',
    b"",
    b"[1, 2]",
    b'"just a string"',
    b'{"prompt": "\xff\xfe"}',
    b"[" * 50_000,
])
def test_bodies_that_are_not_a_json_object_are_bad_request(http: httpx.Client,
                                                           raw: bytes) -> None:
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        response = http.post(path, content=raw, headers={"content-type": "application/json"})
        assert response.status_code == 400, (path, response.text)
        assert error_of(response)["type"] == "invalid_request_error"


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 1}'),
    ("/v1/completions", b'{"prompt": "x", "stop": ["\\udfff"], "max_tokens": 1}'),
    ("/v1/completions", b'{"prompt": "x", "cache_salt": "\\ud800", "max_tokens": 1}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udc00"}]}'),
    ("/tokenize", b'{"prompt": "a\\ud800b"}'),
])
def test_lone_surrogate_escapes_are_bad_request(http: httpx.Client, path: str,
                                                body: bytes) -> None:
    """A JSON escape of half a UTF-16 pair is no text: refused, where protobuf would fail."""
    response = http.post(path, content=body)
    assert response.status_code == 400, response.text
    assert "surrogate" in error_of(response)["message"]


def test_a_surrogate_pair_escape_is_one_character(http: httpx.Client) -> None:
    response = http.post("/tokenize", content=b'{"prompt": "\\ud83d\\ude00"}')
    assert response.status_code == 200, response.text


def test_unknown_model_and_unknown_path_are_not_found(client: openai.OpenAI,
                                                      http: httpx.Client) -> None:
    with pytest.raises(openai.NotFoundError) as error:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    body = error.value.body
    assert isinstance(body, dict)
    assert (body["param"], body["code"], body["type"]) == ("model", "model_not_found",
                                                           "not_found_error")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model",
                                       messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model=MODEL, input="x")  # an endpoint pagewire has not
    response = http.get("/v2/nothing")
    assert response.status_code == 404
    assert error_of(response)["type"] == "not_found_error"
    response = http.get("/v1/completions")
    assert response.status_code == 405 and error_of(response)


# ----- the SSE wire format -------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_sse_framing(http: httpx.Client, path: str) -> None:
    body: dict[str, Any] = dict(model=MODEL, max_tokens=5, temperature=0, n=2, stream=True,
                                stream_options={"include_usage": True})
    if path == "/v1/completions":
        body["prompt"] = ["sse one", "sse two"]
    else:
        body["messages"] = [{"role": "user", "content": "sse"}]
    with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    assert raw.endswith("data: [DONE]\n\n")
    events = raw.split("\n\n")
    assert events[-1] == ""  # nothing after the last blank line
    events = events[:-1]
    assert events[-1] == "data: [DONE]"
    chunks = []
    for event in events[:-1]:
        assert event.startswith("data: ") and "\n" not in event, event
        chunks.append(json.loads(event.removeprefix("data: ")))
    assert len(chunks) >= 2
    assert len({c["id"] for c in chunks}) == 1
    assert len({c["created"] for c in chunks}) == 1
    kind = "chat.completion.chunk" if "chat" in path else "text_completion"
    assert all(c["object"] == kind and c["model"] == MODEL for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == (
        5 * (4 if path == "/v1/completions" else 2))
    finished = [ch["index"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert sorted(finished) == list(range(4 if path == "/v1/completions" else 2))


# ----- clients that go away ------------------------------------------------------------------

def assert_aborted_and_serving(stack: Stack, http: httpx.Client, prompt: list[int],
                               batches_before: int) -> None:
    """The request of a client that went away freed its blocks and its slot, was aborted (not
    run to its 1000 tokens, 1000 steps), and the gateway serves the next one right."""
    stats = stack.wait_idle(5)
    assert stats.used_blocks == 0, stats
    assert len(stack.runner.batches) - batches_before < 900
    assert stack.gateway.http is not None
    streams = stack.gateway.http.api.streams
    wait_for(lambda: streams.open_streams == 0, 5)
    after = http.post("/v1/completions", json=dict(model=MODEL, prompt=prompt, max_tokens=2,
                                                   temperature=0))
    assert after.status_code == 200
    assert after.json()["choices"][0]["text"] == Oracle(stack.gateway.tokenizer).text(
        expected_tokens(prompt, 2))


def test_a_disconnected_stream_frees_its_blocks(stack: Stack, http: httpx.Client) -> None:
    prompt = prompt_of(60, 9)
    batches_before = len(stack.runner.batches)
    try:
        with httpx.Client(base_url=base_url(stack.gateway), timeout=30) as own, own.stream(
                "POST", "/v1/completions", json=dict(model=MODEL, prompt=prompt, max_tokens=1000,
                                                     temperature=0, stream=True)) as response:
            events = []
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                    if len(events) == 2:
                        break
            # Hold the runner: the request is mid-way, its blocks held, while the client goes.
            stack.runner.proceed.clear()
            # It runs (the runner has seen its steps). The block service's used_blocks is not
            # asserted here: leaving iter_lines early may already close the response (httpx
            # closes the stream when its line iterator is dropped), so the abort can land
            # before the hold.
            assert len(events) == 2 and len(stack.runner.batches) > batches_before
            assert stack.runner.batches[-1].block_tables
        # Leaving the blocks closes the response and the connection.
    finally:
        stack.runner.proceed.set()
    assert_aborted_and_serving(stack, http, prompt, batches_before)


def test_an_abandoned_whole_request_frees_its_blocks(stack: Stack, http: httpx.Client) -> None:
    prompt = prompt_of(61, 9)
    batches_before = len(stack.runner.batches)
    stack.runner.proceed.clear()  # hold the runner: the answer cannot come before the timeout
    try:
        with pytest.raises(httpx.ReadTimeout), httpx.Client(
                base_url=base_url(stack.gateway), timeout=httpx.Timeout(30, read=0.5)) as own:
            own.post("/v1/completions", json=dict(model=MODEL, prompt=prompt, max_tokens=1000,
                                                  temperature=0))
    finally:
        stack.runner.proceed.set()
    assert_aborted_and_serving(stack, http, prompt, batches_before)


def test_completions_default_max_tokens_bows_to_the_room_left(stack: Stack,
                                                              http: httpx.Client) -> None:
    """Without max_tokens a completion gets OpenAI's 16, or what fits when less does: the
    default the client never sent is not refused."""
    max_len = stack.gateway.servicer.admission.limits.max_len  # type: ignore[union-attr]
    for length, expected in ((9, 16), (max_len - 5, 5)):
        response = http.post("/v1/completions", json=dict(
            model=MODEL, prompt=prompt_of(80 + length % 7, length), temperature=0))
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == expected


def test_logit_bias_past_float32_is_clamped_not_refused(http: httpx.Client) -> None:
    """OpenAI clamps biases to [-100, 100]; 1e39 (inf as a protobuf float) is clamped too."""
    answers = [http.post("/v1/completions", json=dict(
        model=MODEL, prompt=prompt_of(90, 5), max_tokens=2, temperature=0,
        logit_bias={"7": bias})) for bias in (100, 1e39)]
    assert [a.status_code for a in answers] == [200, 200], answers[1].text
    assert answers[0].json()["choices"][0]["text"] == answers[1].json()["choices"][0]["text"]


def test_whole_answers_give_their_stream_slot_back(stack: Stack, http: httpx.Client) -> None:
    """More whole (non-streamed) answers than --max-streams-per-client, one after another:
    each gives its slot back (they once kept it, and the gateway refused everyone after)."""
    assert stack.gateway.http is not None
    streams = stack.gateway.http.api.streams
    for i in range(stack.gateway.config.max_streams_per_client + 2):
        response = http.post("/v1/completions", json=dict(model=MODEL, prompt=[7, 8, i + 20],
                                                          max_tokens=1))
        assert response.status_code == 200, response.text
    assert streams.open_streams == 0


# ----- a gateway with tokens and small limits ------------------------------------------------

TOKENS = ("secret", "other")
MAX_MESSAGE_BYTES = 16 * 1024


class GuardedGateway:
    """A gateway with bearer tokens, a small body limit, two HTTP streams per client, three in
    all and one waiting request, on a fake runner that can be held."""

    def __init__(self, tokenizer: Tokenizer, block_service: ServiceProcess) -> None:
        self.runner = FakeRunner(num_blocks=64, block_size=BLOCK_SIZE, epoch=43)
        self.runner_server = start_fake_runner(self.runner)
        config = GatewayConfig(block_service=block_service.address,
                               runners=[f"127.0.0.1:{self.runner_server.port}"],
                               http_port=free_port(), max_http_streams=3,
                               max_http_streams_per_client=2,
                               max_waiting=1)
        options = ServerOptions(port=0, max_workers=16, max_message_bytes=MAX_MESSAGE_BYTES,
                                auth_tokens=TOKENS)
        self.gateway = Gateway(config, options, tokenizer)
        self.gateway.start(timeout_s=30)
        self.url = base_url(self.gateway)

    def headers(self, token: str = TOKENS[0]) -> dict[str, str]:
        return {"Authorization": f"Bearer {token}"}

    def close(self) -> None:
        self.runner.proceed.set()
        self.gateway.stop()
        self.runner_server.stop(0)


@pytest.fixture(scope="module")
def guarded(tokenizer: Tokenizer, block_service: ServiceProcess) -> Iterator[GuardedGateway]:
    g = GuardedGateway(tokenizer, block_service)
    yield g
    g.close()


def test_auth_tokens_are_checked_and_probes_stay_open(guarded: GuardedGateway) -> None:
    body = dict(model=MODEL, prompt="auth", max_tokens=1)
    with httpx.Client(base_url=guarded.url, timeout=30) as http:
        for headers in ({}, guarded.headers("wrong"), {"Authorization": "secret"},
                        {"Authorization": "Bearer secret2"}):
            response = http.post("/v1/completions", json=body, headers=headers)
            assert response.status_code == 401, headers
            assert error_of(response)["type"] == "authentication_error"
        assert http.get("/v1/models").status_code == 401
        for token in TOKENS:
            ok = http.post("/v1/completions", json=body, headers=guarded.headers(token))
            assert ok.status_code == 200, ok.text
        for path in ("/health", "/metrics", "/version"):
            assert http.get(path).status_code == 200, path
    with openai.OpenAI(base_url=guarded.url + "/v1", api_key="wrong", max_retries=0) as bad, \
            pytest.raises(openai.AuthenticationError):
        bad.completions.create(**body)  # type: ignore[call-overload]
    with openai.OpenAI(base_url=guarded.url + "/v1", api_key="secret", max_retries=0) as good:
        assert good.completions.create(**body).choices  # type: ignore[call-overload]


def test_a_body_over_the_message_limit_is_413(guarded: GuardedGateway) -> None:
    big = {"model": MODEL, "prompt": "x" * MAX_MESSAGE_BYTES, "max_tokens": 1}
    with httpx.Client(base_url=guarded.url, timeout=30, headers=guarded.headers()) as http:
        response = http.post("/v1/completions", json=big)
        assert response.status_code == 413
        assert error_of(response)["code"] == 413
        # Without a Content-Length (chunked): counted as it is read.
        data = json.dumps(big).encode()
        chunked = http.post("/v1/chat/completions",
                            content=iter([data[i:i + 4096] for i in range(0, len(data), 4096)]))
        assert "content-length" not in chunked.request.headers
        assert chunked.status_code == 413
        assert http.post("/v1/completions", json=dict(big, prompt="small")).status_code == 200
    with openai.OpenAI(base_url=guarded.url + "/v1", api_key="secret", max_retries=0) as c, \
            pytest.raises(openai.APIStatusError) as error:
        c.completions.create(**big)  # type: ignore[call-overload]
    assert error.value.status_code == 413


def test_stream_and_queue_limits_are_rate_limit_errors(guarded: GuardedGateway) -> None:
    """The runner held: A runs, B waits (the queue is full), C is over `secret`'s two streams,
    D (another token) is refused by the full queue; all pass once the runner goes on."""
    engine = guarded.gateway.engine
    assert guarded.gateway.http is not None
    streams = guarded.gateway.http.api.streams

    def queued() -> int:
        return sum(loop.num_queued for loop in engine.loops)

    results: dict[str, int] = {}

    def send(name: str, token: str) -> None:
        with httpx.Client(base_url=guarded.url, timeout=60) as http:
            results[name] = http.post("/v1/completions", headers=guarded.headers(token), json=dict(
                model=MODEL, prompt=prompt_of(70 + len(name), 5), max_tokens=3)).status_code

    guarded.runner.proceed.clear()
    threads = []
    try:
        threads.append(threading.Thread(target=send, args=("A", "secret")))
        threads[-1].start()
        wait_for(lambda: streams.open_streams == 1 and queued() == 0)
        threads.append(threading.Thread(target=send, args=("B", "secret")))
        threads[-1].start()
        wait_for(lambda: streams.open_streams == 2 and queued() == 1)
        with openai.OpenAI(base_url=guarded.url + "/v1", api_key="secret",
                           max_retries=0) as c, pytest.raises(openai.RateLimitError) as error:
            c.completions.create(model=MODEL, prompt="C", max_tokens=1)
        body = error.value.body
        assert isinstance(body, dict) and body["type"] == "rate_limit_error"
        assert "--max-http-streams-per-client" in body["message"]
        with openai.OpenAI(base_url=guarded.url + "/v1", api_key="other",
                           max_retries=0) as c, pytest.raises(openai.RateLimitError) as error:
            c.completions.create(model=MODEL, prompt="D", max_tokens=1)
        assert "waiting queue full" in str(error.value.body)
    finally:
        guarded.runner.proceed.set()
        for thread in threads:
            thread.join(60)
    assert results == {"A": 200, "B": 200}
    wait_for(lambda: streams.open_streams == 0, 5)
    # D was refused before it was submitted: nothing of it stays in the engine.
    assert not engine._aborted_unplaced


# ----- a backend down ------------------------------------------------------------------------

def test_backend_down_is_503_and_health_says_so(tokenizer: Tokenizer,
                                                block_service: ServiceProcess) -> None:
    down = Stack(tokenizer, block_service, num_blocks=64, epoch=45, http_port=free_port())
    try:
        url = base_url(down.gateway)
        with httpx.Client(base_url=url, timeout=30) as http, \
                openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as client:
            assert http.get("/health").json() == {"status": "SERVING"}
            assert client.completions.create(model=MODEL, prompt="up", max_tokens=1).choices
            down.runner_server.stop(0)
            wait_for(lambda: http.get("/health").status_code == 503, 15)
            health = http.get("/health").json()
            assert health["status"] == "NOT_SERVING" and "runner" in health["problem"]
            with pytest.raises(openai.InternalServerError) as error:
                client.completions.create(model=MODEL, prompt="down", max_tokens=1)
            assert error.value.status_code == 503
            body = error.value.body
            assert isinstance(body, dict) and body["type"] == "service_unavailable"
            # Streamed: refused before any event (the status, not an error event).
            response = http.post("/v1/chat/completions", json=dict(
                model=MODEL, messages=[{"role": "user", "content": "down"}], max_tokens=1,
                stream=True))
            assert response.status_code == 503 and error_of(response)
    finally:
        down.close()

