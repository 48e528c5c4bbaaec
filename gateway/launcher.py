"""`pagewire serve`: the three services as processes on localhost, supervised together.

The block service and the runners listen on free internal ports; the gateways on --port
(50051) and the ports after it. Runners register with the block service and gateways serve
every registered runner (docs/scaling.md); with several runners the machine's cores are split
between them. The launcher waits until each answers health SERVING, then watches them. A service
that dies is restarted on the same port, after a backoff that doubles with each quick death
(0.5 s up to 30 s; back to 0.5 s once it has run for a minute), and the launcher logs why it
died (exit code or signal). The block service journals into a folder of this serve run, so
a restarted one comes back with every session and block table; a restarted runner has a new
epoch and the gateway recomputes its running sequences. On Ctrl-C / SIGTERM all are stopped
together (gateway first, so streams end before their backends go).
"""

from __future__ import annotations

import json
import logging
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

log = logging.getLogger("pagewire")

_STOP_TIMEOUT_S = 15.0
_FIRST_BACKOFF_S = 0.5
_MAX_BACKOFF_S = 30.0
_STABLE_AFTER_S = 60.0  # a child that ran this long starts over at the first backoff
SERVICES_NICE = 10
DEFAULT_HTTP_PORT = 8000
# The runner's --dtype choices (gpu_runner.runner.DTYPES; a test holds the two equal). Named
# here so that the CLI can check the flag without importing torch.
RUNNER_DTYPES = ("float32", "bfloat16", "float16")
# The runners' --max-loras when adapters are served (--lora-modules) and it is not given.
DEFAULT_MAX_LORAS = 4


@dataclass
class LaunchConfig:
    """What `pagewire serve` starts."""

    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int = 0
    http_port: int = 0  # the first gateway's HTTP API (0: none; the CLI defaults to 8000)
    served_model_name: str = ""
    generation_config: str | None = None  # the gateways' --generation-config
    # The gateways' --override-generation-config (generation-config fields).
    override_generation_config: dict[str, Any] = field(default_factory=dict)
    block_size: int | None = None
    kv_cache_memory: int | None = None
    max_model_len: int | None = None
    dtype: str | None = None  # every runner's --dtype (None: the runner's default)
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    runners: int = 1  # runner processes (each its own KV pool)
    gateways: int = 1  # gateway processes, on port, port + 1, ...
    routing: str | None = None  # the gateways' --routing
    runner_args: list[str] = field(default_factory=list)
    # LoRA: the gateways' --lora-modules (name, path), the runners' --max-loras (None: 0, or
    # DEFAULT_MAX_LORAS with lora_modules) and --max-lora-rank (None: the runner's default).
    lora_modules: list[tuple[str, str]] = field(default_factory=list)
    max_loras: int | None = None
    max_lora_rank: int | None = None
    log_dir: Path | None = None
    journal_dir: Path | None = None  # the block service's journal (default: under log_dir)
    startup_timeout_s: float = 900.0  # a first start converts the default model
    restart: bool = True  # restart a service that dies (False: stop everything)
    # `--nice` of the gateway and the block service: all three share this host's cores, and a
    # CPU runner's forward keeps every core busy; a thread of theirs that takes a core in the
    # middle of a forward stalls its other threads at the next barrier. W1 on 2 cores: +1.6 %
    # at 10 and +2.9 % at 19, 3 of 3 rounds each (2026-12-01).
    services_nice: int = SERVICES_NICE


INTERNAL_HOST = "127.0.0.1"


