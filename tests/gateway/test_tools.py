"""A request's tools (gateway/tools.py): the checks and their messages, the grammar that forces
Hermes-format calls (held against llguidance with the default model's tokenizer, token by
token), and chats with tools rendered for a template without tool support (the default
model's) and for one with it."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import llguidance
import pytest

from common.model_store import resolve_model
from gateway.adapters import AdapterCatalog
from gateway.admission import Admission
from gateway.config import GatewayConfig
from gateway.runner_loop import BackendInfo
from gateway.tokenizer import ChatMessage, Tokenizer, ToolCall
from gateway.tool_calls import ToolCallParser
from gateway.tools import (
    MAX_TOOLS,
    FunctionTool,
    ToolUse,
    check_tool_use,
    tool_grammar,
    tools_system_text,
)
from gateway.validation import InvalidRequest
from protos import gateway_pb2

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/unit"},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city"],
    "$defs": {"unit": {"enum": ["celsius", "fahrenheit"]}},
}
SEARCH = {"type": "object", "properties": {"query": {"type": "string"},
                                           "filters": {"type": "array",
                                                       "items": {"$ref": "#/$defs/filter"}}},
          "required": ["query"], "additionalProperties": False,
          "$defs": {"filter": {"type": "object", "properties": {"key": {"type": "string"}},
                               "required": ["key"]}}}
TOOLS = (FunctionTool("get_weather", "The weather in a city.", WEATHER),
         FunctionTool("search-web", "", SEARCH),
         FunctionTool("now", "The time.", {"type": "object"}))


def request(tools: list[dict[str, Any]] | None = None, **fields: Any
            ) -> gateway_pb2.GenerateRequest:
    """A chat request with `tools` ({name, parameters, ...} each) and other fields."""
    pb = gateway_pb2.GenerateRequest(**fields)
    if not pb.WhichOneof("input"):
        pb.messages.messages.add(role="user", content="What is the weather in Paris?")
    for tool in tools if tools is not None else [{"name": "get_weather",
                                                  "parameters": json.dumps(WEATHER)}]:
        pb.tools.add(**tool)
    return pb


# ----- checks ------------------------------------------------------------------------------

INVALID: list[tuple[str, gateway_pb2.GenerateRequest, str]] = [
    ("bad name", request([{"name": "get weather"}]), "tools[0].name"),
    ("empty name", request([{"name": "f"}, {"name": ""}]), "tools[1].name"),
    ("long name", request([{"name": "x" * 65}]), "tools[0].name"),
    ("same name twice", request([{"name": "f"}, {"name": "g"}, {"name": "f"}]),
     "tools[2].name 'f' is also the name of tools[0]"),
    ("too many tools", request([{"name": f"f{i}"} for i in range(MAX_TOOLS + 1)]), "tools has"),
    ("parameters not JSON", request([{"name": "f", "parameters": "{type: object}"}]),
     "tools[0].parameters is not JSON"),
    ("parameters not an object", request([{"name": "f"}, {"name": "g", "parameters": "[1]"}]),
     "tools[1].parameters must be a JSON schema object"),
    ("named function unknown", request(tool_choice=gateway_pb2.ToolChoice(function_name="g")),
     "tool_choice.function_name 'g' is not one of the tools (get_weather)"),
    ("named function without tools",
     request([], tool_choice=gateway_pb2.ToolChoice(function_name="g")),
     "tool_choice.function_name"),
    ("required without tools",
     request([], tool_choice=gateway_pb2.ToolChoice(mode=gateway_pb2.TOOL_CHOICE_MODE_REQUIRED)),
     "tool_choice required needs tools"),
    ("unknown mode", request(tool_choice=gateway_pb2.ToolChoice(mode=9)),  # type: ignore[arg-type]
     "tool_choice.mode"),
    ("tools with a text prompt", request(prompt="hi"), "tools need a messages prompt"),
    ("tools with token ids",
     request(prompt_token_ids=gateway_pb2.TokenIds(token_ids=[1, 2])), "tools need"),
    ("tools with structured output",
     request(structured_output=gateway_pb2.StructuredOutput(json_object=True)),
     "tools cannot be combined with structured_output"),
]


@pytest.mark.parametrize(("pb", "message"), [case[1:] for case in INVALID],
                         ids=[case[0] for case in INVALID])
def test_invalid_tools_are_refused_naming_the_field(pb: gateway_pb2.GenerateRequest,
                                                    message: str) -> None:
    with pytest.raises(InvalidRequest) as error:
        check_tool_use(pb)
    assert str(error.value).startswith(message), str(error.value)


def test_how_a_request_uses_its_tools() -> None:
    assert check_tool_use(request([])) is None
    # tool_choice auto or none without tools asks for nothing
    for mode in (gateway_pb2.TOOL_CHOICE_MODE_AUTO, gateway_pb2.TOOL_CHOICE_MODE_NONE):
        assert check_tool_use(request([], tool_choice=gateway_pb2.ToolChoice(mode=mode))) is None
    use = check_tool_use(request([{"name": "f"}, {"name": "g", "parameters": "", "strict": True,
                                                  "description": "G."}]))
    assert use == ToolUse((FunctionTool("f", "", {"type": "object"}),
                           FunctionTool("g", "G.", {"type": "object"}, strict=True)),
                          "auto", "", True)
    assert use.grammar() is None and use.parses_calls
    none = check_tool_use(request(tool_choice=gateway_pb2.ToolChoice(
        mode=gateway_pb2.TOOL_CHOICE_MODE_NONE)))
    assert none is not None and none.mode == "none" and not none.parses_calls
    assert none.grammar() is None
    required = check_tool_use(request(
        tool_choice=gateway_pb2.ToolChoice(mode=gateway_pb2.TOOL_CHOICE_MODE_REQUIRED),
        parallel_tool_calls=False))
    assert required is not None and (required.mode, required.parallel) == ("required", False)
    assert required.grammar() == tool_grammar(required.tools, None, False)
    named = check_tool_use(request(tool_choice=gateway_pb2.ToolChoice(
        function_name="get_weather")))
    assert named is not None and (named.mode, named.function_name) == ("function",
                                                                       "get_weather")
    assert named.grammar() == tool_grammar(named.tools, "get_weather", False)


# ----- the grammar -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ll_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(tokenizer._tok.backend_tokenizer.to_str(),
                                  eos_token=tokenizer.eos_token_id)


def accepts(tokenizer: Tokenizer, ll_tokenizer: llguidance.LLTokenizer, grammar: str,
            text: str) -> bool:
    """Whether the grammar lets the model write `text` token by token and then stop (EOS)."""
    matcher = llguidance.LLMatcher(ll_tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar),
                                   log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    for token in tokenizer.encode(text):
        if not matcher.consume_token(token):
            return False
    return matcher.is_accepting() and matcher.consume_token(ll_tokenizer.eos_token)


def call(name: str, arguments: dict[str, Any]) -> str:
    """A call exactly as the grammar wants it (json.dumps' separators, characters as they are:
    llguidance writes \\u escapes only for control characters)."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


