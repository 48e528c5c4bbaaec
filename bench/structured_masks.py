"""Structured output's CPU costs: compiling a JSON schema, and filling token masks per row.

For every schema of the corpus in tests/fixtures/schemas/, with the default model's tokenizer
(SmolLM2-135M-Instruct, 49,152 tokens), through gateway/grammar.py:

* compile, cold: a new FormatCompiler for each sample (its compile thread started first, as a
  running gateway's is), so the spec is a cache miss; what the first request with a schema
  waits for. Cached: the same spec again.
* mask fill per constrained row, over realistic walks: a matcher advanced through each valid
  instance of the schema, with the tokens a model masked by that matcher could write it with
  (`guided_tokens`: at each step the longest allowed token the text goes on with), the mask
  filled before every token and before the end of sequence. Timed one row per call, and 64
  rows per call: 64 outputs at staggered places of the schema's instances, one fill_masks
  call per step, a row's time being the call's / 64. The mixed batch draws its 64 outputs
  from every schema, as a server's step would.

The issue's targets, at the default model's vocabulary: mask fill mean <= 50 µs and p99
<= 0.5 ms per row; compile p99 <= 15 ms over the corpus.

xgrammar, where it imports, is measured beside llguidance on the same schemas and the same
token walks in the same run (compile_json_schema with json.dumps' separators and no other
whitespace, as the gateway compiles; GrammarMatcher and BatchGrammarMatcher for the masks).
It is no dependency of pagewire: install it apart, for instance
`pip install --no-deps --target DIR xgrammar apache-tvm-ffi` (torch, transformers, pydantic,
numpy and triton, its other requirements, are in .venv already), and pass --xgrammar-site DIR.

    .venv/bin/python -m bench.structured_masks [--repeats 20] [--walks 3] [--batch 64]
        [--xgrammar-site DIR | --no-xgrammar]
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import llguidance
import numpy as np

from bench.harness import RESULTS, ROOT, git_state, percentile, run_header, save_results
from gateway.grammar import (
    CompiledFormat,
    FormatCompiler,
    FormatError,
    FormatSpec,
    LLGuidanceBackend,
)
from gateway.tokenizer import load_tokenizer

CORPUS_DIR = ROOT / "tests" / "fixtures" / "schemas"
VOCAB = 49152  # the default model's logits
TARGET_FILL_MEAN_US = 50.0
TARGET_FILL_P99_US = 500.0
TARGET_COMPILE_P99_MS = 15.0


# ---- the corpus -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One file of the corpus (tests/fixtures/schemas/README.md says what each key holds)."""

    name: str
    schema: Any
    valid: list[Any]
    invalid: list[Any]
    description: str = ""
    # Valid by JSON Schema, refused by llguidance by design: [{"instance", "why"}].
    valid_refused: list[dict[str, Any]] = field(default_factory=list)
    # Invalid by JSON Schema, allowed by llguidance (an approximation): [{"instance", "why"}].
    invalid_accepted: list[dict[str, Any]] = field(default_factory=list)
    # A piece of the FormatError llguidance gives the schema ('' when it compiles).
    llguidance_refuses: str = ""

    @property
    def source(self) -> str:
        return json.dumps(self.schema)

    def instances(self) -> Iterator[tuple[str, Any]]:
        """(kind, instance) for every instance, the kind naming the list it came from."""
        yield from (("valid", x) for x in self.valid)
        yield from (("invalid", x) for x in self.invalid)
        yield from (("valid_refused", x["instance"]) for x in self.valid_refused)
        yield from (("invalid_accepted", x["instance"]) for x in self.invalid_accepted)


def load_corpus(folder: Path = CORPUS_DIR) -> list[Case]:
    return [Case(**json.loads(path.read_text())) for path in sorted(folder.glob("*.json"))]


# ---- masks and walks --------------------------------------------------------------------------


def allows(row: np.ndarray, token: int) -> bool:
    """Bit `token` of a packed mask row."""
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)


def allowed_tokens(row: np.ndarray) -> np.ndarray:
    """The tokens a packed mask row allows."""
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))


