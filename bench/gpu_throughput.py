"""Offline throughput on nano-vLLM's workload with a random-weight model shaped like Qwen3-0.6B.

Workload (nano-vLLM's bench.py): 256 sequences, random prompts of 100-1024 tokens, outputs of
100-1024 tokens, ignore_eos, everything submitted at once. Figures: output tokens/s of
- the runner alone: an in-process driver (continuous batching, prefill-first, at most
  --max-num-batched-tokens per prefill step) calling ModelRunner.execute;
- all three services: block_service, gpu_runner and gateway as processes (`pagewire serve`'s
  launcher), the requests streamed through the gateway.

The model is built from a config (28 layers, hidden 1024, 16 heads, 8 kv heads, head_dim 128,
intermediate 3072, vocab 151936, tied embeddings) with random weights: nothing is downloaded.

    python bench/gpu_throughput.py                 # on a GPU (about 2-4 minutes on an H200)
    python bench/gpu_throughput.py --tiny          # a tiny model and few sequences, on CPU
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import shutil
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
# Same vocabulary (so the gateway path sees the same ids), a few small layers.
TINY = {**QWEN3_0_6B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "max_position_embeddings": 4096}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@dataclass(frozen=True)
class Workload:
    """nano-vLLM's bench: prompt token ids and output lengths."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(num_seqs: int, input_range: tuple[int, int], output_range: tuple[int, int],
                  seed: int = 0) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(*input_range))]
               for _ in range(num_seqs)]
    outputs = [rng.randint(*output_range) for _ in range(num_seqs)]
    return Workload(prompts, outputs)


def write_model(folder: Path, config: dict[str, Any], device: str) -> Path:
    """A random-weight Qwen3 folder (config.json, model.safetensors, tokenizer files)."""
    import transformers

    from common.model_store import resolve_model

    folder.mkdir(parents=True, exist_ok=True)
    hf_config = transformers.Qwen3Config(**{k: v for k, v in config.items()
                                            if k not in ("architectures", "model_type")})
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    with torch.device(device):
        model = transformers.Qwen3ForCausalLM(hf_config).to(dtype).eval()  # type: ignore[arg-type]
    model.save_pretrained(folder)
    del model
    source = resolve_model(None)  # the default model's tokenizer: the gateway needs one
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, folder / name)
    return folder


# ---- the runner alone ----


def run_in_process(folder: Path, workload: Workload, args: argparse.Namespace
                   ) -> tuple[float, str]:
    """Output tokens/s of ModelRunner.execute driven by a continuous-batching loop, and the
    attention backend the runner chose."""
    from gpu_runner.runner import ModelRunner, RunnerOptions
    from tests.helpers.paged_driver import PagedDriver

    runner = ModelRunner(RunnerOptions(
        model=str(folder), device=args.device, block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        attention_backend=args.attention_backend, enforce_eager=args.enforce_eager))
    print(f"runner: {runner.info()}", flush=True)
    driver = PagedDriver(lambda batch: runner.execute(batch).token_ids, runner.block_size,
                         runner.num_blocks)
    _warm_up(driver)
    start = time.perf_counter()
    produced = _drive(driver, workload, args.max_num_batched_tokens, args.max_num_seqs)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    assert produced == workload.output_tokens, (produced, workload.output_tokens)
    backend = runner.info().attention_backend
    runner.close()
    return produced / seconds, backend


def _warm_up(driver: Any) -> None:
    seqs = [driver.add([1] * 64) for _ in range(4)]
    for _ in range(3):
        driver.step(seqs)
    for seq in seqs:
        driver.free(seq)