GOOD = [call("get_weather", {"city": "Paris"}),
        call("get_weather", {"city": "Zürich \"centre\"", "unit": "celsius", "days": 3}),
        call("search-web", {"query": "llguidance", "filters": [{"key": "a"}, {"key": "b"}]}),
        call("now", {}),
        call("now", {"anything": [1, None]})]
BAD = [call("get_weather", {"unit": "celsius"}),  # city is required
       call("get_weather", {"city": "Paris", "unit": "kelvin"}),  # not in the $ref'd enum
       call("get_weather", {"city": "Paris", "days": 9}),
       call("search-web", {"query": "x", "other": 1}),  # no additional properties
       call("search-web", {"query": "x", "filters": [{}]}),  # a $ref'd item lacks its key
       call("nope", {}),
       '<tool_call>\n{"arguments": {}, "name": "now"}\n</tool_call>',  # name comes first
       '<tool_call>\n{"name":"now","arguments":{}}\n</tool_call>',  # json.dumps' spacing
       '<tool_call>{"name": "now", "arguments": {}}</tool_call>',  # the newlines
       "The weather is fine.",
       ""]


@pytest.mark.parametrize(("function_name", "parallel"), [(None, True), (None, False),
                                                         ("get_weather", True)])
def test_the_grammar_compiles(function_name: str | None, parallel: bool) -> None:
    grammar = tool_grammar(TOOLS, function_name, parallel)
    assert llguidance.LLMatcher.validate_grammar(
        llguidance.LLMatcher.grammar_from_lark(grammar)) == ""


def test_the_grammar_takes_valid_calls_token_by_token_and_nothing_else(
        tokenizer: Tokenizer, ll_tokenizer: llguidance.LLTokenizer) -> None:
    one = tool_grammar(TOOLS, None, parallel=False)
    for text in GOOD:
        assert accepts(tokenizer, ll_tokenizer, one, text), text
        parsed = ToolCallParser(lambda: "id")  # and the parser reads them back
        content, deltas = parsed.feed(text)
        assert content == "" and len(deltas) == 1
        assert deltas[0].arguments == text.split('"arguments": ', 1)[1].rsplit("}", 1)[0]
    for text in BAD:
        assert not accepts(tokenizer, ll_tokenizer, one, text), text
    two = GOOD[0] + "\n" + GOOD[2]
    assert not accepts(tokenizer, ll_tokenizer, one, two)
    assert accepts(tokenizer, ll_tokenizer, tool_grammar(TOOLS, None, parallel=True), two)
    assert accepts(tokenizer, ll_tokenizer, tool_grammar(TOOLS, None, parallel=True),
                   "\n".join(GOOD))


