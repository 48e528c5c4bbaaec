"""W4 — many prefixes, many runners: each routing policy under `pagewire serve --runners 2`.

Every policy gets the same treatment: a fresh launch with the same flags (two runners splitting
the cores, one gateway), the same untimed warm-up, a settle, then the same requests
(workloads.many_prefixes). Each runner's KV cache holds about 60 % of all the prefixes' tokens,
as in production where the prefixes outgrow one runner's memory: only a policy that keeps
each prefix on one runner can keep them all cached.

Per policy: cached prompt tokens (usage.cached_tokens, counted on the client) as a share of
all prompt tokens and of the ideal — one cache shared by every request, where each prefix's
full blocks are computed once —, TTFT p50/p99, output tokens/s, and each runner's work
(prompt tokens it computed plus tokens appended, from the block service's per-pool stats)
with the busiest ÷ idlest ratio. Issue 21's targets: prefix caches ≥ 90 % of the ideal, its
TTFT p50 is ≥ 2× better than round-robin's, busiest ÷ idlest ≤ 1.3.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from bench import workloads
from bench.timing import RunSummary, run_workload
from bench.w1 import check_counts, wait_until_quiet
from gateway.launcher import LaunchConfig, Launcher, free_port
from protos import block_pb2, block_pb2_grpc

POLICIES = ("prefix", "least-loaded", "round-robin")
BLOCK_SIZE = 16
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # SmolLM2-135M in float32: layers x (K, V) x heads x dim
KV_SHARE = 0.6  # of all the prefixes' tokens, per runner
MAX_MODEL_LEN = 2048
TARGET_CACHED_OF_IDEAL = 0.9
TARGET_TTFT_GAIN = 2.0
TARGET_BUSIEST_OVER_IDLEST = 1.3


@dataclass(frozen=True)
class W4Settings:
    num_prefixes: int = 16
    per_prefix: int = 8
    rate_per_s: float = 2.0
    timeout_s: float = 600.0


def kv_blocks(workload: workloads.ManyPrefixes) -> int:
    """Blocks per runner: KV_SHARE of every prefix's tokens."""
    return math.ceil(KV_SHARE * sum(len(p) for p in workload.prefixes) / BLOCK_SIZE)


