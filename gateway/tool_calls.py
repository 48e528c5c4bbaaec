"""Tool calls parsed out of a model's output text as it streams (the Hermes format).

The model writes each call as `<tool_call>`, a JSON object `{"name": ..., "arguments": {...}}`,
then `</tool_call>`, whitespace around the object optional, several calls in a row allowed
(gateway/tools.py describes the format to the model and forces it with a grammar). The
parser splits the text into the content to stream and the calls, as deltas: a call's first
delta once its name is known (index, id, name), then its arguments' JSON text in fragments
as it arrives.

Everything it decides depends only on the text seen, never on how it was cut into pieces:
any split of a text gives the same content and the same calls as the whole text at once.

How it treats what is not a well-formed call (chosen so that nothing sent ever has to be
taken back):
- A `<tool_call>` whose object breaks before its name is known (not JSON, not an object, a
  name that is no non-empty string, an object that ends without a name, or the output ends
  first) is content, as written; the text after the tag is read again as usual.
- Once the name is known the call is out: an error later ends it with the arguments sent so
  far, and everything up to the next `</tool_call>` or `<tool_call>` is dropped. An object
  that ends without arguments has arguments `{}`. An output that ends inside a call leaves
  it with the arguments sent so far (its finish reason says it was cut).
- `"parameters"` is taken for `"arguments"` (some models write that); the first of them
  counts, and the first name, other keys are skipped. Arguments written as a JSON string
  are that string's text when it is JSON text itself, else the string as written.
- The arguments are JSON text exactly as the model wrote it, strictly JSON (a raw control
  character in a string is an error), without the whitespace around it.
- Whitespace next to calls is no content: at the start of the output before a call, between
  calls, and after the last call at the end. Content with other characters is kept whole.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
NAME_KEY = "name"
ARGUMENT_KEYS = ("arguments", "parameters")

_JSON_WHITESPACE = " \t\n\r"
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_LITERALS = ("true", "false", "null")
_SIMPLE_ESCAPES = frozenset('"\\/bfnrt')
_HEX = frozenset("0123456789abcdefABCDEF")
# A run of string characters that need no attention (no quote, backslash or control char).
_PLAIN_RUN = re.compile(r'[^"\\\x00-\x1f]*')


def make_call_id() -> str:
    """A call id as OpenAI writes them: `call_` and 24 hex digits."""
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolCallDelta:
    """Progress of one call: its first delta has the id and name; arguments come in pieces."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


class _Event(Enum):
    MEMBER = "member"  # a member of the object was read (its value's span)
    CLOSED = "closed"  # the object ended
    ERROR = "error"  # the text is not JSON (at `at`)


@dataclass
class _Found:
    event: _Event
    at: int  # where it happened (end of the member or object; the offending character)
    key: str = ""  # MEMBER: its key
    start: int = 0  # MEMBER: where its value starts


