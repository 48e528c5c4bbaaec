"""Generate streams from client processes, for benches that measure a server's CPU.

A bench that streams hundreds of requests from one asyncio loop inside its own process shares
a GIL (and a core) with its sampling, and on a small machine may itself be what limits the
server. Here each client is a separate process (`python -m bench.stream_clients`) that drives
its share of the streams with bench/timing.py's stream code (`Workload`, one asyncio loop in a
thread), so the parent can read each client's CPU from /proc/<pid>/stat like any service's.

The protocol, JSON lines (one object per line):
- parent -> child, first line on stdin: {"addresses": [...], "requests": [{"prompt": [ids],
  "max_tokens": n, "target": index into addresses}, ...], "timeout_s": seconds};
- child -> parent on stdout: {"kind": "started"} once every stream has been sent;
- parent: "sample" on stdin -> child: {"kind": "sample", "at": time.monotonic(), "tokens":
  [output tokens received so far, per address], "done": requests ended, "errors": requests
  ended in an error} (read at once, so the parent counts tokens at the moment it asks);
- child, when its last stream has ended: {"kind": "final", "counts": [output tokens of each
  request, in the order given], "errors": [the first few errors], "error_count": n};
- the child exits when its stdin closes and its streams have ended.

`ClientProcess` is the parent's side: it starts the child, sends it its requests, and reads its
lines on a thread into a queue (`expect` waits for one kind).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from bench.timing import RequestTiming, _stream_one  # noqa: E402
from bench.workloads import BenchRequest  # noqa: E402
from protos import gateway_pb2_grpc  # noqa: E402

MAX_ERRORS_REPORTED = 5


def spread(count: int, parts: int) -> list[list[int]]:
    """Indices 0 .. count-1 dealt round-robin into `parts` lists: part k gets k, k+parts, ..."""
    return [list(range(part, count, parts)) for part in range(parts)]


class Workload:
    """Every request on its own stream from one asyncio loop in a thread (bench/timing.py's
    stream code), request i to addresses[targets[i]] (one channel per address); the timings
    fill in as tokens arrive, so another thread can count them."""

    def __init__(self, addresses: Sequence[str], requests: Sequence[BenchRequest],
                 timeout_s: float, targets: Sequence[int] | None = None) -> None:
        self.addresses = list(addresses)
        self.requests = list(requests)
        self.targets = list(targets) if targets is not None else [0] * len(self.requests)
        if len(self.targets) != len(self.requests):
            raise ValueError("one target per request")
        self.timeout_s = timeout_s
        self.timings = [RequestTiming(sent=0.0) for _ in self.requests]
        self.error: BaseException | None = None
        self.started = threading.Event()  # every stream has been sent
        self.thread = threading.Thread(target=self._run, name="workload", daemon=True)

    def tokens(self) -> int:
        return sum(timing.output_tokens for timing in self.timings)

    def tokens_by_address(self) -> list[int]:
        counts = [0] * len(self.addresses)
        for target, timing in zip(self.targets, self.timings, strict=True):
            counts[target] += timing.output_tokens
        return counts

    def done(self) -> int:
        return sum(1 for timing in self.timings if timing.done)

    def errors(self) -> list[str]:
        found = [timing.error for timing in self.timings if timing.error]
        if self.error is not None:
            found.append(repr(self.error))
        return found

    def _run(self) -> None:
        try:
            asyncio.run(self._streams())
        except BaseException as error:  # reported by the caller
            self.error = error
        finally:
            self.started.set()

    async def _streams(self) -> None:
        channels = [grpc.aio.insecure_channel(address) for address in self.addresses]
        try:
            stubs = [gateway_pb2_grpc.GenerationServiceStub(channel) for channel in channels]
            streams = []
            for request, timing, target in zip(self.requests, self.timings, self.targets,
                                               strict=True):
                timing.sent = time.perf_counter()
                streams.append(asyncio.create_task(
                    _stream_one(stubs[target], request, timing, self.timeout_s)))
            self.started.set()
            await asyncio.gather(*streams)
        finally:
            for channel in channels:
                await channel.close()


# ---- the child ------------------------------------------------------------------------------
def child_main(stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout) -> int:
    spec = json.loads(stdin.readline())
    requests = [BenchRequest(list(item["prompt"]), int(item["max_tokens"]))
                for item in spec["requests"]]
    workload = Workload(spec["addresses"], requests, float(spec["timeout_s"]),
                        [int(item["target"]) for item in spec["requests"]])
    lock = threading.Lock()

    def say(message: dict[str, Any]) -> None:
        with lock:
            stdout.write(json.dumps(message) + "\n")
            stdout.flush()

    def finish() -> None:
        workload.thread.join()
        errors = workload.errors()
        say({"kind": "final", "counts": [timing.output_tokens for timing in workload.timings],
             "errors": errors[:MAX_ERRORS_REPORTED], "error_count": len(errors)})

    workload.thread.start()
    workload.started.wait()
    say({"kind": "started"})
    finisher = threading.Thread(target=finish, name="finish", daemon=True)
    finisher.start()
    for line in stdin:
        if line.strip() == "sample":
            say({"kind": "sample", "at": time.monotonic(),
                 "tokens": workload.tokens_by_address(), "done": workload.done(),
                 "errors": sum(1 for timing in workload.timings if timing.error)})
    finisher.join()
    return 0


# ---- the parent's side ----------------------------------------------------------------------
class ClientProcess:
    """One `python -m bench.stream_clients` child, driving `requests` (request i to
    addresses[targets[i]])."""

    def __init__(self, addresses: Sequence[str], requests: Sequence[BenchRequest],
                 targets: Sequence[int], timeout_s: float) -> None:
        self.requests = list(requests)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "bench.stream_clients"], cwd=ROOT, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env=dict(os.environ, PYTHONPATH=str(ROOT)))
        self.pid = self.process.pid
        self.final: dict[str, Any] | None = None
        self._lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, name=f"client-{self.pid}",
                                        daemon=True)
        self._reader.start()
        self._send(json.dumps({
            "addresses": list(addresses), "timeout_s": timeout_s,
            "requests": [{"prompt": request.prompt_token_ids, "max_tokens": request.max_tokens,
                          "target": target}
                         for request, target in zip(self.requests, targets, strict=True)]}))

    def _send(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            try:
                message = json.loads(line)
            except ValueError:  # not ours (a library's print): passed on
                sys.stderr.write(line)
                continue
            if not isinstance(message, dict):
                continue
            if message.get("kind") == "final":
                self.final = message
            self._lines.put(message)
        self._lines.put(None)  # the child closed its stdout

    def expect(self, kind: str, timeout_s: float) -> dict[str, Any]:
        """The next message of this kind; a "final" that comes first is kept (self.final)."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                message = self._lines.get(timeout=max(left, 0.0))
            except queue.Empty:
                raise RuntimeError(f"client process {self.pid}: no {kind!r} within "
                                   f"{timeout_s:.0f} s") from None
            if message is None:
                self._lines.put(None)
                raise RuntimeError(f"client process {self.pid} ended before {kind!r} "
                                   f"(exit status {self.process.poll()})")
            if message.get("kind") == kind:
                return message

    def ask_sample(self) -> None:
        self._send("sample")

    def wait_final(self, timeout_s: float) -> dict[str, Any]:
        if self.final is not None:
            return self.final
        return self.expect("final", timeout_s)

    def close(self) -> None:
        """Closes the child's stdin (it exits once its streams have ended); SIGTERM, then
        SIGKILL, if it has not ended within 10 s."""
        if self.process.stdin is not None and not self.process.stdin.closed:
            with contextlib.suppress(OSError):
                self.process.stdin.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)


if __name__ == "__main__":
    sys.exit(child_main())
