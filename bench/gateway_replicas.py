"""W1 through one gateway and through two, on the real default model, side by side.

    .venv/bin/python bench/gateway_replicas.py              # 4 rounds (about 4 minutes)
    .venv/bin/python bench/gateway_replicas.py --rounds 2

Do gateway replicas add capacity, or split the runner's batch? One launch of
`pagewire serve --runners 1 --gateways 2` (serve_bench's settings: float32, 2 GiB of KV cache,
2048 batched tokens, 256 sequences), warmed up with one W1-sized run of another seed through
both gateways; then rounds, each with its own W1 prompts (bench/w1.py round_workload) and a
cache salt per run, alternating which way goes first:
- "one gateway": every request through gateway 0 (gateway 1 idles);
- "two gateways": requests alternately through gateway 0 and 1, both at once.
The machine settles before each timed run (bench/w1.py wait_until_quiet). Every request's
output tokens are counted on the client and must equal its max_tokens. Reported: output tok/s
per run and the ratio two ÷ one per round (median, min–max). Both ways run on the same
processes, so they meet the same machine; the runner merges the two gateways' batches into one
forward (gpu_runner/merging.py), which is what makes two ≈ one.

Results: bench/results/gateway_replicas.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import workloads  # noqa: E402
from bench.harness import (  # noqa: E402
    RESULTS,
    Server,
    exit_on_sigterm,
    free_port_run,
    git_state,
    run_header,
    save_results,
    wait_for,
)
from bench.openai_serve import OFFLINE, PAGEWIRE  # noqa: E402
from bench.timing import run_workload  # noqa: E402
from bench.w1 import (  # noqa: E402
    WARM_UP_SEED,
    Ratio,
    check_counts,
    per_round_ratio,
    round_order,
    round_workload,
    wait_until_quiet,
)
from bench.workloads import BenchRequest  # noqa: E402
from common.model_store import resolve_model  # noqa: E402
from gateway.launcher import is_serving  # noqa: E402

START_TIMEOUT_S = 600.0
WAYS = ("one gateway", "two gateways")


def serve_command(model_dir: Path, port: int, http_port: int, log_dir: Path) -> list[str]:
    return [str(PAGEWIRE), "serve", "--model", str(model_dir), "--host", "127.0.0.1",
            "--port", str(port), "--http-port", str(http_port), "--runners", "1",
            "--gateways", "2",
            "--block-size", "16", "--kv-cache-memory", str(2 << 30), "--max-model-len", "2048",
            "--max-num-batched-tokens", "2048", "--max-num-seqs", "256",
            "--log-dir", str(log_dir)]


def run_way(way: str, addresses: list[str], requests: list[BenchRequest]) -> tuple[float, int]:
    """(seconds, output tokens) of one W1 run the given way; every count checked."""
    if way == WAYS[0]:
        shares = [requests]
        targets = addresses[:1]
    else:
        shares = [requests[i::len(addresses)] for i in range(len(addresses))]
        targets = addresses
    started = time.perf_counter()
    with ThreadPoolExecutor(len(targets)) as pool:
        summaries = list(pool.map(lambda pair: run_workload(pair[0], pair[1], timeout_s=600),
                                  zip(targets, shares, strict=True)))
    seconds = time.perf_counter() - started
    for share, summary in zip(shares, summaries, strict=True):
        check_counts(way, share, [timing.output_tokens for timing in summary.timings])
    return seconds, sum(summary.output_tokens for summary in summaries)


def salted(requests: list[BenchRequest], salt: str) -> list[BenchRequest]:
    """No run finds another's prompts in the prefix cache."""
    return [replace(request, cache_salt=salt) for request in requests]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    exit_on_sigterm()
    model_dir = resolve_model(None)
    data: dict[str, Any] = {
        **run_header("bench/gateway_replicas.py", argv),
        "git": git_state(), "cpus": os.cpu_count(), "model": str(model_dir.name),
        "runs": []}
    with tempfile.TemporaryDirectory(prefix="gateway-replicas-") as logs:
        measure(model_dir, Path(logs), args.rounds, data)
    # Only a whole run replaces the results (an interrupted one prints its runs as it goes).
    save_results(args.results, "gateway_replicas", data, markdown(data))
    return 0


def measure(model_dir: Path, log_dir: Path, rounds: int, data: dict[str, Any]) -> None:
    """One launch, its warm-up, then `rounds` rounds; each run is added to data["runs"]."""
    # `pagewire serve --gateways 2` serves gRPC on port and port + 1, HTTP on http_port and
    # http_port + 1: one run of four free ports.
    port = free_port_run(4)
    http_port = port + 2
    addresses = [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"]
    server = Server("pagewire", serve_command(model_dir, port, http_port, log_dir / "services"),
                    dict(OFFLINE), http_port, log_dir / "pagewire.log")
    data["server"] = " ".join(server.command)
    try:
        server.start(START_TIMEOUT_S)  # the first gateway's HTTP API answers
        assert server.process is not None
        try:
            wait_for("the gateways to serve",
                     lambda: all(is_serving(address) for address in addresses),
                     [server.process], 60)
        except RuntimeError:
            raise SystemExit(f"the gateways did not serve:\n{server.log_tail()}") from None
        warm = salted(workloads.offline_throughput(seed=WARM_UP_SEED), "warm-up")
        run_way(WAYS[1], addresses, warm)
        for round_index in range(rounds):
            requests = round_workload(round_index)
            for way in round_order(round_index, WAYS):
                settled = wait_until_quiet()
                seconds, tokens = run_way(way, addresses, salted(
                    requests, f"round-{round_index}-{way}"))
                data["runs"].append({"round": round_index + 1, "way": way, "seconds": seconds,
                                     "output_tokens": tokens, "tokens_per_s": tokens / seconds,
                                     "settled_s": settled})
                print(f"round {round_index + 1} {way}: {tokens} tokens in {seconds:.1f} s, "
                      f"{tokens / seconds:.1f} tok/s", flush=True)
    finally:
        server.stop()


def ratio(data: dict[str, Any]) -> Ratio | None:
    """two ÷ one over the rounds both ways ran."""
    rates = {way: [run["tokens_per_s"] for run in sorted(data["runs"], key=lambda r: r["round"])
                   if run["way"] == way] for way in WAYS}
    return per_round_ratio(rates[WAYS[1]], rates[WAYS[0]])


def markdown(data: dict[str, Any]) -> str:
    lines = ["# W1 through one gateway and through two (one runner, the default model)", "",
             f"`{data['command']}` — {data['measured_at']}, git {data['git']}, "
             f"{data['cpus']} CPUs. Server: `{data.get('server', '')}`.", "",
             "| round | way | seconds | output tokens | tok/s |", "|---:|---|---:|---:|---:|"]
    for run in data["runs"]:
        lines.append(f"| {run['round']} | {run['way']} | {run['seconds']:.1f} | "
                     f"{run['output_tokens']} | {run['tokens_per_s']:.1f} |")
    two_over_one = ratio(data)
    if two_over_one is not None:
        lines += ["", f"two gateways ÷ one, per round: median {two_over_one.median:.3f} "
                      f"(min {two_over_one.low:.3f}, max {two_over_one.high:.3f}, "
                      f"{two_over_one.rounds} rounds)."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
