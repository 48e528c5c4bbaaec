"""One runner's step loop: one block-service Step and one runner Execute per scheduling step.

A gateway runs one RunnerLoop per runner it serves (gateway/engine.py places requests on
them). Step N+1 is planned, sent to the block service and sent to the runner while step N's
forward runs: the scheduler plans N+1 from what N will have computed, a decode whose token N is
still sampling gets its position reserved in the block service (the next Step fills in the
token), and Execute N+1 leaves that token to the runner (taken from its answer to N). The
runner starts forward N+1 as soon as forward N ends; the loop then takes N's samples. Sequences
that finish at N run one step too many (their samples are dropped) and are freed a step later.

One thread owns the loop's scheduler and every request's state while the request is here.
Other threads only hand requests in (`submit`) and ask for aborts (`abort`); both wake the
loop. A second thread keeps the loop's block-service session alive and probes the runner.
When the runner's epoch changes (it restarted and lost its KV cache) or the session is lost,
the loop re-creates the pool and a session and puts every running sequence back in the queue
to be recomputed: streams go on unchanged. When the runner leaves for good, the engine
`retire`s the loop and moves its requests, to be recomputed the same way, to other runners.
Calls go through gateway/retry.py (deadlines, retries, "down" backends).
LoRA adapters (gateway/adapters.py): before each step the loop's thread loads the catalog's
adapters its runner lacks (after a reset: all of them) and unloads those taken out of the
catalog once none of its live sequences uses them any more.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from gateway import metrics
from gateway.adapters import AdapterCatalog, RunnerAdapters
from gateway.config import GatewayConfig
from gateway.delivery import Outbox
from gateway.grammar import Backend, FormatMatcher
from gateway.masking import StepMasks, step_masks
from gateway.request import Request, TokenLogprobs
from gateway.retry import (
    BLOCK_SERVICE,
    DOWN_PROBE_S,
    LOST,
    RETRYABLE,
    DependencyHealth,
    RetryPolicy,
    call_with_retry,
)
from gateway.sampled import SampledRow, take_sampled
from gateway.scheduler import Scheduler, StepOutcome, StepPlan, Work
from gateway.sequence import SeqStatus, Sequence
from gateway.step_builder import (
    ExecuteCall,
    SamplingRow,
    build_execute_request,
    build_step_request,
    parse_step_response,
    sampled_sequences,
)
from gateway.step_stream import StepStreamClient, StreamBroken
from protos import block_pb2, block_pb2_grpc, runner_pb2, runner_pb2_grpc

log = logging.getLogger(__name__)

_EXECUTE = runner_pb2.DESCRIPTOR.services_by_name["RunnerService"].methods_by_name["Execute"]
EXECUTE_METHOD = f"/{_EXECUTE.containing_service.full_name}/{_EXECUTE.name}"

_IDLE_WAIT_S = 0.5
_NO_PROGRESS_WAIT_S = 0.01

T = TypeVar("T")

@dataclass
class InFlight:
    """An Execute sent to the runner whose answer the loop has not taken yet."""

    step_id: int
    work: list[Work]
    reply: Future[runner_pb2.ExecuteResponse]
    # Its masks, when they follow it: sent once the step before has been taken.
    late_masks: StepMasks | None = None


class BackendLost(Exception):
    """The session, the pool or the runner's KV cache is gone: reset and recompute."""


@dataclass
class BackendInfo:
    """The runner's description, as the gateway serves it."""

    model: str
    architecture: str
    vocab_size: int
    eos_token_ids: list[int]
    max_model_len: int
    num_blocks: int
    block_size: int
    dtype: str
    device: str
    epoch: int
    max_loras: int = 0  # distinct LoRA adapters per batch; 0: the runner serves none

    @property
    def max_len(self) -> int:
        """Longest prompt + output: the model's limit, or what the whole pool can hold."""
        return min(self.max_model_len, self.num_blocks * self.block_size)


