"""Structured output's formats at the token level, with no model (gateway/grammar.py).

Text is tokenized with the default model's tokenizer and put to a new matcher one token at a
time, the matcher's mask filled (as a step fills it) before each token and before the end of
sequence. Text a format allows must be consumed to the end and finish; text it does not allow
must be refused at some token, the end of sequence included. A token the mask allows must
always be consumed: otherwise a model could be steered into a dead end.

Each text is written three ways: as the tokenizer splits it, one character at a time (a split
no tokenizer would choose), and as a model masked by the matcher would write it (at each step
the longest allowed token the text goes on with; bench/structured_masks.py's guided_tokens).
`consume` takes any split: llguidance matches bytes. The mask does not quite: over bytes the
format forces (`{"name": "` opening an object whose first member is required, `"}}` closing
two objects, a const's text), llguidance allows only the first of the tokenizer's own tokens
for those bytes ("fast-forward" tokens, docs/fast_forward.md in llguidance). So a token the
mask refuses may still be consumed, and `walk` checks that each such token is exactly that
case (check_forced). The tokenizer's own split of a whole text is refused that way in 2 of the
corpus's 63 valid texts, the character split in nearly all; the masked way writes them all.

The JSON-schema corpus lives in tests/fixtures/schemas/ (its README says what a case holds).
Each of its instances is checked against the schema by `jsonschema` first, so a case cannot
claim what JSON Schema does not say. Where llguidance knowingly differs from JSON Schema (it
writes properties in the schema's order, bounded numbers have no exponent, a date is a regex),
the case lists those instances apart with why, and the test holds llguidance to that
difference: a change in llguidance shows up here.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest

from bench.structured_masks import (
    Case,
    TokenBytes,
    allowed_tokens,
    allows,
    guided_tokens,
    load_corpus,
)
from gateway.grammar import (
    MAX_FORMAT_BYTES,
    CompiledFormat,
    FormatCompiler,
    FormatError,
    FormatMatcher,
    FormatSpec,
    LLGuidanceBackend,
    choice_spec,
)
from gateway.tokenizer import Tokenizer

VOCAB = 49152  # SmolLM2-135M-Instruct's logits
CASES = load_corpus()
# What JSON Schema says of each kind of instance, and what the matcher must say.
VALID_BY_SCHEMA = {"valid": True, "invalid": False, "valid_refused": True,
                   "invalid_accepted": False}
ACCEPTED_BY_MATCHER = {"valid": True, "invalid": False, "valid_refused": False,
                       "invalid_accepted": True}

# ---- the corpus ----------------------------------------------------------------------------


def schema_validator(schema: Any) -> jsonschema.protocols.Validator:
    """A validator that checks formats too (jsonschema skips them unless asked)."""
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    cls.check_schema(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def formats_in(node: Any) -> set[str]:
    """Every string `format` named anywhere in a schema."""
    if isinstance(node, list):
        return set().union(*(formats_in(item) for item in node))
    if not isinstance(node, dict):
        return set()
    own = {node["format"]} if isinstance(node.get("format"), str) else set()
    return own.union(*(formats_in(value) for value in node.values()))


def test_corpus_agrees_with_jsonschema() -> None:
    assert len(CASES) >= 16
    assert len({case.name for case in CASES}) == len(CASES)
    for case in CASES:
        validator = schema_validator(case.schema)
        # A format this jsonschema does not check would let an invalid instance pass it.
        unchecked = formats_in(case.schema) - set(validator.format_checker.checkers)
        assert not unchecked, f"{case.name}: jsonschema does not check {unchecked}"
        assert len(case.valid) >= 2 and len(case.invalid) >= 3, case.name
        for kind, instance in case.instances():
            errors = list(validator.iter_errors(instance))
            assert (not errors) == VALID_BY_SCHEMA[kind], (case.name, kind, instance, errors)


# ---- walking a matcher through tokens -------------------------------------------------------


@dataclass
class Walk:
    """One token sequence put to a new matcher."""

    length: int  # the text's tokens
    tokens: int  # tokens the matcher was asked about, the end of sequence included
    refused_at: int | None  # the first token `consume` refused (length: the EOS); None: none
    forced: int = 0  # tokens the mask refused and `consume` took (see check_forced)

    @property
    def accepted(self) -> bool:
        return self.refused_at is None


def check_forced(row: np.ndarray, token: int, token_bytes: TokenBytes) -> None:
    """The mask refused a token that `consume` takes. That is llguidance forcing: over bytes
    the format forces, its mask allows only the first of the tokenizer's own tokens for them
    (one token), where `consume` takes any tokens with those bytes. Anything else is a bug."""
    only = allowed_tokens(row)
    assert len(only) == 1, f"token {token} refused by a mask allowing {len(only)} tokens"
    mine, forced = token_bytes.of[token], token_bytes.of[int(only[0])]
    common = min(len(mine), len(forced))
    assert common and mine[:common] == forced[:common], (mine, forced)


def walk(backend: LLGuidanceBackend, compiled: CompiledFormat, ids: list[int], eos: int,
         token_bytes: TokenBytes) -> Walk:
    """Puts `ids` and then the end of sequence to a new matcher, the mask filled before each.
    A token the mask allows must be consumed (else a model could write text outside the
    format); one it refuses must be refused by `consume` too, but over forced bytes."""
    matcher = compiled.new_matcher()
    row = np.zeros((1, backend.words), dtype=np.int32)
    forced = 0
    for index, token in enumerate([*ids, eos]):
        backend.fill_masks([matcher], row)
        allowed = allows(row[0], token)
        consumed = matcher.consume(token)
        assert consumed or not allowed, f"token {index} ({token}) allowed, then refused"
        if not consumed:
            return Walk(len(ids), index + 1, index, forced)
        if not allowed:
            check_forced(row[0], token, token_bytes)
            forced += 1
    assert matcher.finished, "the end of sequence was taken but the matcher is not finished"
    return Walk(len(ids), len(ids) + 1, None, forced)


def char_by_char(tok: Tokenizer, text: str) -> list[int]:
    """A split no tokenizer would choose: each character tokenized on its own."""
    ids = [token for char in text for token in tok.encode(char)]
    assert tok.decode(ids, skip_special_tokens=False) == text
    return ids


@pytest.fixture(scope="module")
def backend(tokenizer: Tokenizer) -> LLGuidanceBackend:
    assert tokenizer.eos_token_id is not None
    return LLGuidanceBackend(tokenizer.backend_json(), [tokenizer.eos_token_id], VOCAB)


@pytest.fixture(scope="module")
def token_bytes(backend: LLGuidanceBackend) -> TokenBytes:
    return TokenBytes(backend.tokenizer)


@pytest.fixture(scope="module")
def eos(tokenizer: Tokenizer) -> int:
    assert tokenizer.eos_token_id is not None
    return tokenizer.eos_token_id


@pytest.fixture
def compiler(backend: LLGuidanceBackend) -> Iterator[FormatCompiler]:
    compiler = FormatCompiler(backend)
    yield compiler
    compiler.close()


@dataclass
class InstanceWalks:
    """One instance of a case, put to matchers three ways."""

    kind: str  # the case's list the instance came from
    text: str  # json.dumps(instance, ensure_ascii=False)
    tokenizer: Walk  # the tokenizer's own split of the whole text
    by_char: Walk  # one character at a time
    guided: list[int] | None  # as a model masked by the matcher writes it (None: it cannot)

    @property
    def accepted(self) -> dict[str, bool]:
        return {"tokenizer": self.tokenizer.accepted, "by_char": self.by_char.accepted,
                "guided": self.guided is not None}


@dataclass
class CaseWalks:
    error: str = ""  # the FormatError when the schema did not compile
    instances: list[InstanceWalks] = field(default_factory=list)


@pytest.fixture(scope="module")
def corpus_walks(tokenizer: Tokenizer, backend: LLGuidanceBackend, token_bytes: TokenBytes,
                 eos: int) -> dict[str, CaseWalks]:
    """Every instance of the corpus walked, once for the module's tests."""
    compiler = FormatCompiler(backend)
    results = {}
    for case in CASES:
        result = results[case.name] = CaseWalks()
        try:
            compiled = compiler.compile(FormatSpec("json_schema", case.source))
        except FormatError as error:
            result.error = str(error)
            continue
        for kind, instance in case.instances():
            text = json.dumps(instance, ensure_ascii=False)
            result.instances.append(InstanceWalks(
                kind, text,
                walk(backend, compiled, tokenizer.encode(text), eos, token_bytes),
                walk(backend, compiled, char_by_char(tokenizer, text), eos, token_bytes),
                guided_tokens(backend, compiled, text, token_bytes, eos)))
    compiler.close()
    return results


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_corpus_case(case: Case, corpus_walks: dict[str, CaseWalks],
                     tokenizer: Tokenizer) -> None:
    result = corpus_walks[case.name]
    if case.llguidance_refuses:
        assert case.llguidance_refuses in result.error
        assert result.error.startswith("structured_output: ")
        return
    assert not result.error
    for item in result.instances:
        expected = ACCEPTED_BY_MATCHER[item.kind]
        assert item.accepted == dict.fromkeys(item.accepted, expected), (item.kind, item.text)
        if item.guided is not None:
            assert tokenizer.decode(item.guided[:-1], skip_special_tokens=False) == item.text


