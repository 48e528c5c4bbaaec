"""Structured output end to end, real processes: a gateway, a block service and a runner.

- A small random model, over gRPC: greedy outputs under a format (JSON schema, regex, choice,
  Lark grammar) equal transformers' greedy loop under llguidance's mask (tests/e2e/oracle.py),
  alone and in a concurrent batch with unconstrained requests (masks that follow their step,
  merged forwards); sampled outputs match their format.
- The default model (SmolLM2-135M-Instruct), over HTTP with the official `openai` client:
  `response_format` json_schema answers parse and validate; tool_choice required gives a
  valid call; with auto and required, streamed answers equal the answers not streamed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import grpc
import jsonschema
import llguidance
import openai
import pytest

from common.model_store import resolve_model
from gateway.client import collect
from gateway.grammar import FormatSpec, choice_spec
from protos import gateway_pb2
from tests.e2e.oracle import greedy_constrained
from tests.faults.conftest import Cluster
from tests.helpers.services import GatewayProcess, free_port
from tests.helpers.tiny_models import make_tiny_model

T = TypeVar("T")
MAX_TOKENS = 24
ITEM = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                   "ok": {"type": "boolean"}},
    "required": ["id", "ok"],
    "additionalProperties": False,
}
FORMATS = [
    gateway_pb2.StructuredOutput(json_schema=json.dumps(ITEM)),
    gateway_pb2.StructuredOutput(regex=r"[a-f]{3}-\d{2,4}"),
    gateway_pb2.StructuredOutput(choice=gateway_pb2.StringList(values=["red", "green", "blue"])),
    gateway_pb2.StructuredOutput(grammar='start: "(" num ("," num)* ")"\nnum: /[0-9]{1,3}/'),
]


def llguidance_grammar(output: gateway_pb2.StructuredOutput) -> str:
    """What the gateway compiles for `output` (its FormatSpec's grammar)."""
    kind = output.WhichOneof("format")
    if kind == "choice":
        return choice_spec(list(output.choice.values), "choice").grammar()
    return FormatSpec(kind, getattr(output, kind)).grammar()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[GatewayProcess, Path]]:
    root = tmp_path_factory.mktemp("structured_tiny")
    model = make_tiny_model("qwen2", root / "qwen2")
    (root / "logs").mkdir()
    cluster = Cluster(root / "logs", model)
    try:
        cluster.start_runners(1)
        [gateway] = cluster.start_gateways(1)
        yield gateway, model
    finally:
        cluster.close()


def _request(prompt: list[int], output: gateway_pb2.StructuredOutput, **sampling: object
             ) -> gateway_pb2.GenerateRequest:
    request = gateway_pb2.GenerateRequest(prompt_token_ids=gateway_pb2.TokenIds(
        token_ids=prompt), structured_output=output)
    for key, value in sampling.items():
        setattr(request.sampling_params, key, value)
    return request


def test_greedy_under_a_format_equals_transformers(
        tiny: tuple[GatewayProcess, Path]) -> None:
    gateway, model = tiny
    prompts = [[100 + 7 * i + j for j in range(5 + 3 * i)] for i in range(len(FORMATS))]
    requests = [_request(p, f, max_tokens=MAX_TOKENS, temperature=0)
                for p, f in zip(prompts, FORMATS, strict=True)]
    # With as many unconstrained requests in the same batches.
    plain = [gateway_pb2.GenerateRequest(
        prompt_token_ids=gateway_pb2.TokenIds(token_ids=p[::-1]),
        sampling_params=gateway_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
        for p in prompts]
    with ThreadPoolExecutor(len(requests) + len(plain)) as pool:
        results = list(pool.map(lambda r: collect(gateway.client.stub.Generate(r, timeout=120)),
                                requests + plain))
    for prompt, output, result in zip(prompts, FORMATS, results, strict=False):
        expected = greedy_constrained(prompt, MAX_TOKENS, llguidance_grammar(output), model)
        assert result.token_ids[0] == expected, output
        assert result.finish_reasons == ["stop" if len(expected) < MAX_TOKENS else "length"]


def test_sampled_outputs_match_their_format(tiny: tuple[GatewayProcess, Path]) -> None:
    gateway, _ = tiny
    regex = FORMATS[1]
    request = _request([5, 6, 7, 8], regex, max_tokens=MAX_TOKENS, temperature=1.0, n=4,
                       seed=11)
    result = collect(gateway.client.stub.Generate(request, timeout=120))
    assert result.finish_reasons == ["stop"] * 4
    for text in result.texts:
        assert re.fullmatch(regex.regex, text), text


def test_an_invalid_schema_is_invalid_argument(tiny: tuple[GatewayProcess, Path]) -> None:
    gateway, _ = tiny
    bad = gateway_pb2.StructuredOutput(json_schema='{"type": "object", "minProperties": "x"}')
    with pytest.raises(grpc.RpcError) as raised:
        collect(gateway.client.stub.Generate(_request([5, 6], bad), timeout=30))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details().startswith("structured_output.json_schema")


# ----- the default model over the OpenAI API ---------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string", "maxLength": 40},
                                      "unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["city", "unit"], "additionalProperties": False},
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "description": "The local time in a city.",
                 "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                "required": ["city"]}},
}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 30},
                   "age": {"type": "integer", "minimum": 0, "maximum": 130},
                   "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20},
                               "maxItems": 3}},
    "required": ["name", "age", "hobbies"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def smol(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    root = tmp_path_factory.mktemp("structured_smol")
    (root / "logs").mkdir()
    model = resolve_model(None)
    cluster = Cluster(root / "logs", model, ["--model", str(model), "--max-model-len", "1024",
                                             "--kv-cache-memory", str(128 << 20)])
    http_port = free_port()
    try:
        cluster.start_runners(1)
        cluster.start_gateways(1, "--http-port", str(http_port))
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="none",
                               max_retries=0, timeout=120)
        yield client
        client.close()
    finally:
        cluster.close()


def _both(ask: Callable[[bool], T]) -> list[T]:
    """ask(stream=False) and ask(stream=True), at once."""
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(ask, (False, True)))


