"""The CPU float32 GEMM kernels of gpu_runner/layers/linear.py side by side, over a whole model.

One run = every projection of SmolLM2-135M's 30 layers plus the LM head (its shapes, random
weights), in model order, at one row count, on one kernel: ~540 MB of float32 weights per run,
more than this machine's caches, so the weights stream from memory as they do in a decode step
(timing one weight in a loop would leave it in the cache and hide that). The kernels alternate
in the same process; each figure is the median over runs, and the last column the fastest
other kernel's time over the panels'.

    python bench/linear.py [--rows 1 4 8 16 32 64 128 512 2048] [--runs 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpu_runner import cpu_kernels
from gpu_runner.layers.linear import Gemm, GemmRun, candidate_kernels

LAYERS = 30
# (out_features, in_features) of one decoder layer: q/k/v fused, o, gate/up fused, down.
LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
HEAD = (49152, 576)


def model_weights() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = [shape for _ in range(LAYERS) for shape in LAYER_SHAPES] + [HEAD]
    return [torch.randn(*shape, generator=gen) * 0.05 for shape in shapes]


def model_runs(weights: list[torch.Tensor]) -> dict[Gemm, list[GemmRun]]:
    """Per kernel, one call per weight (each with the layout that kernel needs)."""
    per_weight = [candidate_kernels(w, None, cpu_kernels.pack_panels(w)) for w in weights]
    return {kernel: [runs[kernel] for runs in per_weight] for kernel in per_weight[0]}


def bench_rows(weights: list[torch.Tensor], runs: dict[Gemm, list[GemmRun]], rows: int,
               num_runs: int) -> dict[Gemm, float]:
    """Median ms of one pass over the model per kernel, after checking they agree."""
    inputs = [torch.randn(rows, w.shape[1]) for w in weights]
    for kernel, calls in runs.items():  # same results on every kernel
        torch.testing.assert_close(calls[0](inputs[0]),
                                   torch.nn.functional.linear(inputs[0], weights[0]),
                                   rtol=1e-4, atol=1e-4, msg=kernel.value)
    times: dict[Gemm, list[float]] = {kernel: [] for kernel in runs}
    for run in range(num_runs + 1):  # the first round warms up
        order = list(runs) if run % 2 == 0 else list(reversed(runs))
        for kernel in order:
            start = time.perf_counter()
            for call, x in zip(runs[kernel], inputs, strict=True):
                call(x)
            if run:
                times[kernel].append((time.perf_counter() - start) * 1e3)
    return {kernel: statistics.median(ms) for kernel, ms in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+",
                        default=[1, 4, 8, 16, 32, 64, 128, 512, 2048])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    if not cpu_kernels.available():
        sys.exit("the C++ kernels are unavailable (see the warning above)")
    weights = model_weights()
    runs = model_runs(weights)
    print(f"{len(weights)} weights ({sum(w.numel() for w in weights) * 4 / 2**20:.0f} MiB) per "
          f"run, {torch.get_num_threads()} threads, median of {args.runs} runs, ms per run")
    print(f"{'rows':>5} " + " ".join(f"{kernel.value:>11}" for kernel in runs)
          + f" {'best other / panels':>20}")
    for rows in args.rows:
        ms = bench_rows(weights, runs, rows, args.runs)
        best_other = min(t for kernel, t in ms.items() if kernel is not Gemm.PANELS)
        print(f"{rows:>5} " + " ".join(f"{ms[kernel]:>11.1f}" for kernel in runs)
              + f" {best_other / ms[Gemm.PANELS]:>19.2f}x", flush=True)


if __name__ == "__main__":
    main()
