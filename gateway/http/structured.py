"""Structured output and tool fields of an OpenAI body, to the GenerateRequest's.

The output formats: OpenAI's `response_format`, vLLM's `structured_outputs` and its older
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`; at most one per request.
The tools: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`, and the calls and
results of earlier turns in chat messages. Only shapes are checked here; what the formats and
tools mean (a schema that compiles, tool names, tool_choice against the tools) is checked by
admission (gateway/tools.py, gateway/grammar.py), for gRPC's requests too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gateway.http.errors import invalid
from protos import gateway_pb2

# The body fields that ask for an output format, and the field of vLLM's that pagewire cannot
# honour (a whitespace regex: its JSON is in one line, or has any whitespace with
# whitespace_flexible).
FORMAT_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
                 "guided_choice", "guided_grammar", "guided_whitespace_pattern")
TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")
_FORMATS = ("json", "regex", "choice", "grammar", "json_object")
# The options of structured_outputs: pagewire's whitespace_flexible (gRPC's name) and vLLM's
# (disable_any_whitespace: no free whitespace, pagewire's default; disable_fallback: pagewire
# has one backend and never falls back; the others are honoured only at their defaults).
_STRUCTURED_OPTIONS = ("whitespace_flexible", "disable_any_whitespace", "disable_fallback",
                       "disable_additional_properties", "whitespace_pattern", "structural_tag")
_TOOL_CHOICES = {
    "auto": gateway_pb2.TOOL_CHOICE_MODE_AUTO,
    "none": gateway_pb2.TOOL_CHOICE_MODE_NONE,
    "required": gateway_pb2.TOOL_CHOICE_MODE_REQUIRED,
}


@dataclass(frozen=True)
class OutputFormat:
    """The format a body asks for, and the field that asked (errors name it)."""

    field: str
    output: gateway_pb2.StructuredOutput


def output_format(body: dict[str, Any]) -> OutputFormat | None:
    """The one output format of the body's format fields; None: free text."""
    found: list[OutputFormat] = []
    for name, parse in (("response_format", _response_format),
                        ("structured_outputs", _structured_outputs)):
        value = body.get(name)
        output = parse(value) if value is not None else None
        if output is not None:
            found.append(OutputFormat(name, output))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"),
                      ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        if body.get(name) is not None:
            output = gateway_pb2.StructuredOutput()
            _set_format(output, key, body[name], name)
            found.append(OutputFormat(name, output))
    if body.get("guided_whitespace_pattern") is not None:
        raise _unhonoured_whitespace("guided_whitespace_pattern")
    if len(found) > 1:
        raise invalid(f"{found[0].field} and {found[1].field} both ask for an output format: "
                      f"give one", param=found[1].field)
    return found[0] if found else None


