"""pagewire side by side with its peers on one machine, model and workload, in one run.

    .venv/bin/python bench/serve_bench.py            # everything (about 15 minutes on 2 cores)
    .venv/bin/python bench/serve_bench.py --quick    # shorter online phase, fewer rates
    .venv/bin/python bench/serve_bench.py --only hf-cb        # re-measure one peer
    .venv/bin/python bench/serve_bench.py --skip vllm,hf-cb   # everything else

Workloads (bench/workloads.py, seeded): W1 offline throughput, W2 shared prefix with prefix
caching on and off, W3 online Poisson arrivals. Peers on W1: transformers static batching,
transformers continuous batching, vLLM CPU (when `make bench-peers` installed it), and the
ceiling: pagewire's own runner replaying the very batches of a W1 run in-process. W1 runs in
W1_ROUNDS rounds, each one pagewire's W1 twice (offline: every request `final_only`, one
message with the whole completion, as the peers' offline APIs return it, which is the headline
row; and streamed: a message per step per request; in swapped order every round), the
ceiling's replay of the offline run's batches right after that run, then every peer's W1
(pagewire's services stay up and idle meanwhile), and every W1 rate is a total over the rounds:
this machine's speed drifts by tens of percent over minutes, and a ratio should compare engines
measured under the same conditions, not minutes apart.

Each peer runs in its own child process under a time limit (--peer-timeout, model loading
included): a peer that hangs or crashes is stopped and shows in the table as "timed out after
N s" or "failed", and the rest of the bench goes on.

Threads, the same for everyone: the 2 cores of this machine. pagewire's runner and both
transformers peers use torch's default (one thread per core); vLLM's worker is bound to every
core with VLLM_CPU_OMP_THREADS_BIND (its default, "auto", keeps one core of two for its
scheduler process and computes on one thread), with 2 GiB of KV cache
(VLLM_CPU_KVCACHE_SPACE), pagewire's budget here. A value already in the environment wins
(`VLLM_CPU_OMP_THREADS_BIND=auto` measures vLLM's own default); each peer row records the
settings it ran with. vLLM keeps its own scheduler budget (4096 batched tokens), transformers'
continuous batching gets pagewire's (2048). See bench/peers/{hf,vllm_offline}.py.

Results go to bench/results/serve_bench.{json,md,png}, rewritten after every workload and
peer, so a crash keeps what finished. A run merges into the JSON already there: it replaces
the rows it measures (a pagewire run replaces all of pagewire's rows and drops a ceiling it
did not re-measure) and keeps the others, each row stamped with when it was measured;
--fresh starts from an empty file instead.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tqdm import tqdm  # noqa: E402

from bench import step_profile, workloads  # noqa: E402
from bench.ceiling import replay  # noqa: E402
from bench.peers.child import PeerOutcome, run_peer  # noqa: E402
from bench.peers.protocol import PeerRequest  # noqa: E402
from bench.timing import RunSummary, run_workload  # noqa: E402
from bench.workloads import BenchRequest  # noqa: E402
from common.model_store import resolve_model  # noqa: E402
from gateway.launcher import LaunchConfig, Launcher, free_port  # noqa: E402
from gpu_runner.runner import ModelRunner, RunnerOptions  # noqa: E402

RESULTS = ROOT / "bench" / "results"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
BLOCK_SIZE = 16
KV_CACHE_BYTES = 2 << 30
MAX_BATCHED_TOKENS = 2048
MAX_NUM_SEQS = 256
P99_TTFT_TARGET_S = 2.0
# W1 and the ceiling alternate this many times (totals over the rounds): this machine's speed
# drifts by tens of percent over minutes, and one pair of runs can straddle a change (single
# rounds' efficiency ranged 0.85-0.96 in one afternoon). Even: the offline and streamed runs
# take turns going first.
W1_ROUNDS = 4
# Before each W1 run, the machine should be this idle (a window of 0.5 s), for at most
# QUIET_MAX_S: the round after the peers' ran 15 % slower (14:10 run) than the one before.
QUIET_IDLE = 0.95
QUIET_MAX_S = 60.0
PEER_TIMEOUT_S = 600.0
STAGES = ("pagewire", "ceiling", "hf-static", "hf-cb", "vllm")
PEER_NAMES = {"hf-static": "transformers static", "hf-cb": "transformers continuous",
              "vllm": "vLLM CPU"}


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class Results:
    """The results file, rewritten (JSON, markdown, chart) after every change."""

    def __init__(self, folder: Path, fresh: bool) -> None:
        self.folder = folder
        self.json_path = folder / "serve_bench.json"
        self.data: dict[str, Any] = {}
        if not fresh and self.json_path.exists():
            self.data = json.loads(self.json_path.read_text())
        self.data.setdefault("peers", {})

    def start_pagewire(self) -> None:
        """A new pagewire run: its rows and the ceiling derived from its W1 are now stale."""
        self.data["pagewire"] = {"measured_at": _now()}
        self.data.pop("ceiling", None)
        self.save()

    def set_pagewire(self, key: str, row: Any) -> None:
        self.data["pagewire"][key] = row
        self.save()

    def set_ceiling(self, row: dict[str, Any]) -> None:
        self.data["ceiling"] = {**row, "measured_at": _now()}
        self.save()

    def set_peer(self, name: str, row: dict[str, Any]) -> None:
        self.data["peers"][name] = {**row, "measured_at": _now()}
        self.save()

    def save(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.json_path.write_text(json.dumps(self.data, indent=2))
        (self.folder / "serve_bench.md").write_text(markdown(self.data))
        chart(self.data, self.folder / "serve_bench.png")


def _progress(label: str, total: int) -> tqdm:
    return tqdm(total=total, desc=label, unit="req", leave=False, file=sys.stderr)


def _run(address: str, label: str, requests: list[BenchRequest],
         allow_errors: bool = False) -> RunSummary:
    with _progress(label, len(requests)) as bar:
        summary = run_workload(address, requests, bar)
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


def launch_config(runner_args: list[str]) -> LaunchConfig:
    """The three services with the bench's settings, on free ports, logging to a temp folder."""
    return LaunchConfig(
        port=free_port(),
        metrics_port=free_port(),
        block_size=BLOCK_SIZE,
        kv_cache_memory=KV_CACHE_BYTES,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        max_num_seqs=MAX_NUM_SEQS,
        runner_args=runner_args,
        log_dir=Path(tempfile.mkdtemp(prefix="pagewire-bench-")),
    )


