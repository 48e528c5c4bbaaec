"""The OpenAI-compatible HTTP API: a Starlette app over the gateway's engine, served by uvicorn.

It runs in the gateway process, on the event loop that serves gRPC's streams too, and submits
to the same engine as the gRPC servicer (no extra hop). Requests are built and checked by
gateway/admission.py, as gRPC's are (on a worker thread: tokenizing must not stall the loop's
other streams); the runner loops hand each step's messages to this loop in one batch
(gateway/delivery.py). HTTP requests have their own limits (--max-http-streams), apart from
gRPC's (--max-streams). LoRA adapters are loaded and unloaded through the gateway's
AdapterAdmin (gateway/adapters.py), as the gRPC AdminService does. docs/api.md describes the
endpoints.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import json
import logging
import ssl
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from functools import lru_cache
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from common.server import ServerOptions
from gateway import refusals
from gateway.adapters import AdapterAdmin, AdapterError, ModelNames, UnknownModel
from gateway.admission import Admission
from gateway.delivery import AsyncSink, Item, StreamError
from gateway.engine import AdmissionError, Engine
from gateway.http.errors import ApiError, from_grpc_code, invalid
from gateway.http.protocol import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    KNOWN_FIELDS,
    Fields,
    Job,
    check_model,
    model_not_found,
    parse_chat,
    parse_completion,
    parse_json,
)
from gateway.http.responses import Answer
from gateway.request import Request
from gateway.validation import (
    InvalidRequest,
    LimitReached,
    StreamLimiter,
    check_prompt_ids,
    check_prompt_length,
)
from protos import gateway_pb2

log = logging.getLogger(__name__)

# Paths anyone may read, token or not: probes and scrapers (the gRPC side's health and metrics
# port are open too).
_OPEN_PATHS = ("/health", "/metrics", "/version")
_Item = tuple[int, Item]


class _JobMessages:
    """The messages of a job's requests (one per prompt), each tagged with its prompt's
    index, on one queue; taking one tells its sink (so a request whose reader is behind
    merges its progress instead of queueing more)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, num_requests: int) -> None:
        self.queue: asyncio.Queue[_Item] = asyncio.Queue()
        self.sinks = [AsyncSink(loop, self.queue, index) for index in range(num_requests)]

    async def get(self) -> _Item:
        item = await self.queue.get()
        self.sinks[item[0]].taken()
        return item


