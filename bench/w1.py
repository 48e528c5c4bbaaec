"""W1 in rounds with every engine treated alike, and the figures a reviewer can check.

The rules, the same for every row of the table (pagewire offline and streamed, the ceiling,
each peer):
- **Lifetime**: one process (or, for the ceiling, one in-process runner) per engine for the
  whole of W1: started once, warmed up once, then timed in every round.
- **Warm-up**: one W1-sized run of another seed (WARM_UP_SEED), untimed, right after start.
- **Settle**: before every timed run, the machine waits (up to QUIET_MAX_S) until its CPUs are
  QUIET_IDLE idle over half a second; each row records how long it waited.
- **Rounds**: W1_ROUNDS rounds, each with its own seeded prompts (the same for every engine in
  that round, so no engine's prefix cache finds an earlier round's prompts) and its own order
  of the engines (round_order), so every engine runs at several positions after several
  others: neither the machine's drift nor what one engine leaves behind always lands on the
  same engine.
- **Verified tokens**: every request's output tokens are counted on the client, request by
  request, and must equal its `max_tokens` (EOS is ignored): an engine that falls short fails
  the bench instead of looking fast.
- **Ratios**: per round (pagewire ÷ row in that round); the headline is their median with
  the min–max beside it.
- **Dtypes**: W1 runs once per dtype (serve_bench --dtypes), every row of a dtype under the
  rules above (a dtype other than float32 with its first rounds alone: --other-dtype-rounds);
  ratios compare rows of one dtype, except pagewire ÷ pagewire across dtypes, which pairs the
  rounds by index (round i has the same prompts in every dtype).
"""

from __future__ import annotations

import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from bench import workloads
from bench.workloads import BenchRequest

W1_ROUNDS = 4
WARM_UP_SEED = 99
QUIET_IDLE = 0.95
QUIET_MAX_S = 60.0
WARM_UP = f"one untimed W1-sized run (seed {WARM_UP_SEED}) after start"


def round_seed(round_index: int) -> int:
    """A round's seed, of its prompts and of its order of the engines."""
    return round_index


def round_workload(round_index: int) -> list[BenchRequest]:
    """W1 of a round: its own seed, so no round finds another's prompts in a cache."""
    return workloads.offline_throughput(seed=round_seed(round_index))


def round_order(round_index: int, names: Sequence[str]) -> list[str]:
    """The order the engines run in, in a round: row `round_index` of a Williams design (first
    row 0, 1, n-1, 2, n-2, ...; each next row adds one to every entry, mod n). Each engine runs
    at another position every round, after other engines: over n rounds of an even n, every
    engine follows every other once. With 5 engines over 4 rounds: a b e c d, b c a d e,
    c d b e a, d e c a b."""
    count = len(names)
    first = [0]
    low, high = 1, count - 1
    while len(first) < count:
        first.append(low)
        low += 1
        if len(first) < count:
            first.append(high)
            high -= 1
    return [names[(k + round_index) % count] for k in first]


class ShortOutput(RuntimeError):
    """An engine produced other than the tokens a request asked for."""


def check_counts(label: str, requests: Sequence[BenchRequest], produced: Sequence[int]) -> None:
    """Raises ShortOutput unless request i produced exactly requests[i].max_tokens tokens."""
    if len(produced) != len(requests):
        raise ShortOutput(f"{label}: {len(produced)} token counts for {len(requests)} requests")
    wrong = [(i, count, request.max_tokens)
             for i, (count, request) in enumerate(zip(produced, requests, strict=True))
             if count != request.max_tokens]
    if wrong:
        index, count, asked = wrong[0]
        raise ShortOutput(f"{label}: {len(wrong)} of {len(requests)} requests produced other "
                          f"than they asked, e.g. request {index}: {count} of {asked} tokens")


