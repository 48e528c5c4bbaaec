"""pagewire side by side with its peers on one machine, model and workload, in one run.

    .venv/bin/python bench/serve_bench.py            # everything (about 30 minutes on 2 cores)
    .venv/bin/python bench/serve_bench.py --quick    # shorter online phase, fewer rates
    .venv/bin/python bench/serve_bench.py --skip vllm,hf-cb   # leave peers out
    .venv/bin/python bench/serve_bench.py --dtypes bfloat16 --skip w4   # W1 in bfloat16 alone

Workloads (bench/workloads.py, seeded): W1 offline throughput, W2 shared prefix with prefix
caching on and off, W3 online Poisson arrivals, W4 many prefixes over two runners under each
routing policy (bench/w4.py). W1 rows: pagewire offline (every request
`final_only`, one message with the whole completion, as the peers' offline APIs return it:
the headline), pagewire streamed (a message per step per request), the ceiling (pagewire's own
runner replaying the very batches of each offline run in-process, right after it), and the
peers: transformers static batching, transformers continuous batching, vLLM CPU (when `make
bench-peers` installed it). Every row is treated alike (bench/w1.py): one process for all
rounds, the same warm-up, a settle before every timed run, rounds with the engines' order
rotated, every request's output tokens counted on the client and checked, and each ratio the
median of per-round ratios with its min–max. An engine that produces other than the tokens
asked for, or fails, fails the bench (exit status 1) after the rest has run.

Dtypes (--dtypes, default float32,bfloat16): W1 runs once per dtype, one after the other, each
with its own services (the runner started with `--dtype`), ceiling runner and peer processes
(transformers `dtype`, vLLM `LLM(dtype=...)`), all under the rules above, round i with the same
seed in every dtype; ratios compare rows of one dtype, plus pagewire bfloat16 ÷ pagewire
float32 (median of the per-round ratios: round i has the same prompts in both). float32 is
the full set. To keep the bench's time (the bfloat16 set added ~5 minutes on 2026-12-02), the
other dtypes leave out the streamed row (it measures the services, not the model) and
transformers continuous batching (about 4 minutes of W1 a dtype), each shown as such in the
table, and run fewer rounds (--other-dtype-rounds, default 2 of W1's 4, round i's prompts
those of float32's round i). W2 and W3 run on float32's services, W4 in float32;
`--dtypes bfloat16` runs neither W2 nor W3.

The roofline (bench/roofline.py): with the ceiling, the machine's GEMM peak per dtype (the
best of the runner's kernels at the model's projection shapes) and its memory bandwidth are
measured once at the start; each round's recorded forwards are counted (FLOPs, bytes of
weights and KV cache) and put against them, timed by the ceiling's replay and by the offline
run end to end: achieved GFLOP/s and GB/s and the fraction of the roofline bound, per dtype,
in the summary next to the ratios.

Each peer runs in its own child process with a time limit per run (--peer-timeout, model
loading included in its warm-up): a peer that hangs or crashes shows in the table as "timed
out after N s" or "failed", and the rest of the bench goes on.

Threads, the same for everyone: the 2 cores of this machine. pagewire's runner and both
transformers peers use torch's default (one thread per core); vLLM's worker is bound to every
core with VLLM_CPU_OMP_THREADS_BIND (its default, "auto", keeps one core of two for its
scheduler process and computes on one thread), with 2 GiB of KV cache
(VLLM_CPU_KVCACHE_SPACE), pagewire's budget here. A value already in the environment wins
(`VLLM_CPU_OMP_THREADS_BIND=auto` measures vLLM's own default); each peer row records the
settings it ran with. vLLM keeps its own scheduler budget (4096 batched tokens), transformers'
continuous batching gets pagewire's (2048). See bench/peers/{hf,vllm_offline}.py.

Results go to bench/results/serve_bench.{json,md,png}, rewritten after every run, so a crash
keeps what finished. Every run starts a new file: ratios only compare rows of one run.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tqdm import tqdm  # noqa: E402

from bench import step_profile, workloads  # noqa: E402
from bench.ceiling import replay  # noqa: E402
from bench.peers.child import PeerProcess  # noqa: E402
from bench.peers.protocol import PeerRequest, peer_command  # noqa: E402
from bench.roofline import (  # noqa: E402
    MachinePeaks,
    RooflineTally,
    measure_peaks,
    recorded_work,
)
from bench.serve_report import (  # noqa: E402
    CEILING,
    FULL_DTYPE,
    P99_TTFT_TARGET_S,
    PAGEWIRE,
    STREAMED,
    chart,
    markdown,
    row_name,
)
from bench.timing import RunSummary, run_workload  # noqa: E402
from bench.w1 import (  # noqa: E402
    W1_ROUNDS,
    WARM_UP,
    W1Engine,
    W1Row,
    check_counts,
    round_seed,
    run_rounds,
    wait_until_quiet,
)
from bench.w4 import W4Settings, run_w4  # noqa: E402
from bench.workloads import BenchRequest  # noqa: E402
from common.model_store import resolve_model  # noqa: E402
from gateway.launcher import LaunchConfig, Launcher, free_port  # noqa: E402
from gpu_runner.config import load_model_config  # noqa: E402
from gpu_runner.runner import ModelRunner, RunnerOptions  # noqa: E402

RESULTS = ROOT / "bench" / "results"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
BLOCK_SIZE = 16
KV_CACHE_BYTES = 2 << 30
MAX_BATCHED_TOKENS = 2048
MAX_NUM_SEQS = 256
PEER_TIMEOUT_S = 600.0
# A pagewire stream still running after this long fails its run, as a peer's run does after
# --peer-timeout: a hung service must not hang the bench.
STREAM_TIMEOUT_S = PEER_TIMEOUT_S
STAGES = ("pagewire", "ceiling", "hf-static", "hf-cb", "vllm", "w4")
PEER_NAMES = {"hf-static": "transformers static", "hf-cb": "transformers continuous",
              "vllm": "vLLM CPU"}
DTYPES = ("float32", "bfloat16")
# Peers measured in the full dtype alone: transformers' continuous batching takes ~4 minutes
# of W1 per dtype, half the time the other dtypes' rows may add to the bench.
FULL_DTYPE_ONLY = ("hf-cb",)
# W1 rounds of the other dtypes (--other-dtype-rounds): transformers static batching runs
# several times slower in bfloat16 than in float32 on this CPU (a warm-up of 4 minutes under
# load, against 35 s for a float32 run), and every round runs every row once.
OTHER_DTYPE_ROUNDS = 2


class Results:
    """The results file, rewritten (JSON, markdown, chart) after every change. W1's rows are
    the engines' own records, read at every save."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.json_path = folder / "serve_bench.json"
        self.data: dict[str, Any] = {
            "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "w1": {"rounds": W1_ROUNDS, "seeds": [round_seed(i) for i in range(W1_ROUNDS)],
                   "rows": [], "orders": {}, "rounds_by_dtype": {}},
            "pagewire": {}}
        self.w1_rows: list[W1Row] = []
        self.peaks: MachinePeaks | None = None
        self.rooflines: dict[str, RooflineTally] = {}  # by dtype

    def roofline(self, dtype: str) -> RooflineTally | None:
        """The tally of W1's rooflines in `dtype` (None when the peaks were not measured)."""
        if self.peaks is None:
            return None
        return self.rooflines.setdefault(dtype, RooflineTally(dtype, self.peaks))

    def set_pagewire(self, key: str, row: Any) -> None:
        self.data["pagewire"][key] = row
        self.save()

    def save(self) -> None:
        self.data["w1"]["rows"] = [row.as_dict() for row in self.w1_rows]
        if self.peaks is not None:
            self.data["roofline"] = {
                "peaks": self.peaks.as_dict(),
                "dtypes": {dtype: tally.as_dict() for dtype, tally in self.rooflines.items()}}
        self.folder.mkdir(parents=True, exist_ok=True)
        self.json_path.write_text(json.dumps(self.data, indent=2))
        (self.folder / "serve_bench.md").write_text(markdown(self.data))
        chart(self.data, self.folder / "serve_bench.png")

    def failures(self) -> list[str]:
        w4 = self.data.get("w4", {}).get("policies", {})
        return [*(f"{row.name}: {row.status}" for row in self.w1_rows
                  if row.status.startswith("failed")),
                *(f"W4 {policy}: {row['error']}" for policy, row in w4.items() if "error" in row)]


