"""GenerationService: protobuf in, validated requests to the engine, streamed deltas out."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from typing import NoReturn

import grpc

from gateway import refusals
from gateway.delivery import AsyncSink, Item, MessageSink, StreamError
from gateway.engine import AdmissionError, BackendInfo, Engine
from gateway.request import Request
from gateway.sampling_defaults import GenerationConfigError, SamplingDefaults
from gateway.tokenizer import CHAT_ROLES, ChatMessage, Tokenizer
from gateway.validation import (
    InvalidRequest,
    LimitReached,
    Limits,
    StreamLimiter,
    check_identifiers,
    check_prompt_ids,
    check_prompt_length,
    peer_key,
    sampling_config,
    stream_interval,
)
from protos import gateway_pb2, gateway_pb2_grpc

log = logging.getLogger(__name__)


class GenerationServicer(gateway_pb2_grpc.GenerationServiceServicer):
    """The public API; every check happens before a request reaches the engine."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, info: BackendInfo,
                 tokens_checked: bool = False, defaults: SamplingDefaults | None = None,
                 served_model_name: str = "") -> None:
        """`tokens_checked`: the server verifies bearer tokens, so a token names a client;
        `defaults`: of the sampling fields a request leaves unset (GenerationConfigError when
        they are out of range); `served_model_name`: the name clients use (default: the
        runner's name of the model)."""
        self.engine = engine
        self._tokens_checked = tokens_checked
        self.tokenizer = tokenizer
        self._info = info
        config = engine.config
        self.limits = Limits(
            vocab_size=info.vocab_size,
            max_len=info.max_len,
            max_n=min(config.max_n, config.max_num_seqs, config.max_num_batched_tokens),
            max_prompt_tokens=config.max_prompt_tokens,
            max_tokens=config.max_tokens_limit,
            max_stop_strings=config.max_stop_strings,
            max_stop_string_chars=config.max_stop_string_chars,
        )
        self.streams = StreamLimiter(config.max_streams, config.max_streams_per_client)
        self.defaults = defaults or SamplingDefaults.none()
        self.served_model_name = served_model_name or info.model
        try:  # the defaults alone must make a valid request
            sampling_config(self.defaults.apply(gateway_pb2.SamplingParams()), 0, self.limits, 0)
        except InvalidRequest as error:
            raise GenerationConfigError(
                f"the default sampling parameters ({self.defaults.source}): {error}") from None

    async def Generate(self, request: gateway_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        """Streams a request's messages, on the gateway's event loop: a stream holds no
        thread, and each step's messages arrive in one batch (gateway/delivery.py)."""
        messages: asyncio.Queue[tuple[None, Item]] = asyncio.Queue()
        sink = AsyncSink(asyncio.get_running_loop(), messages, None)
        try:
            # Tokenizing a long prompt must not stall the other streams.
            engine_request = await asyncio.to_thread(self.build_request, request, sink)
        except InvalidRequest as error:
            await _refuse(context, grpc.StatusCode.INVALID_ARGUMENT, error)
        client = peer_key(context.invocation_metadata(), context.peer(), self._tokens_checked)
        try:
            release = self.streams.acquire(client)
        except LimitReached as error:
            await _refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, error, "limit_reached")
        ended = False  # the stream ran to its end, or the request was never placed
        try:
            try:
                # Placing may ask the block service where to route (a blocking call).
                await asyncio.to_thread(self.engine.submit, engine_request)
            except AdmissionError as error:
                ended = True
                await _refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, error, "queue_full")
            while True:
                _, item = await messages.get()
                sink.taken()
                if item is None:
                    ended = True
                    return
                if isinstance(item, StreamError):
                    ended = True
                    await context.abort(getattr(grpc.StatusCode, item.code_name), item.message)
                else:
                    yield item
        finally:  # however it ends: finished, failed, or cancelled by the client
            release()
            if not ended:  # the client went away: its blocks are freed in the next step
                self.engine.abort(engine_request)

    def Tokenize(self, request: gateway_pb2.TokenizeRequest,
                 context: grpc.ServicerContext) -> gateway_pb2.TokenizeResponse:
        try:
            token_ids = self.prompt_ids(request)
            check_prompt_length(len(token_ids), self.limits)
        except InvalidRequest as error:
            _refuse_now(context, grpc.StatusCode.INVALID_ARGUMENT, error)
        return gateway_pb2.TokenizeResponse(
            token_ids=token_ids, tokens=self.tokenizer.token_pieces(token_ids)
        )

    def model_info(self) -> BackendInfo:
        """The served model as the runners describe it now."""
        return self.engine.info or self._info

    def GetModelInfo(self, request: gateway_pb2.GetModelInfoRequest,
                     context: grpc.ServicerContext) -> gateway_pb2.GetModelInfoResponse:
        info = self.model_info()
        return gateway_pb2.GetModelInfoResponse(
            model=self.served_model_name, architecture=info.architecture,
            vocab_size=info.vocab_size, max_model_len=info.max_model_len,
            eos_token_ids=info.eos_token_ids, num_blocks=info.num_blocks,
            block_size=info.block_size, dtype=info.dtype, device=info.device,
            default_sampling_params=self.defaults.params,
            has_chat_template=self.tokenizer.has_chat_template,
        )

    # ----- building a request --------------------------------------------------------------

    def build_request(self, request: gateway_pb2.GenerateRequest,
                      stream: MessageSink | None = None,
                      default_max_tokens: int | None = None) -> Request:
        """A validated engine request (InvalidRequest when it cannot be served), its messages
        going to `stream` (default: a queue read by `Request.messages`); an unset max_tokens
        is what fits, capped at the generation config's max_new_tokens, else at
        `default_max_tokens`. Unset sampling fields take the server's defaults. The HTTP API
        builds its requests here too, so both APIs check and tokenize alike."""
        check_identifiers(request.request_id, request.cache_salt)
        if request.WhichOneof("input") == "prompt_token_ids":
            check_prompt_length(len(request.prompt_token_ids.token_ids), self.limits)
            prompt_ids = list(request.prompt_token_ids.token_ids)
        else:
            prompt_ids = self.prompt_ids(request)
        check_prompt_ids(prompt_ids, self.limits)
        params = sampling_config(self.defaults.apply(request.sampling_params), len(prompt_ids),
                                 self.limits, self.engine.new_seed(),
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
                self.engine.config.stream_interval),
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


