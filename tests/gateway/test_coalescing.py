"""Coalescing (stream_interval, and a reader that falls behind) never drops, repeats or
reorders a token, a piece of text, a logprob or a finish reason.

Each case runs the same random token stream twice through a Request: once as the reference
(stream_interval 1, a reader that takes every message at once, each token's text decoded as
it comes) and once coalesced (a random interval, a reader that takes what is there only at
random steps, sometimes never until the end), fed as the runner loop feeds a step
(gateway/sampled.py: a token's text waits until its request sends a message). What the reader
assembles must be the same; the coalesced stream must stay bounded.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.delivery import StreamError
from gateway.request import MAX_UNREAD, Request, TokenLogprobs
from gateway.sampled import SampledRow, take_sampled
from gateway.sequence import SamplingConfig
from protos import gateway_pb2

CASES = 600
LETTERS = "abcdefghijkl"
# Small, so stop strings and stop tokens occur; the last two tokens are the two bytes of "é",
# so a character split across tokens (and a lone byte of one) is decoded too.
TOKEN_BYTES = [letter.encode() for letter in LETTERS] + [b"\xc3", b"\xa9"]
VOCAB = len(TOKEN_BYTES)
EOS = len(LETTERS) - 1


def decode(ids: Sequence[int]) -> str:
    return b"".join(TOKEN_BYTES[i] for i in ids).decode(errors="replace")


class Reader:
    """A stream whose reader takes what is there when the test says so."""

    def __init__(self) -> None:
        self.items: list[gateway_pb2.GenerateResponse | StreamError | None] = []
        self.taken = 0
        self.most_unread = 0

    @property
    def unread(self) -> int:
        return len(self.items) - self.taken

    def put(self, item: gateway_pb2.GenerateResponse | StreamError | None) -> None:
        self.items.append(item)
        self.most_unread = max(self.most_unread, self.unread)

    def take_all(self) -> None:
        self.taken = len(self.items)


@dataclass
class Case:
    n: int
    max_tokens: int
    stop: tuple[str, ...]
    stop_token_ids: frozenset[int]
    logprobs: int | None
    steps: list[list[int]]  # per step, a token for each output
    end: str  # after the steps: "abort" or "fail" what is left


def random_case(rng: random.Random) -> Case:
    n = rng.choice((1, 1, 2, 3))
    max_tokens = rng.randint(1, 40)
    stop = tuple("".join(rng.choice(LETTERS) for _ in range(rng.randint(1, 3)))
                 for _ in range(rng.choice((0, 0, 1, 2))))
    return Case(
        n=n, max_tokens=max_tokens, stop=stop,
        stop_token_ids=frozenset(rng.sample(range(VOCAB), rng.choice((0, 0, 1)))),
        logprobs=rng.choice((None, 0, 2)),
        # Often fewer steps than max_tokens: the request is cut short.
        steps=[[rng.randrange(VOCAB) for _ in range(n)]
               for _ in range(rng.randint(1, max_tokens + 3))],
        end=rng.choice(("abort", "fail")))


def run(case: Case, stream_interval: int, take_every: float, rng: random.Random,
        as_steps: bool) -> tuple[Reader, Request]:
    """The case through a Request, token by token (add_token) or as the runner loop's steps
    (take_sampled); after each step the reader takes what is there with probability
    `take_every`."""
    reader = Reader()
    params = SamplingConfig(max_tokens=case.max_tokens, n=case.n, stop=case.stop,
                            stop_token_ids=case.stop_token_ids, logprobs=case.logprobs)
    request = Request("r", [1, 2], params, max_len=1000, eos_ids=frozenset({EOS}),
                      decode=decode, stream=reader, stream_interval=stream_interval)
    for tokens in case.steps:
        if request.finished:
            break
        rows = [SampledRow(request, seq, token, TokenLogprobs(-token / 10, [token], [-0.1]))
                for seq, token in zip(request.sequences, tokens, strict=True)
                if not request.outputs[seq.index].finished]
        if as_steps:
            request.flush(due=take_sampled(rows).due[request])
        else:
            for row in rows:
                request.add_token(row.seq, row.token_id, row.logprobs)
            request.flush()
        if rng.random() < take_every:
            reader.take_all()
    if not request.closed:
        if case.end == "fail":
            request.fail("UNAVAILABLE", "gone")
        else:
            request.abort_outputs()
            request.flush()
    return reader, request


def assembled(reader: Reader) -> tuple[dict[int, tuple], list[str]]:
    """Per output (text, token ids, logprob ids and values, finish reasons seen), and the
    kinds of the stream's items in order (message, usage, error, end)."""
    outputs: dict[int, tuple[str, list[int], list[tuple[int, float]], list[int]]] = {}
    kinds = []
    for item in reader.items:
        if item is None:
            kinds.append("end")
        elif isinstance(item, StreamError):
            kinds.append("error")
        else:
            kinds.append("usage" if item.HasField("usage") else "message")
            for out in item.outputs:
                text, ids, lps, reasons = outputs.setdefault(out.index, ("", [], [], []))
                lps.extend((p.token.token_id, round(p.token.logprob, 5),
                            [t.token_id for t in p.top]) for p in out.logprobs)
                ids.extend(out.token_ids)
                if out.finish_reason:
                    reasons.append(out.finish_reason)
                outputs[out.index] = (text + out.text, ids, lps, reasons)
    return outputs, kinds