def run_pagewire(args: argparse.Namespace, model_dir: Path, results: Results,
                 peers: PeerRounds) -> None:
    """W1, W2 and W3 through the three services as processes, each saved as it ends; each
    round of W1 is followed by a replay of its batches (with the ceiling selected) and by the
    peers' round."""
    record_path = Path(tempfile.mkdtemp(prefix="pagewire-ceiling-")) / "batches.recording"
    config = launch_config(["--record-batches", str(record_path)])
    metrics_port = config.metrics_port
    launcher = Launcher(config)
    results.start_pagewire()
    try:
        launcher.start()
        address = launcher.gateway_address
        # W1's size, other prompts: the gateway's server starts a thread per concurrent stream
        # the first time it sees that many (the first W1 round used ~50 % more gateway CPU).
        _run(address, "warm-up", workloads.offline_throughput(seed=99))
        run_w1(address, metrics_port, record_path, model_dir if "ceiling" in args.stages else None,
               results, peers.run_round)
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


def wait_until_quiet(max_s: float = QUIET_MAX_S, window_s: float = 0.5) -> float:
    """Waits (up to max_s) until the machine's CPUs are QUIET_IDLE idle over a window, and
    returns the seconds waited: what one engine left running (the kernel reclaiming a peer's
    memory, a process winding down) must not be billed to the next. Linux /proc/stat only."""
    def idle_and_total() -> tuple[int, int]:
        with open("/proc/stat") as stat:
            fields = [int(value) for value in stat.readline().split()[1:]]
        return fields[3] + fields[4], sum(fields)  # idle + iowait, all

    started = time.perf_counter()
    try:
        idle, total = idle_and_total()
        while time.perf_counter() - started < max_s:
            time.sleep(window_s)
            new_idle, new_total = idle_and_total()
            busy_share = 1 - (new_idle - idle) / max(new_total - total, 1)
            if busy_share <= 1 - QUIET_IDLE:
                break
            idle, total = new_idle, new_total
    except OSError:
        pass
    return time.perf_counter() - started


