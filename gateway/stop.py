"""Stop strings, found even when they span several tokens.

Text is fed in as the detokenizer produces it. Text that could be the start of a stop string
is held back until the next text decides it, so neither a stop string nor anything after it
is ever streamed.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Accumulates output text and releases the part that is safe to stream."""

    def __init__(self, stop: Sequence[str]) -> None:
        self._stop = [s for s in stop if s]
        self._longest = max((len(s) for s in self._stop), default=0)
        # The text not yet released, and before it as much released text as a match starting
        # in it needs (up to a stop string, once found).
        self._text = ""
        self._released = 0  # characters of _text already released
        self.stopped = False

    def add(self, text: str) -> str:
        """Adds new text; returns what can be streamed now. Sets `stopped` on a match."""
        if self.stopped or not text:
            return ""
        if not self._stop:  # nothing to hold back, nothing to keep: every row of every step
            return text
        # A match may start up to longest-1 characters before the new text.
        search_from = max(0, len(self._text) - self._longest + 1)
        self._text += text
        match = self._first_match(search_from)
        if match is not None:
            self.stopped = True
            self._text = self._text[:match]
            return self._release(match)
        piece = self._release(len(self._text) - self._partial_match_len())
        self._forget_settled()
        return piece

    def _forget_settled(self) -> None:
        """Drops text that is released and too far back to begin a match: what is kept stays
        about as long as the longest stop string, not the whole output."""
        cut = min(self._released, len(self._text) - self._longest + 1)
        if cut > 0:
            self._text = self._text[cut:]
            self._released -= cut

    def flush(self) -> str:
        """The held-back text, at the end of generation (no stop string came)."""
        return self._release(len(self._text))

    def _first_match(self, search_from: int) -> int | None:
        positions = [self._text.find(s, search_from) for s in self._stop]
        found = [p for p in positions if p >= 0]
        return min(found) if found else None

    def _partial_match_len(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        tail = self._text[-self._longest:] if self._longest else ""
        for length in range(min(len(tail), self._longest - 1), 0, -1):
            suffix = tail[-length:]
            if any(s.startswith(suffix) for s in self._stop):
                return length
        return 0

    def _release(self, end: int) -> str:
        end = max(end, self._released)
        piece = self._text[self._released:end]
        self._released = end
        return piece