# Field names a refusal's reason may be (the first word of an InvalidRequest message names the
# field at fault when it is one of these).
_REQUEST_FIELDS = frozenset(gateway_pb2.SamplingParams.DESCRIPTOR.fields_by_name) | frozenset(
    gateway_pb2.GenerateRequest.DESCRIPTOR.fields_by_name)


def _refusal(context: grpc.ServicerContext | grpc.aio.ServicerContext,
             code: grpc.StatusCode, error: Exception, reason: str) -> str:
    """Logs and counts a refusal (gateway/refusals.py); returns the message to abort with."""
    message = str(error)
    if not reason:
        field = refusals.reason_label(message.split(" ", 1)[0].rstrip(":"))
        reason = field if field in _REQUEST_FIELDS else code.name.lower()
    refusals.record("grpc", code.name, reason, context.peer(), message)
    return message


async def _refuse(context: grpc.aio.ServicerContext, code: grpc.StatusCode, error: Exception,
                  reason: str = "") -> NoReturn:
    """Refuses a call on the event loop (Generate)."""
    await context.abort(code, _refusal(context, code, error, reason))
    raise AssertionError("context.abort raises")  # for the type checker: it never returns


def _refuse_now(context: grpc.ServicerContext, code: grpc.StatusCode, error: Exception,
                reason: str = "") -> NoReturn:
    """Refuses a call on a worker thread (the unary methods)."""
    context.abort(code, _refusal(context, code, error, reason))
    raise AssertionError("context.abort raises")


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
