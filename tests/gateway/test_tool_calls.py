"""Tool calls parsed out of streamed text (gateway/tool_calls.py): hand-worked cases, the
shape of the deltas, and random texts cut into random pieces, which must parse exactly as
the whole text does (and, for texts built of well-formed calls, as they were built)."""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import dataclass, field
from typing import Any

import pytest

from gateway.tool_calls import ToolCallDelta, ToolCallParser, make_call_id


@dataclass
class Parsed:
    """What a parser gave for one text: its content and calls as (id, name, arguments),
    however they came in pieces."""

    content: str = ""
    calls: list[tuple[str, str, str]] = field(default_factory=list)
    num_calls: int = 0

    def take(self, content: str, deltas: list[ToolCallDelta]) -> None:
        self.content += content
        for delta in deltas:
            if delta.index == len(self.calls):  # the call's first delta
                assert delta.id and delta.name, delta
                self.calls.append((delta.id, delta.name, delta.arguments))
            else:
                assert delta.index < len(self.calls) and not delta.id and not delta.name, delta
                call_id, name, arguments = self.calls[delta.index]
                self.calls[delta.index] = (call_id, name, arguments + delta.arguments)

    @property
    def named_calls(self) -> list[tuple[str, str]]:
        return [(name, arguments) for _, name, arguments in self.calls]


def counter_ids() -> Any:
    numbers = itertools.count()
    return lambda: f"call_{next(numbers)}"


def parse(pieces: list[str]) -> Parsed:
    parser = ToolCallParser(counter_ids())
    parsed = Parsed()
    for piece in pieces:
        parsed.take(*parser.feed(piece))
    parsed.take(*parser.finish())
    parsed.num_calls = parser.num_calls
    return parsed


def whole(text: str) -> Parsed:
    return parse([text])


# ----- hand-worked cases ---------------------------------------------------------------------

ARGS = '{"city": "Paris", "days": [1, 2]}'
CALL = f'<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>'
CASES: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("plain text", "plain text", []),
    ("", "", []),
    ("  \n ", "  \n ", []),  # whitespace alone, no call: content as it is
    (CALL, "", [("get_weather", ARGS)]),
    ("Let me check.\n" + CALL, "Let me check.\n",
     [("get_weather", ARGS)]),
    ("\n\n" + CALL + "\n" + CALL + "\n  \n", "", [("get_weather", ARGS)] * 2),
    (CALL + "\nDone.", "\nDone.", [("get_weather", ARGS)]),
    ('<tool_call>{"name":"f","arguments":{}}</tool_call>'
     '<tool_call>{"name":"g","arguments":{"x":null}}</tool_call>',
     "", [("f", "{}"), ("g", '{"x":null}')]),
    # name after the arguments
    ('<tool_call>\n{"arguments": {"a": true}, "name": "f"}\n</tool_call>', "",
     [("f", '{"a": true}')]),
    # "parameters" for "arguments"; other keys skipped; the first arguments count
    ('<tool_call>{"id": 7, "name": "f", "parameters": {"a": 1}, "arguments": {"b": 2}}</tool_call>',
     "", [("f", '{"a": 1}')]),
    # no arguments: {}
    ('<tool_call>{"name": "f"}</tool_call>', "", [("f", "{}")]),
    # arguments as a JSON string holding JSON text: that text; else the string as written
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": [1, \\"x\\"]}"}</tool_call>', "",
     [("f", '{"a": [1, "x"]}')]),
    ('<tool_call>{"name": "f", "arguments": "not json"}</tool_call>', "", [("f", '"not json"')]),
    ('<tool_call>{"name": "f", "arguments": 12.5e3}</tool_call>', "", [("f", "12.5e3")]),
    # the text of a call that breaks before its name is known is content
    ("<tool_call>nope</tool_call> after", "<tool_call>nope</tool_call> after", []),
    ('<tool_call>{"name": 5, "arguments": {}}</tool_call>',
     '<tool_call>{"name": 5, "arguments": {}}</tool_call>', []),
    ('<tool_call>{"name": "", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "", "arguments": {}}</tool_call>', []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ('x <tool_call>{"name": "f', 'x <tool_call>{"name": "f', []),  # ended unnamed
    ('x <tool_call>{"name": "f"', "x ", [("f", "")]),  # named: a call, cut short
    ("<tool_c", "<tool_c", []),
    # ... and the text after it is read again: a good call after a bad tag is a call
    ("<tool_call>oops " + CALL, "<tool_call>oops ",
     [("get_weather", ARGS)]),
    # once named, a call stays: an error ends it, the rest up to the next tag is dropped
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>\nok', "\nok",
     [("f", '{"a": 1}')]),
    ('<tool_call>{"name": "f", "arguments": {"a": 1}} trailing junk</tool_call>', "",
     [("f", '{"a": 1}')]),
    ('<tool_call>{"name": "f", "arguments": {"a": tru}}</tool_call>', "", [("f", '{"a": ')]),
    ('<tool_call>{"name": "f", "arguments": {"a": "x\ny"}}</tool_call>', "", [("f", '{"a": "x')]),
    # a call that ends cut short keeps what was sent
    ('<tool_call>{"name": "f", "arguments": {"a": [1, 2', "", [("f", '{"a": [1, ')]),
    ('<tool_call>{"name": "f", "arguments": {"a": "hal', "", [("f", '{"a": "hal')]),
    # a missing closing tag: the next opening one begins the next call
    ('<tool_call>{"name": "f", "arguments": {}}\n'
     '<tool_call>{"name": "g", "arguments": {}}</tool_call>', "", [("f", "{}"), ("g", "{}")]),
    # escapes, unicode and a closing tag inside a string are arguments
    ('<tool_call>{"name": "f", "arguments": {"s": "</tool_call> \\u00e9\\n\\"", "t": "日本"}}'
     "</tool_call>", "", [("f", '{"s": "</tool_call> \\u00e9\\n\\"", "t": "日本"}')]),
    # a stray closing tag in content is content
    ("a </tool_call> b", "a </tool_call> b", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), CASES, ids=[c[0][:40] for c in CASES])
