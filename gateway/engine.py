"""The gateway's engine: the runners it serves, one RunnerLoop each, and where requests go.

Membership (docs/scaling.md): with `--runner` (repeatable) the gateway serves exactly those
runners and registers each with the block service while it answers Info; without it, the
gateway serves every runner registered with the block service (a runner registers itself when
started with `--block-service`). Every MEMBERSHIP_POLL_S the engine reads the live runners
(ListRunners): it starts a loop for a runner that joined, and retires the loop of one whose
lease ran out, moving its requests to the others, where they are recomputed from their tokens
so far (as after a runner restart: streams go on, nothing repeated or skipped).

Placement: a request (its n outputs together) goes to the only serving loop, or where the
block service's Route puts it among the serving loops (`--routing`: prefix, least-loaded,
round-robin). One with nowhere to go waits, up to the backend-down timeout, for a runner.

Health: SERVING while at least one loop is serving (its runner and the block service answer).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable

import grpc

from gateway import metrics
from gateway.adapters import AdapterCatalog
from gateway.config import GatewayConfig
from gateway.request import Request
from gateway.retry import RETRYABLE, RetryPolicy
from gateway.runner_loop import BackendInfo, RunnerLoop
from protos import block_pb2, block_pb2_grpc, runner_pb2, runner_pb2_grpc

log = logging.getLogger(__name__)

MEMBERSHIP_POLL_S = 0.5
# The lease a gateway asks for the runners it registers (--runner): a runner that stops
# answering Info leaves within this long, and its requests move.
RUNNER_LEASE_MS = 3000
LOOP_START_TIMEOUT_S = 10.0
ROUTING_POLICIES = {
    "prefix": block_pb2.ROUTING_POLICY_PREFIX,
    "least-loaded": block_pb2.ROUTING_POLICY_LEAST_LOADED,
    "round-robin": block_pb2.ROUTING_POLICY_ROUND_ROBIN,
}


class AdmissionError(Exception):
    """The waiting queue is full."""


class Engine:
    """Schedules and runs every request of one gateway, over every runner it serves."""

    def __init__(self, config: GatewayConfig, block_channel: grpc.Channel,
                 open_runner_channel: Callable[[str], grpc.Channel]) -> None:
        self.config = config
        self.retry = RetryPolicy.from_config(config)
        self.info: BackendInfo | None = None  # of the first runner (all serve one model)
        # The LoRA adapters served: every loop keeps its runner in step with it.
        self.adapters = AdapterCatalog()
        self._block_channel = block_channel
        self._blocks = block_pb2_grpc.BlockServiceStub(block_channel)
        self._open_runner_channel = open_runner_channel
        self._policy = ROUTING_POLICIES[config.routing]
        # --runner: pool id -> address; empty: every registered runner.
        self._static = {config.pool_id_of(address): address for address in config.runners}
        self._lock = threading.Lock()
        self._loops: dict[str, RunnerLoop] = {}  # pool id -> loop
        self._channels: dict[str, grpc.Channel] = {}  # pool id -> its runner's channel
        self._placed: dict[str, tuple[Request, RunnerLoop]] = {}  # request id ->
        self._unplaced: list[tuple[Request, float]] = []  # (request, waiting since)
        self._aborted_unplaced: dict[str, Request] = {}
        self._serving = False
        self._listener: Callable[[bool], None] | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def loops(self) -> list[RunnerLoop]:
        with self._lock:
            return list(self._loops.values())

    # ----- life cycle ----------------------------------------------------------------------

    def start(self, timeout_s: float = 300.0) -> BackendInfo:
        """Waits until one runner is served, then watches the membership."""
        deadline = time.monotonic() + timeout_s
        while self.info is None:
            # A refusal (bad credentials, a bad flag) fails the start instead of waiting.
            self._update_membership(refusals_raise=True)
            if self.info is not None:
                break
            if time.monotonic() > deadline or self._stopping.is_set():
                raise RuntimeError(f"no runner to serve after {timeout_s:.0f} s (" + (
                    f"--runner {', '.join(self._static.values())} did not answer"
                    if self._static else "none registered with the block service") + ")")
            time.sleep(0.2)
        self._thread = threading.Thread(target=self._watch_membership, name="membership",
                                        daemon=True)
        self._thread.start()
        return self.info

    def stop(self) -> None:
        """Ends every loop; unfinished requests end with finish reason abort."""
        self._listener = None  # the server is stopping: health stays NOT_SERVING
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for loop in self.loops:
            loop.stop()
        with self._lock:
            unplaced, self._unplaced = self._unplaced, []
        for request, _ in unplaced:
            request.abort_outputs()
            request.flush()
        for channel in self._channels.values():
            channel.close()

    def set_health_listener(self, listener: Callable[[bool], None] | None) -> None:
        """`listener(serving)` is called now and whenever the gateway turns SERVING (some
        loop serving) or NOT_SERVING (none); the server wires it to its health status."""
        self._listener = listener
        if listener is not None:
            listener(self._serving)

    def new_seed(self) -> int:
        return random.getrandbits(63)

    # ----- requests (any thread) -----------------------------------------------------------

    def problem(self) -> str:
        """Why the gateway cannot serve now ("" when some runner loop is serving)."""
        loops = self.loops
        if any(loop.health.serving for loop in loops):
            return ""
        if not loops:
            return "no runner is serving (" + (
                "--runner " + ", ".join(self._static.values()) + " not answering"
                if self._static else "none is registered with the block service") + ")"
        return "; ".join(loop.health.problem() for loop in loops)

    def submit(self, request: Request) -> None:
        """Places a validated request; AdmissionError when the waiting queue is full."""
        if self._stopping.is_set():
            raise AdmissionError("the gateway is shutting down")
        queued = sum(loop.num_queued for loop in self.loops) + len(self._unplaced)
        if queued >= self.config.max_waiting:
            raise AdmissionError(
                f"waiting queue full ({self.config.max_waiting} requests): retry later")
        problem = self.problem()
        if problem:
            # Not queued: no runner can take it, so the request would only hang.
            request.fail("UNAVAILABLE", f"pagewire cannot serve now: {problem}; retry later")
            metrics.REQUESTS.labels("unavailable").inc()
            return
        metrics.ADAPTER_REQUESTS.labels(request.adapter).inc()
        self._place(request)

    def abort(self, request: Request) -> None:
        """Asks the request's loop to end it and free its blocks in its next step (nothing for
        a request that has ended: the APIs call this whenever a stream closes)."""
        if request.closed:
            return
        with self._lock:
            placed = self._placed.get(request.request_id)
            if placed is None:  # between placements: _place ends it
                self._aborted_unplaced[request.request_id] = request
                return
        placed[1].abort(request.request_id)

    def _place(self, request: Request, since: float | None = None) -> None:
        """Hands a request to a serving loop, or keeps it until there is one (waiting since
        `since`: now when not given)."""
        loops = [loop for loop in self.loops if loop.health.serving]
        if request.adapter:  # not on a runner that refused its adapter, when others have it
            loops = [loop for loop in loops if loop.serves_adapter(request.adapter)] or loops
        with self._lock:
            if self._aborted_unplaced.pop(request.request_id, None) is not None:
                request.abort_outputs()
                request.flush()
                return
            if not loops:
                self._unplaced.append((request, since or time.monotonic()))
                return
        loop = loops[0] if len(loops) == 1 else self._route(request, loops)
        with self._lock:
            self._placed[request.request_id] = (request, loop)
        metrics.PLACED_REQUESTS.labels(loop.address).inc()
        loop.submit(request)

    def _route(self, request: Request, loops: list[RunnerLoop]) -> RunnerLoop:
        """The block service's choice among `loops` (the least queued one if it cannot
        answer)."""
        by_pool = {loop.pool_id: loop for loop in loops}
        first = request.sequences[0]  # prompt and what it generated before a move
        try:
            reply = self._blocks.Route(block_pb2.RouteRequest(
                client_name=self.config.client_name, token_ids=first.token_ids,
                cache_salt=request.cache_salt, policy=self._policy,  # type: ignore[arg-type]
                num_seqs=len(request.sequences), pool_ids=list(by_pool)),
                timeout=self.retry.control_timeout_s)
            chosen = by_pool.get(reply.pool_id)
            if chosen is not None:
                held = next(c for c in reply.candidates if c.pool_id == reply.pool_id)
                request.expected_cached_tokens = max(held.num_cached_tokens,
                                                     held.num_pending_tokens)
                return chosen
        except grpc.RpcError as error:
            log.warning("Route failed (%s): placing by local queue length",
                        error.code())  # type: ignore[attr-defined]
        return min(loops, key=lambda loop: loop.num_queued)

    # ----- membership (membership thread) --------------------------------------------------

    def _watch_membership(self) -> None:
        while not self._stopping.wait(MEMBERSHIP_POLL_S):
            try:
                self._update_membership()
            except Exception:  # a bug must not end membership for good
                log.exception("membership update failed")

    def _update_membership(self, refusals_raise: bool = False) -> None:
        """Registers the --runner runners, starts loops for runners that joined, retires
        those of runners that left, and places what waits for a runner."""
        for pool_id, address in self._static.items():
            self._register(pool_id, address, refusals_raise)
        try:
            reply = self._blocks.ListRunners(block_pb2.ListRunnersRequest(),
                                             timeout=self.retry.control_timeout_s)
        except grpc.RpcError as error:
            # The block service is down: the loops notice and wait for it; keep them.
            log.debug("ListRunners: %s", error.code())  # type: ignore[attr-defined]
            if refusals_raise and error.code() not in RETRYABLE:  # type: ignore[attr-defined]
                raise
            return
        live = {runner.pool.pool_id: runner.pool.address for runner in reply.runners
                if not self._static or runner.pool.pool_id in self._static}
        with self._lock:
            gone = [pool_id for pool_id in self._loops if pool_id not in live]
            joined = [pool_id for pool_id in live if pool_id not in self._loops]
        for pool_id in gone:
            self._retire(pool_id)
        for pool_id in joined:
            self._start_loop(pool_id, live[pool_id])
        self._place_unplaced()
        self._forget_finished()

    def _register(self, pool_id: str, address: str, refusals_raise: bool) -> None:
        """Registers a --runner runner (renewing its lease) if it answers Info."""
        channel = self._channel(pool_id, address)
        try:
            info = runner_pb2_grpc.RunnerServiceStub(channel).Info(
                runner_pb2.InfoRequest(), timeout=1.0)
            self._blocks.RegisterRunner(block_pb2.RegisterRunnerRequest(
                pool_id=pool_id, address=address, num_blocks=info.num_blocks,
                block_size=info.block_size, epoch=info.epoch, lease_ttl_ms=RUNNER_LEASE_MS),
                timeout=self.retry.control_timeout_s)
        except grpc.RpcError as error:
            code = error.code()  # type: ignore[attr-defined]
            if code not in RETRYABLE and refusals_raise:
                raise
            if code not in RETRYABLE:
                log.warning("registering runner %s: %s: %s", address, code.name,
                            error.details())  # type: ignore[attr-defined]

    def _channel(self, pool_id: str, address: str) -> grpc.Channel:
        channel = self._channels.get(pool_id)
        if channel is None:
            channel = self._channels[pool_id] = self._open_runner_channel(address)
        return channel

    def _start_loop(self, pool_id: str, address: str) -> None:
        loop = RunnerLoop(self.config, pool_id, address, self._block_channel,
                          self._channel(pool_id, address), self.adapters)
        try:
            info = loop.start(LOOP_START_TIMEOUT_S)
        except grpc.RpcError as error:
            log.warning("runner %s joined but does not answer (%s): next time",
                        address, error.code())  # type: ignore[attr-defined]
            loop.stop()
            return
        first = self.info
        if first is not None and (info.model, info.vocab_size, info.eos_token_ids) != (
                first.model, first.vocab_size, first.eos_token_ids):
            log.error("runner %s serves %s (vocabulary %d), not %s (%d): not serving it",
                      address, info.model, info.vocab_size, first.model, first.vocab_size)
            loop.stop()
            return
        self.info = first or info
        with self._lock:
            self._loops[pool_id] = loop
        loop.set_health_listener(lambda _serving: self._health_changed())
        log.info("serving runner %s (pool %s, %d blocks of %d)", address, pool_id,
                 info.num_blocks, info.block_size)

    def _retire(self, pool_id: str) -> None:
        """The runner left: its loop ends and its requests are placed again."""
        with self._lock:
            loop = self._loops.pop(pool_id)
            # Aborts from here on wait for the request's next placement.
            for request_id in [key for key, (_, at) in self._placed.items() if at is loop]:
                del self._placed[request_id]
        requests = loop.retire()
        log.warning("runner %s left: moving %d request(s) to %d other runner(s)",
                    loop.address, len(requests), len(self._loops))
        metrics.MOVED_REQUESTS.inc(len(requests))
        self._health_changed()
        for request in requests:
            self._place(request)

    def _place_unplaced(self) -> None:
        with self._lock:
            unplaced, self._unplaced = self._unplaced, []
        now = time.monotonic()
        for request, since in unplaced:
            if request.closed:
                continue
            if now - since > self.retry.give_up_s:
                request.fail("UNAVAILABLE", f"no runner to serve it for "
                                            f"{self.retry.give_up_s:.0f} s")
                metrics.REQUESTS.labels("failed").inc()
                continue
            self._place(request, since)

    def _forget_finished(self) -> None:
        with self._lock:
            for request_id in [key for key, (request, _) in self._placed.items()
                               if request.closed]:
                del self._placed[request_id]
            # An abort that raced the request's end would otherwise stay here for good.
            for request_id in [key for key, request in self._aborted_unplaced.items()
                               if request.closed]:
                del self._aborted_unplaced[request_id]

    def _health_changed(self) -> None:
        serving = any(loop.health.serving for loop in self.loops)
        if serving == self._serving:
            return
        self._serving = serving
        listener = self._listener
        if listener is not None:
            listener(serving)
