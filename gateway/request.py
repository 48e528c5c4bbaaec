"""One Generate request: its sequences, the text each output streams, its usage.

The runner loop's thread feeds sampled tokens in (`add_token`), then calls `flush` once per
step, which puts the progress on the request's stream (gateway/delivery.py) as one
GenerateResponse when a message is due: the first tokens at once, then every
`stream_interval` tokens, and always the end. A reader that falls behind (MAX_UNREAD messages
not taken yet) gets nothing more until it catches up: the progress waits in the outputs and
goes out merged into one message, so coalescing never drops, repeats or reorders anything and
what a slow stream holds stays bounded by its own output. With `final_only`, the outputs are
sent at the end only (or in parts of about FINAL_ONLY_PART_BYTES). Everything else here is only
touched by the runner loop's thread.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from gateway.delivery import MessageSink, Outbox, StreamError, ThreadSink
from gateway.detokenizer import DecodeBatchFn, DecodeFn, IncrementalDetokenizer
from gateway.grammar import CompiledFormat, FormatMatcher
from gateway.sequence import SamplingConfig, SeqStatus
from gateway.sequence import Sequence as Seq
from gateway.stop import StopStringMatcher
from gateway.tool_calls import ToolCallDelta, ToolCallParser, make_call_id
from protos import gateway_pb2

STOP = gateway_pb2.FINISH_REASON_STOP
LENGTH = gateway_pb2.FINISH_REASON_LENGTH
ABORT = gateway_pb2.FINISH_REASON_ABORT
TOOL_CALLS = gateway_pb2.FINISH_REASON_TOOL_CALLS
UNFINISHED = gateway_pb2.FINISH_REASON_UNSPECIFIED

# A final_only request's outputs are sent early, as a part, once what they hold may reach this
# many bytes: the whole completion of a long request (with n outputs and logprobs) can pass
# gRPC's message limit (4 MiB by default on both sides).
FINAL_ONLY_PART_BYTES = 1 << 20
# Upper bounds of the encoded size, for that estimate: a token id; one TokenLogprob.
_TOKEN_ID_BYTES = 5
_TOKEN_LOGPROB_BYTES = 16

# Messages a stream's reader may leave untaken before the request holds its progress back
# (merged into the next message it sends).
MAX_UNREAD = 1

# Seeds of the n outputs are spread by the 64-bit golden ratio so that neighbouring request
# seeds do not give overlapping output seeds.
_SEED_STRIDE = 0x9E3779B97F4A7C15
_U64 = (1 << 64) - 1


def output_seed(request_seed: int, index: int) -> int:
    """The seed of output `index` of a request seeded with `request_seed`."""
    return (request_seed + index * _SEED_STRIDE) & _U64


@dataclass
class TokenLogprobs:
    """The runner's log-probabilities at one sampled position."""

    logprob: float
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


class OutputState:
    """What one output has streamed and holds back, and why it ended."""

    def __init__(self, index: int, decode: DecodeFn, prompt_ids: Sequence[int],
                 stop: Sequence[str], output_format: CompiledFormat | None = None,
                 parses_tool_calls: bool = False) -> None:
        self.index = index
        self.detokenizer = IncrementalDetokenizer(decode, prompt_ids)
        self.stop_matcher = StopStringMatcher(stop)
        # Structured output: where the output is in its format, advanced with every token by
        # the runner loop (which fills the next token's mask from it).
        self.matcher: FormatMatcher | None = (
            output_format.new_matcher() if output_format is not None else None)
        # Tools: calls taken out of the text as they come (gateway/tool_calls.py).
        self.tool_parser = ToolCallParser(make_call_id) if parses_tool_calls else None
        self.pending_tool_calls: list[ToolCallDelta] = []
        self.finish_reason: gateway_pb2.FinishReason = UNFINISHED
        self.pending_text: list[str] = []  # pieces: joined once, when taken
        self.pending_ids: list[int] = []
        self.pending_logprobs: list[gateway_pb2.PositionLogprobs] = []
        self.held_bytes = 0  # an upper bound of the pending progress's encoded size
        self.reported_finish = False

    @property
    def finished(self) -> bool:
        return self.finish_reason != UNFINISHED

    def add_text(self, text: str) -> None:
        self._hold_text(self._parse_calls(self.stop_matcher.add(text)))

    def _parse_calls(self, text: str, final: bool = False) -> str:
        """The text less the tool calls in it, which wait in pending_tool_calls."""
        if self.tool_parser is None:
            return text
        content, calls = self.tool_parser.feed(text) if text else ("", [])
        if final:
            rest, more = self.tool_parser.finish()
            content, calls = content + rest, calls + more
        for call in calls:
            self.pending_tool_calls.append(call)
            self.held_bytes += 4 * len(call.arguments) + 64
        return content

    def _hold_text(self, text: str) -> None:
        if text:
            self.pending_text.append(text)
            self.held_bytes += 4 * len(text)  # UTF-8: at most 4 bytes a character

    def add_token(self, token_id: int, logprobs: gateway_pb2.PositionLogprobs | None) -> None:
        self.pending_ids.append(token_id)
        self.held_bytes += _TOKEN_ID_BYTES
        if logprobs is not None:
            self.pending_logprobs.append(logprobs)
            self.held_bytes += _TOKEN_LOGPROB_BYTES * (1 + len(logprobs.top))

    def finish(self, reason: gateway_pb2.FinishReason) -> None:
        """Ends the output; complete text still held (no stop string matched) is released
        unless it is aborted."""
        if self.finished:
            return
        self.catch_up()
        if reason != ABORT:
            held = "" if self.stop_matcher.stopped else self.stop_matcher.flush()
            self._hold_text(self._parse_calls(held, final=True))
            if reason == STOP and self.tool_parser is not None and self.tool_parser.num_calls:
                reason = TOOL_CALLS
        self.finish_reason = reason

    def catch_up(self) -> None:
        """Decodes what the detokenizer holds, a partial character aside: at the end, and
        before an error ends the stream, the tokens whose text waited for a message
        (Request.text_every_token) get it as they would have at their steps."""
        if not self.finished:
            self.add_text(self.detokenizer.flush())

    def take_delta(self, message: gateway_pb2.GenerateResponse) -> bool:
        """Adds the progress since the last call to `message`; False when there is none.

        Only the fields that hold something are set: a message per token per stream is made
        for every row of every step, and each keyword protobuf takes costs."""
        finishing = self.finished and not self.reported_finish
        if not (self.pending_text or self.pending_ids or finishing or self.pending_tool_calls):
            return False
        delta = message.outputs.add(token_ids=self.pending_ids)
        if self.index:
            delta.index = self.index
        if self.pending_text:
            delta.text = "".join(self.pending_text)
            self.pending_text = []
        if self.pending_logprobs:
            delta.logprobs.extend(self.pending_logprobs)
            self.pending_logprobs = []
        if self.pending_tool_calls:
            for call in self.pending_tool_calls:
                delta.tool_calls.add(index=call.index, id=call.id, name=call.name,
                                     arguments=call.arguments)
            self.pending_tool_calls = []
        if finishing:
            delta.finish_reason = self.finish_reason
            self.reported_finish = True
        self.pending_ids = []
        self.held_bytes = 0
        return True


