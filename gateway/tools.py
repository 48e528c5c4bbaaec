"""A request's tools: checked, described to the model, and made a grammar that forces calls.

Calls are written in the Hermes format (gateway/tool_calls.py parses them back out):
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, the JSON as Python's
json.dumps writes it (", " and ": "), as Hermes-trained models write it. With tool_choice
required or a named function the output is constrained to calls of that shape whose
arguments validate against the tool's parameters; with auto the model writes what it likes and
the calls are parsed out; with none they are not (the tools are still described).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from gateway.tool_calls import CLOSE, OPEN
from gateway.validation import InvalidRequest
from protos import gateway_pb2

MAX_TOOLS = 128
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
# The keys of a JSON schema whose values are data, not schemas: a "$ref" in them is no
# reference.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
# Hermes-trained models write the call's JSON as json.dumps does; the grammar holds them to it
# (any other whitespace could run on until max_tokens).
_CALL_JSON_STYLE = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}

ToolMode = Literal["auto", "none", "required", "function"]
_MODES: dict[int, ToolMode] = {
    gateway_pb2.TOOL_CHOICE_MODE_UNSPECIFIED: "auto",
    gateway_pb2.TOOL_CHOICE_MODE_AUTO: "auto",
    gateway_pb2.TOOL_CHOICE_MODE_NONE: "none",
    gateway_pb2.TOOL_CHOICE_MODE_REQUIRED: "required",
}


@dataclass(frozen=True)
class FunctionTool:
    """A checked tool: its parameters are a JSON schema (an object)."""

    name: str
    description: str
    parameters: dict[str, Any]
    strict: bool = False

    def openai(self) -> dict[str, Any]:
        """OpenAI's shape, which chat templates with tool support take."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolUse:
    """How a request uses its tools (tool_choice and parallel_tool_calls applied)."""

    tools: tuple[FunctionTool, ...]
    mode: ToolMode  # "function": call function_name
    function_name: str = ""
    parallel: bool = True

    @property
    def parses_calls(self) -> bool:
        """Whether calls are taken out of the output (all modes but none)."""
        return self.mode != "none"

    def grammar(self) -> str | None:
        """The Lark grammar that forces the calls (required or a named function), else None."""
        if self.mode == "required":
            return tool_grammar(self.tools, None, self.parallel)
        if self.mode == "function":
            return tool_grammar(self.tools, self.function_name, False)
        return None


def check_tool_use(request: gateway_pb2.GenerateRequest) -> ToolUse | None:
    """The request's tools and tool_choice, checked (InvalidRequest naming the field); None
    when it has no tools."""
    tools = function_tools(request.tools)
    mode, function_name = _tool_choice(request.tool_choice, tools)
    if not tools:
        return None
    if request.WhichOneof("input") != "messages":
        raise InvalidRequest("tools need a messages prompt (they are described through the "
                             "chat), not prompt or prompt_token_ids")
    if request.structured_output.WhichOneof("format") is not None:
        raise InvalidRequest("tools cannot be combined with structured_output: tool calls "
                             "have a format of their own")
    parallel = (request.parallel_tool_calls if request.HasField("parallel_tool_calls")
                else True)
    return ToolUse(tuple(tools), mode, function_name, parallel)


def function_tools(tools: Sequence[gateway_pb2.Tool]) -> list[FunctionTool]:
    """The request's tools, each checked: a valid and distinct name, parameters that are a
    JSON object (empty: any object)."""
    if len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"tools has {len(tools)} tools, over the limit of {MAX_TOOLS}")
    checked: list[FunctionTool] = []
    index_of: dict[str, int] = {}
    for i, tool in enumerate(tools):
        field = f"tools[{i}]"
        if not _NAME.fullmatch(tool.name):
            raise InvalidRequest(f"{field}.name {tool.name[:80]!r} must be 1 to 64 of a-z, "
                                 f"A-Z, 0-9, '_' and '-'")
        if tool.name in index_of:
            raise InvalidRequest(f"{field}.name {tool.name!r} is also the name of "
                                 f"tools[{index_of[tool.name]}]: names must be distinct")
        index_of[tool.name] = i
        checked.append(FunctionTool(tool.name, tool.description,
                                    _parameters(tool.parameters, f"{field}.parameters"),
                                    tool.strict))
    return checked


