"""The HTTP API's structured-output and tool fields, at the unit level: OpenAI / vLLM bodies to
GenerateRequests (gateway/http/protocol.py, gateway/http/structured.py), refusals naming the
field, and tool calls in answers, whole and streamed (gateway/http/responses.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.http.app import _field_named
from gateway.http.errors import ApiError
from gateway.http.protocol import Job, ServedModel, parse_chat, parse_completion
from gateway.http.responses import Answer
from protos import gateway_pb2

MODEL = ServedModel("m")
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
USER = [{"role": "user", "content": "Weather in Paris?"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                         "parameters": SCHEMA, "strict": True}}


def chat(**fields: Any) -> gateway_pb2.GenerateRequest:
    job = parse_chat({"messages": USER, **fields}, MODEL)
    assert len(job.requests) == 1
    return job.requests[0]


def refusal(parse: Any, body: dict[str, Any]) -> ApiError:
    with pytest.raises(ApiError) as error:
        parse(body, MODEL)
    assert error.value.status == 400
    return error.value


# ----- output formats ----------------------------------------------------------------------

FORMATS: list[tuple[dict[str, Any], gateway_pb2.StructuredOutput | None]] = [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, gateway_pb2.StructuredOutput(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "w", "schema": SCHEMA, "strict": True, "description": "d"}}},
     gateway_pb2.StructuredOutput(json_schema=json.dumps(SCHEMA))),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "strict": None}}},
     gateway_pb2.StructuredOutput(json_schema="{}")),  # no schema: any JSON value
    ({"structured_outputs": {"json": SCHEMA}},
     gateway_pb2.StructuredOutput(json_schema=json.dumps(SCHEMA))),
    ({"structured_outputs": {"json": '{"type": "integer"}'}},  # JSON text goes as it is
     gateway_pb2.StructuredOutput(json_schema='{"type": "integer"}')),
    ({"structured_outputs": {"json": SCHEMA, "whitespace_flexible": True,
                             "disable_fallback": True}},
     gateway_pb2.StructuredOutput(json_schema=json.dumps(SCHEMA), whitespace_flexible=True)),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True,
                             "disable_additional_properties": False}},
     gateway_pb2.StructuredOutput(json_schema=json.dumps(SCHEMA))),
    ({"structured_outputs": {"regex": "[0-9]{3}", "choice": None}},
     gateway_pb2.StructuredOutput(regex="[0-9]{3}")),
    ({"structured_outputs": {"choice": ["yes", "no"]}},
     gateway_pb2.StructuredOutput(choice=gateway_pb2.StringList(values=["yes", "no"]))),
    ({"structured_outputs": {"grammar": 'start: "a"+'}},
     gateway_pb2.StructuredOutput(grammar='start: "a"+')),
    ({"structured_outputs": {"json_object": True}},
     gateway_pb2.StructuredOutput(json_object=True)),
    ({"structured_outputs": {"json_object": False}}, None),
    ({"structured_outputs": {"json_object": False, "regex": "a"}},
     gateway_pb2.StructuredOutput(regex="a")),
    ({"structured_outputs": {}}, None),
    ({"guided_json": SCHEMA}, gateway_pb2.StructuredOutput(json_schema=json.dumps(SCHEMA))),
    ({"guided_regex": "a|b"}, gateway_pb2.StructuredOutput(regex="a|b")),
    ({"guided_choice": ["x"]}, gateway_pb2.StructuredOutput(
        choice=gateway_pb2.StringList(values=["x"]))),
    ({"guided_grammar": "start: /x+/"}, gateway_pb2.StructuredOutput(grammar="start: /x+/")),
    ({"guided_json": None, "response_format": None, "guided_whitespace_pattern": None}, None),
]


@pytest.mark.parametrize(("fields", "expected"), FORMATS, ids=[str(f)[:60] for f, _ in FORMATS])
def test_output_formats_map_onto_structured_output(
        fields: dict[str, Any], expected: gateway_pb2.StructuredOutput | None) -> None:
    request = chat(**fields)
    if expected is None:
        assert not request.HasField("structured_output")
    else:
        assert request.structured_output == expected
    completion = parse_completion({"prompt": ["a", "b"], **fields}, MODEL)
    for pb in completion.requests:  # completions take them too, for every prompt
        assert pb.HasField("structured_output") == (expected is not None)
        if expected is not None:
            assert pb.structured_output == expected
    field = next((k for k, v in fields.items() if v is not None and expected is not None), None)
    assert completion.format_field == field


BAD_FORMATS: list[tuple[dict[str, Any], str]] = [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": "json_object"}, "response_format"),
    ({"response_format": {"type": "text", "x": 1}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA, "x": 1}}},
     "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": 5}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"strict": "yes"}}},
     "response_format.json_schema.strict"),
    ({"structured_outputs": "regex"}, "structured_outputs"),
    ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"frobnicate": 1}}, "structured_outputs"),
    ({"structured_outputs": {"json": "not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": "[1, 2]"}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": 5}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": ["start"]}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object"),
    ({"structured_outputs": {"json": SCHEMA, "whitespace_flexible": 1}}, "structured_outputs"),
    ({"structured_outputs": {"json": SCHEMA, "whitespace_flexible": True,
                             "disable_any_whitespace": True}}, "structured_outputs"),
    ({"structured_outputs": {"json": SCHEMA, "disable_additional_properties": True}},
     "structured_outputs"),
    ({"structured_outputs": {"json": SCHEMA, "whitespace_pattern": " ?"}},
     "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs"),
    ({"guided_json": SCHEMA, "guided_whitespace_pattern": "[ ]*"}, "guided_whitespace_pattern"),
    ({"guided_choice": "yes"}, "guided_choice"),
    ({"guided_regex": 5}, "guided_regex"),
    # one format a request
    ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "guided_json"),
    ({"structured_outputs": {"regex": "a"}, "guided_regex": "b"}, "guided_regex"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs"),
]


@pytest.mark.parametrize(("fields", "param"), BAD_FORMATS,
                         ids=[str(f)[:60] for f, _ in BAD_FORMATS])
def test_bad_formats_are_refused_naming_the_field(fields: dict[str, Any], param: str) -> None:
    for parse, body in ((parse_chat, {"messages": USER, **fields}),
                        (parse_completion, {"prompt": "x", **fields})):
        error = refusal(parse, body)
        assert error.param == param, error
        assert param.split(".")[0] in error.message.split(":")[0], error.message


def test_two_formats_are_both_named() -> None:
    error = refusal(parse_chat, {"messages": USER, "response_format": {"type": "json_object"},
                                 "guided_regex": "a"})
    assert "response_format and guided_regex" in error.message
    error = refusal(parse_chat, {"messages": USER,
                                 "structured_outputs": {"choice": ["a"], "grammar": "g"}})
    assert "structured_outputs.choice and structured_outputs.grammar" in error.message


# ----- tools -------------------------------------------------------------------------------

def test_tools_map_onto_the_request() -> None:
    request = chat(tools=[TOOL, {"type": "function", "function": {"name": "now"}}],
                   tool_choice="required", parallel_tool_calls=False)
    assert list(request.tools) == [
        gateway_pb2.Tool(name="get_weather", description="Weather.",
                         parameters=json.dumps(SCHEMA), strict=True),
        gateway_pb2.Tool(name="now")]
    assert request.tool_choice == gateway_pb2.ToolChoice(
        mode=gateway_pb2.TOOL_CHOICE_MODE_REQUIRED)
    assert request.HasField("parallel_tool_calls") and not request.parallel_tool_calls
    for choice, mode in (("auto", gateway_pb2.TOOL_CHOICE_MODE_AUTO),
                         ("none", gateway_pb2.TOOL_CHOICE_MODE_NONE)):
        assert chat(tools=[TOOL], tool_choice=choice).tool_choice.mode == mode
    named = chat(tools=[TOOL], tool_choice={"type": "function",
                                            "function": {"name": "get_weather"}})
    assert named.tool_choice == gateway_pb2.ToolChoice(function_name="get_weather")
    plain = chat(tools=None, tool_choice=None, parallel_tool_calls=None)
    assert not plain.tools and not plain.HasField("tool_choice")
    assert not plain.HasField("parallel_tool_calls")
    # what clients that fill every field in send: nothing asked
    empty = chat(tools=[], tool_choice="none", parallel_tool_calls=True)
    assert not empty.tools


BAD_TOOLS: list[tuple[dict[str, Any], str]] = [
    ({"tools": TOOL}, "tools"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0]"),
    ({"tools": [TOOL, {"type": "function", "function": {"name": "f"}, "x": 1}]}, "tools[1]"),
    ({"tools": [{"type": "function", "function": "f"}]}, "tools[0].function"),
    ({"tools": [{"type": "function", "function": {"name": "f", "returns": {}}}]},
     "tools[0].function"),
    ({"tools": [{"type": "function", "function": {"name": 5}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"description": "d"}}]},
     "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": 1}}]},
     "tools[0].function.description"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "no"}}]},
     "tools[0].function.strict"),
    ({"tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": 1}}}, "tool_choice"),
    ({"tool_choice": {"type": "function", "name": "f"}}, "tool_choice"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [TOOL], "response_format": {"type": "json_object"}}, "tools"),
    ({"tools": [TOOL], "guided_regex": "a"}, "tools"),
]


@pytest.mark.parametrize(("fields", "param"), BAD_TOOLS, ids=[str(f)[:60] for f, _ in BAD_TOOLS])
def test_bad_tools_are_refused_naming_the_field(fields: dict[str, Any], param: str) -> None:
    error = refusal(parse_chat, {"messages": USER, **fields})
    assert error.param == param, error


def test_tools_with_a_format_name_the_format_field() -> None:
    error = refusal(parse_chat, {"messages": USER, "tools": [TOOL], "guided_regex": "a"})
    assert error.message.startswith("tools cannot be combined with guided_regex")


@pytest.mark.parametrize("fields", [{"tools": [TOOL]}, {"tool_choice": "required"},
                                    {"tool_choice": "auto"}])
def test_tools_are_refused_on_completions(fields: dict[str, Any]) -> None:
    error = refusal(parse_completion, {"prompt": "x", **fields})
    assert error.param == next(iter(fields))
    assert "/v1/chat/completions only" in error.message
    # what asks for nothing is taken
    parse_completion({"prompt": "x", "tools": [], "tool_choice": "none",
                      "parallel_tool_calls": False}, MODEL)


# ----- messages with calls and results -------------------------------------------------------

def test_calls_and_results_in_messages_map_onto_the_request() -> None:
    messages = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"function": {"name": "now", "arguments": {"tz": "UTC"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "22"}]},
        {"role": "assistant", "content": "Done.", "tool_calls": None},
        {"role": "assistant", "tool_calls": [{"function": {"name": "now"}}]},
        # an answer's message sent back as the openai SDK's model_dump() writes it
        {"content": None, "refusal": None, "role": "assistant", "annotations": None,
         "audio": None, "function_call": None, "tool_calls": [
             {"id": "call_2", "function": {"arguments": "{}", "name": "now"},
              "type": "function"}]},
    ]
    request = parse_chat({"messages": messages}, MODEL).requests[0]
    assert list(request.messages.messages) == [
        gateway_pb2.ChatMessage(role="user", content="Weather in Paris?"),
        gateway_pb2.ChatMessage(role="assistant", tool_calls=[
            gateway_pb2.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}'),
            gateway_pb2.ToolCall(name="now", arguments='{"tz": "UTC"}')]),
        gateway_pb2.ChatMessage(role="tool", content="22", tool_call_id="call_1"),
        gateway_pb2.ChatMessage(role="assistant", content="Done."),
        gateway_pb2.ChatMessage(role="assistant", tool_calls=[gateway_pb2.ToolCall(name="now")]),
        gateway_pb2.ChatMessage(role="assistant", tool_calls=[
            gateway_pb2.ToolCall(id="call_2", name="now", arguments="{}")]),
    ]


BAD_MESSAGES: list[tuple[dict[str, Any], str]] = [
    ({"role": "tool", "content": "x"}, "messages[1].tool_call_id"),
    ({"role": "tool", "content": "x", "tool_call_id": 5}, "messages[1].tool_call_id"),
    ({"role": "user", "content": "x", "tool_calls": []}, "messages[1]"),
    ({"role": "user", "content": "x", "tool_call_id": "c"}, "messages[1]"),
    ({"role": "assistant", "content": None}, "messages[1].content"),
    ({"role": "assistant", "content": None, "tool_calls": []}, "messages[1].content"),
    ({"role": "assistant", "tool_calls": {"function": {"name": "f"}}},
     "messages[1].tool_calls"),
    ({"role": "assistant", "tool_calls": [{"type": "code", "function": {"name": "f"}}]},
     "messages[1].tool_calls[0]"),
    ({"role": "assistant", "tool_calls": [{"function": {"name": 1}}]},
     "messages[1].tool_calls[0]"),
    ({"role": "assistant", "tool_calls": [{"id": 1, "function": {"name": "f"}}]},
     "messages[1].tool_calls[0]"),
    ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 1}}]},
     "messages[1].tool_calls[0]"),
    ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "x": 1}}]},
     "messages[1].tool_calls[0]"),
    ({"role": "assistant", "content": "x", "name": "bot"}, "messages[1]"),
    ({"role": "assistant", "content": "x", "refusal": "no"}, "messages[1]"),
    ({"role": "user", "content": "x", "refusal": None}, "messages[1]"),
]


@pytest.mark.parametrize(("message", "param"), BAD_MESSAGES,
                         ids=[str(m)[:60] for m, _ in BAD_MESSAGES])
def test_bad_calls_and_results_are_refused_naming_the_field(message: dict[str, Any],
                                                            param: str) -> None:
    error = refusal(parse_chat, {"messages": [*USER, message]})
    assert error.param == param, error


# ----- admission's messages name the field -----------------------------------------------------

def test_admission_errors_name_the_body_field() -> None:
    job = parse_chat({"messages": USER, "guided_regex": "("}, MODEL)
    assert _field_named("structured_output.regex: bad regex", job) == "guided_regex"
    assert _field_named("tools[2].name 'a b' must be ...", job) == "tools[2].name"
    assert _field_named("tool_choice.function_name 'x' is not ...", job) == (
        "tool_choice.function_name")
    assert _field_named("messages[0].tool_calls[1].arguments is not JSON", job) == (
        "messages[0].tool_calls[1].arguments")
    assert _field_named("max_tokens 5 is over", job) == "max_tokens"
    assert _field_named("the prompt is empty", job) is None
    plain = parse_chat({"messages": USER}, MODEL)
    assert _field_named("structured_output.regex: bad", plain) is None


# ----- answers with calls ------------------------------------------------------------------

def delta(index: int, call_id: str = "", name: str = "", arguments: str = ""
          ) -> gateway_pb2.ToolCallDelta:
    return gateway_pb2.ToolCallDelta(index=index, id=call_id, name=name, arguments=arguments)


def message(*outputs: gateway_pb2.CompletionOutput) -> gateway_pb2.GenerateResponse:
    return gateway_pb2.GenerateResponse(outputs=list(outputs))


CALLS = gateway_pb2.FINISH_REASON_TOOL_CALLS
STREAM = [
    message(gateway_pb2.CompletionOutput(index=0, text="Let me check.")),
    message(gateway_pb2.CompletionOutput(index=0, tool_calls=[
        delta(0, "call_a", "get_weather", ""), delta(0, arguments='{"ci')])),
    message(gateway_pb2.CompletionOutput(index=0, tool_calls=[
        delta(0, arguments='ty": "Paris"}'), delta(1, "call_b", "now", "{}")])),
    message(gateway_pb2.CompletionOutput(index=0, finish_reason=CALLS)),
]


def answer(stream: bool) -> Answer:
    job = Job(model="m", requests=[gateway_pb2.GenerateRequest()], n=1, stream=stream,
              include_usage=False, chat=True)
    return Answer(job, lambda token: "", [])


def test_a_whole_answer_has_the_calls_and_finish_reason_tool_calls() -> None:
    whole = answer(stream=False)
    for item in STREAM:
        whole.add(0, item)
    choice = whole.whole()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"] == {"role": "assistant", "content": "Let me check.", "tool_calls": [
        {"id": "call_a", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_b", "type": "function", "function": {"name": "now", "arguments": "{}"}}]}
    only_calls = answer(stream=False)
    for item in STREAM[1:]:
        only_calls.add(0, item)
    assert only_calls.whole()["choices"][0]["message"]["content"] is None
    plain = answer(stream=False)
    plain.add(0, message(gateway_pb2.CompletionOutput(
        index=0, text="Hi", finish_reason=gateway_pb2.FINISH_REASON_STOP)))
    assert plain.whole()["choices"][0]["message"] == {"role": "assistant", "content": "Hi"}


def test_a_stream_has_the_calls_as_openai_streams_them() -> None:
    streamed = answer(stream=True)
    deltas = [chunk["choices"][0]["delta"] for item in STREAM
              for chunk in streamed.chunks(0, item)]
    reasons = [chunk["choices"][0]["finish_reason"] for item in STREAM
               for chunk in streamed.chunks(0, item)]
    assert deltas == [
        {"role": "assistant", "content": "Let me check."},
        {"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"ci'}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Paris"}'}},
                        {"index": 1, "id": "call_b", "type": "function",
                         "function": {"name": "now", "arguments": "{}"}}]},
        {},
    ]
    assert reasons == [None, None, None, "tool_calls"]


# ----- junk never gets past as anything but a 400 ------------------------------------------

JUNK = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
              st.text(max_size=8), st.sampled_from(["function", "json_schema", "text", "none",
                                                    "auto", "required", "json_object"])),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.sampled_from(
                                ["type", "function", "name", "parameters", "json_schema",
                                 "schema", "json", "regex", "choice", "grammar", "id",
                                 "arguments", "strict", "whitespace_flexible", "x"]),
                                inner, max_size=4)),
    max_leaves=12)
FIELDS = ["response_format", "structured_outputs", "guided_json", "guided_regex",
          "guided_choice", "guided_grammar", "guided_whitespace_pattern", "tools",
          "tool_choice", "parallel_tool_calls"]


@settings(max_examples=400, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(fields=st.dictionaries(st.sampled_from(FIELDS), JUNK, min_size=1, max_size=3),
       message=st.dictionaries(st.sampled_from(["role", "content", "tool_calls",
                                                "tool_call_id"]), JUNK, max_size=4))
def test_junk_in_the_new_fields_is_a_400_or_a_request(fields: dict[str, Any],
                                                      message: dict[str, Any]) -> None:
    for parse, body in ((parse_chat, {"messages": [*USER, message], **fields}),
                        (parse_chat, {"messages": USER, **fields}),
                        (parse_completion, {"prompt": "x", **fields})):
        try:
            job = parse(body, MODEL)
        except ApiError as error:
            assert error.status == 400 and error.message
        else:
            for request in job.requests:
                request.SerializeToString()
