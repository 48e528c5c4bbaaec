"""One peer in a child process that lives for the whole benchmark (see bench/peers/protocol.py
for what the child does), under a time limit per run, so a hung or crashing peer can neither
hang nor kill the benchmark."""

from __future__ import annotations

import os
import queue
import shutil
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

from bench.peers.protocol import (
    DONE,
    PeerRequest,
    parse_progress,
    read_result,
    run_command,
    write_workload,
)

_LOG_TAIL_CHARS = 3000
_TERMINATE_GRACE_S = 10.0
_CLOSE_WAIT_S = 30.0
_POLL_S = 1.0


@dataclass
class PeerOutcome:
    """What one peer run gave: a measurement, or why there is none (`status`)."""

    seconds: float = 0.0  # as the peer timed its run
    output_tokens: list[int] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)
    status: str = ""
    wall_s: float = 0.0  # from the run command to the peer's answer, timed here


def _stop_group(process: subprocess.Popen[str]) -> None:
    """Ends the child and everything it started (vLLM runs an engine core process)."""
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


def end_leftovers(group: int, wait_s: float = 10.0) -> None:
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


class PeerProcess:
    """A peer started once (`command MODEL_DIR` style, see protocol.py) and asked for one run
    at a time. A run that fails or passes its time limit ends the process: the peer is then
    `failed` for good and every later run answers with that status at once."""

    def __init__(self, command: list[str], env: Mapping[str, str] | None = None) -> None:
        self._folder = Path(tempfile.mkdtemp(prefix="pagewire-peer-"))
        self._log_path = self._folder / "peer.log"
        self._log = open(self._log_path, "w")  # noqa: SIM115 (the child writes it until close)
        try:
            self._process = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                text=True, env=None if env is None else dict(env), start_new_session=True)
        except OSError:
            self._log.close()
            shutil.rmtree(self._folder, ignore_errors=True)
            raise
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, args=(self._process.stdout,), daemon=True).start()
        self.failed = ""
        self._runs = 0

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self._lines.put(line.strip())
        self._lines.put(None)  # the child closed stdout: it exited

    def run(self, label: str, requests: list[PeerRequest], timeout_s: float) -> PeerOutcome:
        """One run of `requests`; the time limit covers model loading for the first run."""
        if self.failed:
            return PeerOutcome(status=self.failed)
        self._runs += 1
        workload = self._folder / f"workload-{self._runs}.json"
        result = self._folder / f"result-{self._runs}.json"
        write_workload(workload, requests)
        assert self._process.stdin is not None
        try:
            self._process.stdin.write(run_command(workload, result))
            self._process.stdin.flush()
        except BrokenPipeError:
            return self._fail(label)
        started = time.monotonic()
        with tqdm(total=len(requests), desc=label, unit="req", leave=False,
                  file=sys.stderr) as bar:
            while True:
                try:
                    line = self._lines.get(timeout=_POLL_S)
                except queue.Empty:
                    # A child that died while what it started holds its stdout open (vLLM's
                    # engine core) sends no end of file: look at it, not only at the pipe.
                    if self._process.poll() is not None:
                        return self._fail(label)
                    if time.monotonic() - started > timeout_s:
                        return self._fail(label, f"timed out after {timeout_s:.0f} s")
                    continue
                if line is None:
                    return self._fail(label)
                if line == DONE:
                    break
                finished = parse_progress(line)
                if finished is not None and finished > bar.n:
                    bar.update(finished - bar.n)
                else:  # not the protocol: a log line the peer printed on stdout
                    self._log.write(line + "\n")
        measured = read_result(result)
        return PeerOutcome(measured.seconds, measured.output_tokens, measured.settings,
                           wall_s=time.monotonic() - started)

    def _fail(self, label: str, timed_out: str = "") -> PeerOutcome:
        """Ends the peer for good: it timed out (`timed_out` says how) or it exited."""
        if self._process.poll() is None:
            _stop_group(self._process)
        end_leftovers(self._process.pid)
        why = timed_out
        if not why:
            why = f"failed (exit code {self._process.returncode})"
            print(f"{label} {why}; the end of its log:\n{self.log_tail()}", file=sys.stderr)
        self.failed = why
        return PeerOutcome(status=why)

    def log_tail(self) -> str:
        self._log.flush()
        return self._log_path.read_text(errors="replace")[-_LOG_TAIL_CHARS:]

    def close(self) -> None:
        """Closes the peer's stdin (it exits when it reads the end) and reaps what is left."""
        if self._process.poll() is None:
            try:
                assert self._process.stdin is not None
                self._process.stdin.close()
                self._process.wait(timeout=_CLOSE_WAIT_S)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                _stop_group(self._process)
        end_leftovers(self._process.pid)
        self._log.close()
        shutil.rmtree(self._folder, ignore_errors=True)