@dataclass
class W1Totals:
    """One way of running W1, summed over the rounds."""

    seconds: float = 0.0
    output_tokens: int = 0
    client_cpu_s: float = 0.0
    windows: list[tuple[step_profile.Snapshot, step_profile.Snapshot]] = field(
        default_factory=list)
    round_rates: list[float] = field(default_factory=list)

    def add(self, address: str, metrics_port: int, label: str,
            requests: list[BenchRequest]) -> RunSummary:
        before, cpu_before = step_profile.take_snapshot(metrics_port), time.process_time()
        summary = _run(address, label, requests)
        self.client_cpu_s += time.process_time() - cpu_before
        self.windows.append((before, step_profile.take_snapshot(metrics_port)))
        self.add_round(summary.seconds, summary.output_tokens)
        return summary

    def add_round(self, seconds: float, output_tokens: int) -> None:
        self.seconds += seconds
        self.output_tokens += output_tokens
        self.round_rates.append(output_tokens / seconds)

    def row(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "output_tokens": self.output_tokens,
                "rounds": len(self.round_rates),
                "tokens_per_s": self.output_tokens / self.seconds,
                "round_tokens_per_s": self.round_rates}

    def profile(self) -> dict[str, Any]:
        return step_profile.profile(self.windows, self.seconds, self.client_cpu_s)


def settle() -> None:
    waited_s = wait_until_quiet()
    print(f"waited {waited_s:.1f} s for the machine to settle", file=sys.stderr)


def run_w1(address: str, metrics_port: int, record_path: Path, ceiling_model: Path | None,
           results: Results, after_round: Callable[[], None] = lambda: None) -> None:
    """W1 in W1_ROUNDS rounds. Each round runs it twice: as an offline client would (every
    request `final_only`, like the peers' offline APIs: the headline row) and streamed (a
    message per step per request), each after the machine has settled; the ceiling replays
    the offline run's batches right after it; then `after_round` runs (the peers' round). The
    two ways swap order every round (each goes first in half of them: W1_ROUNDS is even), and
    every rate is a total over the rounds."""
    runner = None
    if ceiling_model is not None:
        runner = ModelRunner(RunnerOptions(model=str(ceiling_model), block_size=BLOCK_SIZE,
                                           kv_cache_memory=KV_CACHE_BYTES))
    offline, streamed, ceiling = W1Totals(), W1Totals(), W1Totals()
    for round_index in range(W1_ROUNDS):
        for final_only in (True, False) if round_index % 2 == 0 else (False, True):
            settle()
            record_path.write_bytes(b"")  # the ceiling replays one run alone
            # A salt per run: a run must not find an earlier one's prompts in the cache.
            requests = [replace(r, cache_salt=f"w1-{round_index}-{final_only}",
                                final_only=final_only)
                        for r in workloads.offline_throughput()]
            how = "offline" if final_only else "streamed"
            label = f"W1 pagewire {how}, round {round_index + 1}/{W1_ROUNDS}"
            run = (offline if final_only else streamed).add(address, metrics_port, label,
                                                            requests)
            if final_only and runner is not None:
                with _progress(f"W1 ceiling (replay), round {round_index + 1}", 1) as bar:
                    replay_s = replay(runner, record_path)
                    bar.update(1)
                ceiling.add_round(replay_s, run.output_tokens)
        after_round()
    settle()  # before what comes next: the peers' round has just ended
    results.set_pagewire("w1_profile", offline.profile())
    results.set_pagewire("w1_streamed_profile", streamed.profile())
    results.set_pagewire("w1", offline.row())
    results.set_pagewire("w1_streamed", streamed.row())
    if runner is not None:
        results.set_ceiling(ceiling.row())


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