@dataclass
class _ObjectScanner:
    """Checks one JSON object a character at a time and reports its top-level members.

    Positions are absolute offsets into the parser's text. `safe` is how far the text is
    made of whole, checked pieces (not inside a number, a literal or an escape), so a
    prefix up to there can be passed on.
    """

    pos: int
    safe: int = 0
    stack: list[str] = field(default_factory=list)
    expect: str = "object"  # object, key, key_or_end, colon, value, value_or_end, comma_or_end
    token: str = ""  # the token being read: "", "string", "number", "literal"
    token_start: int = 0
    is_key: bool = False
    escape: int = -1  # -1: none; 0: after a backslash; 1-4: hex digits of \u read
    key: str = ""  # the current top-level member's key
    member_start: int = -1  # where the current top-level member's value starts; -1: none

    def advance(self, text: str, base: int) -> _Found | None:
        """Reads on until something is found or the text runs out (None); text[0] is at
        `base`."""
        end = base + len(text)
        while self.pos < end:
            found = self._step(text, base)
            if found is not None:
                return found
        return None

    def _step(self, text: str, base: int) -> _Found | None:
        i = self.pos - base
        char = text[i]
        if self.token == "string":
            return self._string_step(text, base)
        if self.token:  # a number or literal ends at the first character not its own
            own = char in _NUMBER_CHARS if self.token == "number" else "a" <= char <= "z"
            if own:
                self.pos += 1
                return None
            word = text[self.token_start - base:i]
            valid = (_NUMBER.fullmatch(word) if self.token == "number"
                     else word in _LITERALS)
            if not valid:
                return _Found(_Event.ERROR, self.token_start)
            self.token = ""
            return self._value_done(self.pos)  # the character is read next
        if char in _JSON_WHITESPACE:
            self.pos += 1
            self.safe = self.pos
            return None
        return self._structure(char)

    def _structure(self, char: str) -> _Found | None:
        at = self.pos
        expect = self.expect
        if expect == "object":
            if char != "{":
                return _Found(_Event.ERROR, at)
            self._open("{")
        elif expect in ("key", "key_or_end"):
            if char == '"':
                self._start_token("string", is_key=True)
            elif char == "}" and expect == "key_or_end":
                return self._close()
            else:
                return _Found(_Event.ERROR, at)
        elif expect == "colon":
            if char != ":":
                return _Found(_Event.ERROR, at)
            self.expect = "value"
        elif expect in ("value", "value_or_end"):
            if char == "]" and expect == "value_or_end":
                return self._close()
            if len(self.stack) == 1:
                self.member_start = at
            if char in "{[":
                self._open(char)
            elif char == '"':
                self._start_token("string", is_key=False)
            elif char in "-0123456789":
                self._start_token("number")
            elif "a" <= char <= "z":
                self._start_token("literal")
            else:
                return _Found(_Event.ERROR, at)
        else:  # comma_or_end
            closer = "}" if self.stack[-1] == "{" else "]"
            if char == ",":
                self.expect = "key" if closer == "}" else "value"
            elif char == closer:
                return self._close()
            else:
                return _Found(_Event.ERROR, at)
        self.pos += 1
        if not self.token:
            self.safe = self.pos
        return None

    def _open(self, bracket: str) -> None:
        self.stack.append(bracket)
        self.expect = "key_or_end" if bracket == "{" else "value_or_end"

    def _close(self) -> _Found | None:
        self.stack.pop()
        self.pos += 1
        self.safe = self.pos
        if not self.stack:
            return _Found(_Event.CLOSED, self.pos)
        return self._value_done(self.pos)

    def _start_token(self, kind: str, is_key: bool = False) -> None:
        self.token = kind
        self.token_start = self.pos
        self.is_key = is_key

    def _string_step(self, text: str, base: int) -> _Found | None:
        i = self.pos - base
        char = text[i]
        if self.escape == 0:
            if char == "u":
                self.escape = 1
            elif char in _SIMPLE_ESCAPES:
                self.escape = -1
            else:
                return _Found(_Event.ERROR, self.pos)
        elif self.escape > 0:
            if char not in _HEX:
                return _Found(_Event.ERROR, self.pos)
            self.escape = -1 if self.escape == 4 else self.escape + 1
        elif char == "\\":
            self.escape = 0
        elif char == '"':
            self.pos += 1
            self.token = ""
            if self.is_key:
                self.safe = self.pos
                self.expect = "colon"
                if len(self.stack) == 1:
                    self.key = _string_value(text[self.token_start - base:i + 1]) or ""
                return None
            return self._value_done(self.pos)
        elif char < " ":
            return _Found(_Event.ERROR, self.pos)
        else:  # plain characters: the whole run at once
            run = _PLAIN_RUN.match(text, i)
            self.pos = self.safe = base + (run.end() if run else i + 1)
            return None
        self.pos += 1
        if self.escape < 0:
            self.safe = self.pos
        return None

    def _value_done(self, end: int) -> _Found | None:
        self.expect = "comma_or_end"
        self.safe = end
        if len(self.stack) == 1:  # a top-level member's value
            start, self.member_start = self.member_start, -1
            return _Found(_Event.MEMBER, end, self.key, start)
        return None


def _string_value(raw: str) -> str | None:
    """The text of a JSON string literal; None when it holds a lone surrogate (no text)."""
    value = json.loads(raw)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return None
    return str(value)