class TokenBytes:
    """Each token's bytes, and the tokens by their bytes: which tokens a text can go on
    with."""

    def __init__(self, tokenizer: llguidance.LLTokenizer) -> None:
        self.of: list[bytes] = [b"" if tokenizer.is_special_token(token)
                                else tokenizer.decode_bytes([token])
                                for token in range(tokenizer.vocab_size)]
        self.by_bytes: dict[bytes, list[int]] = {}
        for token, data in enumerate(self.of):
            if data:
                self.by_bytes.setdefault(data, []).append(token)
        self.longest = max(map(len, self.by_bytes))

    def starting(self, data: bytes) -> Iterator[int]:
        """Tokens whose bytes `data` starts with, longest first."""
        for length in range(min(self.longest, len(data)), 0, -1):
            yield from self.by_bytes.get(data[:length], ())


def guided_tokens(backend: LLGuidanceBackend, compiled: CompiledFormat, text: str,
                  token_bytes: TokenBytes, eos: int) -> list[int] | None:
    """The tokens, the end of sequence last, with which a model masked by a new matcher of
    `compiled` writes `text`: at each step the longest token the mask allows that the text
    goes on with. None where none is allowed (or the end of sequence is not): the format does
    not let a model write the text.

    llguidance's masks allow only the tokenizer's own tokens over bytes the format forces
    (`{"name": "` at the start of an object whose first member is required, `"}}` closing
    two objects), where `consume` takes any tokens with those bytes: a model cannot write
    every tokenization of a valid text, but it can write every valid text this way."""
    matcher = compiled.new_matcher()
    row = np.zeros((1, backend.words), dtype=np.int32)
    data = text.encode()
    tokens: list[int] = []
    at = 0
    while at < len(data):
        backend.fill_masks([matcher], row)
        token = next((t for t in token_bytes.starting(data[at:]) if allows(row[0], t)), None)
        if token is None:
            return None
        if not matcher.consume(token):
            raise AssertionError(f"the mask allowed token {token}, the matcher refused it")
        tokens.append(token)
        at += len(token_bytes.of[token])
    backend.fill_masks([matcher], row)
    if not allows(row[0], eos):
        return None
    if not matcher.consume(eos):
        raise AssertionError("the mask allowed the end of sequence, the matcher refused it")
    return [*tokens, eos]


# ---- the libraries, behind one face ---------------------------------------------------------


class Library(Protocol):
    name: str
    words: int

    def compile_cold(self, source: str) -> float:
        """Seconds to compile `source` with nothing cached."""
        ...

    def compile_cached(self, source: str) -> Any: ...

    def new_matcher(self, compiled: Any) -> Any: ...

    def consume(self, matcher: Any, token: int) -> bool: ...

    def fill(self, matchers: list[Any], rows: np.ndarray) -> None: ...


class LLGuidance:
    """gateway/grammar.py's backend and compiler, as the gateway uses them."""

    name = "llguidance"

    def __init__(self, backend: LLGuidanceBackend) -> None:
        self.backend = backend
        self.words = backend.words
        self.compiler = FormatCompiler(backend, cache_size=1024)

    def compile_cold(self, source: str) -> float:
        compiler = FormatCompiler(self.backend)
        try:
            compiler.compile(FormatSpec("json_object"))  # starts its compile thread
            start = time.perf_counter()
            compiler.compile(FormatSpec("json_schema", source))
            return time.perf_counter() - start
        finally:
            compiler.close()

    def compile_cached(self, source: str) -> CompiledFormat:
        return self.compiler.compile(FormatSpec("json_schema", source))

    def new_matcher(self, compiled: CompiledFormat) -> Any:
        return compiled.new_matcher()

    def consume(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume(token))

    def fill(self, matchers: list[Any], rows: np.ndarray) -> None:
        self.backend.fill_masks(matchers, rows)


