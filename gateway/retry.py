"""Calls to the backends under deadlines and retries, and which backends are down.

Every call has a deadline; a call that times out or finds its peer unavailable is retried with
the same request (same session, step id and epoch: Step and Execute are idempotent by step
id), so a block service restarted from its journal, or a slow call, changes nothing. A backend
failing for a while is "down": its runner loop's health turns NOT_SERVING; running requests
wait up to the backend-down timeout, then fail with UNAVAILABLE. See docs/reliability.md.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from gateway.config import GatewayConfig

log = logging.getLogger(__name__)

RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# The session or pool is gone, or the runner restarted: recover by starting over.
LOST = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND)
_FIRST_RETRY_DELAY_S = 0.05
_MAX_RETRY_DELAY_S = 0.5  # a restarted peer is picked up within half a second
# Control calls (Step, KeepAlive, CreatePool, ...) are short: a lost one is retried after
# this long at most. Execute gets the whole rpc_timeout_s (a long prefill on a CPU is slow).
_CONTROL_TIMEOUT_S = 10.0
# A dependency failing for this long is "down": health NOT_SERVING, new requests UNAVAILABLE.
_DOWN_AFTER_S = 1.0
DOWN_PROBE_S = 0.2  # how often a backend that is down is probed
# How long running requests wait for a dependency to come back before they fail.
DEFAULT_BACKEND_DOWN_TIMEOUT_S = 30.0
BACKEND_DOWN_TIMEOUT_ENV = "PAGEWIRE_GATEWAY_BACKEND_DOWN_TIMEOUT_S"
RPC_TIMEOUT_ENV = "PAGEWIRE_GATEWAY_RPC_TIMEOUT_S"
BLOCK_SERVICE = "block service"
RUNNER = "runner"

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """Deadlines of the calls to the block service and the runner, and how long to wait for
    one of them to come back."""

    execute_timeout_s: float = 120.0  # one Execute
    control_timeout_s: float = _CONTROL_TIMEOUT_S  # one Step, KeepAlive, CreatePool, ...
    down_after_s: float = _DOWN_AFTER_S  # failing this long: health NOT_SERVING
    give_up_s: float = DEFAULT_BACKEND_DOWN_TIMEOUT_S  # failing this long: requests fail

    @classmethod
    def from_config(cls, config: GatewayConfig,
                    environ: Mapping[str, str] | None = None) -> RetryPolicy:
        """From the config's rpc_timeout_s; PAGEWIRE_GATEWAY_RPC_TIMEOUT_S and
        PAGEWIRE_GATEWAY_BACKEND_DOWN_TIMEOUT_S override (processes started by tests and by
        `pagewire serve` set them)."""
        env = os.environ if environ is None else environ
        rpc_timeout_s = float(env.get(RPC_TIMEOUT_ENV) or config.rpc_timeout_s)
        give_up_s = float(env.get(BACKEND_DOWN_TIMEOUT_ENV) or DEFAULT_BACKEND_DOWN_TIMEOUT_S)
        if rpc_timeout_s <= 0 or give_up_s <= 0:
            raise ValueError("RPC and backend-down timeouts must be positive")
        return cls(execute_timeout_s=rpc_timeout_s,
                   control_timeout_s=min(rpc_timeout_s, _CONTROL_TIMEOUT_S),
                   down_after_s=min(_DOWN_AFTER_S, give_up_s), give_up_s=give_up_s)


class DependencyHealth:
    """Which backends are down, and since when; tells a listener when the gateway as a whole
    turns NOT_SERVING (some backend down) or SERVING again (all back)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._down: dict[str, str] = {}  # backend -> why
        self._listener: Callable[[bool], None] | None = None
        self._came_back = threading.Condition(self._lock)  # notified when one is back up

    def set_listener(self, listener: Callable[[bool], None] | None) -> None:
        with self._lock:
            self._listener = listener
            serving = not self._down
        if listener is not None:
            listener(serving)

    @property
    def serving(self) -> bool:
        return not self._down

    def problem(self) -> str:
        """Why the gateway is not serving ("" when it is)."""
        with self._lock:
            return "; ".join(f"the {name} is unreachable ({why})"
                             for name, why in sorted(self._down.items()))

    def mark_down(self, name: str, why: str) -> None:
        with self._lock:
            was_serving = not self._down
            first = name not in self._down
            self._down[name] = why
            listener = self._listener
        if first:
            log.warning("the %s is down: %s", name, why)
        if was_serving and listener is not None:
            listener(False)

    def wait_until_back(self, timeout_s: float) -> None:
        """Sleeps up to `timeout_s`, less when a backend comes back meanwhile (a retry then
        goes out at once instead of at the end of its backoff)."""
        with self._lock:
            self._came_back.wait(timeout_s)

    def mark_up(self, name: str) -> None:
        with self._lock:
            if name not in self._down:
                return
            del self._down[name]
            self._came_back.notify_all()
            now_serving = not self._down
            listener = self._listener
        log.info("the %s is back", name)
        if now_serving and listener is not None:
            listener(True)


def call_with_retry(rpc: Callable[..., T], request: Any, timeout_s: float,
                    policy: RetryPolicy | None = None, health: DependencyHealth | None = None,
                    backend: str = "", stopping: threading.Event | None = None) -> T:
    """Calls a unary RPC with a deadline, retrying THE SAME request while the peer is
    unavailable or the call timed out (every call is safe to retry: Step and Execute are
    deduplicated by (session, step id), the others are idempotent).

    Gives up after `policy.give_up_s` of failures (raising the last error); after
    `policy.down_after_s` the backend is marked down in `health` until a call succeeds.
    """
    policy = policy or RetryPolicy()
    first_failure: float | None = None
    delay = _FIRST_RETRY_DELAY_S
    while True:
        try:
            reply = rpc(request, timeout=timeout_s)
        except grpc.RpcError as error:
            code = error.code()  # type: ignore[attr-defined]
            if code not in RETRYABLE:
                raise
            now = time.monotonic()
            first_failure = now if first_failure is None else first_failure
            failing_s = now - first_failure
            if health is not None and failing_s >= policy.down_after_s:
                health.mark_down(backend, f"{code.name} for {failing_s:.1f} s")
            if failing_s >= policy.give_up_s or (stopping is not None and stopping.is_set()):
                raise
            log.info("%s call failed (%s): retrying the same request in %.2f s", backend or
                     "backend", code.name, delay)
            if health is not None:
                health.wait_until_back(delay)
            else:
                time.sleep(delay)
            delay = min(delay * 2, _MAX_RETRY_DELAY_S)
            continue
        if health is not None and backend:
            health.mark_up(backend)
        return reply  # type: ignore[no-any-return]

