"""Start pagewire services as real processes on free loopback ports, for tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.client import PagewireClient
from gateway.launcher import free_port as free_port  # re-exported for the tests

ROOT = Path(__file__).resolve().parents[2]


SERVE_BANNER = "pagewire is serving"


def start_serve(args: Sequence[str], output_path: Path, env: dict[str, str] | None = None,
                timeout_s: float = 300.0) -> subprocess.Popen[bytes]:
    """`pagewire serve ARGS` as a process writing to `output_path`, returned once its banner
    is out (a process that exits or a banner that does not come within `timeout_s` fails
    the test with the output)."""
    with open(output_path, "wb") as output:
        serve = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", *args],
                                 cwd=ROOT, stdout=output, stderr=subprocess.STDOUT,
                                 env={**os.environ, **(env or {})})
    deadline = time.monotonic() + timeout_s
    while SERVE_BANNER not in output_path.read_text(errors="replace"):
        if serve.poll() is not None or time.monotonic() > deadline:
            serve.kill()
            raise AssertionError(output_path.read_text(errors="replace"))
        time.sleep(0.2)
    return serve


def pid_alive(pid: int) -> bool:
    """Whether a process with this id still exists (a zombie counts until it is reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def health_status(address: str, timeout_s: float = 1.0) -> int | None:
    """The overall health status of the server at `address`, or None if it does not answer."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout_s
            )
        except grpc.RpcError:
            return None
        return int(reply.status)


def scrape_metric(metrics_port: int | str, name: str, **labels: str) -> float:
    """Sum of a metric's samples on a service's /metrics page that carry every label in
    `labels` (0 when there is none). `name` may end with labels of its own, as written on the
    page: 'pagewire_gateway_batch_tokens_bucket{le="16.0"}'."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + " ") and not line.startswith(name + "{"):
            continue
        if all(f'{key}="{value}"' in line for key, value in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@dataclass
class ServiceProcess:
    """A service started as `python -m <module> --port <port> <args>`."""

    module: str
    args: Sequence[str] = ()
    env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, log_dir: Path) -> ServiceProcess:
        self.log_path = log_dir / f"{self.module}-{self.port}.log"
        command = [sys.executable, "-m", self.module, "--port", str(self.port), *self.args]
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                command, cwd=ROOT, env={**os.environ, **self.env}, stdout=log, stderr=log
            )
        return self

    def wait_serving(self, timeout_s: float = 120.0) -> ServiceProcess:
        """Waits until health says SERVING; fails with the service's log otherwise."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.module} exited {self.process.returncode}:\n{self.log()}")
            if health_status(self.address) == health_pb2.HealthCheckResponse.SERVING:
                return self
            time.sleep(0.1)
        raise TimeoutError(f"{self.module} not SERVING after {timeout_s}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path else ""

    def terminate(self, timeout_s: float = 10.0) -> int:
        """SIGTERM, then wait; returns the exit code (kills and raises on timeout)."""
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise

    def kill(self) -> None:
        """SIGKILL (a crash), then reap."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@dataclass
class GatewayProcess:
    """A gateway process with its client and metrics port."""

    process: ServiceProcess
    metrics_port: int
    client: PagewireClient

    def metric(self, name: str, **labels: str) -> float:
        """A metric's value from the gateway's /metrics page (0 when absent); with `labels`,
        the sum of the samples that carry them."""
        return scrape_metric(self.metrics_port, name, **labels)
