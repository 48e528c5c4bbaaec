"""A small Python client of pagewire's public API.

    from gateway.client import PagewireClient
    with PagewireClient("127.0.0.1:50051") as client:
        for message in client.generate("The capital of France is", max_tokens=16):
            print(message.outputs[0].text if message.outputs else "", end="", flush=True)
        result = client.complete(messages=[("user", "Hi!")], temperature=0)
        print(result.texts[0], result.finish_reasons[0], result.usage)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from common.security import ClientTls, open_channel
from protos import gateway_pb2, gateway_pb2_grpc

MessageLike = gateway_pb2.ChatMessage | tuple[str, str] | dict[str, str]


@dataclass
class Completion:
    """Every output of a finished request, assembled from its stream."""

    request_id: str = ""
    texts: list[str] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    # "stop", "length", "abort", "tool_calls"
    finish_reasons: list[str] = field(default_factory=list)
    logprobs: list[list[gateway_pb2.PositionLogprobs]] = field(default_factory=list)
    # Per output, its tool calls (the request had tools), arguments joined.
    tool_calls: list[list[gateway_pb2.ToolCall]] = field(default_factory=list)
    usage: gateway_pb2.Usage | None = None
    num_messages: int = 0


def finish_reason_name(value: int) -> str:
    """"stop", "length", "abort", "tool_calls" ("" when not finished)."""
    if value == gateway_pb2.FINISH_REASON_UNSPECIFIED:
        return ""
    return gateway_pb2.FinishReason.Name(value).removeprefix("FINISH_REASON_").lower()


def build_request(prompt: str | None = None, messages: Iterable[MessageLike] | None = None,
                  token_ids: Sequence[int] | None = None, *, request_id: str = "",
                  cache_salt: str = "", final_only: bool = False, model: str = "",
                  **params: Any) -> gateway_pb2.GenerateRequest:
    """A GenerateRequest from exactly one of prompt / messages / token_ids and sampling
    parameters by their proto names (max_tokens, temperature, stop, n, seed, ...); `model`:
    a LoRA adapter's name ("": the base model)."""
    given = [x is not None for x in (prompt, messages, token_ids)]
    if sum(given) != 1:
        raise ValueError("give exactly one of prompt, messages, token_ids")
    request = gateway_pb2.GenerateRequest(
        request_id=request_id, cache_salt=cache_salt, final_only=final_only, model=model,
        sampling_params=gateway_pb2.SamplingParams(**params),
    )
    if prompt is not None:
        request.prompt = prompt
    elif messages is not None:
        request.messages.CopyFrom(chat_messages(messages))
    else:
        request.prompt_token_ids.token_ids.extend(token_ids or [])
    return request


def chat_messages(messages: Iterable[MessageLike]) -> gateway_pb2.ChatMessages:
    """ChatMessages from protos, (role, content) pairs or {"role", "content"} dicts."""
    result = gateway_pb2.ChatMessages()
    for message in messages:
        if isinstance(message, gateway_pb2.ChatMessage):
            result.messages.append(message)
        elif isinstance(message, dict):
            result.messages.add(role=message["role"], content=message["content"])
        else:
            role, content = message
            result.messages.add(role=role, content=content)
    return result


class PagewireClient:
    """Generate, Tokenize and GetModelInfo over one channel."""

    def __init__(self, address: str = "127.0.0.1:50051",
                 channel: grpc.Channel | None = None, tls: ClientTls | None = None,
                 token: str | None = None) -> None:
        """Connects to `address` (over TLS when `tls` is given, sending the bearer `token`
        when given), or uses `channel` as it is."""
        self._own_channel = channel is None
        self.channel = channel or open_channel(address, tls, token)
        self.stub = gateway_pb2_grpc.GenerationServiceStub(self.channel)

    def __enter__(self) -> PagewireClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._own_channel:
            self.channel.close()

    def generate(self, prompt: str | None = None,
                 messages: Iterable[MessageLike] | None = None,
                 token_ids: Sequence[int] | None = None, *, timeout: float | None = None,
                 request_id: str = "", cache_salt: str = "", final_only: bool = False,
                 model: str = "", **params: Any) -> Iterator[gateway_pb2.GenerateResponse]:
        """The stream of deltas (cancel it with .cancel() on the returned iterator); with
        `final_only`, one message with the whole completion when it ends."""
        request = build_request(prompt, messages, token_ids, request_id=request_id,
                                cache_salt=cache_salt, final_only=final_only, model=model,
                                **params)
        return self.stub.Generate(request, timeout=timeout)  # type: ignore[no-any-return]

    def complete(self, prompt: str | None = None,
                 messages: Iterable[MessageLike] | None = None,
                 token_ids: Sequence[int] | None = None, *, timeout: float | None = None,
                 **params: Any) -> Completion:
        """Runs a request to its end and assembles its outputs."""
        return collect(self.generate(prompt, messages, token_ids, timeout=timeout, **params))

    def tokenize(self, prompt: str | None = None,
                 messages: Iterable[MessageLike] | None = None) -> list[int]:
        request = gateway_pb2.TokenizeRequest()
        if prompt is not None:
            request.prompt = prompt
        elif messages is not None:
            request.messages.CopyFrom(chat_messages(messages))
        return list(self.stub.Tokenize(request).token_ids)

    def model_info(self) -> gateway_pb2.GetModelInfoResponse:
        return self.stub.GetModelInfo(gateway_pb2.GetModelInfoRequest())  # type: ignore[no-any-return]


def collect(stream: Iterable[gateway_pb2.GenerateResponse]) -> Completion:
    """Assembles a stream's deltas into a Completion."""
    result = Completion()
    for message in stream:
        result.request_id = message.request_id
        result.num_messages += 1
        for output in message.outputs:
            while len(result.texts) <= output.index:
                result.texts.append("")
                result.token_ids.append([])
                result.finish_reasons.append("")
                result.logprobs.append([])
                result.tool_calls.append([])
            result.texts[output.index] += output.text
            calls = result.tool_calls[output.index]
            for delta in output.tool_calls:
                if delta.index == len(calls):  # a call's first delta
                    calls.append(gateway_pb2.ToolCall(id=delta.id, name=delta.name))
                calls[delta.index].arguments += delta.arguments
            result.token_ids[output.index].extend(output.token_ids)
            result.logprobs[output.index].extend(output.logprobs)
            if output.finish_reason:
                result.finish_reasons[output.index] = finish_reason_name(output.finish_reason)
        if message.HasField("usage"):
            result.usage = message.usage
    return result
