"""Structured output: a request's format compiled once, a matcher per output, token masks.

The gateway owns grammars (the runner only applies the masks it is given: runner.proto
ExecuteRequest.masks). A format (`FormatSpec`: a JSON schema, any JSON object, a regex, a
choice of strings, a Lark grammar, or the tool-call grammar of gateway/tools.py) is compiled at
admission, on the admission thread (never the event loop), under a time limit, and cached by
its text: a second request with the same schema starts at no cost. Each output of a request
gets its own `FormatMatcher` (a copy of the compiled one), advanced with every token the output
takes; its mask for the next token is filled into one row of a step's packed masks
(`MaskFiller`), ceil(vocab_size / 32) int32 words per row, bit j of word w allowing token
32 w + j.

The backend is llguidance (no dependencies, an abi3 wheel; bench/structured.py measures its
compile and mask times, with xgrammar's beside them where it is installed). `Backend` is the
seam another library would fill: compile a spec, copy a matcher, fill masks.
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import llguidance
import llguidance.numpy
import numpy as np

from protos import gateway_pb2

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# A format's text (schema, regex, grammar, choices) at most this long: a bigger one is refused
# before it is compiled.
MAX_FORMAT_BYTES = 64 * 1024
# A compile that takes longer is refused (the compile itself runs on and its result is
# dropped: llguidance bounds its own work with the parser limits below).
COMPILE_TIMEOUT_S = 5.0
# Compiled formats kept, most recently used first.
CACHE_SIZE = 256
# llguidance's lexer states (1-2 kB each) per matcher, at most: its default (250,000) would let
# one hostile schema hold hundreds of MB.
MAX_LEXER_STATES = 50_000

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "tools")


class FormatError(ValueError):
    """A format that cannot be served; the message starts with the request field at fault."""


@dataclass(frozen=True)
class FormatSpec:
    """What a request's output must match: `kind` is one of KINDS, `source` its text (a JSON
    schema as JSON text, a regex, choices as a JSON list, a Lark grammar). `field` names the
    request field it came from, for errors."""

    kind: str
    source: str = ""
    whitespace_flexible: bool = False
    # Not part of what is compiled (nor of the cache key): one schema from two fields is
    # one compile.
    field: str = dataclasses.field(default="structured_output", compare=False)

    def grammar(self) -> str:
        """The llguidance grammar (FormatError for a source that does not parse), without
        forced-token search: llguidance's search for the tokens a state forces can run
        without end, its memory growing, on grammars such as `start: /a+/ "a"`, and the masks
        need none of it."""
        return _without_forcing(self._grammar())

    def _grammar(self) -> str:
        if self.kind == "json_object":
            return self._json({"type": "object"})
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.source)
            except ValueError as error:
                raise FormatError(f"{self.field}: not JSON: {error}") from None
            if schema is True:
                schema = {}  # any value
            if schema is False:
                raise FormatError(f"{self.field}: the schema false allows no value")
            if not isinstance(schema, dict):
                raise FormatError(f"{self.field}: a JSON schema is an object or a boolean")
            return self._json(schema)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.source)
        if self.kind == "choice":
            try:
                choices = json.loads(self.source)
            except ValueError:
                choices = None
            if not (isinstance(choices, list) and choices
                    and all(isinstance(choice, str) and choice for choice in choices)):
                raise FormatError(f"{self.field}: give a list of non-empty strings")
            alternatives = " | ".join(json.dumps(choice) for choice in choices)
            return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
        if self.kind in ("grammar", "tools"):
            return llguidance.LLMatcher.grammar_from_lark(self.source)
        raise FormatError(f"{self.field}: unknown format {self.kind!r}")

    def _json(self, schema: dict) -> str:
        # One fixed spacing by default, json.dumps's (", " and ": "), which models have seen
        # most: a model free to put whitespace between tokens can write it until max_tokens
        # (vLLM #38696).
        options: JsonCompileOptions = {"whitespace_flexible": self.whitespace_flexible}
        if not self.whitespace_flexible:
            options["item_separator"] = ", "
            options["key_separator"] = ": "
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                                 defaults=options)
        except ValueError as error:
            raise FormatError(f"{self.field}: {error}") from None


def format_spec(output: gateway_pb2.StructuredOutput, field: str = "structured_output"
                ) -> FormatSpec | None:
    """A request's StructuredOutput as a spec (None when it sets no format); FormatError
    naming the field for an empty one."""
    kind = output.WhichOneof("format")
    if kind is None:
        return None
    flexible = output.whitespace_flexible
    if kind == "json_object":
        if not output.json_object:
            raise FormatError(f"{field}.json_object: set it true, or set no format")
        return FormatSpec("json_object", whitespace_flexible=flexible, field=field)
    if kind == "choice":
        return choice_spec(list(output.choice.values), f"{field}.choice")
    source = getattr(output, kind)
    if not source.strip():
        raise FormatError(f"{field}.{kind} is empty")
    return FormatSpec(kind, source, flexible, f"{field}.{kind}")


def choice_spec(choices: list[str], field: str) -> FormatSpec:
    """The format of one of `choices` exactly."""
    return FormatSpec("choice", json.dumps(choices), field=field)


def _without_forcing(grammar: str) -> str:
    """`grammar` (llguidance's JSON form, or Lark text) as Lark text with forced-token search
    off (a directive only Lark takes; put last, so that errors keep their line numbers)."""
    lark = grammar
    if grammar.lstrip().startswith("{"):
        [entry] = json.loads(grammar)["grammars"]
        lark = entry.get("lark_grammar") or "start: %json " + json.dumps(entry["json_schema"])
    return lark + '\n%llguidance {"no_forcing": true}\n'


class FormatMatcher(Protocol):
    """One output's place in its format."""

    def consume(self, token_id: int) -> bool:
        """Advances by a sampled token; False when the format does not allow it."""
        ...

    @property
    def finished(self) -> bool:
        """The format is complete (only an end-of-sequence token may follow), or the matcher
        failed (a token it did not allow: see `error`)."""
        ...

    @property
    def error(self) -> str:
        """Why the matcher failed ('' while it has not)."""
        ...


class CompiledFormat(Protocol):
    """A compiled format: a matcher at its start for each new output, and the backend that
    fills their masks."""

    @property
    def backend(self) -> Backend: ...

    def new_matcher(self) -> FormatMatcher: ...


class Backend(Protocol):
    """A structured-output library, behind the seam."""

    @property
    def words(self) -> int:
        """int32 words per mask row (the runner's vocabulary)."""
        ...

    def compile(self, spec: FormatSpec) -> CompiledFormat: ...

    def fill_masks(self, matchers: list[FormatMatcher], masks: np.ndarray) -> None:
        """Row i of `masks` [len(matchers), words] int32 gets matcher i's mask."""
        ...


class _LLMatcher:
    """FormatMatcher over an llguidance LLMatcher."""

    __slots__ = ("inner",)

    def __init__(self, inner: llguidance.LLMatcher) -> None:
        self.inner = inner

    def consume(self, token_id: int) -> bool:
        return self.inner.consume_token(token_id)

    @property
    def finished(self) -> bool:
        return self.inner.is_stopped() or self.inner.is_error()

    @property
    def error(self) -> str:
        return self.inner.get_error() if self.inner.is_error() else ""


@dataclass(frozen=True)
class _LLCompiled:
    start: llguidance.LLMatcher  # never advanced: each output takes a copy
    backend: LLGuidanceBackend

    def new_matcher(self) -> FormatMatcher:
        return _LLMatcher(self.start.deep_copy())


class LLGuidanceBackend:
    """llguidance: a tokenizer built once from the model's tokenizer.json."""

    def __init__(self, tokenizer_json: str, eos_token_ids: list[int], vocab_size: int) -> None:
        """`vocab_size`: the runner's (its logits' width), which the masks cover."""
        self.vocab_size = vocab_size
        self.words = -(-vocab_size // 32)
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, eos_token=eos_token_ids)
        # llguidance's masks cover its tokenizer's vocabulary; copied into the runner's width
        # (tokens past the tokenizer's are never allowed, past the runner's never sampled).
        self._own_words = -(-self.tokenizer.vocab_size // 32)
        self._limits = llguidance.LLParserLimits(max_lexer_states=MAX_LEXER_STATES)
        self._executor = llguidance.LLExecutor(num_threads=2)

    def compile(self, spec: FormatSpec) -> CompiledFormat:
        matcher = llguidance.LLMatcher(self.tokenizer, spec.grammar(), log_level=0,
                                       limits=self._limits)
        if not matcher.is_error():
            # The first mask, at admission: a grammar that cannot even start (e.g. one that
            # never ends, `start: "a" start`) is refused here rather than at its first step.
            probe = _LLMatcher(matcher.deep_copy())
            self.fill_masks([probe], np.zeros((1, self.words), dtype=np.int32))
            if probe.error:
                raise FormatError(f"{spec.field}: {_one_line(probe.error, spec)}")
        if matcher.is_error():
            raise FormatError(f"{spec.field}: {_one_line(matcher.get_error(), spec)}")
        return _LLCompiled(matcher, self)

    def fill_masks(self, matchers: list[FormatMatcher], masks: np.ndarray) -> None:
        if not matchers:
            return
        inner = [(m.inner, i) for i, m in enumerate(matchers)]  # type: ignore[attr-defined]
        if self._own_words == self.words:
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, inner, masks)
            return
        own = np.zeros((len(matchers), self._own_words), dtype=np.int32)
        llguidance.numpy.fill_next_token_bitmask_par(self._executor, inner, own)
        width = min(self.words, self._own_words)
        masks[:, :width] = own[:, :width]
        masks[:, width:] = 0


class FormatCompiler:
    """Compiles formats under a time limit and caches them by spec (concurrent requests for
    one spec share its compile)."""

    def __init__(self, backend: Backend, timeout_s: float = COMPILE_TIMEOUT_S,
                 cache_size: int = CACHE_SIZE) -> None:
        self.backend = backend
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self._cache: OrderedDict[FormatSpec, Future[CompiledFormat]] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="format-compile")
        self.compiles = 0  # compiles started (cache misses)

    def compile(self, spec: FormatSpec) -> CompiledFormat:
        """The compiled format (FormatError when it is invalid, too big or too slow)."""
        if len(spec.source.encode()) > MAX_FORMAT_BYTES:
            raise FormatError(f"{spec.field}: {len(spec.source.encode())} bytes; at most "
                              f"{MAX_FORMAT_BYTES}")
        future = self._future(spec)
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            self._drop(spec, future)
            raise FormatError(f"{spec.field}: took over {self.timeout_s:g} s to compile; "
                              "simplify it") from None
        except FormatError:
            self._drop(spec, future)
            raise

    def _future(self, spec: FormatSpec) -> Future[CompiledFormat]:
        with self._lock:
            future = self._cache.get(spec)
            if future is not None:
                self._cache.move_to_end(spec)
                return future
            future = self._pool.submit(self.backend.compile, spec)
            self.compiles += 1
            self._cache[spec] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return future

    def _drop(self, spec: FormatSpec, future: Future[CompiledFormat]) -> None:
        """Failed compiles are not kept: a retry may come under less load (time-outs), and a
        client must not be able to fill the cache with errors."""
        with self._lock:
            if self._cache.get(spec) is future:
                del self._cache[spec]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _one_line(message: str, spec: FormatSpec, limit: int = 400) -> str:
    """llguidance's error on one line, without the grammar it quotes (lines `N | ...`) and,
    but for a client's own Lark grammar, without the place in the grammar made of its spec."""
    lines = []
    for line in message.splitlines():
        if _QUOTED_LINE.match(line):
            break
        if line.strip():
            lines.append(line.strip())
    text = " ".join(lines) or "invalid"
    if spec.kind != "grammar":
        text = _GENERATED_PLACE.sub("", text)
    return text if len(text) <= limit else text[:limit - 3] + "..."


_QUOTED_LINE = re.compile(r"^\s*\d+ \|")
_GENERATED_PLACE = re.compile(r"^at \d+\(\d+\): (failed to compile JSON schema: )?")