def _peer_command(key: str, model_dir: Path) -> list[str] | None:
    """The command line of a peer; None when it is not installed."""
    if key == "vllm":
        if not VLLM_PYTHON.exists():
            return None
        return [str(VLLM_PYTHON), str(ROOT / "bench" / "peers" / "vllm_offline.py"),
                str(model_dir)]
    mode = "static" if key == "hf-static" else "continuous"
    return [sys.executable, str(ROOT / "bench" / "peers" / "hf.py"), mode, str(model_dir)]


class PeerRounds:
    """W1 on each selected peer, once per round, each run in its own child process; a peer's
    row holds its totals over the rounds so far (saved after every run). A peer that fails or
    times out in a round keeps that status and is not run again."""

    def __init__(self, model_dir: Path, selected: list[str], timeout_s: float,
                 results: Results) -> None:
        self._commands = {key: _peer_command(key, model_dir)
                          for key in PEER_NAMES if key in selected}
        self._timeout_s = timeout_s
        self._results = results
        self._totals: dict[str, PeerOutcome] = {}
        self.rounds_done = 0
        self._requests = [PeerRequest(r.prompt_token_ids, r.max_tokens)
                          for r in workloads.offline_throughput()]

    def run_round(self) -> None:
        self.rounds_done += 1
        for key, command in self._commands.items():
            name = PEER_NAMES[key]
            if command is None:
                if self.rounds_done == 1:
                    print(f"{name} peer skipped: not installed (run `make bench-peers`)",
                          file=sys.stderr)
                    self._results.set_peer(name, {"status": "not installed (make bench-peers)"})
                continue
            total = self._totals.get(key)
            if total is not None and total.status:
                continue
            outcome = run_peer(f"W1 {name}, round {self.rounds_done}/{W1_ROUNDS}", command,
                               self._requests, self._timeout_s)
            self._totals[key] = add_outcomes(total, outcome)
            self._results.set_peer(name, {**self._totals[key].as_row(),
                                          "rounds": self.rounds_done})


def add_outcomes(total: PeerOutcome | None, outcome: PeerOutcome) -> PeerOutcome:
    """Totals over rounds; a failed round's status wins."""
    if total is None or outcome.status:
        return outcome
    return PeerOutcome(total.seconds + outcome.seconds,
                       total.output_tokens + outcome.output_tokens, total.settings)


