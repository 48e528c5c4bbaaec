"""What the benches share, in one place: free ports, percentiles, the result files, and the
processes they measure (starting them, waiting for them, stopping them, reading their CPU
from /proc and their /metrics page).

Ports come from the launcher's free_port (gateway/launcher.py): below the ephemeral range, so
no outgoing connection of the bench itself can take a port between its pick and the server's
bind (a port the kernel hands out for port 0 lies inside that range).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NamedTuple

from bench.peers.child import end_leftovers
from gateway.launcher import free_port as free_port  # the one free-port function, re-exported

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
STARTUP_TIMEOUT_S = 900.0  # an OpenAI server's start, vLLM's included
STOP_GRACE_S = 45.0  # pagewire stops its three services one after another (15 s each at most)
STOP_TIMEOUT_S = 15.0  # a service started by start_python(): SIGTERM, then SIGKILL after this
LOG_TAIL_CHARS = 3000


# ---- ports ----------------------------------------------------------------------------------
def free_port_run(count: int, host: str = "127.0.0.1") -> int:
    """A port P with P .. P+count-1 all free on `host` (bound together to test them): a sim
    runner's --count N serves on N consecutive ports, `pagewire serve --gateways 2` on two.
    P is the launcher's free_port, so the run lies below the ephemeral range as well."""
    if count == 1:
        return free_port(host)
    for _ in range(200):
        base = free_port(host)
        with contextlib.ExitStack() as stack:
            try:
                for port in range(base + 1, base + count):
                    stack.enter_context(socket.socket()).bind((host, port))
            except (OSError, OverflowError):  # taken, or past 65535
                continue
            return base
    raise RuntimeError(f"no run of {count} free ports found")


# ---- figures --------------------------------------------------------------------------------
def percentile(values: Sequence[float], fraction: float) -> float:
    """The sorted values' element at index int(fraction * n) (the last for fraction 1; 0 for
    no values): a value that was measured, not one interpolated between two. One rank above
    the textbook nearest rank where fraction * n is whole; kept so figures stay comparable
    with earlier runs."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def fmt(value: float | None, spec: str, unit: str = "") -> str:
    """A table cell: `value` formatted by `spec`, "–" where there is none."""
    return "–" if value is None else f"{value:{spec}}{unit}"


# ---- results --------------------------------------------------------------------------------
def run_header(script: str, argv: Sequence[str] | None) -> dict[str, str]:
    """The first keys of a result file: the command as run from the checkout (`script` such
    as "bench/x.py"; `argv` as main got it, None for the process's own) and when (UTC)."""
    return {"command": " ".join([f".venv/bin/python {script}",
                                 *(sys.argv[1:] if argv is None else argv)]),
            "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def git_state() -> str:
    """The commit measured, and how many tracked files differed from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=False).stdout.strip()

    dirty = git("status", "--porcelain", "--untracked-files=no").splitlines()
    return git("rev-parse", "--short", "HEAD") + (
        f" + uncommitted changes in {len(dirty)} files" if dirty else "")


def portable_paths(text: str) -> str:
    """`text` with this machine's folders named as any machine has them: the checkout as
    relative paths, the home folder as ~, the temp folder as $TMPDIR (results are committed)."""
    for folder, name in ((ROOT, ""), (Path.home(), "~/"), (Path(tempfile.gettempdir()),
                                                            "$TMPDIR/")):
        text = text.replace(f"{folder}/", name)
    return text


def save_results(folder: Path, stem: str, data: dict[str, Any], text: str,
                 echo: bool = True) -> None:
    """Writes `stem`.json and `stem`.md (the table) into `folder` and prints the table (unless
    not `echo`: a save part-way through a run); paths in both are made portable."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{stem}.json").write_text(portable_paths(json.dumps(data, indent=2)))
    (folder / f"{stem}.md").write_text(portable_paths(text))
    if echo:
        print()
        print(text)


# ---- processes ------------------------------------------------------------------------------
def start_python(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """`python ARGS` from the checkout, with the checkout importable (for `-m service`)."""
    return subprocess.Popen([sys.executable, *args], cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=str(ROOT), **(env or {})))


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL if it has not ended within STOP_TIMEOUT_S."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def wait_for(what: str, ready: Callable[[], bool], processes: Sequence[subprocess.Popen[bytes]],
             timeout_s: float) -> None:
    """Polls `ready` until it holds; raises RuntimeError, naming `what`, once any of
    `processes` exits or `timeout_s` passes first."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if any(process.poll() is not None for process in processes):
            raise RuntimeError(f"a process exited while waiting for {what}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.2)


def exit_on_sigterm() -> None:
    """SIGTERM (a timeout, a kill) raises SystemExit, so the bench's `finally` blocks and
    context managers still stop the services and clients it started."""
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))


def accepts_channels(address: str, timeout_s: float = 0.5) -> bool:
    """Whether a gRPC channel to `address` becomes ready within `timeout_s` (for servers
    without a health service; wait_for polls it)."""
    import grpc

    with grpc.insecure_channel(address) as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            return False
    return True


@contextlib.contextmanager
def block_service_process(extra_args: tuple[str, ...] = ()) -> Iterator[str]:
    """`python -m block_service` on a free loopback port; yields its address once its channel
    is ready (an error at once if it exits first)."""
    address = f"127.0.0.1:{free_port()}"
    server = start_python(["-m", "block_service", "--port", address.rsplit(":", 1)[1],
                           "--log-level", "WARNING", *extra_args])
    try:
        wait_for("the block service", lambda: accepts_channels(address), [server], 30)
        yield address
    finally:
        stop(server)


def block_service_pid() -> int:
    """The pid of this process's `python -m block_service` child."""
    for task in Path("/proc/self/task").iterdir():
        for pid in (task / "children").read_text().split():
            with contextlib.suppress(OSError):
                if b"-m\0block_service\0" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return int(pid)
    raise RuntimeError("no block service child process found")