def test_coalesced_streams_carry_exactly_what_uncoalesced_ones_do() -> None:
    coalesced_cases = held_back_cases = stopped_cases = failed_cases = text_waited = 0
    split_characters = 0
    for seed in range(CASES):
        rng = random.Random(seed)
        case = random_case(rng)
        interval = rng.choice((1, 2, 3, 8, 16))
        take_every = rng.choice((0.0, 0.2, 0.5, 1.0))
        reference, ref_request = run(case, 1, 1.0, random.Random(0), as_steps=False)
        reader, request = run(case, interval, take_every, rng, as_steps=True)
        expected, expected_kinds = assembled(reference)
        got, kinds = assembled(reader)
        assert got == expected, f"seed {seed}"
        assert request.usage() == ref_request.usage()
        # The end comes once, last, after the usage (or after an error).
        assert kinds[-1] == "end" and kinds.count("end") == 1, f"seed {seed}"
        assert kinds[-2] == expected_kinds[-2] and kinds[-2] in ("usage", "error")
        assert kinds.count("usage") <= 1
        for index, (_, _, _, reasons) in got.items():
            assert len(reasons) <= 1, f"seed {seed}: output {index} finished twice"
        # Bounded: the reader never has more than MAX_UNREAD messages waiting, plus the
        # last message, an error and the end marker.
        assert reader.most_unread <= MAX_UNREAD + 3, f"seed {seed}"
        coalesced = len(reader.items) < len(reference.items)
        coalesced_cases += coalesced
        # A step without a message left its tokens' text undecoded, to be decoded later.
        text_waited += coalesced and not request.text_every_token
        split_characters += any(token >= len(LETTERS) for _, ids, *_ in got.values()
                                for token in ids)
        held_back_cases += take_every < 1.0 and reader.most_unread >= MAX_UNREAD
        stopped_cases += any(gateway_pb2.FINISH_REASON_STOP in reasons
                             for *_, reasons in got.values())
        failed_cases += "error" in kinds
    # The inputs reached what they test: coalescing by interval and by a slow reader, text
    # that waited for a message, bytes of a character split across tokens, stop strings and
    # tokens, failures.
    assert coalesced_cases > CASES // 3, coalesced_cases
    assert text_waited > CASES // 10, text_waited
    assert split_characters > CASES // 10, split_characters
    assert held_back_cases > CASES // 10, held_back_cases
    assert stopped_cases > CASES // 10, stopped_cases
    assert failed_cases > CASES // 10, failed_cases


def test_an_interval_sends_the_first_tokens_at_once_then_every_interval() -> None:
    reader = Reader()
    request = Request("r", [1, 2], SamplingConfig(max_tokens=10), max_len=100,
                      eos_ids=frozenset(), decode=decode, stream=reader, stream_interval=4)
    for token in range(10):
        request.add_token(request.sequences[0], token % VOCAB, None)
        request.flush()
        reader.take_all()
    sizes = [len(item.outputs[0].token_ids) for item in reader.items if item is not None]
    assert sizes == [1, 4, 4, 1]  # the first at once, then by 4, the last when it ends