# Where free_port looks: below the kernel's ephemeral range, whose ports outgoing connections
# take. A port the kernel hands out for bind(0) lies inside it, and a service binds its port
# only after its start-up (a runner tunes for ~40 s): in between, a client connection may take
# it ("Address already in use", seen in serve_bench after W3's connections).
_PORT_FLOOR = 10_000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now on `host` that no outgoing connection will take: drawn below the
    ephemeral range (the kernel's choice where that range leaves no room)."""
    low = _ephemeral_low()
    for _ in range(64):
        port = random.randrange(_PORT_FLOOR, low) if low > _PORT_FLOOR + 1000 else 0
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return int(sock.getsockname()[1])
    raise OSError(f"no free port below {low} on {host}")


def _ephemeral_low() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0  # unknown: let the kernel choose


def exit_reason(code: int) -> str:
    """A Popen return code in words: "exit code 3" or "signal SIGKILL"."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


@dataclass
class Backoff:
    """Restart delays of one child: doubling while it keeps dying soon after a start."""

    first_s: float = _FIRST_BACKOFF_S
    max_s: float = _MAX_BACKOFF_S
    stable_after_s: float = _STABLE_AFTER_S
    next_s: float = _FIRST_BACKOFF_S

    def delay_after(self, ran_s: float) -> float:
        """The delay before the next start of a child that ran `ran_s` seconds."""
        if ran_s >= self.stable_after_s:
            self.next_s = self.first_s
        delay = self.next_s
        self.next_s = min(self.next_s * 2, self.max_s)
        return delay


def is_serving(address: str, timeout_s: float = 1.0) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout_s
            )
        except grpc.RpcError:
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


@dataclass
class Child:
    """One supervised service process."""

    name: str
    command: list[str]
    address: str
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    env: dict[str, str] = field(default_factory=dict)
    started_at: float = 0.0
    restarts: int = 0
    backoff: Backoff = field(default_factory=Backoff)
    restart_at: float | None = None  # when a dead child is due to start again

    def start(self) -> None:
        with open(self.log_path, "ab") as log_file:
            # A session of its own: Ctrl-C reaches the launcher only, which stops the
            # children in order.
            self.process = subprocess.Popen(
                self.command, stdout=log_file, stderr=log_file, start_new_session=True,
                env={**os.environ, **self.env} if self.env else None,
            )
        self.started_at = time.monotonic()

    def exited(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop in %.0fs: killing it", self.name, _STOP_TIMEOUT_S)
            self.process.kill()
            self.process.wait()

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class Launcher:
    """Starts, watches and stops the block service, the runner and the gateway."""

    def __init__(self, config: LaunchConfig) -> None:
        self.config = config
        self.log_dir = config.log_dir or Path(tempfile.mkdtemp(prefix="pagewire-logs-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.journal_dir = config.journal_dir or self.log_dir / "block_journal"
        self.journal_dir.mkdir(parents=True, exist_ok=True)
        self.children: list[Child] = []
        self._stop_requested = threading.Event()

    @property
    def gateway_address(self) -> str:
        return f"{self.config.host}:{self.config.port}"

    def start(self) -> None:
        """Starts the three services in dependency order; raises if one fails to come up.
        Runners start one after another: the first converts a GGUF model into the cache for
        the others, and each measures its kernels (--linear-backend auto) on quiet cores. The
        gateways, which measure nothing, start together."""
        # Only the gateway may face the network: the internal services take orders from
        # gateways alone, so they stay on loopback whatever --host says.
        host = INTERNAL_HOST
        block_address = f"{host}:{free_port(host)}"
        py = [sys.executable, "-m"]
        self._start_children([Child(
            "block_service", [*py, "block_service", "--host", host,
                              "--port", block_address.rsplit(":", 1)[1],
                              "--journal-dir", str(self.journal_dir),
                              "--nice", str(self.config.services_nice)],
            block_address, self.log_dir / "block_service.log")])
        for index in range(self.config.runners):
            port = free_port(host)
            name = "gpu_runner" if self.config.runners == 1 else f"gpu_runner-{index}"
            self._start_children([Child(
                name, [*py, "gpu_runner", "--host", host, "--port", str(port),
                       "--block-service", block_address, *self._runner_flags()],
                f"{host}:{port}", self.log_dir / f"{name}.log")])
        gateways = []
        for index in range(self.config.gateways):
            name = "gateway" if self.config.gateways == 1 else f"gateway-{index}"
            port = self.config.port + index
            gateways.append(Child(
                name, [*py, "gateway", "--host", self.config.host, "--port", str(port),
                       "--block-service", block_address,
                       "--nice", str(self.config.services_nice), *self._gateway_flags(index)],
                f"{self.config.host}:{port}", self.log_dir / f"{name}.log"))
        self._start_children(gateways)

    @property
    def gateway_addresses(self) -> list[str]:
        return [f"{self.config.host}:{self.config.port + i}" for i in range(self.config.gateways)]

    def _runner_flags(self) -> list[str]:
        c = self.config
        flags = ["--model", c.model or "default"]
        for name, value in (("--block-size", c.block_size),
                            ("--kv-cache-memory", c.kv_cache_memory),
                            ("--max-model-len", c.max_model_len), ("--dtype", c.dtype)):
            if value is not None:
                flags += [name, str(value)]
        max_loras = c.max_loras
        if max_loras is None and c.lora_modules:
            max_loras = DEFAULT_MAX_LORAS
        for name, value in (("--max-loras", max_loras), ("--max-lora-rank", c.max_lora_rank)):
            if value is not None:
                flags += [name, str(value)]
        if c.runners > 1 and "--num-threads" not in c.runner_args:
            # The runners share this machine's cores: a thread team each would oversubscribe.
            flags += ["--num-threads", str(max(1, (os.cpu_count() or 1) // c.runners))]
        return [*flags, *c.runner_args]

    @property
    def http_address(self) -> str:
        """The first gateway's HTTP API ("" when off)."""
        return f"{self.config.host}:{self.config.http_port}" if self.config.http_port else ""

    def _gateway_flags(self, index: int) -> list[str]:
        c = self.config
        flags = ["--model", c.model or "default", "--metrics-port", str(c.metrics_port)]
        if c.http_port:
            flags += ["--http-port", str(c.http_port + index)]
        if c.served_model_name:
            flags += ["--served-model-name", c.served_model_name]
        if c.override_generation_config:
            flags += ["--override-generation-config", json.dumps(c.override_generation_config)]
        for name, value in (("--generation-config", c.generation_config),
                            ("--max-num-batched-tokens", c.max_num_batched_tokens),
                            ("--max-num-seqs", c.max_num_seqs), ("--routing", c.routing)):
            if value is not None:
                flags += [name, str(value)]
        if c.lora_modules:
            flags += ["--lora-modules", *(f"{name}={path}" for name, path in c.lora_modules)]
        return flags

    def _start_children(self, children: list[Child]) -> None:
        """Starts `children` together and waits until each serves."""
        for child in children:
            log.info("starting %s on %s (log: %s)", child.name, child.address, child.log_path)
            child.start()
            self.children.append(child)
        deadline = time.monotonic() + self.config.startup_timeout_s
        waiting = list(children)
        while waiting:
            for child in list(waiting):
                code = child.exited()
                if code is not None:
                    raise RuntimeError(
                        f"{child.name} exited with {code} while starting:\n{child.log_tail()}")
                if is_serving(child.address):
                    waiting.remove(child)
            if waiting and (time.monotonic() > deadline or self._stop_requested.is_set()):
                raise RuntimeError("did not start: " + "\n".join(
                    f"{child.name}:\n{child.log_tail()}" for child in waiting))
            if waiting:
                time.sleep(0.2)

    def supervise(self) -> int:
        """Watches the children until a stop is requested, restarting one that dies (with
        backoff); returns the exit code (1 when restarts are off and a child died)."""
        while not self._stop_requested.wait(0.2):
            for child in self.children:
                if not self._watch(child):
                    return 1
        return 0

    def _watch(self, child: Child) -> bool:
        """One look at a child: notices a death, restarts when due. False: give up."""
        if child.restart_at is not None:
            if time.monotonic() >= child.restart_at:
                self._restart(child)
            return True
        code = child.exited()
        if code is None:
            return True
        ran_s = time.monotonic() - child.started_at
        log.error("%s died (%s) after %.1f s:\n%s", child.name, exit_reason(code), ran_s,
                  child.log_tail())
        if not self.config.restart:
            return False
        delay = child.backoff.delay_after(ran_s)
        log.warning("restarting %s on %s in %.1f s", child.name, child.address, delay)
        child.restart_at = time.monotonic() + delay
        return True

    def _restart(self, child: Child) -> None:
        child.restart_at = None
        child.restarts += 1
        log.info("starting %s again (restart %d)", child.name, child.restarts)
        child.start()

    def request_stop(self) -> None:
        self._stop_requested.set()

    def stop(self) -> None:
        """Stops the gateway first, then the runner and the block service."""
        for child in reversed(self.children):
            child.stop()
        log.info("stopped (logs in %s)", self.log_dir)

    def install_signal_handlers(self) -> None:
        def handle(signum: int, _frame: FrameType | None) -> None:
            log.info("signal %d: stopping all services", signum)
            self.request_stop()

        signal.signal(signal.SIGINT, handle)
        signal.signal(signal.SIGTERM, handle)


# What the banner suggests: questions the default model answers in sentences, through its chat
# template (checked against transformers by tests/e2e/test_cli_e2e.py).
BANNER_PROMPTS = {
    "generate": "Give me three tips for staying healthy.",
    "grpcurl": "What is the capital of France?",
    "curl": "Explain what a GPU is in one sentence.",
}


def serving_banner(address: str, http_address: str = "", model: str = "") -> str:
    """Where pagewire listens and how to reach it: commands to paste (`model`: the served
    model's name, for the HTTP API's `model` field)."""
    grpc_body = json.dumps({"messages": {"messages": [
        {"role": "user", "content": BANNER_PROMPTS["grpcurl"]}]}})
    lines = [
        f"pagewire is serving {model or 'its model'} on {address} "
        "(gRPC: pagewire.gateway.v1.GenerationService)",
        f"  try:  pagewire generate --address {address} {shlex.quote(BANNER_PROMPTS['generate'])}",
        f"        pagewire chat --address {address}",
        f"        grpcurl -plaintext -d {shlex.quote(grpc_body)} {address} "
        "pagewire.gateway.v1.GenerationService/Generate",
    ]
    if http_address:
        http_body = json.dumps({**({"model": model} if model else {}), "messages": [
            {"role": "user", "content": BANNER_PROMPTS["curl"]}]})
        lines += [
            f"  OpenAI-compatible HTTP API on http://{http_address}/v1 (docs/api.md):",
            f"        curl http://{http_address}/v1/chat/completions "
            f"-H 'Content-Type: application/json' -d {shlex.quote(http_body)}",
        ]
    return "\n".join([*lines, "  Ctrl-C stops every service."])
