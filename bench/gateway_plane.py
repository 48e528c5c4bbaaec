"""Control-plane benchmark, gateway side: what one or more gateways cost per step and per streamed
token while driving R simulated runners.

    .venv/bin/python bench/gateway_plane.py            # the default points below (~8 minutes)
    .venv/bin/python bench/gateway_plane.py --quick    # R=1 x 256 streams at interval 1 and 8
    .venv/bin/python bench/gateway_plane.py --runners 1,4 --per-runner 64 \
        --stream-intervals 1,8 --gateways 1,2 --clients 2 --results /tmp/gp

bench/control_plane.py measures the block service alone under R runner loops; here the loops
are real gateways'. A point is (R runners, B streams per runner, stream interval N, M
gateways); the points are the product of --runners x --stream-intervals x --gateways (B from
--per-runner, else 256 // R: 256 streams in all). With none of those three flags the default
set is: R=1 x B=256 at N=1 and 8; R=4 x B=64 at N=1 and 8; M=2 and M=4 gateways over R=1 x
B=256 at N=1 (--per-runner, if given, replaces every default point's B). --quick: R=1 x B=256
at N=1 and 8, shorter windows.

Per point (a fresh set of processes each):
- one `python -m block_service` (`--max-workers M x R + 16`: a StepStream per runner loop of
  every gateway, the runners' registrations, the gateways' unary calls);
- `bench/sim_runner.py --count R --block-service ... --metrics-port P`: R simulated runners
  (no model; Execute sleeps the cost model's time, merging the batches of every gateway that
  wait at once into one forward) on consecutive ports, each registered with the block service;
  its /metrics has the process's `pagewire_sim_runner_{forwards,rows,busy_seconds}_total`;
- once ListRunners shows all R, M `python -m gateway` processes, each on its own --port and
  --metrics-port, without --runner (each serves every registered runner, a RunnerLoop each),
  `--routing round-robin`, `--max-num-seqs B`, `--max-num-batched-tokens max(B, 256)`,
  `--stream-interval N` (omitted when N = 1), threads and stream limits for its share;
- R x B requests at once, prompts of 32 random token ids, max_tokens long enough that every
  request outlives the measured window at the offered rate ((warm + measure) x 1000 / step_ms
  x 1.3 + 64, at most 8192: a point lasts until every request has ended, longer the further
  the gateways fall short of the offered rate); request i goes to gateway i mod M
  and is driven by client process i mod K (--clients K; default 1 up to 64 streams, else 4):
  `python -m bench.stream_clients` children, each one asyncio loop running bench/timing.py's
  stream code for its share. Each must produce exactly its max_tokens (bench/w1.py's
  check_counts, over every request once all have ended).

The step time: the sim runner's cost model is scaled so that a decode step of B rows (not 256)
takes --step-ms, so that every runner, kept busy, steps every --step-ms as a runner at batch
256 on the target hardware would (the messages carry B rows, not 256: a gateway's cost per
step at 256 rows is higher). Offered rate: M x R x 1000 / step_ms steps/s, every gateway's
loop of every runner stepping once per runner step (with M > 1 a runner merges the batches of
the gateways that wait at once into one forward, of B rows in all; the runner busy share and
the rows per forward say how well that went).

After --warm-s (default 3 s, --quick 1; counted from when every client has sent its streams),
at the start and the end of a --measure-s window (default 8 s, --quick 3): each client is
asked for its running count of received output tokens (per gateway) and ended requests, and
at the same moment every gateway's /metrics and /proc/<pid>/stat, the block service's, the sim
runners' and each client's /proc/<pid>/stat, the sim runners' /metrics and the machine's
/proc/stat are read. Reported per point:
scheduling steps/s (`pagewire_gateway_steps_total`, delta, summed over the gateways), the
Block-service Step round trip as the gateways see it (`pagewire_gateway_block_step_seconds`,
bucket deltas summed over the gateways: mean exact from _sum/_count, p50/p99 interpolated
inside the histogram's buckets as Prometheus' histogram_quantile does, so bounded by the
bucket edges 0.5, 1, 2.5, 5, 10 ms ...), output tokens/s the clients received in the window,
the gateways' CPU (all threads, summed over the gateway processes) per streamed token (a token
the clients received in the window) and per step (the share on Python threads in brackets),
each gateway process's CPU per token it streamed, the runner busy share (sim runners' busy
seconds delta / (R x window)) and mean rows per forward (rows delta / forwards delta; "n/a"
when the sim runner has no such counters), the busiest client process's cores, the cores of
every process group and of the machine, and how much of the offered rate was achieved.

Results: --results (default bench/results)/gateway_plane.{json,md}; the table is printed as
well. A point that fails (a process that does not start, a client that stops answering) is
reported as not measured and the others still run; the exit status is 1 then, or when any
request errs or produces other than its max_tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import random
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.harness import (  # noqa: E402
    RESULTS,
    block_service_pid,
    block_service_process,
    exit_on_sigterm,
    fmt,
    free_port,
    free_port_run,
    git_state,
    machine_busy_s,
    run_header,
    save_results,
    scrape,
    service_counters,
    start_python,
    stop,
    wait_for,
)
from bench.sim_runner import CostModel  # noqa: E402
from bench.stream_clients import ClientProcess, spread  # noqa: E402
from bench.w1 import check_counts, wait_until_quiet  # noqa: E402
from bench.workloads import BenchRequest  # noqa: E402
from gateway.launcher import is_serving  # noqa: E402
from protos import block_pb2, block_pb2_grpc  # noqa: E402

PROMPT_TOKENS = 32
TOKEN_RANGE = (1000, 30000)
MAX_TOKENS_CAP = 8192  # the gateway's --max-tokens-limit default (gateway/validation.py)
STEP_HISTOGRAM = "pagewire_gateway_block_step_seconds"
# The gateway's histograms whose window means are kept (gateway/metrics.py): where a step goes.
PHASES = {"loop": "pagewire_gateway_step_loop_seconds",
          "schedule": "pagewire_gateway_schedule_seconds",
          "output": "pagewire_gateway_output_seconds",
          "execute": "pagewire_gateway_execute_seconds",
          "execute_wait": "pagewire_gateway_execute_wait_seconds"}
# The sim runner's process totals on its --metrics-port (bench/sim_runner.py).
RUNNER_FORWARDS = "pagewire_sim_runner_forwards_total"
RUNNER_ROWS = "pagewire_sim_runner_rows_total"
RUNNER_BUSY = "pagewire_sim_runner_busy_seconds_total"
START_TIMEOUT_S = 60.0
STREAMS = 256  # streams in all when --per-runner is not given: B = STREAMS // R
ONE_CLIENT_UP_TO = 64  # streams one client process drives by default; more: DEFAULT_CLIENTS
DEFAULT_CLIENTS = 4
SAMPLE_TIMEOUT_S = 30.0


# ---- points ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Point:
    """One configuration: R runners, B streams per runner (the gateways' --max-num-seqs),
    tokens per streamed message (the gateways' --stream-interval), M gateway processes."""

    runners: int
    per_runner: int
    stream_interval: int = 1
    gateways: int = 1

    @property
    def streams(self) -> int:
        return self.runners * self.per_runner


DEFAULT_POINTS = (Point(1, 256, 1), Point(1, 256, 8), Point(4, 64, 1), Point(4, 64, 8),
                  Point(1, 256, 1, 2), Point(1, 256, 1, 4))
QUICK_POINTS = (Point(1, 256, 1), Point(1, 256, 8))


def plan_points(runners: Sequence[int] | None, per_runner: int | None,
                stream_intervals: Sequence[int] | None, gateways: Sequence[int] | None,
                quick: bool = False) -> list[Point]:
    """The points to measure. With none of runners / stream_intervals / gateways given: the
    default set (--quick: its quick subset), per_runner (if given) replacing each point's B.
    Otherwise the product runners x stream intervals x gateways (each [1] when not given),
    B = per_runner, else STREAMS // R (at least 1)."""
    if runners is None and stream_intervals is None and gateways is None:
        chosen = QUICK_POINTS if quick else DEFAULT_POINTS
        return [Point(point.runners, per_runner or point.per_runner, point.stream_interval,
                      point.gateways) for point in chosen]
    return [Point(count, per_runner or max(1, STREAMS // count), interval, gateway_count)
            for count in runners or [1] for interval in stream_intervals or [1]
            for gateway_count in gateways or [1]]


def default_clients(streams: int) -> int:
    """Client processes when --clients is not given: one up to ONE_CLIENT_UP_TO streams."""
    return 1 if streams <= ONE_CLIENT_UP_TO else DEFAULT_CLIENTS


# ---- processes ------------------------------------------------------------------------------
def registered_runners(block_address: str) -> int:
    with grpc.insecure_channel(block_address) as channel:
        try:
            reply = block_pb2_grpc.BlockServiceStub(channel).ListRunners(
                block_pb2.ListRunnersRequest(), timeout=2.0)
        except grpc.RpcError:
            return 0
        return len(reply.runners)


def gateway_args(point: Point, share: int, port: int, metrics_port: int,
                 block_address: str) -> list[str]:
    """`python -m gateway` for one of the point's gateways, serving `share` of its streams."""
    args = ["-m", "gateway", "--port", str(port), "--block-service", block_address,
            "--model", "default", "--routing", "round-robin",
            "--metrics-port", str(metrics_port), "--max-num-seqs", str(point.per_runner),
            "--max-num-batched-tokens", str(max(point.per_runner, 256)),
            "--max-workers", str(share + 32), "--max-streams", str(share + 16),
            "--max-streams-per-client", str(share + 16),
            "--max-waiting", str(share + 16), "--log-level", "WARNING"]
    if point.stream_interval != 1:  # a gateway without the flag still runs interval 1
        args += ["--stream-interval", str(point.stream_interval)]
    return args


@contextlib.contextmanager
def cluster(point: Point, sim_step_ms: float) -> Iterator[dict[str, Any]]:
    """Block service, R simulated runners registered with it, M gateways; yields the gateways'
    addresses, metrics ports and pids, the block service's and the sim runners' pids and the
    sim runners' metrics port."""
    loops = point.runners * point.gateways
    with block_service_process(("--max-workers", str(loops + 16))) as block_address:
        port = free_port_run(point.runners)
        runner_metrics_port = free_port()
        processes = [start_python(["bench/sim_runner.py", "--count", str(point.runners),
                                   "--port", str(port), "--step-ms", f"{sim_step_ms:.6g}",
                                   "--block-service", block_address,
                                   "--metrics-port", str(runner_metrics_port),
                                   "--max-workers", str(max(16, 4 * point.gateways + 4)),
                                   "--log-level", "WARNING"])]
        try:
            wait_for(f"{point.runners} registered runners",
                     lambda: registered_runners(block_address) >= point.runners, processes,
                     START_TIMEOUT_S)
            gateways: list[dict[str, Any]] = []
            for share in spread(point.streams, point.gateways):
                gateway_port, metrics_port = free_port(), free_port()
                processes.append(start_python(
                    gateway_args(point, len(share), gateway_port, metrics_port, block_address),
                    env={"PAGEWIRE_GATEWAY_MAX_WORKERS": str(len(share) + 32)}))
                gateways.append({"address": f"127.0.0.1:{gateway_port}",
                                 "metrics_port": metrics_port, "pid": processes[-1].pid})
            for gateway in gateways:
                wait_for(f"the gateway at {gateway['address']} to serve",
                         functools.partial(is_serving, gateway["address"]), processes,
                         START_TIMEOUT_S)
            yield {"gateways": gateways, "block_pid": block_service_pid(),
                   "runners_pid": processes[0].pid, "runner_metrics_port": runner_metrics_port}
        finally:
            for process in reversed(processes):
                stop(process)


# ---- measuring ------------------------------------------------------------------------------
def scrape_or_none(metrics_port: int) -> dict[str, float] | None:
    """scrape, or None where nothing answers (a sim runner without a metrics port)."""
    try:
        return scrape(metrics_port)
    except (OSError, urllib.error.URLError, ValueError):
        return None


def merge_samples(scrapes: Sequence[dict[str, float]]) -> dict[str, float]:
    """Several processes' /metrics added up sample by sample: counters and histograms of M
    gateways as if one (every sample used here is a counter or a histogram's)."""
    merged: dict[str, float] = {}
    for samples in scrapes:
        for name, value in samples.items():
            merged[name] = merged.get(name, 0.0) + value
    return merged


def histogram_delta(before: dict[str, float], after: dict[str, float], name: str
                    ) -> tuple[list[tuple[float, float]], float, float]:
    """([(upper bound, cumulative count)], sum, count) of a histogram between two scrapes."""
    buckets = []
    prefix = f'{name}_bucket{{le="'
    for key, value in after.items():
        if key.startswith(prefix):
            bound = key[len(prefix):].split('"', 1)[0]
            buckets.append((float(bound), value - before.get(key, 0.0)))
    buckets.sort()
    return (buckets, after.get(f"{name}_sum", 0.0) - before.get(f"{name}_sum", 0.0),
            after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0))


def bucket_quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """Prometheus' histogram_quantile: linear inside the bucket that holds the quantile; the
    last finite bound when it falls in +Inf."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for bound, cumulative in buckets:
        if cumulative >= rank:
            if bound == float("inf"):
                return lower
            inside = cumulative - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = bound, cumulative
    return lower


def mean_ms(before: dict[str, float], after: dict[str, float], name: str) -> float | None:
    """A histogram's mean over the window, in ms."""
    _, total, count = histogram_delta(before, after, name)
    return total / count * 1e3 if count else None


def counter(samples: dict[str, float], name: str) -> float:
    return samples.get(f"{name}_total", 0.0)


def counter_delta(before: dict[str, float] | None, after: dict[str, float] | None,
                  name: str) -> float | None:
    """A counter's (full sample name) change between two scrapes; None where either scrape or
    the counter is missing."""
    if before is None or after is None or name not in before or name not in after:
        return None
    return after[name] - before[name]


def make_requests(count: int, max_tokens: int, seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [BenchRequest([rng.randrange(*TOKEN_RANGE) for _ in range(PROMPT_TOKENS)],
                         max_tokens) for _ in range(count)]


def sample(nodes: dict[str, Any], clients: Sequence[ClientProcess]) -> dict[str, Any]:
    """Every counter the point reports, read now: the clients are asked first and answer
    while the rest is read."""
    for client in clients:
        client.ask_sample()
    at = time.perf_counter()
    gateways = []
    for gateway in nodes["gateways"]:
        cpu, kernel, python, switches = service_counters(gateway["pid"])
        gateways.append({"metrics": scrape(gateway["metrics_port"]), "cpu_s": cpu,
                         "kernel_s": kernel, "python_s": python, "switches": switches})
    taken = {"at": at, "gateways": gateways,
             "block_cpu_s": service_counters(nodes["block_pid"])[0],
             "runners_cpu_s": service_counters(nodes["runners_pid"])[0],
             "runner_metrics": scrape_or_none(nodes["runner_metrics_port"]),
             "machine_busy_s": machine_busy_s(),
             "client_cpu_s": [service_counters(client.pid)[0] for client in clients]}
    taken["clients"] = [client.expect("sample", SAMPLE_TIMEOUT_S) for client in clients]
    return taken


def gather_counts(parts: Sequence[Sequence[int]], counts: Sequence[Sequence[int]],
                  total: int) -> list[int]:
    """Per request, in the original order, the output tokens the client processes counted:
    client k drove requests parts[k] and reported counts[k] in that order."""
    produced = [0] * total
    for indices, reported in zip(parts, counts, strict=True):
        if len(indices) != len(reported):
            raise ValueError(f"a client reported {len(reported)} counts for {len(indices)} "
                             "requests")
        for index, count in zip(indices, reported, strict=True):
            produced[index] = count
    return produced


def run_point(point: Point, step_ms: float, warm_s: float, measure_s: float, seed: int,
              settle_max_s: float, clients: int | None = None) -> dict[str, Any]:
    """One point: a fresh cluster, the workload from `clients` client processes, one
    measured window; every request checked once all have ended."""
    settled_s = wait_until_quiet(settle_max_s) if settle_max_s > 0 else 0.0
    started = time.perf_counter()
    cost = CostModel()
    # The sim runner's --step-ms is a 256-row decode step; scale it so B rows take step_ms.
    sim_step_ms = step_ms * cost.decode_step_s() / cost.step_time_s(point.per_runner)
    per_sequence = 1000.0 / step_ms
    max_tokens = min(MAX_TOKENS_CAP, int((warm_s + measure_s) * per_sequence * 1.3) + 64)
    requests = make_requests(point.streams, max_tokens, seed + point.runners)
    procs = max(1, min(clients or default_clients(point.streams), point.streams))
    client_parts = spread(point.streams, procs)
    targets = [index % point.gateways for index in range(point.streams)]
    timeout_s = max(300.0, 20 * (warm_s + measure_s))
    meta: dict[str, Any] = {
        **asdict(point), "requests": len(requests), "clients": procs, "step_ms": step_ms,
        "sim_step_ms_256_rows": sim_step_ms, "max_tokens": max_tokens, "settled_s": settled_s}
    errors: list[str] = []
    with cluster(point, sim_step_ms) as nodes, contextlib.ExitStack() as stack:
        addresses = [gateway["address"] for gateway in nodes["gateways"]]
        children = []
        for part in client_parts:
            child = ClientProcess(addresses, [requests[index] for index in part],
                                  [targets[index] for index in part], timeout_s)
            stack.callback(child.close)
            children.append(child)
        for child in children:
            child.expect("started", START_TIMEOUT_S)
        time.sleep(warm_s)
        first = sample(nodes, children)
        time.sleep(measure_s)
        last = sample(nodes, children)
        finals = [child.wait_final(timeout_s + 60.0) for child in children]
    for final in finals:
        errors += final["errors"]
    error_count = sum(final["error_count"] for final in finals)
    try:
        produced = gather_counts(client_parts, [final["counts"] for final in finals],
                                 len(requests))
        check_counts(f"{point.runners} runners", requests, produced)
    except Exception as error:
        errors.insert(0, str(error))
        error_count += 1
        produced = [count for final in finals for count in final["counts"]]
    row = summarise(meta, first, last)
    row.update({"tokens_checked": sum(produced),
                "requests_checked": len(requests) if not error_count else 0,
                "errors": errors[:5], "error_count": error_count,
                "point_wall_s": time.perf_counter() - started})
    return row


def summarise(meta: dict[str, Any], first: dict[str, Any], last: dict[str, Any]
              ) -> dict[str, Any]:
    """A point's figures from the samples at the start and the end of its window (`meta`:
    the point's fields, step_ms and what else the row keeps)."""
    runners, gateways, step_ms = meta["runners"], meta["gateways"], meta["step_ms"]
    seconds = last["at"] - first["at"]
    before = merge_samples([gateway["metrics"] for gateway in first["gateways"]])
    after = merge_samples([gateway["metrics"] for gateway in last["gateways"]])
    offered = gateways * runners * 1000.0 / step_ms if step_ms > 0 else None
    steps = counter(after, "pagewire_gateway_steps") - counter(before, "pagewire_gateway_steps")
    executes = (counter(after, "pagewire_gateway_executes")
                - counter(before, "pagewire_gateway_executes"))
    generated = (counter(after, "pagewire_gateway_generated_tokens")
                 - counter(before, "pagewire_gateway_generated_tokens"))
    buckets, step_sum, step_count = histogram_delta(before, after, STEP_HISTOGRAM)
    p50, p99 = bucket_quantile(buckets, 0.5), bucket_quantile(buckets, 0.99)

    def gateway_delta(key: str) -> list[float]:
        return [end[key] - start[key]
                for start, end in zip(first["gateways"], last["gateways"], strict=True)]

    cpu_by_gateway = gateway_delta("cpu_s")
    cpu_s = sum(cpu_by_gateway)
    python_s, kernel_s = sum(gateway_delta("python_s")), sum(gateway_delta("kernel_s"))
    switches = sum(gateway_delta("switches"))
    # Tokens the clients received in the window, per gateway.
    tokens_by_gateway = [0.0] * gateways
    for start, end in zip(first["clients"], last["clients"], strict=True):
        for index in range(gateways):
            tokens_by_gateway[index] += end["tokens"][index] - start["tokens"][index]
    tokens = sum(tokens_by_gateway)
    client_cores = [(end - start) / seconds for start, end in
                    zip(first["client_cpu_s"], last["client_cpu_s"], strict=True)]
    forwards = counter_delta(first["runner_metrics"], last["runner_metrics"], RUNNER_FORWARDS)
    rows = counter_delta(first["runner_metrics"], last["runner_metrics"], RUNNER_ROWS)
    busy = counter_delta(first["runner_metrics"], last["runner_metrics"], RUNNER_BUSY)

    def per_step(value: float) -> float | None:
        return value / steps * 1e6 if steps else None

    return {
        **meta, "offered_steps_per_s": offered,
        "measure_s": seconds, "steps": steps, "steps_per_s": steps / seconds,
        "executes_per_s": executes / seconds,
        "steps_per_s_of_offered": steps / seconds / offered if offered else None,
        "block_step_mean_ms": step_sum / step_count * 1e3 if step_count else None,
        "block_step_p50_ms": p50 * 1e3 if p50 is not None else None,
        "block_step_p99_ms": p99 * 1e3 if p99 is not None else None,
        "block_step_buckets": [[bound, count] for bound, count in buckets],
        "phase_mean_ms": {phase: mean_ms(before, after, name) for phase, name in PHASES.items()},
        "rows_per_step": (counter(after, "pagewire_gateway_scheduled_tokens")
                          - counter(before, "pagewire_gateway_scheduled_tokens")) / steps
        if steps else None,
        "client_tokens_per_s": tokens / seconds,
        "client_tokens_per_s_by_gateway": [count / seconds for count in tokens_by_gateway],
        "gateway_tokens_per_s": generated / seconds,
        "gateway_cpu_s": cpu_s, "gateway_cores": cpu_s / seconds,
        "gateway_cores_by_process": [value / seconds for value in cpu_by_gateway],
        "gateway_cpu_us_per_token": cpu_s / tokens * 1e6 if tokens else None,
        "gateway_cpu_us_per_token_by_process": [
            value / count * 1e6 if count else None
            for value, count in zip(cpu_by_gateway, tokens_by_gateway, strict=True)],
        "gateway_cpu_us_per_step": per_step(cpu_s),
        "gateway_python_us_per_step": per_step(python_s),
        "gateway_kernel_us_per_step": per_step(kernel_s),
        "gateway_switches_per_step": switches / steps if steps else None,
        "block_service_cores": (last["block_cpu_s"] - first["block_cpu_s"]) / seconds,
        "block_service_cpu_us_per_step": per_step(last["block_cpu_s"] - first["block_cpu_s"]),
        "sim_runners_cores": (last["runners_cpu_s"] - first["runners_cpu_s"]) / seconds,
        "runner_forwards_per_s": forwards / seconds if forwards is not None else None,
        "runner_busy_share": busy / (runners * seconds) if busy is not None else None,
        "rows_per_forward": rows / forwards if rows is not None and forwards else None,
        "client_cores": client_cores,
        "client_cores_max": max(client_cores, default=None),
        "clients_cores": sum(client_cores),
        "machine_cores": (last["machine_busy_s"] - first["machine_busy_s"]) / seconds,
        "done_before_window_end": sum(client["done"] for client in last["clients"]),
    }


# ---- report ---------------------------------------------------------------------------------
def na(value: float | None, spec: str) -> str:
    """fmt, with "n/a" for a figure that was not there to read."""
    return "n/a" if value is None else f"{value:{spec}}"


def per_token_cell(row: dict[str, Any]) -> str:
    """Total µs per streamed token; with several gateways each process's in brackets."""
    total = fmt(row["gateway_cpu_us_per_token"], ",.1f")
    by_process = row["gateway_cpu_us_per_token_by_process"]
    if len(by_process) < 2:
        return total
    return f"{total} ({' / '.join(fmt(value, ',.1f') for value in by_process)})"


def table(rows: list[dict[str, Any]]) -> list[str]:
    header = ["runners", "requests (per runner)", "stream interval", "gateways", "clients",
              "offered steps/s", "steps/s", "of offered", "Block Step mean / p50 / p99 ms",
              "client tokens/s", "gateway CPU µs/token (per process)",
              "gateway CPU µs/step (Python threads)", "block service CPU µs/step",
              "runner busy", "rows/forward", "busiest client cores",
              "cores: gateways / block service / sim runners / clients / machine",
              "checked (errors)"]
    lines = ["| " + " | ".join(header) + " |",
             "|" + "---:|" * 16 + "---|---:|"]
    for row in rows:
        cells = [
            f"{row['runners']}", f"{row['requests']} ({row['per_runner']})",
            f"{row['stream_interval']}", f"{row['gateways']}", f"{row['clients']}",
            fmt(row["offered_steps_per_s"], ",.0f"), f"{row['steps_per_s']:,.0f}",
            fmt(row["steps_per_s_of_offered"], ".0%"),
            f"{fmt(row['block_step_mean_ms'], '.2f')} / {fmt(row['block_step_p50_ms'], '.2f')}"
            f" / {fmt(row['block_step_p99_ms'], '.2f')}",
            f"{row['client_tokens_per_s']:,.0f}", per_token_cell(row),
            f"{fmt(row['gateway_cpu_us_per_step'], ',.0f')} "
            f"({fmt(row['gateway_python_us_per_step'], ',.0f')})",
            fmt(row["block_service_cpu_us_per_step"], ",.0f"),
            na(row["runner_busy_share"], ".0%"), na(row["rows_per_forward"], ".1f"),
            fmt(row["client_cores_max"], ".2f"),
            f"{row['gateway_cores']:.2f} / {row['block_service_cores']:.2f} / "
            f"{row['sim_runners_cores']:.2f} / {row['clients_cores']:.2f} / "
            f"{row['machine_cores']:.2f}",
            f"{row['requests_checked']} ({row['error_count']})"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def label(row: dict[str, Any]) -> str:
    """A point in words: "4 runners × 64, interval 8, 2 gateways"."""
    runners = row["runners"]
    text = f"{runners} runner{'s' if runners > 1 else ''} × {row['per_runner']}, " \
           f"interval {row['stream_interval']}"
    if row["gateways"] > 1:
        text += f", {row['gateways']} gateways"
    return text


def markdown(data: dict[str, Any]) -> str:
    rows = data["points"]
    lines = [
        "# Control plane, gateway side: gateways driving R simulated runners",
        "",
        f"`{data['command']}` — {data['measured_at']}, git {data['git']}, {data['cpus']} CPUs, "
        f"load average {data['load_average_before']:.2f} before the run.",
        "",
        "Per point a fresh block service, R simulated runners (bench/sim_runner.py, "
        "registered with it) and M gateway processes each serving them all (round-robin "
        f"placement), each with `--stream-interval N` (tokens per streamed message); R × B "
        f"requests of {PROMPT_TOKENS} prompt tokens at once, request i to gateway i mod M, "
        "driven by client process i mod K (separate processes, one asyncio loop each), each "
        "request long enough to outlive the window; every request checked for exactly its "
        f"max_tokens. The simulated runner takes {data['step_ms']:g} ms for a decode step of "
        f"B rows (the cost model scaled so), so a busy runner steps "
        f"{1000 / data['step_ms']:,.0f} times a second: offered = M × R × that (every "
        f"gateway's loop of every runner once per runner step). Warm-up {data['warm_s']:g} s, "
        f"measured window {data['measure_s']:g} s.",
        "",
        *table(rows),
        "",
        "steps/s: `pagewire_gateway_steps_total` (Steps sent to the block service), delta over "
        "the window, summed over the gateways. Block Step: the gateways' "
        "`pagewire_gateway_block_step_seconds`, bucket deltas over the window summed over the "
        "gateways; mean exact (_sum / _count), p50 / p99 interpolated inside the buckets "
        "(edges 0.5, 1, 2.5, 5, 10, 25 ms ...), so estimates within their bucket. client "
        "tokens/s: output tokens the client processes received in the window. Gateway CPU: "
        "/proc/<pid>/stat of the gateway processes over the window, summed (all threads); per "
        "token: per output token the clients received in the window (in brackets, with "
        "several gateways, each process's CPU per token it streamed); per step: per "
        "`pagewire_gateway_steps_total` of all gateways (in brackets its threads named "
        "python: handlers, scheduler, protobuf, gRPC's Python layer, which take turns on the "
        "GIL). Block service CPU: its process over the window, per gateway step (each step is "
        "one Step of the block service). runner busy: the sim runners' "
        "`pagewire_sim_runner_busy_seconds_total` delta / (R × window); rows/forward: "
        "`pagewire_sim_runner_rows_total` / `pagewire_sim_runner_forwards_total` deltas (a "
        "forward merges the batches of the gateways waiting at once); n/a: the sim runner "
        "exposed no such counters. busiest client cores: the client process with the most CPU "
        "in the window (/proc/<pid>/stat). Cores: CPU seconds per second of the window; "
        "clients: all client processes; machine: every process (this script and anything "
        "else included) on the machine's cores, which they all share.",
    ]
    for failed in data.get("failed", []):
        lines += ["", f"**Not measured**: {label(failed)} — {failed['error']}"]
    lines += busy_section(rows)
    lines += interval_section(rows)
    lines += gateways_section(rows)
    lines += clients_section(rows)
    lines += limits(rows)
    return "\n".join(lines) + "\n"


def busy_section(rows: list[dict[str, Any]]) -> list[str]:
    busy = [row for row in rows if row["steps_per_s_of_offered"] is not None]
    if not busy:
        return []
    lines = ["", "## Do the gateways keep the runners busy?", ""]
    for row in busy:
        share = row["steps_per_s_of_offered"]
        verdict = "yes" if share >= 0.9 else "no"
        runner = "" if row["runner_busy_share"] is None else \
            f", the runners busy {row['runner_busy_share']:.0%} of the window at " \
            f"{na(row['rows_per_forward'], '.1f')} rows per forward"
        lines.append(
            f"- {label(row)}: {verdict} — {row['steps_per_s']:,.0f} of "
            f"{row['offered_steps_per_s']:,.0f} steps/s ({share:.0%}){runner}; the "
            f"gateway{'s' if row['gateways'] > 1 else ''} at {row['gateway_cores']:.2f} cores, "
            f"{fmt(row['gateway_cpu_us_per_step'], ',.0f')} µs of CPU per step, "
            f"{fmt(row['gateway_cpu_us_per_token'], ',.1f')} per streamed token.")
    return lines


def groups(rows: list[dict[str, Any]], keys: tuple[str, ...], varying: str
           ) -> list[list[dict[str, Any]]]:
    """Rows that share `keys` and differ in `varying`, in groups of two or more (by
    `varying`), in the order of their first row."""
    found: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for row in rows:
        found.setdefault(tuple(row[key] for key in keys), []).append(row)
    return [sorted(group, key=lambda row: row[varying]) for group in found.values()
            if len({row[varying] for row in group}) > 1]


def interval_section(rows: list[dict[str, Any]]) -> list[str]:
    """What coalescing tokens into fewer messages saves, per set of otherwise equal points."""
    found = groups(rows, ("runners", "per_runner", "gateways"), "stream_interval")
    if not found:
        return []
    lines = ["", "## Stream interval: tokens per message", ""]
    for group in found:
        base = group[0]
        parts = []
        for row in group:
            parts.append(
                f"interval {row['stream_interval']}: "
                f"{fmt(row['gateway_cpu_us_per_token'], ',.1f')} µs of gateway CPU per token"
                f" ({fmt(row['gateway_cpu_us_per_step'], ',.0f')} per step), "
                f"{row['client_tokens_per_s']:,.0f} tokens/s, "
                f"{fmt(row['steps_per_s_of_offered'], '.0%')} of the offered steps")
        lines.append(f"- {base['runners']} runner{'s' if base['runners'] > 1 else ''} × "
                     f"{base['per_runner']}, {base['gateways']} gateway"
                     f"{'s' if base['gateways'] > 1 else ''}: " + "; ".join(parts) + ".")
    return lines


def gateways_section(rows: list[dict[str, Any]]) -> list[str]:
    """The same streams over more gateway processes: total and per-process cost."""
    found = groups(rows, ("runners", "per_runner", "stream_interval"), "gateways")
    if not found:
        return []
    lines = ["", "## Several gateways over the same runners", ""]
    for group in found:
        base = group[0]
        parts = []
        for row in group:
            each = " / ".join(fmt(value, ",.1f")
                              for value in row["gateway_cpu_us_per_token_by_process"])
            cores = " / ".join(f"{value:.2f}" for value in row["gateway_cores_by_process"])
            parts.append(
                f"{row['gateways']} gateway{'s' if row['gateways'] > 1 else ''}: "
                f"{fmt(row['gateway_cpu_us_per_token'], ',.1f')} µs per token in all "
                f"(per process {each}; cores {cores}), {row['client_tokens_per_s']:,.0f} "
                f"tokens/s, runners busy {na(row['runner_busy_share'], '.0%')} at "
                f"{na(row['rows_per_forward'], '.1f')} rows per forward")
        lines.append(f"- {base['runners']} runner{'s' if base['runners'] > 1 else ''} × "
                     f"{base['per_runner']}, interval {base['stream_interval']}: "
                     + "; ".join(parts) + ".")
    return lines


def clients_section(rows: list[dict[str, Any]]) -> list[str]:
    """Whether the client processes could have limited what was measured."""
    measured = [row for row in rows if row["client_cores_max"] is not None]
    if not measured:
        return []
    top = max(measured, key=lambda row: row["client_cores_max"])
    verdict = ("well under a core: the client is not the bottleneck"
               if top["client_cores_max"] < 0.7 else
               "close to a full core: at that point the client may limit the rate")
    return ["", "## The client", "",
            f"Busiest client process at {top['client_cores_max']:.2f} cores ({label(top)}, "
            f"{top['clients']} client process{'es' if top['clients'] > 1 else ''} at "
            f"{top['clients_cores']:.2f} cores in all), {verdict}. The clients share the "
            "machine's cores with the gateways, the block service and the sim runners: at "
            f"that point {top['machine_cores']:.2f} cores were busy in all."]


def limits(rows: list[dict[str, Any]]) -> list[str]:
    """What bounds the gateway, from the most loaded single-gateway point (interval 1 first)."""
    loaded = [row for row in rows if row["steps"] and row["gateway_cpu_us_per_step"]]
    if not loaded:
        return []
    top = max(loaded, key=lambda row: (row["gateways"] == 1, row["stream_interval"] == 1,
                                       row["requests"], row["runners"]))
    gateway_us, block_us = top["gateway_cpu_us_per_step"], top["block_service_cpu_us_per_step"]
    phases = top["phase_mean_ms"]
    tokens_per_step = top["client_tokens_per_s"] / top["steps_per_s"]
    per_token = top["gateway_cpu_us_per_token"]
    gateway = "the gateway" if top["gateways"] == 1 else f"the {top['gateways']} gateways"
    return [
        "", "## What limits the gateway", "",
        f"At {label(top)}, {gateway} made {top['steps_per_s']:,.0f} steps/s at "
        f"{top['gateway_cores']:.2f} cores, {gateway_us:,.0f} µs of CPU per step "
        f"({fmt(top['gateway_python_us_per_step'], ',.0f')} on its Python threads, "
        f"{fmt(top['gateway_kernel_us_per_step'], ',.0f')} in the kernel, "
        f"{fmt(top['gateway_switches_per_step'], '.0f')} context switches per step) for "
        f"{tokens_per_step:.1f} tokens streamed per step: {fmt(per_token, ',.1f')} µs per "
        f"streamed token. One core at that cost is about {1e6 / gateway_us:,.0f} steps/s, "
        f"{1e6 / per_token if per_token else 0:,.0f} tokens/s. The machine was at "
        f"{top['machine_cores']:.2f} of its cores busy (the clients "
        f"{top['clients_cores']:.2f}). The block service spent "
        f"{fmt(block_us, ',.0f')} µs of CPU per Step ({top['block_service_cores']:.2f} "
        f"cores); the rest of the Step round trip the gateway sees (mean "
        f"{fmt(top['block_step_mean_ms'], '.1f')} ms) is transport and queueing, on the "
        "gateway's side its threads waiting for the GIL to send the Step and take the answer. "
        f"The runners were busy {na(top['runner_busy_share'], '.0%')} of the window. "
        "Mean per step over the window (the gateway's histograms, ms): "
        + ", ".join(f"{phase} {fmt(value, '.2f')}" for phase, value in phases.items()) + ".",
    ]


def int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runners", type=int_list, default=None,
                        help="runner counts (default: the default point set, see the module "
                             "docstring; 1 when another of the point flags is given)")
    parser.add_argument("--per-runner", type=int, default=None,
                        help="streams per runner (= the gateways' --max-num-seqs); default "
                             f"{STREAMS} // runners, or each default point's")
    parser.add_argument("--stream-intervals", type=int_list, default=None,
                        help="the gateways' --stream-interval values, a point each "
                             "(default 1)")
    parser.add_argument("--gateways", type=int_list, default=None,
                        help="gateway process counts, a point each (default 1)")
    parser.add_argument("--clients", type=int, default=None,
                        help=f"client processes (default 1 up to {ONE_CLIENT_UP_TO} streams, "
                             f"else {DEFAULT_CLIENTS})")
    parser.add_argument("--step-ms", type=float, default=8.0,
                        help="a simulated decode step of --per-runner rows")
    parser.add_argument("--warm-s", type=float, default=None, help="default 3 (--quick 1)")
    parser.add_argument("--measure-s", type=float, default=None,
                        help="default 8 (--quick 3)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--settle-max-s", type=float, default=20.0,
                        help="before each point, wait up to this long for the CPUs to be 95%% "
                             "idle (bench/w1.py; 0: no wait)")
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="folder of gateway_plane.{json,md}")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.warm_s is None:
        args.warm_s = 1.0 if args.quick else 3.0
    if args.measure_s is None:
        args.measure_s = 3.0 if args.quick else 8.0
    lists = [values for values in (args.runners, args.stream_intervals, args.gateways)
             if values is not None]
    if any(not values or min(values) < 1 for values in lists):
        parser.error("--runners, --stream-intervals and --gateways need counts >= 1")
    if (args.per_runner is not None and args.per_runner < 1) or args.step_ms <= 0 or \
            (args.clients is not None and args.clients < 1):
        parser.error("need --per-runner >= 1, --clients >= 1 and --step-ms > 0")
    args.points = plan_points(args.runners, args.per_runner, args.stream_intervals,
                              args.gateways, args.quick)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Stopped with SIGTERM (timeout, kill), the points' clean-up still stops the services.
    exit_on_sigterm()
    data: dict[str, Any] = {
        **run_header("bench/gateway_plane.py", argv),
        "cpus": os.cpu_count(), "load_average_before": os.getloadavg()[0],
        "git": git_state(), "step_ms": args.step_ms, "clients": args.clients,
        "warm_s": args.warm_s, "measure_s": args.measure_s,
        "planned": [asdict(point) for point in args.points], "points": [], "failed": []}
    print("\n".join(table([])), flush=True)
    for point in args.points:
        try:
            row = run_point(point, args.step_ms, args.warm_s, args.measure_s, args.seed,
                            args.settle_max_s, args.clients)
        except Exception as failure:  # the other points still run; the failure is reported
            print(f"  point {asdict(point)} failed: {failure!r}", file=sys.stderr)
            data["failed"].append({**asdict(point), "error": repr(failure)})
            continue
        data["points"].append(row)
        print(table([row])[-1], flush=True)
        for error in row["errors"]:
            print(f"  error: {error}", file=sys.stderr)
    save_results(args.results, "gateway_plane", data, markdown(data))
    return 1 if data["failed"] or any(row["error_count"] for row in data["points"]) else 0


if __name__ == "__main__":
    sys.exit(main())
