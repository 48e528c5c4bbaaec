"""Decode attention on the CPU: the torch path (gather + SDPA) against the C++ paged kernel.

SmolLM2-135M shapes (9 heads, 3 KV heads, head_dim 64, block size 16), 30 layers' worth of
calls per timed run, on real AttentionMetadata with shuffled block ids. Both paths run in the
same process, interleaved (their order alternates); each figure is a median over runs, with
the best run in parentheses (the machine is shared: the best run is the least disturbed).
The torch path's `plan` is built once per batch outside the timing (it is per batch, not per
layer); the kernel needs no per-batch work.

    python bench/cpu_attention.py [--batches 1 8 32 64] [--contexts 256 1024] [--runs 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpu_runner.attention import cpu_decode
from gpu_runner.attention.metadata import AttentionMetadata
from gpu_runner.attention.torch_backend import TorchAttentionBackend

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, LAYERS = 9, 3, 64, 16, 30
DISTINCT_CACHES = 4  # layers cycle over a few caches so that small cases do not sit in L2


def decode_metadata(batch: int, context: int, num_blocks: int, seed: int) -> AttentionMetadata:
    """A decode step: every sequence has `context` keys (the new token's included)."""
    rng = np.random.default_rng(seed)
    per_seq = -(-context // BLOCK_SIZE)
    tables = rng.permutation(num_blocks)[: batch * per_seq].reshape(batch, per_seq)
    ctx = np.full(batch, context, dtype=np.int64)
    last = ctx - 1
    slots = tables[np.arange(batch), last // BLOCK_SIZE] * BLOCK_SIZE + last % BLOCK_SIZE
    ones = np.ones(batch, dtype=np.int64)
    return AttentionMetadata(
        positions=torch.from_numpy(last),
        slot_mapping=torch.from_numpy(slots),
        block_tables=torch.from_numpy(tables.astype(np.int64)),
        query_lens=torch.from_numpy(ones),
        context_lens=torch.from_numpy(ctx),
        query_start_locs=torch.arange(batch + 1),
        logits_indices=torch.arange(batch),
        query_lens_host=ones,
        context_lens_host=ctx,
        block_table_lens_host=np.full(batch, per_seq, dtype=np.int64),
        block_size=BLOCK_SIZE,
    )


def timed_ms(run: Callable[[], object], runs: list[float]) -> None:
    start = time.perf_counter()
    run()
    runs.append((time.perf_counter() - start) * 1e3)


def bench_case(batch: int, context: int, threads: int, num_runs: int
               ) -> tuple[list[float], list[float]]:
    torch.set_num_threads(threads)
    num_blocks = batch * -(-context // BLOCK_SIZE) + 8
    caches = [torch.randn(2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
              for _ in range(DISTINCT_CACHES)]
    meta = decode_metadata(batch, context, num_blocks, seed=batch * 7919 + context)
    query = torch.randn(batch, HEADS, HEAD_DIM)
    backend = TorchAttentionBackend(HEADS, KV_HEADS, HEAD_DIM)
    plan = backend.plan(meta)
    assert plan.decode is not None

    def torch_path() -> None:
        for layer in range(LAYERS):
            backend._decode(query, caches[layer % DISTINCT_CACHES], plan.decode)

    def kernel_path() -> None:
        for layer in range(LAYERS):
            cache = caches[layer % DISTINCT_CACHES]
            cpu_decode.paged_decode_attention(query, cache[0], cache[1], meta.block_tables,
                                              meta.context_lens, backend.scale)

    expected = backend._decode(query, caches[0], plan.decode)
    got = cpu_decode.paged_decode_attention(query, caches[0][0], caches[0][1],
                                            meta.block_tables, meta.context_lens, backend.scale)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    torch_path(), kernel_path()  # warm-up
    torch_runs: list[float] = []
    kernel_runs: list[float] = []
    for run in range(num_runs):
        pair = [(torch_path, torch_runs), (kernel_path, kernel_runs)]
        for fn, runs in pair if run % 2 == 0 else reversed(pair):
            timed_ms(fn, runs)
    return torch_runs, kernel_runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    start = time.perf_counter()
    if not cpu_decode.available():
        sys.exit("the C++ kernel is unavailable (see the warning above)")
    print(f"kernel ready in {time.perf_counter() - start:.1f} s; "
          f"{LAYERS} layers per run, {args.runs} runs: median (and best) ms")
    print(f"{'threads':>7} {'batch':>5} {'context':>7} {'torch':>18} {'kernel':>18} "
          f"{'speedup':>8} {'best':>6}")
    for threads in args.threads:
        for context in args.contexts:
            for batch in args.batches:
                torch_runs, kernel_runs = bench_case(batch, context, threads, args.runs)
                torch_ms, kernel_ms = (statistics.median(x) for x in (torch_runs, kernel_runs))
                torch_best, kernel_best = min(torch_runs), min(kernel_runs)
                print(f"{threads:>7} {batch:>5} {context:>7} {torch_ms:>9.2f} "
                      f"({torch_best:>6.2f}) {kernel_ms:>9.2f} ({kernel_best:>6.2f}) "
                      f"{torch_ms / kernel_ms:>7.2f}x {torch_best / kernel_best:>5.2f}x",
                      flush=True)


if __name__ == "__main__":
    main()