def _chat(client: openai.OpenAI, content: str, stream: bool, **options: object
          ) -> tuple[str | None, list[tuple[str, str]], str]:
    """(content, [(name, arguments)], finish_reason) of one chat answer."""
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": content}]
    if not stream:
        answer = client.chat.completions.create(model=model, messages=messages,  # type: ignore[call-overload]
                                                **options)
        choice = answer.choices[0]
        calls = [(c.function.name, c.function.arguments)
                 for c in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason
    text, finish = "", ""
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for chunk in client.chat.completions.create(model=model, messages=messages,  # type: ignore[call-overload]
                                                stream=True, **options):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                if call.function and call.function.name:
                    names[call.index] = call.function.name
                arguments[call.index] = (arguments.get(call.index, "")
                                         + ((call.function.arguments or "") if call.function
                                            else ""))
            finish = choice.finish_reason or finish
    calls = [(names[i], arguments.get(i, "")) for i in sorted(names)]
    return text or None, calls, finish


def test_response_format_json_schema_answers_validate(smol: openai.OpenAI) -> None:
    """Sampled (greedy, n > 1 and the other formats: test_structured_fake_runner.py)."""
    fmt = {"type": "json_schema",
           "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    answers = _both(lambda stream: _chat(smol, "Describe a fictional person.", stream,
                                         response_format=fmt, max_tokens=160,
                                         temperature=0.8, seed=3))
    assert answers[0] == answers[1]  # the same seed: the same answer, streamed or not
    content, calls, finish = answers[0]
    assert finish == "stop" and not calls, content
    jsonschema.validate(json.loads(content or ""), PERSON)


def test_forced_tool_calls_are_valid_and_stream_as_they_answer(smol: openai.OpenAI) -> None:
    """tool_choice required (a named function: test_structured_fake_runner.py)."""
    tool_choice = "required"
    answers = _both(lambda stream: _chat(
        smol, "What is the weather in Paris?", stream, tools=[WEATHER, TIME],
        tool_choice=tool_choice, parallel_tool_calls=False, max_tokens=96, temperature=0))
    assert answers[0] == answers[1]
    content, calls, finish = answers[0]
    assert finish == "tool_calls" and len(calls) == 1 and not (content or "").strip()
    name, arguments = calls[0]
    tool = {"get_weather": WEATHER, "get_time": TIME}[name]
    jsonschema.validate(json.loads(arguments), tool["function"]["parameters"])  # type: ignore[index]


def test_auto_tool_choice_streams_as_it_answers(smol: openai.OpenAI) -> None:
    answers = _both(lambda stream: _chat(smol, "Call get_time for Tokyo.", stream,
                                         tools=[WEATHER, TIME], max_tokens=32, temperature=0))
    assert answers[0] == answers[1]
    content, calls, finish = answers[0]
    # The 135M model may answer in text (then up to max_tokens) rather than call.
    assert finish in (("tool_calls",) if calls else ("stop", "length")), answers[0]
    assert calls or content


def test_llguidance_is_what_the_oracle_uses() -> None:
    """The oracle builds its own matcher from the model's tokenizer.json: the gateway's
    grammars must be plain llguidance grammars it can read."""
    for output in FORMATS:
        assert llguidance.LLMatcher.validate_grammar(llguidance_grammar(output)) == ""