def _drive(driver: Any, workload: Workload, max_batched_tokens: int, max_seqs: int) -> int:
    """Prefill-first continuous batching (like nano-vLLM's scheduler); returns the number of
    output tokens produced. A sequence is admitted only when blocks for its whole life are
    free (no preemption here)."""
    waiting = deque(zip(workload.prompts, workload.output_lens, strict=True))
    running: list[tuple[Any, int]] = []
    produced = 0
    while waiting or running:
        admitted: list[tuple[Any, int]] = []
        budget = max_batched_tokens
        spare = len(driver.pool.free) - sum(
            _blocks_for_life(driver, seq.prompt_len, n) - len(seq.table) for seq, n in running)
        while waiting and len(running) + len(admitted) < max_seqs:
            prompt, output_len = waiting[0]
            needed = _blocks_for_life(driver, len(prompt), output_len)
            if len(prompt) > budget or needed > spare:
                break
            waiting.popleft()
            budget -= len(prompt)
            spare -= needed
            admitted.append((driver.add(prompt), output_len))
        if not admitted and not running:
            raise RuntimeError("the KV cache cannot hold the next sequence")
        step = admitted or running
        driver.step([seq for seq, _ in step])
        produced += len(step)
        running.extend(admitted)
        for seq, n in running:
            if len(seq.generated) >= n:
                driver.free(seq)
        running = [(seq, n) for seq, n in running if len(seq.generated) < n]
    return produced


def _blocks_for_life(driver: Any, prompt_len: int, output_len: int) -> int:
    return -(-(prompt_len + output_len) // driver.block_size)


# ---- all three services ----


def run_services(folder: Path, workload: Workload, args: argparse.Namespace) -> float:
    from bench.timing import run_workload
    from bench.workloads import BenchRequest
    from gateway.launcher import LaunchConfig, Launcher, free_port

    runner_args = ["--device", args.device, "--attention-backend", args.attention_backend,
                   "--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    if args.enforce_eager:
        runner_args.append("--enforce-eager")
    log_dir = Path(tempfile.mkdtemp(prefix="pagewire-gpu-bench-"))
    launcher = Launcher(LaunchConfig(
        model=str(folder), port=free_port(), block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        runner_args=runner_args, log_dir=log_dir))
    requests = [BenchRequest(prompt, n) for prompt, n in
                zip(workload.prompts, workload.output_lens, strict=True)]
    try:
        launcher.start()
        run_workload(launcher.gateway_address, requests[:4])  # warm-up
        summary = run_workload(launcher.gateway_address, requests)
    finally:
        launcher.request_stop()
        launcher.stop()
    if summary.errors:
        first = next(t.error for t in summary.timings if t.error)
        raise RuntimeError(f"{summary.errors} requests failed, e.g. {first} (logs: {log_dir})")
    return summary.output_tokens / summary.seconds


def _release_memory(device: str) -> None:
    """Frees the in-process runner's GPU memory before the services start."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny model, 8 short sequences")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--num-seqs", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--kv-cache-memory", type=int, default=None,
                        help="KV cache bytes (default 56 GiB on CUDA: the whole workload "
                             "fits, and the services' runner does not count on this "
                             "process's memory being free)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--max-num-seqs", type=int, default=512)
    parser.add_argument("--skip-services", action="store_true")
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args(argv)
    if args.tiny:
        args.num_seqs = args.num_seqs or 8
        args.block_size = 16 if args.block_size == 256 else args.block_size
        args.kv_cache_memory = args.kv_cache_memory or (64 << 20)
        args.max_model_len = 512
    elif args.kv_cache_memory is None and args.device.startswith("cuda"):
        args.kv_cache_memory = 56 << 30
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tiny:
        workload = make_workload(args.num_seqs, (10, 60), (5, 30))
    else:
        workload = make_workload(args.num_seqs or 256, (100, 1024), (100, 1024))
    model_dir = args.model_dir or Path(tempfile.mkdtemp(prefix="pagewire-qwen3-shape-"))
    figures: dict[str, Any] = {"device": args.device, "sequences": len(workload.prompts),
                               "output_tokens": workload.output_tokens,
                               "attention_backend": args.attention_backend,
                               "block_size": args.block_size}
    try:
        write_model(model_dir, TINY if args.tiny else QWEN3_0_6B, args.device)
        figures["runner_tok_s"], figures["attention_backend"] = run_in_process(
            model_dir, workload, args)
        print(f"runner alone (in-process driver): {figures['runner_tok_s']:,.0f} output tok/s",
              flush=True)
        _release_memory(args.device)
        if not args.skip_services:
            figures["services_tok_s"] = run_services(model_dir, workload, args)
            print(f"through all three services:       "
                  f"{figures['services_tok_s']:,.0f} output tok/s", flush=True)
    finally:
        if args.model_dir is None:
            shutil.rmtree(model_dir, ignore_errors=True)
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2))
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    np.set_printoptions(linewidth=120)
    sys.exit(main())
