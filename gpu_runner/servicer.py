"""pagewire.runner.v1.RunnerService over a ModelRunner: a thin translation to and from protobuf.

- Info: the runner's description (UNAVAILABLE until the model is loaded).
- Execute: FAILED_PRECONDITION for another epoch; INVALID_ARGUMENT for a malformed batch
  (nothing written); a retried (client_id, step_id) gets its first answer again. One forward
  runs at a time (the KV cache has one writer), of every client's batch waiting then
  (gpu_runner/merging.py: several gateways' loops share the runner's batch instead of
  splitting it). A batch may leave tokens to the answer of the client's previous step
  (pending tokens): it waits its turn after that step and takes them from its stored
  answer, so the next forward starts as soon as one ends.

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
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np

from common.handlers import lenient_handlers
from gpu_runner.batch import ExecuteBatch, validate_batch
from gpu_runner.distributed import WorkerLostError
from gpu_runner.lora.manager import (
    AdapterConflictError,
    AdapterManager,
    AdapterUnknownError,
    LoadedAdapter,
)
from gpu_runner.lora.peft_format import AdapterError, AdapterNotFoundError
from gpu_runner.masks import MaskBoard
from gpu_runner.merging import BatchError, BatchMerger, PartialFailure, PendingStepError
from gpu_runner.recorder import BatchRecorder
from gpu_runner.runner import ExecuteResult, ModelRunner
from protos import runner_pb2, runner_pb2_grpc

log = logging.getLogger(__name__)

SERVICE = runner_pb2.DESCRIPTOR.services_by_name["RunnerService"]
SERVICE_NAME = SERVICE.full_name
class RunnerServicer(runner_pb2_grpc.RunnerServiceServicer):
    """Serves Info and Execute for the runner it was given or has loaded (None while loading)."""

    def __init__(self, runner: ModelRunner | None = None,
                 recorder: BatchRecorder | None = None) -> None:
        self._runner: ModelRunner | None = None
        self._merger = BatchMerger()
        if runner is not None:
            self._serve(runner)
        self._masks = MaskBoard()
        self._recorder = recorder
        self._forward_thread = ThreadPoolExecutor(max_workers=1,
                                                  thread_name_prefix="runner-forward")

    def close(self) -> None:
        """Stops the forward thread (after the batch it runs)."""
        self._forward_thread.shutdown(wait=True)

    def load(self, make_runner: Callable[[], ModelRunner]) -> ModelRunner:
        """Builds the runner on the forward thread (its warm-up and tuning forwards would leave
        a second OpenMP team on any other: see the module's docstring) and serves it."""
        return self._serve(self._forward_thread.submit(make_runner).result())

    def _serve(self, runner: ModelRunner) -> ModelRunner:
        # A merged forward names at most the runner's slots' worth of adapters.
        self._merger.max_adapters = runner.info().max_loras
        self._runner = runner
        return runner

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
            max_loras=info.max_loras,
            max_lora_rank=info.max_lora_rank,
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
        if (request.after_step_id or request.masks_follow) and not request.client_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "after_step_id and masks_follow need a client_id")
        try:
            answer = self._merger.run(request, lambda own: self._check(runner, own, context),
                                      lambda merged, parts: self._forward(runner, merged, parts))
        except PendingStepError as error:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
        except BatchError as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        except WorkerLostError as error:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"runner lost a worker: {error}")
        except _CallEnded:
            context.abort(grpc.StatusCode.CANCELLED, "the call ended before execution")
        except (RuntimeError, MemoryError) as error:
            # E.g. out of memory in the forward: report it, keep serving.
            log.exception("execute failed")
            context.abort(grpc.StatusCode.INTERNAL, f"execute failed: {error}")
        if self._recorder is not None:
            self._recorder.write(request)
        return answer

    @staticmethod
    def _check(runner: ModelRunner, request: runner_pb2.ExecuteRequest,
               context: grpc.ServicerContext) -> None:
        """In the batch's turn: refuses it alone if malformed or its caller is gone."""
        if not context.is_active():
            raise _CallEnded()  # the caller gave up (deadline or cancel) while waiting
        batch = ExecuteBatch.from_proto(request)
        validate_batch(batch, runner.limits)
        runner.check_adapters(batch)

    def SupplyMasks(self, request: runner_pb2.SupplyMasksRequest,
                    context: grpc.ServicerContext) -> runner_pb2.SupplyMasksResponse:
        if not request.client_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "SupplyMasks needs a client_id")
        self._masks.put(request.client_id, request.step_id, request.masks)
        return runner_pb2.SupplyMasksResponse()

    def LoadAdapter(self, request: runner_pb2.LoadAdapterRequest,
                    context: grpc.ServicerContext) -> runner_pb2.LoadAdapterResponse:
        adapters = self._adapters(context)
        try:
            # Read on the forward thread: its torch calls would give a gRPC thread an OpenMP
            # team of its own (the module docstring); reading takes milliseconds.
            loaded = adapters.register(self._forward_thread.submit(
                adapters.read, request.name, request.path).result(), request.holder)
        except AdapterNotFoundError as error:
            context.abort(grpc.StatusCode.NOT_FOUND, str(error))
        except AdapterConflictError as error:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
        except AdapterError as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        log.info("LoRA adapter %r loaded from %s (rank %d, %s)", loaded.name, loaded.path,
                 loaded.adapter.rank, ", ".join(loaded.adapter.target_modules))
        return runner_pb2.LoadAdapterResponse(adapter=_adapter_info(loaded))

    def UnloadAdapter(self, request: runner_pb2.UnloadAdapterRequest,
                      context: grpc.ServicerContext) -> runner_pb2.UnloadAdapterResponse:
        adapters = self._adapters(context)
        try:
            # On the forward thread: the slot table changes between forwards only.
            forgotten = self._forward_thread.submit(adapters.unload, request.name,
                                                    request.holder).result()
        except AdapterUnknownError:
            context.abort(grpc.StatusCode.NOT_FOUND,
                          f"no adapter named {request.name[:140]!r} is loaded for "
                          f"{request.holder[:140]!r}")
        if forgotten:
            log.info("LoRA adapter %r unloaded", request.name)
        return runner_pb2.UnloadAdapterResponse()

    def ListAdapters(self, request: runner_pb2.ListAdaptersRequest,
                     context: grpc.ServicerContext) -> runner_pb2.ListAdaptersResponse:
        runner = self._loaded(context)
        if runner.lora is None:
            return runner_pb2.ListAdaptersResponse()
        return runner_pb2.ListAdaptersResponse(
            adapters=[_adapter_info(loaded) for loaded in runner.lora.adapters()],
            max_loras=runner.lora.max_loras, max_lora_rank=runner.lora.max_rank)

    def _adapters(self, context: grpc.ServicerContext) -> AdapterManager:
        runner = self._loaded(context)
        if runner.lora is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          "this runner serves no LoRA adapters (start it with --max-loras)")
        assert runner.lora is not None
        return runner.lora

    def _forward(self, runner: ModelRunner, merged: runner_pb2.ExecuteRequest,
                 parts: list[runner_pb2.ExecuteRequest]) -> runner_pb2.ExecuteResponse:
        started = time.perf_counter()
        failed: dict[int, BaseException] = {}

        def late_masks() -> bytes:
            return self._masks.gather(parts, runner.limits.vocab_size, failed)

        result = self._forward_thread.submit(runner.execute, ExecuteBatch.from_proto(merged),
                                             late_masks if merged.masks_follow else None
                                             ).result()
        answer = to_response(result, runner.epoch, started)
        if failed:
            raise PartialFailure(answer, failed)
        return answer


def _adapter_info(loaded: LoadedAdapter) -> runner_pb2.AdapterInfo:
    adapter = loaded.adapter
    return runner_pb2.AdapterInfo(name=loaded.name, path=loaded.path, rank=adapter.rank,
                                  target_modules=list(adapter.target_modules),
                                  digest=adapter.digest)


class _CallEnded(Exception):
    """The caller went away before its batch's turn."""


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