def _progress(label: str, total: int) -> tqdm:
    return tqdm(total=total, desc=label, unit="req", leave=False, file=sys.stderr)


def _run(address: str, label: str, requests: list[BenchRequest],
         allow_errors: bool = False) -> RunSummary:
    with _progress(label, len(requests)) as bar:
        summary = run_workload(address, requests, bar, STREAM_TIMEOUT_S)
    if summary.errors and not allow_errors:
        first = next(t.error for t in summary.timings if t.error)
        raise RuntimeError(f"{label}: {summary.errors} requests failed, e.g. {first}")
    return summary


def _latency_row(summary: RunSummary) -> dict[str, float]:
    return {
        "tokens_per_s": summary.tokens_per_s,
        "ttft_p50_s": summary.percentile("ttft", 50),
        "ttft_p99_s": summary.percentile("ttft", 99),
        "tpot_p50_s": summary.percentile("tpot", 50),
        "tpot_p99_s": summary.percentile("tpot", 99),
        "latency_p50_s": summary.percentile("latency", 50),
        "latency_p99_s": summary.percentile("latency", 99),
        "cached_tokens": float(sum(t.cached_tokens for t in summary.timings)),
    }


def launch_config(runner_args: list[str], dtype: str = FULL_DTYPE) -> LaunchConfig:
    """The three services with the bench's settings, the runner's model in `dtype`, on free
    ports, logging to a temp folder."""
    return LaunchConfig(
        port=free_port(),
        metrics_port=free_port(),
        block_size=BLOCK_SIZE,
        kv_cache_memory=KV_CACHE_BYTES,
        dtype=dtype,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        max_num_seqs=MAX_NUM_SEQS,
        runner_args=runner_args,
        log_dir=Path(tempfile.mkdtemp(prefix="pagewire-bench-")),
    )


