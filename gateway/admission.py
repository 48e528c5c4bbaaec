"""Admission: a public request checked, tokenized and made an engine Request.

Both public APIs build their requests here (gRPC's GenerateRequest as it came, the HTTP API's
as gateway/http/protocol.py made it from an OpenAI body), so they check, tokenize and refuse
alike. An InvalidRequest message names the field at fault first: each API labels its refusals
by it. The engine's own refusal (a full queue: engine.AdmissionError) comes later, at submit.
"""

from __future__ import annotations

import uuid

from gateway.config import GatewayConfig
from gateway.delivery import MessageSink
from gateway.engine import BackendInfo, Engine
from gateway.request import Request
from gateway.sampling_defaults import GenerationConfigError, SamplingDefaults
from gateway.tokenizer import CHAT_ROLES, ChatMessage, Tokenizer
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
        `default_max_tokens`. Unset sampling fields take the server's defaults. Tokenizing a
        long prompt takes a while: call it off the event loop."""
        check_identifiers(request.request_id, request.cache_salt)
        if request.WhichOneof("input") == "prompt_token_ids":
            check_prompt_length(len(request.prompt_token_ids.token_ids), self.limits)
            prompt_ids = list(request.prompt_token_ids.token_ids)
        else:
            prompt_ids = self.prompt_ids(request)
        check_prompt_ids(prompt_ids, self.limits)
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
            cache_salt=request.cache_salt,
            final_only=request.final_only,
            stream=stream,
            stream_interval=stream_interval(
                request.stream_interval if request.HasField("stream_interval") else None,
                self._engine.config.stream_interval),
        )

    def prompt_ids(self, request: gateway_pb2.GenerateRequest | gateway_pb2.TokenizeRequest
                   ) -> list[int]:
        """Token ids of a text or chat prompt."""
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
                return self.tokenizer.encode_chat(messages)
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
        result.append(ChatMessage(message.role, message.content))
    return result