def _peers_in_order(results: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Peer rows in the order the bench runs them, whichever run measured them."""
    order = list(PEER_NAMES.values())
    peers = results.get("peers", {})
    return sorted(peers.items(),
                  key=lambda item: order.index(item[0]) if item[0] in order else len(order))


def _ratio(numerator: float | None, row: dict[str, Any]) -> str:
    if numerator is None or "tokens_per_s" not in row:
        return "—"
    return f"{numerator / row['tokens_per_s']:.2f}"


def _w1_table(results: dict[str, Any]) -> list[str]:
    pagewire = results.get("pagewire", {})
    w1_row, streamed_row = pagewire.get("w1"), pagewire.get("w1_streamed")
    w1 = w1_row["tokens_per_s"] if w1_row else None
    lines = ["| W1 offline throughput (32 requests) | output tok/s | pagewire ÷ row |",
             "|---|---:|---:|",
             "| **pagewire** (3 services, gRPC), offline: each request `final_only` | "
             f"{'—' if w1 is None else f'{w1:.1f}'} | {'—' if w1 is None else '1.00'} |"]
    if streamed_row:
        lines.append("| pagewire streamed: a message per step per request | "
                     f"{streamed_row['tokens_per_s']:.1f} | {_ratio(w1, streamed_row)} |")
    peers = _peers_in_order(results)
    for name, row in peers:
        measured = f"{row['tokens_per_s']:.1f}" if "tokens_per_s" in row else row["status"]
        lines.append(f"| {name} | {measured} | {_ratio(w1, row)} |")
    ceiling = results.get("ceiling")
    if ceiling:
        lines.append(f"| ceiling (runner alone, same batches) | {ceiling['tokens_per_s']:.1f} | "
                     f"{_ratio(w1, ceiling)} (efficiency) |")
    if streamed_row:
        rate = streamed_row["tokens_per_s"]
        shown = [f"{name} {_ratio(rate, row)}" for name, row in
                 [*peers, ("ceiling", ceiling or {})] if "tokens_per_s" in row]
        lines += ["", f"pagewire streamed ÷ row: {', '.join(shown)}."]
    rounds = [(name, row.get("round_tokens_per_s")) for name, row in
              (("pagewire", w1_row or {}), ("streamed", streamed_row or {}),
               ("ceiling", ceiling or {}))]
    shown = [f"{name} {', '.join(f'{rate:.1f}' for rate in rates)}"
             for name, rates in rounds if rates]
    if shown:
        lines += ["", f"W1 tok/s per round: {'; '.join(shown)}."]
    return lines


def _w2_table(pagewire: dict[str, Any]) -> list[str]:
    on, off = pagewire.get("w2_cache_on"), pagewire.get("w2_cache_off")
    if not (on or off):
        return []
    lines = ["", "| W2 shared 512-token prefix (64 requests) | TTFT p50 s | TTFT p99 s | "
             "tok/s | cached prompt tokens |", "|---|---:|---:|---:|---:|"]
    for label, row in (("prefix caching on", on), ("prefix caching off", off)):
        if row:
            lines.append(f"| {label} | {row['ttft_p50_s']:.3f} | {row['ttft_p99_s']:.3f} | "
                         f"{row['tokens_per_s']:.1f} | {row['cached_tokens']:.0f} |")
    if on and off:
        lines.append(f"| on ÷ off TTFT p50 speed-up | "
                     f"{off['ttft_p50_s'] / on['ttft_p50_s']:.1f}× | | | |")
    return lines


def _w3_table(w3: dict[str, Any]) -> list[str]:
    lines = ["", f"| W3 online, Poisson, {w3['duration_s']:.0f} s per rate | TTFT p50 | "
             "TTFT p99 | TPOT p50 | TPOT p99 | latency p50 | latency p99 | tok/s | refused |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for rate, row in w3["rates"].items():
        lines.append(
            f"| {rate} req/s | {row['ttft_p50_s']:.2f} | {row['ttft_p99_s']:.2f} | "
            f"{row['tpot_p50_s'] * 1000:.0f} ms | {row['tpot_p99_s'] * 1000:.0f} ms | "
            f"{row['latency_p50_s']:.2f} | {row['latency_p99_s']:.2f} | "
            f"{row['tokens_per_s']:.1f} | {row['refused']:.0f} |")
    lines.append(f"\nHighest rate held with p99 TTFT ≤ {P99_TTFT_TARGET_S:.0f} s: "
                 f"{w3['best_rate_per_s']} req/s.")
    return lines


def _settings_notes(results: dict[str, Any]) -> list[str]:
    lines = ["", "Settings: 2 CPU threads for every engine (pagewire's runner and transformers: "
             "torch's default, one per core; vLLM: its worker bound to both cores with "
             "VLLM_CPU_OMP_THREADS_BIND, 2 GiB KV cache with VLLM_CPU_KVCACHE_SPACE). "
             "Each peer runs in its own process with a time limit."]
    stamps = {"pagewire": results.get("pagewire", {}).get("measured_at"),
              "ceiling": results.get("ceiling", {}).get("measured_at")}
    for name, row in results.get("peers", {}).items():
        stamps[name] = row.get("measured_at")
        if row.get("settings"):
            shown = ", ".join(f"{k}={v}" for k, v in row["settings"].items())
            lines.append(f"- {name}: {shown}")
    measured = ", ".join(f"{name} {stamp}" for name, stamp in stamps.items() if stamp)
    lines.append(f"\nMeasured (UTC): {measured}.")
    return lines


def markdown(results: dict[str, Any]) -> str:
    pagewire = results.get("pagewire", {})
    lines = _w1_table(results) + _w2_table(pagewire)
    if "w3" in pagewire:
        lines += _w3_table(pagewire["w3"])
    profiles = {name: pagewire[key] for key, name in
                (("w1_profile", "offline"), ("w1_streamed_profile", "streamed"))
                if key in pagewire}
    if profiles:
        lines += step_profile.markdown(profiles)
    lines += _settings_notes(results)
    return "\n".join(lines) + "\n"


def chart(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars: list[tuple[str, float]] = []
    pagewire = results.get("pagewire", {})
    bars += [(name, pagewire[key]["tokens_per_s"]) for key, name in
             (("w1", "pagewire"), ("w1_streamed", "pagewire streamed")) if key in pagewire]
    bars += [(name, row["tokens_per_s"]) for name, row in _peers_in_order(results)
             if "tokens_per_s" in row]
    if results.get("ceiling"):
        bars.append(("ceiling", results["ceiling"]["tokens_per_s"]))
    names, values = [name for name, _ in bars][::-1], [value for _, value in bars][::-1]
    figure, axis = plt.subplots(figsize=(8, 4))
    axis.barh(names, values, color="#3b7dd8")
    axis.set_xlabel("output tokens/s (W1, SmolLM2-135M, float32, 2-core CPU)")
    for y, value in enumerate(values):
        axis.text(value, y, f" {value:.0f}", va="center")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _stage_list(text: str) -> list[str]:
    names = [name for name in text.split(",") if name]
    unknown = sorted(set(names) - set(STAGES))
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown stage(s) {', '.join(unknown)}; choose from {', '.join(STAGES)}")
    return names


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
    parser.add_argument("--peer-timeout", type=float, default=PEER_TIMEOUT_S,
                        help="seconds a peer may take, model loading included")
    parser.add_argument("--fresh", action="store_true",
                        help="start a new results file instead of merging into the last one")
    parser.add_argument("--results-dir", type=Path, default=RESULTS,
                        help="where serve_bench.{json,md,png} go (default: bench/results)")
    args = parser.parse_args(argv)
    args.w3_duration = args.w3_duration or (20.0 if args.quick else 60.0)
    args.w3_rates = args.w3_rates or ([1.0, 2.0, 3.0] if args.quick else [1.0, 2.0, 3.0, 4.0, 5.0])
    args.stages = [s for s in (args.only or STAGES) if s not in args.skip]
    if "ceiling" in args.stages and "pagewire" not in args.stages:
        parser.error("the ceiling replays pagewire's W1 batches: run it with pagewire")
    return args


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING)
    model_dir = resolve_model(None)
    results = Results(args.results_dir, fresh=args.fresh)
    started = time.perf_counter()
    failed = False
    peers = PeerRounds(model_dir, args.stages, args.peer_timeout, results)
    if "pagewire" in args.stages:
        try:
            run_pagewire(args, model_dir, results, peers)
        except Exception:  # the peers still run; what pagewire finished is already saved
            traceback.print_exc()
            failed = True
    while peers.rounds_done < W1_ROUNDS:  # no pagewire stage, or it stopped early
        peers.run_round()
    results.data["bench_seconds"] = time.perf_counter() - started
    results.save()
    print(markdown(results.data))
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
