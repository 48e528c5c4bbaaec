"""Runner benchmark: pagewire's runner core next to transformers on the same shapes, same run.

- decode: time of one decode step at batch 1, 8, 32, 64 with context 256 (pagewire: one
  Execute of the runner core, validation and greedy sampling included; transformers: one
  forward with its DynamicCache plus an argmax);
- prefill: tokens/s for 8 prompts of 256 tokens in one batch (transformers: one padded-free
  [8, 256] forward with logits_to_keep=1, as generate does).

Like with like: both sides compute logits only where a token is sampled (transformers'
decode forward has one position per sequence; its prefill uses logits_to_keep=1), both run
the same dtype on the same threads, and both are timed alternately in the same process (median of
the steps) so that both see the same machine load. Our side includes validation, batch
building and greedy sampling; theirs only the forward and an argmax. `--linear-backend`
(default auto: MKL-packed weights for the row counts where they measured faster at start)
is printed in the header; `--linear-backend plain` measures without them. `--dtype` (float32
or bfloat16) is the dtype of both sides: weights, activations and KV cache.

After the table, the roofline (bench/roofline.py): the machine's GEMM peak for the dtype and
its memory bandwidth are measured once at start, and pagewire's batch-1 decode step (which
reads every weight for one token: bandwidth-bound) and its prefill (compute-bound) are each
put against them: achieved GB/s and GFLOP/s, and the fraction of the roofline bound reached.

Default model (SmolLM2-135M-Instruct), float32, CPU. Usage: .venv/bin/python bench/runner.py
[--batches 1 8 32 64] [--context 256] [--steps 7] [--model PATH] [--linear-backend auto]
[--dtype float32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import roofline
from common.model_store import resolve_model
from gpu_runner.batch import ExecuteBatch
from gpu_runner.config import ModelConfig, load_model_config
from gpu_runner.kv_cache import bytes_per_block
from gpu_runner.layers.linear import LINEAR_BACKENDS
from gpu_runner.runner import ModelRunner, RunnerOptions

BLOCK_SIZE = 16


@dataclass
class Row:
    shape: str
    ours: float
    theirs: float
    unit: str  # "ms" (lower is better) or "tok/s" (higher is better)

    @property
    def ratio(self) -> float:
        """ours relative to transformers: time ratio for ms, speed-up for tok/s."""
        return self.ours / self.theirs


def batch_for(prompts: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
              tables: np.ndarray) -> ExecuteBatch:
    """Sequences i compute prompts[i, starts[i]:starts[i]+lengths[i]]; sequence i owns blocks
    tables[i] (contiguous per sequence)."""
    n = len(lengths)
    positions = [np.arange(s, s + c) for s, c in zip(starts, lengths, strict=True)]
    slots = np.concatenate([tables[i][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                            for i, p in enumerate(positions)])
    needed = -(-(starts + lengths) // BLOCK_SIZE)
    return ExecuteBatch(
        num_new_tokens=lengths.astype(np.int64),
        start_positions=starts.astype(np.int64),
        token_ids=np.concatenate([prompts[i, p] for i, p in enumerate(positions)]),
        slot_mapping=slots,
        block_table_lens=needed,
        block_tables=np.concatenate([tables[i, :k] for i, k in enumerate(needed)]),
        do_sample=np.ones(n, dtype=bool),
        temperatures=np.zeros(n, dtype=np.float32),
        top_ps=np.ones(n, dtype=np.float32),
        top_ks=np.zeros(n, dtype=np.int64),
        min_ps=np.zeros(n, dtype=np.float32),
        seeds=np.zeros(n, dtype=np.uint64),
    )


def interleaved_ms(ours: Callable[[], None], theirs: Callable[[], None],
                   repeats: int) -> tuple[float, float]:
    """Median ms of each, measured alternately so that both see the same machine load."""
    ours()  # warm-up
    theirs()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for run, sink in ((ours, times[0]), (theirs, times[1])):
            start = time.perf_counter()
            run()
            sink.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[0]), statistics.median(times[1])


def ours_decode_step(runner: ModelRunner, batch: int, context: int,
                     steps: int) -> Callable[[], None]:
    """Prefills `batch` random prompts of `context` tokens; returns one decode step."""
    rng = np.random.default_rng(0)
    total = context + steps + 2
    tokens = rng.integers(3, runner.config.vocab_size, size=(batch, total))
    per_seq = -(-total // BLOCK_SIZE)
    tables = np.arange(batch * per_seq).reshape(batch, per_seq)
    ones = np.ones(batch, dtype=np.int64)
    for first in range(0, batch, 8):  # prefill 8 at a time (bounded activation memory)
        rows = slice(first, min(first + 8, batch))
        count = rows.stop - rows.start
        runner.execute(batch_for(tokens[rows], np.zeros(count, np.int64),
                                 np.full(count, context), tables[rows]))
    position = [context]

    def step() -> None:
        runner.execute(batch_for(tokens, ones * position[0], ones, tables))
        position[0] += 1

    return step


def theirs_decode_step(model: Any, batch: int, context: int) -> Callable[[], None]:
    """Prefills the same shapes into a DynamicCache; returns one decode step (+ argmax)."""
    from transformers import DynamicCache

    rng = np.random.default_rng(0)
    prompts = torch.from_numpy(rng.integers(3, model.config.vocab_size, size=(batch, context)))
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        for first in range(0, batch, 8):
            rows = prompts[first:first + 8]
            # Rows are prefilled 8 at a time into per-chunk caches, then concatenated.
            chunk_cache = DynamicCache(config=model.config)
            model(input_ids=rows, past_key_values=chunk_cache, use_cache=True, logits_to_keep=1)
            _append_rows(cache, chunk_cache)
    state: dict[str, Any] = {"next": prompts[:, -1:], "position": context}

    def step() -> None:
        with torch.inference_mode():
            positions = torch.full((batch, 1), state["position"])
            result = model(input_ids=state["next"], past_key_values=cache, use_cache=True,
                           position_ids=positions)
            state["next"] = result.logits[:, -1].argmax(-1, keepdim=True)
            state["position"] += 1

    return step


def _append_rows(cache: object, chunk: object) -> None:
    """Concatenates a DynamicCache of more rows onto `cache` along the batch dimension."""
    for layer_index, layer in enumerate(chunk.layers):  # type: ignore[attr-defined]
        if len(cache.layers) <= layer_index or cache.layers[layer_index].keys is None:  # type: ignore[attr-defined]
            cache.update(layer.keys, layer.values, layer_index)  # type: ignore[attr-defined]
            continue
        target = cache.layers[layer_index]  # type: ignore[attr-defined]
        target.keys = torch.cat((target.keys, layer.keys))
        target.values = torch.cat((target.values, layer.values))


def ours_prefill(runner: ModelRunner, prompts: int, length: int) -> Callable[[], None]:
    rng = np.random.default_rng(1)
    tokens = rng.integers(3, runner.config.vocab_size, size=(prompts, length))
    per_seq = -(-length // BLOCK_SIZE)
    tables = np.arange(prompts * per_seq).reshape(prompts, per_seq)
    batch = batch_for(tokens, np.zeros(prompts, np.int64), np.full(prompts, length), tables)
    def run() -> None:
        runner.execute(batch)

    return run


def theirs_prefill(model: Any, prompts: int, length: int) -> Callable[[], None]:
    from transformers import DynamicCache

    rng = np.random.default_rng(1)
    tokens = torch.from_numpy(rng.integers(3, model.config.vocab_size, size=(prompts, length)))

    def run() -> None:
        with torch.inference_mode():
            model(input_ids=tokens, past_key_values=DynamicCache(config=model.config),
                  use_cache=True, logits_to_keep=1)

    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=7, help="timed decode steps per shape")
    parser.add_argument("--prefill-prompts", type=int, default=8)
    parser.add_argument("--prefill-len", type=int, default=256)
    parser.add_argument("--prefill-repeats", type=int, default=3)
    parser.add_argument("--linear-backend", default="auto", choices=list(LINEAR_BACKENDS))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="of both sides' weights, activations and KV cache")
    args = parser.parse_args()
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    folder = resolve_model(args.model)
    dtype = roofline.dtype_of(args.dtype)

    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype,
                                                  attn_implementation="sdpa").eval()
    max_batch = max(max(args.batches), args.prefill_prompts)
    max_len = max(args.context + args.steps + 2, args.prefill_len)
    blocks = max_batch * -(-max_len // BLOCK_SIZE)
    config = load_model_config(folder)
    # Measured before the runner is built and anything is timed (transformers' model sits idle).
    peaks = roofline.measure_peaks(config, [dtype], threads)
    cache_bytes = blocks * bytes_per_block(config, BLOCK_SIZE, dtype)
    ours = ModelRunner(RunnerOptions(model=str(folder), block_size=BLOCK_SIZE,
                                     kv_cache_memory=cache_bytes, max_model_len=max_len,
                                     num_threads=threads, linear_backend=args.linear_backend,
                                     dtype=args.dtype))
    rows = []
    for batch in args.batches:
        ours_ms, theirs_ms = interleaved_ms(
            ours_decode_step(ours, batch, args.context, args.steps),
            theirs_decode_step(theirs, batch, args.context), args.steps)
        rows.append(Row(f"decode batch {batch:>2} ctx {args.context}", ours_ms, theirs_ms, "ms"))
    tokens = args.prefill_prompts * args.prefill_len
    ours_ms, theirs_ms = interleaved_ms(
        ours_prefill(ours, args.prefill_prompts, args.prefill_len),
        theirs_prefill(theirs, args.prefill_prompts, args.prefill_len), args.prefill_repeats)
    rows.append(Row(f"prefill {args.prefill_prompts}x{args.prefill_len}",
                    tokens / ours_ms * 1e3, tokens / theirs_ms * 1e3, "tok/s"))
    print_table(rows, folder.name, args.dtype, threads, ours.linear_backend)
    for shape, policy in ours.linear_policies.items():
        print(f"  kernels for {shape.out_features}x{shape.in_features}: "
              f"{policy.describe()}")
    print_roofline(config, peaks, dtype, rows, args)
    return 0


def shape_batch(starts: list[int], lengths: list[int]) -> ExecuteBatch:
    """A batch of these shapes (token ids and blocks do not matter: counting only)."""
    longest = max(s + n for s, n in zip(starts, lengths, strict=True))
    per_seq = -(-longest // BLOCK_SIZE)
    tables = np.arange(len(lengths) * per_seq).reshape(len(lengths), per_seq)
    return batch_for(np.zeros((len(lengths), longest), np.int64), np.array(starts),
                     np.array(lengths), tables)


def print_roofline(config: ModelConfig, peaks: roofline.MachinePeaks, dtype: torch.dtype,
                   rows: list[Row], args: argparse.Namespace) -> None:
    """pagewire's batch-1 decode against the bandwidth bound, its prefill against the GEMM
    peak (the roofline takes the larger bound of each; see bench/roofline.py)."""
    print("\nroofline (bench/roofline.py), the machine:")
    for text in peaks.describe():
        print(f"  {text}")
    print("pagewire against it:")
    decode_1 = f"decode batch {1:>2} ctx {args.context}"
    for row in rows:
        if row.shape == decode_1:
            work = roofline.forward_work(config, shape_batch([args.context], [1]), dtype)
            line = roofline.roofline([work], row.ours / 1e3, peaks, dtype)
            print(f"  decode batch 1: {line.describe()}")
        elif row.unit == "tok/s":
            work = roofline.forward_work(config, shape_batch(
                [0] * args.prefill_prompts, [args.prefill_len] * args.prefill_prompts), dtype)
            seconds = args.prefill_prompts * args.prefill_len / row.ours
            line = roofline.roofline([work], seconds, peaks, dtype)
            print(f"  {row.shape}: {line.describe()}")


def print_table(rows: list[Row], model: str, dtype: str, threads: int,
                linear_backend: str) -> None:
    print(f"\nrunner benchmark: {model}, {dtype}, CPU, {threads} threads, "
          f"torch {torch.__version__}, linear backend {linear_backend}")
    print(f"{'shape':<28}{'pagewire':>12}{'transformers':>14}{'ratio':>8}  target")
    for row in rows:
        target = "<= 1.00x time" if row.unit == "ms" else ">= 1.20x tok/s"
        print(f"{row.shape:<28}{row.ours:>10.2f}{row.unit:>2}{row.theirs:>12.2f}{row.unit:>2}"
              f"{row.ratio:>7.2f}x  {target}")


if __name__ == "__main__":
    sys.exit(main())
