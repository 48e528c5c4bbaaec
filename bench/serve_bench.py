"""pagewire side by side with its peers on one machine, model and workload, in one run.

    .venv/bin/python bench/serve_bench.py            # everything (about 15 minutes on 2 cores)
    .venv/bin/python bench/serve_bench.py --quick    # shorter online phase, fewer rates

Workloads (bench/workloads.py, seeded): W1 offline throughput, W2 shared prefix with prefix
caching on and off, W3 online Poisson arrivals. Peers on W1: transformers static batching,
transformers continuous batching, vLLM CPU (when `make bench-peers` installed it), and the
ceiling: pagewire's own runner replaying the very batches of the W1 run in-process.
Results go to bench/results/serve_bench.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tqdm import tqdm  # noqa: E402

from bench import workloads  # noqa: E402
from bench.ceiling import replay  # noqa: E402
from bench.peers import hf  # noqa: E402
from bench.timing import RunSummary, run_workload  # noqa: E402
from bench.workloads import BenchRequest  # noqa: E402
from common.model_store import resolve_model  # noqa: E402
from gateway.launcher import LaunchConfig, Launcher, free_port  # noqa: E402
from gpu_runner.runner import RunnerOptions  # noqa: E402

RESULTS = ROOT / "bench" / "results"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
BLOCK_SIZE = 16
KV_CACHE_BYTES = 2 << 30
MAX_BATCHED_TOKENS = 2048
MAX_NUM_SEQS = 256
P99_TTFT_TARGET_S = 2.0


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


def run_pagewire(args: argparse.Namespace, w1_batches: Path) -> dict[str, Any]:
    """W1, W2 and W3 through the three services as processes; the runner's batches of W1
    are left in `w1_batches` for the ceiling."""
    record_path = w1_batches.with_suffix(".recording")
    config = LaunchConfig(
        port=free_port(),
        block_size=BLOCK_SIZE,
        kv_cache_memory=KV_CACHE_BYTES,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        max_num_seqs=MAX_NUM_SEQS,
        runner_args=["--record-batches", str(record_path)],
        log_dir=Path(tempfile.mkdtemp(prefix="pagewire-bench-")),
    )
    launcher = Launcher(config)
    results: dict[str, Any] = {}
    try:
        launcher.start()
        address = launcher.gateway_address
        _run(address, "warm-up", workloads.offline_throughput(4, seed=99))
        record_path.write_bytes(b"")  # the ceiling replays W1 alone
        w1 = _run(address, "W1 pagewire", workloads.offline_throughput())
        # The runner opens the file per batch: later workloads record into a new file.
        record_path.rename(w1_batches)
        results["w1"] = {"seconds": w1.seconds, "output_tokens": w1.output_tokens,
                         "tokens_per_s": w1.tokens_per_s}
        shared = workloads.shared_prefix()
        # Off: a unique cache salt per request, so no request can reuse another's blocks.
        off = [replace(r, cache_salt=f"off-{i}") for i, r in enumerate(shared)]
        results["w2_cache_off"] = _latency_row(_run(address, "W2 cache off", off))
        results["w2_cache_on"] = _latency_row(_run(address, "W2 cache on", shared))
        results["w3"] = run_online(address, args.w3_rates, args.w3_duration)
    finally:
        launcher.request_stop()
        launcher.stop()
    return results


def run_online(address: str, rates: list[float], duration_s: float) -> dict[str, Any]:
    """W3 at increasing rates until p99 TTFT exceeds the target."""
    rows: dict[str, Any] = {}
    best = 0.0
    for rate in rates:
        # Past saturation the gateway refuses streams (admission limits): that rate is not held.
        summary = _run(address, f"W3 {rate}/s", workloads.online(rate, duration_s),
                       allow_errors=True)
        row = {**_latency_row(summary), "refused": float(summary.errors)}
        rows[str(rate)] = row
        if row["ttft_p99_s"] <= P99_TTFT_TARGET_S and not summary.errors:
            best = rate
        else:
            break
    return {"rates": rows, "duration_s": duration_s, "best_rate_per_s": best}


def run_ceiling(model_dir: Path, record_path: Path, output_tokens: int) -> dict[str, float]:
    options = RunnerOptions(model=str(model_dir), block_size=BLOCK_SIZE,
                            kv_cache_memory=KV_CACHE_BYTES)
    seconds, _ = replay(record_path, options)
    return {"seconds": seconds, "tokens_per_s": output_tokens / seconds}


def run_vllm(model_dir: Path, requests: list[BenchRequest]) -> dict[str, float] | None:
    if not VLLM_PYTHON.exists():
        print("vLLM peer skipped: not installed (run `make bench-peers`)", file=sys.stderr)
        return None
    with tempfile.TemporaryDirectory() as folder:
        workload, result = Path(folder) / "workload.json", Path(folder) / "result.json"
        workload.write_text(json.dumps(
            [{"prompt_token_ids": r.prompt_token_ids, "max_tokens": r.max_tokens}
             for r in requests]))
        script = ROOT / "bench" / "peers" / "vllm_offline.py"
        done = subprocess.run([str(VLLM_PYTHON), str(script), str(model_dir), str(workload),
                               str(result)], capture_output=True, text=True)
        if done.returncode != 0:
            print(f"vLLM peer failed:\n{done.stderr[-3000:]}", file=sys.stderr)
            return None
        measured = json.loads(result.read_text())
    return {"seconds": measured["seconds"],
            "tokens_per_s": measured["output_tokens"] / measured["seconds"]}


def run_peers(model_dir: Path, skip: set[str]) -> dict[str, Any]:
    requests = workloads.offline_throughput()
    prompts = [r.prompt_token_ids for r in requests]
    lengths = [r.max_tokens for r in requests]
    peers: dict[str, Any] = {}
    if "hf-static" not in skip:
        result = hf.static_batching(model_dir, prompts, lengths)
        peers["transformers static"] = {"seconds": result.seconds,
                                        "tokens_per_s": result.tokens_per_s}
    if "hf-cb" not in skip:
        result = hf.continuous_batching(model_dir, prompts, lengths)
        peers["transformers continuous"] = {"seconds": result.seconds,
                                            "tokens_per_s": result.tokens_per_s}
    if "vllm" not in skip:
        vllm = run_vllm(model_dir, requests)
        if vllm is not None:
            peers["vLLM CPU"] = vllm
    return peers


def markdown(results: dict[str, Any]) -> str:
    pw = results["pagewire"]
    w1 = pw["w1"]["tokens_per_s"]
    lines = ["| W1 offline throughput (32 requests) | output tok/s | pagewire ÷ peer |",
             "|---|---:|---:|",
             f"| **pagewire** (3 services, gRPC) | {w1:.1f} | 1.00 |"]
    for name, row in results["peers"].items():
        lines.append(f"| {name} | {row['tokens_per_s']:.1f} | {w1 / row['tokens_per_s']:.2f} |")
    ceiling = results.get("ceiling")
    if ceiling:
        lines.append(f"| ceiling (runner alone, same batches) | {ceiling['tokens_per_s']:.1f} | "
                     f"{w1 / ceiling['tokens_per_s']:.2f} (efficiency) |")
    on, off = pw["w2_cache_on"], pw["w2_cache_off"]
    lines += ["", "| W2 shared 512-token prefix (64 requests) | TTFT p50 s | TTFT p99 s | "
              "tok/s | cached prompt tokens |", "|---|---:|---:|---:|---:|"]
    for label, row in (("prefix caching on", on), ("prefix caching off", off)):
        lines.append(f"| {label} | {row['ttft_p50_s']:.3f} | {row['ttft_p99_s']:.3f} | "
                     f"{row['tokens_per_s']:.1f} | {row['cached_tokens']:.0f} |")
    lines.append(f"| on ÷ off TTFT p50 speed-up | {off['ttft_p50_s'] / on['ttft_p50_s']:.1f}× "
                 "| | | |")
    w3 = pw["w3"]
    lines += ["", f"| W3 online, Poisson, {w3['duration_s']:.0f} s per rate | TTFT p50 | "
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
    return "\n".join(lines) + "\n"


def chart(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["pagewire", *list(results["peers"])]
    values = [results["pagewire"]["w1"]["tokens_per_s"]]
    values += [row["tokens_per_s"] for row in results["peers"].values()]
    if results.get("ceiling"):
        names.append("ceiling")
        values.append(results["ceiling"]["tokens_per_s"])
    figure, axis = plt.subplots(figsize=(8, 4))
    axis.barh(names[::-1], values[::-1], color="#3b7dd8")
    axis.set_xlabel("output tokens/s (W1, SmolLM2-135M, float32, 2-core CPU)")
    for y, value in enumerate(values[::-1]):
        axis.text(value, y, f" {value:.0f}", va="center")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="20 s per online rate")
    parser.add_argument("--w3-rates", type=lambda s: [float(x) for x in s.split(",")],
                        default=None, help="comma-separated request rates for W3")
    parser.add_argument("--w3-duration", type=float, default=None)
    parser.add_argument("--skip", default="", help="comma-separated: hf-static,hf-cb,vllm")
    args = parser.parse_args()
    args.w3_duration = args.w3_duration or (20.0 if args.quick else 60.0)
    args.w3_rates = args.w3_rates or ([0.5, 1.0, 2.0] if args.quick else [0.5, 1.0, 1.5, 2.0, 3.0])
    logging.basicConfig(level=logging.WARNING)
    model_dir = resolve_model(None)
    RESULTS.mkdir(parents=True, exist_ok=True)
    record_path = Path(tempfile.mkdtemp(prefix="pagewire-ceiling-")) / "batches.bin"
    started = time.perf_counter()
    results: dict[str, Any] = {"pagewire": run_pagewire(args, record_path)}
    results["ceiling"] = run_ceiling(model_dir, record_path,
                                     results["pagewire"]["w1"]["output_tokens"])
    results["peers"] = run_peers(model_dir, set(filter(None, args.skip.split(","))))
    results["bench_seconds"] = time.perf_counter() - started
    (RESULTS / "serve_bench.json").write_text(json.dumps(results, indent=2))
    table = markdown(results)
    (RESULTS / "serve_bench.md").write_text(table)
    chart(results, RESULTS / "serve_bench.png")
    print(table)


if __name__ == "__main__":
    main()
