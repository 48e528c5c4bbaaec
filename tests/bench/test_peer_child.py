"""serve_bench's peer process: one process serves every run it is asked for; a peer that
crashes or hangs is reported as such (the hung one and its own children are stopped), stays
failed, and never stalls the bench."""

from __future__ import annotations

import time
from pathlib import Path

from bench.peers.child import PeerProcess
from bench.peers.protocol import PeerRequest
from tests.bench import fake_peer as fake_peer_script
from tests.helpers.services import pid_alive

REQUESTS = [PeerRequest([1, 2, 3], 10), PeerRequest([4], 6)]


def fake_peer(tmp_path: Path, mode: str) -> tuple[list[str], Path]:
    pid_file = tmp_path / f"{mode}.pid"
    return fake_peer_script.command(mode, pid_file), pid_file


def test_one_process_serves_every_run_with_its_per_request_counts(tmp_path: Path) -> None:
    command, _ = fake_peer(tmp_path, "ok")
    peer = PeerProcess(command)
    try:
        first = peer.run("first", REQUESTS, 30)
        second = peer.run("second", REQUESTS[:1], 30)
    finally:
        peer.close()
    assert (first.status, first.output_tokens, first.seconds) == ("", [10, 6], 1e-4)
    assert first.wall_s >= first.seconds
    assert second.output_tokens == [10]
    assert first.settings["pid"] == second.settings["pid"]
    assert not pid_alive(first.settings["pid"])


def test_a_crashed_peer_is_reported_with_its_exit_code_and_stays_failed(tmp_path: Path) -> None:
    command, _ = fake_peer(tmp_path, "crash")
    peer = PeerProcess(command)
    try:
        assert peer.run("crash", REQUESTS, 30).status == "failed (exit code 3)"
        assert peer.run("again", REQUESTS, 30).status == "failed (exit code 3)"
    finally:
        peer.close()


def test_a_hung_peer_and_its_children_are_stopped_at_the_time_limit(tmp_path: Path) -> None:
    command, pid_file = fake_peer(tmp_path, "hang")
    peer = PeerProcess(command)
    started = time.monotonic()
    try:
        assert peer.run("hang", REQUESTS, 3).status == "timed out after 3 s"
    finally:
        peer.close()
    assert time.monotonic() - started < 25
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while pid_alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(grandchild)
