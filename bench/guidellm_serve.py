"""Online serving over OpenAI's HTTP API, measured by GuideLLM: pagewire vs `vllm serve`.

    .venv/bin/python bench/guidellm_serve.py                  # both engines (~10 minutes)
    .venv/bin/python bench/guidellm_serve.py --quick          # 30 s per step (~7 minutes)
    .venv/bin/python bench/guidellm_serve.py --engines vllm --streams 1,8 --seconds 30

What it measures: what a GuideLLM user sees of each engine: requests/s, output tokens/s,
TTFT, ITL and TPOT at a fixed number of concurrent streams, per step of the profile.

How: each engine in turn (`--engines`, default pagewire then vLLM) on a fresh launch: start its
server (bench/openai_serve.py's `pagewire_server` / `vllm_server`), wait until
`GET /v1/models` answers, warm up with an untimed GuideLLM run (the largest stream count, one
request per stream, another seed), settle the machine (bench/w1.py's wait_until_quiet), then
one timed GuideLLM run (0.8.1, `.venv-vllm/bin/guidellm`, installed by `make bench-peers`):

    guidellm run --backend kind=openai_http,target=http://127.0.0.1:PORT,model=SERVED_NAME
        --profile kind=concurrent --override profile.streams 1,4,16
        --constraint kind=max_duration,seconds=60
        --data kind=synthetic_text,prompt_tokens=256,output_tokens=128
        --data-loader kind=pytorch,prefetch_factor=16
        --tokenizer kind=huggingface_auto,model=MODEL_DIR --seed kind=static,value=42
        --output kind=json,path=...

GuideLLM's defaults otherwise: the backend's chat-completions request format
(`/v1/chat/completions`, streamed, `stream_options` with `include_usage` and
`continuous_usage_stats`, `max_completion_tokens` = the synthetic output length with
`ignore_eos: true`, no sampling parameters), up to 10 worker processes, token counts from the
server's usage. One change to how the client works, not to what it sends: GuideLLM's data
loader prefetches 4096 prompts by default, in a worker process that builds each (Faker text,
tokenized and cut) as fast as it can from the run's start: here that took ~12 CPU-seconds of
the two cores the server under test runs on (pagewire at 4 streams for 40 s: 46.4 output tok/s
with it, 61.9 with a prefetch of 16, TTFT p50 1.19 vs 0.77 s). With `prefetch_factor=16`
(`--data-prefetch`; 4096 restores GuideLLM's default) it builds prompts as they are taken; the
prompts and their order are the same (the seed's). What the client used is reported per
engine (`client_cpu_s`: GuideLLM and its worker processes, over `client_wall_s`).

The profile: GuideLLM's quick start is a `sweep` (synchronous, throughput and
8 constant rates between them, 30 s each); its bundled scenarios (`rhaiis/concurrent-*`) are
`concurrent` profiles over stream counts with a `max_duration` per step. This bench takes the
latter: a sweep places its rates from each engine's own throughput, so two engines would not
meet the same load at a step, while a stream count is the same load for both. Each step runs
`--seconds` (default 60; `--quick` 30), after which GuideLLM cancels the requests in flight
(at most the stream count: "incomplete", not errors); throughput is GuideLLM's own over all
requests (what its console prints as Server Throughput), latencies over completed ones.
The synthetic prompts: 256 tokens by the tokenizer of the very folder both servers load
(common.model_store's default model, read offline: HF_HUB_OFFLINE=1), each starting with a
per-request counter (GuideLLM's, so no two share a prefix beyond the chat template), from the
same seed for both engines; the servers add the chat template, so their prompt token count
(reported) is larger.

Checks, per step: no errored request (the bench fails and prints GuideLLM's error and, as
GuideLLM keeps only an HTTP error's status line, the server's own answer to a request body of
the run sent once more), at least one completed request, and every completed request produced
exactly the output tokens asked (128: GuideLLM sends ignore_eos); a step that ends before any
request completes (one request outlasts a short step at 16 streams) has no latencies but fails
only when no output token came. An engine that fails a check is not ranked.

Equal treatment (bench/openai_serve.py's server settings, imported): both servers on every
core this process may run on (vLLM bound to them with VLLM_CPU_OMP_THREADS_BIND), float32,
max model length 2048, 2 GiB of KV cache each, prefix caching on, 2048 batched tokens and 256
sequences, the same served model name. Sampling: GuideLLM sends no temperature or top_p, so
each server applies its default, and both take it from the model's generation_config.json
(temperature 0.2, top_p 0.9 for the default model): pagewire serve by default, vllm serve with
its default `--generation-config auto`; each record's `default_sampling` says what the server
reported (pagewire's /v1/models, vLLM's start-up log). The client (GuideLLM, in .venv-vllm)
shares the cores with the server under test, the same for both.

Results: bench/results/guidellm_serve.{json,md}, rewritten after each engine. Exit status 1
when an engine failed a check or could not be measured.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.harness import (  # noqa: E402
    RESULTS,
    STARTUP_TIMEOUT_S,
    Server,
    git_state,
    log_tail,
    run_header,
    save_results,
)
from bench.openai_serve import (  # noqa: E402
    ENGINES,
    NAMES,
    OFFLINE,
    comma_choices,
    pagewire_server,
    vllm_server,
)
from bench.w1 import WARM_UP_SEED, wait_until_quiet  # noqa: E402

GUIDELLM = ROOT / ".venv-vllm" / "bin" / "guidellm"
STREAMS = (1, 4, 16)
STEP_SECONDS = 60.0
QUICK_STEP_SECONDS = 30.0  # 20 s was shorter than vLLM's first 16 requests here
DATA_PREFETCH = 16  # GuideLLM's default: 4096 (see the module docstring)
PROMPT_TOKENS = 256
OUTPUT_TOKENS = 128
SEED = 42  # GuideLLM's own default seed
STEP_OVERHEAD_S = 120.0  # GuideLLM's per-step start and wind-down, generously
RUN_OVERHEAD_S = 300.0
REPLAY_TIMEOUT_S = 60.0
ERROR_EXAMPLES = 3
SENT_AGAIN = "a request GuideLLM sent, sent again"


# ---------------------------------------------------------------- the client


def spec(**fields: Any) -> str:
    """A GuideLLM registry option: `kind=...,key=value` or, where a value holds a comma or an
    equals sign (a folder may), the same as JSON, which the option also takes."""
    values = {key: str(value) if isinstance(value, Path) else value
              for key, value in fields.items()}
    if any(ch in str(value) for value in values.values() for ch in ",="):
        return json.dumps(values)
    return ",".join(f"{key}={value}" for key, value in values.items())


def guidellm_command(server: Server, model_dir: Path, streams: Sequence[int],
                     constraint: dict[str, Any], prompt_tokens: int, output_tokens: int,
                     seed: int, output: Path, prefetch: int = DATA_PREFETCH) -> list[str]:
    return [str(GUIDELLM), "run",
            "--backend", spec(kind="openai_http", target=server.base_url,
                              model=server.served_name),
            "--profile", "kind=concurrent",
            "--override", "profile.streams", ",".join(str(s) for s in streams),
            "--constraint", spec(**constraint),
            "--data", spec(kind="synthetic_text", prompt_tokens=prompt_tokens,
                           output_tokens=output_tokens),
            "--data-loader", spec(kind="pytorch", prefetch_factor=prefetch),
            "--tokenizer", spec(kind="huggingface_auto", model=model_dir),
            "--seed", spec(kind="static", value=seed),
            "--output", spec(kind="json", path=output),
            "--disable-progress"]


def run_guidellm(command: list[str], output: Path, log_path: Path, timeout_s: float,
                 usage: dict[str, float] | None = None) -> dict[str, Any]:
    """Runs GuideLLM; its JSON report. Raises with the tail of its log when it fails. `usage`
    gets the client's CPU seconds (GuideLLM and the worker processes it reaped: this
    process's children while it waits, the server not being one it has reaped) and wall
    seconds."""
    before, started = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    with open(log_path, "w") as log:
        done = subprocess.run(command, stdout=log, stderr=log, env={**os.environ, **OFFLINE},
                              timeout=timeout_s, check=False)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if usage is not None:
        usage["client_cpu_s"] = (after.ru_utime + after.ru_stime
                                 - before.ru_utime - before.ru_stime)
        usage["client_wall_s"] = time.perf_counter() - started
    if done.returncode != 0 or not output.is_file():
        raise RuntimeError(f"guidellm exited with {done.returncode}; its log:\n"
                           f"{log_tail(log_path)}")
    report: dict[str, Any] = json.loads(output.read_text())
    return report


# ---------------------------------------------------------------- reading GuideLLM's report


def _stat(metrics: dict[str, Any], name: str, status: str, key: str) -> float | None:
    """One statistic of a GuideLLM StatusDistributionSummary (`mean`, `min`, `max`, `count`,
    or a percentile such as `p50`); None where the metric or status is absent or empty."""
    summary = (metrics.get(name) or {}).get(status)
    if not summary or not summary.get("count"):
        return None
    value = summary["percentiles"].get(key) if key.startswith("p") else summary.get(key)
    return None if value is None else float(value)


def step_label(config: dict[str, Any]) -> str:
    """`concurrent@4` for a concurrent step (GuideLLM's own name for it); the strategy type
    and its rate otherwise."""
    strategy = config.get("strategy", {})
    kind = strategy.get("type_", "?")
    if strategy.get("streams") is not None:
        return f"{kind}@{strategy['streams']}"
    if strategy.get("rate") is not None:
        return f"{kind}@{strategy['rate']:g}"
    return str(kind)


def error_examples(benchmark: dict[str, Any], limit: int = ERROR_EXAMPLES) -> list[str]:
    """The distinct messages GuideLLM recorded for errored requests, at most `limit`."""
    found: list[str] = []
    for request in (benchmark.get("requests") or {}).get("errored") or []:
        message = str((request.get("info") or {}).get("error") or "no message")
        # httpx's message has a second line (a pointer to MDN's status pages), escaped in
        # the exception's repr GuideLLM records
        message = re.split(r"\n|\\n", message)[0]
        if message not in found:
            found.append(message)
        if len(found) == limit:
            break
    return found


def step_row(benchmark: dict[str, Any], output_tokens: int) -> dict[str, Any]:
    """One step of the profile as a table row, with its checks in `problems` (failures) and
    `notes`."""
    metrics = benchmark["metrics"]
    totals = metrics["request_totals"]
    config = benchmark["config"]
    row: dict[str, Any] = {
        "step": step_label(config),
        "streams": config.get("strategy", {}).get("streams"),
        "duration_s": benchmark.get("duration"),
        "successful": totals["successful"], "errored": totals["errored"],
        "incomplete": totals["incomplete"],
        # GuideLLM's console (Server Throughput): over every request of the window.
        "requests_per_s": _stat(metrics, "requests_per_second", "total", "mean"),
        "output_tokens_per_s": _stat(metrics, "output_tokens_per_second", "total", "mean"),
        "completed_per_s": _stat(metrics, "requests_per_second", "successful", "mean"),
        "ttft_p50_ms": _stat(metrics, "time_to_first_token_ms", "successful", "p50"),
        "ttft_p99_ms": _stat(metrics, "time_to_first_token_ms", "successful", "p99"),
        "itl_p50_ms": _stat(metrics, "inter_token_latency_ms", "successful", "p50"),
        "itl_p99_ms": _stat(metrics, "inter_token_latency_ms", "successful", "p99"),
        "tpot_p50_ms": _stat(metrics, "time_per_output_token_ms", "successful", "p50"),
        "latency_p50_s": _stat(metrics, "request_latency", "successful", "p50"),
        "output_tokens_min": _stat(metrics, "output_token_count", "successful", "min"),
        "output_tokens_max": _stat(metrics, "output_token_count", "successful", "max"),
        "prompt_tokens_p50": _stat(metrics, "prompt_token_count", "successful", "p50"),
        "errors": error_examples(benchmark),
    }
    row["problems"] = check_step(row, output_tokens)
    row["notes"] = ([] if row["successful"] or row["problems"] else
                    ["no request completed within the step (shorter than one request here: "
                     "lengthen --seconds); no latencies"])
    return row


def check_step(row: dict[str, Any], output_tokens: int) -> list[str]:
    """What is wrong with one step: empty when no request errored, tokens came, and every
    completed request produced exactly `output_tokens` tokens. (A step may end before any
    request completes: not a failure while tokens came.)"""
    problems = []
    if row["errored"]:
        why = "; ".join(row["errors"]) or "GuideLLM recorded no message"
        problems.append(f"{row['errored']} requests errored: {why}")
    if not row["successful"]:
        if not row["output_tokens_per_s"]:
            problems.append("no request completed and no output token came")
    else:
        counts = {row["output_tokens_min"], row["output_tokens_max"]}
        if counts != {float(output_tokens)}:
            low, high = row["output_tokens_min"], row["output_tokens_max"]
            problems.append(f"completed requests produced {low:g}-{high:g} output tokens, "
                            f"not {output_tokens}" if low is not None and high is not None
                            else "no output token counts for completed requests")
    return problems


def summarize(report: dict[str, Any], output_tokens: int) -> dict[str, dict[str, Any]]:
    """Every step of a GuideLLM report, by its label, in the order it ran."""
    return {row["step"]: row for row in (step_row(b, output_tokens)
                                         for b in report.get("benchmarks", []))}


def sent_body(report: dict[str, Any]) -> dict[str, Any] | None:
    """A request body as GuideLLM sent it in this run: an errored request's where GuideLLM
    kept it (0.8.1 keeps none: `request_args` is null there), else a completed or cancelled
    one's (the same shape, another prompt)."""
    for status in ("errored", "successful", "incomplete"):
        for benchmark in report.get("benchmarks", []):
            for request in (benchmark.get("requests") or {}).get(status) or []:
                args = request.get("request_args")
                if isinstance(args, str):
                    try:
                        args = json.loads(args)
                    except ValueError:
                        continue
                if isinstance(args, dict) and isinstance(args.get("body"), dict):
                    return dict(args["body"])
    return None


def guidellm_body(model: str, output_tokens: int) -> dict[str, Any]:
    """The body GuideLLM 0.8.1 sends for a synthetic chat request (as its reports show), with
    a short prompt: for when the report kept none."""
    return {"model": model, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "max_completion_tokens": output_tokens, "ignore_eos": True,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}]}