def test_a_named_function_is_called_once(tokenizer: Tokenizer,
                                         ll_tokenizer: llguidance.LLTokenizer) -> None:
    grammar = tool_grammar(TOOLS, "get_weather", parallel=True)
    assert accepts(tokenizer, ll_tokenizer, grammar, GOOD[1])
    assert not accepts(tokenizer, ll_tokenizer, grammar, GOOD[3])
    assert not accepts(tokenizer, ll_tokenizer, grammar, GOOD[0] + "\n" + GOOD[1])


def test_data_that_looks_like_a_reference_is_left_alone(
        tokenizer: Tokenizer, ll_tokenizer: llguidance.LLTokenizer) -> None:
    schema = {"type": "object", "properties": {"r": {"const": {"$ref": "#/x"}}},
              "required": ["r"]}
    grammar = tool_grammar([FunctionTool("f", "", schema)], None, False)
    assert accepts(tokenizer, ll_tokenizer, grammar, call("f", {"r": {"$ref": "#/x"}}))


# ----- chats with tools --------------------------------------------------------------------

CHAT = [ChatMessage("system", "Be brief."),
        ChatMessage("user", "Weather in Paris and Rome?"),
        ChatMessage("assistant", "Checking.", (
            ToolCall("get_weather", '{"city": "Paris"}', "call_1"),
            ToolCall("get_weather", '{"city":"Rome"}', "call_2"))),
        ChatMessage("tool", "22 C", tool_call_id="call_1"),
        ChatMessage("tool", "25 C", tool_call_id="call_2"),
        ChatMessage("assistant", "", (ToolCall("now", "{}"),)),
        ChatMessage("tool", "noon", tool_call_id="")]