class XGrammar:
    """xgrammar, compiling as the gateway does: json.dumps' separators, no other whitespace,
    and JSON Schema's own additionalProperties (not xgrammar's strict mode)."""

    name = "xgrammar"

    def __init__(self, module: Any, model_folder: Path, eos: int) -> None:
        from transformers import AutoTokenizer

        self.xgr = module
        # The model's own tokenizer, its special tokens known as such: one rebuilt from
        # tokenizer.json alone would let xgrammar write "<|im_start|>" inside a string.
        hf = AutoTokenizer.from_pretrained(str(model_folder))
        info = module.TokenizerInfo.from_huggingface(hf, vocab_size=VOCAB, stop_token_ids=[eos])
        self.words = -(-VOCAB // 32)
        # Two threads, as llguidance's executor has (and this machine's CPUs, often).
        self.cold = module.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self.cached = module.GrammarCompiler(info, max_threads=2)
        self.batch = module.BatchGrammarMatcher(max_threads=2)

    def _compile(self, compiler: Any, source: str) -> Any:
        return compiler.compile_json_schema(source, any_whitespace=False,
                                            separators=(", ", ": "), strict_mode=False)

    def compile_cold(self, source: str) -> float:
        start = time.perf_counter()
        self._compile(self.cold, source)
        return time.perf_counter() - start

    def compile_cached(self, source: str) -> Any:
        return self._compile(self.cached, source)

    def new_matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def consume(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))

    def fill(self, matchers: list[Any], rows: np.ndarray) -> None:
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(rows)
        else:
            self.batch.batch_fill_next_token_bitmask(matchers, rows)


def import_xgrammar(site: Path | None) -> tuple[Any, str]:
    """xgrammar, or None and why not. `site` is appended to sys.path: .venv's packages come
    first, so a folder of xgrammar alone cannot shadow them."""
    if site is not None:
        sys.path.append(str(site))
    try:
        return importlib.import_module("xgrammar"), ""
    except Exception as error:  # any failure to import is reported, not raised
        return None, f"xgrammar does not import ({error!r})"


# ---- measuring --------------------------------------------------------------------------------


def stats(samples: Sequence[float], scale: float) -> dict[str, float]:
    """mean, p50, p99 and max of `samples` (seconds) times `scale`."""
    if not samples:
        return {}
    return {"n": len(samples), "mean": statistics.fmean(samples) * scale,
            "p50": percentile(samples, 0.5) * scale, "p99": percentile(samples, 0.99) * scale,
            "max": max(samples) * scale}


def time_compiles(library: Library, source: str, repeats: int) -> dict[str, Any]:
    cold = [library.compile_cold(source) for _ in range(repeats)]
    library.compile_cached(source)
    cached = []
    for _ in range(repeats):
        start = time.perf_counter()
        library.compile_cached(source)
        cached.append(time.perf_counter() - start)
    return {"cold_ms": stats(cold, 1e3), "cached_us": stats(cached, 1e6), "cold_s": cold,
            "cached_s": cached}


@dataclass
class WalkResult:
    fills: list[float] = field(default_factory=list)  # seconds per single-row fill
    first: list[float] = field(default_factory=list)  # those of the first pass only
    rows: list[list[np.ndarray]] = field(default_factory=list)  # each walk's masks, once
    refused: list[tuple[int, int]] = field(default_factory=list)  # (walk, token) refused


def time_walks(library: Library, compiled: Any, walks: list[list[int]], repeats: int,
               keep_rows: bool) -> WalkResult:
    """Every walk `repeats` times, one row per fill, each fill timed."""
    result = WalkResult()
    row = np.zeros((1, library.words), dtype=np.int32)
    for repeat in range(repeats):
        for tokens in walks:
            matcher = library.new_matcher(compiled)
            if keep_rows and repeat == 0:
                result.rows.append([])
            for at, token in enumerate(tokens):
                start = time.perf_counter()
                library.fill([matcher], row)
                result.fills.append(time.perf_counter() - start)
                if repeat == 0:
                    result.first.append(result.fills[-1])
                if keep_rows and repeat == 0:
                    result.rows[-1].append(row[0].copy())
                if not library.consume(matcher, token):
                    if repeat == 0:
                        result.refused.append((walks.index(tokens), at))
                    break
    return result


def text_of(token_bytes: TokenBytes, tokens: list[int]) -> str:
    return b"".join(token_bytes.of[token] for token in tokens).decode(errors="replace")


