"""Online serving over OpenAI's HTTP API, measured by vLLM's own client: pagewire vs vLLM CPU.

    .venv/bin/python bench/openai_serve.py                       # both engines, W1 HTTP vs gRPC
    .venv/bin/python bench/openai_serve.py --num-prompts 8 --rates 1,inf --w1-rounds 3
    .venv/bin/python bench/openai_serve.py --engines vllm --stages online   # vLLM alone

**Online** (stage `online`): each engine in turn (`--engines`, default pagewire then vLLM) on a
fresh launch: start its server, wait until `GET /v1/models` answers, warm up with an untimed
run of the same client (WARM_UP_PROMPTS random prompts of another seed, all at once), then for
every rate (`--rates`, default 1, 2, 4, inf) settle the machine (bench/w1.py's
wait_until_quiet) and run `vllm bench serve --backend openai --endpoint /v1/completions
--dataset-name random --random-input-len 256 --random-output-len 128 --ignore-eos
--temperature 0` on it (the peer environment's `vllm` command, through bench/peers/vllm_cli.py:
see there why). The seeds are the same for both engines, so they get the same prompts and
arrival times; each rate has its own (--seed + the rate's index), since prompts seen at the
rate before would be served from either engine's prefix cache; the client tokenizes with the
very folder both servers load (common.model_store's default model), offline
(HF_HUB_OFFLINE=1, TRANSFORMERS_OFFLINE=1).
The client first asks the server's /tokenize to align its prompts; both servers refuse it
(it sends the folder, not the served name, as the model), so both get the prompts as
generated. Each rate records what the client did, and the targets are only evaluated when
both engines report the same prompt token count (`usage.prompt_tokens`) at every rate.

What the client measured is checked, per rate: completed == num_prompts, failed == 0,
total_output_tokens == num_prompts × output_len and every request's output length == output_len
(the client counts `usage.completion_tokens`). An engine that fails a check at any rate is
"failed": its rows say why and it is not ranked (no target is evaluated).

**Sustains**: an engine sustains a rate when it keeps up with the arrivals: its kept-up rate
(N − 1) / (send span + the time from the last send to the last answer beyond the fastest
request's latency) is ≥ SUSTAIN_SHARE × the offered rate (N − 1) / (send span), from the
client's own send times. With perfect keeping-up the last answer comes one service time after
the last send, so the ratio is ~1; a queue that grows makes it fall. (The nominal rate would
judge the Poisson draw's own span and the last request's unavoidable service time, ±10 % at
100 prompts.)

Targets: pagewire's output throughput at rate inf ≥ vLLM's; pagewire's TTFT p99 ≤ vLLM's at
every finite rate vLLM sustains.

**W1 over HTTP vs over gRPC** (stage `w1`, on the pagewire launch of the online stage, after
it): serve_bench's W1 request sets (bench/w1.py's round_workload: 32 requests, prompts of
64-256 token ids, 32-128 output tokens, all at once, greedy, EOS ignored) through the gRPC
client (`final_only`, one message per request, as serve_bench's headline W1 row) and through
`POST /v1/completions` non-streaming (one JSON answer per request: the same shape), the same
token-id prompts and max_tokens. One untimed W1-sized warm-up (seed 99) through each, then
`--w1-rounds` rounds (≥ 3), each its own prompts, the two in alternating order, a settle before
every timed run. Each run gets its own cache salt (`cache_salt`, over both), so no
run finds another's blocks. Output tokens are counted on the client, request by request, and
must equal max_tokens (gRPC: the token ids received; HTTP: `usage.completion_tokens`, as the
non-streaming answer carries text, not ids). Greedy decoding should give the same completion
over both: each round reports how many requests' texts differ and where (reported, not failed:
a different batch composition may flip a near-tie argmax in float32). The ratio HTTP ÷ gRPC
is the median of per-round ratios, with its min–max (target ≥ 0.95).

Equal treatment: both servers on every core this process may run on (pagewire's runner
uses torch's default, one thread per core; vLLM's worker is bound to the same cores with
VLLM_CPU_OMP_THREADS_BIND, as bench/peers/vllm_offline.py does), float32, max model length
2048, 2 GiB of KV cache each, prefix caching on (both defaults; the random prompts share
nothing). The same scheduler budgets: 2048 batched tokens and 256 sequences (serve_bench's;
vllm serve's CPU defaults are 2048 and 128, so runs before 2026-12-02 06:40, which left vLLM at
its defaults, differ only in a cap no rate reached). The client (vLLM's, in
.venv-vllm) shares the cores with the server under test, the same for both.

Results: bench/results/openai_serve.{json,md}, rewritten after every rate (a crash keeps what
finished). Exit status 1 when an engine failed its checks or could not be measured, or the
W1 stage did not finish.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import workloads  # noqa: E402
from bench.harness import (  # noqa: E402
    RESULTS,
    STARTUP_TIMEOUT_S,
    Server,
    free_port,
    git_state,
    log_tail,
    run_header,
    save_results,
)
from bench.peers.vllm_offline import KV_CACHE_GIB, _cpu_list  # noqa: E402
from bench.w1 import WARM_UP_SEED, per_round_ratio, round_seed, wait_until_quiet  # noqa: E402
from bench.workloads import BenchRequest  # noqa: E402

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
VLLM_CLI = ROOT / "bench" / "peers" / "vllm_cli.py"
PAGEWIRE = Path(sys.executable).parent / "pagewire"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
ENGINES = ("pagewire", "vllm")
NAMES = {"pagewire": "pagewire", "vllm": "vLLM CPU"}
STAGES = ("online", "w1")
SERVED_MODEL_NAME = "SmolLM2-135M-Instruct"
BLOCK_SIZE = 16
MAX_MODEL_LEN = 2048
KV_CACHE_BYTES = int(KV_CACHE_GIB) << 30  # vLLM's VLLM_CPU_KVCACHE_SPACE, in bytes
MAX_BATCHED_TOKENS = 2048  # pagewire's, as in serve_bench
MAX_NUM_SEQS = 256
NUM_PROMPTS = 100
INPUT_LEN = 256
OUTPUT_LEN = 128
SEED = 0
WARM_UP_PROMPTS = 8
W1_ROUNDS = 3
SUSTAIN_SHARE = 0.9
TARGET_HTTP_OVER_GRPC = 0.95
CLIENT_TIMEOUT_S = 1800.0
REQUEST_TIMEOUT_S = 600.0


# ---------------------------------------------------------------- servers


def _has_flag(command: list[str], flag: str) -> bool:
    """Whether `command --help` mentions `flag` (the HTTP server's flags are new)."""
    try:
        help_text = subprocess.run([*command, "--help"], capture_output=True, text=True,
                                   timeout=120, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return flag in help_text


def pagewire_server(model_dir: Path, log_dir: Path) -> Server:
    """`pagewire serve` with serve_bench's settings, its gRPC gateway and its HTTP API."""
    http_port, grpc_port = free_port(), free_port()
    command = [str(PAGEWIRE), "serve", "--model", str(model_dir), "--host", "127.0.0.1",
               "--port", str(grpc_port), "--http-port", str(http_port),
               "--block-size", str(BLOCK_SIZE), "--kv-cache-memory", str(KV_CACHE_BYTES),
               "--max-model-len", str(MAX_MODEL_LEN),
               "--max-num-batched-tokens", str(MAX_BATCHED_TOKENS),
               "--max-num-seqs", str(MAX_NUM_SEQS), "--log-dir", str(log_dir / "services")]
    if _has_flag([str(PAGEWIRE), "serve"], "--served-model-name"):
        command += ["--served-model-name", SERVED_MODEL_NAME]
    return Server("pagewire", command, dict(OFFLINE), http_port, log_dir / "pagewire.log",
                  settings={"grpc_address": f"127.0.0.1:{grpc_port}",
                            "threads": "torch default: one per core",
                            "kv_cache_bytes": KV_CACHE_BYTES, "block_size": BLOCK_SIZE,
                            "max_model_len": MAX_MODEL_LEN,
                            "max_num_batched_tokens": MAX_BATCHED_TOKENS,
                            "max_num_seqs": MAX_NUM_SEQS, "dtype": "float32 (its only)"})


def vllm_server(model_dir: Path, log_dir: Path) -> Server:
    """`vllm serve` in the peer environment, threads and KV cache as in serve_bench."""
    port = free_port()
    env = {**OFFLINE,
           "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND",
                                                       _cpu_list()),
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GIB)}
    command = [str(VLLM_PYTHON), str(VLLM_CLI), "serve", str(model_dir), "--host", "127.0.0.1",
               "--port", str(port), "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
               # pagewire's scheduler budgets (vllm serve's CPU defaults are 2048 and 128).
               "--max-num-batched-tokens", str(MAX_BATCHED_TOKENS),
               "--max-num-seqs", str(MAX_NUM_SEQS),
               "--served-model-name", SERVED_MODEL_NAME, "--seed", "0"]
    return Server("vllm", command, env, port, log_dir / "vllm.log",
                  settings={key: value for key, value in env.items() if key.startswith("VLLM")}
                  | {"dtype": "float32", "max_model_len": MAX_MODEL_LEN,
                     "max_num_batched_tokens": MAX_BATCHED_TOKENS, "max_num_seqs": MAX_NUM_SEQS})


