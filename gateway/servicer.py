"""GenerationService: protobuf in, requests built by gateway/admission.py to the engine,
streamed deltas out."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import NoReturn

import grpc

from gateway import refusals
from gateway.adapters import UnknownModel
from gateway.admission import Admission
from gateway.delivery import AsyncSink, Item, StreamError
from gateway.engine import AdmissionError, Engine
from gateway.validation import (
    InvalidRequest,
    LimitReached,
    StreamLimiter,
    check_prompt_length,
    peer_key,
)
from protos import gateway_pb2, gateway_pb2_grpc


class GenerationServicer(gateway_pb2_grpc.GenerationServiceServicer):
    """The public API; every check happens before a request reaches the engine."""

    def __init__(self, engine: Engine, admission: Admission,
                 tokens_checked: bool = False) -> None:
        """`admission` builds and checks the requests (the HTTP API's too); `tokens_checked`:
        the server verifies bearer tokens, so a token names a client."""
        self._engine = engine
        self.admission = admission
        self._tokens_checked = tokens_checked
        config = engine.config
        self.streams = StreamLimiter(config.max_streams, config.max_streams_per_client)

    async def Generate(self, request: gateway_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        """Streams a request's messages, on the gateway's event loop: a stream holds no
        thread, and each step's messages arrive in one batch (gateway/delivery.py)."""
        messages: asyncio.Queue[tuple[None, Item]] = asyncio.Queue()
        sink = AsyncSink(asyncio.get_running_loop(), messages, None)
        try:
            # Tokenizing a long prompt must not stall the other streams.
            engine_request = await asyncio.to_thread(self.admission.build_request, request, sink)
        except InvalidRequest as error:
            await _refuse(context, grpc.StatusCode.INVALID_ARGUMENT, error)
        except UnknownModel as error:
            await _refuse(context, grpc.StatusCode.NOT_FOUND, error, "model_not_found")
        client = peer_key(context.invocation_metadata(), context.peer(), self._tokens_checked)
        try:
            release = self.streams.acquire(client)
        except LimitReached as error:
            await _refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, error, "limit_reached")
        ended = False  # the stream ran to its end, or the request was never placed
        try:
            try:
                # Placing may ask the block service where to route (a blocking call).
                await asyncio.to_thread(self._engine.submit, engine_request)
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
                self._engine.abort(engine_request)

    def Tokenize(self, request: gateway_pb2.TokenizeRequest,
                 context: grpc.ServicerContext) -> gateway_pb2.TokenizeResponse:
        try:
            token_ids = self.admission.prompt_ids(request)
            check_prompt_length(len(token_ids), self.admission.limits)
        except InvalidRequest as error:
            _refuse_now(context, grpc.StatusCode.INVALID_ARGUMENT, error)
        return gateway_pb2.TokenizeResponse(
            token_ids=token_ids, tokens=self.admission.tokenizer.token_pieces(token_ids)
        )

    def GetModelInfo(self, request: gateway_pb2.GetModelInfoRequest,
                     context: grpc.ServicerContext) -> gateway_pb2.GetModelInfoResponse:
        admission = self.admission
        info = admission.model_info()
        return gateway_pb2.GetModelInfoResponse(
            model=admission.served_model_name, architecture=info.architecture,
            vocab_size=info.vocab_size, max_model_len=info.max_model_len,
            eos_token_ids=info.eos_token_ids, num_blocks=info.num_blocks,
            block_size=info.block_size, dtype=info.dtype, device=info.device,
            default_sampling_params=admission.defaults.params,
            has_chat_template=admission.tokenizer.has_chat_template,
            adapters=[gateway_pb2.LoraAdapter(name=a.name, path=a.path, rank=a.rank)
                      for a in admission.models.catalog.list()],
        )


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
