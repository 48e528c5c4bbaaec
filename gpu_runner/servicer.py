"""pagewire.runner.v1.RunnerService over a ModelRunner: a thin translation to and from protobuf.

- Info: the runner's description (UNAVAILABLE until the model is loaded).
- Execute: FAILED_PRECONDITION for another epoch; INVALID_ARGUMENT for a malformed batch
  (nothing written); a retried (client_id, step_id) gets its first answer again. One batch
  runs at a time: the KV cache has one writer. A batch may leave tokens to the answer of
  the client's previous step (pending tokens): it waits its turn after that step (`StepGate`)
  and takes them from its stored answer, so the next forward starts as soon as one ends.

Every torch computation of the runner runs on one dedicated thread, the model's loading (its
warm-up and tuning forwards) included: libgomp gives each OS thread that opens a parallel region
a team of its own, and once a process holds more OpenMP threads than the machine has cores it
stops spinning at barriers and sleeps instead (its "throttled" spin count). A model loaded on
the main thread and run on a gRPC worker or any second thread paid that on every one of a
forward's ~300 parallel regions: W1's forward took 83-89 ms per step behind the services
against 72-74 ms with one team (2 cores, 2026-12-01; docs/gpu_runner.md).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import grpc
import numpy as np

from common.handlers import lenient_handlers
from gpu_runner.batch import BatchError, ExecuteBatch
from gpu_runner.distributed import WorkerLostError
from gpu_runner.recorder import BatchRecorder
from gpu_runner.runner import ExecuteResult, ModelRunner
from protos import runner_pb2, runner_pb2_grpc

log = logging.getLogger(__name__)

SERVICE = runner_pb2.DESCRIPTOR.services_by_name["RunnerService"]
SERVICE_NAME = SERVICE.full_name
MAX_REMEMBERED_CLIENTS = 1024
AFTER_STEP_WAIT_S = 30.0  # how long a batch waits for the step it is to run after


class StepGate:
    """One batch at a time (the KV cache has one writer), and a batch that names a step of its
    client to run after (`after_step_id`) waits until that step has had its turn: a client's
    step N+1, sent while N runs or waits behind another client's batch, never overtakes N."""

    def __init__(self, wait_s: float = AFTER_STEP_WAIT_S,
                 capacity: int = MAX_REMEMBERED_CLIENTS) -> None:
        self.wait_s = wait_s
        self.capacity = capacity
        self._changed = threading.Condition()
        self._busy = False
        self._last_turn: OrderedDict[str, int] = OrderedDict()  # client -> its last step run

    @contextmanager
    def turn(self, client_id: str, step_id: int, after_step_id: int) -> Iterator[None]:
        """Holds the runner for one batch; PendingStepError if `after_step_id` has not had
        its turn within wait_s."""
        deadline = time.monotonic() + self.wait_s
        with self._changed:
            while True:
                step_missing = self._last_turn.get(client_id, 0) < after_step_id
                if not (self._busy or step_missing):
                    break
                remaining = deadline - time.monotonic()
                if step_missing and remaining <= 0:
                    raise PendingStepError(
                        f"step {after_step_id} of client {client_id!r} has not run within "
                        f"{self.wait_s:.0f} s; this batch was to run after it")
                self._changed.wait(remaining if step_missing else None)
            self._busy = True
        try:
            yield
        finally:
            with self._changed:
                self._busy = False
                if client_id:
                    self._last_turn[client_id] = max(step_id, self._last_turn.get(client_id, 0))
                    self._last_turn.move_to_end(client_id)
                    while len(self._last_turn) > self.capacity:
                        self._last_turn.popitem(last=False)
                self._changed.notify_all()


class PendingStepError(Exception):
    """Pending tokens refer to a step that is not the client's last executed one."""


class RetryCache:
    """The last answer per client, so that a retried step is not executed twice (and the
    next step can take its pending tokens from it)."""

    def __init__(self, capacity: int = MAX_REMEMBERED_CLIENTS) -> None:
        self.capacity = capacity
        self._last: OrderedDict[str, tuple[int, runner_pb2.ExecuteResponse]] = OrderedDict()

    def lookup(self, client_id: str, step_id: int) -> runner_pb2.ExecuteResponse | None:
        """The cached answer of a retry; raises BatchError for a step older than the last."""
        if not client_id or client_id not in self._last:
            return None
        last_step, answer = self._last[client_id]
        if step_id == last_step:
            return answer
        if step_id < last_step:
            raise BatchError(
                f"step_id {step_id} of client {client_id!r} is older than its last step "
                f"{last_step} (step ids must increase)"
            )
        return None

    def fill_pending(self, request: runner_pb2.ExecuteRequest) -> None:
        """Writes the request's pending tokens into its token_ids, from the answer they refer
        to, and clears the pending columns (so that a recording replays as it ran)."""
        indices, rows = request.pending_token_indices, request.pending_sample_rows
        if not indices and not rows:
            return
        if len(indices) != len(rows):
            raise BatchError(f"pending_token_indices has {len(indices)} entries but "
                             f"pending_sample_rows {len(rows)}")
        if not request.after_step_id:
            raise BatchError("pending tokens need an after_step_id (the step that samples them)")
        last_step, answer = self._last.get(request.client_id, (None, None))
        if answer is None or last_step != request.after_step_id:
            raise PendingStepError(
                f"pending tokens come from step {request.after_step_id}; the last step "
                f"answered for client {request.client_id!r} is {last_step}")
        sampled = answer.token_ids
        if max(indices) >= len(request.token_ids) or len(set(indices)) != len(indices):
            raise BatchError("pending_token_indices must be distinct indices into token_ids")
        if max(rows) >= len(sampled):
            raise BatchError(f"pending_sample_rows names row {max(rows)}; step "
                             f"{last_step} sampled {len(sampled)} tokens")
        tokens = request.token_ids
        for index, row in zip(indices, rows, strict=True):
            tokens[index] = sampled[row]
        request.ClearField("pending_token_indices")
        request.ClearField("pending_sample_rows")

    def store(self, client_id: str, step_id: int, answer: runner_pb2.ExecuteResponse) -> None:
        if not client_id:
            return
        self._last[client_id] = (step_id, answer)
        self._last.move_to_end(client_id)
        while len(self._last) > self.capacity:
            self._last.popitem(last=False)