def test_hand_worked_texts(text: str, content: str, calls: list[tuple[str, str]]) -> None:
    parsed = whole(text)
    assert (parsed.content, parsed.named_calls) == (content, calls)
    assert parsed.num_calls == len(calls)
    for size in range(1, 8):  # and cut into pieces of every small size
        assert parse(chop(text, size)) == parsed


def chop(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def test_deltas_stream_the_call_as_it_comes() -> None:
    parser = ToolCallParser(counter_ids())
    assert parser.feed("Sure.\n<tool_") == ("Sure.\n", [])  # a tag's beginning is held
    assert parser.feed('call>\n{"name": "get') == ("", [])
    assert parser.feed('_weather", "arguments": {"ci') == (
        "", [ToolCallDelta(0, "call_0", "get_weather", '{"ci')])
    assert parser.feed('ty": "Par') == ("", [ToolCallDelta(0, arguments='ty": "Par')])
    # a number goes when it is whole, and so does the closing brace
    assert parser.feed('is", "days": 1') == ("", [ToolCallDelta(0, arguments='is", "days": ')])
    assert parser.feed("2}") == ("", [ToolCallDelta(0, arguments="12}")])
    assert parser.feed("}\n</tool_call>\n") == ("", [])
    assert parser.num_calls == 1
    assert parser.feed('<tool_call>{"name": "f", "arguments": {}}</tool_call>') == (
        "", [ToolCallDelta(1, "call_1", "f", "{}")])
    assert parser.finish() == ("", [])
    assert parser.num_calls == 2


def test_make_call_id_is_openais_shape() -> None:
    ids = {make_call_id() for _ in range(100)}
    assert len(ids) == 100
    for call_id in ids:
        assert call_id.startswith("call_") and len(call_id) == 29
        int(call_id[5:], 16)


def test_long_outputs_keep_little_text() -> None:
    """The parser forgets settled text: what it keeps stays short, however long the output."""
    parser = ToolCallParser(counter_ids())
    arguments = json.dumps({f"k{i}": ["value", i, {"x": None}] for i in range(2000)})
    text = "word " * 5000 + '<tool_call>{"name": "f", "arguments": ' + arguments + "}</tool_call>"
    parsed = Parsed()
    kept = 0
    for piece in chop(text, 3):
        parsed.take(*parser.feed(piece))
        kept = max(kept, len(parser._text))
    parsed.take(*parser.finish())
    assert parsed.content == "word " * 5000 and parsed.named_calls == [("f", arguments)]
    assert kept < 40


# ----- random texts in random pieces ---------------------------------------------------------

WORDS = ["hello", " ", "\n", "<", "tool", "_call", ">", "</tool_call>", "<tool_c", "{", "}",
         '"name"', "é", "日本", "🙂", "\t", "  ", ".", ",", "call"]


def random_json(rng: random.Random, depth: int = 0) -> Any:
    kinds = ["str", "int", "float", "lit"] + (["obj", "arr"] * 2 if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "str":
        return "".join(rng.choice(['a', 'b', ' ', '"', "\\", "\n", "é", "🙂", "}", "</tool_call>",
                                   "\x01", "{"]) for _ in range(rng.randint(0, 6)))
    if kind == "int":
        return rng.randint(-10**6, 10**6)
    if kind == "float":
        return rng.choice([0.5, -1e-7, 3.25e21, 1.0])
    if kind == "lit":
        return rng.choice([True, False, None])
    if kind == "arr":
        return [random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {f"k{i}{rng.choice(['', 'é', ' '])}": random_json(rng, depth + 1)
            for i in range(rng.randint(0, 3))}


def dumps(rng: random.Random, value: Any) -> str:
    """JSON text as different models write it: compact, spaced, indented, ASCII or not."""
    style: dict[str, Any] = rng.choice([{}, {"separators": (",", ":")}, {"indent": 2},
                                        {"indent": 0}])
    return json.dumps(value, ensure_ascii=rng.random() < 0.5, **style)


def ws(rng: random.Random) -> str:
    return rng.choice(["", "", "\n", " ", "\n\n", " \t\n"])


def good_call(rng: random.Random) -> tuple[str, tuple[str, str]]:
    """A well-formed call's text and its (name, arguments)."""
    name = rng.choice(["get_weather", "f", "search-web", "é_tool"])
    arguments = dumps(rng, {k: random_json(rng, 1) for k in ["a", "b", "c"][:rng.randint(0, 3)]})
    members = [f'"name": {json.dumps(name)}', f'"arguments": {arguments}']
    if rng.random() < 0.3:
        members.reverse()
    if rng.random() < 0.3:
        members.insert(rng.randint(0, 2), f'"extra": {dumps(rng, random_json(rng, 2))}')
    sep = rng.choice([", ", ",", ",\n  "])
    body = "{" + ws(rng) + sep.join(members) + ws(rng) + "}"
    return f"<tool_call>{ws(rng)}{body}{ws(rng)}</tool_call>", (name, arguments)


def bad_call(rng: random.Random) -> str:
    """A tag with something that is no well-formed call after it (may be cut anywhere)."""
    text, _ = good_call(rng)
    kind = rng.randrange(5)
    if kind == 0:  # cut anywhere
        return text[:rng.randint(0, len(text) - 1)]
    if kind == 1:  # a character changed
        i = rng.randrange(len(text))
        return text[:i] + rng.choice(['"', "}", "x", "<", "\n", ":"]) + text[i + 1:]
    if kind == 2:
        return "<tool_call>" + "".join(rng.choice(WORDS) for _ in range(rng.randint(0, 5)))
    if kind == 3:
        return '<tool_call>{"name": ' + dumps(rng, random_json(rng, 2)) + "}</tool_call>"
    return text.replace("</tool_call>", "", 1)


def content(rng: random.Random) -> str:
    """Text with no opening tag (a tag's beginning and the closing tag may be in it)."""
    text = "".join(rng.choice(WORDS) for _ in range(rng.randint(0, 6)))
    while "<tool_call>" in text:
        text = text.replace("<tool_call>", "<tool")
    return text


def expected_content(segments: list[str], num_calls: int) -> str:
    """The content of segments around calls: one of whitespace alone next to a call goes."""
    if num_calls == 0:
        return "".join(segments)
    return "".join(s for s in segments if s.strip())


def random_pieces(rng: random.Random, text: str) -> list[str]:
    pieces, i = [], 0
    while i < len(text):
        size = rng.choice([1, 1, 2, 3, 5, 8, 13, 40])
        pieces.append(text[i:i + size])
        i += size
    if rng.random() < 0.2:
        pieces.insert(rng.randint(0, len(pieces)), "")  # empty pieces change nothing
    return pieces


CHUNKINGS = 8


def test_well_formed_texts_parse_as_built_however_they_are_cut() -> None:
    rng = random.Random(20240533)
    texts = calls_found = chunkings = 0
    for _ in range(400):
        num_calls = rng.randint(0, 4)
        segments = [content(rng)]
        calls = []
        text = segments[0]
        for _ in range(num_calls):
            call_text, call = good_call(rng)
            segments.append(content(rng))
            calls.append(call)
            text += call_text + segments[-1]
        parsed = whole(text)
        assert parsed.named_calls == calls, text
        assert parsed.content == expected_content(segments, num_calls), text
        for _, arguments in parsed.named_calls:
            json.loads(arguments)
        ids = [call_id for call_id, _, _ in parsed.calls]
        assert ids == [f"call_{i}" for i in range(num_calls)]
        for _ in range(CHUNKINGS):
            assert parse(random_pieces(rng, text)) == parsed, text
            chunkings += 1
        texts += 1
        calls_found += len(calls)
    assert (texts, chunkings) == (400, 400 * CHUNKINGS)
    assert calls_found > 600  # about 2 a text: many texts have several


def test_any_text_parses_the_same_however_it_is_cut() -> None:
    """Texts mixing content, good calls and broken ones: cut into pieces, the content and
    calls are those of the whole text; a text in which no call was found is all content."""
    rng = random.Random(33)
    texts = with_calls = without_calls = 0
    for _ in range(600):
        parts = [rng.choice([content, content, bad_call, lambda r: good_call(r)[0]])(rng)
                 for _ in range(rng.randint(1, 5))]
        text = "".join(parts)
        parsed = whole(text)
        if parsed.num_calls == 0:
            assert parsed.content == text
            without_calls += 1
        else:
            with_calls += 1
        assert parsed.num_calls == len(parsed.calls)
        for _ in range(CHUNKINGS):
            assert parse(random_pieces(rng, text)) == parsed, text
        texts += 1
    assert texts == 600
    assert with_calls > 200 and without_calls > 100, (with_calls, without_calls)