def log_tail(path: Path, chars: int = LOG_TAIL_CHARS) -> str:
    """The end of a log, for an error message ("" where it cannot be read)."""
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def children(pid: int) -> list[int]:
    """Every live descendant of `pid` (from /proc): pagewire's services run in sessions of
    their own, so a signal to the launcher's group does not reach them."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int(proc_stat(entry / "stat")[1])
        except OSError:
            continue
        parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


@dataclass
class Server:
    """One engine's OpenAI server as a process group of its own, logging to a file."""

    engine: str
    command: list[str]
    env: dict[str, str]
    port: int
    log_path: Path
    settings: dict[str, Any] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None
    served_name: str = ""

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = STARTUP_TIMEOUT_S) -> str:
        """Starts the server and waits until `GET /v1/models` answers; returns the model name
        it serves."""
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=log,
                                            env={**os.environ, **self.env},
                                            start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.engine} server exited with {self.process.returncode}"
                                   f" while starting; its log:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/v1/models", timeout=5) as reply:
                    models = json.loads(reply.read())
                self.served_name = models["data"][0]["id"]
                return self.served_name
            except (OSError, urllib.error.URLError, ValueError, KeyError, IndexError):
                time.sleep(1.0)
        raise RuntimeError(f"{self.engine} server did not answer /v1/models in {timeout_s:.0f}"
                           f" s; its log:\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM (pagewire then stops its services in order), SIGKILL after STOP_GRACE_S;
        then whatever it started that is still there, by pid, and its process group."""
        process = self.process
        if process is None:
            return
        descendants = children(process.pid)
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        for pid in descendants:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        end_leftovers(process.pid)

    def log_tail(self) -> str:
        return log_tail(self.log_path)


# ---- what a process used --------------------------------------------------------------------
def proc_stat(path: Path | str) -> list[str]:
    """The fields of a /proc/<pid>[/task/<tid>]/stat file after the command name (which may
    hold spaces and parentheses): [1] the parent pid, [11] user and [12] system CPU ticks."""
    with open(path) as file:
        return file.read().rsplit(")", 1)[1].split()


class ProcessCounters(NamedTuple):
    """Of one process so far (a tuple, so that deltas are taken field by field)."""

    cpu_s: float  # all threads, user + system, and the children it has reaped (snapshot writers)
    kernel_s: float  # of that, system
    python_s: float  # threads named "python"
    switches: float  # context switches of its live threads


def service_counters(pid: int) -> ProcessCounters:
    """Of a process so far: its CPU seconds (with those of the children it has waited for:
    the block service's journal snapshots are written by forked children), of them in the
    kernel, CPU seconds of its threads named "python", context switches of its live threads.
    The Python threads run the
    handlers, protobuf and gRPC's Python layer (under the GIL), and gRPC's C core where they
    poll; gRPC's own threads (event_engine, timer) work without the GIL."""
    ticks = os.sysconf("SC_CLK_TCK")

    def cpu(stat_path: Path) -> tuple[float, float]:
        fields = proc_stat(stat_path)
        return (int(fields[11]) + int(fields[12])) / ticks, int(fields[12]) / ticks

    python = switches = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            if (task / "comm").read_text().strip() == "python":
                python += cpu(task / "stat")[0]
            for line in (task / "status").read_text().splitlines():
                if line.endswith(tuple("0123456789")) and "ctxt_switches" in line:
                    switches += int(line.split()[-1])
    total, kernel = cpu(Path(f"/proc/{pid}/stat"))
    fields = proc_stat(f"/proc/{pid}/stat")
    children = (int(fields[13]) + int(fields[14])) / ticks  # cutime + cstime
    return ProcessCounters(total + children, kernel, python, switches)


def machine_busy_s() -> float:
    """CPU seconds all cores of the machine spent outside idle and iowait since boot."""
    with open("/proc/stat") as file:
        fields = [int(value) for value in file.readline().split()[1:]]
    ticks = os.sysconf("SC_CLK_TCK")
    return (sum(fields[:8]) - fields[3] - fields[4]) / ticks


def scrape(metrics_port: int, timeout_s: float = 5.0) -> dict[str, float]:
    """Every sample on a loopback /metrics page, by its name with labels as written there."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=timeout_s) as reply:
        text = reply.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples
