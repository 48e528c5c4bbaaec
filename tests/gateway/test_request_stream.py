"""What a Request puts on its stream, streamed and final_only: the same outputs either way, in
one message for final_only (or in parts when they are large), on every way a request ends."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from gateway import request as request_module
from gateway.delivery import StreamError
from gateway.request import Request, TokenLogprobs
from gateway.sequence import SamplingConfig
from protos import gateway_pb2

PROMPT = [1, 2, 3]


def decode(ids: Sequence[int]) -> str:
    """One letter per token id."""
    return "".join(chr(ord("a") + i % 26) for i in ids)


class Reader:
    """A request's stream as a list; the test says when the reader takes what is there."""

    def __init__(self) -> None:
        self.items: list[gateway_pb2.GenerateResponse | StreamError | None] = []
        self.taken = 0

    @property
    def unread(self) -> int:
        return len(self.items) - self.taken

    def put(self, item: gateway_pb2.GenerateResponse | StreamError | None) -> None:
        self.items.append(item)

    def take_all(self) -> None:
        self.taken = len(self.items)


def make_request(final_only: bool, stream_interval: int = 1, **params: object) -> Request:
    config = SamplingConfig(**{"max_tokens": 50, **params})  # type: ignore[arg-type]
    return Request("r", list(PROMPT), config, max_len=1000, eos_ids=frozenset(),
                   decode=decode, final_only=final_only, stream=Reader(),
                   stream_interval=stream_interval)


def run_steps(request: Request, steps: list[list[int | None]],
              logprobs: TokenLogprobs | None = None) -> None:
    """Step k adds steps[k][i] to output i (None: nothing for that output), then flushes; the
    reader keeps up."""
    for tokens in steps:
        for seq, token in zip(request.sequences, tokens, strict=True):
            if token is not None and not request.outputs[seq.index].finished:
                request.add_token(seq, token, logprobs)
        request.flush()
        request.stream.take_all()


def drain(request: Request) -> list[gateway_pb2.GenerateResponse | StreamError]:
    """What the stream carried, up to its end marker (which must be there)."""
    items = request.stream.items
    assert items[-1] is None and None not in items[:-1]
    return items[:-1]


def assembled(messages: list[gateway_pb2.GenerateResponse | StreamError]) -> dict[int, tuple]:
    """Per output: (text, token ids, logprob token ids, finish reason)."""
    outputs: dict[int, tuple] = {}
    for message in messages:
        assert isinstance(message, gateway_pb2.GenerateResponse)
        for out in message.outputs:
            text, ids, lps, reason = outputs.get(out.index, ("", [], [], 0))
            outputs[out.index] = (text + out.text, ids + list(out.token_ids),
                                  lps + [p.token.token_id for p in out.logprobs],
                                  out.finish_reason or reason)
    return outputs


def both_ways(steps: list[list[int | None]], **params: object
              ) -> tuple[list[gateway_pb2.GenerateResponse | StreamError],
                         list[gateway_pb2.GenerateResponse | StreamError]]:
    results = []
    for final_only in (False, True):
        request = make_request(final_only, **params)
        run_steps(request, steps, TokenLogprobs(-0.5, [7], [-0.5]))
        results.append(drain(request))
    return results[0], results[1]


def test_final_only_is_one_message_with_what_the_stream_carried() -> None:
    streamed, final = both_ways([[3], [4], [5], [6]], max_tokens=4, logprobs=1)
    assert len(streamed) == 4 and len(final) == 1
    assert assembled(final) == assembled(streamed) == {
        0: ("defg", [3, 4, 5, 6], [3, 4, 5, 6], gateway_pb2.FINISH_REASON_LENGTH)}
    assert final[0].usage == streamed[-1].usage
    assert final[0].usage.completion_tokens == 4


def test_final_only_cuts_a_stop_string_as_the_stream_does() -> None:
    steps: list[list[int | None]] = [[7], [4], [11], [11], [14], [0]]  # h e l l o a
    streamed, final = both_ways(steps, stop=("llo",))
    assert len(final) == 1
    assert assembled(final) == assembled(streamed)
    assert assembled(final)[0][0] == "he"
    assert assembled(final)[0][3] == gateway_pb2.FINISH_REASON_STOP


def test_outputs_that_end_at_different_steps_come_together_at_the_end() -> None:
    steps: list[list[int | None]] = [[1, 1], [2, 9], [3, None], [4, None]]
    streamed, final = both_ways(steps, n=2, max_tokens=4, stop_token_ids=frozenset({9}))
    assert len(final) == 1 and final[0].HasField("usage")
    assert assembled(final) == assembled(streamed)
    reasons = {index: out[3] for index, out in assembled(final).items()}
    assert reasons == {0: gateway_pb2.FINISH_REASON_LENGTH, 1: gateway_pb2.FINISH_REASON_STOP}


def test_an_aborted_final_only_request_sends_what_it_made() -> None:
    request = make_request(True)
    run_steps(request, [[5], [6]])
    assert request.stream.items == []
    request.abort_outputs()
    request.flush()
    (message,) = drain(request)
    assert isinstance(message, gateway_pb2.GenerateResponse)
    assert list(message.outputs[0].token_ids) == [5, 6]
    assert message.outputs[0].finish_reason == gateway_pb2.FINISH_REASON_ABORT
    assert message.usage.completion_tokens == 2


def test_a_failed_final_only_request_ends_with_the_status_alone() -> None:
    request = make_request(True)
    run_steps(request, [[5], [6]])
    request.fail("UNAVAILABLE", "the runner is gone")
    assert drain(request) == [StreamError("UNAVAILABLE", "the runner is gone")]


def test_a_large_final_only_completion_comes_in_parts_under_the_limit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(request_module, "FINAL_ONLY_PART_BYTES", 400)
    steps: list[list[int | None]] = [[i % 26] for i in range(50)]
    streamed, final = both_ways(steps, max_tokens=50, logprobs=1)
    assert 1 < len(final) < len(streamed)
    assert assembled(final) == assembled(streamed)
    assert final[-1].HasField("usage")
    for message in final:
        assert isinstance(message, gateway_pb2.GenerateResponse)
        assert message.ByteSize() <= 400