def ceiling_options(model_dir: Path, dtype: str) -> RunnerOptions:
    """The ceiling's in-process runner: the services' runner settings, in `dtype`."""
    return RunnerOptions(model=str(model_dir), block_size=BLOCK_SIZE,
                         kv_cache_memory=KV_CACHE_BYTES, dtype=dtype)


@dataclass
class Ceiling:
    """The ceiling of one dtype: an in-process runner that replays each offline run's
    recorded batches, and the tally of those batches' roofline (None: not counted)."""

    runner: ModelRunner
    record_path: Path
    roofline: RooflineTally | None = None


class PagewireW1:
    """pagewire's W1 through its three services, one way: offline (every request `final_only`)
    or streamed. Both ways share the services' processes, warmed up once by the offline way.
    The offline way also times the ceiling: right after each run, its recorded batches are
    replayed on an in-process runner (kept for all rounds, warmed up on the warm-up's batches),
    and counted for the roofline of both the replay and the run."""

    def __init__(self, address: str, metrics_port: int, final_only: bool,
                 ceiling: Ceiling | None = None, dtype: str = FULL_DTYPE,
                 rounds: int = W1_ROUNDS) -> None:
        self._address, self._metrics_port, self._final_only = address, metrics_port, final_only
        self._rounds = rounds  # for the progress bars
        self._how = "offline" if final_only else "streamed"
        self._label = f"W1 {row_name(f'pagewire {self._how}', dtype)}"
        self._ceiling, self._dtype = ceiling, dtype
        # The streamed way starts nothing: it runs on the offline way's three processes.
        self.row = W1Row(row_name(PAGEWIRE if final_only else STREAMED, dtype),
                         processes_started=3 if final_only else 0,
                         warm_up=WARM_UP if final_only else "the offline row's (same processes)",
                         dtype=dtype)
        self.ceiling_row = W1Row(row_name(CEILING, dtype), processes_started=1, warm_up=(
            "a replay of the warm-up's batches (same runner for all rounds)"), dtype=dtype)
        self.rows = [self.row, self.ceiling_row] if ceiling else [self.row]
        self.windows: list[tuple[step_profile.Snapshot, step_profile.Snapshot]] = []
        self.client_cpu_s = 0.0

    def _requests(self, requests: list[BenchRequest], salt: str) -> list[BenchRequest]:
        # A salt per run: the offline and streamed runs of a round share their prompts.
        return [replace(r, cache_salt=salt, final_only=self._final_only) for r in requests]

    def warm_up(self, requests: list[BenchRequest]) -> None:
        if not self._final_only:
            return
        if self._ceiling:
            self._ceiling.record_path.write_bytes(b"")
        label = f"{self._label} warm-up"
        salted = self._requests(requests, "w1-warm-up")
        summary = _run(self._address, label, salted)
        check_counts(label, salted, [t.output_tokens for t in summary.timings])
        if self._ceiling:
            replay(self._ceiling.runner, self._ceiling.record_path)

    def run(self, round_index: int, requests: list[BenchRequest]) -> None:
        label = f"{self._label}, round {round_index + 1}/{self._rounds}"
        salted = self._requests(requests, f"w1-{round_index}-{self._how}")
        self.row.settle()
        if self._ceiling:
            self._ceiling.record_path.write_bytes(b"")  # the ceiling replays this run alone
        before, cpu_before = step_profile.take_snapshot(self._metrics_port), time.process_time()
        summary = _run(self._address, label, salted)
        self.client_cpu_s += time.process_time() - cpu_before
        self.windows.append((before, step_profile.take_snapshot(self._metrics_port)))
        check_counts(label, salted, [t.output_tokens for t in summary.timings])
        self.row.add_round(summary.seconds, summary.output_tokens)
        if self._ceiling and not self.ceiling_row.status:
            self._replay(round_index, summary.output_tokens, summary.seconds)

    def _replay(self, round_index: int, output_tokens: int, run_s: float) -> None:
        """The ceiling's run: the offline run's batches again, so its tokens are that run's;
        then the roofline of those batches, timed by the replay and by the run."""
        ceiling = self._ceiling
        assert ceiling is not None
        self.ceiling_row.settle()
        try:
            with _progress(f"W1 {self.ceiling_row.name} (replay), round {round_index + 1}",
                           1) as bar:
                replay_s = replay(ceiling.runner, ceiling.record_path)
                bar.update(1)
            self.ceiling_row.add_round(replay_s, output_tokens)
            if ceiling.roofline is not None:
                works = recorded_work(ceiling.runner.config, ceiling.record_path, self._dtype)
                ceiling.roofline.add("ceiling", works, replay_s)
                ceiling.roofline.add("pagewire", works, run_s)
        except Exception as error:  # the ceiling alone fails; pagewire's rows go on
            print(f"*** W1 {self.ceiling_row.name} failed: {error!r} ***", file=sys.stderr)
            self.ceiling_row.status = f"failed in round {round_index + 1}: {error!r}"

    def profile(self) -> dict[str, Any]:
        return step_profile.profile(self.windows, sum(self.row.round_seconds),
                                    self.client_cpu_s)