class RunnerLoop:
    """Schedules and runs the requests a gateway placed on one runner."""

    def __init__(self, config: GatewayConfig, pool_id: str, address: str,
                 block_channel: grpc.Channel, runner_channel: grpc.Channel,
                 catalog: AdapterCatalog | None = None) -> None:
        """`catalog`: the LoRA adapters the gateway serves (the engine's), kept loaded on
        this runner."""
        self.config = config
        self.pool_id = pool_id
        self.address = address
        self.retry = RetryPolicy.from_config(config)
        # This loop's view of its two backends; the engine combines the loops' views.
        self.health = DependencyHealth()
        self.runner_name = f"runner {address}"
        self._blocks = block_pb2_grpc.BlockServiceStub(block_channel)
        self._runner = runner_pb2_grpc.RunnerServiceStub(runner_channel)
        # Execute with the step's block tables pre-encoded (step_builder.ExecuteCall).
        self._execute_rpc = runner_channel.unary_unary(
            EXECUTE_METHOD, request_serializer=ExecuteCall.serialize,
            response_deserializer=runner_pb2.ExecuteResponse.FromString)
        self._step_stream = StepStreamClient(self._blocks, self.retry.control_timeout_s)
        self.scheduler = Scheduler(config.max_num_batched_tokens, config.max_num_seqs)
        self.adapters = RunnerAdapters(catalog or AdapterCatalog(), self._runner,
                                       self.runner_name, self.retry.control_timeout_s,
                                       holder=config.client_name)
        self.info: BackendInfo | None = None
        self._session_id = ""
        self._step_id = 0
        self._requests: dict[str, Request] = {}  # loop thread only
        # Each request's sampling row, made once when it arrives (loop thread only).
        self._sampling_rows: dict[str, SamplingRow] = {}
        # Oldest first: at most two, the one running and the one queued behind it.
        self._in_flight: deque[InFlight] = deque()  # loop thread only
        self._executor = ThreadPoolExecutor(2, thread_name_prefix="loop-execute")
        self._lock = threading.Condition()
        self._inbox: list[Request] = []
        self._aborts: set[str] = set()
        self.num_waiting = 0  # sequences the scheduler holds in its queue (read by the engine)
        self._needs_reset = False
        self._epoch_seen = 0  # a runner epoch the watcher saw that differs from info's
        self._stopping = threading.Event()
        self._loop_thread: threading.Thread | None = None
        self._keepalive_thread: threading.Thread | None = None
        self._lease_ttl_ms = config.lease_ttl_ms
        self._probe_failing_since: dict[str, float] = {}  # watcher thread only

    # ----- life cycle ----------------------------------------------------------------------

    def start(self, timeout_s: float = 300.0) -> BackendInfo:
        """Waits for the runner, creates the pool, opens a session, starts the threads."""
        self.info = self._wait_for_runner(timeout_s)
        self.scheduler.block_size = self.info.block_size
        self.scheduler.max_loras = self.info.max_loras
        self._create_pool(self.info)
        self._open_session()
        self._loop_thread = threading.Thread(target=self._run, name=f"loop {self.address}",
                                             daemon=True)
        self._keepalive_thread = threading.Thread(
            target=self._watch_backends, name=f"keepalive {self.address}", daemon=True
        )
        self._loop_thread.start()
        self._keepalive_thread.start()
        return self.info

    def stop(self) -> None:
        """Ends the loop; unfinished requests end with finish reason abort."""
        for request in self.retire():
            request.abort_outputs()
            request.flush()

    def retire(self) -> list[Request]:
        """Ends the loop and closes its session (freeing what it held); returns its
        unfinished requests with every sequence back in the state of one that holds no
        blocks, to be placed again (their tokens so far are kept: they are recomputed)."""
        self.health.set_listener(None)
        self._stopping.set()
        with self._lock:
            self._lock.notify_all()
        if self._loop_thread is not None:
            self._loop_thread.join(timeout=30)
        self._drop_in_flight()
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._step_stream.close()
        self._close_session()
        self.scheduler.reset_all()
        with self._lock:
            inbox, self._inbox = self._inbox, []
        requests = [*self._requests.values(), *inbox]
        self._requests = {}
        self._sampling_rows = {}
        return [request for request in requests if not request.closed]

    def set_health_listener(self, listener: Callable[[bool], None] | None) -> None:
        """`listener(serving)` is called now and whenever a backend goes down or comes back
        (the engine combines the loops')."""
        self.health.set_listener(listener)

    @property
    def max_loras(self) -> int:
        """Distinct adapters one batch of its runner may name (0: it serves none)."""
        return self.info.max_loras if self.info is not None else 0

    def serves_adapter(self, name: str) -> bool:
        """False when its runner refused a catalog adapter (the engine places the adapter's
        requests elsewhere when it can)."""
        return not self.adapters.failure(name)

    def unload_adapter(self, name: str) -> None:
        """The catalog dropped `name`: the loop unloads it from the runner once none of its
        sequences uses it (any thread)."""
        self.adapters.retire(name)
        with self._lock:
            self._lock.notify_all()

    @property
    def num_queued(self) -> int:
        """Requests handed in and not taken yet plus sequences waiting (any thread)."""
        return len(self._inbox) + self.num_waiting

    def _wait_for_runner(self, timeout_s: float) -> BackendInfo:
        deadline = time.monotonic() + timeout_s
        started = time.monotonic()
        while True:
            try:
                reply = self._runner.Info(runner_pb2.InfoRequest(),
                                          timeout=self.retry.control_timeout_s)
                self.health.mark_up(self.runner_name)
                return _backend_info(reply)
            except grpc.RpcError as error:
                code = error.code()  # type: ignore[attr-defined]
                # Only a runner that is not up yet (or still loading) is worth waiting for.
                if (code not in RETRYABLE or time.monotonic() > deadline
                        or self._stopping.is_set()):
                    raise
                if time.monotonic() - started >= self.retry.down_after_s:
                    self.health.mark_down(self.runner_name, f"Info: {code.name}")
                log.info("waiting for the runner: %s", code)
                time.sleep(0.2)

    def _call(self, backend: str, rpc: Callable[..., T], request: Any,
              timeout_s: float | None = None) -> T:
        """One call to a backend under the retry policy (same request on every retry)."""
        return call_with_retry(rpc, request, timeout_s or self.retry.control_timeout_s,
                               self.retry, self.health, backend, self._stopping)

    def _create_pool(self, info: BackendInfo) -> None:
        self._call(BLOCK_SERVICE, self._blocks.CreatePool, block_pb2.CreatePoolRequest(
            pool_id=self.pool_id, num_blocks=info.num_blocks,
            block_size=info.block_size, epoch=info.epoch,
        ))

    def _open_session(self) -> None:
        reply = self._call(BLOCK_SERVICE, self._blocks.OpenSession, block_pb2.OpenSessionRequest(
            client_name=self.config.client_name, lease_ttl_ms=self.config.lease_ttl_ms,
        ))
        self._session_id = reply.session_id
        self._lease_ttl_ms = reply.lease_ttl_ms or self.config.lease_ttl_ms
        self._step_id = 0
        log.info("block-service session %s (lease %d ms)", self._session_id, self._lease_ttl_ms)

    def _close_session(self) -> None:
        if not self._session_id:
            return
        try:
            self._blocks.CloseSession(
                block_pb2.CloseSessionRequest(session_id=self._session_id), timeout=5
            )
        except grpc.RpcError as error:
            log.info("closing the session: %s", error.code())  # type: ignore[attr-defined]
        self._session_id = ""

    def _watch_backends(self) -> None:
        """Renews the lease every third of it and probes the runner as often (at least every
        second): a backend that goes down (or a runner that restarts) is noticed even while
        the gateway idles. While one is down both are probed every 0.2 s, so that health
        turns SERVING soon after it is back."""
        period_s = min(1.0, self._lease_ttl_ms / 3000)
        next_due = time.monotonic() + period_s
        while not self._stopping.wait(DOWN_PROBE_S):
            now = time.monotonic()
            if now < next_due and self.health.serving:
                continue
            next_due = now + period_s
            self._keep_alive_once()
            self._probe_runner()

    def _keep_alive_once(self) -> None:
        session_id = self._session_id
        try:
            self._blocks.KeepAlive(block_pb2.KeepAliveRequest(session_id=session_id),
                                   timeout=max(1.0, self._lease_ttl_ms / 3000))
            self._probe_ok(BLOCK_SERVICE)
        except grpc.RpcError as error:
            code = error.code()  # type: ignore[attr-defined]
            if code in LOST and session_id == self._session_id:
                log.warning("session %s lost (%s): resetting", session_id, code)
                self._request_reset()
            elif code in RETRYABLE:
                self._probe_failed(BLOCK_SERVICE, "KeepAlive", code)
            else:
                log.info("keep-alive failed: %s", code)

    def _probe_runner(self) -> None:
        try:
            reply = self._runner.Info(runner_pb2.InfoRequest(), timeout=1.0)
        except grpc.RpcError as error:
            code = error.code()  # type: ignore[attr-defined]
            if code in RETRYABLE:
                self._probe_failed(self.runner_name, "Info", code)
            return
        self._probe_ok(self.runner_name)
        info = self.info
        if info is not None and reply.epoch != info.epoch:
            log.warning("runner epoch %d -> %d: its KV cache is gone", info.epoch, reply.epoch)
            with self._lock:
                self._epoch_seen = reply.epoch
                self._lock.notify_all()

    def _probe_ok(self, backend: str) -> None:
        self._probe_failing_since.pop(backend, None)
        self.health.mark_up(backend)

    def _probe_failed(self, backend: str, what: str, code: grpc.StatusCode) -> None:
        """A refused connection marks the backend down at once; a slow answer only once it
        has been slow for down_after_s (a busy backend is not a dead one)."""
        now = time.monotonic()
        since = self._probe_failing_since.setdefault(backend, now)
        if code == grpc.StatusCode.UNAVAILABLE or now - since >= self.retry.down_after_s:
            self.health.mark_down(backend, f"{what}: {code.name}")

    def _request_reset(self) -> None:
        with self._lock:
            self._needs_reset = True
            self._lock.notify_all()

    # ----- requests (any thread) -----------------------------------------------------------

    def submit(self, request: Request) -> None:
        """Hands in a request placed here (new, or moved from a runner that left): its
        WAITING sequences are queued (the engine has done the admission checks)."""
        with self._lock:
            self._inbox.append(request)
            self._lock.notify_all()

    def abort(self, request_id: str) -> None:
        """Asks the loop to end a request and free its blocks in the next step."""
        with self._lock:
            self._aborts.add(request_id)
            self._lock.notify_all()

    # ----- the loop (its own thread) --------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self._iteration()
            except Exception:  # a bug must not silently kill every stream
                log.exception("step loop of %s failed", self.address)
                try:
                    self._fail_everything(None)
                except Exception:
                    log.exception("failing the requests failed too")
                    self._stopping.wait(1.0)

    def _iteration(self) -> None:
        """Takes what came in, then runs one step (or waits for work)."""
        try:
            if self._epoch_seen:
                # Seen by the watcher; stale if the loop has already reset to it.
                seen, self._epoch_seen = self._epoch_seen, 0
                self._needs_reset |= self.info is None or seen != self.info.epoch
            if self._needs_reset:
                self._reset()
            # Before taking new requests: their adapters are judged by what the runner holds
            # once it is in step with the catalog.
            if self.adapters.sync(self._adapters_in_use):
                self._end_unservable_requests()
            self._take_inbox()
            if not self.scheduler.has_work:
                self._wait_for_work()
                return
            self._one_step()
        except BackendLost as error:
            log.warning("backend lost (%s): recomputing every running sequence", error)
            self._needs_reset = True
        except grpc.RpcError as error:
            self._fail_everything(error)

    def _wait_for_work(self) -> None:
        with self._lock:
            if (not self._inbox and not self._aborts and not self._needs_reset
                    and not self._epoch_seen):
                self._lock.wait(_IDLE_WAIT_S)

    def _adapters_in_use(self) -> set[str]:
        """The adapters of its live requests and of the Executes in flight (whose rows may
        be of requests that have just ended)."""
        with self._lock:
            used = {request.adapter for request in self._inbox}
        used.update(request.adapter for request in self._requests.values())
        for in_flight in self._in_flight:
            used.update(item.seq.adapter for item in in_flight.work)
        return used

    def _adapter_refusal(self, request: Request) -> tuple[str, str] | None:
        """Why a request's adapter cannot run here (code name, message), or None."""
        name = request.adapter
        if not name or self.adapters.is_loaded(name):
            return None
        why = self.adapters.failure(name)
        if why:
            return "FAILED_PRECONDITION", f"LoRA adapter {name!r} could not be loaded on " \
                                          f"{self.runner_name}: {why}"
        return "NOT_FOUND", f"LoRA adapter {name!r} is no longer served"

    def _end_unservable_requests(self) -> None:
        """Ends the requests whose adapter the runner does not hold (it refused it after a
        restart, or it was unloaded meanwhile): an Execute naming it would be refused whole."""
        for request in [r for r in self._requests.values() if r.adapter]:
            refusal = self._adapter_refusal(request)
            if refusal is not None:
                self._forget(request)
                self._end_request(request, "failed", refusal)

    def _take_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, set()
        for request in inbox:
            refusal = self._adapter_refusal(request)
            if refusal is not None:
                request.fail(*refusal)
                metrics.REQUESTS.labels("failed").inc()
                continue
            self._requests[request.request_id] = request
            self._sampling_rows[request.request_id] = SamplingRow.from_config(request.params)
            self.scheduler.add(seq for seq in request.sequences
                               if seq.status is SeqStatus.WAITING)
        for request_id in aborts:
            aborted = self._requests.get(request_id)
            if aborted is not None:
                self._forget(aborted)
                self._end_request(aborted, "aborted")
        self._update_gauges()

    def _forget(self, request: Request) -> None:
        metrics.ADAPTER_GENERATED_TOKENS.labels(request.adapter).inc(
            sum(seq.num_output_tokens for seq in request.sequences))
        del self._requests[request.request_id]
        del self._sampling_rows[request.request_id]

    def _end_request(self, request: Request, outcome: str,
                     error: tuple[str, str] | None = None) -> None:
        """Takes a request's sequences out (freed in the next Step) and ends its stream:
        with finish reason abort, or with the error status `error` (code name, message)."""
        for seq in request.sequences:
            if seq.status is not SeqStatus.FINISHED:
                self.scheduler.finish(seq)
        if error is None:
            request.abort_outputs()
            request.flush()
        else:
            request.fail(*error)
        metrics.REQUESTS.labels(outcome).inc()

    def _one_step(self) -> None:
        with metrics.LOOP_SECONDS.time():
            self._plan_and_run_step()

    def _plan_and_run_step(self) -> None:
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        planning_s = time.perf_counter() - started
        try:
            if plan.is_empty:
                if not self._in_flight:
                    time.sleep(_NO_PROGRESS_WAIT_S)
                self._take_in_flight(keep=0)
                return
            response = self._send_step(plan)
            started = time.perf_counter()
            results = parse_step_response(response, plan.num_ops)
            outcome = self.scheduler.apply_results(plan, results)
            # One observation per step sent: planning plus applying the answer (idle polls
            # of an empty queue are not steps).
            metrics.SCHEDULE_SECONDS.observe(planning_s + time.perf_counter() - started)
            if outcome.stale:
                raise BackendLost("the pool's epoch changed")
            self._apply_outcome(outcome)
            work = [item for item in outcome.work if item.seq.status is SeqStatus.RUNNING]
            if work:
                self._start_execute(work, list(response.copies))
            self._take_in_flight(keep=1 if work else 0)
            if not work and (plan.allocates or outcome.preempted):
                time.sleep(_NO_PROGRESS_WAIT_S)  # nothing fits yet: do not spin
        except Exception:
            self._drop_in_flight()
            self.scheduler.abandon(plan)  # every failure resets: keep the queue whole
            raise

    def _start_execute(self, work: list[Work], copies: list[block_pb2.BlockCopy]) -> None:
        """Sends the step's Execute, to run after the one in flight; tokens that one samples
        are left to the runner (rows of its answer)."""
        pending_rows: dict[Sequence, int] = {}
        after_step_id = 0
        if self._in_flight:
            previous = self._in_flight[-1]
            pending_rows = {seq: row for row, seq in enumerate(sampled_sequences(previous.work))}
            after_step_id = previous.step_id
        request = self._execute_request(work, copies, pending_rows, after_step_id)
        late_masks = self._add_masks(request.request, work, pending_rows)
        self._in_flight.append(InFlight(self._step_id, work,
                                        self._executor.submit(self._execute, request),
                                        late_masks))

    def _add_masks(self, request: runner_pb2.ExecuteRequest, work: list[Work],
                   pending_rows: Mapping[Sequence, int]) -> StepMasks | None:
        """Structured output: names the step's masked rows, with their masks when every one
        can be filled now; returns them when they must follow (a masked row's input token
        is still being sampled), to be filled and sent once it is taken (gateway/masking.py)."""
        masks = step_masks(work, self._matcher_of)
        if masks is None:
            return None
        request.mask_seq_indices.extend(masks.seq_indices)
        if any(work[i].seq in pending_rows for i in masks.seq_indices):
            request.masks_follow = True
            return masks
        request.masks = masks.fill()
        return None

    def _matcher_of(self, seq: Sequence) -> tuple[FormatMatcher, Backend] | None:
        request = self._requests.get(seq.request_id)
        if request is None or request.output_format is None:
            return None
        output = request.outputs[seq.index]
        if output.matcher is None or output.finished:
            return None
        return output.matcher, request.output_format.backend

    def _send_late_masks(self) -> None:
        """Fills and sends the masks of the step in flight that waits for them (its rows'
        matchers have just taken the tokens before); the runner waits for them only before
        sampling. A failed call leaves that step to fail at the runner (and the loop to
        reset)."""
        in_flight = self._in_flight[0] if self._in_flight else None
        masks = in_flight.late_masks if in_flight is not None else None
        if in_flight is None or masks is None:
            return
        in_flight.late_masks = None
        request = runner_pb2.SupplyMasksRequest(client_id=self._session_id,
                                                step_id=in_flight.step_id, masks=masks.fill())
        call = self._runner.SupplyMasks.future(request, timeout=self.retry.control_timeout_s)
        call.add_done_callback(_log_mask_failure)

    def _take_in_flight(self, keep: int) -> None:
        """Waits for the oldest Executes until `keep` remain, and takes their samples (a
        failure raises here)."""
        while len(self._in_flight) > keep:
            in_flight = self._in_flight.popleft()
            with metrics.EXECUTE_WAIT_SECONDS.time():
                reply = in_flight.reply.result()
            self.scheduler.on_executed(in_flight.work)
            with metrics.OUTPUT_SECONDS.time():
                self._take_samples(in_flight.work, reply)

    def _drop_in_flight(self) -> None:
        """Before a reset: lets the Executes in flight end (they write KV into blocks the reset
        hands out again) and forgets their results; their sequences are recomputed."""
        while self._in_flight:
            in_flight = self._in_flight.popleft()
            try:
                in_flight.reply.result()
            except Exception as error:  # the reset that follows deals with the cause
                log.info("an Execute in flight failed too: %s", error)

    def _send_step(self, plan: StepPlan) -> block_pb2.StepResponse:
        assert self.info is not None
        self._step_id += 1
        salts = {r.request_id: r.cache_salt for r in self._requests.values() if r.cache_salt}
        request = build_step_request(plan, self._session_id, self.pool_id,
                                     self._step_id, self.info.epoch, salts)
        # The load report routers see (block_service/registry.py).
        request.num_waiting_tokens = self._waiting_tokens()
        metrics.STEPS.inc()
        try:
            with metrics.STEP_SECONDS.time():
                try:
                    return self._step_stream.step(request)
                except StreamBroken as broken:
                    # The same request as a unary Step, under the retry policy; a failure
                    # Step answers with a status surfaces here as it would have on the stream.
                    log.debug("StepStream: %s; sending step %d as a Step", broken,
                              request.step_id)
                return self._call(BLOCK_SERVICE, self._blocks.Step, request)
        except grpc.RpcError as error:
            if error.code() in LOST:  # type: ignore[attr-defined]
                raise BackendLost(error.details()) from error  # type: ignore[attr-defined]
            raise

    def _waiting_tokens(self) -> int:
        """Prompt tokens queued here, not allocated yet and not expected to be cached."""
        with self._lock:
            queued = [(request, request.sequences[0].num_tokens) for request in self._inbox]
        for seq in self.scheduler.waiting:
            request = self._requests.get(seq.request_id)
            if request is not None:
                queued.append((request, seq.alloc_len))
        return sum(max(0, tokens - request.expected_cached_tokens) for request, tokens in queued)

    def _apply_outcome(self, outcome: StepOutcome) -> None:
        if outcome.preempted:
            metrics.PREEMPTIONS.inc(len(outcome.preempted))
            log.info("preempted %d sequence(s) for recompute", len(outcome.preempted))
        for seq, cached in outcome.newly_cached:
            request = self._requests.get(seq.request_id)
            if request is not None:
                request.cached_tokens = max(request.cached_tokens, cached)
        for seq, error in outcome.failed:
            request = self._requests.get(seq.request_id)
            if request is not None:
                self._forget(request)
                log.error("request %s failed in the block service: %s", seq.request_id, error)
                self._end_request(request, "failed", ("INTERNAL", f"block service: {error}"))
        self._update_gauges()

    def _execute_request(self, work: list[Work], copies: list[block_pb2.BlockCopy],
                         pending_rows: Mapping[Sequence, int], after_step_id: int
                         ) -> ExecuteCall:
        assert self.info is not None
        call = build_execute_request(work, copies, self.info.epoch, self._session_id,
                                     self._step_id, self._sampling_rows, pending_rows,
                                     after_step_id)
        num_tokens = len(call.request.token_ids)
        metrics.EXECUTES.inc()
        metrics.BATCH_SEQS.observe(len(work))
        metrics.BATCH_TOKENS.observe(num_tokens)
        metrics.SCHEDULED_TOKENS.inc(num_tokens)
        return call

    def _execute(self, request: ExecuteCall) -> runner_pb2.ExecuteResponse:
        """One Execute under the retry policy (on the executor thread)."""
        try:
            with metrics.EXECUTE_SECONDS.time():
                reply = self._call(self.runner_name, self._execute_rpc, request,
                                   self.retry.execute_timeout_s)
            metrics.RUNNER_SECONDS.observe(reply.total_ms / 1000)
            metrics.FORWARD_SECONDS.observe(reply.forward_ms / 1000)
            metrics.SAMPLE_SECONDS.observe(reply.sample_ms / 1000)
            return reply
        except grpc.RpcError as error:
            if error.code() in LOST:  # type: ignore[attr-defined]
                raise BackendLost(error.details()) from error  # type: ignore[attr-defined]
            raise

    def _take_samples(self, work: list[Work], reply: runner_pb2.ExecuteResponse) -> None:
        sampled = sampled_sequences(work)
        if len(reply.token_ids) != len(sampled):
            raise RuntimeError(
                f"runner returned {len(reply.token_ids)} tokens for {len(sampled)} sequences"
            )
        logprobs = _split_logprobs(reply)
        metrics.GENERATED_TOKENS.inc(len(sampled))
        rows: list[SampledRow] = []
        for i, seq in enumerate(sampled):
            request = self._requests.get(seq.request_id)
            if request is not None and seq.status is SeqStatus.RUNNING:
                rows.append(SampledRow(request, seq, reply.token_ids[i],
                                       logprobs[i] if logprobs else None))
        # Matchers first, and the next step's masks out at once: its forward is running.
        _advance_matchers(rows)
        self._send_late_masks()
        taken = take_sampled(rows)
        for seq in taken.ended:
            self.scheduler.finish(seq)
        outbox = Outbox()  # the step's messages: one wake-up per reader's event loop
        for request, due in taken.due.items():
            request.flush(outbox, due)
            if request.closed:
                self._forget(request)
                metrics.REQUESTS.labels("finished").inc()
        outbox.send()

    # ----- recovery ------------------------------------------------------------------------

    def _reset(self) -> None:
        """Starts over with the runner's current epoch and a new session; running sequences
        are recomputed from their tokens so far."""
        started = time.monotonic()
        self._drop_in_flight()
        previous = self.info
        self.info = self._wait_for_runner(self.retry.give_up_s)
        self.scheduler.block_size = self.info.block_size
        self.scheduler.max_loras = self.info.max_loras
        if previous is None or previous.epoch != self.info.epoch:
            # A new epoch is a new runner process: its adapters are gone with its memory
            # (the next sync loads the catalog's again, before any step).
            self.adapters.reset()
        self._create_pool(self.info)
        self._close_session()
        self._open_session()
        requeued = self.scheduler.reset_all()
        self._needs_reset = False
        log.info("reset at epoch %d in %.2f s: %d sequence(s) to recompute", self.info.epoch,
                 time.monotonic() - started, len(requeued))

    def _fail_everything(self, error: grpc.RpcError | None) -> None:
        """A dependency stayed down: end every request with UNAVAILABLE and start over.
        (Not while the loop is being retired: its requests move to another runner.)"""
        if self._stopping.is_set():
            return
        if error is not None:
            code = error.code()  # type: ignore[attr-defined]
            details = error.details()  # type: ignore[attr-defined]
            if code in RETRYABLE:
                message, code_name = f"backend unavailable: {details}", "UNAVAILABLE"
            else:  # the backend refused what the gateway sent: a gateway bug
                message, code_name = f"backend refused a step: {code.name}: {details}", "INTERNAL"
        else:
            message, code_name = "internal error in the gateway's step loop", "INTERNAL"
        log.error("%s: failing %d request(s)", message, len(self._requests))
        for request in list(self._requests.values()):
            self._end_request(request, "failed", (code_name, message))
        self._requests.clear()
        self._sampling_rows.clear()
        self.scheduler.reset_all()
        self.scheduler.waiting.clear()
        self._needs_reset = True
        self._stopping.wait(0.5)

    def _update_gauges(self) -> None:
        waiting = len(self.scheduler.waiting)
        self.num_waiting = waiting
        metrics.WAITING.labels(self.address).set(waiting)
        metrics.RUNNING.labels(self.address).set(len(self.scheduler.running))