def _parameters(text: str, field: str) -> dict[str, Any]:
    if not text.strip():
        return {"type": "object"}
    try:
        schema = json.loads(text)
    except ValueError as error:
        raise InvalidRequest(f"{field} is not JSON: {error}") from None
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{field} must be a JSON schema object, got "
                             f"{type(schema).__name__}")
    return schema


def _tool_choice(choice: gateway_pb2.ToolChoice, tools: Sequence[FunctionTool]
                 ) -> tuple[ToolMode, str]:
    which = choice.WhichOneof("choice")
    if which == "function_name":
        names = [tool.name for tool in tools]
        if choice.function_name not in names:
            listed = ", ".join(names[:16]) + (", ..." if len(names) > 16 else "")
            raise InvalidRequest(f"tool_choice.function_name {choice.function_name[:80]!r} "
                                 f"is not one of the tools ({listed or 'none given'})")
        return "function", choice.function_name
    mode = _MODES.get(choice.mode) if which == "mode" else "auto"
    if mode is None:
        raise InvalidRequest(f"tool_choice.mode {choice.mode} is not a ToolChoiceMode")
    if mode == "required" and not tools:
        raise InvalidRequest("tool_choice required needs tools")
    return mode, ""


# ----- the grammar -------------------------------------------------------------------------

def tool_grammar(tools: Sequence[FunctionTool], function_name: str | None,
                 parallel: bool) -> str:
    """A Lark grammar (llguidance's dialect) for calls in the Hermes format: one call of
    `function_name`, else of any of `tools` — one, or one or more when `parallel`. Each call
    is `{"name": <the tool's name>, "arguments": <valid for its parameters>}`, name first."""
    chosen = [t for t in tools if function_name is None or t.name == function_name]
    if not chosen:
        raise ValueError(f"no tool named {function_name!r}")
    schema = {"x-guidance": _CALL_JSON_STYLE,
              "anyOf": [_call_schema(tool, f"#/anyOf/{i}/properties/arguments")
                        for i, tool in enumerate(chosen)]}
    calls = 'call ("\\n" call)*' if parallel and function_name is None else "call"
    return "\n".join([
        f"start: {calls}",
        f"call: {json.dumps(OPEN + chr(10))} body {json.dumps(chr(10) + CLOSE)}",
        f"body: %json {json.dumps(schema)}",
        "",
    ])


def _call_schema(tool: FunctionTool, arguments_at: str) -> dict[str, Any]:
    """One tool's call; its parameters' local references are moved to where they now are."""
    return {"type": "object",
            "properties": {"name": {"const": tool.name},
                           "arguments": _moved_refs(tool.parameters, arguments_at)},
            "required": ["name", "arguments"], "additionalProperties": False}


def _moved_refs(schema: Any, root: str) -> Any:
    """`schema` with every local `$ref` ("#..." , relative to its own root) made relative to
    `root`, the JSON pointer where it is embedded."""
    if isinstance(schema, list):
        return [_moved_refs(item, root) for item in schema]
    if not isinstance(schema, dict):
        return schema
    moved: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            moved[key] = root + value[1:]
        elif key in _DATA_KEYWORDS:
            moved[key] = value
        else:
            moved[key] = _moved_refs(value, root)
    return moved


# ----- the description, for chat templates without tool support ----------------------------

def tools_system_text(tools: Sequence[FunctionTool]) -> str:
    """The tools described in a system message, Hermes style, with the call format."""
    listed = "\n".join(json.dumps(tool.openai(), ensure_ascii=False) for tool in tools)
    return (
        "# Tools\n\n"
        "You can call functions to help answer the user. Their signatures are listed "
        "between the <tools></tools> tags:\n"
        f"<tools>\n{listed}\n</tools>\n\n"
        "To call a function, answer with a JSON object giving its name and its arguments "
        "between <tool_call></tool_call> tags, one block per call:\n"
        f'{OPEN}\n{{"name": <function-name>, "arguments": <arguments-json-object>}}\n{CLOSE}'
    )


def call_text(name: str, arguments: str) -> str:
    """A call as the model writes it; `arguments` is JSON text (taken as a string if not)."""
    try:
        value: Any = json.loads(arguments)
    except ValueError:
        value = arguments
    body = json.dumps({"name": name, "arguments": value}, ensure_ascii=False)
    return f"{OPEN}\n{body}\n{CLOSE}"


def response_text(content: str) -> str:
    """A tool's result as a Hermes model reads it (in a user message)."""
    return f"<tool_response>\n{content}\n</tool_response>"