def _peer_command(key: str, model_dir: Path, dtype: str) -> list[str] | None:
    """The command line of a peer, its model in `dtype`; None when it is not installed."""
    if key == "vllm":
        if not VLLM_PYTHON.exists():
            return None
        script = [str(VLLM_PYTHON), str(ROOT / "bench" / "peers" / "vllm_offline.py")]
    else:
        mode = "static" if key == "hf-static" else "continuous"
        script = [sys.executable, str(ROOT / "bench" / "peers" / "hf.py"), mode]
    return peer_command(script, str(model_dir), dtype)


class PeerW1:
    """A peer's W1: its process starts at the warm-up and serves every round."""

    def __init__(self, name: str, command: list[str], timeout_s: float,
                 dtype: str = FULL_DTYPE, rounds: int = W1_ROUNDS) -> None:
        self._command, self._timeout_s, self._rounds = command, timeout_s, rounds
        self._process: PeerProcess | None = None
        self.row = W1Row(name, warm_up=WARM_UP, dtype=dtype)
        self.rows = [self.row]

    def _run(self, label: str, requests: list[BenchRequest]) -> tuple[float, int]:
        """One run; a failed one ends the peer's process at once: it must not hold its memory
        (or, idle, any CPU) through the other engines' runs."""
        assert self._process is not None
        try:
            outcome = self._process.run(label, [PeerRequest(r.prompt_token_ids, r.max_tokens)
                                                for r in requests], self._timeout_s)
            if outcome.status:
                raise RuntimeError(outcome.status)
            if not 0 < outcome.seconds <= outcome.wall_s:
                raise RuntimeError(f"{label}: the peer says it took {outcome.seconds} s of a run "
                                   f"that took {outcome.wall_s:.1f} s from request to answer")
            check_counts(label, requests, outcome.output_tokens)
        except Exception:
            self.close()
            raise
        self.row.settings = outcome.settings
        return outcome.seconds, sum(outcome.output_tokens)

    def warm_up(self, requests: list[BenchRequest]) -> None:
        self._process = PeerProcess(self._command)
        self.row.processes_started += 1
        self._run(f"W1 {self.row.name} warm-up (model loading included)", requests)

    def run(self, round_index: int, requests: list[BenchRequest]) -> None:
        self.row.settle()
        self.row.add_round(*self._run(
            f"W1 {self.row.name}, round {round_index + 1}/{self._rounds}", requests))

    def close(self) -> None:
        if self._process is not None:
            self._process.close()


