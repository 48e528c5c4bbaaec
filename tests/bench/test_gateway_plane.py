"""bench/gateway_plane.py in its quickest forms (one simulated runner registered with a block
service, one or two gateways, 4 requests from one or two client processes): steps are counted
from the gateways' metrics and every request is checked for exactly its max_tokens; and the
pure parts (the points, how streams are dealt out, how several gateways' and clients' samples
add up, the report). No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.gateway_plane import (
    DEFAULT_POINTS,
    QUICK_POINTS,
    RUNNER_BUSY,
    RUNNER_FORWARDS,
    RUNNER_ROWS,
    Point,
    bucket_quantile,
    default_clients,
    gather_counts,
    markdown,
    merge_samples,
    parse_args,
    plan_points,
    summarise,
    table,
)
from bench.stream_clients import spread

ROOT = Path(__file__).resolve().parents[2]


def run_bench(tmp_path: Path, *extra: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "bench/gateway_plane.py", "--runners", "1", "--per-runner", "4",
         "--warm-s", "0.5", "--measure-s", "1", "--settle-max-s", "0",
         "--results", str(tmp_path), *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads((tmp_path / "gateway_plane.json").read_text())  # type: ignore[no-any-return]


def test_quickest_run_counts_steps_and_checks_every_request(tmp_path: Path) -> None:
    data = run_bench(tmp_path)
    [row] = data["points"]
    assert row["runners"] == 1 and row["requests"] == 4
    assert (row["stream_interval"], row["gateways"], row["clients"]) == (1, 1, 1)
    assert row["error_count"] == 0, row["errors"]
    assert row["requests_checked"] == 4
    assert row["tokens_checked"] == 4 * row["max_tokens"]
    assert row["steps"] > 0 and row["gateway_cpu_us_per_step"] > 0
    assert row["gateway_cpu_us_per_token"] > 0
    assert row["client_cores_max"] is not None and len(row["client_cores"]) == 1
    assert row["done_before_window_end"] == 0  # every request outlived the window
    if row["rows_per_forward"] is not None:  # the sim runner's counters
        assert 0 < row["rows_per_forward"] <= 4
    assert "| 1 | 4 (4) | 1 | 1 | 1 |" in (tmp_path / "gateway_plane.md").read_text()


def test_two_gateways_two_clients_coalesced(tmp_path: Path) -> None:
    data = run_bench(tmp_path, "--gateways", "2", "--clients", "2", "--stream-intervals", "4")
    [row] = data["points"]
    assert (row["stream_interval"], row["gateways"], row["clients"]) == (4, 2, 2)
    assert row["error_count"] == 0, row["errors"]
    assert row["requests_checked"] == 4
    assert row["tokens_checked"] == 4 * row["max_tokens"]
    assert row["steps"] > 0
    assert len(row["gateway_cores_by_process"]) == 2
    assert all(value > 0 for value in row["gateway_cpu_us_per_token_by_process"])
    assert len(row["client_cores"]) == 2
    assert "| 1 | 4 (4) | 4 | 2 | 2 |" in (tmp_path / "gateway_plane.md").read_text()


def test_bucket_quantile_interpolates_inside_the_bucket() -> None:
    buckets = [(0.001, 0.0), (0.002, 50.0), (0.004, 100.0), (float("inf"), 100.0)]
    assert bucket_quantile(buckets, 0.5) == 0.002
    assert abs(bucket_quantile(buckets, 0.75) - 0.003) < 1e-12  # type: ignore[operator]
    assert bucket_quantile([(0.001, 0.0), (float("inf"), 4.0)], 0.99) == 0.001
    assert bucket_quantile([], 0.5) is None


# ---- points ---------------------------------------------------------------------------------
def test_default_points_and_quick_subset() -> None:
    assert plan_points(None, None, None, None) == list(DEFAULT_POINTS)
    assert [(p.runners, p.per_runner, p.stream_interval, p.gateways) for p in DEFAULT_POINTS] \
        == [(1, 256, 1, 1), (1, 256, 8, 1), (4, 64, 1, 1), (4, 64, 8, 1), (1, 256, 1, 2),
            (1, 256, 1, 4)]
    assert plan_points(None, None, None, None, quick=True) == list(QUICK_POINTS)
    assert set(QUICK_POINTS) <= set(DEFAULT_POINTS)
    # --per-runner alone replaces every default point's streams per runner.
    assert {p.per_runner for p in plan_points(None, 8, None, None)} == {8}


def test_points_are_the_product_of_the_flags() -> None:
    points = plan_points([1, 4], 64, [1, 8], [1, 2])
    assert len(points) == 8
    assert points[0] == Point(1, 64, 1, 1) and points[1] == Point(1, 64, 1, 2)
    assert points[2] == Point(1, 64, 8, 1) and points[-1] == Point(4, 64, 8, 2)
    # Missing lists are [1]; B defaults to 256 streams in all.
    assert plan_points([1, 4, 16], None, None, None) == [Point(1, 256), Point(4, 64),
                                                         Point(16, 16)]
    assert plan_points(None, None, None, [2]) == [Point(1, 256, 1, 2)]
    assert plan_points(None, 4, [8], None) == [Point(1, 4, 8, 1)]
    assert plan_points([512], None, None, None) == [Point(512, 1)]


def test_parse_args_builds_points_and_refuses_nonsense() -> None:
    args = parse_args(["--runners", "1", "--per-runner", "4", "--stream-intervals", "1,8",
                       "--gateways", "1,2", "--clients", "2"])
    assert len(args.points) == 4 and args.clients == 2
    assert (args.warm_s, args.measure_s) == (3.0, 8.0)
    quick = parse_args(["--quick"])
    assert quick.points == list(QUICK_POINTS) and quick.measure_s < 8.0
    for bad in (["--gateways", "0"], ["--stream-intervals", ""], ["--clients", "0"],
                ["--per-runner", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_clients_and_how_streams_are_dealt() -> None:
    assert default_clients(64) == 1 and default_clients(65) == 4 and default_clients(256) == 4
    assert spread(5, 2) == [[0, 2, 4], [1, 3]]
    assert spread(2, 4) == [[0], [1], [], []]
    parts = spread(5, 2)
    assert gather_counts(parts, [[10, 12, 14], [11, 13]], 5) == [10, 11, 12, 13, 14]
    with pytest.raises(ValueError):
        gather_counts(parts, [[10, 12], [11, 13]], 5)


# ---- aggregation ----------------------------------------------------------------------------
def gateway_metrics(steps: float, tokens: float, step_sum: float) -> dict[str, float]:
    return {"pagewire_gateway_steps_total": steps,
            "pagewire_gateway_executes_total": steps,
            "pagewire_gateway_generated_tokens_total": tokens,
            "pagewire_gateway_scheduled_tokens_total": tokens,
            'pagewire_gateway_block_step_seconds_bucket{le="0.001"}': steps / 2,
            'pagewire_gateway_block_step_seconds_bucket{le="0.0025"}': steps,
            'pagewire_gateway_block_step_seconds_bucket{le="+Inf"}': steps,
            "pagewire_gateway_block_step_seconds_sum": step_sum,
            "pagewire_gateway_block_step_seconds_count": steps}


def snapshot(at: float, scale: float, runner: dict[str, float] | None) -> dict[str, Any]:
    """Two gateways (the second with twice the first's counts), two clients."""
    return {
        "at": at,
        "gateways": [
            {"metrics": gateway_metrics(100 * scale, 1000 * scale, 0.1 * scale),
             "cpu_s": 1.0 * scale, "kernel_s": 0.1 * scale, "python_s": 0.8 * scale,
             "switches": 50 * scale},
            {"metrics": gateway_metrics(200 * scale, 2000 * scale, 0.2 * scale),
             "cpu_s": 3.0 * scale, "kernel_s": 0.2 * scale, "python_s": 2.5 * scale,
             "switches": 80 * scale}],
        "block_cpu_s": 0.5 * scale, "runners_cpu_s": 0.2 * scale,
        "runner_metrics": runner, "machine_busy_s": 10 * scale,
        # tokens per gateway, as each client counted them.
        "clients": [{"tokens": [400 * scale, 1000 * scale], "done": 0, "errors": 0},
                    {"tokens": [600 * scale, 1000 * scale], "done": 1, "errors": 0}],
        "client_cpu_s": [0.5 * scale, 1.0 * scale],
    }


def runner_metrics(scale: float) -> dict[str, float]:
    return {RUNNER_FORWARDS: 100 * scale, RUNNER_ROWS: 6400 * scale, RUNNER_BUSY: 0.9 * scale}


META = {"runners": 1, "per_runner": 64, "stream_interval": 1, "gateways": 2, "requests": 64,
        "clients": 2, "step_ms": 8.0, "max_tokens": 100}


def finish(row: dict[str, Any]) -> dict[str, Any]:
    row.update({"tokens_checked": 6400, "requests_checked": 64, "errors": [], "error_count": 0})
    return row


def test_summarise_adds_up_gateways_and_clients() -> None:
    row = summarise(META, snapshot(0.0, 1.0, runner_metrics(1.0)),
                    snapshot(2.0, 2.0, runner_metrics(2.0)))
    assert row["measure_s"] == 2.0
    assert row["steps"] == 300 and row["steps_per_s"] == 150
    assert row["offered_steps_per_s"] == 2 * 1000 / 8.0
    assert row["gateway_cpu_s"] == 4.0 and row["gateway_cores"] == 2.0
    assert row["gateway_cores_by_process"] == [0.5, 1.5]
    # 3,000 tokens received in the window: 1,000 from gateway 0, 2,000 from gateway 1.
    assert row["client_tokens_per_s"] == 1500
    assert row["client_tokens_per_s_by_gateway"] == [500, 1000]
    assert row["gateway_cpu_us_per_token"] == pytest.approx(4.0 / 3000 * 1e6)
    assert row["gateway_cpu_us_per_token_by_process"] == pytest.approx([1000.0, 1500.0])
    assert row["gateway_cpu_us_per_step"] == pytest.approx(4.0 / 300 * 1e6)
    assert row["gateway_python_us_per_step"] == pytest.approx(3.3 / 300 * 1e6)
    assert row["block_step_mean_ms"] == pytest.approx(0.3 / 300 * 1e3)
    assert row["client_cores"] == [0.25, 0.5] and row["client_cores_max"] == 0.5
    assert row["clients_cores"] == 0.75
    assert row["runner_busy_share"] == pytest.approx(0.9 / 2.0)
    assert row["rows_per_forward"] == 64
    assert row["done_before_window_end"] == 1
    assert row["gateways"] == 2 and row["stream_interval"] == 1


def test_missing_runner_counters_read_as_na() -> None:
    row = finish(summarise(META, snapshot(0.0, 1.0, None), snapshot(2.0, 2.0, None)))
    assert row["runner_busy_share"] is None and row["rows_per_forward"] is None
    assert " n/a | n/a |" in table([row])[-1]
    without = finish(summarise(META, snapshot(0.0, 1.0, {"other_total": 1.0}),
                               snapshot(2.0, 2.0, {"other_total": 2.0})))
    assert without["runner_busy_share"] is None


def test_merge_samples_adds_each_sample() -> None:
    merged = merge_samples([{"a_total": 1.0, "b": 2.0}, {"a_total": 3.0}])
    assert merged == {"a_total": 4.0, "b": 2.0}
    assert merge_samples([]) == {}


def test_markdown_reports_every_section() -> None:
    one = finish(summarise({**META, "gateways": 1},
                           {**snapshot(0.0, 1.0, runner_metrics(1.0)),
                            "gateways": snapshot(0.0, 1.0, None)["gateways"][:1],
                            "clients": [{"tokens": [400.0], "done": 0, "errors": 0}],
                            "client_cpu_s": [0.5]},
                           {**snapshot(2.0, 2.0, runner_metrics(2.0)),
                            "gateways": snapshot(2.0, 2.0, None)["gateways"][:1],
                            "clients": [{"tokens": [800.0], "done": 0, "errors": 0}],
                            "client_cpu_s": [1.0]}))
    coalesced = {**one, "stream_interval": 8}
    two = finish(summarise(META, snapshot(0.0, 1.0, runner_metrics(1.0)),
                           snapshot(2.0, 2.0, runner_metrics(2.0))))
    data = {"command": "bench", "measured_at": "now", "git": "x", "cpus": 2,
            "load_average_before": 0.0, "step_ms": 8.0, "warm_s": 1.0, "measure_s": 2.0,
            "points": [one, coalesced, two],
            "failed": [{"runners": 4, "per_runner": 64, "stream_interval": 1, "gateways": 4,
                        "error": "RuntimeError('boom')"}]}
    text = markdown(data)
    assert "**Not measured**: 4 runners × 64, interval 1, 4 gateways — RuntimeError('boom')" \
        in text
    for heading in ("## Do the gateways keep the runners busy?",
                    "## Stream interval: tokens per message",
                    "## Several gateways over the same runners", "## The client",
                    "## What limits the gateway"):
        assert heading in text
    assert "Busiest client process at 0.50 cores" in text
    assert "| 1 | 64 (64) | 8 | 1 | 2 |" in text
    assert "(1,000.0 / 1,500.0)" in text  # each gateway's µs per token
    # The limits section takes the single-gateway point at interval 1.
    assert "At 1 runner × 64, interval 1, the gateway made" in text
