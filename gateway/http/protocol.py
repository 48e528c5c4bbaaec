"""OpenAI request bodies to GenerateRequests: every field type-checked and named in its error.

The HTTP API checks here only what JSON can get wrong (types, integer ranges that protobuf
cannot hold, the shapes of prompts and messages, fields pagewire does not serve) and leaves
every limit that gRPC clients have too to gateway/admission.py, which builds gRPC's requests
too, so both APIs refuse alike. `null` means "not given" for every optional field, as in
OpenAI's API.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.adapters import ModelNames
from gateway.http.errors import ApiError, invalid
from gateway.http.structured import (
    FORMAT_FIELDS,
    TOOL_FIELDS,
    OutputFormat,
    output_format,
    set_tools,
    tool_calls,
)
from gateway.tokenizer import CHAT_ROLES
from gateway.validation import MAX_STREAM_INTERVAL
from protos import gateway_pb2

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_INT32 = (-(1 << 31), (1 << 31) - 1)
_UINT32_MAX = (1 << 32) - 1
_U64 = (1 << 64) - 1
# Prompts in one /v1/completions request (each is a request of its own to the engine).
MAX_PROMPTS = 256
MAX_USER_CHARS = 256
# OpenAI's default max_tokens for /v1/completions (vLLM's too); chat defaults to what fits.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
MAX_BIAS = 100.0  # logit_bias values are clamped to [-MAX_BIAS, MAX_BIAS]

# Fields pagewire does not serve, with the values that ask for nothing (sent by clients that
# fill every field in, or by tools written for vLLM): any other value would change the output
# without pagewire honouring it, so it is refused, never ignored. OpenAI's first, then
# vLLM's extras.
_UNSERVED: dict[str, Callable[[Any], bool]] = {
    "functions": lambda v: v == [],
    "function_call": lambda v: v == "none",
    "audio": lambda v: False,
    "modalities": lambda v: v == ["text"],
    "prediction": lambda v: False,
    "reasoning_effort": lambda v: False,
    "verbosity": lambda v: False,
    "web_search_options": lambda v: False,
    "store": lambda v: v is False,
    "metadata": lambda v: v == {},
    "service_tier": lambda v: v in ("auto", "default"),
    # Hints about who asks and which prompts repeat: they never change the output.
    "prompt_cache_key": lambda v: isinstance(v, str),
    "safety_identifier": lambda v: isinstance(v, str),
    "suffix": lambda v: v == "",
    "best_of": lambda v: v == 1,
    "min_tokens": lambda v: v == 0,
    "use_beam_search": lambda v: v is False,
    "length_penalty": lambda v: v == 1,
    "include_stop_str_in_output": lambda v: v is False,
    "skip_special_tokens": lambda v: v is True,
    "spaces_between_special_tokens": lambda v: v is True,
    "detokenize": lambda v: v is True,
    "return_tokens_as_token_ids": lambda v: v is False,
    "bad_words": lambda v: v == [],
    "allowed_token_ids": lambda v: False,
    "prompt_logprobs": lambda v: False,
    "truncate_prompt_tokens": lambda v: False,
    "priority": lambda v: v == 0,
}
# The same for fields whose no-op value differs between the two endpoints (pagewire renders a
# chat with the generation prompt and tokenizes it without adding special tokens, and a plain
# prompt with them).
_UNSERVED_CHAT: dict[str, Callable[[Any], bool]] = {
    **_UNSERVED,
    "add_generation_prompt": lambda v: v is True,
    "continue_final_message": lambda v: v is False,
    "add_special_tokens": lambda v: v is False,
    "echo": lambda v: v is False,
    "chat_template": lambda v: False,
    "chat_template_kwargs": lambda v: v == {},
    "documents": lambda v: False,
}
_UNSERVED_COMPLETION: dict[str, Callable[[Any], bool]] = {
    **_UNSERVED,
    "add_special_tokens": lambda v: v is True,
    # Tools are described through the chat template: chat only.
    "tools": lambda v: v == [],
    "tool_choice": lambda v: v == "none",
    "parallel_tool_calls": lambda v: isinstance(v, bool),
}
_SAMPLING_FIELDS = {
    "model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop",
    "seed", "presence_penalty", "frequency_penalty", "logit_bias", "user",
    # pagewire's extras (vLLM names them the same)
    "top_k", "min_p", "repetition_penalty", "ignore_eos", "cache_salt", "stop_token_ids",
    "stream_interval",  # pagewire's own (vLLM has only a server flag)
}
COMPLETION_FIELDS = _SAMPLING_FIELDS | {"prompt", "echo", "logprobs", *FORMAT_FIELDS}
CHAT_FIELDS = _SAMPLING_FIELDS | {"messages", "max_completion_tokens", "logprobs",
                                  "top_logprobs", *FORMAT_FIELDS, *TOOL_FIELDS}
# Every field name an endpoint knows (a refusal's reason label may be one of them).
KNOWN_FIELDS = COMPLETION_FIELDS | CHAT_FIELDS | set(_UNSERVED_CHAT) | set(
    _UNSERVED_COMPLETION)
STREAM_OPTIONS = {"include_usage", "continuous_usage_stats"}
# OpenAI's role names, each to the role the model takes (CHAT_ROLES): its own, and after
# "system" OpenAI's newer name for it, "developer" (which gRPC clients may not send).
_ROLE_ALIASES = {"system": ("developer",)}
OPENAI_ROLES = {name: role for role in CHAT_ROLES for name in (role, *_ROLE_ALIASES.get(role, ()))}
# The fields of a chat message beyond role and content, by role.
_MESSAGE_FIELDS = {"assistant": {"role", "content", "tool_calls"},
                   "tool": {"role", "content", "tool_call_id"}}
# Fields of an answer's message that ask for nothing when null (or empty), which a client
# sends back with the message as the openai SDK's model_dump() writes it.
_ECHOED_ANSWER_FIELDS = {"refusal", "annotations", "audio", "function_call"}


# The names a request's `model` may give: the base model's (or an alias) and the LoRA
# adapters served (admission resolves them, for gRPC's requests too).
ServedModel = ModelNames


@dataclass
class Job:
    """What one HTTP request asks of the engine, and how to answer it."""

    model: str
    requests: list[gateway_pb2.GenerateRequest]  # one per prompt
    n: int
    stream: bool
    include_usage: bool
    chat: bool
    # stream_options.continuous_usage_stats (vLLM's): usage so far in every chunk.
    continuous_usage: bool = False
    # An unset max_tokens: what fits, capped at this (completions: OpenAI's 16).
    default_max_tokens: int | None = None
    # Completions with echo: each prompt (text, or token ids to decode), put before its outputs.
    echo_prompts: list[str | list[int]] = field(default_factory=list)
    # Completions: logprobs=k; chat: top_logprobs when logprobs is true. None: no logprobs.
    logprobs: int | None = None
    # The body field that asked for an output format (admission's errors about the format
    # name it), if any.
    format_field: str | None = None


def parse_json(body: bytes) -> dict[str, Any]:
    """The body as a JSON object; NaN and Infinity (which JSON has not) are refused."""
    try:
        value = json.loads(body, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as error:  # JSONDecodeError, bad UTF-8, huge ints
        raise invalid(f"the body is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise invalid(f"the body must be a JSON object, not {_json_type(value)}")
    if _SURROGATE_ESCAPE.search(body):  # a pair is one character; a lone half is no text
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise invalid("the body has a lone UTF-16 surrogate escape (\\ud800-\\udfff): "
                          "not text") from None
    return value


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


class Fields:
    """Typed reads of a JSON object's fields; each error names the field."""

    def __init__(self, body: dict[str, Any], known: set[str],
                 unserved: dict[str, Callable[[Any], bool]] | None = None) -> None:
        """`known`: the fields served; `unserved`: fields taken only at the value that asks
        for nothing (null always)."""
        unserved = unserved or {}
        for name, value in body.items():
            if name in known:
                continue
            if name in unserved:
                if value is not None and not unserved[name](value):
                    raise invalid(f"{name} is not served by pagewire (it is taken only at "
                                  f"its default, which asks for nothing)", param=name,
                                  reason="unserved_value")
            else:
                raise invalid(f"unknown field {name[:64]!r}; this endpoint takes "
                              f"{', '.join(sorted(known))}", param=name[:64],
                              reason="unknown_field")
        self.body = body

    def get(self, name: str) -> Any:
        return self.body.get(name)

    def integer(self, name: str, low: int, high: int) -> int | None:
        value = self.body.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise invalid(f"{name} must be an integer, got {_json_type(value)}", param=name)
        if not low <= value <= high:
            raise invalid(f"{name} must be in [{low}, {high}], got {value}", param=name)
        return value

    def number(self, name: str) -> float | None:
        value = self.body.get(name)
        if value is None:
            return None
        return _finite(value, name)

    def boolean(self, name: str, default: bool = False) -> bool:
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise invalid(f"{name} must be true or false, got {_json_type(value)}", param=name)
        return value

    def string(self, name: str, default: str = "") -> str:
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, str):
            raise invalid(f"{name} must be a string, got {_json_type(value)}", param=name)
        return value


