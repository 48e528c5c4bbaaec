"""Incremental detokenization that never emits half a character.

As vLLM does it: decode a small window of recent tokens twice, once up to the last emitted
token (`prefix_offset .. read_offset`) and once with the new tokens (`prefix_offset .. end`);
the new text is the difference. While the new text ends in U+FFFD the window holds an
incomplete UTF-8 sequence (a character split across tokens), so nothing is emitted until the
next token completes it. Decoding a window, not the whole output, keeps each step O(1), and
starting the window a few tokens back keeps tokenizers that strip a leading space right.

A runner loop decodes the windows of every row of a step in one batched call (`new_texts`):
one call into the tokenizer per step instead of two per row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as context for the first output tokens (vLLM uses 5 as well).
PROMPT_CONTEXT_TOKENS = 5

DecodeFn = Callable[[Sequence[int]], str]
DecodeBatchFn = Callable[[list[list[int]]], list[str]]


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of complete text pieces."""

    def __init__(self, decode: DecodeFn, prompt_ids: Sequence[int]) -> None:
        self._decode = decode
        context = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)

    def add(self, new_ids: Sequence[int]) -> str:
        """Text completed by `new_ids` (empty while a character is still incomplete)."""
        self.extend(new_ids)
        prefix, full = self.windows()
        return self.advance(self._decode(prefix), self._decode(full))

    def extend(self, new_ids: Sequence[int]) -> None:
        self._ids.extend(new_ids)

    def windows(self) -> tuple[list[int], list[int]]:
        """The two windows to decode for the text of the tokens extended since the last
        `advance`: up to the last emitted token, and up to the newest."""
        return (self._ids[self._prefix_offset:self._read_offset],
                self._ids[self._prefix_offset:])

    def advance(self, prefix_text: str, full_text: str) -> str:
        """The new text, given the decoded `windows()`."""
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text):]

    def flush(self) -> str:
        """Whatever complete text is still held at the end; a dangling partial character is
        dropped rather than emitted as U+FFFD."""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset:])
        self._prefix_offset = self._read_offset = len(self._ids)
        if len(full_text) <= len(prefix_text):
            return ""
        return full_text[len(prefix_text):].rstrip(REPLACEMENT_CHAR)


def new_texts(detokenizers: Sequence[IncrementalDetokenizer],
              decode_batch: DecodeBatchFn) -> list[str]:
    """Each detokenizer's text for the tokens extended since its last `advance`, with every
    window decoded in one `decode_batch` call."""
    windows: list[list[int]] = []
    for detokenizer in detokenizers:
        windows.extend(detokenizer.windows())
    texts = decode_batch(windows)
    return [detokenizer.advance(texts[2 * i], texts[2 * i + 1])
            for i, detokenizer in enumerate(detokenizers)]