def _backend_info(reply: runner_pb2.InfoResponse) -> BackendInfo:
    return BackendInfo(
        model=reply.model, architecture=reply.architecture, vocab_size=reply.vocab_size,
        eos_token_ids=list(reply.eos_token_ids), max_model_len=reply.max_model_len,
        num_blocks=reply.num_blocks, block_size=reply.block_size, dtype=reply.dtype,
        device=reply.device, epoch=reply.epoch, max_loras=reply.max_loras,
    )


def _advance_matchers(rows: list[SampledRow]) -> None:
    """Each structured output's matcher takes its token (the runner sampled it under the
    matcher's mask, so a refusal is a bug somewhere: the output then ends)."""
    for row in rows:
        output = row.request.outputs[row.seq.index]
        matcher = output.matcher
        if matcher is None or output.finished:
            continue
        if not matcher.consume(row.token_id):
            log.error("request %s: token %d is not allowed by its format: %s",
                      row.request.public_id, row.token_id, matcher.error)


def _log_mask_failure(call: Future[runner_pb2.SupplyMasksResponse]) -> None:
    error = call.exception()
    if error is not None:
        log.warning("SupplyMasks failed (the step that waits for them will fail): %s", error)


def _split_logprobs(reply: runner_pb2.ExecuteResponse) -> list[TokenLogprobs]:
    """Per sampled sequence, its logprobs (empty list when the runner sent none)."""
    if not reply.logprobs:
        return []
    result: list[TokenLogprobs] = []
    cursor = 0
    counts = list(reply.top_counts) or [0] * len(reply.logprobs)
    top_ids = list(reply.top_token_ids)
    top_lps = list(reply.top_logprobs)
    for logprob, count in zip(reply.logprobs, counts, strict=True):
        result.append(TokenLogprobs(logprob, top_ids[cursor:cursor + count],
                                    top_lps[cursor:cursor + count]))
        cursor += count
    return result