def _finite(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise invalid(f"{name} must be a number, got {_json_type(value)}", param=name)
    try:
        number = float(value)
    except OverflowError:  # an integer past float's range
        raise invalid(f"{name} is too large", param=name) from None
    if not math.isfinite(number):
        raise invalid(f"{name} must be finite", param=name)
    return number


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


# ----- the two endpoints -------------------------------------------------------------------

def parse_completion(body: dict[str, Any], model: ServedModel) -> Job:
    """A /v1/completions body; `model` is what it must name (when it names one). Without
    max_tokens the job's default_max_tokens (OpenAI's 16) caps what fits."""
    for name in TOOL_FIELDS:
        value = body.get(name)
        if value is not None and not _UNSERVED_COMPLETION[name](value):
            raise invalid(f"{name} is served on /v1/chat/completions only (tools are described "
                          f"to the model through its chat template)", param=name)
    fields = Fields(body, COMPLETION_FIELDS, _UNSERVED_COMPLETION)
    prompts = _completion_prompts(body.get("prompt"))
    logprobs = fields.integer("logprobs", 0, _UINT32_MAX)
    echo = fields.boolean("echo")
    if echo and logprobs is not None:
        raise invalid("echo with logprobs asks for the prompt's logprobs, which pagewire does "
                      "not compute: drop one of them", param="echo")
    params = _sampling_params(fields, "max_tokens")
    if logprobs is not None:
        params.logprobs = logprobs
    fmt = output_format(body)
    requests = []
    for prompt in prompts:
        request = _generate_request(fields, params, fmt)
        if isinstance(prompt, str):
            request.prompt = prompt
        else:
            request.prompt_token_ids.token_ids.extend(prompt)
        requests.append(request)
    job = _job(fields, model, requests, params, chat=False, fmt=fmt)
    job.logprobs = logprobs
    job.default_max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    if echo:
        job.echo_prompts = prompts
    return job


def parse_chat(body: dict[str, Any], model: ServedModel) -> Job:
    """A /v1/chat/completions body."""
    fields = Fields(body, CHAT_FIELDS, _UNSERVED_CHAT)
    request_messages = _chat_messages(body.get("messages"))
    want_logprobs = fields.boolean("logprobs")
    top = fields.integer("top_logprobs", 0, _UINT32_MAX)
    if top is not None and not want_logprobs:
        raise invalid("top_logprobs needs logprobs: true", param="top_logprobs")
    params = _sampling_params(fields, "max_tokens")
    max_completion_tokens = fields.integer("max_completion_tokens", 1, _UINT32_MAX)
    if max_completion_tokens is not None:  # OpenAI's newer name wins
        params.max_tokens = max_completion_tokens
    if want_logprobs:
        params.logprobs = top or 0
    fmt = output_format(body)
    request = _generate_request(fields, params, fmt)
    request.messages.messages.extend(request_messages)
    set_tools(body, request)
    if request.tools and fmt is not None:
        raise invalid(f"tools cannot be combined with {fmt.field}: tool calls have a format "
                      f"of their own", param="tools")
    job = _job(fields, model, [request], params, chat=True, fmt=fmt)
    job.logprobs = (top or 0) if want_logprobs else None
    return job


def _job(fields: Fields, model: ServedModel, requests: list[gateway_pb2.GenerateRequest],
         params: gateway_pb2.SamplingParams, chat: bool, fmt: OutputFormat | None) -> Job:
    asked = check_model(fields, model)
    for request in requests:  # admission resolves it again: the adapter may be gone by then
        request.model = asked
    stream = fields.boolean("stream")
    include_usage = continuous_usage = False
    options = fields.get("stream_options")
    if options is not None:
        if not stream:
            raise invalid("stream_options is only allowed with stream: true",
                          param="stream_options")
        if not isinstance(options, dict) or not set(options) <= STREAM_OPTIONS:
            raise invalid(f"stream_options takes {' and '.join(sorted(STREAM_OPTIONS))}",
                          param="stream_options")
        read = Fields(options, STREAM_OPTIONS)
        include_usage = read.boolean("include_usage")
        # vLLM's: usage in every chunk, which only makes sense with the usage asked for.
        continuous_usage = include_usage and read.boolean("continuous_usage_stats")
    user = fields.string("user")
    if len(user) > MAX_USER_CHARS:
        raise invalid(f"user has {len(user)} characters, over {MAX_USER_CHARS}", param="user")
    # The answer names the model that ran: the adapter's name, or the base model's.
    echoed = model.name if model.is_base(asked) else asked
    return Job(model=echoed, requests=requests,
               n=params.n if params.HasField("n") else 1, stream=stream,
               include_usage=include_usage, chat=chat, continuous_usage=continuous_usage,
               format_field=fmt.field if fmt is not None else None)


def check_model(fields: Fields, model: ServedModel) -> str:
    """The body's `model` (the base model's name when it names none); 404 when it names
    neither the base model nor a served LoRA adapter."""
    asked = fields.string("model", model.name)
    if not asked or not model.names(asked):  # "" is gRPC's "not given"; JSON has null
        raise model_not_found(model, asked)
    return asked


def model_not_found(model: ServedModel, asked: str) -> ApiError:
    served = [model.name, *(adapter.name for adapter in model.catalog.list())]
    return ApiError(404, f"the model {asked[:64]!r} does not exist; this server serves "
                         f"{', '.join(repr(name) for name in served)}", param="model",
                    code="model_not_found")


def _generate_request(fields: Fields, params: gateway_pb2.SamplingParams,
                      fmt: OutputFormat | None) -> gateway_pb2.GenerateRequest:
    request = gateway_pb2.GenerateRequest(cache_salt=fields.string("cache_salt"))
    request.sampling_params.CopyFrom(params)
    if fmt is not None:
        request.structured_output.CopyFrom(fmt.output)
    request.final_only = not fields.boolean("stream")
    interval = fields.integer("stream_interval", 1, MAX_STREAM_INTERVAL)
    if interval is not None:
        request.stream_interval = interval
    return request


def _sampling_params(fields: Fields, max_key: str) -> gateway_pb2.SamplingParams:
    params = gateway_pb2.SamplingParams()
    max_tokens = fields.integer(max_key, 1, _UINT32_MAX)
    if max_tokens is not None:
        params.max_tokens = max_tokens
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        value = fields.number(name)
        if value is not None:
            setattr(params, name, value)
    top_k = fields.integer("top_k", -1, _UINT32_MAX)
    if top_k is not None:
        params.top_k = max(top_k, 0)  # vLLM's -1 and 0 both mean off
    n = fields.integer("n", 1, _UINT32_MAX)
    if n is not None:
        params.n = n
    seed = fields.integer("seed", -(1 << 63), _U64)
    if seed is not None:
        params.seed = seed & _U64
    params.ignore_eos = fields.boolean("ignore_eos")
    params.stop.extend(_stop_strings(fields.get("stop")))
    params.stop_token_ids.extend(_token_list(fields.get("stop_token_ids"), "stop_token_ids"))
    for token_id, bias in _logit_bias(fields.get("logit_bias")).items():
        params.logit_bias[token_id] = bias
    return params


def _stop_strings(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    raise invalid("stop must be a string or an array of strings", param="stop")


def _token_list(value: Any, name: str) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(_is_int32(t) for t in value):
        raise invalid(f"{name} must be an array of token ids (integers)", param=name)
    return value


def _is_int32(value: Any) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool)
            and _INT32[0] <= value <= _INT32[1])