@dataclass
class _Call:
    """The call being read."""

    start: int  # where its text (held whitespace before the tag included) starts
    body: int  # just after the opening tag
    scanner: _ObjectScanner
    index: int = -1  # once its name is known: its index among the output's calls
    args_start: int = -1  # where its arguments' value starts; -1: not yet known
    args_end: int = -1  # where it ends; -1: not yet
    args_sent: int = -1  # up to where its arguments were passed on
    args_first: str = ""  # the first character of their value (its JSON type)

    @property
    def named(self) -> bool:
        return self.index >= 0


class _Mode(Enum):
    CONTENT = "content"
    CALL = "call"
    SKIP = "skip"  # after a call: dropped up to the next tag


class ToolCallParser:
    """Splits an output's text into content and tool calls, as the text arrives."""

    def __init__(self, make_id: Callable[[], str]) -> None:
        """`make_id`: a new call id (e.g. make_call_id)."""
        self._make_id = make_id
        self._text = ""  # the text not yet settled; self._text[0] is at offset self._base
        self._base = 0
        self._pos = 0  # where reading goes on
        self._mode = _Mode.CONTENT
        self._held = 0  # content from here on is not passed on yet
        self._segment_has_text = False  # content since the last call has non-whitespace
        self._after_call = False  # the current content follows a call
        self._call: _Call | None = None
        self._num_calls = 0
        self._content: list[str] = []
        self._deltas: dict[int, ToolCallDelta] = {}

    @property
    def num_calls(self) -> int:
        """The calls found so far (each has had its first delta)."""
        return self._num_calls

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Adds output text; returns the content to pass on now and the calls' deltas."""
        self._text += text
        self._run(final=False)
        return self._take()

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """The output ended: releases what was held back."""
        self._run(final=True)
        return self._take()

    def _take(self) -> tuple[str, list[ToolCallDelta]]:
        content = "".join(self._content)
        deltas = list(self._deltas.values())
        self._content.clear()
        self._deltas.clear()
        self._forget_settled()
        return content, deltas

    def _run(self, final: bool) -> None:
        step = {_Mode.CONTENT: self._read_content, _Mode.CALL: self._read_call,
                _Mode.SKIP: self._skip}
        while step[self._mode](final):
            pass

    @property
    def _end(self) -> int:
        return self._base + len(self._text)

    def _slice(self, start: int, end: int) -> str:
        return self._text[start - self._base:end - self._base]

    # ----- content ----------------------------------------------------------------------

    def _read_content(self, final: bool) -> bool:
        """Passes content on up to a call's tag (True: a call begins) or what may begin one."""
        tag = self._text.find(OPEN, self._pos - self._base)
        if tag >= 0:
            tag += self._base
            before = self._slice(self._held, tag)
            if self._segment_has_text or before.strip():
                self._release(tag)
            # Whitespace alone before the tag stays held: dropped if a call follows, content
            # if the tag turns out to begin none.
            self._begin_call(self._held, tag + len(OPEN))
            return True
        hold = 0 if final else _partial_tag(self._text, OPEN)
        self._pos = self._end - hold
        piece = self._slice(self._held, self._pos)
        if self._segment_has_text or piece.strip():
            self._release(self._pos)
        elif final:
            if not self._after_call:  # whitespace alone, and no call to be next to
                self._release(self._pos)
            self._held = self._pos
        return False

    def _release(self, end: int) -> None:
        piece = self._slice(self._held, end)
        if piece:
            self._content.append(piece)
            self._segment_has_text = self._segment_has_text or bool(piece.strip())
        self._held = end

    # ----- a call -----------------------------------------------------------------------

    def _begin_call(self, start: int, body: int) -> None:
        self._mode = _Mode.CALL
        self._call = _Call(start, body, _ObjectScanner(pos=body, safe=body))
        self._pos = body

    def _read_call(self, final: bool) -> bool:
        call = self._call
        assert call is not None
        while True:
            found = call.scanner.advance(self._text, self._base)
            if found is None:
                if not final:
                    self._send_arguments(call)
                    return False
                if not call.named:
                    self._not_a_call(call)
                    return True
                self._mode = _Mode.SKIP  # cut short: what was sent stays
                self._pos = self._end
                return False
            if found.event is _Event.MEMBER:
                if not self._member(call, found):
                    self._not_a_call(call)
                    return True
                continue
            if not call.named:
                self._not_a_call(call)
                return True
            if found.event is _Event.CLOSED and call.args_start < 0:
                self._delta(call.index).arguments += "{}"
            self._send_arguments(call)
            self._mode = _Mode.SKIP
            self._pos = found.at
            return True

    def _member(self, call: _Call, found: _Found) -> bool:
        """Takes a top-level member; False when it shows this is no call."""
        if found.key == NAME_KEY and not call.named:
            raw = self._slice(found.start, found.at)
            name = _string_value(raw) if raw.startswith('"') else None
            if not name:
                return False
            call.index = self._num_calls
            self._num_calls += 1
            first = self._delta(call.index)
            first.id = self._make_id()
            first.name = name
        elif found.key in ARGUMENT_KEYS and call.args_end < 0:
            if call.args_start < 0:
                self._arguments_begin(call, found.start)
            call.args_end = found.at
        self._send_arguments(call)
        return True

    def _send_arguments(self, call: _Call) -> None:
        """Passes on the arguments' text known to be theirs (once the call is named)."""
        scanner = call.scanner
        if call.args_start < 0 and scanner.member_start >= 0 and scanner.key in ARGUMENT_KEYS:
            self._arguments_begin(call, scanner.member_start)
        if not call.named or call.args_start < 0:
            return
        first = call.args_first
        if call.args_end >= 0:
            end = call.args_end
        elif first in ("{", "["):  # inside an object or array: whole pieces go at once
            end = max(scanner.safe, call.args_sent)
        else:  # a string, number or literal goes when whole
            return
        if end <= call.args_sent:
            return
        piece = self._slice(call.args_sent, end)
        call.args_sent = end
        if first == '"':
            piece = _string_arguments(piece)
        self._delta(call.index).arguments += piece

    def _arguments_begin(self, call: _Call, start: int) -> None:
        call.args_start = call.args_sent = start
        call.args_first = self._slice(start, start + 1)

    def _not_a_call(self, call: _Call) -> None:
        """The tag began no call: it is content, and the text after it is read again."""
        self._mode = _Mode.CONTENT
        self._call = None
        self._held = call.start
        self._release(call.body)
        self._pos = call.body

    def _delta(self, index: int) -> ToolCallDelta:
        delta = self._deltas.get(index)
        if delta is None:
            delta = self._deltas[index] = ToolCallDelta(index)
        return delta

    # ----- after a call -----------------------------------------------------------------

    def _skip(self, final: bool) -> bool:
        """Drops text up to the next tag: a closing one ends the call, an opening one begins
        the next."""
        i = self._pos - self._base
        opening, closing = self._text.find(OPEN, i), self._text.find(CLOSE, i)
        if opening < 0 and closing < 0:
            if not final:
                self._pos = self._end - max(_partial_tag(self._text, OPEN),
                                            _partial_tag(self._text, CLOSE))
            return False
        self._call = None
        if closing >= 0 and (opening < 0 or closing < opening):
            self._mode = _Mode.CONTENT
            self._held = self._pos = self._base + closing + len(CLOSE)
            self._segment_has_text = False
            self._after_call = True
            return True
        start = self._base + opening
        self._begin_call(start, start + len(OPEN))
        return True

    def _forget_settled(self) -> None:
        """Drops the text no later step reads again, so the text kept stays short."""
        keep = self._pos
        if self._mode is _Mode.CONTENT:
            keep = min(keep, self._held)
        elif self._mode is _Mode.CALL:
            call = self._call
            assert call is not None
            if not call.named:
                keep = call.start  # the whole of it may turn out to be content
            else:
                scanner = call.scanner
                keep = scanner.pos
                if scanner.token:
                    keep = min(keep, scanner.token_start)
                if call.args_start >= 0:
                    keep = min(keep, call.args_sent)
        if keep > self._base:
            self._text = self._text[keep - self._base:]
            self._base = keep


def _string_arguments(raw: str) -> str:
    """Arguments written as a JSON string: its text when that is JSON text, else as written."""
    text = _string_value(raw)
    if text is None:
        return raw
    try:
        json.loads(text)
    except ValueError:
        return raw
    return text.strip(_JSON_WHITESPACE)


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag`."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0