def accepts_invalid(library: Library, compiled: Any, case: Case,
                    encode: Callable[[str], list[int]], eos: int) -> list[str]:
    """The instances invalid by JSON Schema that the library lets through whole (each as
    the tokenizer splits it): where its grammar is looser than the schema."""
    loose = []
    for kind, instance in case.instances():
        if kind not in ("invalid", "invalid_accepted"):
            continue
        text = json.dumps(instance, ensure_ascii=False)
        matcher = library.new_matcher(compiled)
        if all(library.consume(matcher, token) for token in [*encode(text), eos]):
            loose.append(text)
    return loose


@dataclass
class Lane:
    """One output of a batch: its walks in turn, its place in the current one."""

    compiled: Any
    walks: list[list[int]]
    walk: int = 0
    at: int = 0
    matcher: Any = None


def time_batch(library: Library, lanes: list[Lane], steps: int) -> list[float]:
    """`steps` fills of every lane's row in one call each; seconds per row."""
    for index, lane in enumerate(lanes):
        lane.matcher = library.new_matcher(lane.compiled)
        skip = index * 7 % len(lane.walks[lane.walk])  # stagger the lanes' places
        for token in lane.walks[lane.walk][:skip]:
            library.consume(lane.matcher, token)
        lane.at = skip
    rows = np.zeros((len(lanes), library.words), dtype=np.int32)
    per_row = []
    for _ in range(steps):
        start = time.perf_counter()
        library.fill([lane.matcher for lane in lanes], rows)
        per_row.append((time.perf_counter() - start) / len(lanes))
        for lane in lanes:
            advance(library, lane)
    return per_row


def advance(library: Library, lane: Lane) -> None:
    """The lane's next token; a new matcher on its next walk after the last (or a token the
    library refused: the walk is over for it too)."""
    tokens = lane.walks[lane.walk]
    ok = library.consume(lane.matcher, tokens[lane.at])
    lane.at += 1
    if lane.at == len(tokens) or not ok:
        lane.walk = (lane.walk + 1) % len(lane.walks)
        lane.at = 0
        lane.matcher = library.new_matcher(lane.compiled)


