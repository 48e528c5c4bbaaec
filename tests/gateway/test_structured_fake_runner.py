"""Structured output end to end: gateway, real block service, a fake runner that samples
under the masks it is given (tests/gateway/fake_runner.py), real llguidance matchers."""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import jsonschema
import pytest

from gateway.client import collect
from gateway.tokenizer import Tokenizer
from protos import gateway_pb2
from tests.gateway.stack import Stack
from tests.helpers.services import ServiceProcess

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def stack(tokenizer: Tokenizer, block_service: ServiceProcess) -> Iterator[Stack]:
    s = Stack(tokenizer, block_service, num_blocks=512, max_num_batched_tokens=64,
              max_num_seqs=16)
    yield s
    s.close()


def generate(stack: Stack, structured: gateway_pb2.StructuredOutput, **params: object
             ) -> gateway_pb2.GenerateRequest:
    request = gateway_pb2.GenerateRequest(prompt="Describe a person as JSON:",
                                          structured_output=structured)
    for key, value in params.items():
        if key == "final_only":
            request.final_only = bool(value)
        else:
            setattr(request.sampling_params, key, value)
    return request


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("final_only", [False, True])
def test_json_schema_outputs_validate(stack: Stack, temperature: float,
                                      final_only: bool) -> None:
    structured = gateway_pb2.StructuredOutput(json_schema=json.dumps(PERSON))
    request = generate(stack, structured, max_tokens=200, temperature=temperature, n=3,
                       seed=5, final_only=final_only)
    result = collect(stack.client.stub.Generate(request, timeout=60))
    assert result.finish_reasons == ["stop"] * 3, result.texts
    for text in result.texts:
        jsonschema.validate(json.loads(text), PERSON)
    assert stack.runner.masked_rows > 0
    assert stack.wait_idle().used_blocks == 0


def test_constrained_rows_keep_one_token_per_step(stack: Stack) -> None:
    """A masked decode row samples every step: its masks follow the step (filled while the
    forward runs), not a step later."""
    structured = gateway_pb2.StructuredOutput(regex="[a-z]{60}")
    before = len(stack.runner.batches)
    result = collect(stack.client.stub.Generate(
        generate(stack, structured, max_tokens=100, temperature=0), timeout=60))
    batches = stack.runner.batches[before:]
    assert len(result.texts[0]) == 60 and result.finish_reasons == ["stop"]
    tokens = len(result.token_ids[0])
    assert len(batches) <= tokens + 3, (len(batches), tokens)
    assert sum(b.masks_follow for b in batches) >= tokens - 3


def test_an_invalid_format_is_refused_naming_the_field(stack: Stack) -> None:
    for structured, field in [
        (gateway_pb2.StructuredOutput(json_schema="{nope"), "structured_output.json_schema"),
        (gateway_pb2.StructuredOutput(regex="("), "structured_output.regex"),
        (gateway_pb2.StructuredOutput(grammar="start: missing"), "structured_output.grammar"),
        (gateway_pb2.StructuredOutput(json_schema=json.dumps({"type": "nope"})),
         "structured_output.json_schema"),
    ]:
        with pytest.raises(grpc.RpcError) as raised:
            collect(stack.client.stub.Generate(generate(stack, structured), timeout=30))
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert raised.value.details().startswith(field), raised.value.details()
    assert stack.wait_idle().used_blocks == 0


WEATHER = gateway_pb2.Tool(name="get_weather", description="The weather in a city.",
                           parameters=json.dumps({
                               "type": "object",
                               "properties": {"city": {"type": "string", "maxLength": 10},
                                              "days": {"type": "integer", "minimum": 1,
                                                       "maximum": 7}},
                               "required": ["city", "days"], "additionalProperties": False}))
CLOCK = gateway_pb2.Tool(name="get_time", parameters=json.dumps({
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
    # Closed: the fake model, free to add properties, nests arrays until max_tokens.
    "additionalProperties": False}))


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("final_only", [False, True])
def test_required_tool_calls_validate_streamed_or_not(stack: Stack, parallel: bool,
                                                      final_only: bool) -> None:
    request = gateway_pb2.GenerateRequest(
        messages=gateway_pb2.ChatMessages(messages=[
            gateway_pb2.ChatMessage(role="user", content="Weather in Oslo?")]),
        tools=[WEATHER, CLOCK], parallel_tool_calls=parallel, final_only=final_only,
        tool_choice=gateway_pb2.ToolChoice(mode=gateway_pb2.TOOL_CHOICE_MODE_REQUIRED),
        sampling_params=gateway_pb2.SamplingParams(max_tokens=300, temperature=0.7, seed=9,
                                                   n=2))
    result = collect(stack.client.stub.Generate(request, timeout=60))
    schemas = {tool.name: json.loads(tool.parameters) for tool in (WEATHER, CLOCK)}
    for text, calls, reason in zip(result.texts, result.tool_calls, result.finish_reasons,
                                   strict=True):
        assert reason == "tool_calls" and not text.strip(), (text, reason)
        assert len(calls) >= 1 and (parallel or len(calls) == 1)
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
            assert call.id.startswith("call_")
    assert stack.wait_idle().used_blocks == 0


def test_a_named_function_is_the_one_called(stack: Stack) -> None:
    request = gateway_pb2.GenerateRequest(
        messages=gateway_pb2.ChatMessages(messages=[
            gateway_pb2.ChatMessage(role="user", content="Time?")]),
        tools=[WEATHER, CLOCK], tool_choice=gateway_pb2.ToolChoice(function_name="get_time"),
        sampling_params=gateway_pb2.SamplingParams(max_tokens=100, temperature=0))
    result = collect(stack.client.stub.Generate(request, timeout=60))
    [call] = result.tool_calls[0]
    assert call.name == "get_time" and result.finish_reasons == ["tool_calls"]
    assert json.loads(call.arguments)["zone"] in ("utc", "cet")