# ---------------------------------------------------------------- the client and its results


@dataclass(frozen=True)
class Load:
    """One run of vLLM's client."""

    rate: float
    num_prompts: int
    input_len: int
    output_len: int
    seed: int


def rate_text(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def client_command(server: Server, model_dir: Path, load: Load, result_dir: Path,
                   filename: str) -> list[str]:
    return [str(VLLM_PYTHON), str(VLLM_CLI), "bench", "serve",
            "--backend", "openai", "--base-url", server.base_url, "--endpoint", "/v1/completions",
            "--model", str(model_dir), "--tokenizer", str(model_dir),
            "--served-model-name", server.served_name,
            "--dataset-name", "random", "--random-input-len", str(load.input_len),
            "--random-output-len", str(load.output_len), "--ignore-eos", "--temperature", "0",
            "--num-prompts", str(load.num_prompts), "--request-rate", rate_text(load.rate),
            "--seed", str(load.seed),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--save-result", "--save-detailed", "--result-dir", str(result_dir),
            "--result-filename", filename, "--disable-tqdm"]


def run_client(server: Server, model_dir: Path, load: Load, work_dir: Path, label: str,
               timeout_s: float = CLIENT_TIMEOUT_S) -> dict[str, Any]:
    """vLLM's client against `server`; its result JSON (with per-request details)."""
    filename = f"{label}.json"
    command = client_command(server, model_dir, load, work_dir, filename)
    log_path = work_dir / f"{label}.client.log"
    with open(log_path, "w") as log:
        done = subprocess.run(command, stdout=log, stderr=log, env={**os.environ, **OFFLINE},
                              timeout=timeout_s, check=False)
    if done.returncode != 0 or not (work_dir / filename).is_file():
        raise RuntimeError(f"vllm bench serve ({label}) exited with {done.returncode}:\n"
                           f"{log_tail(log_path)}")
    raw: dict[str, Any] = json.loads((work_dir / filename).read_text())
    raw["prompt_alignment"] = prompt_alignment(log_path.read_text(errors="replace"))
    return raw


def prompt_alignment(client_log: str) -> str:
    """What vLLM's client did to its prompts before sending them: it asks the server's
    /tokenize (with the model *folder* as the model name) and, when the server's count of the
    first prompt differs from its own, re-tokenizes every prompt there. Only "unavailable" and
    "as generated" send the seed's prompts unchanged."""
    if "/tokenize unavailable" in client_log:
        return "unavailable"  # the server refused or lacks /tokenize: prompts as generated
    if "tokenizer mismatch" in client_log:
        return "re-aligned"
    return "as generated"


METRICS = ("ttft", "tpot", "itl", "e2el")


def check(raw: dict[str, Any], num_prompts: int, output_len: int) -> list[str]:
    """What is wrong with one client run: empty when every request completed with exactly
    `output_len` tokens."""
    problems = []
    completed, failed = raw.get("completed", 0), raw.get("failed", 0)
    if completed != num_prompts:
        problems.append(f"completed {completed} of {num_prompts} requests")
    if failed:
        errors = [e for e in raw.get("errors", []) if e]
        example = f", e.g. {errors[0].strip().splitlines()[-1][:200]}" if errors else ""
        problems.append(f"{failed} requests failed{example}")
    expected = num_prompts * output_len
    total = raw.get("total_output_tokens", 0)
    if total != expected:
        problems.append(f"{total} output tokens, not {num_prompts} × {output_len} = {expected}")
    lens = raw.get("output_lens")
    if lens is not None:
        wrong = [(i, n) for i, n in enumerate(lens) if n != output_len]
        if wrong:
            index, count = wrong[0]
            problems.append(f"{len(wrong)} of {len(lens)} requests produced other than "
                            f"{output_len} tokens, e.g. request {index}: {count}")
    return problems


def sustain_share(raw: dict[str, Any], rate: float) -> float | None:
    """The kept-up rate ÷ the offered rate (see the module docstring); None at rate inf. Without
    per-request details: request throughput ÷ the nominal rate."""
    if math.isinf(rate):
        return None
    starts = raw.get("start_times") or []
    latencies = [lat for lat, err in zip(raw.get("latencies") or [], raw.get("errors") or [],
                                         strict=False) if not err and lat > 0]
    if len(starts) < 2 or not latencies:
        return float(raw.get("request_throughput", 0.0)) / rate
    span = max(starts) - min(starts)
    if span <= 0:
        return None
    excess = max(0.0, raw["duration"] - span - min(latencies))
    return span / (span + excess)


def summarize(raw: dict[str, Any], load: Load) -> dict[str, Any]:
    """One rate's row: the client's figures, the checks, and whether the rate was sustained."""
    row: dict[str, Any] = {
        key: raw.get(key) for key in ("completed", "failed", "total_input_tokens",
                                      "total_output_tokens", "duration", "request_throughput",
                                      "output_throughput", "total_token_throughput",
                                      "max_concurrent_requests")}
    for metric in METRICS:
        for stat in ("mean", "p50", "p99"):
            row[f"{stat}_{metric}_ms"] = raw.get(f"{stat}_{metric}_ms")
    row["problems"] = check(raw, load.num_prompts, load.output_len)
    row["prompt_alignment"] = raw.get("prompt_alignment", "")
    share = sustain_share(raw, load.rate)
    row["sustain_share"] = share
    row["sustained"] = None if share is None else share >= SUSTAIN_SHARE
    starts = raw.get("start_times") or []
    if len(starts) >= 2 and max(starts) > min(starts):
        row["offered_rate"] = (len(starts) - 1) / (max(starts) - min(starts))
    return row


# ---------------------------------------------------------------- W1 over HTTP and over gRPC


@dataclass
class Answer:
    """What one request returned, as its client saw it."""

    text: str = ""
    token_ids: list[int] | None = None  # None: the transport gave no token ids
    completion_tokens: int = 0  # counted on the client (gRPC: ids received; HTTP: usage)
    cached_tokens: int = 0
    error: str = ""


@dataclass
class TransportRun:
    seconds: float
    answers: list[Answer]

    @property
    def tokens(self) -> int:
        return sum(a.completion_tokens for a in self.answers)


async def _grpc_run(address: str, requests: Sequence[BenchRequest], salt: str) -> TransportRun:
    """serve_bench's offline W1 client (bench/timing.py) keeping what each request returned:
    one stream per request, `final_only`, all at once on one channel."""
    import grpc

    from gateway.client import build_request
    from protos import gateway_pb2_grpc

    answers = [Answer() for _ in requests]

    async def one(stub: Any, request: BenchRequest, answer: Answer) -> None:
        try:
            call = stub.Generate(build_request(
                token_ids=request.prompt_token_ids, max_tokens=request.max_tokens,
                temperature=0.0, ignore_eos=True, cache_salt=salt, final_only=True),
                timeout=REQUEST_TIMEOUT_S)
            answer.token_ids = []
            async for message in call:
                for output in message.outputs:
                    answer.token_ids.extend(output.token_ids)
                    answer.text += output.text
                if message.HasField("usage"):
                    answer.cached_tokens = message.usage.cached_tokens
            answer.completion_tokens = len(answer.token_ids)
        except Exception as error:  # a benchmark reports failures instead of stopping
            answer.error = repr(error)

    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GenerationServiceStub(channel)
        start = time.perf_counter()
        await asyncio.gather(*(one(stub, r, a) for r, a in zip(requests, answers, strict=True)))
        seconds = time.perf_counter() - start
    return TransportRun(seconds, answers)


async def _http_run(base_url: str, model: str, requests: Sequence[BenchRequest], salt: str
                    ) -> TransportRun:
    """The same requests as `POST /v1/completions`, non-streaming (one answer per request, as
    `final_only`), all at once, one connection each (HTTP/1.1)."""
    import httpx

    answers = [Answer() for _ in requests]

    async def one(client: httpx.AsyncClient, request: BenchRequest, answer: Answer) -> None:
        try:
            reply = await client.post("/v1/completions", json={
                "model": model, "prompt": request.prompt_token_ids,
                "max_tokens": request.max_tokens, "temperature": 0.0, "ignore_eos": True,
                "cache_salt": salt, "stream": False})
            reply.raise_for_status()
            body = reply.json()
            choice = body["choices"][0]
            answer.text = choice.get("text") or ""
            ids = choice.get("token_ids")
            answer.token_ids = list(ids) if ids is not None else None
            usage = body.get("usage") or {}
            answer.completion_tokens = int(usage.get("completion_tokens") or 0)
            details = usage.get("prompt_tokens_details") or {}
            answer.cached_tokens = int(details.get("cached_tokens") or 0)
        except Exception as error:
            answer.error = repr(error)

    limits = httpx.Limits(max_connections=len(requests),
                          max_keepalive_connections=len(requests))
    async with httpx.AsyncClient(base_url=base_url, timeout=REQUEST_TIMEOUT_S,
                                 limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(one(client, r, a) for r, a in zip(requests, answers, strict=True)))
        seconds = time.perf_counter() - start
    return TransportRun(seconds, answers)


def verify_counts(label: str, requests: Sequence[BenchRequest], run: TransportRun) -> None:
    """Raises unless every request answered with exactly its max_tokens tokens (and, where
    the transport gave token ids, that many ids)."""
    for index, (request, answer) in enumerate(zip(requests, run.answers, strict=True)):
        if answer.error:
            raise RuntimeError(f"{label}: request {index} failed: {answer.error}")
        counts = {answer.completion_tokens}
        if answer.token_ids is not None:
            counts.add(len(answer.token_ids))
        if counts != {request.max_tokens}:
            raise RuntimeError(f"{label}: request {index} returned {sorted(counts)} tokens, "
                               f"asked {request.max_tokens}")


def compare_answers(grpc_run: TransportRun, http_run: TransportRun) -> dict[str, Any]:
    """Greedy decoding of the same prompt should give the same completion over both: how many
    requests differ (text, and token ids where HTTP gave them), and where the first differs."""
    differ = []
    for index, (g, h) in enumerate(zip(grpc_run.answers, http_run.answers, strict=True)):
        same_ids = h.token_ids is None or h.token_ids == g.token_ids
        if g.text != h.text or not same_ids:
            at = next((i for i, (a, b) in enumerate(zip(g.text, h.text, strict=False))
                       if a != b), min(len(g.text), len(h.text)))
            differ.append({"request": index, "first_difference_at_char": at})
    return {"requests": len(grpc_run.answers), "differ": len(differ),
            "examples": differ[:3],
            "http_gave_token_ids": any(h.token_ids is not None for h in http_run.answers)}


def run_w1_http_vs_grpc(grpc_address: str, base_url: str, model: str, rounds: int,
                        save: Any, num_requests: int = 32) -> dict[str, Any]:
    """W1 through both transports on one pagewire launch (see the module docstring)."""
    if rounds < 3:
        raise ValueError("W1 HTTP vs gRPC needs at least 3 rounds")
    w1: dict[str, Any] = {"requests": num_requests, "rounds": [],
                          "warm_up": f"one untimed W1-sized run (seed {WARM_UP_SEED}) through "
                                     "each, gRPC first"}

    def run(transport: str, requests: list[BenchRequest], tag: str) -> TransportRun:
        # A salt per run, as serve_bench's: no run finds another's blocks in the cache.
        salt = f"w1-{transport}-{tag}"
        if transport == "grpc":
            return asyncio.run(_grpc_run(grpc_address, requests, salt))
        return asyncio.run(_http_run(base_url, model, requests, salt))

    warm_up = workloads.offline_throughput(num_requests, seed=WARM_UP_SEED)
    for transport in ("grpc", "http"):
        verify_counts(f"W1 {transport} warm-up", warm_up, run(transport, warm_up, "warm-up"))
    for index in range(rounds):
        # serve_bench's W1 of this round (w1.round_workload) when num_requests is 32.
        requests = [replace(r, final_only=True) for r in
                    workloads.offline_throughput(num_requests, seed=round_seed(index))]
        order = ["grpc", "http"] if index % 2 == 0 else ["http", "grpc"]
        measured: dict[str, TransportRun] = {}
        settles: dict[str, float] = {}
        for transport in order:
            settles[transport] = wait_until_quiet()
            measured[transport] = run(transport, requests, f"round-{index}")
            verify_counts(f"W1 {transport}, round {index + 1}", requests, measured[transport])
        w1["rounds"].append({
            "order": order, "settle_s": settles,
            **{f"{t}_seconds": measured[t].seconds for t in measured},
            **{f"{t}_tokens": measured[t].tokens for t in measured},
            **{f"{t}_tokens_per_s": measured[t].tokens / measured[t].seconds for t in measured},
            **{f"{t}_cached_tokens": sum(a.cached_tokens for a in measured[t].answers)
               for t in measured},
            "same_completions": compare_answers(measured["grpc"], measured["http"])})
        save(w1)
    ratio = per_round_ratio([r["http_tokens_per_s"] for r in w1["rounds"]],
                            [r["grpc_tokens_per_s"] for r in w1["rounds"]])
    assert ratio is not None
    w1["http_over_grpc"] = {"median": ratio.median, "low": ratio.low, "high": ratio.high,
                            "rounds": ratio.rounds, "target": TARGET_HTTP_OVER_GRPC,
                            "met": ratio.median >= TARGET_HTTP_OVER_GRPC}
    for transport in ("grpc", "http"):
        seconds = sum(r[f"{transport}_seconds"] for r in w1["rounds"])
        w1[f"{transport}_tokens_per_s"] = sum(r[f"{transport}_tokens"]
                                              for r in w1["rounds"]) / seconds
    save(w1)
    return w1


# ---------------------------------------------------------------- one engine, then the table


def run_engine(engine: str, args: argparse.Namespace, model_dir: Path,
               data: dict[str, Any], save: Any) -> None:
    """One fresh launch of `engine`: warm-up, every rate, and (pagewire) the W1 stage."""
    work_dir = Path(tempfile.mkdtemp(prefix=f"openai-serve-{engine}-"))
    server = (pagewire_server if engine == "pagewire" else vllm_server)(model_dir, work_dir)
    record: dict[str, Any] = {"name": NAMES[engine], "status": "", "rates": {},
                              "command": " ".join(server.command), "settings": server.settings,
                              "logs": str(work_dir)}
    data["engines"][engine] = record
    try:
        started = time.perf_counter()
        record["served_model_name"] = server.start(args.startup_timeout)
        record["startup_s"] = time.perf_counter() - started
        print(f"{NAMES[engine]}: serving {record['served_model_name']} on {server.base_url} "
              f"after {record['startup_s']:.0f} s", file=sys.stderr)
        if "online" in args.stages:
            warm = Load(math.inf, args.warm_up_prompts, args.input_len, args.output_len,
                        WARM_UP_SEED)
            raw = run_client(server, model_dir, warm, work_dir, "warm-up")
            record["warm_up"] = {"prompts": args.warm_up_prompts, "seed": WARM_UP_SEED,
                                 "problems": check(raw, warm.num_prompts, warm.output_len)}
            if record["warm_up"]["problems"]:
                raise RuntimeError("warm-up: " + "; ".join(record["warm_up"]["problems"]))
            for index, rate in enumerate(args.rates):
                # A seed per rate: the same prompts again would be served from the prefix
                # cache of the rate before (both engines cache prefixes), not computed.
                load = Load(rate, args.num_prompts, args.input_len, args.output_len,
                            args.seed + index)
                settle_s = wait_until_quiet()
                print(f"{NAMES[engine]}: rate {rate_text(rate)} …", file=sys.stderr)
                raw = run_client(server, model_dir, load, work_dir, f"rate-{rate_text(rate)}")
                record["rates"][rate_text(rate)] = summarize(raw, load) | {"settle_s": settle_s}
                save()
        if engine == "pagewire" and "w1" in args.stages:
            def save_w1(w1: dict[str, Any]) -> None:
                data["w1_http_vs_grpc"] = w1
                save()
            run_w1_http_vs_grpc(server.settings["grpc_address"], server.base_url,
                                server.served_name, args.w1_rounds, save_w1, args.w1_requests)
    except Exception as error:  # the other engine still runs; the bench fails at its end
        record["status"] = f"failed: {error}"
        print(f"*** {NAMES[engine]} failed: {error} ***", file=sys.stderr)
    finally:
        server.stop()
        save()


def engine_failures(record: dict[str, Any]) -> list[str]:
    problems = [record["status"]] if record.get("status") else []
    for rate, row in record.get("rates", {}).items():
        problems += [f"rate {rate}: {p}" for p in row["problems"]]
    return problems


def targets(data: dict[str, Any]) -> dict[str, Any]:
    """The targets with their figures; {"not_evaluated": why} unless both engines passed."""
    engines = data["engines"]
    pagewire, vllm = engines.get("pagewire"), engines.get("vllm")
    if pagewire is None or vllm is None:
        return {"not_evaluated": "needs both engines"}
    failed = [NAMES[e] for e in ("pagewire", "vllm") if engine_failures(engines[e])]
    if failed:
        return {"not_evaluated": f"{', '.join(failed)} failed its checks (not ranked)"}
    result: dict[str, Any] = {}
    differ = {rate: (row["total_input_tokens"], vllm["rates"][rate]["total_input_tokens"])
              for rate, row in pagewire["rates"].items() if rate in vllm["rates"]
              and (row["total_input_tokens"] != vllm["rates"][rate]["total_input_tokens"]
                   or row.get("prompt_alignment") == "re-aligned"
                   or vllm["rates"][rate].get("prompt_alignment") == "re-aligned")}
    if differ:
        return {"not_evaluated": "the engines did not get the same prompts (prompt tokens "
                + ", ".join(f"at {r}: {a} vs {b}" for r, (a, b) in differ.items()) + ")"}
    p_inf, v_inf = pagewire["rates"].get("inf"), vllm["rates"].get("inf")
    if p_inf and v_inf:
        ratio = p_inf["output_throughput"] / v_inf["output_throughput"]
        result["throughput_at_inf"] = {"ratio": ratio, "met": ratio >= 1.0}
    ttft = {}
    for rate, v_row in vllm["rates"].items():
        p_row = pagewire["rates"].get(rate)
        if rate == "inf" or p_row is None or not v_row["sustained"]:
            continue
        ratio = p_row["p99_ttft_ms"] / v_row["p99_ttft_ms"]
        ttft[rate] = {"ratio": ratio, "met": ratio <= 1.0}
    result["ttft_p99_where_vllm_sustains"] = ttft
    return result


def _num(value: Any, digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _ratio(a: Any, b: Any) -> str:
    return f"{a / b:.2f}" if a is not None and b else ""


def markdown(data: dict[str, Any]) -> str:
    engines = data["engines"]
    order = [e for e in ENGINES if e in engines]
    lines = [f"# OpenAI API serving, measured by `vllm bench serve` — {data['measured_at']}", "",
             f"`{data['command']}` ({data['git']}, {data['cpus']} CPUs, load average "
             f"{data['load_average_before']:.2f} before). Random dataset: "
             f"{data['input_len']} prompt tokens, {data['output_len']} output tokens "
             f"(ignore_eos, temperature 0), {data['num_prompts']} prompts, seed "
             f"{data['seed']} + the rate's index, "
             f"`/v1/completions` streamed (the client's openai backend); each engine a fresh "
             f"launch, warmed up with {data['warm_up_prompts']} prompts (seed {WARM_UP_SEED}), "
             "a settle before every rate.", ""]
    for engine in order:
        record = engines[engine]
        failures = engine_failures(record)
        if failures:
            lines.append(f"**{record['name']} FAILED** (not ranked): " + "; ".join(failures))
            lines.append("")
    rates = list(dict.fromkeys(r for e in order for r in engines[e]["rates"]))
    names = [engines[e]["name"] for e in order]
    both = order == list(ENGINES)
    for rate in rates:
        rows = [engines[e]["rates"].get(rate) for e in order]
        header = f"| rate {rate} req/s | " + " | ".join(names) + (" | pagewire ÷ vLLM |"
                                                                   if both else " |")
        lines += [header, "|---|" + "---:|" * (len(names) + both)]

        def line(label: str, key: str, digits: int = 1, show_ratio: bool = True,
                 current: list[dict[str, Any] | None] = rows) -> str:
            values = [row.get(key) if row else None for row in current]
            cells = [_num(v, digits) for v in values]
            extra = ([_ratio(values[0], values[1]) if show_ratio else ""] if both else [])
            return f"| {label} | " + " | ".join(cells + extra) + " |"

        lines.append("| completed / failed | " + " | ".join(
            f"{row['completed']} / {row['failed']}" if row else "—" for row in rows)
            + (" | |" if both else " |"))
        lines.append(line("prompt tokens (usage)", "total_input_tokens", 0, show_ratio=False))
        lines.append("| client's prompt alignment (/tokenize) | " + " | ".join(
            (row.get("prompt_alignment") or "—") if row else "—" for row in rows)
            + (" | |" if both else " |"))
        lines.append(line("request throughput (req/s)", "request_throughput", 2))
        lines.append(line("output throughput (tok/s)", "output_throughput"))
        for metric in ("ttft", "tpot", "itl"):
            for stat in ("mean", "p50", "p99"):
                lines.append(line(f"{metric.upper()} {stat} (ms)", f"{stat}_{metric}_ms", 1,
                                  show_ratio=(metric == "ttft" and stat == "p99")))
        if rate != "inf":
            lines.append("| sustained (kept-up ÷ offered) | " + " | ".join(
                (f"{'yes' if row['sustained'] else 'no'} ({row['sustain_share']:.2f})"
                 if row and row["sustain_share"] is not None else "—") for row in rows)
                + (" | |" if both else " |"))
        lines.append("| checks | " + " | ".join(
            ("ok" if not row["problems"] else "FAILED: " + "; ".join(row["problems"]))
            if row else "—" for row in rows) + (" | |" if both else " |"))
        lines.append("")
    goals = data.get("targets", {})
    lines.append("Targets:")
    if "not_evaluated" in goals:
        lines.append(f"- not evaluated: {goals['not_evaluated']}")
    else:
        inf = goals.get("throughput_at_inf")
        if inf:
            lines.append(f"- pagewire output throughput at rate inf ≥ vLLM's: "
                         f"{inf['ratio']:.3f}× — {'met' if inf['met'] else 'NOT met'}")
        ttft = goals.get("ttft_p99_where_vllm_sustains", {})
        if not ttft:
            lines.append("- TTFT p99 ≤ vLLM's where vLLM sustains the rate: vLLM sustained no "
                         "finite rate")
        for rate, goal in ttft.items():
            lines.append(f"- TTFT p99 at {rate} req/s (vLLM sustains it) ≤ vLLM's: "
                         f"{goal['ratio']:.3f}× — {'met' if goal['met'] else 'NOT met'}")
    lines.append(f"- sustains: kept-up rate ≥ {SUSTAIN_SHARE} × offered rate, both from the "
                 "client's send times (bench/openai_serve.py's docstring)")
    w1 = data.get("w1_http_vs_grpc")
    if w1 and w1.get("rounds"):
        lines += ["", f"W1 over HTTP vs over gRPC, one pagewire launch ({w1['requests']} requests "
                  "all at once, "
                  "token-id prompts, greedy, ignore_eos; gRPC `final_only`, HTTP "
                  "`/v1/completions` non-streaming):", "",
                  "| round | order | gRPC tok/s | HTTP tok/s | HTTP ÷ gRPC | cached tokens "
                  "gRPC / HTTP | completions that differ |", "|---:|---|---:|---:|---:|---|---|"]
        for index, row in enumerate(w1["rounds"]):
            same = row["same_completions"]
            lines.append(
                f"| {index + 1} | {' → '.join(row['order'])} | {row['grpc_tokens_per_s']:.1f} |"
                f" {row['http_tokens_per_s']:.1f} | "
                f"{row['http_tokens_per_s'] / row['grpc_tokens_per_s']:.3f} | "
                f"{row['grpc_cached_tokens']} / {row['http_cached_tokens']} | "
                f"{same['differ']} of {same['requests']} |")
        ratio = w1.get("http_over_grpc")
        if ratio:
            lines.append("")
            lines.append(f"HTTP ÷ gRPC output tok/s, median of rounds: {ratio['median']:.3f} "
                         f"({ratio['low']:.3f}–{ratio['high']:.3f}), target ≥ "
                         f"{ratio['target']} — {'met' if ratio['met'] else 'NOT met'}")
    lines += ["", "How each engine ran:", ""]
    for engine in order:
        record = engines[engine]
        lines.append(f"- {record['name']}: `{record['command']}`; "
                     f"{json.dumps(record['settings'])}")
    return "\n".join(lines) + "\n"


def _rates(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def comma_choices(allowed: Sequence[str]) -> Any:
    def parse(text: str) -> list[str]:
        names = [n for n in text.split(",") if n]
        unknown = sorted(set(names) - set(allowed))
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)}; choose from "
                                             f"{', '.join(allowed)}")
        return names
    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--rates", type=_rates, default=[1.0, 2.0, 4.0, math.inf],
                        help="comma-separated request rates per second (inf: all at once)")
    parser.add_argument("--num-prompts", type=int, default=NUM_PROMPTS)
    parser.add_argument("--input-len", type=int, default=INPUT_LEN)
    parser.add_argument("--output-len", type=int, default=OUTPUT_LEN)
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--warm-up-prompts", type=int, default=WARM_UP_PROMPTS)
    parser.add_argument("--engines", type=comma_choices(ENGINES), default=list(ENGINES),
                        help="comma-separated, in the order they run")
    parser.add_argument("--stages", type=comma_choices(STAGES), default=list(STAGES),
                        help="online (vLLM's client at every rate), w1 (HTTP vs gRPC)")
    parser.add_argument("--w1-rounds", type=int, default=W1_ROUNDS)
    parser.add_argument("--w1-requests", type=int, default=32,
                        help="requests per W1 run (32: serve_bench's W1; fewer for a smoke run)")
    parser.add_argument("--startup-timeout", type=float, default=STARTUP_TIMEOUT_S)
    parser.add_argument("--results-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.w1_rounds < 3:
        parser.error("--w1-rounds must be at least 3")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from common.model_store import resolve_model

    started = time.perf_counter()
    model_dir = resolve_model(None)
    data: dict[str, Any] = {
        **run_header("bench/openai_serve.py", argv),
        "cpus": os.cpu_count(), "load_average_before": os.getloadavg()[0], "git": git_state(),
        "model_dir": str(model_dir), "rates": [rate_text(r) for r in args.rates],
        "num_prompts": args.num_prompts, "input_len": args.input_len,
        "output_len": args.output_len, "seed": args.seed,
        "warm_up_prompts": args.warm_up_prompts, "sustain_share": SUSTAIN_SHARE,
        "engines": {}}
    if not VLLM_PYTHON.exists():
        print("openai_serve needs vLLM's client: run `make bench-peers`", file=sys.stderr)
        return 1

    def save() -> None:
        data["targets"] = targets(data)
        folder = args.results_dir
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "openai_serve.json").write_text(json.dumps(data, indent=2))
        (folder / "openai_serve.md").write_text(markdown(data))

    for engine in args.engines:
        run_engine(engine, args, model_dir, data, save)
    data["seconds"] = time.perf_counter() - started
    save_results(args.results_dir, "openai_serve", data | {"targets": targets(data)},
                 markdown(data))
    failures = [f"{NAMES[e]}: {p}" for e, r in data["engines"].items()
                for p in engine_failures(r)]
    w1_ratio = data.get("w1_http_vs_grpc", {}).get("http_over_grpc")
    if failures:
        print("openai_serve FAILED: " + "; ".join(failures), file=sys.stderr)
    return 1 if failures or ("w1" in args.stages and "pagewire" in args.engines
                             and w1_ratio is None) else 0


if __name__ == "__main__":
    sys.exit(main())