def lanes_for(compiled: list[Any], walks: list[list[list[int]]], batch: int) -> list[Lane]:
    """`batch` lanes over the schemas in turn, each starting on another of its walks."""
    lanes = []
    for index in range(batch):
        schema = index % len(compiled)
        lane_walks = walks[schema]
        lanes.append(Lane(compiled[schema], lane_walks, walk=(index // len(compiled))
                          % len(lane_walks)))
    return lanes


def compare_masks(reference: list[list[np.ndarray]], other: list[list[np.ndarray]],
                  special: list[int]) -> dict[str, int]:
    """Steps of the same walks at which two libraries' masks are the same, the reference's a
    strict subset of the other's (llguidance's forced tokens do that), or otherwise apart (a
    walk the other library refused a token of ends there); and the steps at which the other
    allows one of the `special` tokens (the end of sequence aside)."""
    counts = {"same": 0, "subset": 0, "apart": 0, "special": 0}
    pairs = [pair for mine, theirs in zip(reference, other, strict=True)
             for pair in zip(mine, theirs, strict=False)]
    for mine, theirs in pairs:
        if np.array_equal(mine, theirs):
            counts["same"] += 1
        elif np.array_equal(mine & theirs, mine):
            counts["subset"] += 1
        else:
            counts["apart"] += 1
        counts["special"] += any(allows(theirs, token) for token in special)
    return counts


# ---- the run ----------------------------------------------------------------------------------


@dataclass
class Setup:
    """What every measurement shares."""

    backend: LLGuidanceBackend  # llguidance's, which also guides the walks
    token_bytes: TokenBytes
    encode: Callable[[str], list[int]]  # the tokenizer's own split
    eos: int
    args: argparse.Namespace

    @property
    def special(self) -> list[int]:
        """The tokenizer's special tokens, the end of sequence aside."""
        return [token for token, data in enumerate(self.token_bytes.of)
                if not data and token != self.eos]


def walks_for(setup: Setup, case: Case, entry: dict[str, Any]) -> list[list[int]]:
    """Each valid instance as a model masked by llguidance writes it, the end of sequence
    last; where llguidance refuses the schema, as the tokenizer splits it (for the others)."""
    try:
        compiled = setup.backend.compile(FormatSpec("json_schema", case.source))
    except FormatError as error:
        entry["llguidance_error"] = str(error)
        return [[*setup.encode(json.dumps(x, ensure_ascii=False)), setup.eos]
                for x in case.valid]
    guided = [guided_tokens(setup.backend, compiled, json.dumps(x, ensure_ascii=False),
                            setup.token_bytes, setup.eos) for x in case.valid]
    walks = [tokens for tokens in guided if tokens is not None]
    entry["unwritable"] = len(guided) - len(walks)
    return walks


def measure_case(setup: Setup, library: Library, case: Case, walks: list[list[int]],
                 reference: list[list[np.ndarray]]) -> tuple[dict[str, Any], Any, WalkResult]:
    """One library on one schema: its figures, its compiled format (None where it refused
    the schema) and its single-row walks."""
    figures: dict[str, Any] = {}
    try:
        figures.update(time_compiles(library, case.source, setup.args.repeats))
        compiled = library.compile_cached(case.source)
    except Exception as error:  # a library's refusal is a result
        figures["error"] = f"{type(error).__name__}: {error}"
        return figures, None, WalkResult()
    walked = time_walks(library, compiled, walks, setup.args.walks, keep_rows=True)
    figures["fill_us"] = stats(walked.fills, 1e6)
    figures["fills_s"] = walked.fills
    figures["first_s"] = walked.first
    figures["walks_refused"] = [
        {"text": text_of(setup.token_bytes, walks[walk][:at]),
         "token": text_of(setup.token_bytes, walks[walk][at:at + 1])}
        for walk, at in walked.refused]
    figures["invalid_accepted"] = accepts_invalid(library, compiled, case, setup.encode,
                                                  setup.eos)
    if reference and library.name != "llguidance":
        figures["masks_vs_llguidance"] = compare_masks(reference, walked.rows, setup.special)
    lanes = lanes_for([compiled], [walks], setup.args.batch)
    figures["batch_row_us"] = stats(time_batch(library, lanes, setup.args.steps), 1e6)
    return figures, compiled, walked


def measure(setup: Setup, libraries: list[Library], cases: list[Case],
            log: Callable[[str], None]) -> dict[str, Any]:
    schemas: list[dict[str, Any]] = []
    kept: dict[tuple[str, str], tuple[Any, list[list[int]]]] = {}  # compiled and walks
    for case in cases:
        entry: dict[str, Any] = {"name": case.name}
        schemas.append(entry)
        walks = walks_for(setup, case, entry)
        entry["walk_tokens"] = sum(map(len, walks))
        reference: list[list[np.ndarray]] = []  # llguidance's masks, to compare
        for library in libraries:
            figures, compiled, walked = measure_case(setup, library, case, walks, reference)
            entry[library.name] = figures
            if library.name == "llguidance":
                reference = walked.rows
            if compiled is not None and walks:
                kept[case.name, library.name] = (compiled, walks)
        log(line_for(entry, libraries))
    overall, common = summarize(setup, libraries, schemas, kept)
    for entry in schemas:  # the raw samples made the overall figures; the file keeps stats
        for library in libraries:
            for key in ("cold_s", "cached_s", "fills_s", "first_s"):
                entry[library.name].pop(key, None)
    return {"schemas": schemas, "overall": overall, "common": common}


def summarize(setup: Setup, libraries: list[Library], schemas: list[dict[str, Any]],
              kept: dict[tuple[str, str], tuple[Any, list[list[int]]]],
              ) -> tuple[dict[str, Any], list[str]]:
    """Overall figures over the schemas every library compiled (the same work for each),
    with a batch mixing them all; and those schemas' names."""
    common = [entry["name"] for entry in schemas
              if all((entry["name"], library.name) in kept for library in libraries)]
    overall = {}
    for library in libraries:
        pairs = [kept[name, library.name] for name in common]
        lanes = lanes_for([c for c, _ in pairs], [w for _, w in pairs], setup.args.batch)
        mixed_batch = time_batch(library, lanes, setup.args.steps * 2) if lanes else []
        entries = [entry[library.name] for entry in schemas if entry["name"] in common]
        overall[library.name] = {
            "compile_cold_ms": stats([s for e in entries for s in e["cold_s"]], 1e3),
            "compile_cached_us": stats([s for e in entries for s in e["cached_s"]], 1e6),
            "fill_us": stats([s for e in entries for s in e["fills_s"]], 1e6),
            "fill_first_pass_us": stats([s for e in entries for s in e["first_s"]], 1e6),
            "batch_mixed_row_us": stats(mixed_batch, 1e6),
            "refused_schemas": [entry["name"] for entry in schemas
                                if "error" in entry[library.name]],
        }
    return overall, common


def line_for(entry: dict[str, Any], libraries: list[Library]) -> str:
    parts = [f"{entry['name']}:"]
    for library in libraries:
        figures = entry.get(library.name, {})
        if "error" in figures:
            parts.append(f"{library.name} refused it")
        elif figures:
            fill = figures.get("fill_us", {})
            parts.append(f"{library.name} compile {figures['cold_ms']['p50']:.2f} ms, fill "
                         f"{fill.get('mean', float('nan')):.1f} µs/row")
    return " ".join(parts)


def targets(overall: dict[str, Any]) -> dict[str, bool]:
    fill = overall["fill_us"]
    batch = overall["batch_mixed_row_us"]
    return {
        "fill_mean": fill["mean"] <= TARGET_FILL_MEAN_US,
        "fill_p99": fill["p99"] <= TARGET_FILL_P99_US,
        "batch_mean": bool(batch) and batch["mean"] <= TARGET_FILL_MEAN_US,
        "batch_p99": bool(batch) and batch["p99"] <= TARGET_FILL_P99_US,
        "compile_p99": overall["compile_cold_ms"]["p99"] <= TARGET_COMPILE_P99_MS,
    }


# ---- the report -------------------------------------------------------------------------------


def three(figures: dict[str, float] | None, spec: str = ".1f") -> str:
    """mean / p50 / p99 in one cell."""
    if not figures:
        return "–"
    return " / ".join(f"{figures[key]:{spec}}" for key in ("mean", "p50", "p99"))


def yes(met: bool) -> str:
    return "met" if met else "**not met**"


def markdown(data: dict[str, Any]) -> str:
    names = data["libraries"]
    overall = data["overall"]
    lines = ["# Structured output: compile and mask-fill costs per schema", "",
             f"`{data['command']}` — {data['measured_at']}, git {data['git']}, "
             f"{data['cpus']} CPUs, load average {data['load_before']:.2f} before the run; "
             f"llguidance {data['versions']['llguidance']}"
             + (f", xgrammar {data['versions']['xgrammar']}" if "xgrammar" in names else "")
             + f"; vocabulary {VOCAB:,}.", "",
             f"{data['cases']} schemas of tests/fixtures/schemas/, {data['walk_tokens']:,} "
             f"tokens over their valid instances (bench/structured_masks.py's docstring says "
             f"how each figure is taken). Cold compiles: {data['repeats']} per schema; "
             f"single-row fills: every walk {data['walks']} times; batches of "
             f"{data['batch']} rows, {data['steps']} steps per schema and "
             f"{2 * data['steps']} mixed.", ""]
    if data.get("xgrammar_note"):
        lines += [data["xgrammar_note"], ""]
    lines += ["## Against the targets", "",
              f"Over the {len(data['common'])} schemas every library compiled.", "",
              "| figure | " + " | ".join(names) + " | target | met |",
              "|---|" + "---:|" * len(names) + "---|---|"]
    met = data["targets"]
    rows = [
        ("compile cold, mean / p50 / p99 (ms)", "compile_cold_ms", ".2f",
         f"p99 ≤ {TARGET_COMPILE_P99_MS:g} ms", ["compile_p99"]),
        ("compile cached: mean / p50 / p99 (µs)", "compile_cached_us", ".1f", "", []),
        ("mask fill, 1 row per call: mean / p50 / p99 (µs)", "fill_us", ".1f",
         f"mean ≤ {TARGET_FILL_MEAN_US:g} µs, p99 ≤ {TARGET_FILL_P99_US:g} µs",
         ["fill_mean", "fill_p99"]),
        ("… of which the first pass over each walk (states built as they are met)",
         "fill_first_pass_us", ".1f", "", []),
        (f"mask fill, {data['batch']} mixed rows per call, per row: mean / p50 / p99 (µs)",
         "batch_mixed_row_us", ".1f", "the same", ["batch_mean", "batch_p99"]),
    ]
    for label, key, spec, target, checks in rows:
        cells = [three(overall[name][key], spec) for name in names]
        verdict = "; ".join(f"{name} {yes(all(met[name][c] for c in checks))}"
                            for name in names) if checks else ""
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {target} | {verdict} |")
    lines += ["", "## Compile per schema", "",
              "Cold: mean / p50 / p99 ms; cached: p50 µs.", "",
              "| schema | " + " | ".join(f"{n} cold | {n} cached" for n in names) + " |",
              "|---|" + "---:|---:|" * len(names)]
    for entry in data["schemas"]:
        cells = []
        for name in names:
            figures = entry.get(name, {})
            if "error" in figures:
                cells += ["refused", "–"]
            else:
                cells += [three(figures.get("cold_ms"), ".2f"),
                          f"{figures['cached_us']['p50']:.1f}"]
        lines.append(f"| {entry['name']} | " + " | ".join(cells) + " |")
    lines += ["", "## Mask fill per schema", "",
              f"Per row, mean / p50 / p99 µs: one row per call, and {data['batch']} rows per "
              "call (that call's time / rows).", "",
              "| schema | tokens | " + " | ".join(f"{n} 1 row | {n} ×{data['batch']}"
                                                  for n in names) + " |",
              "|---|---:|" + "---:|---:|" * len(names)]
    for entry in data["schemas"]:
        cells = []
        for name in names:
            figures = entry.get(name, {})
            cells += [three(figures.get("fill_us")), three(figures.get("batch_row_us"))]
        lines.append(f"| {entry['name']} | {entry['walk_tokens']} | " + " | ".join(cells)
                     + " |")
    lines += ["", "## Notes", ""] + [f"- {note}" for note in data["notes"]]
    return "\n".join(lines) + "\n"


def notes(data: dict[str, Any]) -> list[str]:
    found = []
    for entry in data["schemas"]:
        if "llguidance_error" in entry:
            found.append(f"llguidance refuses {entry['name']}: {entry['llguidance_error']}")
        for name in data["libraries"]:
            figures = entry.get(name, {})
            if "error" in figures and name != "llguidance":
                found.append(f"{name} refuses {entry['name']}: {figures['error'][:200]}")
            for refusal in figures.get("walks_refused", []):
                found.append(f"{name} refuses a valid instance of {entry['name']}: "
                             f"{refusal['token']!r} after …{refusal['text'][-40:]!r}")
            for text in figures.get("invalid_accepted", []):
                found.append(f"{name} lets an invalid instance of {entry['name']} through: "
                             f"{text[:80]}")
        if entry.get("unwritable"):
            found.append(f"{entry['unwritable']} valid instances of {entry['name']} cannot be "
                         "written under llguidance's mask (left out of the walks)")
    if "xgrammar" in data["libraries"]:
        counts = {"same": 0, "subset": 0, "apart": 0, "special": 0}
        for entry in data["schemas"]:
            for key, value in entry.get("xgrammar", {}).get("masks_vs_llguidance", {}).items():
                counts[key] += value
        total = counts["same"] + counts["subset"] + counts["apart"] or 1
        found.append(
            f"Masks at the same steps of the same walks: {counts['same']} of {total} "
            f"({counts['same'] / total:.0%}) the same in both libraries, {counts['subset']} "
            f"({counts['subset'] / total:.0%}) llguidance's a strict subset of xgrammar's "
            "(over bytes the format forces llguidance allows only the tokenizer's own "
            f"tokens), {counts['apart']} ({counts['apart'] / total:.0%}) otherwise apart. "
            f"At {counts['special']} steps xgrammar allows one of the tokenizer's special "
            "tokens (<|im_start|>, <filename>, ...): its TokenizerInfo.from_huggingface "
            "takes them for text, which a JSON string may hold; llguidance never allows them.")
        direct = data["direct_compile_ms"]
        found.append("xgrammar compiles in the calling thread; llguidance's cold figures "
                     "include FormatCompiler's hand-off to its compile thread (llguidance's "
                     f"own compile alone: p50 {direct['p50']:.2f} ms, p99 {direct['p99']:.2f} "
                     "ms).")
    found.append("The machine is shared: p99 figures carry other processes' noise; the "
                 "load average is in the first line.")
    return found


def direct_compile_ms(backend: LLGuidanceBackend, cases: list[Case],
                      repeats: int) -> dict[str, float]:
    """llguidance's compile without FormatCompiler's thread hop, over the corpus."""
    samples = []
    for case in cases:
        for _ in range(repeats):
            start = time.perf_counter()
            try:
                backend.compile(FormatSpec("json_schema", case.source))
            except FormatError:
                break
            samples.append(time.perf_counter() - start)
    return stats(samples, 1e3)


def load_libraries(args: argparse.Namespace, backend: LLGuidanceBackend, model_folder: Path,
                   eos: int) -> tuple[list[Library], dict[str, str], str]:
    """The libraries to measure, their versions, and why xgrammar is not among them."""
    libraries: list[Library] = [LLGuidance(backend)]
    versions = {"llguidance": importlib.metadata.version("llguidance")}
    if args.no_xgrammar:
        return libraries, versions, "xgrammar: not measured (--no-xgrammar)."
    module, why = import_xgrammar(args.xgrammar_site)
    if module is None:
        return libraries, versions, (
            f"xgrammar: not measured: {why}. Install it apart (pip install --no-deps --target "
            "DIR xgrammar apache-tvm-ffi) and pass --xgrammar-site DIR.")
    try:
        libraries.append(XGrammar(module, model_folder, eos))
    except Exception as error:  # reported in the results, not raised
        return libraries, versions, f"xgrammar: imports but does not start: {error!r}"
    versions["xgrammar"] = importlib.metadata.version("xgrammar")
    return libraries, versions, ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20, help="cold compiles per schema")
    parser.add_argument("--walks", type=int, default=3, help="single-row passes per walk")
    parser.add_argument("--batch", type=int, default=64, help="rows per batched fill")
    parser.add_argument("--steps", type=int, default=64, help="batched fills per schema")
    parser.add_argument("--xgrammar-site", type=Path,
                        help="a folder xgrammar is installed in (pip install --target)")
    parser.add_argument("--no-xgrammar", action="store_true")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    tokenizer = load_tokenizer(None)
    eos = tokenizer.eos_token_id
    assert eos is not None
    backend = LLGuidanceBackend(tokenizer.backend_json(), [eos], VOCAB)
    libraries, versions, note = load_libraries(args, backend, tokenizer.folder, eos)
    if note:
        print(note, flush=True)
    cases = load_corpus()
    data: dict[str, Any] = {
        **run_header("-m bench.structured_masks", argv), "git": git_state(),
        "cpus": os.cpu_count(), "load_before": os.getloadavg()[0], "versions": versions,
        "libraries": [library.name for library in libraries], "xgrammar_note": note,
        "cases": len(cases), "repeats": args.repeats, "walks": args.walks,
        "batch": args.batch, "steps": args.steps,
        "targets_set": {"fill_mean_us": TARGET_FILL_MEAN_US, "fill_p99_us": TARGET_FILL_P99_US,
                        "compile_p99_ms": TARGET_COMPILE_P99_MS}}
    setup = Setup(backend, TokenBytes(backend.tokenizer), tokenizer.encode, eos, args)
    data.update(measure(setup, libraries, cases, lambda text: print(text, flush=True)))
    data["walk_tokens"] = sum(entry["walk_tokens"] for entry in data["schemas"])
    data["direct_compile_ms"] = direct_compile_ms(backend, cases, args.repeats)
    data["targets"] = {name: targets(data["overall"][name]) for name in data["libraries"]}
    data["notes"] = notes(data)
    save_results(args.results, "structured_masks", data, markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
