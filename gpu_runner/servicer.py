"""pagewire.runner.v1.RunnerService over a ModelRunner: a thin translation to and from protobuf.

- Info: the runner's description (UNAVAILABLE until the model is loaded).
- Execute: FAILED_PRECONDITION for another epoch; INVALID_ARGUMENT for a malformed batch
  (nothing written); a retried (client_id, step_id) gets its first answer again. One lock
  serialises batches: the KV cache has one writer. Batches run on one dedicated thread, not on
  whichever gRPC worker took the call: torch's OpenMP thread team belongs to the OS thread that
  opens a parallel region, so forwards started from ever-different threads would each bring up
  (and leave spinning) a team of their own on a machine with no core to spare.
- After a batch, that thread polls for the next one for up to `idle_poll_s` (yielding its core
  to anyone who wants it) before it blocks. Between two batches the gateway needs ~8 ms (its
  Step, the stream sends, the next request); on the 2-core VM this was measured on, a forward
  that follows an idle gap that long is ~7 % slower than one that follows busy time
  (docs/gpu_runner.md has the measurements, and how far the polling recovers it).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

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


class RetryCache:
    """The last answer per client, so that a retried step is not executed twice."""

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

    def store(self, client_id: str, step_id: int, answer: runner_pb2.ExecuteResponse) -> None:
        if not client_id:
            return
        self._last[client_id] = (step_id, answer)
        self._last.move_to_end(client_id)
        while len(self._last) > self.capacity:
            self._last.popitem(last=False)


# How long the forward thread polls for the next batch before it blocks (`--idle-poll-ms`).
IDLE_POLL_S = 0.05


class RunnerServicer(runner_pb2_grpc.RunnerServiceServicer):
    """Serves Info and Execute for the runner set with set_runner (None while loading)."""

    def __init__(self, runner: ModelRunner | None = None,
                 recorder: BatchRecorder | None = None, idle_poll_s: float = IDLE_POLL_S) -> None:
        self._runner = runner
        self._lock = threading.Lock()
        self._retries = RetryCache()
        self._recorder = recorder
        self._forward_thread = ThreadPoolExecutor(max_workers=1,
                                                  thread_name_prefix="runner-forward")
        self._idle_poll_s = idle_poll_s
        self._batch_coming = False  # a batch is submitted or about to be: the poll stops
        self._closed = False

    def close(self) -> None:
        """Ends a poll in progress and stops the forward thread (after the batch it runs)."""
        self._closed = True
        self._forward_thread.shutdown(wait=True)

    def _poll_for_next_batch(self) -> None:
        """Keeps the forward thread's core busy until the next batch or the deadline;
        sched_yield gives the core to any other runnable thread meanwhile."""
        deadline = time.perf_counter() + self._idle_poll_s
        while not (self._batch_coming or self._closed) and time.perf_counter() < deadline:
            os.sched_yield()

    def set_runner(self, runner: ModelRunner) -> None:
        self._runner = runner

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
        received = time.perf_counter()
        runner = self._loaded(context)
        if request.epoch != runner.epoch:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"batch built for epoch {request.epoch}, the runner's is {runner.epoch} "
                "(its KV cache was lost: rebuild the sequences)",
            )
        with self._lock:
            try:
                cached = self._retries.lookup(request.client_id, request.step_id)
                if cached is not None:
                    return cached
                if not context.is_active():
                    # The caller gave up (deadline or cancel) while waiting for the lock.
                    context.abort(grpc.StatusCode.CANCELLED, "the call ended before execution")
                batch = ExecuteBatch.from_proto(request)
                result = self._execute_on_forward_thread(runner, batch)
            except BatchError as error:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
            except WorkerLostError as error:
                context.abort(grpc.StatusCode.UNAVAILABLE, f"runner lost a worker: {error}")
            except (RuntimeError, MemoryError) as error:
                # E.g. out of memory in the forward: report it, keep serving.
                log.exception("execute failed")
                context.abort(grpc.StatusCode.INTERNAL, f"execute failed: {error}")
            answer = to_response(result, runner.epoch, received)
            self._retries.store(request.client_id, request.step_id, answer)
            if self._recorder is not None:
                self._recorder.write(request)
            return answer

    def _execute_on_forward_thread(self, runner: ModelRunner, batch: ExecuteBatch
                                   ) -> ExecuteResult:
        """Runs the batch on the forward thread (Execute holds the lock: one at a time), then
        leaves that thread polling for the next one."""
        self._batch_coming = True  # ends a poll in progress: the batch is queued behind it
        try:
            result = self._forward_thread.submit(runner.execute, batch).result()
        finally:
            self._batch_coming = False
        if self._idle_poll_s > 0:
            self._forward_thread.submit(self._poll_for_next_batch)
        return result


def to_response(result: ExecuteResult, epoch: int, received: float) -> runner_pb2.ExecuteResponse:
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
    response.total_ms = (time.perf_counter() - received) * 1e3
    return response


def register_handlers(servicer: RunnerServicer) -> grpc.GenericRpcHandler:
    """The RunnerService methods; a request that does not parse gets INVALID_ARGUMENT."""
    return lenient_handlers(servicer, SERVICE, runner_pb2)