class Request:
    """A request's sequences and stream."""

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingConfig,
                 max_len: int, eos_ids: frozenset[int], decode: DecodeFn,
                 cache_salt: str = "", public_id: str = "", final_only: bool = False,
                 stream: MessageSink | None = None, stream_interval: int = 1,
                 decode_batch: DecodeBatchFn | None = None,
                 output_format: CompiledFormat | None = None,
                 parses_tool_calls: bool = False, adapter: str = "") -> None:
        """`output_format`: structured output (each output gets a matcher of it);
        `parses_tool_calls`: tool calls are taken out of the outputs' text; `adapter`: the
        LoRA adapter it runs on ("": the base model), whose digest `cache_salt` holds."""
        self.request_id = request_id  # unique inside the gateway
        self.public_id = public_id or request_id  # what the client sees
        self.prompt_ids = prompt_ids
        self.params = params
        self.max_len = max_len  # longest prompt + output: max_model_len, or what the pool holds
        self.eos_ids = eos_ids
        self.cache_salt = cache_salt  # the effective salt (gateway/adapters.py)
        self.adapter = adapter
        self.final_only = final_only  # one message, at the end
        self.stream_interval = stream_interval  # tokens per message, at most (the last aside)
        # Whether each token's text is needed as it comes: stop strings are looked for in it,
        # and a final_only request's parts are sized by it. Otherwise a step decodes a row
        # only when its request sends a message (gateway/sampled.py): the tokens since the
        # last one wait in the detokenizer and are decoded together.
        self.text_every_token = final_only or any(params.stop)
        # Decodes many token windows at once (the runner loop's per-step pass).
        self.decode_batch: DecodeBatchFn = decode_batch or (
            lambda windows: [decode(window) for window in windows])
        self._sent_any = False
        self.sequences = self._make_sequences()
        self.output_format = output_format
        self.outputs = [
            OutputState(i, decode, prompt_ids, params.stop, output_format, parses_tool_calls)
            for i in range(params.n)
        ]
        self.cached_tokens = 0
        # What its runner was expected to hold of the prompt when it was placed there (Route):
        # the rest is the work it queues there (load reports, runner_loop.py).
        self.expected_cached_tokens = 0
        self.stream: MessageSink = stream if stream is not None else ThreadSink()
        self.closed = False

    def _make_sequences(self) -> list[Seq]:
        """n sequences; with n > 1 and a prompt of 2+ tokens, children fork from the first."""
        n = self.params.n
        max_num_tokens = min(len(self.prompt_ids) + self.params.max_tokens, self.max_len)
        seqs = [
            Seq(self.request_id, i, list(self.prompt_ids), len(self.prompt_ids),
                output_seed(self.params.seed, i), cache_salt=self.cache_salt,
                adapter=self.adapter, max_num_tokens=max_num_tokens)
            for i in range(n)
        ]
        if n > 1 and len(self.prompt_ids) >= 2:
            for child in seqs[1:]:
                child.status = SeqStatus.FORK_PENDING
            seqs[0].pending_children = seqs[1:]
        return seqs

    @property
    def initial_sequences(self) -> list[Seq]:
        """What the scheduler queues: the parent only when its children will fork from it."""
        if self.sequences[0].pending_children:
            return [self.sequences[0]]
        return list(self.sequences)

    @property
    def finished(self) -> bool:
        # A loop, not all() over a generator: asked for every row of every step.
        for output in self.outputs:  # noqa: SIM110
            if not output.finished:
                return False
        return True

    def add_token(self, seq: Seq, token_id: int, logprobs: TokenLogprobs | None) -> bool:
        """Appends a sampled token to `seq` and its output; True when the output ended."""
        if self.take_token(seq, token_id, logprobs):
            return True
        return self.take_text(seq, self.outputs[seq.index].detokenizer.add(()))

    def take_token(self, seq: Seq, token_id: int, logprobs: TokenLogprobs | None) -> bool:
        """The first half of add_token: the token without its text, which the caller
        decodes (with the step's other rows: detokenizer.new_texts) and gives to `take_text`
        unless this returns True (the output ended on a stop token)."""
        output = self.outputs[seq.index]
        seq.token_ids.append(token_id)
        position = None
        if logprobs is not None and self.params.logprobs is not None:
            position = _position_logprobs(token_id, logprobs)
        output.add_token(token_id, position)
        params = self.params
        if token_id in params.stop_token_ids or (
            not params.ignore_eos and token_id in self.eos_ids
        ):
            output.finish(STOP)  # the stop token stays out of the text
            return True
        output.detokenizer.extend((token_id,))
        return False

    def take_text(self, seq: Seq, text: str) -> bool:
        """The second half of add_token: the new token's text; True when the output ended."""
        output = self.outputs[seq.index]
        output.add_text(text)
        if output.stop_matcher.stopped:
            output.finish(STOP)
            return True
        return self.take_length(seq)

    def take_length(self, seq: Seq) -> bool:
        """Ends `seq`'s output when it has reached its length, or its format is complete
        (its text, decoded or waiting, is released); True when the output has ended."""
        output = self.outputs[seq.index]
        if output.matcher is not None and output.matcher.finished:
            output.finish(STOP)
        elif seq.num_output_tokens >= self.params.max_tokens or seq.num_tokens >= self.max_len:
            output.finish(LENGTH)
        return output.finished

    def abort_outputs(self) -> None:
        for output in self.outputs:
            output.finish(ABORT)

    def usage(self) -> gateway_pb2.Usage:
        return gateway_pb2.Usage(
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=sum(seq.num_output_tokens for seq in self.sequences),
            cached_tokens=self.cached_tokens,
        )

    def message_due(self) -> bool:
        """Whether `flush` would send a message now."""
        return not self.closed and (self.finished or self._message_due())

    def flush(self, outbox: Outbox | None = None, due: bool | None = None) -> None:
        """Puts one message with every output's progress on the stream when one is due (the
        last one with usage, then the end marker), through `outbox` when given.

        `due`: what `message_due` said before this step's text was decoded, which decided
        whose text was (a reader that caught up since waits for the next step, whose text
        is decoded then); None asks now."""
        if self.closed:
            return
        done = self.finished
        if not done and not (self._message_due() if due is None else due):
            return
        message = gateway_pb2.GenerateResponse(request_id=self.public_id)
        if not self._take_deltas(message) and not done:
            return
        if done:
            message.usage.CopyFrom(self.usage())
        self._put(message, outbox)
        self._sent_any = True
        if done:
            self.close(outbox)

    def _take_deltas(self, message: gateway_pb2.GenerateResponse) -> bool:
        """Adds every output's progress to `message`; False when none had any."""
        taken = False
        for output in self.outputs:
            taken = output.take_delta(message) or taken
        return taken

    def _message_due(self) -> bool:
        """Whether the progress so far goes out now (the request has not ended)."""
        if self.final_only:
            return sum(output.held_bytes for output in self.outputs) >= FINAL_ONLY_PART_BYTES
        if self.stream.unread >= MAX_UNREAD:
            return False  # the reader is behind: merge into a later message
        if not self._sent_any or self.stream_interval == 1:
            return True
        return (max(len(output.pending_ids) for output in self.outputs) >= self.stream_interval
                or any(output.finished and not output.reported_finish
                       for output in self.outputs))

    def fail(self, code_name: str, message: str) -> None:
        """Ends the stream with an error status."""
        if self.closed:
            return
        if not self.final_only:  # what coalescing held back still reaches the reader
            for output in self.outputs:
                output.catch_up()
            held = gateway_pb2.GenerateResponse(request_id=self.public_id)
            if self._take_deltas(held):
                self._put(held, None)
        self.abort_outputs()
        self._put(StreamError(code_name, message), None)
        self.close()

    def close(self, outbox: Outbox | None = None) -> None:
        self.closed = True
        self._put(None, outbox)

    def _put(self, item: gateway_pb2.GenerateResponse | StreamError | None,
             outbox: Outbox | None) -> None:
        if outbox is None:
            self.stream.put(item)
        else:
            outbox.put(self.stream, item)

    def messages(self) -> Iterator[gateway_pb2.GenerateResponse | StreamError]:
        """The stream, for a reader on its own thread: messages until the end marker."""
        assert isinstance(self.stream, ThreadSink), "messages() reads a ThreadSink"
        return self.stream.items()


def _position_logprobs(token_id: int, logprobs: TokenLogprobs) -> gateway_pb2.PositionLogprobs:
    return gateway_pb2.PositionLogprobs(
        token=gateway_pb2.TokenLogprob(token_id=token_id, logprob=logprobs.logprob),
        top=[
            gateway_pb2.TokenLogprob(token_id=t, logprob=lp)
            for t, lp in zip(logprobs.top_ids, logprobs.top_logprobs, strict=True)
        ],
    )
