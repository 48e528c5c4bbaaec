"""Incremental detokenization with the default model's byte-level BPE tokenizer."""

from __future__ import annotations

import pytest

from gateway.detokenizer import IncrementalDetokenizer
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