def test_corpus_reached_the_matcher(corpus_walks: dict[str, CaseWalks]) -> None:
    """The corpus is not vacuous: this many instances and tokens went through matchers."""
    items = [item for result in corpus_walks.values() for item in result.instances]
    by_kind = {kind: sum(1 for item in items if item.kind == kind) for kind in VALID_BY_SCHEMA}
    walks = [w for item in items for w in (item.tokenizer, item.by_char)]
    tokens = sum(w.tokens for w in walks) + sum(len(item.guided or ()) for item in items)
    assert by_kind["valid"] >= 60 and by_kind["invalid"] >= 115, by_kind
    assert by_kind["valid_refused"] >= 4 and by_kind["invalid_accepted"] >= 1, by_kind
    assert tokens >= 10_000, tokens
    # Most invalid text is refused inside it, not only at its end.
    invalid = [item.tokenizer for item in items if item.kind == "invalid"]
    inside = sum(1 for w in invalid if w.refused_at is not None and w.refused_at < w.length)
    assert inside >= 0.8 * len(invalid), (inside, len(invalid))
    # Forced-token search is off (gateway/grammar.py): the mask allows every split of the
    # bytes the matcher consumes, the tokenizer's own and one character at a time alike.
    valid = [item for item in items if item.kind == "valid"]
    off_mask = [item.text for item in valid if item.tokenizer.forced or item.by_char.forced]
    print(f"{by_kind}, {tokens} tokens; {len(off_mask)} of {len(valid)} valid texts split "
          f"off the mask: {off_mask}")
    assert not off_mask, off_mask


