"""Runs one peer in a child process with a time limit, so a hung or crashing peer can neither
hang nor kill the benchmark (see bench/peers/protocol.py for what the child does)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from tqdm import tqdm

from bench.peers.protocol import PeerRequest, parse_progress, write_workload

_LOG_TAIL_CHARS = 3000
_TERMINATE_GRACE_S = 10.0


@dataclass
class PeerOutcome:
    """What one peer run gave: a measurement, or why there is none (`status`)."""

    seconds: float = 0.0
    output_tokens: int = 0
    settings: dict[str, Any] = field(default_factory=dict)
    status: str = ""

    def as_row(self) -> dict[str, Any]:
        if self.status:
            return {"status": self.status}
        return {"seconds": self.seconds, "output_tokens": self.output_tokens,
                "tokens_per_s": self.output_tokens / self.seconds, "settings": self.settings}


def _follow_progress(stream: IO[str], bar: tqdm) -> None:
    for line in stream:
        finished = parse_progress(line.strip())
        if finished is not None and finished > bar.n:
            bar.update(finished - bar.n)


def _stop_group(process: subprocess.Popen[str]) -> None:
    """Ends the child and everything it started (vLLM runs an engine and a worker process)."""
    for sig, wait_s in ((signal.SIGTERM, _TERMINATE_GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _end_leftovers(group: int, wait_s: float = 10.0) -> None:
    """Kills what a peer that exited left running in its process group (vLLM's engine core
    can outlive its parent) and waits until it is gone: the next measurement needs the CPU."""
    deadline = time.monotonic() + wait_s
    try:
        os.killpg(group, signal.SIGKILL)
        while time.monotonic() < deadline:
            os.killpg(group, 0)  # raises once no process of the group is left
            time.sleep(0.05)
    except ProcessLookupError:
        return


def _log_tail(path: Path) -> str:
    text = path.read_text(errors="replace")
    return text[-_LOG_TAIL_CHARS:]


def _outcome(process: subprocess.Popen[str], result_path: Path, log_path: Path,
             label: str) -> PeerOutcome:
    if process.returncode != 0 or not result_path.exists():
        print(f"{label} failed (exit code {process.returncode}); the end of its log:\n"
              f"{_log_tail(log_path)}", file=sys.stderr)
        return PeerOutcome(status=f"failed (exit code {process.returncode})")
    measured = json.loads(result_path.read_text())
    return PeerOutcome(float(measured["seconds"]), int(measured["output_tokens"]),
                       dict(measured.get("settings", {})))


def run_peer(label: str, command: list[str], requests: list[PeerRequest], timeout_s: float,
             env: Mapping[str, str] | None = None) -> PeerOutcome:
    """Runs `command WORKLOAD.json RESULT.json` with a progress bar; a child still running
    after `timeout_s` (model loading included) is stopped with its whole process group."""
    with tempfile.TemporaryDirectory(prefix="pagewire-peer-") as folder:
        workload, result = Path(folder) / "workload.json", Path(folder) / "result.json"
        log_path = Path(folder) / "peer.log"
        write_workload(workload, requests)
        with open(log_path, "w") as log, tqdm(total=len(requests), desc=label, unit="req",
                                             leave=False, file=sys.stderr) as bar:
            process = subprocess.Popen(
                [*command, str(workload), str(result)], stdout=subprocess.PIPE, stderr=log,
                text=True, env=None if env is None else dict(env), start_new_session=True)
            assert process.stdout is not None
            reader = threading.Thread(target=_follow_progress, args=(process.stdout, bar),
                                      daemon=True)
            reader.start()
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _stop_group(process)
                return PeerOutcome(status=f"timed out after {timeout_s:.0f} s")
            finally:
                if process.poll() is None:  # interrupted: leave no peer running
                    _stop_group(process)
                _end_leftovers(process.pid)
            reader.join(timeout=5)
        return _outcome(process, result, log_path, label)
