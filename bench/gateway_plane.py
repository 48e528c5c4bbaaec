"""Control-plane benchmark, gateway side: the scheduling steps per second one gateway drives.

    .venv/bin/python bench/gateway_plane.py            # 1, 4, 16 runners (about 3 minutes)
    .venv/bin/python bench/gateway_plane.py --quick    # 1, 4 runners, shorter

bench/control_plane.py measures the block service alone under R runner loops; here the loops
are a real gateway's. Per point (a fresh set of processes each):
- one `python -m block_service` (`--max-workers R + 16`: a StepStream per runner loop, the
  runners' registrations, the gateway's unary calls);
- `bench/sim_runner.py --count R --block-service ...`: R simulated runners (no model; Execute
  sleeps the cost model's time) on consecutive ports, each registered with the block service;
- once ListRunners shows all R, ONE `python -m gateway` without --runner (it serves every
  registered runner, a RunnerLoop each), `--routing round-robin`, `--max-num-seqs B`,
  `--max-num-batched-tokens max(B, 256)`, `--metrics-port`, threads and stream limits for
  R x B streams;
- R x B requests at once from one asyncio client (bench/timing.py's stream code), prompts of
  32 random token ids, max_tokens long enough that every request outlives the measured
  window at the offered rate; each must produce exactly its max_tokens (bench/w1.py).

The step time: the sim runner's cost model is scaled so that a decode step of B rows (not 256)
takes --step-ms, so that every runner loop, kept busy, steps every --step-ms as a runner at
batch 256 on the target hardware would (the messages carry B rows, not 256: a gateway's cost
per step at 256 rows is higher). Offered rate: R x 1000 / step_ms steps/s.

After --warm-s, the gateway's /metrics and /proc/<pid>/stat are read at the start and the end
of a --measure-s window while the workload runs. Reported per point: scheduling steps/s
(`pagewire_gateway_steps_total`, delta), the Block-service Step round trip as the gateway sees
it (`pagewire_gateway_block_step_seconds`: mean exact from _sum/_count, p50/p99 interpolated
inside the histogram's buckets as Prometheus' histogram_quantile does, so bounded by the bucket
edges 0.5, 1, 2.5, 5, 10 ms ...), output tokens/s counted on the client in the window, the
gateway process's CPU µs per step (all threads; the share on its Python threads in brackets),
the machine's CPU, and how much of the offered rate the gateway achieved.

Results: bench/results/gateway_plane.{json,md}; the table is printed as well.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.block_service import free_port, server_process  # noqa: E402
from bench.control_plane import (  # noqa: E402
    fmt,
    git_state,
    machine_busy_s,
    save_results,
    service_counters,
    service_pid,
)
from bench.sim_runner import CostModel  # noqa: E402
from bench.timing import RequestTiming, _stream_one  # noqa: E402
from bench.w1 import check_counts, wait_until_quiet  # noqa: E402
from bench.workloads import BenchRequest  # noqa: E402
from gateway.launcher import is_serving  # noqa: E402
from protos import block_pb2, block_pb2_grpc, gateway_pb2_grpc  # noqa: E402

RESULTS = ROOT / "bench" / "results"
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
START_TIMEOUT_S = 60.0


# ---- processes ------------------------------------------------------------------------------
def free_port_run(count: int) -> int:
    """A port P with P .. P+count-1 all free on the loopback (bind-tested)."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 60000 - count)
        with contextlib.ExitStack() as stack:
            try:
                for port in range(base, base + count):
                    sock = stack.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return base
    raise RuntimeError(f"no run of {count} free ports found")