class RunnerServicer(runner_pb2_grpc.RunnerServiceServicer):
    """Serves Info and Execute for the runner it was given or has loaded (None while loading)."""

    def __init__(self, runner: ModelRunner | None = None,
                 recorder: BatchRecorder | None = None) -> None:
        self._runner = runner
        self._gate = StepGate()
        self._retries = RetryCache()
        self._recorder = recorder
        self._forward_thread = ThreadPoolExecutor(max_workers=1,
                                                  thread_name_prefix="runner-forward")

    def close(self) -> None:
        """Stops the forward thread (after the batch it runs)."""
        self._forward_thread.shutdown(wait=True)

    def load(self, make_runner: Callable[[], ModelRunner]) -> ModelRunner:
        """Builds the runner on the forward thread (its warm-up and tuning forwards would leave
        a second OpenMP team on any other: see the module's docstring) and serves it."""
        self._runner = self._forward_thread.submit(make_runner).result()
        return self._runner

    def _loaded(self, context: grpc.ServicerContext) -> ModelRunner:
        if self._runner is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        assert self._runner is not None
        return self._runner

    def Info(self, request: runner_pb2.InfoRequest, context: grpc.ServicerContext
             ) -> runner_pb2.InfoResponse:
        info = self._loaded(context).info()
        return runner_pb2.InfoResponse(
            model=info.model,
            architecture=info.architecture,
            vocab_size=info.vocab_size,
            eos_token_ids=list(info.eos_token_ids),
            max_model_len=info.max_model_len,
            num_blocks=info.num_blocks,
            block_size=info.block_size,
            dtype=info.dtype,
            device=info.device,
            epoch=info.epoch,
            attention_backend=info.attention_backend,
            tensor_parallel_size=info.tensor_parallel_size,
        )

    def Execute(self, request: runner_pb2.ExecuteRequest, context: grpc.ServicerContext
                ) -> runner_pb2.ExecuteResponse:
        runner = self._loaded(context)
        if request.epoch != runner.epoch:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"batch built for epoch {request.epoch}, the runner's is {runner.epoch} "
                "(its KV cache was lost: rebuild the sequences)",
            )
        if request.after_step_id and not request.client_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "after_step_id needs a client_id")
        try:
            with self._gate.turn(request.client_id, request.step_id, request.after_step_id):
                return self._execute_in_turn(runner, request, context, time.perf_counter())
        except PendingStepError as error:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
        raise AssertionError("unreachable: abort raises")

    def _execute_in_turn(self, runner: ModelRunner, request: runner_pb2.ExecuteRequest,
                         context: grpc.ServicerContext, turn_started: float
                         ) -> runner_pb2.ExecuteResponse:
        try:
            cached = self._retries.lookup(request.client_id, request.step_id)
            if cached is not None:
                return cached
            if not context.is_active():
                # The caller gave up (deadline or cancel) while waiting for its turn.
                context.abort(grpc.StatusCode.CANCELLED, "the call ended before execution")
            self._retries.fill_pending(request)
            batch = ExecuteBatch.from_proto(request)
            result = self._forward_thread.submit(runner.execute, batch).result()
        except BatchError as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        except WorkerLostError as error:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"runner lost a worker: {error}")
        except (RuntimeError, MemoryError) as error:
            # E.g. out of memory in the forward: report it, keep serving.
            log.exception("execute failed")
            context.abort(grpc.StatusCode.INTERNAL, f"execute failed: {error}")
        answer = to_response(result, runner.epoch, turn_started)
        self._retries.store(request.client_id, request.step_id, answer)
        if self._recorder is not None:
            self._recorder.write(request)
        return answer


def to_response(result: ExecuteResult, epoch: int, turn_started: float
                ) -> runner_pb2.ExecuteResponse:
    """ExecuteResult -> ExecuteResponse (top entries flattened row by row)."""
    response = runner_pb2.ExecuteResponse(
        token_ids=result.token_ids.tolist(),
        epoch=epoch,
        forward_ms=result.forward_ms,
        sample_ms=result.sample_ms,
    )
    if result.logprobs is not None:
        response.logprobs.extend(result.logprobs.tolist())
    if result.top_counts is not None:
        response.top_counts.extend(result.top_counts.tolist())
        if result.top_token_ids is not None and result.top_logprobs is not None:
            width = result.top_token_ids.shape[1] if result.top_token_ids.ndim == 2 else 0
            keep = np.arange(width)[None, :] < result.top_counts[:, None]
            response.top_token_ids.extend(result.top_token_ids[keep].tolist())
            response.top_logprobs.extend(result.top_logprobs[keep].tolist())
    response.total_ms = (time.perf_counter() - turn_started) * 1e3
    return response


def register_handlers(servicer: RunnerServicer) -> grpc.GenericRpcHandler:
    """The RunnerService methods; a request that does not parse gets INVALID_ARGUMENT."""
    return lenient_handlers(servicer, SERVICE, runner_pb2)
