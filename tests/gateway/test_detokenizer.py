"""Incremental detokenization with the default model's byte-level BPE tokenizer."""

from __future__ import annotations

import random

import pytest

from gateway.detokenizer import IncrementalDetokenizer, new_texts
from gateway.tokenizer import Tokenizer

TEXTS = [
    "Hello, world! This is a test.",
    "naïve café — déjà vu 😀🎉 emoji",
    "中文字符测试：你好，世界！",
    "Ελληνικά και русский текст",
    "  leading spaces\nand\ttabs  ",
    "🧑‍🤝‍🧑 family 👩🏽‍💻",
]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_never_breaks_a_character_and_equals_the_whole(
        tokenizer: Tokenizer, text: str) -> None:
    prompt = tokenizer.encode("Say something:")
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer.decode, prompt)
    pieces = [detok.add([token]) for token in ids]
    pieces.append(detok.flush())
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == tokenizer.decode(ids)


def test_the_cases_above_do_split_characters_across_tokens(tokenizer: Tokenizer) -> None:
    # Guards the test above: some token of these texts holds only part of a character.
    split = [t for text in TEXTS[1:] for t in tokenizer.encode(text)
             if "\ufffd" in tokenizer.decode([t])]
    assert split


def test_an_output_that_ends_inside_a_character_drops_the_partial_character(
        tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ok 😀")
    partial = next(i for i in range(1, len(ids) + 1)
                   if tokenizer.decode(ids[:i]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tokenizer.decode, [])
    text = "".join(detok.add([t]) for t in ids[:partial]) + detok.flush()
    assert text == tokenizer.decode(ids[:partial]).rstrip("\ufffd")
    assert "\ufffd" not in text


def test_special_tokens_are_left_out_of_the_text(tokenizer: Tokenizer) -> None:
    eos = tokenizer.eos_token_id
    assert eos is not None
    ids = [*tokenizer.encode("Done."), eos]
    detok = IncrementalDetokenizer(tokenizer.decode, [])
    text = "".join(detok.add([t]) for t in ids) + detok.flush()
    assert text == "Done."


def test_batched_decoding_streams_the_same_text_as_decoding_each_row(
        tokenizer: Tokenizer) -> None:
    """A runner loop decodes every row's windows of a step in one call (new_texts): each
    row's stream must be what its own detokenizer gives alone."""
    rows = [tokenizer.encode(text) for text in TEXTS]
    alone = [IncrementalDetokenizer(tokenizer.decode, []) for _ in rows]
    batched = [IncrementalDetokenizer(tokenizer.decode, []) for _ in rows]
    streamed_alone: list[list[str]] = [[] for _ in rows]
    streamed_batched: list[list[str]] = [[] for _ in rows]
    for step in range(max(len(ids) for ids in rows)):
        live = [i for i, ids in enumerate(rows) if step < len(ids)]
        for i in live:
            streamed_alone[i].append(alone[i].add([rows[i][step]]))
            batched[i].extend([rows[i][step]])
        texts = new_texts([batched[i] for i in live], tokenizer.decode_batch)
        for i, text in zip(live, texts, strict=True):
            streamed_batched[i].append(text)
    assert streamed_batched == streamed_alone
    assert any(piece == "" for pieces in streamed_batched for piece in pieces)  # split chars


def test_decode_equals_transformers_decode(tokenizer: Tokenizer) -> None:
    """Tokenizer.decode may skip transformers' Python layer: it must still decode as it does,
    special tokens and byte fragments included."""
    from transformers import AutoTokenizer

    oracle = AutoTokenizer.from_pretrained(str(tokenizer.folder))
    rng = random.Random(0)
    eos = tokenizer.eos_token_id
    samples = [[rng.randrange(tokenizer.size) for _ in range(rng.randint(0, 12))]
               for _ in range(300)]
    samples += [[eos, *tokenizer.encode(text), eos] for text in TEXTS]
    assert any(eos in ids for ids in samples)
    for ids in samples:
        assert tokenizer.decode(ids) == oracle.decode(ids, skip_special_tokens=True)
        assert tokenizer.decode(ids, skip_special_tokens=False) == oracle.decode(ids)
    assert tokenizer.decode_batch(samples) == [tokenizer.decode(ids) for ids in samples]
