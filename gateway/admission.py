"""Admission: a public request checked, tokenized and made an engine Request.

Both public APIs build their requests here (gRPC's GenerateRequest as it came, the HTTP API's
as gateway/http/protocol.py made it from an OpenAI body), so they check, tokenize and refuse
alike. An InvalidRequest message names the field at fault first: each API labels its refusals
by it. The engine's own refusal (a full queue: engine.AdmissionError) comes later, at submit.
A request's `model` is resolved here too (gateway/adapters.py ModelNames): the base model or a
LoRA adapter, whose digest goes into the request's cache salt; an unknown name is
UnknownModel (gRPC NOT_FOUND, HTTP 404).
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Sequence

from gateway.adapters import ModelNames, effective_salt
from gateway.config import GatewayConfig
from gateway.delivery import MessageSink
from gateway.engine import BackendInfo, Engine
from gateway.grammar import (
    CompiledFormat,
    FormatCompiler,
    FormatError,
    FormatSpec,
    LLGuidanceBackend,
    format_spec,
)
from gateway.request import Request
from gateway.sampling_defaults import GenerationConfigError, SamplingDefaults
from gateway.tokenizer import CHAT_ROLES, ChatMessage, Tokenizer, ToolCall
from gateway.tools import FunctionTool, ToolUse, check_tool_use
from gateway.validation import (
    InvalidRequest,
    Limits,
    check_identifiers,
    check_prompt_ids,
    check_prompt_length,
    sampling_config,
    stream_interval,
)
from protos import gateway_pb2


class Admission:
    """What building a request needs: the served model's tokenizer, limits, sampling defaults
    and name."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, info: BackendInfo,
                 defaults: SamplingDefaults | None = None, served_model_name: str = "") -> None:
        """`info`: the model as the runners described it at start; `defaults`: of the sampling
        fields a request leaves unset (GenerationConfigError when they are out of range);
        `served_model_name`: the name clients use (default: the runner's name of the model)."""
        self._engine = engine
        self._info = info
        self.tokenizer = tokenizer
        self.limits = _limits(engine.config, info)
        self.defaults = defaults or SamplingDefaults.none()
        self.served_model_name = served_model_name or info.model
        # The model folder's name stays an alias of the model's own (the default model was
        # served by its folder's name before it had a name of its own); a --served-model-name
        # is the only name, as in vLLM.
        name = self.served_model_name
        aliases = {tokenizer.folder.name} - {name} if name == info.model else set()
        self.models = ModelNames(name, frozenset(aliases), engine.adapters)
        self._formats: FormatCompiler | None = None
        self._formats_lock = threading.Lock()
        try:  # the defaults alone must make a valid request
            sampling_config(self.defaults.apply(gateway_pb2.SamplingParams()), 0, self.limits, 0)
        except InvalidRequest as error:
            raise GenerationConfigError(
                f"the default sampling parameters ({self.defaults.source}): {error}") from None

    def model_info(self) -> BackendInfo:
        """The served model as the runners describe it now."""
        return self._engine.info or self._info

    def build_request(self, request: gateway_pb2.GenerateRequest,
                      stream: MessageSink | None = None,
                      default_max_tokens: int | None = None) -> Request:
        """A validated engine request (InvalidRequest when it cannot be served), its messages
        going to `stream` (default: a queue read by `Request.messages`); an unset max_tokens
        is what fits, capped at the generation config's max_new_tokens, else at
        `default_max_tokens`. Unset sampling fields take the server's defaults;
        UnknownModel when `model` names neither the base model nor an adapter. Tokenizing a
        long prompt takes a while: call it off the event loop."""
        check_identifiers(request.request_id, request.cache_salt)
        adapter = self.models.resolve(request.model)
        tool_use = check_tool_use(request)
        if request.WhichOneof("input") == "prompt_token_ids":
            check_prompt_length(len(request.prompt_token_ids.token_ids), self.limits)
            prompt_ids = list(request.prompt_token_ids.token_ids)
        else:
            prompt_ids = self.prompt_ids(request, tool_use.tools if tool_use else ())
        check_prompt_ids(prompt_ids, self.limits)
        output_format = self._output_format(request, tool_use)
        params = sampling_config(self.defaults.apply(request.sampling_params), len(prompt_ids),
                                 self.limits, self._engine.new_seed(),
                                 self.defaults.max_tokens or default_max_tokens)
        key = uuid.uuid4().hex
        return Request(
            request_id=key,
            public_id=request.request_id or key,
            prompt_ids=prompt_ids,
            params=params,
            max_len=self.limits.max_len,
            eos_ids=frozenset(self._info.eos_token_ids),
            decode=self.tokenizer.decode,
            decode_batch=self.tokenizer.decode_batch,
            cache_salt=effective_salt(request.cache_salt, adapter),
            adapter=adapter.name if adapter is not None else "",
            final_only=request.final_only,
            stream=stream,
            stream_interval=stream_interval(
                request.stream_interval if request.HasField("stream_interval") else None,
                self._engine.config.stream_interval),
            output_format=output_format,
            parses_tool_calls=tool_use is not None and tool_use.parses_calls,
        )

    def _output_format(self, request: gateway_pb2.GenerateRequest, tool_use: ToolUse | None
                       ) -> CompiledFormat | None:
        """The compiled format the outputs must follow: structured_output's, or the tool-call
        grammar of tool_choice required or a named function (InvalidRequest naming the
        field when it cannot be served)."""
        try:
            spec = format_spec(request.structured_output)
            grammar = tool_use.grammar() if tool_use is not None else None
            if grammar is not None:
                spec = FormatSpec("tools", grammar, field="tools")
            return self.formats.compile(spec) if spec is not None else None
        except FormatError as error:
            raise InvalidRequest(str(error)) from None

    @property
    def formats(self) -> FormatCompiler:
        """The structured-output compiler, made at the first request that needs it (its
        tokenizer takes a few tenths of a second to build)."""
        with self._formats_lock:
            if self._formats is None:
                backend = LLGuidanceBackend(self.tokenizer.backend_json(),
                                            list(self._info.eos_token_ids),
                                            self._info.vocab_size)
                self._formats = FormatCompiler(backend)
            return self._formats

    def prompt_ids(self, request: gateway_pb2.GenerateRequest | gateway_pb2.TokenizeRequest,
                   tools: Sequence[FunctionTool] = ()) -> list[int]:
        """Token ids of a text or chat prompt (a chat with `tools` described)."""
        which = request.WhichOneof("input")
        if which == "prompt":
            if not request.prompt:
                raise InvalidRequest("the prompt is empty")
            token_ids = self.tokenizer.encode(request.prompt)
            if not token_ids:  # characters the vocabulary has no token for are dropped
                raise InvalidRequest("the prompt has no tokens after tokenization: the model's "
                                     "vocabulary has none for its characters")
            return token_ids
        if which == "messages":
            messages = _chat_messages(request.messages)
            try:
                return self.tokenizer.encode_chat(messages, tools)
            except ValueError as error:
                raise InvalidRequest(str(error)) from error
        raise InvalidRequest("no prompt: set one of prompt, messages or prompt_token_ids")


