"""Where a serving step's time goes, across the three services, over one workload.

From the gateway's Prometheus metrics (sums of its per-step histograms, read before and after
the workload) and the CPU time each service process used meanwhile (/proc, Linux only):
- per step: scheduling (planning + applying the block service's answer), the Step round trip
  (sent while the previous step's Execute runs), how long the loop then still waited for that
  Execute, the Execute round trip and inside it the runner's own time (forward, sampling, the rest:
  decoding the request, validation, building the batch), and the output (detokenizing, stop
  checks, handing deltas to the streams);
- CPU seconds of each process: on a 2-core machine every CPU-second outside the runner is taken
  from the runner's two threads while a forward runs.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from bench.harness import proc_stat, scrape

# Histogram name (without pagewire_gateway_) -> the row it feeds.
_HISTOGRAMS = {
    "step_loop_seconds": "whole step",
    "schedule_seconds": "scheduling",
    "block_step_seconds": "Step round trip",
    "execute_seconds": "Execute round trip",
    "execute_wait_seconds": "wait for the Execute in flight",
    "runner_busy_seconds": "runner (its total)",
    "runner_forward_seconds": "runner: forward",
    "runner_sample_seconds": "runner: sampling",
    "output_seconds": "output (detokenize, stream)",
}
_SERVICES = ("gpu_runner", "block_service", "gateway")


@dataclass(frozen=True)
class Snapshot:
    """Histogram sums and counts of the gateway, and CPU seconds per service process."""

    sums: dict[str, float]
    counts: dict[str, float]
    cpu_s: dict[str, float]


def take_snapshot(metrics_port: int) -> Snapshot:
    samples = scrape(metrics_port, timeout_s=10)
    sums = {name: samples[f"pagewire_gateway_{name}_sum"] for name in _HISTOGRAMS
            if f"pagewire_gateway_{name}_sum" in samples}
    counts = {name: samples[f"pagewire_gateway_{name}_count"] for name in _HISTOGRAMS
              if f"pagewire_gateway_{name}_count" in samples}
    return Snapshot(sums, counts, _service_cpu_seconds())


def _service_cpu_seconds() -> dict[str, float]:
    """User + system CPU seconds of this process's `python -m <service>` children."""
    seconds = {name: 0.0 for name in _SERVICES}
    ticks = os.sysconf("SC_CLK_TCK")
    me = os.getpid()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as file:
                command = file.read().replace(b"\0", b" ").decode(errors="replace")
            fields = proc_stat(f"/proc/{pid}/stat")
        except OSError:
            continue
        if int(fields[1]) != me:  # the parent pid: only the services this bench started
            continue
        for name in _SERVICES:
            if f"-m {name} " in command + " ":
                seconds[name] += (int(fields[11]) + int(fields[12])) / ticks
    return seconds


def profile(windows: Sequence[tuple[Snapshot, Snapshot]], wall_s: float, bench_cpu_s: float
            ) -> dict[str, Any]:
    """Per-step milliseconds of each row, and CPU seconds per process, summed over the
    (before, after) snapshot windows of one workload's runs."""

    def change(sample: Callable[[Snapshot], dict[str, float]], name: str) -> float:
        return sum(sample(after).get(name, 0.0) - sample(before).get(name, 0.0)
                   for before, after in windows)

    steps = change(lambda s: s.counts, "step_loop_seconds")
    per_step_ms = {label: change(lambda s: s.sums, name) * 1e3 / max(steps, 1.0)
                   for name, label in _HISTOGRAMS.items()}
    cpu_s = {name: change(lambda s: s.cpu_s, name) for name in _SERVICES}
    cpu_s["bench client"] = bench_cpu_s
    return {"steps": steps, "wall_s": wall_s, "per_step_ms": per_step_ms, "cpu_s": cpu_s}


def markdown(rows: dict[str, dict[str, Any]]) -> list[str]:
    """The profiles of several ways of running W1 (name -> profile), a column each."""
    names = list(rows)
    per_step = {name: dict(row["per_step_ms"]) for name, row in rows.items()}
    for values in per_step.values():
        values["runner: request decoding, validation, batch building"] = (
            values["runner (its total)"] - values["runner: forward"]
            - values["runner: sampling"])
        # The Execute round trip also holds the wait behind the step before it (sent while
        # that one ran): what the runner is not busy with our batches is whole step − total.
        values["runner not on our batch (whole step − runner total)"] = (
            values["whole step"] - values["runner (its total)"])
    steps = ", ".join(f"{name}: {row['steps']:.0f} steps in {row['wall_s']:.1f} s"
                      for name, row in rows.items())
    columns = " | ".join(names)
    rule = "|---|" + "---:|" * len(names)
    lines = ["", f"Step-loop profile of W1 over its rounds ({steps}; the gateway's metrics, "
             "mean ms per step):", "", f"| part | {columns} |", rule]
    for label in per_step[names[0]]:
        lines.append(f"| {label} | "
                     + " | ".join(f"{per_step[name][label]:.2f}" for name in names) + " |")
    lines += ["", "CPU seconds used during W1, per process:", "", f"| process | {columns} |",
              rule]
    for process in rows[names[0]]["cpu_s"]:
        lines.append(f"| {process} | "
                     + " | ".join(f"{rows[name]['cpu_s'][process]:.2f}" for name in names)
                     + " |")
    return lines