def make_peers(model_dir: Path, stages: list[str], timeout_s: float, dtype: str = FULL_DTYPE,
               rounds: int = W1_ROUNDS) -> tuple[list[PeerW1], list[W1Row]]:
    """The selected peers that are installed, in `dtype`; and a row for each other selected
    peer, that says why it does not run."""
    peers, missing = [], []
    for key, base in PEER_NAMES.items():
        if key not in stages:
            continue
        name = row_name(base, dtype)
        if dtype != FULL_DTYPE and key in FULL_DTYPE_ONLY:
            missing.append(W1Row(name, status=f"not run in {dtype} (the bench's time; "
                                              f"measured in {FULL_DTYPE})", dtype=dtype))
            continue
        command = _peer_command(key, model_dir, dtype)
        if command is None:
            print(f"{name} peer skipped: not installed (run `make bench-peers`)", file=sys.stderr)
            missing.append(W1Row(name, status="not installed (make bench-peers)", dtype=dtype))
            continue
        peers.append(PeerW1(name, command, timeout_s, dtype, rounds))
    return peers, missing


def run_w1(engines: list[W1Engine], results: Results, dtype: str = FULL_DTYPE,
           missing: list[W1Row] | None = None, rounds: int = W1_ROUNDS) -> None:
    """W1's rounds of one dtype's engines; their rows (and `missing`, the rows of peers that
    do not run) follow the rows of the dtypes before."""
    results.w1_rows += [row for engine in engines for row in engine.rows] + (missing or [])
    results.data["w1"]["rounds_by_dtype"][dtype] = rounds
    results.data["w1"]["orders"][dtype] = run_rounds(engines, rounds, after_run=results.save)
    results.save()