def replay(base_url: str, path: str, body: dict[str, Any]) -> str:
    """Sends a GuideLLM request body once more, alone, and returns the server's answer when it
    is not a success: GuideLLM records only the status line of an HTTP error."""
    request = urllib.request.Request(f"{base_url}{path}", method="POST",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=REPLAY_TIMEOUT_S) as reply:
            reply.read()
            return f"{SENT_AGAIN}: HTTP {reply.status} (accepted alone)"
    except urllib.error.HTTPError as error:
        return f"{SENT_AGAIN}: HTTP {error.code}: {error.read().decode(errors='replace')[:500]}"
    except OSError as error:
        return f"{SENT_AGAIN}: {error!r}"


def server_answer(server: Server, report: dict[str, Any], steps: dict[str, dict[str, Any]],
                  output_tokens: int) -> str:
    """Where a step had errored requests: the server's answer to a body of the run sent once
    more (see replay); empty otherwise."""
    if not any(row["errored"] for row in steps.values()):
        return ""
    body = sent_body(report) or guidellm_body(server.served_name, output_tokens)
    return replay(server.base_url, "/v1/chat/completions", body)


def default_sampling(server: Server) -> dict[str, Any] | str:
    """The sampling defaults the server says it applies: pagewire lists them in /v1/models
    (`default_sampling_params`), vLLM logs them at start-up."""
    try:
        with urllib.request.urlopen(f"{server.base_url}/v1/models", timeout=10) as reply:
            listed = json.loads(reply.read())["data"][0].get("default_sampling_params")
        if listed:
            return dict(listed)
    except (OSError, ValueError, KeyError, IndexError):
        pass
    try:
        log = server.log_path.read_text(errors="replace")
    except OSError:
        log = ""
    found = re.search(r"sampling parameters have been overridden by (.+?): `([^`]*)`", log)
    return f"{found.group(2)} (from {found.group(1)})" if found else "not reported"


