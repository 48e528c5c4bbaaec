"""A step's samples through gateway/sampled.py with the default model's tokenizer: text that
waits for its request's message decodes to exactly what token-by-token decoding streams, and
to Hugging Face's decode of the whole output (the outside oracle) where that is clean text."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from gateway.request import Request
from gateway.sampled import SampledRow, take_sampled
from gateway.sequence import SamplingConfig
from gateway.tokenizer import Tokenizer, load_tokenizer

WORDS = ["déjà", "vu", "naïve", "café", "über", "straße", "日本語", "テキスト", "emoji 🙂", "🚀🚀",
         "ok", "the", "of", "Ünïcödé", "ça", "va", "\n", "  ", "tab\t", "x"]


class Reader:
    def __init__(self, rng: random.Random, take_every: float) -> None:
        self.items: list[object] = []
        self.taken = 0
        self.rng = rng
        self.take_every = take_every

    @property
    def unread(self) -> int:
        return len(self.items) - self.taken

    def put(self, item: object) -> None:
        self.items.append(item)

    def step(self) -> None:
        if self.rng.random() < self.take_every:
            self.taken = len(self.items)

    def text(self) -> str:
        return "".join(out.text for item in self.items if item is not None
                       for out in item.outputs)  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(None)


def stream(tokenizer: Tokenizer, prompt: list[int], tokens: list[int], interval: int,
           take_every: float, as_steps: bool, rng: random.Random) -> tuple[str, Request]:
    reader = Reader(rng, take_every)
    request = Request("r", prompt, SamplingConfig(max_tokens=len(tokens), ignore_eos=True),
                      max_len=1 << 20, eos_ids=frozenset(), decode=tokenizer.decode,
                      decode_batch=tokenizer.decode_batch, stream=reader,
                      stream_interval=interval)
    seq = request.sequences[0]
    for token in tokens:
        if as_steps:
            request.flush(due=take_sampled([SampledRow(request, seq, token)]).due[request])
        else:
            request.add_token(seq, token, None)
            request.flush()
        reader.step()
    assert request.closed
    return reader.text(), request


def test_waiting_text_equals_token_by_token_text_and_the_whole_decode(
        tokenizer: Tokenizer) -> None:
    oracle = AutoTokenizer.from_pretrained(str(tokenizer.folder))
    rng = random.Random(7)
    prompt = tokenizer.encode("Say something:")
    waited = 0
    for case in range(60):
        clean = case % 2 == 0  # encoded text, else random ids (partial characters included)
        if clean:
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30)))
            tokens = tokenizer.encode(text)
        else:
            tokens = [rng.randrange(tokenizer.size) for _ in range(rng.randint(3, 60))]
        interval, take_every = rng.choice((2, 4, 8, 16)), rng.choice((0.3, 1.0))
        by_token, _ = stream(tokenizer, prompt, tokens, 1, 1.0, False, rng)
        by_step, request = stream(tokenizer, prompt, tokens, interval, take_every, True, rng)
        assert by_step == by_token, f"case {case}"
        if clean:
            assert by_step == text == oracle.decode(tokens, skip_special_tokens=True), case
        waited += not request.text_every_token and len(tokens) > interval
    assert waited >= 40, waited  # the inputs reached the waiting path
