"""Attention on the CPU: the torch path (gather/pad + SDPA) against the C++ paged kernel.

Two kinds of batch: decode (every sequence has one new token after `context - 1` cached ones)
and prefill (every sequence is a fresh prompt of `context` tokens). SmolLM2-135M shapes
(9 heads, 3 KV heads, head_dim 64, block size 16), 30 layers' worth of calls per timed run, on
real AttentionMetadata with shuffled block ids. Both paths run in the same process,
interleaved (their order alternates); each figure is a median over runs, with the best run in
parentheses (the machine is shared: the best run is the least disturbed). The torch path's
padded groups are built once per batch outside the timing (they are per batch, not per layer);
the kernel needs no per-batch work.

    python bench/cpu_attention.py [--batches 1 8 32 64] [--contexts 256 1024]
        [--prefill 8x256 2x1024] [--threads 1 2] [--runs 7]
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

from gpu_runner import cpu_kernels
from gpu_runner.attention.metadata import AttentionMetadata
from gpu_runner.attention.torch_backend import TorchAttentionBackend

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, LAYERS = 9, 3, 64, 16, 30
DISTINCT_CACHES = 4  # layers cycle over a few caches so that small cases do not sit in L2


def batch_metadata(batch: int, context: int, new_tokens: int, num_blocks: int, seed: int
                   ) -> AttentionMetadata:
    """Every sequence has `context` keys, the last `new_tokens` of them new (1: a decode;
    `context`: a fresh prompt)."""
    rng = np.random.default_rng(seed)
    per_seq = -(-context // BLOCK_SIZE)
    tables = rng.permutation(num_blocks)[: batch * per_seq].reshape(batch, per_seq)
    ctx = np.full(batch, context, dtype=np.int64)
    query_lens = np.full(batch, new_tokens, dtype=np.int64)
    positions = np.tile(np.arange(context - new_tokens, context), batch)
    seq_of_token = np.repeat(np.arange(batch), new_tokens)
    slots = tables[seq_of_token, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    starts = np.arange(batch + 1) * new_tokens
    return AttentionMetadata(
        positions=torch.from_numpy(positions),
        slot_mapping=torch.from_numpy(slots),
        block_tables=torch.from_numpy(tables.astype(np.int64)),
        query_lens=torch.from_numpy(query_lens),
        context_lens=torch.from_numpy(ctx),
        query_start_locs=torch.from_numpy(starts),
        logits_indices=torch.from_numpy(starts[1:] - 1),
        query_lens_host=query_lens,
        context_lens_host=ctx,
        block_table_lens_host=np.full(batch, per_seq, dtype=np.int64),
        block_size=BLOCK_SIZE,
    )


def timed_ms(run: Callable[[], object], runs: list[float]) -> None:
    start = time.perf_counter()
    run()
    runs.append((time.perf_counter() - start) * 1e3)


def bench_case(batch: int, context: int, new_tokens: int, threads: int, num_runs: int
               ) -> tuple[list[float], list[float]]:
    torch.set_num_threads(threads)
    num_blocks = batch * -(-context // BLOCK_SIZE) + 8
    caches = [torch.randn(2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
              for _ in range(DISTINCT_CACHES)]
    meta = batch_metadata(batch, context, new_tokens, num_blocks,
                          seed=batch * 7919 + context + new_tokens)
    query = torch.randn(meta.num_tokens, HEADS, HEAD_DIM)
    # The new tokens' K/V as the layer hands them over (already in the cache, as after store).
    new_kv = [cache.view(2, -1, KV_HEADS, HEAD_DIM)[:, meta.slot_mapping] for cache in caches]
    backend = TorchAttentionBackend(HEADS, KV_HEADS, HEAD_DIM)
    groups = backend.group_sequences(meta)

    def torch_once(layer: int) -> torch.Tensor:
        cache, kv = caches[layer % DISTINCT_CACHES], new_kv[layer % DISTINCT_CACHES]
        return backend._attend_groups(query, kv[0], kv[1], cache, groups, meta.num_tokens)

    def kernel_once(layer: int) -> torch.Tensor:
        cache = caches[layer % DISTINCT_CACHES]
        return cpu_kernels.paged_attention(query, cache[0], cache[1], meta.block_tables,
                                           meta.context_lens, meta.query_start_locs,
                                           backend.scale)

    def torch_path() -> None:
        for layer in range(LAYERS):
            torch_once(layer)

    def kernel_path() -> None:
        for layer in range(LAYERS):
            kernel_once(layer)

    torch.testing.assert_close(kernel_once(0), torch_once(0), rtol=1e-4, atol=1e-4)
    torch_path(), kernel_path()  # warm-up
    torch_runs: list[float] = []
    kernel_runs: list[float] = []
    for run in range(num_runs):
        pair = [(torch_path, torch_runs), (kernel_path, kernel_runs)]
        for fn, runs in pair if run % 2 == 0 else reversed(pair):
            timed_ms(fn, runs)
    return torch_runs, kernel_runs


def parse_prefill(value: str) -> tuple[int, int]:
    """"8x256" -> 8 prompts of 256 tokens."""
    batch, _, length = value.partition("x")
    try:
        return int(batch), int(length)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected PROMPTSxTOKENS, got {value!r}") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--prefill", type=parse_prefill, nargs="*", default=[(8, 256), (2, 1024)],
                        help="fresh-prompt batches as PROMPTSxTOKENS")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    start = time.perf_counter()
    if not cpu_kernels.available():
        sys.exit("the C++ kernel is unavailable (see the warning above)")
    print(f"kernel ready in {time.perf_counter() - start:.1f} s; "
          f"{LAYERS} layers per run, {args.runs} runs: median (and best) ms")
    print(f"{'threads':>7} {'kind':>7} {'batch':>5} {'context':>7} {'torch':>18} "
          f"{'kernel':>18} {'speedup':>8} {'best':>6}")
    cases = [("decode", batch, context) for context in args.contexts for batch in args.batches]
    cases += [("prefill", batch, length) for batch, length in args.prefill]
    for threads in args.threads:
        for kind, batch, context in cases:
            new_tokens = 1 if kind == "decode" else context
            torch_runs, kernel_runs = bench_case(batch, context, new_tokens, threads, args.runs)
            torch_ms, kernel_ms = (statistics.median(x) for x in (torch_runs, kernel_runs))
            torch_best, kernel_best = min(torch_runs), min(kernel_runs)
            print(f"{threads:>7} {kind:>7} {batch:>5} {context:>7} {torch_ms:>9.2f} "
                  f"({torch_best:>6.2f}) {kernel_ms:>9.2f} ({kernel_best:>6.2f}) "
                  f"{torch_ms / kernel_ms:>7.2f}x {torch_best / kernel_best:>5.2f}x",
                  flush=True)


if __name__ == "__main__":
    main()
