"""Fuzz of structured output and tools, over HTTP and gRPC, against the fake runner: random
formats (mostly broken or hostile: bad JSON, unknown keywords, deep nesting, huge enums, bad
regexes and grammars, wrong types) and tool lists. Every answer is a success or a 4xx /
INVALID_ARGUMENT, never a 5xx or INTERNAL; every answer that ends with `stop` under a JSON
schema validates; nothing stays allocated and the gateway keeps serving. How many requests
reached the engine and how many were refused is counted and asserted."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import jsonschema
import pytest

from gateway.client import collect
from gateway.grammar import MAX_FORMAT_BYTES
from gateway.tokenizer import Tokenizer
from protos import gateway_pb2
from tests.gateway.conftest import SubmitCounter
from tests.gateway.stack import Stack
from tests.helpers.services import ServiceProcess, free_port

NUM_CASES = 160


@pytest.fixture(scope="module")
def stack(tokenizer: Tokenizer, block_service: ServiceProcess) -> Iterator[Stack]:
    s = Stack(tokenizer, block_service, num_blocks=256, epoch=53, http_port=free_port(),
              max_num_batched_tokens=64, max_num_seqs=16)
    yield s
    s.close()


def random_schema(rng: random.Random, depth: int = 0) -> Any:
    """A JSON schema, valid or not, sometimes large or deep."""
    kind = rng.choice(["object", "array", "string", "integer", "number", "boolean", "enum",
                       "anyOf", "ref", "junk", "deep", "big_enum"])
    if depth > 3:
        kind = rng.choice(["string", "integer", "boolean"])
    if kind == "object":
        names = [rng.choice(["a", "b", "name", "ü", "x y", ""]) for _ in range(rng.randint(0, 4))]
        return {"type": "object",
                "properties": {n: random_schema(rng, depth + 1) for n in names},
                "required": names[:rng.randint(0, len(names))],
                "additionalProperties": rng.choice([False, True])}
    if kind == "array":
        low = rng.randint(0, 3)
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": low,
                "maxItems": low + rng.randint(-1, 3)}
    if kind == "string":
        return rng.choice([{"type": "string", "maxLength": rng.randint(0, 8)},
                           {"type": "string", "pattern": rng.choice(["^[a-c]+$", "(", "\\d{2}"])},
                           {"type": "string", "format": rng.choice(["date", "email", "nope"])}])
    if kind in ("integer", "number"):
        low = rng.randint(-5, 5)
        return {"type": kind, "minimum": low, "maximum": low + rng.randint(-2, 10)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": [rng.choice(["x", 1, None, True, [1], {"k": 2}]) for _ in range(3)]}
    if kind == "anyOf":
        return {"anyOf": [random_schema(rng, depth + 1) for _ in range(rng.randint(0, 3))]}
    if kind == "ref":
        return {"$defs": {"n": {"type": "integer"}}, "$ref": rng.choice(["#/$defs/n", "#/nope"])}
    if kind == "deep":
        schema: Any = {"type": "integer"}
        for _ in range(rng.randint(10, 60)):
            schema = {"type": "array", "items": schema, "maxItems": 1}
        return schema
    if kind == "big_enum":
        return {"enum": [f"v{i}" * rng.randint(1, 4) for i in range(rng.randint(100, 3000))]}
    return rng.choice([{"type": "nope"}, {"minimum": "x"}, [], 3, "str", {"properties": 5}])


def random_format(rng: random.Random) -> tuple[str, Any]:
    """(HTTP field, value): a format in one of the ways a client may ask for one."""
    schema = random_schema(rng)
    return rng.choice([
        ("response_format", {"type": "json_schema",
                             "json_schema": {"name": "x", "schema": schema}}),
        ("response_format", {"type": rng.choice(["json_object", "text", "xml", 5])}),
        ("structured_outputs", {"json": schema}),
        ("structured_outputs", {"regex": rng.choice(["[a-z]{1,6}", "(", "a*b", "\\p{L}+", ""])}),
        ("structured_outputs", {"choice": rng.choice([["a", "b"], [], ["x" * 50], [1, 2]])}),
        ("structured_outputs", {"grammar": rng.choice(['start: "a" | "b"', "start: nope",
                                                       "%%%", 'start: /[0-9]+/'])}),
        ("guided_json", schema),
        ("guided_regex", rng.choice(["\\d+", "["])),
        ("guided_choice", ["yes", "no"]),
        ("structured_outputs", {"json": "x" * (MAX_FORMAT_BYTES + 1)}),
    ])


def random_tools(rng: random.Random) -> dict[str, Any]:
    tools = [{"type": "function",
              "function": {"name": rng.choice(["f", "g", "bad name", "", "h" * 70]),
                           "parameters": random_schema(rng)}}
             for _ in range(rng.randint(0, 3))]
    body: dict[str, Any] = {"tools": tools}
    body["tool_choice"] = rng.choice(["auto", "none", "required", "sometimes",
                                      {"type": "function", "function": {"name": "f"}}, None])
    if body["tool_choice"] is None:
        del body["tool_choice"]
    return body


def test_random_formats_and_tools_over_http(stack: Stack, submits: SubmitCounter) -> None:
    rng = random.Random(20261207)
    statuses: dict[int, int] = {}
    validated = 0
    before = submits.count
    with stack.http_client() as http:
        for _ in range(NUM_CASES):
            body: dict[str, Any] = {"messages": [{"role": "user", "content": "Go."}],
                                    "max_tokens": rng.choice([8, 40]),
                                    "temperature": rng.choice([0, 0.9]), "seed": 1}
            use_tools = rng.random() < 0.3
            if use_tools:
                body.update(random_tools(rng))
            else:
                field, value = random_format(rng)
                body[field] = value
            body["stream"] = rng.random() < 0.3
            answer = http.post("/v1/chat/completions", json=body)
            statuses[answer.status_code] = statuses.get(answer.status_code, 0) + 1
            assert answer.status_code in (200, 400), (body, answer.text)
            if answer.status_code == 400:
                assert answer.json()["error"]["message"]
            elif not body["stream"]:
                validated += _check_answer(body, answer)
    reached = submits.count - before
    assert statuses.get(400, 0) >= NUM_CASES // 5, statuses
    assert reached >= NUM_CASES // 4, (reached, statuses)
    assert validated >= 5
    assert stack.wait_idle().used_blocks == 0
    assert stack.client.complete(token_ids=[5, 6, 7], max_tokens=2).finish_reasons == ["length"]


def _check_answer(body: dict[str, Any], answer: httpx.Response) -> int:
    """1 when a stopped JSON-schema answer was validated against its schema."""
    choice = answer.json()["choices"][0]
    schema = None
    if body.get("response_format", {}).get("type") == "json_schema":
        schema = body["response_format"]["json_schema"]["schema"]
    elif isinstance(body.get("structured_outputs"), dict) and "json" in body["structured_outputs"]:
        schema = body["structured_outputs"]["json"]
    elif "guided_json" in body:
        schema = body["guided_json"]
    if schema is None or choice["finish_reason"] != "stop":
        return 0
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    return 1


def test_random_structured_output_over_grpc(stack: Stack) -> None:
    rng = random.Random(7)
    refused = served = 0
    for _ in range(NUM_CASES // 2):
        output = gateway_pb2.StructuredOutput(whitespace_flexible=rng.random() < 0.2)
        kind = rng.choice(["json_schema", "regex", "grammar", "choice", "json_object"])
        if kind == "json_schema":
            output.json_schema = rng.choice([json.dumps(random_schema(rng)), "{", "", "null"])
        elif kind == "regex":
            output.regex = rng.choice(["[xy]{2,5}", "(", "", "a|"])
        elif kind == "grammar":
            output.grammar = rng.choice(['start: "q"+', "start:", "x"])
        elif kind == "choice":
            output.choice.values.extend(rng.sample(["a", "b", "", "\n"], rng.randint(0, 3)))
        else:
            output.json_object = rng.random() < 0.8
        request = gateway_pb2.GenerateRequest(
            prompt_token_ids=gateway_pb2.TokenIds(token_ids=[9, 8, 7]), structured_output=output,
            sampling_params=gateway_pb2.SamplingParams(max_tokens=12, n=rng.randint(1, 3)))
        try:
            collect(stack.client.stub.Generate(request, timeout=60))
            served += 1
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
            assert error.details().startswith("structured_output"), error.details()
            refused += 1
    assert served >= 10 and refused >= 10, (served, refused)
    assert stack.wait_idle().used_blocks == 0