# ---------------------------------------------------------------- one engine, then the table


def run_engine(engine: str, args: argparse.Namespace, model_dir: Path, data: dict[str, Any],
               save: Callable[[], None]) -> None:
    """One fresh launch of `engine`: warm-up, settle, the timed GuideLLM run."""
    work_dir = Path(tempfile.mkdtemp(prefix=f"guidellm-serve-{engine}-"))
    server = (pagewire_server if engine == "pagewire" else vllm_server)(model_dir, work_dir)
    record: dict[str, Any] = {"name": NAMES[engine], "status": "", "steps": {},
                              "command": " ".join(server.command), "settings": server.settings,
                              "logs": str(work_dir)}
    data["engines"][engine] = record
    try:
        started = time.perf_counter()
        record["served_model_name"] = server.start(args.startup_timeout)
        record["startup_s"] = time.perf_counter() - started
        record["default_sampling"] = default_sampling(server)
        print(f"{NAMES[engine]}: serving {record['served_model_name']} on {server.base_url} "
              f"after {record['startup_s']:.0f} s; default sampling "
              f"{record['default_sampling']}", file=sys.stderr)

        widest = max(args.streams)
        output = work_dir / "warm-up.json"
        command = guidellm_command(server, model_dir, [widest],
                                   {"kind": "max_requests", "count": widest},
                                   args.prompt_tokens, args.output_tokens, WARM_UP_SEED, output,
                                   args.data_prefetch)
        print(f"{NAMES[engine]}: warm-up …", file=sys.stderr)
        report = run_guidellm(command, output, work_dir / "warm-up.log",
                              RUN_OVERHEAD_S + STEP_OVERHEAD_S)
        warm = summarize(report, args.output_tokens)
        record["warm_up"] = {"streams": widest, "requests": widest, "seed": WARM_UP_SEED,
                             "problems": [p for row in warm.values() for p in row["problems"]]}
        if record["warm_up"]["problems"]:
            answer = server_answer(server, report, warm, args.output_tokens)
            raise RuntimeError("warm-up: " + "; ".join([*record["warm_up"]["problems"],
                                                        *([answer] if answer else [])]))

        record["settle_s"] = wait_until_quiet()
        output = work_dir / "guidellm.json"
        command = guidellm_command(server, model_dir, args.streams,
                                   {"kind": "max_duration", "seconds": args.seconds},
                                   args.prompt_tokens, args.output_tokens, args.seed, output,
                                   args.data_prefetch)
        record["guidellm_command"] = " ".join(command)
        record["guidellm_report"] = str(output)
        print(f"{NAMES[engine]}: GuideLLM, streams {args.streams}, {args.seconds:g} s each …",
              file=sys.stderr)
        timeout = RUN_OVERHEAD_S + len(args.streams) * (args.seconds + STEP_OVERHEAD_S)
        usage: dict[str, float] = {}
        report = run_guidellm(command, output, work_dir / "guidellm.log", timeout, usage)
        record.update(usage)
        record["steps"] = summarize(report, args.output_tokens)
        record["server_answer"] = server_answer(server, report, record["steps"],
                                                args.output_tokens)
    except Exception as error:  # the other engine still runs; the bench fails at its end
        record["status"] = f"failed: {error}"
        print(f"*** {NAMES[engine]} failed: {error} ***", file=sys.stderr)
    finally:
        server.stop()
        save()


