"""GenerateResponse messages to OpenAI's response and stream-chunk JSON."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.http.protocol import Job
from protos import gateway_pb2

FINISH_REASONS = {
    gateway_pb2.FINISH_REASON_STOP: "stop",
    gateway_pb2.FINISH_REASON_LENGTH: "length",
    gateway_pb2.FINISH_REASON_ABORT: "abort",
    gateway_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls",
}

TokenText = Callable[[int], str]


@dataclass
class Choice:
    """One choice of the answer as it builds up (non-streamed answers)."""

    index: int
    texts: list[str] = field(default_factory=list)  # whole answers only
    streamed_chars: int = 0  # streams: text sent so far (logprobs' text_offset)
    streamed_tokens: int = 0  # streams: tokens sent so far (continuous usage)
    logprobs: list[gateway_pb2.PositionLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # whole answers only


class Answer:
    """Shapes one job's messages as OpenAI's JSON: chunks of a stream, or the whole answer."""

    def __init__(self, job: Job, token_text: TokenText, echo_texts: Sequence[str],
                 prompt_tokens: Sequence[int] = ()) -> None:
        """`prompt_tokens`: each prompt's length, for the usage in every chunk
        (continuous_usage_stats)."""
        self.job = job
        self.token_text = token_text
        self.id = ("chatcmpl-" if job.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.echo_texts = echo_texts
        self.choices = [Choice(i) for i in range(len(job.requests) * job.n)]
        self._usage = [gateway_pb2.Usage() for _ in job.requests]
        self._prompt_tokens = list(prompt_tokens) or [0] * len(job.requests)
        self._started: set[int] = set()  # choices whose first chunk was sent

    # ----- shared ------------------------------------------------------------------------

    def _head(self, streamed: bool) -> dict[str, Any]:
        if self.job.chat:
            kind = "chat.completion.chunk" if streamed else "chat.completion"
        else:
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created,
                "model": self.job.model}

    def add_usage(self, prompt_index: int, usage: gateway_pb2.Usage) -> None:
        self._usage[prompt_index] = usage

    def usage(self) -> dict[str, Any]:
        prompt = sum(u.prompt_tokens for u in self._usage)
        completion = sum(u.completion_tokens for u in self._usage)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(u.cached_tokens
                                                               for u in self._usage)}}

    def _logprobs(self, entries: Sequence[gateway_pb2.PositionLogprobs], offset: int
                  ) -> dict[str, Any] | None:
        if self.job.logprobs is None:
            return None
        if self.job.chat:
            return {"content": [self._chat_logprob(e) for e in entries]}
        tokens = [self.token_text(e.token.token_id) for e in entries]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {"tokens": tokens,
                "token_logprobs": [e.token.logprob for e in entries],
                "top_logprobs": [{self.token_text(t.token_id): t.logprob for t in e.top}
                                 for e in entries],
                "text_offset": offsets}

    def _chat_logprob(self, entry: gateway_pb2.PositionLogprobs) -> dict[str, Any]:
        def one(logprob: gateway_pb2.TokenLogprob) -> dict[str, Any]:
            text = self.token_text(logprob.token_id)
            return {"token": text, "logprob": logprob.logprob,
                    "bytes": list(text.encode("utf-8", "surrogatepass"))}
        return {**one(entry.token), "top_logprobs": [one(t) for t in entry.top]}

    # ----- streamed ----------------------------------------------------------------------

    def chunks(self, prompt_index: int, message: gateway_pb2.GenerateResponse
               ) -> list[dict[str, Any]]:
        """The stream chunks of one message: one with every choice that progressed (none
        when nothing did), or with continuous_usage_stats one per choice, each with that
        choice's usage so far (vLLM's: a chunk's usage is its choice's)."""
        choices = []
        for output in message.outputs:
            index = prompt_index * self.job.n + output.index
            choice = self.choices[index]
            choice.streamed_tokens += len(output.token_ids)
            text = output.text
            first = index not in self._started
            if first:
                self._started.add(index)
                if self.echo_texts:
                    text = self.echo_texts[prompt_index] + text
            offset = choice.streamed_chars
            choice.streamed_chars += len(text)
            reason = FINISH_REASONS.get(output.finish_reason)
            entry: dict[str, Any] = {"index": index}
            if self.job.chat:
                calls = _call_deltas(output.tool_calls)
                empty = not (reason or calls)  # a chunk says something, if only ""
                delta: dict[str, Any] = {"content": text} if text or empty else {}
                if first:
                    delta = {"role": "assistant", **delta}
                if calls:
                    delta["tool_calls"] = calls
                entry["delta"] = delta
            else:
                entry["text"] = text
            entry["logprobs"] = self._logprobs(output.logprobs, offset)
            entry["finish_reason"] = reason
            choices.append(entry)
        if not choices:
            return []
        if self.job.continuous_usage:
            prompt = self._prompt_tokens[prompt_index]
            return [{**self._head(True), "choices": [entry], "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": self.choices[entry["index"]].streamed_tokens,
                "total_tokens": prompt + self.choices[entry["index"]].streamed_tokens}}
                for entry in choices]
        chunk = {**self._head(True), "choices": choices}
        if self.job.include_usage:
            chunk["usage"] = None
        return [chunk]

    def usage_chunk(self) -> dict[str, Any]:
        """The last chunk with stream_options.include_usage: no choices, the usage."""
        return {**self._head(True), "choices": [], "usage": self.usage()}

    # ----- whole -------------------------------------------------------------------------

    def add(self, prompt_index: int, message: gateway_pb2.GenerateResponse) -> None:
        for output in message.outputs:
            choice = self.choices[prompt_index * self.job.n + output.index]
            choice.texts.append(output.text)
            choice.logprobs.extend(output.logprobs)
            for call in _call_deltas(output.tool_calls):
                if "id" in call:  # a call's first delta (they come in index order)
                    choice.tool_calls.append({key: call[key]
                                              for key in ("id", "type", "function")})
                else:
                    choice.tool_calls[call["index"]]["function"]["arguments"] += (
                        call["function"]["arguments"])
            choice.finish_reason = FINISH_REASONS.get(output.finish_reason,
                                                      choice.finish_reason)
        if message.HasField("usage"):
            self.add_usage(prompt_index, message.usage)

    def whole(self) -> dict[str, Any]:
        choices = []
        for choice in self.choices:
            echo = self.echo_texts[choice.index // self.job.n] if self.echo_texts else ""
            text = echo + "".join(choice.texts)
            entry: dict[str, Any] = {"index": choice.index}
            if self.job.chat:
                message: dict[str, Any] = {"role": "assistant", "content": text}
                if choice.tool_calls:
                    # OpenAI's: no content when the answer is only calls.
                    message["content"] = text if text.strip() else None
                    message["tool_calls"] = choice.tool_calls
                entry["message"] = message
            else:
                entry["text"] = text
            entry["logprobs"] = self._logprobs(choice.logprobs, len(echo))
            entry["finish_reason"] = choice.finish_reason
            choices.append(entry)
        return {**self._head(False), "choices": choices, "usage": self.usage()}


def _call_deltas(deltas: Sequence[gateway_pb2.ToolCallDelta]) -> list[dict[str, Any]]:
    """Tool call deltas as OpenAI streams them: a call's first with its id, type and name,
    the others with the next piece of its arguments; a message's deltas of one call are
    merged."""
    calls: list[dict[str, Any]] = []
    for delta in deltas:
        if calls and calls[-1]["index"] == delta.index:
            calls[-1]["function"]["arguments"] += delta.arguments
            continue
        call: dict[str, Any] = {"index": delta.index}
        if delta.name:
            call.update(id=delta.id, type="function",
                        function={"name": delta.name, "arguments": delta.arguments})
        else:
            call["function"] = {"arguments": delta.arguments}
        calls.append(call)
    return calls