def _limits(config: GatewayConfig, info: BackendInfo) -> Limits:
    """A request's limits: the model's (vocabulary, context) and the gateway's flags."""
    return Limits(
        vocab_size=info.vocab_size,
        max_len=info.max_len,
        max_n=min(config.max_n, config.max_num_seqs, config.max_num_batched_tokens),
        max_prompt_tokens=config.max_prompt_tokens,
        max_tokens=config.max_tokens_limit,
        max_stop_strings=config.max_stop_strings,
        max_stop_string_chars=config.max_stop_string_chars,
    )


def _chat_messages(messages: gateway_pb2.ChatMessages) -> list[ChatMessage]:
    if not messages.messages:
        raise InvalidRequest("messages is empty")
    result = []
    for i, message in enumerate(messages.messages):
        if message.role not in CHAT_ROLES:
            raise InvalidRequest(
                f"messages[{i}].role is {message.role!r}; expected one of {', '.join(CHAT_ROLES)}"
            )
        field = f"messages[{i}]"
        if message.tool_calls and message.role != "assistant":
            raise InvalidRequest(f"{field}.tool_calls: only an assistant message makes calls, "
                                 f"not a {message.role} message")
        if message.tool_call_id and message.role != "tool":
            raise InvalidRequest(f"{field}.tool_call_id: only a tool message answers a call, "
                                 f"not a {message.role} message")
        calls = tuple(_tool_call(call, f"{field}.tool_calls[{j}]")
                      for j, call in enumerate(message.tool_calls))
        result.append(ChatMessage(message.role, message.content, calls, message.tool_call_id))
    return result


def _tool_call(call: gateway_pb2.ToolCall, field: str) -> ToolCall:
    """An earlier call, as the chat template writes it: arguments must be JSON text (empty is
    `{}`, a call without arguments)."""
    if not call.name:
        raise InvalidRequest(f"{field}.name is empty")
    arguments = call.arguments if call.arguments.strip() else "{}"
    try:
        json.loads(arguments)
    except ValueError as error:
        raise InvalidRequest(f"{field}.arguments is not JSON text: {error}") from None
    return ToolCall(call.name, arguments, call.id)