def start(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, *args], cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=str(ROOT), **(env or {})))


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL if it has not ended within 15 s."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def wait_for(what: str, ready: Callable[[], bool], processes: list[subprocess.Popen[bytes]],
             timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if any(process.poll() is not None for process in processes):
            raise RuntimeError(f"a process exited while waiting for {what}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.2)


def registered_runners(block_address: str) -> int:
    with grpc.insecure_channel(block_address) as channel:
        try:
            reply = block_pb2_grpc.BlockServiceStub(channel).ListRunners(
                block_pb2.ListRunnersRequest(), timeout=2.0)
        except grpc.RpcError:
            return 0
        return len(reply.runners)


@contextlib.contextmanager
def cluster(runners: int, per_runner: int, sim_step_ms: float) -> Iterator[dict[str, Any]]:
    """Block service, R simulated runners registered with it, one gateway; yields the gateway's
    address, metrics port and process."""
    with server_process(("--max-workers", str(runners + 16))) as block_address:
        port = free_port_run(runners)
        processes = [start(["bench/sim_runner.py", "--count", str(runners), "--port", str(port),
                            "--step-ms", f"{sim_step_ms:.6g}", "--block-service", block_address,
                            "--log-level", "WARNING"])]
        try:
            wait_for(f"{runners} registered runners",
                     lambda: registered_runners(block_address) >= runners, processes)
            streams = runners * per_runner
            gateway_port, metrics_port = free_port(), free_port()
            workers = streams + 32
            processes.append(start(
                ["-m", "gateway", "--port", str(gateway_port), "--block-service", block_address,
                 "--model", "default", "--routing", "round-robin",
                 "--metrics-port", str(metrics_port), "--max-num-seqs", str(per_runner),
                 "--max-num-batched-tokens", str(max(per_runner, 256)),
                 "--max-workers", str(workers), "--max-streams", str(streams + 16),
                 "--max-streams-per-client", str(streams + 16),
                 "--max-waiting", str(streams + 16), "--log-level", "WARNING"],
                env={"PAGEWIRE_GATEWAY_MAX_WORKERS": str(workers)}))
            address = f"127.0.0.1:{gateway_port}"
            wait_for("the gateway to serve", lambda: is_serving(address), processes)
            yield {"address": address, "metrics_port": metrics_port,
                   "pid": processes[-1].pid, "block_pid": service_pid(),
                   "runners_pid": processes[0].pid}
        finally:
            for process in reversed(processes):
                stop(process)


# ---- measuring ------------------------------------------------------------------------------
def scrape(metrics_port: int) -> dict[str, float]:
    """Every sample on the /metrics page, by its name with labels as written there."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


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


def make_requests(count: int, max_tokens: int, seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [BenchRequest([rng.randrange(*TOKEN_RANGE) for _ in range(PROMPT_TOKENS)],
                         max_tokens) for _ in range(count)]


class Workload:
    """Every request on its own stream from one asyncio loop in a thread (bench/timing.py's
    stream code); the timings fill in as tokens arrive, so the main thread can count them."""

    def __init__(self, address: str, requests: list[BenchRequest], timeout_s: float) -> None:
        self.address = address
        self.requests = requests
        self.timeout_s = timeout_s
        self.timings = [RequestTiming(sent=0.0) for _ in requests]
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="workload", daemon=True)

    def tokens(self) -> int:
        return sum(timing.output_tokens for timing in self.timings)

    def done(self) -> int:
        return sum(1 for timing in self.timings if timing.done)

    def _run(self) -> None:
        try:
            asyncio.run(self._streams())
        except BaseException as error:  # reported by the caller
            self.error = error

    async def _streams(self) -> None:
        async with grpc.aio.insecure_channel(self.address) as channel:
            stub = gateway_pb2_grpc.GenerationServiceStub(channel)
            streams = []
            for request, timing in zip(self.requests, self.timings, strict=True):
                timing.sent = time.perf_counter()
                streams.append(asyncio.create_task(
                    _stream_one(stub, request, timing, self.timeout_s)))
            await asyncio.gather(*streams)


def sample(gateway: dict[str, Any], workload: Workload) -> dict[str, Any]:
    cpu, kernel, python, switches = service_counters(gateway["pid"])
    return {"at": time.perf_counter(), "metrics": scrape(gateway["metrics_port"]),
            "cpu_s": cpu, "kernel_s": kernel, "python_s": python, "switches": switches,
            "block_cpu_s": service_counters(gateway["block_pid"])[0],
            "runners_cpu_s": service_counters(gateway["runners_pid"])[0],
            "machine_busy_s": machine_busy_s(), "tokens": workload.tokens(),
            "done": workload.done()}


def run_point(runners: int, per_runner: int, step_ms: float, warm_s: float,
              measure_s: float, seed: int, settle_max_s: float) -> dict[str, Any]:
    """One point: a fresh cluster of `runners` runners, the workload, one measured window."""
    settled_s = wait_until_quiet(settle_max_s) if settle_max_s > 0 else 0.0
    cost = CostModel()
    # The sim runner's --step-ms is a 256-row decode step; scale it so B rows take step_ms.
    sim_step_ms = step_ms * cost.decode_step_s() / cost.step_time_s(per_runner) \
        if step_ms > 0 else 0.0
    offered = runners * 1000.0 / step_ms if step_ms > 0 else None
    per_sequence = 1000.0 / step_ms if step_ms > 0 else 1000.0
    max_tokens = min(MAX_TOKENS_CAP, int((warm_s + measure_s) * per_sequence * 1.3) + 64)
    requests = make_requests(runners * per_runner, max_tokens, seed + runners)
    row: dict[str, Any] = {
        "runners": runners, "per_runner": per_runner, "requests": len(requests),
        "step_ms": step_ms, "sim_step_ms_256_rows": sim_step_ms, "max_tokens": max_tokens,
        "offered_steps_per_s": offered, "settled_s": settled_s, "errors": []}
    with cluster(runners, per_runner, sim_step_ms) as gateway:
        workload = Workload(gateway["address"], requests,
                            timeout_s=max(300.0, 20 * (warm_s + measure_s)))
        workload.thread.start()
        time.sleep(warm_s)
        first = sample(gateway, workload)
        time.sleep(measure_s)
        last = sample(gateway, workload)
        workload.thread.join()
    seconds = last["at"] - first["at"]
    before, after = first["metrics"], last["metrics"]
    steps = counter(after, "pagewire_gateway_steps") - counter(before, "pagewire_gateway_steps")
    executes = (counter(after, "pagewire_gateway_executes")
                - counter(before, "pagewire_gateway_executes"))
    generated = (counter(after, "pagewire_gateway_generated_tokens")
                 - counter(before, "pagewire_gateway_generated_tokens"))
    buckets, step_sum, step_count = histogram_delta(before, after, STEP_HISTOGRAM)
    p50, p99 = bucket_quantile(buckets, 0.5), bucket_quantile(buckets, 0.99)
    cpu_s = last["cpu_s"] - first["cpu_s"]
    errors = [timing.error for timing in workload.timings if timing.error]
    if workload.error is not None:
        errors.append(repr(workload.error))
    try:
        check_counts(f"{runners} runners", requests,
                     [timing.output_tokens for timing in workload.timings])
    except Exception as error:
        errors.append(str(error))
    row.update({
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
        "client_tokens_per_s": (last["tokens"] - first["tokens"]) / seconds,
        "gateway_tokens_per_s": generated / seconds,
        "gateway_cpu_s": cpu_s, "gateway_cores": cpu_s / seconds,
        "gateway_cpu_us_per_step": cpu_s / steps * 1e6 if steps else None,
        "gateway_python_us_per_step": (last["python_s"] - first["python_s"]) / steps * 1e6
        if steps else None,
        "gateway_kernel_us_per_step": (last["kernel_s"] - first["kernel_s"]) / steps * 1e6
        if steps else None,
        "gateway_switches_per_step": (last["switches"] - first["switches"]) / steps
        if steps else None,
        "block_service_cores": (last["block_cpu_s"] - first["block_cpu_s"]) / seconds,
        "block_service_cpu_us_per_step": (last["block_cpu_s"] - first["block_cpu_s"]) / steps
        * 1e6 if steps else None,
        "sim_runners_cores": (last["runners_cpu_s"] - first["runners_cpu_s"]) / seconds,
        "machine_cores": (last["machine_busy_s"] - first["machine_busy_s"]) / seconds,
        "done_before_window_end": last["done"],
        "tokens_checked": sum(timing.output_tokens for timing in workload.timings),
        "requests_checked": len(requests) if not errors else 0,
        "errors": errors[:5], "error_count": len(errors)})
    return row


# ---- report ---------------------------------------------------------------------------------
def table(rows: list[dict[str, Any]]) -> list[str]:
    header = ["runners", "requests (per runner)", "offered steps/s", "steps/s", "of offered",
              "Block Step mean / p50 / p99 ms", "client tokens/s",
              "gateway CPU µs/step (Python threads)", "block service CPU µs/step",
              "cores: gateway / block service / sim runners / machine", "checked (errors)"]
    lines = ["| " + " | ".join(header) + " |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for row in rows:
        cells = [
            f"{row['runners']}", f"{row['requests']} ({row['per_runner']})",
            fmt(row["offered_steps_per_s"], ",.0f"), f"{row['steps_per_s']:,.0f}",
            fmt(row["steps_per_s_of_offered"], ".0%"),
            f"{fmt(row['block_step_mean_ms'], '.2f')} / {fmt(row['block_step_p50_ms'], '.2f')}"
            f" / {fmt(row['block_step_p99_ms'], '.2f')}",
            f"{row['client_tokens_per_s']:,.0f}",
            f"{fmt(row['gateway_cpu_us_per_step'], ',.0f')} "
            f"({fmt(row['gateway_python_us_per_step'], ',.0f')})",
            fmt(row["block_service_cpu_us_per_step"], ",.0f"),
            f"{row['gateway_cores']:.2f} / {row['block_service_cores']:.2f} / "
            f"{row['sim_runners_cores']:.2f} / {row['machine_cores']:.2f}",
            f"{row['requests_checked']} ({row['error_count']})"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def markdown(data: dict[str, Any]) -> str:
    rows = data["points"]
    lines = [
        "# Control plane, gateway side: one gateway driving R simulated runners",
        "",
        f"`{data['command']}` — {data['measured_at']}, git {data['git']}, {data['cpus']} CPUs, "
        f"load average {data['load_average_before']:.2f} before the run.",
        "",
        f"Per point a fresh block service, R simulated runners (bench/sim_runner.py, "
        f"registered with it) and ONE gateway serving them all (round-robin placement); "
        f"R × {data['per_runner']} requests of {PROMPT_TOKENS} prompt tokens at once, each "
        f"long enough to outlive the window; every request checked for exactly its max_tokens. "
        f"The simulated runner takes {data['step_ms']:g} ms for a decode step of "
        f"{data['per_runner']} rows (the cost model scaled so), so a busy runner loop steps "
        f"{1000 / data['step_ms']:,.0f} times a second: offered = R × that. Warm-up "
        f"{data['warm_s']:g} s, measured window {data['measure_s']:g} s.",
        "",
        *table(rows),
        "",
        "steps/s: `pagewire_gateway_steps_total` (Steps sent to the block service), delta over "
        "the window. Block Step: the gateway's `pagewire_gateway_block_step_seconds`, bucket "
        "deltas over the window; mean exact (_sum / _count), p50 / p99 interpolated inside "
        "the buckets (edges 0.5, 1, 2.5, 5, 10, 25 ms ...), so estimates within their "
        "bucket. client tokens/s: tokens the client received in the window. Gateway CPU: "
        "/proc/<pid>/stat of the gateway process over the window (all threads; in brackets "
        "its threads named python: handlers, scheduler, protobuf, gRPC's Python layer, which "
        "take turns on the GIL). Block service CPU: its process over the window, per gateway "
        "step (each step is one Step of the block service). Cores: CPU seconds per second "
        "of the window; machine: every process (the client, this script, anything else "
        "included) on the machine's cores, which they all share.",
    ]
    busy = [row for row in rows if row["steps_per_s_of_offered"] is not None]
    if busy:
        lines += ["", "## Does one gateway keep R runners busy?", ""]
        for row in busy:
            share = row["steps_per_s_of_offered"]
            verdict = "yes" if share >= 0.9 else "no"
            lines.append(
                f"- {row['runners']} runner{'s' if row['runners'] > 1 else ''}: {verdict} — "
                f"{row['steps_per_s']:,.0f} of {row['offered_steps_per_s']:,.0f} steps/s "
                f"({share:.0%}), the gateway at {row['gateway_cores']:.2f} cores and "
                f"{fmt(row['gateway_cpu_us_per_step'], ',.0f')} µs of CPU per step.")
    lines += limits(rows)
    return "\n".join(lines) + "\n"


def limits(rows: list[dict[str, Any]]) -> list[str]:
    """What bounds the gateway, from the most loaded point."""
    loaded = [row for row in rows if row["steps"] and row["gateway_cpu_us_per_step"]]
    if not loaded:
        return []
    top = max(loaded, key=lambda row: row["runners"])
    gateway_us, block_us = top["gateway_cpu_us_per_step"], top["block_service_cpu_us_per_step"]
    phases = top["phase_mean_ms"]
    tokens_per_step = top["gateway_tokens_per_s"] / top["steps_per_s"]
    return [
        "", "## What limits the gateway", "",
        f"At {top['runners']} runners the gateway made {top['steps_per_s']:,.0f} steps/s at "
        f"{top['gateway_cores']:.2f} cores, {gateway_us:,.0f} µs of CPU per step "
        f"({top['gateway_python_us_per_step']:,.0f} on its Python threads, "
        f"{top['gateway_kernel_us_per_step']:,.0f} in the kernel, "
        f"{top['gateway_switches_per_step']:.0f} context switches per step) for "
        f"{tokens_per_step:.1f} tokens streamed per step: about "
        f"{gateway_us / tokens_per_step:,.0f} µs per streamed token. One core at that cost is "
        f"about {1e6 / gateway_us:,.0f} steps/s. The block service spent "
        f"{fmt(block_us, ',.0f')} µs of CPU per Step ({top['block_service_cores']:.2f} "
        f"cores); the rest of the Step round trip the gateway sees (mean "
        f"{fmt(top['block_step_mean_ms'], '.1f')} ms) is transport and queueing, on the "
        "gateway's side its threads waiting for the GIL to send the Step and take the answer. "
        "Mean per step over the window (the gateway's histograms, ms): "
        + ", ".join(f"{phase} {fmt(value, '.2f')}" for phase, value in phases.items()) + ".",
    ]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runners", type=lambda text: [int(part) for part in text.split(",")
                                                        if part.strip()], default=None,
                        help="runner counts, one point each (default 1,4,16; --quick 1,4)")
    parser.add_argument("--per-runner", type=int, default=16,
                        help="requests per runner (= the gateway's --max-num-seqs)")
    parser.add_argument("--step-ms", type=float, default=8.0,
                        help="a simulated decode step of --per-runner rows")
    parser.add_argument("--warm-s", type=float, default=None, help="default 3 (--quick 1)")
    parser.add_argument("--measure-s", type=float, default=None,
                        help="default 10 (--quick 3)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--settle-max-s", type=float, default=20.0,
                        help="before each point, wait up to this long for the CPUs to be 95%% "
                             "idle (bench/w1.py; 0: no wait)")
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="folder of gateway_plane.{json,md}")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.runners is None:
        args.runners = [1, 4] if args.quick else [1, 4, 16]
    if args.warm_s is None:
        args.warm_s = 1.0 if args.quick else 3.0
    if args.measure_s is None:
        args.measure_s = 3.0 if args.quick else 10.0
    if args.per_runner < 1 or args.step_ms <= 0 or min(args.runners, default=0) < 1:
        parser.error("need --per-runner >= 1, --step-ms > 0 and runner counts >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    data: dict[str, Any] = {
        "command": " ".join([".venv/bin/python bench/gateway_plane.py",
                             *(sys.argv[1:] if argv is None else argv)]),
        "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "cpus": os.cpu_count(), "load_average_before": os.getloadavg()[0],
        "git": git_state(), "per_runner": args.per_runner, "step_ms": args.step_ms,
        "warm_s": args.warm_s, "measure_s": args.measure_s, "points": []}
    print("\n".join(table([])), flush=True)
    for runners in args.runners:
        row = run_point(runners, args.per_runner, args.step_ms, args.warm_s, args.measure_s,
                        args.seed, args.settle_max_s)
        data["points"].append(row)
        print(table([row])[-1], flush=True)
        for error in row["errors"]:
            print(f"  error: {error}", file=sys.stderr)
    save_results(args.results, "gateway_plane", data, markdown(data))
    return 1 if any(row["error_count"] for row in data["points"]) else 0


if __name__ == "__main__":
    sys.exit(main())
