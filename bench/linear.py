"""Linear layers at decode row counts: the C++ panel kernel against MKL's packed sgemm.

One run = every projection of SmolLM2-135M's 30 layers plus the LM head (its shapes, random
weights), in model order, at one row count: ~540 MB of float32 weights per run, more than this
machine's caches, so the weights stream from memory as they do in a decode step (timing one
weight in a loop would leave it in the cache and hide that). Both paths alternate in the same
process; each figure is the median over runs.

    python bench/linear.py [--rows 1 4 8 16 32 64] [--runs 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpu_runner import cpu_kernels
from gpu_runner.layers.linear import pack_weight

LAYERS = 30
# (out_features, in_features) of one decoder layer: q/k/v fused, o, gate/up fused, down.
LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
HEAD = (49152, 576)


def model_weights() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = [shape for _ in range(LAYERS) for shape in LAYER_SHAPES] + [HEAD]
    return [torch.randn(*shape, generator=gen) * 0.05 for shape in shapes]


def median_ms(run: Callable[[], object], runs: list[float]) -> None:
    start = time.perf_counter()
    run()
    runs.append((time.perf_counter() - start) * 1e3)


def bench_rows(weights: list[torch.Tensor], panels: list[torch.Tensor],
               mkl: list[torch.Tensor], rows: int, num_runs: int) -> tuple[float, float]:
    inputs = {k: torch.randn(rows, k) for k in {w.shape[1] for w in weights}}
    for w, p in zip(weights[:4], panels[:4], strict=True):  # same results, both paths
        x = inputs[w.shape[1]]
        torch.testing.assert_close(cpu_kernels.panel_linear(x, p, None, w.shape[0]),
                                   torch.nn.functional.linear(x, w), rtol=1e-4, atol=1e-4)

    def panel_path() -> None:
        for w, p in zip(weights, panels, strict=True):
            cpu_kernels.panel_linear(inputs[w.shape[1]], p, None, w.shape[0])

    def mkl_path() -> None:
        for w, m in zip(weights, mkl, strict=True):
            torch.ops.mkl._mkl_linear(inputs[w.shape[1]], m, w, None, rows)

    panel_path(), mkl_path()  # warm-up
    panel_runs: list[float] = []
    mkl_runs: list[float] = []
    for run in range(num_runs):
        pair = [(panel_path, panel_runs), (mkl_path, mkl_runs)]
        for fn, runs in pair if run % 2 == 0 else reversed(pair):
            median_ms(fn, runs)
    return statistics.median(panel_runs), statistics.median(mkl_runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    if not cpu_kernels.available():
        sys.exit("the C++ kernels are unavailable (see the warning above)")
    weights = model_weights()
    panels = [cpu_kernels.pack_panels(w) for w in weights]
    mkl = [pack_weight(w) for w in weights]
    print(f"{len(weights)} weights ({sum(w.numel() for w in weights) * 4 / 2**20:.0f} MiB) per "
          f"run, {torch.get_num_threads()} threads, median of {args.runs} runs")
    print(f"{'rows':>5} {'panels ms':>10} {'MKL packed ms':>14} {'MKL / panels':>13}")
    for rows in args.rows:
        panel_ms, mkl_ms = bench_rows(weights, panels, mkl, rows, args.runs)
        print(f"{rows:>5} {panel_ms:>10.1f} {mkl_ms:>14.1f} {mkl_ms / panel_ms:>12.2f}x",
              flush=True)


if __name__ == "__main__":
    main()