@dataclass
class Checker:
    """Puts texts to new matchers of a compiled format, each written three ways."""

    backend: LLGuidanceBackend
    tokenizer: Tokenizer
    token_bytes: TokenBytes
    eos: int

    def outcomes(self, compiled: CompiledFormat, text: str) -> dict[str, bool]:
        """Whether `text` gets through: split by the tokenizer, one character at a time, and
        as a model masked by the matcher would write it."""
        def through(ids: list[int]) -> bool:
            return walk(self.backend, compiled, ids, self.eos, self.token_bytes).accepted

        guided = guided_tokens(self.backend, compiled, text, self.token_bytes, self.eos)
        return {"tokenizer": through(self.tokenizer.encode(text)),
                "by_char": through(char_by_char(self.tokenizer, text)),
                "guided": guided is not None}

    def check(self, compiled: CompiledFormat, accepted: list[str], refused: list[str]) -> None:
        for texts, expected in ((accepted, True), (refused, False)):
            for text in texts:
                outcomes = self.outcomes(compiled, text)
                assert outcomes == dict.fromkeys(outcomes, expected), (text, outcomes)


@pytest.fixture(scope="module")
def checker(backend: LLGuidanceBackend, tokenizer: Tokenizer, token_bytes: TokenBytes,
            eos: int) -> Checker:
    return Checker(backend, tokenizer, token_bytes, eos)


def test_json_is_compact_unless_whitespace_is_flexible(compiler: FormatCompiler,
                                                       checker: Checker) -> None:
    """Default JSON is json.dumps' own: ", " and ": " and no other whitespace."""
    case = next(case for case in CASES if case.name == "nested_object")
    instance = case.valid[0]
    compact = compiler.compile(FormatSpec("json_schema", case.source))
    flexible = compiler.compile(FormatSpec("json_schema", case.source,
                                           whitespace_flexible=True))
    texts = [json.dumps(instance), json.dumps(instance, separators=(",", ":")),
             json.dumps(instance, indent=2)]
    checker.check(compact, texts[:1], texts[1:])
    checker.check(flexible, texts, [])