def ideal_cached_tokens(workload: workloads.ManyPrefixes) -> int:
    """Cached prompt tokens with one shared cache: every request but each prefix's first finds
    its prefix's full blocks."""
    full = [len(prefix) // BLOCK_SIZE * BLOCK_SIZE for prefix in workload.prefixes]
    return (sum(full[index] for index in workload.prefix_of)
            - sum(full[index] for index in set(workload.prefix_of)))


def _pool_stats(address: str) -> dict[str, block_pb2.Stats]:
    with grpc.insecure_channel(address) as channel:
        stub = block_pb2_grpc.BlockServiceStub(channel)
        runners = stub.ListRunners(block_pb2.ListRunnersRequest(), timeout=10).runners
        return {runner.pool.pool_id: stub.GetStats(
            block_pb2.GetStatsRequest(pool_id=runner.pool.pool_id), timeout=10).stats
            for runner in runners}


def _work(stats: block_pb2.Stats) -> int:
    """Tokens a runner computed: uncached prompt tokens and appended ones."""
    return stats.prompt_tokens - stats.cached_prompt_tokens + stats.appended_tokens


def run_policy(policy: str, workload: workloads.ManyPrefixes, settings: W4Settings,
               progress: Callable[[int], Any] | None = None) -> dict[str, Any]:
    """One policy on a fresh `pagewire serve --runners 2`; raises when a request fails or
    produces other than its max_tokens."""
    blocks = kv_blocks(workload)
    config = LaunchConfig(
        port=free_port(), block_size=BLOCK_SIZE, kv_cache_memory=blocks * BLOCK_SIZE
        * KV_BYTES_PER_TOKEN, max_model_len=min(MAX_MODEL_LEN, blocks * BLOCK_SIZE),
        runners=2, routing=policy,
        log_dir=Path(tempfile.mkdtemp(prefix=f"pagewire-w4-{policy}-")))
    launcher = Launcher(config)
    try:
        launcher.start()
        block_address = next(c.address for c in launcher.children if c.name == "block_service")
        address = launcher.gateway_address
        warm_up = workloads.offline_throughput(8, seed=99)
        check_counts(f"W4 {policy} warm-up", warm_up,
                     [t.output_tokens for t in run_workload(address, warm_up).timings])
        settle_s = wait_until_quiet()
        before = _pool_stats(block_address)
        summary = run_workload(address, workload.requests, progress, settings.timeout_s)
        after = _pool_stats(block_address)
    finally:
        launcher.request_stop()
        launcher.stop()
    failed = [t.error for t in summary.timings if t.error]
    if failed:
        raise RuntimeError(f"W4 {policy}: {len(failed)} requests failed, e.g. {failed[0]}")
    check_counts(f"W4 {policy}", workload.requests, [t.output_tokens for t in summary.timings])
    return _row(policy, workload, summary, before, after, blocks, settle_s)


def _row(policy: str, workload: workloads.ManyPrefixes, summary: RunSummary,
         before: dict[str, block_pb2.Stats], after: dict[str, block_pb2.Stats], blocks: int,
         settle_s: float) -> dict[str, Any]:
    cached = sum(t.cached_tokens for t in summary.timings)
    prompt = sum(len(r.prompt_token_ids) for r in workload.requests)
    work = {pool: _work(after[pool]) - _work(before[pool]) for pool in after if pool in before}
    # The clients' cached tokens come from the gateway's usage: the block service must have
    # served at least as many from its caches (more when a preempted request was readmitted).
    pool_cached = sum(after[pool].cached_prompt_tokens - before[pool].cached_prompt_tokens
                      for pool in work)
    if len(work) != 2 or cached > pool_cached:
        raise RuntimeError(f"W4 {policy}: clients report {cached} cached prompt tokens, the "
                           f"block service's {len(work)} pools {pool_cached}")
    return {
        "policy": policy,
        "requests": len(workload.requests),
        "blocks_per_runner": blocks,
        "settle_s": settle_s,
        "seconds": summary.seconds,
        "output_tokens": summary.output_tokens,
        "tokens_per_s": summary.tokens_per_s,
        "ttft_p50_s": summary.percentile("ttft", 50),
        "ttft_p99_s": summary.percentile("ttft", 99),
        "cached_tokens": cached,
        "pool_cached_tokens": pool_cached,
        "cached_share": cached / prompt,
        "cached_of_ideal": cached / ideal_cached_tokens(workload),
        "runner_work_tokens": work,
        "busiest_over_idlest": max(work.values()) / max(min(work.values()), 1),
    }


def run_w4(settings: W4Settings, save: Callable[[dict[str, Any]], None],
           progress: Callable[[str, int], Any] | None = None) -> dict[str, Any]:
    """Every policy in turn, saved after each; returns the W4 results with the targets."""
    workload = workloads.many_prefixes(settings.num_prefixes, settings.per_prefix,
                                       settings.rate_per_s)
    w4: dict[str, Any] = {
        "settings": vars(settings) | {"kv_share": KV_SHARE},
        "ideal_cached_tokens": ideal_cached_tokens(workload),
        "prompt_tokens": sum(len(r.prompt_token_ids) for r in workload.requests),
        "policies": {}}
    for policy in POLICIES:
        bar = progress(policy, len(workload.requests)) if progress else None
        try:
            w4["policies"][policy] = run_policy(policy, workload, settings, bar)
        except Exception as error:  # a benchmark reports a failure instead of stopping
            w4["policies"][policy] = {"policy": policy, "error": repr(error)}
        finally:
            if bar is not None:
                bar.close()
        save(w4)
    w4["targets"] = targets(w4["policies"])
    save(w4)
    return w4


def targets(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Issue 21's W4 targets, each with its figure and whether it is met."""
    prefix, round_robin = rows.get("prefix", {}), rows.get("round-robin", {})
    if "error" in prefix or "error" in round_robin or not prefix or not round_robin:
        return {}
    gain = round_robin["ttft_p50_s"] / prefix["ttft_p50_s"]
    return {
        "cached_of_ideal": (prefix["cached_of_ideal"],
                            prefix["cached_of_ideal"] >= TARGET_CACHED_OF_IDEAL),
        "ttft_p50_gain_over_round_robin": (gain, gain >= TARGET_TTFT_GAIN),
        "busiest_over_idlest": (prefix["busiest_over_idlest"],
                                prefix["busiest_over_idlest"] <= TARGET_BUSIEST_OVER_IDLEST),
    }


def markdown(w4: dict[str, Any]) -> list[str]:
    """W4's table and its targets."""
    settings = w4["settings"]
    lines = ["", f"W4 many prefixes, many runners: {settings['num_prefixes']} prefixes of "
             f"512–1024 tokens × {settings['per_prefix']} requests (suffix 32–64, output 32–64) "
             f"in random order, Poisson {settings['rate_per_s']}/s, `pagewire serve --runners "
             f"2`, each runner's KV cache {settings['kv_share']:.0%} of the prefixes' tokens; "
             f"ideal cached tokens (one shared cache) {w4['ideal_cached_tokens']} of "
             f"{w4['prompt_tokens']} prompt tokens.", "",
             "| policy | cached share of prompt | of ideal | TTFT p50 (s) | TTFT p99 (s) | "
             "output tok/s | runner work (tokens) | busiest ÷ idlest |",
             "|---|---:|---:|---:|---:|---:|---|---:|"]
    for policy, row in w4["policies"].items():
        if "error" in row:
            lines.append(f"| {policy} | failed: {row['error']} | | | | | | |")
            continue
        work = ", ".join(str(v) for v in row["runner_work_tokens"].values())
        lines.append(f"| {policy} | {row['cached_share']:.2f} | {row['cached_of_ideal']:.2f} | "
                     f"{row['ttft_p50_s']:.2f} | {row['ttft_p99_s']:.2f} | "
                     f"{row['tokens_per_s']:.1f} | {work} | {row['busiest_over_idlest']:.2f} |")
    shown = {"cached_of_ideal": f"prefix caches ≥ {TARGET_CACHED_OF_IDEAL:.0%} of the ideal",
             "ttft_p50_gain_over_round_robin": f"TTFT p50 ≥ {TARGET_TTFT_GAIN:.0f}× better "
                                               "than round-robin",
             "busiest_over_idlest": f"busiest ÷ idlest ≤ {TARGET_BUSIEST_OVER_IDLEST}"}
    for key, (value, met) in w4.get("targets", {}).items():
        lines.append(f"- {shown[key]}: {value:.2f} — {'met' if met else 'NOT met'}")
    return lines