def _response_format(value: Any) -> gateway_pb2.StructuredOutput | None:
    """OpenAI's response_format: text (free), json_object, or json_schema."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text" and set(value) == {"type"}:
        return None
    if kind == "json_object" and set(value) == {"type"}:
        return gateway_pb2.StructuredOutput(json_object=True)
    if kind != "json_schema" or set(value) - {"type", "json_schema"}:
        raise invalid('response_format must be {"type": "text"}, {"type": "json_object"} or '
                      '{"type": "json_schema", "json_schema": {...}}', param="response_format")
    spec = value.get("json_schema")
    field = "response_format.json_schema"
    if not isinstance(spec, dict) or set(spec) - {"name", "schema", "strict", "description"}:
        raise invalid(f"{field} must be an object of name, schema, strict and description",
                      param=field)
    for key, kinds in (("name", str), ("description", str), ("strict", bool)):
        if spec.get(key) is not None and not isinstance(spec[key], kinds):
            raise invalid(f"{field}.{key} must be a {'boolean' if kinds is bool else 'string'}",
                          param=f"{field}.{key}")
    schema = spec.get("schema")
    if schema is None:  # OpenAI's schema is optional: no constraint on the JSON value
        schema = {}
    if not isinstance(schema, dict):
        raise invalid(f"{field}.schema must be a JSON schema (an object)",
                      param=f"{field}.schema")
    return gateway_pb2.StructuredOutput(json_schema=json.dumps(schema, ensure_ascii=False))


def _structured_outputs(value: Any) -> gateway_pb2.StructuredOutput | None:
    """vLLM's structured_outputs: one of json, regex, choice, grammar and json_object, and
    the whitespace options."""
    if not isinstance(value, dict):
        raise invalid("structured_outputs must be an object", param="structured_outputs")
    unknown = set(value) - set(_FORMATS) - set(_STRUCTURED_OPTIONS)
    if unknown:
        raise invalid(f"structured_outputs takes {', '.join((*_FORMATS, *_STRUCTURED_OPTIONS))}"
                      f"; not {', '.join(sorted(k[:32] for k in unknown))}",
                      param="structured_outputs")
    # json_object: false asks for nothing, like a format left out.
    given = [key for key in _FORMATS
             if value.get(key) is not None and not (key == "json_object" and value[key] is False)]
    if len(given) > 1:
        raise invalid(f"structured_outputs.{given[0]} and structured_outputs.{given[1]} both "
                      f"ask for an output format: give one", param="structured_outputs")
    output = gateway_pb2.StructuredOutput()
    flexible = _option(value, "whitespace_flexible")
    compact = _option(value, "disable_any_whitespace")
    _option(value, "disable_fallback")
    if flexible and compact:
        raise invalid("structured_outputs.whitespace_flexible and disable_any_whitespace "
                      "contradict each other", param="structured_outputs")
    if value.get("disable_additional_properties") not in (None, False):
        raise invalid("structured_outputs.disable_additional_properties is not served: give "
                      "the schema additionalProperties: false", param="structured_outputs")
    if value.get("whitespace_pattern") is not None:
        raise _unhonoured_whitespace("structured_outputs.whitespace_pattern")
    if value.get("structural_tag") is not None:
        raise invalid("structured_outputs.structural_tag is not served",
                      param="structured_outputs")
    if not given:
        return None
    _set_format(output, given[0], value[given[0]], f"structured_outputs.{given[0]}")
    output.whitespace_flexible = flexible
    return output


def _option(value: dict[str, Any], key: str) -> bool:
    option = value.get(key)
    if option is not None and not isinstance(option, bool):
        raise invalid(f"structured_outputs.{key} must be true or false",
                      param="structured_outputs")
    return bool(option)


def _set_format(output: gateway_pb2.StructuredOutput, key: str, value: Any, field: str
                ) -> None:
    """Sets the format `key` (vLLM's name) from a body's `value`."""
    if key == "json":
        output.json_schema = _schema_text(value, field)
    elif key == "json_object":
        if value is not True:
            raise invalid(f"{field} must be true or false", param=field)
        output.json_object = True
    elif key == "choice":
        if not (isinstance(value, list) and value and all(isinstance(v, str) for v in value)):
            raise invalid(f"{field} must be a non-empty array of strings", param=field)
        output.choice.values.extend(value)
    else:  # regex, grammar
        if not isinstance(value, str) or not value:
            raise invalid(f"{field} must be a non-empty string", param=field)
        setattr(output, "regex" if key == "regex" else "grammar", value)


def _schema_text(value: Any, field: str) -> str:
    """A JSON schema given as an object or as JSON text, as JSON text."""
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError as error:
            raise invalid(f"{field} is a string that is not JSON: {error}", param=field
                          ) from None
        if isinstance(parsed, dict):
            return value
    elif isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    raise invalid(f"{field} must be a JSON schema: an object, or its JSON text", param=field)


def _unhonoured_whitespace(field: str) -> Exception:
    return invalid(f"{field} is not served: JSON output is in one line, or has any "
                   f"whitespace with structured_outputs.whitespace_flexible: true", param=field)


# ----- tools -------------------------------------------------------------------------------

def set_tools(body: dict[str, Any], request: gateway_pb2.GenerateRequest) -> None:
    """tools, tool_choice and parallel_tool_calls onto `request`."""
    request.tools.extend(_tools(body.get("tools")))
    choice = body.get("tool_choice")
    if isinstance(choice, str) and choice in _TOOL_CHOICES:
        request.tool_choice.mode = _TOOL_CHOICES[choice]
    elif choice is not None:
        request.tool_choice.function_name = _named_function(choice)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None:
        if not isinstance(parallel, bool):
            raise invalid("parallel_tool_calls must be true or false",
                          param="parallel_tool_calls")
        request.parallel_tool_calls = parallel


def _tools(value: Any) -> list[gateway_pb2.Tool]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise invalid('tools must be an array of {"type": "function", "function": {...}}',
                      param="tools")
    tools = []
    for i, tool in enumerate(value):
        field = f"tools[{i}]"
        if not (isinstance(tool, dict) and tool.get("type") == "function"
                and set(tool) == {"type", "function"}):
            raise invalid(f'{field} must be {{"type": "function", "function": {{...}}}} '
                          f"(pagewire serves function tools)", param=field)
        function = tool["function"]
        field += ".function"
        keys = {"name", "description", "parameters", "strict"}
        if not isinstance(function, dict) or set(function) - keys:
            raise invalid(f"{field} must be an object of {', '.join(sorted(keys))}",
                          param=field)
        name, description = function.get("name"), function.get("description")
        parameters, strict = function.get("parameters"), function.get("strict")
        if not isinstance(name, str):
            raise invalid(f"{field}.name must be a string", param=f"{field}.name")
        if description is not None and not isinstance(description, str):
            raise invalid(f"{field}.description must be a string",
                          param=f"{field}.description")
        if parameters is not None and not isinstance(parameters, dict):
            raise invalid(f"{field}.parameters must be a JSON schema (an object)",
                          param=f"{field}.parameters")
        if strict is not None and not isinstance(strict, bool):
            raise invalid(f"{field}.strict must be true or false", param=f"{field}.strict")
        tools.append(gateway_pb2.Tool(
            name=name, description=description or "",
            parameters=json.dumps(parameters, ensure_ascii=False) if parameters else "",
            strict=bool(strict)))
    return tools


def _named_function(choice: Any) -> str:
    function = choice.get("function") if isinstance(choice, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function"
            and set(choice) == {"type", "function"} and isinstance(function, dict)
            and set(function) == {"name"} and isinstance(function["name"], str)):
        raise invalid('tool_choice must be "none", "auto", "required" or '
                      '{"type": "function", "function": {"name": ...}}', param="tool_choice")
    return str(function["name"])


def tool_calls(value: Any, field: str) -> list[gateway_pb2.ToolCall]:
    """An assistant message's tool_calls (OpenAI's shape); arguments as JSON text (an object
    is taken too)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise invalid(f"{field} must be an array of tool calls", param=field)
    calls = []
    for j, call in enumerate(value):
        name = f"{field}[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(call, dict) and set(call) <= {"id", "type", "function"}
                and call.get("type", "function") == "function" and isinstance(function, dict)
                and set(function) <= {"name", "arguments"}):
            raise invalid(f'{name} must be {{"id": ..., "type": "function", "function": '
                          f'{{"name": ..., "arguments": ...}}}}', param=name)
        call_id, arguments = call.get("id"), function.get("arguments")
        if not isinstance(function.get("name"), str):
            raise invalid(f"{name}.function.name must be a string", param=name)
        if call_id is not None and not isinstance(call_id, str):
            raise invalid(f"{name}.id must be a string", param=name)
        if isinstance(arguments, dict):
            arguments = json.dumps(arguments, ensure_ascii=False)
        elif arguments is not None and not isinstance(arguments, str):
            raise invalid(f"{name}.function.arguments must be JSON text (a string)",
                          param=name)
        calls.append(gateway_pb2.ToolCall(id=call_id or "", name=function["name"],
                                          arguments=arguments or ""))
    return calls