# ---- the other kinds --------------------------------------------------------------------------


def test_regex(compiler: FormatCompiler, checker: Checker) -> None:
    compiled = compiler.compile(FormatSpec("regex", r"[0-9]{3}-[a-z]+( ✓)?"))
    checker.check(compiled, ["123-abc", "000-z ✓"],
                  ["12-abc", "123-ABC", "123-abc ", "123-abc ✓✓", "x123-abc", ""])


def test_choice(compiler: FormatCompiler, checker: Checker) -> None:
    # One choice a prefix of another: after "yes" both the end and " please" are allowed.
    choices = ["yes", "yes please", "no", 'say "hi"', "two\nlines", "back\\slash",
               "héllo 🎉", "日本語"]
    compiled = compiler.compile(choice_spec(choices, "choice"))
    checker.check(compiled, choices,
                  ["ye", "yes please!", "maybe", "say hi", '"yes"', "two lines", "héllo",
                   "yes\n"])


def test_choice_of_nothing_is_refused(compiler: FormatCompiler) -> None:
    with pytest.raises(FormatError, match=r"^guided_choice: "):
        compiler.compile(choice_spec([], "guided_choice"))


LARK_ARITHMETIC = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]+/
"""


def test_lark_grammar(compiler: FormatCompiler, checker: Checker) -> None:
    compiled = compiler.compile(FormatSpec("grammar", LARK_ARITHMETIC))
    checker.check(compiled, ["1+22-3", "(1+2)*34/5", "((7))"],
                  ["1++2", "(1+2", "1+2)", "a+1", ""])


def test_json_object(compiler: FormatCompiler, checker: Checker) -> None:
    compiled = compiler.compile(FormatSpec("json_object"))
    objects = [instance for case in CASES for instance in case.valid
               if isinstance(instance, dict)][:12]
    checker.check(compiled, [json.dumps(x, ensure_ascii=False) for x in [{}, *objects]],
                  ["[1, 2]", '"text"', "42", "null", '{"a": 1', '{"a" 1}', "{'a': 1}"])


def test_a_wider_runner_vocabulary_gets_zero_words(tokenizer: Tokenizer, eos: int,
                                                   backend: LLGuidanceBackend) -> None:
    """Tokens past the tokenizer's (a runner's padded logits) are never allowed."""
    wide = LLGuidanceBackend(tokenizer.backend_json(), [eos], VOCAB + 100)
    assert wide.words == backend.words + 4
    spec = FormatSpec("json_object")
    rows = np.full((1, wide.words), -1, dtype=np.int32)
    narrow = np.zeros((1, backend.words), dtype=np.int32)
    wide.fill_masks([wide.compile(spec).new_matcher()], rows)
    backend.fill_masks([backend.compile(spec).new_matcher()], narrow)
    assert (rows[:, backend.words:] == 0).all()
    assert (rows[:, :backend.words] == narrow).all()


# ---- refusals -------------------------------------------------------------------------------

FIELD = "response_format.json_schema"


@pytest.mark.parametrize(("kind", "source", "says"), [
    ("json_schema", '{"type": "object",', "not JSON"),
    ("json_schema", "[1, 2]", "a JSON schema is an object"),
    ("json_schema", '"string"', "a JSON schema is an object"),
    ("json_schema", "3", "a JSON schema is an object"),
    ("json_schema", '{"type": "frog"}', "frog"),
    ("json_schema", '{"type": "integer", "minimum": 5, "maximum": 1}', "Unsatisfiable"),
    ("json_schema", '{"type": "string", "format": "no-such-format"}', "Unknown format"),
    ("json_schema", '{"not": {"type": "string"}}', "Unimplemented keys"),
    ("json_schema", '{"oneOf": [{"type": "integer"}, {"type": "number"}]}', "oneOf"),
    ("json_schema", '{"$ref": "#/$defs/missing"}', "does not exist"),
    ("json_schema", '{"type": "string", "pattern": "(("}', "regex"),
    ("regex", "((", "regex"),
    ("regex", "(?=lookahead)", "look"),
    ("grammar", "start: undefined_rule", "undefined_rule"),
    ("grammar", "???", "expecting rule"),
    ("frog", "", "unknown format"),
], ids=["json-syntax", "json-array", "json-string", "json-number", "unknown-type",
        "unsatisfiable", "unknown-format", "unimplemented-key", "overlapping-oneOf",
        "dangling-ref", "schema-bad-pattern", "bad-regex", "regex-lookahead",
        "lark-undefined", "lark-syntax", "unknown-kind"])
def test_format_errors_name_the_field_first(compiler: FormatCompiler, kind: str,
                                            source: str, says: str) -> None:
    with pytest.raises(FormatError) as raised:
        compiler.compile(FormatSpec(kind, source, field=FIELD))
    message = str(raised.value)
    assert message.startswith(f"{FIELD}: "), message
    assert says in message, message
    assert "\n" not in message


def test_a_source_over_the_limit_is_refused_before_compiling(compiler: FormatCompiler) -> None:
    # Counted in bytes: half as many two-byte characters are just as much.
    for source in ("a" * (MAX_FORMAT_BYTES + 1), "é" * (MAX_FORMAT_BYTES // 2 + 1)):
        with pytest.raises(FormatError, match=rf"^{FIELD}: \d+ bytes; at most"):
            compiler.compile(FormatSpec("regex", source, field=FIELD))
    assert compiler.compiles == 0
    compiler.compile(FormatSpec("regex", "a" * MAX_FORMAT_BYTES))  # the limit itself is fine
    assert compiler.compiles == 1


def test_a_choice_source_that_is_not_a_list_of_strings_is_a_format_error(
        compiler: FormatCompiler) -> None:
    for source in ("yes, no", '{"yes": 1}', "[]", '["a", 2]', '["a", ""]'):
        with pytest.raises(FormatError, match=rf"^{FIELD}: "):
            compiler.compile(FormatSpec("choice", source, field=FIELD))


@pytest.mark.parametrize("grammar", ['start: "a" start', 'start: x\nx: "b" x'])
def test_a_grammar_with_no_end_fails_cleanly(compiler: FormatCompiler, checker: Checker,
                                             grammar: str) -> None:
    """A grammar no finite text matches. Refused at admission, or served like `a*` would be
    (never finished: the output ends by max_tokens): each step's mask allows a token the
    matcher then takes, or the matcher fails cleanly; never an exception."""
    try:
        compiled = compiler.compile(FormatSpec("grammar", grammar))
    except FormatError:
        return
    matcher = compiled.new_matcher()
    row = np.zeros((1, checker.backend.words), dtype=np.int32)
    for _ in range(64):
        checker.backend.fill_masks([matcher], row)
        allowed = allowed_tokens(row[0])
        if not len(allowed) or not matcher.consume(int(allowed[0])):
            assert matcher.error
            return
        assert not matcher.finished


# A child process: the backend from the model's tokenizer.json (no transformers: it starts in
# under a second), a memory cap, one grammar compiled and its first mask filled.
FIRST_MASK = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
import numpy as np
from common.model_store import resolve_model
from gateway.grammar import FormatSpec, LLGuidanceBackend
backend = LLGuidanceBackend((resolve_model(None) / "tokenizer.json").read_text(), [2], 49152)
compiled = backend.compile(FormatSpec("grammar", sys.argv[1]))
backend.fill_masks([compiled.new_matcher()], np.zeros((1, backend.words), dtype=np.int32))
print("filled")
"""