class HttpApi:
    """The endpoints, over one gateway's engine; `admission` builds and checks the requests
    (the gRPC servicer's too)."""

    def __init__(self, engine: Engine, admission: Admission, options: ServerOptions,
                 admin: AdapterAdmin | None = None) -> None:
        """`admin` loads and unloads LoRA adapters (default: one over the engine's loops)."""
        self._engine = engine
        self._admission = admission
        self._tokenizer = admission.tokenizer
        self._options = options
        self._model: ModelNames = admission.models  # base name, aliases, adapters
        self._admin = admin or AdapterAdmin(admission.models, lambda: engine.loops)
        self._expected = [f"Bearer {t}".encode() for t in options.auth_tokens]
        config = engine.config
        # Not the gRPC servicer's limiter: HTTP has limits of its own (docs/gateway.md).
        self.streams = StreamLimiter(config.max_http_streams, config.max_http_streams_per_client,
                                     ("--max-http-streams", "--max-http-streams-per-client"))
        self._token_text = lru_cache(maxsize=1 << 16)(self._decode_one)
        self.app = Starlette(routes=[
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/load_lora_adapter", self.load_lora_adapter, methods=["POST"]),
            Route("/v1/unload_lora_adapter", self.unload_lora_adapter, methods=["POST"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/version", self.version, methods=["GET"]),
        ], exception_handlers={ApiError: _error_response, 404: _not_found,
                               405: _not_allowed, ClientDisconnect: _gone,
                               Exception: _internal_error})
        self.app.add_middleware(_AuthMiddleware, api=self)

    def _decode_one(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def authorized(self, header: str | None) -> bool:
        if not self._expected:
            return True
        presented = (header or "").encode()
        return any([hmac.compare_digest(presented, e) for e in self._expected])

    # ----- endpoints ---------------------------------------------------------------------

    async def models(self, request: HttpRequest) -> Response:
        info = self._admission.model_info()
        max_len = self._admission.limits.max_len
        base = self._model.name
        # vLLM's shape: the base model, then each adapter with its folder as root and the
        # base model as parent.
        adapters = [{"id": adapter.name, "object": "model", "created": 0,
                     "owned_by": "pagewire", "root": adapter.path, "parent": base,
                     "max_model_len": max_len} for adapter in self._model.catalog.list()]
        return JSONResponse({"object": "list", "data": [{
            "id": base, "object": "model", "created": 0, "owned_by": "pagewire",
            "root": info.model, "parent": None, "max_model_len": max_len,
            # What a request's unset sampling fields take (docs/api.md).
            "default_sampling_params": self._admission.defaults.as_dict()}, *adapters]})

    async def load_lora_adapter(self, request: HttpRequest) -> Response:
        """vLLM's: {"lora_name", "lora_path"}; 200 with a line of text once it is served."""
        fields = Fields(await _body(request, self._options), {"lora_name", "lora_path"})
        name, path = fields.string("lora_name"), fields.string("lora_path")
        for field, value in (("lora_name", name), ("lora_path", path)):
            if not value:
                raise invalid(f"{field} is missing: give lora_name and lora_path",
                              param=field, reason=field)
        try:
            await asyncio.to_thread(self._admin.load, name, path)
        except AdapterError as error:
            raise _adapter_error(error) from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, request: HttpRequest) -> Response:
        """vLLM's: {"lora_name"}; 404 for an adapter not served."""
        # vLLM's lora_int_id names nothing here: taken only as null.
        fields = Fields(await _body(request, self._options), {"lora_name"},
                        {"lora_int_id": lambda _value: False})
        name = fields.string("lora_name")
        if not name:
            raise invalid("lora_name is missing", param="lora_name", reason="lora_name")
        try:
            await asyncio.to_thread(self._admin.unload, name)
        except AdapterError as error:
            raise _adapter_error(error) from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    async def completions(self, request: HttpRequest) -> Response:
        job = parse_completion(await _body(request, self._options), self._model)
        return await self._serve(request, job)

    async def chat_completions(self, request: HttpRequest) -> Response:
        job = parse_chat(await _body(request, self._options), self._model)
        return await self._serve(request, job)

    async def tokenize(self, request: HttpRequest) -> Response:
        body = await _body(request, self._options)
        fields = Fields(body, {"model", "prompt", "messages"})
        tokenize = gateway_pb2.TokenizeRequest()
        if body.get("messages") is not None:
            tokenize.messages.CopyFrom(
                parse_chat({"messages": body["messages"]}, self._model).requests[0].messages)
        else:
            tokenize.prompt = fields.string("prompt")
        check_model(fields, self._model)
        try:
            token_ids = await asyncio.to_thread(self._admission.prompt_ids, tokenize)
            check_prompt_length(len(token_ids), self._admission.limits)
        except InvalidRequest as error:
            raise invalid(str(error)) from None
        return JSONResponse({"tokens": token_ids, "count": len(token_ids),
                             "max_model_len": self._admission.limits.max_len,
                             "token_strs": self._tokenizer.token_pieces(token_ids)})

    async def detokenize(self, request: HttpRequest) -> Response:
        body = await _body(request, self._options)
        fields = Fields(body, {"model", "tokens"})
        check_model(fields, self._model)
        token_ids = body.get("tokens")
        if not (isinstance(token_ids, list) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in token_ids)):
            raise invalid("tokens must be an array of token ids", param="tokens")
        try:
            check_prompt_ids(token_ids, self._admission.limits)
        except InvalidRequest as error:
            raise invalid(str(error), param="tokens") from None
        return JSONResponse({"prompt": await asyncio.to_thread(self._tokenizer.decode,
                                                                token_ids)})

    async def health(self, request: HttpRequest) -> Response:
        problem = self._engine.problem()
        if problem:
            return JSONResponse({"status": "NOT_SERVING", "problem": problem}, status_code=503)
        return JSONResponse({"status": "SERVING"})

    async def metrics(self, request: HttpRequest) -> Response:
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    async def version(self, request: HttpRequest) -> Response:
        try:
            return JSONResponse({"version": version("pagewire")})
        except PackageNotFoundError:
            return JSONResponse({"version": "unknown"})

    # ----- generation --------------------------------------------------------------------

    def _build(self, job: Job, messages: _JobMessages) -> tuple[list[Request], list[str]]:
        """The job's engine requests and echo texts (tokenizing: run off the loop)."""
        try:
            requests = [self._admission.build_request(pb, sink, job.default_max_tokens)
                        for pb, sink in zip(job.requests, messages.sinks, strict=True)]
        except InvalidRequest as error:
            raise invalid(str(error), param=_field_named(str(error), job)) from None
        except UnknownModel:  # unloaded since the body was read
            raise model_not_found(self._model, job.requests[0].model) from None
        echo_texts = [p if isinstance(p, str) else self._tokenizer.decode(p)
                      for p in job.echo_prompts]
        return requests, echo_texts

    async def _serve(self, http: HttpRequest, job: Job) -> Response:
        messages = _JobMessages(asyncio.get_running_loop(), len(job.requests))
        requests, echo_texts = await asyncio.to_thread(self._build, job, messages)
        release = self._acquire_slot(http)
        # Placing may ask the block service where to route (a blocking call): off the loop.
        await asyncio.to_thread(self._submit, requests, release)
        try:
            answer = Answer(job, self._token_text, echo_texts,
                            [len(r.prompt_ids) for r in requests])
            watch = asyncio.ensure_future(_disconnected(http))
            try:
                first = await _next(messages, watch)
                if not job.stream:
                    try:
                        return await self._whole(answer, messages, first, watch,
                                                 len(requests))
                    finally:
                        release()  # a stream gives its slot back in _EventStream
            finally:
                watch.cancel()
            _raise_if_error(first)
        except ClientDisconnect:  # nobody is left to answer
            self._abort(requests)
            release()
            return Response(status_code=499)
        except BaseException:
            self._abort(requests)
            release()
            raise

        def close() -> None:  # however the stream ends: idempotent
            self._abort(requests)
            release()
        return _EventStream(self._chunks(answer, messages, first, requests), close)

    def _acquire_slot(self, http: HttpRequest) -> Any:
        if self._expected:
            client = f"token:{http.headers.get('authorization')}"
        else:
            client = http.client.host if http.client else "unknown"
        try:
            return self.streams.acquire(client)
        except LimitReached as error:
            raise ApiError(429, str(error), reason="limit_reached") from None

    def _submit(self, requests: list[Request], release: Any) -> None:
        """Submits every prompt's request, or none: a full queue refuses the whole job (the
        ones submitted are aborted, the slot given back)."""
        for count, request in enumerate(requests):
            try:
                self._engine.submit(request)
            except AdmissionError as error:
                self._abort(requests[:count])  # never the unsubmitted: they would stay queued
                release()
                raise ApiError(429, str(error), reason="queue_full") from None

    def _abort(self, requests: Sequence[Request]) -> None:
        for request in requests:
            self._engine.abort(request)

    async def _whole(self, answer: Answer, messages: _JobMessages, item: _Item,
                     watch: asyncio.Future[None], num_requests: int) -> Response:
        remaining = num_requests
        while True:
            index, message = item
            if message is None:
                remaining -= 1
                if remaining == 0:
                    return JSONResponse(answer.whole())
            else:
                _raise_if_error(item)
                assert isinstance(message, gateway_pb2.GenerateResponse)
                answer.add(index, message)
            item = await _next(messages, watch)

    async def _chunks(self, answer: Answer, messages: _JobMessages, item: _Item,
                      requests: Sequence[Request]) -> AsyncIterator[str]:
        """The event stream: a chunk per message, the usage chunk when asked for, [DONE]."""
        remaining = len(requests)
        while True:
            index, message = item
            if message is None:
                remaining -= 1
                if remaining == 0:
                    break
            elif isinstance(message, StreamError):
                # Headers are sent: the error goes in the stream, as vLLM does.
                yield _event(from_grpc_code(message.code_name, message.message).payload())
                break
            else:
                if message.HasField("usage"):
                    answer.add_usage(index, message.usage)
                for chunk in answer.chunks(index, message):
                    yield _event(chunk)
            item = await messages.get()
        if remaining == 0 and answer.job.include_usage:
            yield _event(answer.usage_chunk())
        yield "data: [DONE]\n\n"


class _EventStream(StreamingResponse):
    """A server-sent-event response that calls `close` however it ends: finished, failed, or
    cancelled by the client's disconnect (then the generator may be left suspended)."""

    def __init__(self, events: AsyncIterator[str], close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self._close = close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._close()


# An AdapterError's gRPC code as an HTTP status (vLLM answers a refused load with 400, an
# adapter it does not have with 404).
_ADAPTER_STATUS = {"INVALID_ARGUMENT": 400, "FAILED_PRECONDITION": 400, "NOT_FOUND": 404,
                   "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 503, "RESOURCE_EXHAUSTED": 429}


def _adapter_error(error: AdapterError) -> ApiError:
    return ApiError(_ADAPTER_STATUS.get(error.code_name, 500), error.message,
                    param=error.field, reason="lora_adapter")


def _field_named(message: str, job: Job) -> str | None:
    """The request field an InvalidRequest message starts with (admission's messages name the
    field first, or its part, like `tools[2].name`); gRPC's structured_output is the body
    field that asked for the format."""
    word = message.split(" ", 1)[0].rstrip(":")
    base = refusals.reason_label(word)
    if base == "structured_output":
        return job.format_field
    return word if base in COMPLETION_FIELDS | CHAT_FIELDS else None


def _raise_if_error(item: _Item) -> None:
    message = item[1]
    if isinstance(message, StreamError):
        raise from_grpc_code(message.code_name, message.message)


async def _next(messages: _JobMessages, watch: asyncio.Future[None]) -> _Item:
    """The next message, or ClientDisconnect when the client goes away first."""
    get: asyncio.Future[Any] = asyncio.ensure_future(messages.get())
    waited: set[asyncio.Future[Any]] = {get, watch}
    done, _ = await asyncio.wait(waited, return_when=asyncio.FIRST_COMPLETED)
    if get in done:
        return get.result()
    get.cancel()
    raise ClientDisconnect()


async def _disconnected(http: HttpRequest) -> None:
    """Returns when the client disconnects (the body is read by then)."""
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            return


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _body(http: HttpRequest, options: ServerOptions) -> dict[str, Any]:
    """The JSON body, read up to the gateway's message limit (413 past it)."""
    limit = options.max_message_bytes
    declared = http.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the body has {declared} bytes, over the limit of {limit}")
    chunks = []
    size = 0
    async for chunk in http.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the body is over the limit of {limit} bytes")
        chunks.append(chunk)
    return parse_json(b"".join(chunks))


async def _error_response(http: HttpRequest, error: Exception) -> Response:
    assert isinstance(error, ApiError)
    _record_refusal(http.client, error)
    return JSONResponse(error.payload(), status_code=error.status)


# Refusal reasons by status, where the error names no known field (gateway/refusals.py).
_STATUS_REASONS = {400: "invalid_argument", 401: "unauthorized", 404: "not_found",
                   405: "method_not_allowed", 413: "body_too_large", 429: "limit_reached"}


def _record_refusal(client: Any, error: ApiError) -> None:
    """Logs and counts a 4xx (a 5xx is the server's fault, logged where it happens)."""
    if not 400 <= error.status < 500:
        return
    if error.reason:
        reason = error.reason
    elif isinstance(error.code, str):
        reason = error.code
    elif error.param and refusals.reason_label(error.param) in KNOWN_FIELDS:
        reason = refusals.reason_label(error.param)
    else:
        reason = _STATUS_REASONS.get(error.status, "other")
    address = f"{client.host}:{client.port}" if client else "unknown"
    refusals.record("http", str(error.status), reason, address, error.message)


async def _not_found(http: HttpRequest, error: Exception) -> Response:
    return await _error_response(http, ApiError(404, f"no endpoint {http.url.path}",
                                                reason="no_endpoint"))


async def _not_allowed(http: HttpRequest, error: Exception) -> Response:
    return await _error_response(
        http, ApiError(405, f"{http.method} is not allowed on {http.url.path}"))


async def _gone(http: HttpRequest, error: Exception) -> Response:
    """The client went away while sending its body: nobody reads the answer."""
    return Response(status_code=499)


async def _internal_error(http: HttpRequest, error: Exception) -> Response:
    log.exception("HTTP %s %s failed", http.method, http.url.path)
    return await _error_response(http, ApiError(500, f"internal error: {error}"))


class _AuthMiddleware:
    """401 for a call without a valid `Authorization: Bearer` token when the gateway has
    --auth-token-file (the same tokens as the gRPC API)."""

    def __init__(self, app: Any, api: HttpApi) -> None:
        self._app = app
        self._api = api

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in _OPEN_PATHS:
            header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            if not self._api.authorized(header):
                error = ApiError(401, "missing or invalid bearer token (header Authorization: "
                                      "Bearer <token>)")
                _record_refusal(HttpRequest(scope).client, error)
                response = JSONResponse(error.payload(), status_code=401)
                await response(scope, receive, send)
                return
        await self._app(scope, receive, send)


class HttpServer:
    """uvicorn serving the API on the gateway's event loop (where its gRPC API runs too)."""

    def __init__(self, api: HttpApi, options: ServerOptions, port: int,
                 loop: asyncio.AbstractEventLoop) -> None:
        tls: dict[str, Any] = {}
        if options.tls is not None:
            tls = {"ssl_certfile": options.tls.cert_file, "ssl_keyfile": options.tls.key_file}
            if options.tls.client_ca_file:
                tls.update(ssl_ca_certs=options.tls.client_ca_file,
                           ssl_cert_reqs=ssl.CERT_REQUIRED)
        config = uvicorn.Config(api.app, host=options.host, port=port, log_level="warning",
                                access_log=False, timeout_graceful_shutdown=int(
                                    max(1, options.grace_s)), **tls)
        self.api = api
        self._server = uvicorn.Server(config)
        self._loop = loop
        self._serving: concurrent.futures.Future[None] | None = None

    @property
    def port(self) -> int:
        servers = getattr(self._server, "servers", [])
        for server in servers:
            for sock in server.sockets:
                return int(sock.getsockname()[1])
        return 0

    def start(self, timeout_s: float = 30.0) -> None:
        serving = self._serving = asyncio.run_coroutine_threadsafe(self._server.serve(),
                                                                   self._loop)
        waited = threading.Event()
        deadline = timeout_s
        while not self._server.started and not serving.done() and deadline > 0:
            waited.wait(0.02)
            deadline -= 0.02
        if not self._server.started:
            raise RuntimeError("the HTTP server did not start (is its port free?)")

    def stop(self) -> None:
        self._server.should_exit = True
        if self._serving is not None:
            with contextlib.suppress(Exception):  # it failed: nothing left to stop
                self._serving.result(timeout=30)