def close_all(peers: list[PeerW1]) -> None:
    for peer in peers:
        peer.close()


def run_pagewire(args: argparse.Namespace, model_dir: Path, results: Results,
                 peers: list[PeerW1], missing: list[W1Row], dtype: str = FULL_DTYPE) -> None:
    rounds = w1_rounds(args, dtype)
    """W1 in `dtype` with the peers; then, in the full dtype, W2 and W3; through the three
    services as processes, their runner in `dtype`, each saved as it ends."""
    recording = tempfile.TemporaryDirectory(prefix="pagewire-ceiling-")
    record_path = Path(recording.name) / "batches.recording"
    config = launch_config(["--record-batches", str(record_path)], dtype)
    launcher = Launcher(config)
    try:
        launcher.start()
        address = launcher.gateway_address
        ceiling = None
        if "ceiling" in args.stages:
            ceiling = Ceiling(ModelRunner(ceiling_options(model_dir, dtype)), record_path,
                              results.roofline(dtype))
        offline = PagewireW1(address, config.metrics_port, True, ceiling, dtype, rounds)
        # The streamed way in the full dtype alone: it measures the services, not the model.
        streamed = (PagewireW1(address, config.metrics_port, False)
                    if dtype == FULL_DTYPE else None)
        try:
            run_w1([offline, *([streamed] if streamed else []), *peers], results, dtype, missing,
                   rounds)
        finally:
            close_all(peers)
        if streamed is None or offline.row.status or streamed.row.status:
            return
        results.set_pagewire("w1_profile", offline.profile())
        results.set_pagewire("w1_streamed_profile", streamed.profile())
        shared = workloads.shared_prefix()
        # Off: a unique cache salt per request, so no request can reuse another's blocks.
        off = [replace(r, cache_salt=f"off-{i}") for i, r in enumerate(shared)]
        results.set_pagewire("w2_cache_off", _latency_row(_run(address, "W2 cache off", off)))
        results.set_pagewire("w2_cache_on", _latency_row(_run(address, "W2 cache on", shared)))
        run_online(address, args.w3_rates, args.w3_duration,
                   lambda w3: results.set_pagewire("w3", w3))
    finally:
        launcher.request_stop()
        launcher.stop()
        recording.cleanup()


def run_online(address: str, rates: list[float], duration_s: float,
               save: Callable[[dict[str, Any]], None]) -> None:
    """W3 at increasing rates until p99 TTFT exceeds the target; saved after each rate."""
    w3: dict[str, Any] = {"rates": {}, "duration_s": duration_s, "best_rate_per_s": 0.0}
    for rate in rates:
        # Past saturation the gateway refuses streams (admission limits): that rate is not held.
        summary = _run(address, f"W3 {rate}/s", workloads.online(rate, duration_s),
                       allow_errors=True)
        row = {**_latency_row(summary), "refused": float(summary.errors)}
        w3["rates"][str(rate)] = row
        held = row["ttft_p99_s"] <= P99_TTFT_TARGET_S and not summary.errors
        if held:
            w3["best_rate_per_s"] = rate
        save(w3)
        if not held:
            break


def _stage_list(text: str) -> list[str]:
    names = [name for name in text.split(",") if name]
    unknown = sorted(set(names) - set(STAGES))
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown stage(s) {', '.join(unknown)}; choose from {', '.join(STAGES)}")
    return names


def w1_rounds(args: argparse.Namespace, dtype: str) -> int:
    """W1's rounds in `dtype`: all of them in the full dtype, --other-dtype-rounds else."""
    return W1_ROUNDS if dtype == FULL_DTYPE else args.other_dtype_rounds