def fill_first_mask_apart(grammar: str, timeout_s: float = 4.0) -> None:
    """Fails the test unless FIRST_MASK fills `grammar`'s first mask within `timeout_s`
    (about 1 s of it is the child's start)."""
    root = Path(__file__).resolve().parents[2]
    try:
        done = subprocess.run([sys.executable, "-c", FIRST_MASK, grammar], cwd=root,
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the first mask fill did not return in {timeout_s:g} s")
    if done.returncode != 0 or "filled" not in done.stdout:
        pytest.fail(f"the child failed ({done.returncode}): {done.stderr[-300:]}")


FORCED_FOREVER = 'start: /a+/ "a"'


def test_a_grammar_forcing_bytes_forever_fills_its_mask() -> None:
    """`start: /a+/ "a"`: lexemes are greedy, so /a+/ takes every "a" and the final "a"
    never comes; no text matches, but each next byte is forced to be "a". With llguidance's
    forced-token search on (its default), its first mask fill forces "a" after "a" without
    end (no parser item is added, so its items limit never trips), its memory growing: 21 GB
    in the fuzz. gateway/grammar.py turns the search off for every format."""
    fill_first_mask_apart(FORCED_FOREVER)


# ---- the cache and the time limit -------------------------------------------------------------


def test_the_same_spec_compiles_once(compiler: FormatCompiler) -> None:
    source = json.dumps(CASES[0].schema)
    first = compiler.compile(FormatSpec("json_schema", source))
    assert compiler.compile(FormatSpec("json_schema", source)) is first  # equal, not the same
    assert compiler.compiles == 1
    compiler.compile(FormatSpec("json_schema", source, whitespace_flexible=True))
    assert compiler.compiles == 2


def test_a_refused_spec_is_not_cached(compiler: FormatCompiler) -> None:
    spec = FormatSpec("json_schema", '{"type": "frog"}')
    for _ in range(2):
        with pytest.raises(FormatError):
            compiler.compile(spec)
    assert compiler.compiles == 2


class BlockedBackend:
    """A backend whose compiles wait until released: a compile as slow as a test needs."""

    words = 1

    def __init__(self) -> None:
        self.release = threading.Event()

    def compile(self, spec: FormatSpec) -> CompiledFormat:
        self.release.wait(30)
        return BlockedCompiled(self)

    def fill_masks(self, matchers: list[FormatMatcher], masks: np.ndarray) -> None:
        masks[:] = 0


@dataclass(frozen=True)
class BlockedCompiled:
    backend: BlockedBackend

    def new_matcher(self) -> FormatMatcher:
        raise NotImplementedError


def test_a_compile_over_the_time_limit_is_refused_and_not_cached() -> None:
    backend = BlockedBackend()
    compiler = FormatCompiler(backend, timeout_s=0.05)
    spec = FormatSpec("json_object", field=FIELD)
    try:
        for _ in range(2):  # the second is a new compile: the first was dropped
            with pytest.raises(FormatError, match=rf"^{FIELD}: took over 0.05 s to compile"):
                compiler.compile(spec)
        assert compiler.compiles == 2
        backend.release.set()
        compiler.timeout_s = 10.0
        assert isinstance(compiler.compile(spec), BlockedCompiled)
        assert compiler.compiles == 3
    finally:
        backend.release.set()
        compiler.close()


def test_a_real_slow_compile_times_out(backend: LLGuidanceBackend) -> None:
    """400 bounded numbers: about 75 ms to compile here, against a 5 ms limit."""
    schema = {"type": "object", "required": [f"n{i}" for i in range(400)], "properties": {
        f"n{i}": {"type": "number", "minimum": -i * 1.37, "maximum": i * 10.5 + 0.123}
        for i in range(400)}}
    spec = FormatSpec("json_schema", json.dumps(schema))
    compiler = FormatCompiler(backend, timeout_s=0.005)
    try:
        with pytest.raises(FormatError, match="took over"):
            compiler.compile(spec)
        compiler.timeout_s = 30.0
        compiler.compile(spec)
        assert compiler.compiles == 2
    finally:
        compiler.close()


# ---- fuzz -----------------------------------------------------------------------------------

SCHEMA_KEYS = ["type", "properties", "items", "required", "enum", "const", "minimum",
               "maximum", "exclusiveMinimum", "pattern", "format", "anyOf", "oneOf", "allOf",
               "$ref", "$defs", "additionalProperties", "minItems", "maxItems", "minLength",
               "maxLength", "not", "prefixItems", "multipleOf", "uniqueItems", "nullable"]
TYPES = ["object", "array", "string", "integer", "number", "boolean", "null", "frog"]
FORMATS = ["date", "date-time", "email", "uuid", "ipv4", "uri", "no-such"]
REGEX_ATOMS = ["a", "b", "é", "[a-z]", "[^0-9]", ".", "\\d", "\\w", "\\", "(", ")", "(?:",
               "(?=", "|", "*", "+", "?", "{2}", "{1,3}", "{3,1}", "^", "$", "[", "]", "-",
               "{", "}", "\\u00e9", "\\p{L}", "🎉"]
LARK_ATOMS = ['"a"', '"b"', '"\\n"', "/[0-9]+/", "/(/", "x", "y", "start", "|", "(", ")",
              "*", "+", "?", "[", "]", ":", "\n", "\nx: ", "\ny: ", "%ignore", "%import",
              "common.NUMBER", "NUMBER", "\nNUMBER: /[0-9]+/", "~", "3", ".."]

# Each generator builds a sound source, then breaks most of them: mutated at random places,
# so the compile and the refusal paths both get exercised, and the edges in between.


def mutate(rng: random.Random, text: str, atoms: list[str]) -> str:
    """`text` with one to three random cuts, insertions of `atoms` and replacements."""
    for _ in range(rng.randint(1, 3)):
        at = rng.randrange(len(text) + 1)
        op = rng.randrange(3)
        if op == 0:
            text = text[:at] + text[at + rng.randint(1, 4):]
        elif op == 1:
            text = text[:at] + rng.choice(atoms) + text[at:]
        else:
            text = text[:at] + rng.choice(atoms) + text[at + 1:]
    return text


def sound_regex(rng: random.Random, depth: int = 0) -> str:
    pick = rng.randrange(6 if depth < 2 else 3)
    if pick == 0:
        return rng.choice(["a", "b", "é", "🎉", "\\.", " "]) * rng.randint(1, 3)
    if pick == 1:
        return rng.choice(["[a-z]", "[0-9]", "[^\"\\\\]", "\\d", "\\w", "[A-F0-9]"])
    if pick == 2:
        return rng.choice(["[a-z]", "x"]) + rng.choice(["*", "+", "?", "{2}", "{1,4}"])
    if pick == 3:
        return "(" + "|".join(sound_regex(rng, depth + 1) for _ in range(rng.randint(2, 3))) + ")"
    if pick == 4:
        return "(?:" + sound_regex(rng, depth + 1) + ")" + rng.choice(["*", "+", "?", "{0,3}"])
    return "".join(sound_regex(rng, depth + 1) for _ in range(rng.randint(2, 4)))


def sound_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    kinds = ["string", "integer", "number", "boolean", "null", "enum"]
    kind = rng.choice(kinds + (["object", "array", "anyOf"] * 2 if depth < 3 else []))
    if kind == "object":
        properties = {f"p{i}": sound_schema(rng, depth + 1) for i in range(rng.randrange(4))}
        schema: dict[str, Any] = {"type": "object", "properties": properties,
                                  "required": [k for k in properties if rng.random() < 0.5]}
        if rng.random() < 0.5:
            schema["additionalProperties"] = False
        return schema
    if kind == "array":
        low = rng.randrange(3)
        return {"type": "array", "items": sound_schema(rng, depth + 1), "minItems": low,
                "maxItems": low + rng.randrange(4)}
    if kind == "anyOf":
        return {"anyOf": [sound_schema(rng, depth + 1) for _ in range(rng.randint(1, 3))]}
    if kind == "enum":
        return {"enum": [rng.choice([1, 2.5, "x", "é\n", None, True]) for _ in range(3)]}
    schema = {"type": kind}
    if kind == "string" and rng.random() < 0.5:
        schema["pattern"] = sound_regex(rng)
    elif kind == "string" and rng.random() < 0.5:
        schema["format"] = rng.choice(FORMATS[:-1])
    elif kind in ("integer", "number") and rng.random() < 0.5:
        schema.update(minimum=rng.randint(-50, 5), maximum=rng.randint(5, 500))
    return schema


def junk_value(rng: random.Random) -> Any:
    """A value for any schema key, most often of the wrong kind."""
    return rng.choice([0, -1, 3, 2.5, "x", True, None, [], {}, rng.choice(TYPES),
                       [rng.choice(TYPES)], rng.choice(FORMATS), {"type": "frog"},
                       "".join(rng.choices(REGEX_ATOMS, k=3)), "#/$defs/missing"])


def break_schema(rng: random.Random, node: Any) -> None:
    """Sets a random key of a random object of the schema to junk."""
    objects = []
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            objects.append(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    rng.choice(objects)[rng.choice(SCHEMA_KEYS)] = junk_value(rng)


def random_schema_text(rng: random.Random) -> str:
    schema = sound_schema(rng)
    pick = rng.random()
    if pick < 0.5:
        for _ in range(rng.randint(1, 2)):
            break_schema(rng, schema)
    text = json.dumps(schema, ensure_ascii=False)
    if 0.5 <= pick < 0.65:  # not JSON, or not an object
        return mutate(rng, text, ["{", "}", '"', ",", "[", "]", ":", "1", "null"])
    return text


def random_regex(rng: random.Random) -> str:
    regex = sound_regex(rng)
    return mutate(rng, regex, REGEX_ATOMS) if rng.random() < 0.6 else regex


def lark_item(rng: random.Random, later: list[str]) -> str:
    """A literal, a regex or one of the `later` rules, maybe repeated."""
    pick = rng.randrange(3 if later else 2)
    atom = (json.dumps(rng.choice(["a", "bc", "é", "\n", " "])) if pick == 0
            else f"/{sound_regex(rng)}/" if pick == 1 else rng.choice(later))
    return atom + rng.choice(["", "", "?", "*", "+"])


def random_lark(rng: random.Random) -> str:
    """Rules whose alternatives are literals, regexes and later rules (the last rule ends
    the chain, but a mutation may well make a rule refer to itself, or to nothing)."""
    names = ["start", *(f"r{i}" for i in range(rng.randrange(3)))]
    lines = []
    for index, name in enumerate(names):
        later = names[index + 1:]
        alternatives = [" ".join(lark_item(rng, later) for _ in range(rng.randint(1, 3)))
                        for _ in range(rng.randint(1, 3))]
        lines.append(f"{name}: " + " | ".join(alternatives))
    grammar = "\n".join(lines)
    return mutate(rng, grammar, LARK_ATOMS) if rng.random() < 0.6 else grammar


def random_choices(rng: random.Random) -> list[str]:
    alphabet = 'ab "\\\n\té🎉{}'
    return ["".join(rng.choice(alphabet) for _ in range(rng.randrange(6)))
            for _ in range(rng.randrange(1, 5))]


FUZZ: dict[str, Callable[[random.Random], FormatSpec]] = {
    "json_schema": lambda rng: FormatSpec("json_schema", random_schema_text(rng),
                                          whitespace_flexible=rng.random() < 0.2),
    "regex": lambda rng: FormatSpec("regex", random_regex(rng)),
    "grammar": lambda rng: FormatSpec("grammar", random_lark(rng)),
    "choice": lambda rng: choice_spec(random_choices(rng), "choice"),
}
# Specs per kind. (With llguidance's forced-token search on, the 3,759th Lark spec of this seed
# hung its first mask fill and took 21 GB: test_a_grammar_forcing_bytes_forever_fills_its_mask.)
FUZZ_SPECS = 300


def smoke(backend: LLGuidanceBackend, compiled: CompiledFormat, rng: random.Random) -> str:
    """A few steps of a compiled fuzz format, on random allowed tokens: the matcher's error
    where one was refused ('' where none was). An allowed token may be refused only with an
    error: llguidance stops a matcher that passes its parser limits (a grammar with no end,
    such as `start: "a" start`, does after a few tokens), and says so."""
    matcher = compiled.new_matcher()
    row = np.zeros((1, backend.words), dtype=np.int32)
    for _ in range(3):
        if matcher.finished:
            return ""
        backend.fill_masks([matcher], row)
        allowed = allowed_tokens(row[0])
        if not len(allowed):
            return ""
        if not matcher.consume(int(rng.choice(allowed))):
            assert matcher.error, "an allowed token refused with no error"
            return matcher.error
    return ""


@pytest.mark.parametrize("kind", list(FUZZ))
def test_fuzz_formats_only_raise_format_error(kind: str, backend: LLGuidanceBackend) -> None:
    rng = random.Random(f"grammar-fuzz-{kind}")
    compiler = FormatCompiler(backend, cache_size=FUZZ_SPECS)
    compiled = refused = 0
    stopped: list[str] = []  # specs whose matchers stopped with an error (see smoke)
    started = time.perf_counter()
    try:
        for _ in range(FUZZ_SPECS):
            spec = FUZZ[kind](rng)
            try:
                result = compiler.compile(spec)
            except FormatError as error:
                assert str(error).startswith(f"{spec.field}: ")
                refused += 1
                continue
            except Exception as error:  # the point of the fuzz: name the spec
                pytest.fail(f"{spec!r} raised {error!r}")
            compiled += 1
            if smoke(backend, result, rng):
                stopped.append(spec.source)
    finally:
        compiler.close()
    print(f"{kind}: {compiled} compiled, {refused} refused, {len(stopped)} stopped on their "
          f"first tokens {stopped[:3]}, {time.perf_counter() - started:.2f} s")
    assert len(stopped) <= compiled // 10
    if kind == "choice":  # choice_spec's sources are sound: only empty choices are refused
        assert compiled >= FUZZ_SPECS // 2
    else:
        assert compiled >= FUZZ_SPECS // 10 and refused >= FUZZ_SPECS // 10, (compiled, refused)