def test_a_template_without_tool_support_gets_hermes_text(tokenizer: Tokenizer) -> None:
    """The default model's template knows no tools: the description goes first in the system
    message, calls as <tool_call> blocks, results in user turns of <tool_response> blocks."""
    text = tokenizer.render_chat(CHAT, TOOLS)
    description = tools_system_text(TOOLS)
    assert text == (
        f"<|im_start|>system\n{description}\n\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
        "<|im_start|>assistant\nChecking.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n22 C\n</tool_response>\n"
        "<tool_response>\n25 C\n</tool_response><|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nnoon\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    assert "<tools>\n" + json.dumps(TOOLS[0].openai()) + "\n" in description
    assert "<tool_call>" in description
    # Without a system message the description is one, in place of the template's default.
    alone = tokenizer.render_chat([ChatMessage("user", "Hi")], TOOLS)
    assert alone.startswith(f"<|im_start|>system\n{description}<|im_end|>\n<|im_start|>user")
    # Without tools nothing changes.
    plain = [ChatMessage("user", "Hi")]
    assert tokenizer.render_chat(plain) == tokenizer._tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert tokenizer.encode_chat(plain, TOOLS) == tokenizer.encode(alone)


# A template that renders tools itself (the shape of Qwen's and Llama's, much shortened).
TOOL_TEMPLATE = (
    "{% if tools %}TOOLS {{ tools | tojson }} | {% endif %}"
    "{% for m in messages %}"
    "[{{ m.role }}] {{ m.content }}"
    "{% for c in m.tool_calls or [] %} CALL {{ c.id }} {{ c.function.name }} "
    "{{ c.function.arguments.city }}{% endfor %}"
    "{% if m.role == 'tool' %} FOR {{ m.tool_call_id }}{% endif %} | "
    "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")


def test_a_template_with_tool_support_gets_them_in_openais_shape() -> None:
    """Tools as OpenAI's JSON, calls with their arguments as objects, results as tool
    messages with the id of their call."""
    tokenizer = Tokenizer(resolve_model(None))
    tokenizer._tok.chat_template = TOOL_TEMPLATE
    text = tokenizer.render_chat(CHAT[1:5], TOOLS[:1])
    assert text == (
        f"TOOLS {json.dumps([TOOLS[0].openai()], ensure_ascii=False)} | "
        "[user] Weather in Paris and Rome? | "
        "[assistant] Checking. CALL call_1 get_weather Paris CALL call_2 get_weather Rome | "
        "[tool] 22 C FOR call_1 | [tool] 25 C FOR call_2 | [assistant]")
    assert tokenizer.render_chat(CHAT[1:2]) == "[user] Weather in Paris and Rome? | [assistant]"


def test_a_template_that_refuses_the_messages_is_a_value_error() -> None:
    tokenizer = Tokenizer(resolve_model(None))
    tokenizer._tok.chat_template = (
        "{% for m in messages %}{% if m.role == 'user' and not loop.first %}"
        "{{ raise_exception('roles must alternate') }}{% endif %}{{ m.content }}{% endfor %}")
    with pytest.raises(ValueError, match="roles must alternate"):
        tokenizer.render_chat([ChatMessage("user", "a"), ChatMessage("user", "b")])


# ----- chats with tools through admission --------------------------------------------------

@pytest.fixture(scope="module")
def admission(tokenizer: Tokenizer) -> Admission:
    info = BackendInfo("m", "llama", tokenizer.size, [2], 2048, 1024, 16, "float32", "cpu", 1)
    engine: Any = SimpleNamespace(config=GatewayConfig(), new_seed=lambda: 1,
                                  adapters=AdapterCatalog())
    return Admission(engine, tokenizer, info)


def chat_request(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
                 ) -> gateway_pb2.GenerateRequest:
    pb = gateway_pb2.GenerateRequest()
    for message in messages:
        pb.messages.messages.add(**message)
    for tool in tools or []:
        pb.tools.add(**tool)
    return pb


def test_admission_renders_the_requests_tools_and_calls(admission: Admission,
                                                        tokenizer: Tokenizer) -> None:
    pb = chat_request(
        [{"role": "user", "content": "Weather?"},
         {"role": "assistant", "tool_calls": [{"id": "c1", "name": "get_weather",
                                                "arguments": '{"city": "Paris"}'},
                                               {"name": "now", "arguments": ""}]},
         {"role": "tool", "content": "22 C", "tool_call_id": "c1"}],
        [{"name": "get_weather", "description": "The weather in a city.",
          "parameters": json.dumps(WEATHER)}])
    expected = tokenizer.encode_chat([
        ChatMessage("user", "Weather?"),
        ChatMessage("assistant", "", (ToolCall("get_weather", '{"city": "Paris"}', "c1"),
                                      ToolCall("now", "{}"))),
        ChatMessage("tool", "22 C", tool_call_id="c1")], TOOLS[:1])
    assert admission.build_request(pb).prompt_ids == expected
    # a TokenizeRequest has no tools: the same chat without their description
    tokenize = gateway_pb2.TokenizeRequest(messages=pb.messages)
    assert admission.prompt_ids(tokenize) != expected
    assert admission.prompt_ids(tokenize) == tokenizer.encode_chat([
        ChatMessage("user", "Weather?"),
        ChatMessage("assistant", "", (ToolCall("get_weather", '{"city": "Paris"}', "c1"),
                                      ToolCall("now", "{}"))),
        ChatMessage("tool", "22 C", tool_call_id="c1")])


BAD_MESSAGES: list[tuple[list[dict[str, Any]], str]] = [
    ([{"role": "user", "content": "x", "tool_calls": [{"name": "f", "arguments": "{}"}]}],
     "messages[0].tool_calls: only an assistant message makes calls"),
    ([{"role": "user", "content": "x"}, {"role": "user", "content": "y", "tool_call_id": "c"}],
     "messages[1].tool_call_id: only a tool message answers a call"),
    ([{"role": "assistant", "tool_calls": [{"name": "f", "arguments": "{}"},
                                           {"name": "g", "arguments": "{oops"}]}],
     "messages[0].tool_calls[1].arguments is not JSON text"),
    ([{"role": "assistant", "tool_calls": [{"name": "", "arguments": "{}"}]}],
     "messages[0].tool_calls[0].name is empty"),
    ([{"role": "robot", "content": "x"}], "messages[0].role is 'robot'"),
]


@pytest.mark.parametrize(("messages", "message"), BAD_MESSAGES,
                         ids=[m for _, m in BAD_MESSAGES])
def test_admission_refuses_misplaced_calls(admission: Admission, messages: list[dict[str, Any]],
                                           message: str) -> None:
    with pytest.raises(InvalidRequest) as error:
        admission.prompt_ids(chat_request(messages))
    assert str(error.value).startswith(message), str(error.value)


def test_admission_checks_the_tools_of_any_prompt(admission: Admission) -> None:
    with pytest.raises(InvalidRequest, match=r"^tools need a messages prompt"):
        admission.build_request(request(prompt="hi"))
    with pytest.raises(InvalidRequest, match=r"^tools\[0\].name"):
        admission.build_request(request([{"name": "bad name"}]))