def engine_failures(record: dict[str, Any]) -> list[str]:
    problems = [record["status"]] if record.get("status") else []
    for step, row in record.get("steps", {}).items():
        problems += [f"{step}: {p}" for p in row["problems"]]
    if problems and record.get("server_answer"):
        problems.append(record["server_answer"])
    return problems


def _cell(value: Any, digits: int = 1) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


ROWS = (  # label, key, digits
    ("requests/s", "requests_per_s", 2),
    ("output tok/s", "output_tokens_per_s", 1),
    ("TTFT p50 (ms)", "ttft_p50_ms", 0),
    ("TTFT p99 (ms)", "ttft_p99_ms", 0),
    ("ITL p50 (ms)", "itl_p50_ms", 1),
    ("TPOT p50 (ms)", "tpot_p50_ms", 1),
)


def markdown(data: dict[str, Any]) -> str:
    engines = data["engines"]
    order = [e for e in ENGINES if e in engines]
    both = order == list(ENGINES)
    lines = [f"# OpenAI API serving, measured by GuideLLM {data['guidellm_version']} — "
             f"{data['measured_at']}", "",
             f"`{data['command']}` ({data['git']}, {data['cpus']} CPUs, load average "
             f"{data['load_average_before']:.2f} before). `guidellm run`: profile concurrent at "
             f"{', '.join(str(s) for s in data['streams'])} streams, {data['seconds']:g} s each "
             "(max_duration: the requests in flight then are cancelled, \"incomplete\"); "
             f"synthetic_text, {data['prompt_tokens']} prompt tokens (GuideLLM's count, before "
             f"the chat template), {data['output_tokens']} output tokens (ignore_eos), seed "
             f"{data['seed']}; `/v1/chat/completions` streamed, GuideLLM's default request; data "
             f"loader prefetch_factor {data['data_prefetch']} (GuideLLM's default: 4096); "
             "each engine a fresh launch, warmed up with one untimed run (seed "
             f"{WARM_UP_SEED}), a settle before the timed run. Throughput over every request of "
             "the window (GuideLLM's Server Throughput), latencies over completed requests; "
             "ratios are pagewire ÷ vLLM (above 1: pagewire higher).", ""]
    for engine in order:
        failures = engine_failures(engines[engine])
        if failures:
            lines += [f"**{engines[engine]['name']} FAILED** (not ranked): "
                      + "; ".join(failures), ""]
    names = [engines[e]["name"] for e in order]
    extra_head = " | pagewire ÷ vLLM |" if both else " |"
    steps = list(dict.fromkeys(s for e in order for s in engines[e].get("steps", {})))
    for step in steps:
        rows = [engines[e].get("steps", {}).get(step) for e in order]
        lines += [f"| {step} | " + " | ".join(names) + extra_head,
                  "|---|" + "---:|" * (len(names) + both)]

        def text_line(label: str, cells: list[str]) -> str:
            return f"| {label} | " + " | ".join(cells) + (" | |" if both else " |")

        lines.append(text_line("completed / errored / incomplete", [
            f"{r['successful']} / {r['errored']} / {r['incomplete']}" if r else "—"
            for r in rows]))
        for label, key, digits in ROWS:
            values = [r.get(key) if r else None for r in rows]
            cells = [_cell(v, digits) for v in values]
            if both:
                a, b = values
                cells.append(f"{a / b:.2f}" if a is not None and b else "")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append(text_line("output tokens per completed request", [
            (f"{r['output_tokens_min']:g}" if r["output_tokens_min"] == r["output_tokens_max"]
             else f"{r['output_tokens_min']:g}–{r['output_tokens_max']:g}")
            if r and r["output_tokens_min"] is not None else "—" for r in rows]))
        lines.append(text_line("prompt tokens p50 (server's usage)", [
            _cell(r.get("prompt_tokens_p50"), 0) if r else "—" for r in rows]))
        lines.append(text_line("checks", [
            ("FAILED: " + "; ".join(r["problems"]) if r["problems"]
             else "ok" + "".join(f" ({note})" for note in r.get("notes", []))) if r
            else "—" for r in rows]))
        lines.append("")
    lines += ["How each engine ran:", ""]
    for engine in order:
        record = engines[engine]
        client = ""
        if record.get("client_wall_s"):
            cpu, wall = record["client_cpu_s"], record["client_wall_s"]
            client = (f"; GuideLLM used {cpu:.0f} CPU-s over its {wall:.0f} s "
                      f"({cpu / wall:.0%} of one core)")
        lines.append(f"- {record['name']}: `{record['command']}`; "
                     f"{json.dumps(record['settings'])}; default sampling "
                     f"{json.dumps(record.get('default_sampling', 'not reached'))}{client}")
    return "\n".join(lines) + "\n"


