"""bench/gateway_plane.py in its quickest form (one simulated runner registered with a block
service, one gateway, 4 requests): steps are counted from the gateway's metrics and every
request is checked for exactly its max_tokens. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.gateway_plane import bucket_quantile

ROOT = Path(__file__).resolve().parents[2]


def test_quickest_run_counts_steps_and_checks_every_request(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "bench/gateway_plane.py", "--runners", "1", "--per-runner", "4",
         "--warm-s", "0.5", "--measure-s", "1", "--settle-max-s", "0",
         "--results", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    data = json.loads((tmp_path / "gateway_plane.json").read_text())
    [row] = data["points"]
    assert row["runners"] == 1 and row["requests"] == 4
    assert row["error_count"] == 0, row["errors"]
    assert row["requests_checked"] == 4
    assert row["tokens_checked"] == 4 * row["max_tokens"]
    assert row["steps"] > 0 and row["gateway_cpu_us_per_step"] > 0
    assert row["done_before_window_end"] == 0  # every request outlived the window
    assert "| 1 | 4 (4) |" in (tmp_path / "gateway_plane.md").read_text()


def test_bucket_quantile_interpolates_inside_the_bucket() -> None:
    buckets = [(0.001, 0.0), (0.002, 50.0), (0.004, 100.0), (float("inf"), 100.0)]
    assert bucket_quantile(buckets, 0.5) == 0.002
    assert abs(bucket_quantile(buckets, 0.75) - 0.003) < 1e-12
    assert bucket_quantile([(0.001, 0.0), (float("inf"), 4.0)], 0.99) == 0.001
    assert bucket_quantile([], 0.5) is None