def _logit_bias(value: Any) -> dict[int, float]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid("logit_bias must be an object of token id -> bias", param="logit_bias")
    biases = {}
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10 and _is_int32(int(key))):
            raise invalid(f"logit_bias key {key[:32]!r} is not a token id", param="logit_bias")
        # OpenAI's range, applied here: past float32's range protobuf would store inf.
        biases[int(key)] = min(max(_finite(bias, f"logit_bias[{key}]"), -MAX_BIAS), MAX_BIAS)
    return biases


def _completion_prompts(value: Any) -> list[str | list[int]]:
    """prompt as a string, an array of strings, of token ids, or of arrays of token ids."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise invalid("prompt must be a string, an array of strings, an array of token ids "
                      "or an array of arrays of token ids (and not empty)", param="prompt")
    if all(_is_int32(t) for t in value):
        return [value]
    if len(value) > MAX_PROMPTS:
        raise invalid(f"{len(value)} prompts, over the limit of {MAX_PROMPTS} per request",
                      param="prompt")
    if all(isinstance(p, str) for p in value):
        return list(value)
    if all(isinstance(p, list) and p and all(_is_int32(t) for t in p) for p in value):
        return list(value)
    raise invalid("prompt must be a string, an array of strings, an array of token ids or an "
                  "array of non-empty arrays of token ids (32-bit integers), not a mix",
                  param="prompt")


def _chat_messages(value: Any) -> list[gateway_pb2.ChatMessage]:
    if not isinstance(value, list) or not value:
        raise invalid("messages must be a non-empty array", param="messages")
    messages = []
    for i, message in enumerate(value):
        name = f"messages[{i}]"
        if not isinstance(message, dict):
            raise invalid(f"{name} must be an object", param=name)
        role = message.get("role")
        if not isinstance(role, str) or role not in OPENAI_ROLES:
            raise invalid(f"{name}.role must be one of {', '.join(OPENAI_ROLES)}, got "
                          f"{str(role)[:32]!r}", param=f"{name}.role")
        served = _MESSAGE_FIELDS.get(role, {"role", "content"})
        extra = set(message) - served
        if role == "assistant":
            extra -= {key for key in extra & _ECHOED_ANSWER_FIELDS if message[key] in (None, [])}
        if extra:
            raise invalid(f"{name} has fields pagewire does not serve: "
                          f"{', '.join(sorted(extra))} (a {role} message takes "
                          f"{', '.join(sorted(served))})", param=name)
        entry = gateway_pb2.ChatMessage(role=OPENAI_ROLES[role])
        entry.tool_calls.extend(tool_calls(message.get("tool_calls"), f"{name}.tool_calls"))
        # OpenAI's content may be left out of an assistant message that makes calls.
        if not (entry.tool_calls and message.get("content") is None):
            entry.content = _content(message.get("content"), name)
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str):
                raise invalid(f"{name}.tool_call_id must be the id of the call it answers (a "
                              f"string)", param=f"{name}.tool_call_id")
            entry.tool_call_id = call_id
        messages.append(entry)
    return messages


def _content(value: Any, name: str) -> str:
    """content as a string or an array of text parts (joined with newlines, as vLLM does)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for j, part in enumerate(value):
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str) and set(part) == {"type", "text"}):
                raise invalid(f"{name}.content[{j}] must be a text part "
                              f'{{"type": "text", "text": ...}}: pagewire serves text only',
                              param=f"{name}.content")
            texts.append(part["text"])
        return "\n".join(texts)
    raise invalid(f"{name}.content must be a string or an array of text parts",
                  param=f"{name}.content")