def _dtype_list(text: str) -> list[str]:
    names = [name for name in text.split(",") if name]
    unknown = sorted(set(names) - set(DTYPES))
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown dtype(s) {', '.join(unknown)}; choose from {', '.join(DTYPES)}")
    return list(dict.fromkeys(names))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="20 s per online rate")
    parser.add_argument("--w3-rates", type=lambda s: [float(x) for x in s.split(",")],
                        default=None, help="comma-separated request rates for W3")
    parser.add_argument("--w3-duration", type=float, default=None)
    parser.add_argument("--only", type=_stage_list, default=None,
                        help=f"comma-separated stages to run, of: {','.join(STAGES)}")
    parser.add_argument("--skip", type=_stage_list, default=[],
                        help="comma-separated stages not to run")
    parser.add_argument("--dtypes", type=_dtype_list, default=list(DTYPES),
                        help="comma-separated dtypes W1 runs in, one after the other "
                             f"(default {','.join(DTYPES)}); W2 and W3 run in {FULL_DTYPE} only")
    parser.add_argument("--other-dtype-rounds", type=int, choices=range(1, W1_ROUNDS + 1),
                        default=OTHER_DTYPE_ROUNDS, metavar=f"1..{W1_ROUNDS}",
                        help=f"W1 rounds of the dtypes other than {FULL_DTYPE} (default "
                             f"{OTHER_DTYPE_ROUNDS}; {FULL_DTYPE} runs {W1_ROUNDS}): the first "
                             "rounds' prompts, so rounds pair up across dtypes")
    parser.add_argument("--peer-timeout", type=float, default=PEER_TIMEOUT_S,
                        help="seconds one peer run may take (its warm-up: model loading too)")
    parser.add_argument("--w4-prefixes", type=int, default=16, help="W4's system prompts")
    parser.add_argument("--w4-per-prefix", type=int, default=None,
                        help="W4's requests per system prompt (default 8, --quick 4)")
    parser.add_argument("--w4-rate", type=float, default=2.0, help="W4's arrivals per second")
    parser.add_argument("--results-dir", type=Path, default=RESULTS,
                        help="where serve_bench.{json,md,png} go (default: bench/results)")
    args = parser.parse_args(argv)
    args.w3_duration = args.w3_duration or (20.0 if args.quick else 60.0)
    args.w3_rates = args.w3_rates or ([1.0, 2.0, 3.0] if args.quick else [1.0, 2.0, 3.0, 4.0, 5.0])
    args.w4_per_prefix = args.w4_per_prefix or (4 if args.quick else 8)
    args.stages = [s for s in (args.only or STAGES) if s not in args.skip]
    if "ceiling" in args.stages and "pagewire" not in args.stages:
        parser.error("the ceiling replays pagewire's W1 batches: run it with pagewire")
    return args


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING)
    model_dir = resolve_model(None)
    results = Results(args.results_dir)
    started = time.perf_counter()
    if "ceiling" in args.stages:
        # Once, before anything runs, on a settled machine: the limits every dtype's W1 is
        # put against.
        wait_until_quiet()
        results.peaks = measure_peaks(load_model_config(model_dir), args.dtypes)
        results.save()
    for dtype in args.dtypes:
        rounds = w1_rounds(args, dtype)
        peers, missing = make_peers(model_dir, args.stages, args.peer_timeout, dtype, rounds)
        if "pagewire" in args.stages:
            run_pagewire(args, model_dir, results, peers, missing, dtype)
        elif peers or missing:
            try:
                run_w1(list(peers), results, dtype, missing, rounds)
            finally:
                close_all(peers)
    if "w4" in args.stages:
        def save_w4(w4: dict[str, Any]) -> None:
            results.data["w4"] = w4
            results.save()
        run_w4(W4Settings(args.w4_prefixes, args.w4_per_prefix, args.w4_rate,
                          args.peer_timeout), save_w4,
               lambda policy, total: _progress(f"W4 {policy}", total))
    results.data["bench_seconds"] = time.perf_counter() - started
    results.save()
    print(markdown(results.data))
    failures = results.failures()
    if failures:
        print("serve_bench FAILED: " + "; ".join(failures), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