def _streams(text: str) -> list[int]:
    streams = [int(x) for x in text.split(",") if x]
    if not streams or min(streams) < 1:
        raise argparse.ArgumentTypeError("streams are positive integers, comma-separated")
    return streams


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--engines", type=comma_choices(ENGINES), default=list(ENGINES),
                        help="comma-separated, in the order they run")
    parser.add_argument("--streams", type=_streams, default=list(STREAMS),
                        help="the concurrent profile's stream counts, one step each")
    parser.add_argument("--seconds", type=float, default=None,
                        help=f"each step's max_duration (default {STEP_SECONDS:g}; "
                             f"--quick: {QUICK_STEP_SECONDS:g})")
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_STEP_SECONDS:g} s per step unless --seconds says")
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS)
    parser.add_argument("--output-tokens", type=int, default=OUTPUT_TOKENS)
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--data-prefetch", type=int, default=DATA_PREFETCH,
                        help="GuideLLM's data loader prefetch_factor (its default: 4096)")
    parser.add_argument("--startup-timeout", type=float, default=STARTUP_TIMEOUT_S)
    parser.add_argument("--results-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.seconds is None:
        args.seconds = QUICK_STEP_SECONDS if args.quick else STEP_SECONDS
    return args


def guidellm_version() -> str:
    done = subprocess.run([str(GUIDELLM), "--version"], capture_output=True, text=True,
                          check=False)
    return done.stdout.strip().rsplit(" ", 1)[-1] or "unknown"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not GUIDELLM.exists():
        print("guidellm_serve needs GuideLLM: run `make bench-peers`", file=sys.stderr)
        return 1
    from common.model_store import resolve_model

    started = time.perf_counter()
    model_dir = resolve_model(None)
    data: dict[str, Any] = {
        **run_header("bench/guidellm_serve.py", argv),
        "cpus": os.cpu_count(), "load_average_before": os.getloadavg()[0], "git": git_state(),
        "guidellm_version": guidellm_version(), "model_dir": str(model_dir),
        "streams": args.streams, "seconds": args.seconds, "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens, "seed": args.seed,
        "data_prefetch": args.data_prefetch, "engines": {}}

    def save() -> None:  # after each engine: what was measured survives a later failure
        save_results(args.results_dir, "guidellm_serve", data, markdown(data), echo=False)

    for engine in args.engines:
        run_engine(engine, args, model_dir, data, save)
    data["seconds_total"] = time.perf_counter() - started
    save_results(args.results_dir, "guidellm_serve", data, markdown(data))
    failures = [f"{NAMES[e]}: {p}" for e, r in data["engines"].items()
                for p in engine_failures(r)]
    if failures:
        print("guidellm_serve FAILED: " + "; ".join(failures), file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
