"""serve_bench's peer runner: a peer that finishes is read, one that crashes or hangs is
reported as such (the hung one and its own children are stopped) and never stalls the bench."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from bench.peers.child import run_peer
from bench.peers.protocol import PeerRequest

FAKE_PEER = textwrap.dedent("""
    import json, os, subprocess, sys, time
    mode, pid_file, workload, result = sys.argv[1:5]
    requests = json.load(open(workload))
    if mode == "hang":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open(pid_file, "w").write(str(child.pid))
        time.sleep(600)
    if mode == "crash":
        print("boom", file=sys.stderr)
        sys.exit(3)
    for i in range(len(requests)):
        print(f"progress {i + 1}", flush=True)
    json.dump({"seconds": 2.0, "output_tokens": sum(r["max_tokens"] for r in requests),
               "settings": {"threads": 2}}, open(result, "w"))
""")
REQUESTS = [PeerRequest([1, 2, 3], 10), PeerRequest([4], 6)]


def fake_peer(tmp_path: Path, mode: str) -> tuple[list[str], Path]:
    script = tmp_path / "fake_peer.py"
    script.write_text(FAKE_PEER)
    pid_file = tmp_path / f"{mode}.pid"
    # run_peer appends WORKLOAD.json RESULT.json to the command.
    return [sys.executable, str(script), mode, str(pid_file)], pid_file


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_finished_peer_gives_its_throughput(tmp_path: Path) -> None:
    command, _ = fake_peer(tmp_path, "ok")
    outcome = run_peer("ok", command, REQUESTS, 30)
    row = outcome.as_row()
    assert row["tokens_per_s"] == pytest.approx((10 + 6) / 2.0)
    assert outcome.settings == {"threads": 2}


def test_a_crashed_peer_is_reported_with_its_exit_code(tmp_path: Path) -> None:
    command, _ = fake_peer(tmp_path, "crash")
    assert run_peer("crash", command, REQUESTS, 30).status == "failed (exit code 3)"


def test_a_hung_peer_and_its_children_are_stopped_at_the_time_limit(tmp_path: Path) -> None:
    command, pid_file = fake_peer(tmp_path, "hang")
    started = time.monotonic()
    outcome = run_peer("hang", command, REQUESTS, 2)
    assert outcome.status == "timed out after 2 s"
    assert time.monotonic() - started < 20
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(grandchild)
