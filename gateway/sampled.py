"""A step's sampled tokens into their requests: token, stop, length, text, message due.

The runner loop calls `take_sampled` once per step with every row the runner sampled. The
text of a row is decoded in one batched pass over the step's rows (detokenizer.new_texts),
and only where it is needed now: its request looks for stop strings or sizes final_only parts
by it (Request.text_every_token), or sends a message this step. Otherwise the token waits in
its detokenizer and is decoded with the next ones when a message is due, so a stream with
stream_interval N decodes about once per N tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.detokenizer import new_texts
from gateway.request import Request, TokenLogprobs
from gateway.sequence import Sequence


@dataclass(slots=True)
class SampledRow:
    """One sequence's sampled token, as the runner answered it."""

    request: Request
    seq: Sequence
    token_id: int
    logprobs: TokenLogprobs | None = None


@dataclass
class TakenStep:
    """What a step's samples did: outputs that ended, and each request's message decision."""

    ended: list[Sequence] = field(default_factory=list)  # for the scheduler to finish
    # Per request touched, whether its message is due: decided before the step's text was
    # decoded, which it decided, and kept for Request.flush (a reader that caught up since
    # gets the next step's message).
    due: dict[Request, bool] = field(default_factory=dict)


def take_sampled(rows: list[SampledRow]) -> TakenStep:
    """Feeds each row's token to its request (in order; every row's request is open)."""
    taken = TakenStep()
    decoding: list[tuple[Request, Sequence]] = []  # rows whose text is decoded this step
    waiting: list[tuple[Request, Sequence]] = []  # rows whose text may wait
    for row in rows:
        request, seq = row.request, row.seq
        taken.due[request] = False
        if request.take_token(seq, row.token_id, row.logprobs):
            taken.ended.append(seq)  # a stop token
        elif request.text_every_token:
            decoding.append((request, seq))
        elif request.take_length(seq):
            taken.ended.append(seq)  # its output released its text
        else:
            waiting.append((request, seq))
    for request in taken.due:
        taken.due[request] = request.message_due()
    decoding += [row for row in waiting if taken.due[row[0]]]
    for (request, seq), text in zip(decoding, _decode_rows(decoding), strict=True):
        if request.take_text(seq, text):
            taken.ended.append(seq)
    return taken


def _decode_rows(rows: list[tuple[Request, Sequence]]) -> list[str]:
    """Each row's new text: one batched decode per tokenizer (all requests share one)."""
    texts: list[str] = [""] * len(rows)
    by_decoder: dict[Any, list[int]] = {}
    for index, (request, _) in enumerate(rows):
        by_decoder.setdefault(request.decode_batch, []).append(index)
    for decode_batch, indices in by_decoder.items():
        detokenizers = [rows[i][0].outputs[rows[i][1].index].detokenizer for i in indices]
        for i, text in zip(indices, new_texts(detokenizers, decode_batch), strict=True):
            texts[i] = text
    return texts
