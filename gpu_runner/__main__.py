"""`python -m gpu_runner --model PATH|default --port N ...`: serve a model over gRPC.

Health is NOT_SERVING (and RPCs answer UNAVAILABLE) until the model is loaded and the KV
cache allocated.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from common.log import setup_logging
from common.registration import PoolShape, Registration, add_registration_arguments
from common.server import add_server_arguments, server_options_from_args, start_server
from gpu_runner.attention.selection import BACKEND_CHOICES
from gpu_runner.layers.linear import LINEAR_BACKENDS
from gpu_runner.recorder import BatchRecorder
from gpu_runner.servicer import SERVICE_NAME, RunnerServicer, register_handlers

DEFAULT_PORT = 50052


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m gpu_runner", description=__doc__)
    add_server_arguments(parser, "runner", DEFAULT_PORT)
    env = os.environ.get
    parser.add_argument("--model", default=env("PAGEWIRE_RUNNER_MODEL", "default"),
                        help="Hugging Face folder, .gguf file, or 'default' (SmolLM2-135M)")
    parser.add_argument("--device", default=env("PAGEWIRE_RUNNER_DEVICE", "cpu"))
    parser.add_argument("--dtype", default=env("PAGEWIRE_RUNNER_DTYPE") or None,
                        choices=["float32", "bfloat16", "float16"],
                        help="default: float32 on CPU, bfloat16 on CUDA; bfloat16 on a CPU "
                             "with avx512_bf16/amx_bf16 runs the fast kernels, elsewhere plain "
                             "torch (docs/gpu_runner.md)")
    parser.add_argument("--block-size", type=int, default=int(env("PAGEWIRE_RUNNER_BLOCK_SIZE",
                                                                  "16")))
    parser.add_argument("--kv-cache-memory", type=int,
                        default=_optional_int(env("PAGEWIRE_RUNNER_KV_CACHE_MEMORY")),
                        help="KV cache bytes (default: 1 GiB on CPU; on CUDA from "
                             "--gpu-memory-utilization)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--max-model-len", type=int,
                        default=_optional_int(env("PAGEWIRE_RUNNER_MAX_MODEL_LEN")))
    parser.add_argument("--num-threads", type=int, default=None, help="CPU threads (all cores)")
    parser.add_argument("--attention-backend",
                        default=env("PAGEWIRE_RUNNER_ATTENTION_BACKEND", "auto"),
                        choices=list(BACKEND_CHOICES),
                        help="auto: flash_attn if it imports on CUDA, else triton on CUDA, "
                             "else torch")
    parser.add_argument("--linear-backend",
                        default=env("PAGEWIRE_RUNNER_LINEAR_BACKEND", "auto"),
                        choices=list(LINEAR_BACKENDS),
                        help="auto: on CPU in float32, the C++ panel kernel for 1-64 rows and "
                             "above that the fastest of MKL sgemm, MKL-packed weights and the "
                             "panels, measured per weight shape at start; panels: the panel "
                             "kernel for 1-64 rows and MKL sgemm above, unmeasured (a quicker "
                             "start); packed: MKL-packed always; plain: MKL sgemm always "
                             "(always plain on CUDA)")
    parser.add_argument("--tensor-parallel-size", type=int,
                        default=int(env("PAGEWIRE_RUNNER_TENSOR_PARALLEL_SIZE", "1")),
                        help="split the model over N processes (N GPUs; gloo on CPU)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="no CUDA graphs for decode batches")
    parser.add_argument("--max-loras", type=int,
                        default=int(env("PAGEWIRE_RUNNER_MAX_LORAS", "0")),
                        help="LoRA adapters one batch may use (slots in device memory; any "
                             "number may be loaded); 0: serve no adapters")
    parser.add_argument("--max-lora-rank", type=int,
                        default=int(env("PAGEWIRE_RUNNER_MAX_LORA_RANK", "16")),
                        help="highest LoRA rank accepted (sizes the slots)")
    parser.add_argument("--record-batches", type=Path, default=None,
                        help="append every executed ExecuteRequest to this file (benchmarks)")
    add_registration_arguments(parser)
    args = parser.parse_args(argv)
    return args


def _optional_int(value: str | None) -> int | None:
    return int(value) if value else None


def main(argv: list[str] | None = None) -> int:
    log = setup_logging("gpu_runner")
    args = parse_args(argv)
    from common.server import run_until_signal
    from gpu_runner.runner import ModelRunner, RunnerOptions

    recorder = BatchRecorder(args.record_batches) if args.record_batches else None
    servicer = RunnerServicer(recorder=recorder)
    service = start_server(
        server_options_from_args(args),
        lambda server: server.add_generic_rpc_handlers((register_handlers(servicer),)),
        [SERVICE_NAME],
        serving=False,
    )
    try:
        runner = servicer.load(lambda: ModelRunner(RunnerOptions(
            model=args.model, device=args.device, dtype=args.dtype, block_size=args.block_size,
            kv_cache_memory=args.kv_cache_memory,
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_model_len=args.max_model_len, num_threads=args.num_threads,
            attention_backend=args.attention_backend, linear_backend=args.linear_backend,
            enforce_eager=args.enforce_eager,
            tensor_parallel_size=args.tensor_parallel_size,
            max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
        )))
    except (OSError, ValueError) as error:
        log.error("cannot load the model: %s", error)
        service.stop(0)
        return 2
    service.set_serving(True)
    # A dead tensor-parallel worker: stop serving (Execute answers UNAVAILABLE).
    runner.on_failure(lambda _reason: service.set_serving(False))
    log.info("serving %s on port %d (epoch %d)", runner.folder.name, service.port, runner.epoch)
    registration = Registration.from_args(args, service.port, lambda: PoolShape(
        runner.info().num_blocks, runner.info().block_size, runner.epoch))
    if registration is not None:
        registration.start()

    def stop() -> None:
        if registration is not None:
            registration.stop()
        servicer.close()
        runner.close()

    return run_until_signal(service, on_stop=stop)


if __name__ == "__main__":
    sys.exit(main())