def wait_until_quiet(max_s: float = QUIET_MAX_S, window_s: float = 0.5) -> float:
    """Waits (up to max_s) until the machine's CPUs are QUIET_IDLE idle over a window, and
    returns the seconds waited: what one engine left running (the kernel reclaiming memory,
    a process winding down) must not be billed to the next. Linux /proc/stat only."""
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
class W1Row:
    """One row of the W1 table: how the engine was treated and what each round measured."""

    name: str
    processes_started: int = 0
    warm_up: str = ""
    settle_waits_s: list[float] = field(default_factory=list)
    round_seconds: list[float] = field(default_factory=list)
    round_tokens: list[int] = field(default_factory=list)  # verified, request by request
    settings: dict[str, Any] = field(default_factory=dict)
    status: str = ""  # why the row stopped measuring; empty while it measures
    dtype: str = "float32"  # of the model's weights, activations and KV cache

    def settle(self) -> None:
        self.settle_waits_s.append(wait_until_quiet())

    def add_round(self, seconds: float, verified_tokens: int) -> None:
        if seconds <= 0:
            raise ValueError(f"{self.name}: a run of {seconds} s cannot be a measurement")
        self.round_seconds.append(seconds)
        self.round_tokens.append(verified_tokens)

    @property
    def round_rates(self) -> list[float]:
        return [tokens / seconds for tokens, seconds in
                zip(self.round_tokens, self.round_seconds, strict=True)]

    @property
    def tokens_per_s(self) -> float | None:
        seconds = sum(self.round_seconds)
        return sum(self.round_tokens) / seconds if seconds else None

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "status": self.status,
                "tokens_per_s": self.tokens_per_s,
                "round_tokens_per_s": self.round_rates, "round_seconds": self.round_seconds,
                "verified_tokens": sum(self.round_tokens), "rounds": len(self.round_rates),
                "processes_started": self.processes_started, "warm_up": self.warm_up,
                "settle_waits_s": self.settle_waits_s, "settings": self.settings}


class W1Engine(Protocol):
    """An engine under W1. `rows` are the table rows it fills (pagewire's offline run also
    fills the ceiling's); `run` measures one round into them, settling before each timed run,
    and raises when a run fails or its token counts are wrong."""

    rows: list[W1Row]

    def warm_up(self, requests: list[BenchRequest]) -> None: ...

    def run(self, round_index: int, requests: list[BenchRequest]) -> None: ...


def _fail(engine: W1Engine, stage: str, error: BaseException) -> None:
    traceback.print_exception(error, file=sys.stderr)
    why = f"failed in {stage}: {error}"
    print(f"\n*** W1 {engine.rows[0].name} {why} ***\n", file=sys.stderr)
    for row in engine.rows:
        row.status = row.status or why


def run_rounds(engines: Sequence[W1Engine], rounds: int,
               after_run: Callable[[], None] = lambda: None) -> list[list[str]]:
    """Warms every engine up, then runs `rounds` rounds, each in its own order (round_order).
    A failed engine keeps its status and is not run again; `after_run` is called after every
    run (to save what is measured so far). Returns each round's order of the engines' names."""
    for engine in engines:
        try:
            engine.warm_up(workloads.offline_throughput(seed=WARM_UP_SEED))
        except Exception as error:  # the others still run; the bench fails at its end
            _fail(engine, "its warm-up", error)
        after_run()
    by_name = {engine.rows[0].name: engine for engine in engines}
    orders = []
    for round_index in range(rounds):
        requests = round_workload(round_index)
        orders.append(round_order(round_index, list(by_name)))
        for name in orders[-1]:
            engine = by_name[name]
            if engine.rows[0].status:
                continue
            try:
                engine.run(round_index, requests)
            except Exception as error:
                _fail(engine, f"round {round_index + 1}", error)
            after_run()
    return orders


@dataclass(frozen=True)
class Ratio:
    """pagewire ÷ row over the rounds both measured."""

    median: float
    low: float
    high: float
    rounds: int


def per_round_ratio(numerators: Sequence[float], denominators: Sequence[float]) -> Ratio | None:
    """The ratios of two rows' per-round rates, round by round (a row that failed has fewer)."""
    ratios = [a / b for a, b in zip(numerators, denominators, strict=False)]
    if not ratios:
        return None
    return Ratio(statistics.median(ratios), min(ratios), max(ratios), len(ratios))
