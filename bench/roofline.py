"""The machine's limits and the runner's place under them (a roofline).

- `measure_peaks`: the best GEMM GFLOP/s per dtype of the kernels the runner can use, at the
  model's own projection shapes with many rows, and the memory bandwidth (STREAM-like copy,
  triad and a read-only sum over arrays far larger than the last-level cache).
- `forward_work`: the FLOPs and the bytes read and written by one runner forward, counted from
  an ExecuteBatch's shapes; `recorded_work` for every batch of a `--record-batches` file.
- `roofline`: per forward, the time the machine needs at least, max(FLOPs ÷ GEMM peak, bytes ÷
  bandwidth); their sum against the measured seconds gives the fraction of the limit reached.

    .venv/bin/python bench/roofline.py [--dtypes float32 bfloat16] [--model PATH] [--threads N]
prints the machine's peaks and which kernel and shape gave each.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from gpu_runner import cpu_kernels  # noqa: E402
from gpu_runner.batch import ExecuteBatch  # noqa: E402
from gpu_runner.config import ModelConfig, load_model_config  # noqa: E402
from gpu_runner.layers.linear import best_of_interleaved, candidate_kernels  # noqa: E402
from gpu_runner.recorder import read_recorded  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Rows of the peak GEMMs: prefill-sized, where a GEMM is compute-bound. A shape whose GEMM at
# these rows would exceed GEMM_MAX_MACS (the LM head's 49152 columns) is measured at fewer rows,
# down to a power of two: it keeps the measurement within seconds.
GEMM_ROWS = (1024, 2048)
GEMM_MAX_MACS = 1 << 33
# Best of: other processes on the machine make single runs slow, never fast.
GEMM_REPEATS = 5
# Each STREAM array: far larger than any last-level cache (the 2-core EPYC VM here: 32 MiB).
STREAM_BYTES = 256 << 20
STREAM_REPEATS = 5


def dtype_of(name: torch.dtype | str) -> torch.dtype:
    return name if isinstance(name, torch.dtype) else DTYPES[name]


def dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.")


# ---- peaks ----


@dataclass(frozen=True)
class GemmPeak:
    """The best GEMM rate of one dtype, and where it was reached."""

    dtype: str
    gflops: float
    kernel: str  # e.g. "plain", "panels"
    shape: str  # "rows x N x K (name)"


@dataclass(frozen=True)
class MachinePeaks:
    """What this machine can do, measured on `threads` threads."""

    threads: int
    gemm: dict[str, GemmPeak]  # by dtype name
    copy_gbs: float
    triad_gbs: float
    read_gbs: float

    @property
    def bandwidth_gbs(self) -> float:
        """The memory bound: the best of copy, triad and read. A bound must not sit below what
        a kernel is seen to reach; the runner's traffic is mostly reads (weights, the KV
        cache), for which the read-only sum is the closest of the three, and copy and triad
        count no write-allocate traffic (STREAM's convention), so they come out lower."""
        return max(self.copy_gbs, self.triad_gbs, self.read_gbs)

    def describe(self) -> list[str]:
        lines = [f"memory bandwidth ({self.threads} threads, {STREAM_BYTES >> 20} MiB arrays): "
                 f"copy {self.copy_gbs:.1f} GB/s, triad {self.triad_gbs:.1f} GB/s, "
                 f"read {self.read_gbs:.1f} GB/s -> bound {self.bandwidth_gbs:.1f} GB/s"]
        for peak in self.gemm.values():
            lines.append(f"GEMM peak {peak.dtype}: {peak.gflops:.1f} GFLOP/s "
                         f"({peak.kernel}, {peak.shape})")
        return lines

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "bandwidth_gbs": self.bandwidth_gbs}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MachinePeaks:
        return cls(int(data["threads"]),
                   {name: GemmPeak(**peak) for name, peak in data["gemm"].items()},
                   float(data["copy_gbs"]), float(data["triad_gbs"]), float(data["read_gbs"]))


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """The runner's projections as (N, K): output and input features of each weight."""
    return {
        "qkv": (config.q_size + 2 * config.kv_size, config.hidden_size),
        "o": (config.hidden_size, config.q_size),
        "gate_up": (2 * config.intermediate_size, config.hidden_size),
        "down": (config.hidden_size, config.intermediate_size),
        "lm_head": (config.vocab_size, config.hidden_size),
    }


def _gemm_rows(n: int, k: int) -> list[int]:
    rows = []
    for wanted in GEMM_ROWS:
        while wanted > 64 and wanted * n * k > GEMM_MAX_MACS:
            wanted //= 2
        rows.append(wanted)
    return sorted(set(rows))


def _kernels(weight: torch.Tensor) -> dict[str, Callable[[torch.Tensor], object]]:
    """Every kernel the runner could use for this weight: candidate_kernels' (with the panel
    layout where the panel kernel takes the dtype), or those of them that can be made."""
    panels = None
    if cpu_kernels.available(weight.device):
        try:
            panels = cpu_kernels.pack_panels(weight)
        except (RuntimeError, TypeError, ValueError):
            panels = None  # the panel kernel does not take this dtype
    # candidate_kernels' "plain" is F.linear; it stays alone where the others cannot be made.
    runs: dict[str, Callable[[torch.Tensor], object]] = {"plain": lambda x: F.linear(x, weight)}
    for attempt in (panels, None) if panels is not None else (None,):
        try:
            runs = {gemm.value: run for gemm, run
                    in candidate_kernels(weight, None, attempt).items()}
            break
        except (RuntimeError, TypeError, ValueError):
            continue  # e.g. MKL's packing is float32 only
    if panels is not None and "panels" not in runs:
        runs["panels"] = lambda x: cpu_kernels.panel_linear(x, panels, None, weight.shape[0])
    return runs


def _computes_the_product(run: Callable[[torch.Tensor], object], x: torch.Tensor,
                          weight: torch.Tensor) -> bool:
    """Whether `run` takes x and returns x @ weight^T, checked on its first, middle and last
    rows: a kernel that cannot take the dtype (it raises), or skips work, gets no peak."""
    try:
        got = run(x)
    except (RuntimeError, TypeError, ValueError):
        return False
    if not isinstance(got, torch.Tensor) or got.shape != (x.shape[0], weight.shape[0]):
        return False
    rows = torch.tensor([0, x.shape[0] // 2, x.shape[0] - 1])
    expected = F.linear(x[rows].float(), weight.float())
    tolerance = 1e-3 if weight.dtype == torch.float32 else 5e-2
    return torch.allclose(got[rows].float(), expected, rtol=tolerance,
                          atol=tolerance * float(expected.abs().max()))


def gemm_peak(config: ModelConfig, dtype: torch.dtype | str,
              repeats: int = GEMM_REPEATS) -> GemmPeak:
    """The best GFLOP/s over the model's projection shapes and the available kernels that
    compute the product right at that shape."""
    dtype = dtype_of(dtype)
    generator = torch.Generator().manual_seed(0)
    best = GemmPeak(dtype_name(dtype), 0.0, "", "")
    with torch.inference_mode():
        for name, (n, k) in projection_shapes(config).items():
            weight = (torch.randn(n, k, generator=generator) * k ** -0.5).to(dtype)
            kernels = _kernels(weight)
            for rows in _gemm_rows(n, k):
                x = torch.randn(rows, k, generator=generator).to(dtype)
                right = {kernel: run for kernel, run in kernels.items()
                         if _computes_the_product(run, x, weight)}
                seconds = best_of_interleaved([partial(run, x) for run in right.values()], repeats)
                for kernel, s in zip(right, seconds, strict=True):
                    gflops = 2 * rows * n * k / s / 1e9
                    if gflops > best.gflops:
                        best = GemmPeak(best.dtype, gflops, kernel, f"{rows}x{n}x{k} ({name})")
    return best


def stream_bandwidth(repeats: int = STREAM_REPEATS,
                     array_bytes: int = STREAM_BYTES) -> tuple[float, float, float]:
    """(copy, triad, read) GB/s, best of `repeats`, STREAM's byte counts: copy a = b moves 2
    arrays, triad a = b + s * c moves 3, the read-only sum 1."""
    count = array_bytes // 4
    a, b, c = (torch.ones(count, dtype=torch.float32) for _ in range(3))
    runs = [lambda: a.copy_(b), lambda: torch.add(b, c, alpha=3.0, out=a), lambda: b.sum()]
    seconds = best_of_interleaved(runs, repeats)
    moved = (2 * array_bytes, 3 * array_bytes, array_bytes)
    copy, triad, read = (m / s / 1e9 for m, s in zip(moved, seconds, strict=True))
    return copy, triad, read


def measure_peaks(config: ModelConfig, dtypes: Sequence[torch.dtype | str],
                  threads: int | None = None) -> MachinePeaks:
    """The machine's GEMM peak per dtype at the model's shapes and its memory bandwidth, on
    `threads` threads (default: every core, as the runner). Restores torch's thread count."""
    before = torch.get_num_threads()
    threads = threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    try:
        copy, triad, read = stream_bandwidth()
        gemm = {dtype_name(d): gemm_peak(config, d) for d in dtypes}
    finally:
        torch.set_num_threads(before)
    return MachinePeaks(threads, gemm, copy, triad, read)


# ---- work of a forward ----


@dataclass(frozen=True)
class Work:
    """FLOPs and bytes of memory traffic of one forward (or a sum of forwards)."""

    flops: float
    bytes: float
    attention_flops: float = 0.0  # part of `flops`: QK^T and PV
    lm_head_flops: float = 0.0  # part of `flops`

    def __add__(self, other: Work) -> Work:
        return Work(self.flops + other.flops, self.bytes + other.bytes,
                    self.attention_flops + other.attention_flops,
                    self.lm_head_flops + other.lm_head_flops)


def _layer_weight_elements(config: ModelConfig) -> int:
    """The elements of one decoder layer's weights: projections, biases and norms."""
    matrices = sum(n * k for name, (n, k) in projection_shapes(config).items()
                   if name != "lm_head")
    bias = config.q_size + 2 * config.kv_size if config.attention_bias else 0
    norms = 2 * config.hidden_size + (2 * config.head_dim if config.qk_norm else 0)
    return matrices + bias + norms


def forward_work(config: ModelConfig, batch: ExecuteBatch,
                 dtype: torch.dtype | str) -> Work:
    """What one runner forward over `batch` computes and moves, from the batch's shapes.

    FLOPs (a multiply-add is 2): per layer, the four projections over every new token
    (2 * tokens * N * K each) and attention, causal: new token at position p sees p + 1 keys,
    and per head and key QK^T and PV cost 2 * head_dim each; then the LM head over the rows
    that sample (the runner computes logits only at each sampling sequence's last new token:
    batch.py's logits_indices). Norms, rotary, activations and sampling are not counted.

    Bytes, in `dtype`: every weight read once per forward (the gathered embedding rows only;
    the LM head's matrix, the embedding's own when tied, once if any row samples), each
    sequence's visible K and V read once per layer (an assumption: whatever the number of its
    new tokens or query heads, a sequence's blocks come from memory once per layer, the cache
    serving the rest), and the new tokens' K and V written. Activations are not counted
    (they mostly stay in the caches), nor are block copies (copy-on-write; W1 has none)."""
    element = torch.empty((), dtype=dtype_of(dtype)).element_size()
    new = batch.num_new_tokens.astype(np.int64)
    starts = batch.start_positions.astype(np.int64)
    tokens = int(new.sum())
    sampled = int(np.count_nonzero(batch.do_sample))
    # Keys seen by a sequence's new tokens: sum over p in [s, s + n) of (p + 1).
    visible = int(np.sum(new * starts + new * (new + 1) // 2))
    context = int(np.sum(starts + new))  # keys per sequence after this forward
    layers = config.num_layers
    projections = 2 * tokens * sum(n * k for name, (n, k) in projection_shapes(config).items()
                                   if name != "lm_head")
    attention = 4 * config.num_heads * config.head_dim * visible
    lm_head = 2 * sampled * config.vocab_size * config.hidden_size
    weights = (layers * _layer_weight_elements(config) + config.hidden_size  # final norm
               + tokens * config.hidden_size  # embedding rows
               + (config.vocab_size * config.hidden_size if sampled else 0))
    kv = layers * 2 * config.kv_size * (context + tokens)  # read, then the new ones written
    return Work(flops=float(layers * (projections + attention) + lm_head),
                bytes=float((weights + kv) * element),
                attention_flops=float(layers * attention), lm_head_flops=float(lm_head))


def recorded_work(config: ModelConfig, path: Path, dtype: torch.dtype | str) -> list[Work]:
    """The Work of every batch of a `--record-batches` file, in order."""
    return [forward_work(config, ExecuteBatch.from_proto(request), dtype)
            for request in read_recorded(path)]


# ---- the roofline ----


@dataclass
class Roofline:
    """Measured forwards against the machine's limits for their dtype. Adds up over runs."""

    dtype: str
    peak_gflops: float
    bandwidth_gbs: float
    flops: float = 0.0
    bytes: float = 0.0
    measured_s: float = 0.0
    attainable_s: float = 0.0  # sum over forwards of max(compute time, memory time)
    compute_bound_s: float = 0.0  # the part of attainable_s from compute-bound forwards
    forwards: int = 0

    @property
    def fraction(self) -> float:
        """How close the measured time comes to the bound (1.0: at the machine's limit)."""
        return self.attainable_s / self.measured_s if self.measured_s else 0.0

    @property
    def bound(self) -> str:
        return ("compute-bound" if self.compute_bound_s >= self.attainable_s / 2
                else "bandwidth-bound")

    @property
    def gflops(self) -> float:
        return self.flops / self.measured_s / 1e9 if self.measured_s else 0.0

    @property
    def gbs(self) -> float:
        return self.bytes / self.measured_s / 1e9 if self.measured_s else 0.0

    def __add__(self, other: Roofline) -> Roofline:
        if (self.dtype, self.peak_gflops, self.bandwidth_gbs) != (
                other.dtype, other.peak_gflops, other.bandwidth_gbs):
            raise ValueError("rooflines of different dtypes or peaks do not add up")
        return Roofline(self.dtype, self.peak_gflops, self.bandwidth_gbs,
                        self.flops + other.flops, self.bytes + other.bytes,
                        self.measured_s + other.measured_s,
                        self.attainable_s + other.attainable_s,
                        self.compute_bound_s + other.compute_bound_s,
                        self.forwards + other.forwards)

    def describe(self) -> str:
        """One line, e.g. "bfloat16: 312 GFLOP/s (34 % of 920 GFLOP/s GEMM peak), 18 GB/s
        (…); roofline bound 41 s of 52 s measured → 79 % (compute-bound)"."""
        return (f"{self.dtype}: {self.gflops:.0f} GFLOP/s "
                f"({100 * self.gflops / self.peak_gflops:.0f} % of {self.peak_gflops:.0f} "
                f"GFLOP/s GEMM peak), {self.gbs:.1f} GB/s "
                f"({100 * self.gbs / self.bandwidth_gbs:.0f} % of {self.bandwidth_gbs:.1f} GB/s);"
                f" roofline bound {_seconds(self.attainable_s)} of {_seconds(self.measured_s)} "
                f"measured "
                f"→ {100 * self.fraction:.0f} % ({self.bound})")

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "fraction": self.fraction, "bound": self.bound,
                "gflops": self.gflops, "gbs": self.gbs, "line": self.describe()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Roofline:
        names = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in names})


def _seconds(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1e3:.1f} ms"


def roofline(works: Iterable[Work], measured_s: float, peaks: MachinePeaks,
             dtype: torch.dtype | str) -> Roofline:
    """The forwards `works`, measured together in `measured_s`, against `peaks` for `dtype`:
    each forward's bound is the larger of its compute time at the GEMM peak and its traffic
    time at the memory bandwidth (compute for large prefills, bandwidth for small decodes)."""
    name = dtype_name(dtype)
    result = Roofline(name, peaks.gemm[name].gflops, peaks.bandwidth_gbs,
                      measured_s=measured_s)
    for work in works:
        compute_s = work.flops / (result.peak_gflops * 1e9)
        memory_s = work.bytes / (result.bandwidth_gbs * 1e9)
        result.flops += work.flops
        result.bytes += work.bytes
        result.attainable_s += max(compute_s, memory_s)
        result.compute_bound_s += compute_s if compute_s >= memory_s else 0.0
        result.forwards += 1
    return result


@dataclass
class RooflineTally:
    """Rooflines of the same forwards timed several ways (e.g. the ceiling's replay and the
    end-to-end run), summed over the rounds of a benchmark."""

    dtype: str
    peaks: MachinePeaks
    by_way: dict[str, Roofline] = field(default_factory=dict)

    def add(self, way: str, works: Sequence[Work], measured_s: float) -> None:
        measured = roofline(works, measured_s, self.peaks, self.dtype)
        self.by_way[way] = self.by_way[way] + measured if way in self.by_way else measured

    def as_dict(self) -> dict[str, Any]:
        return {way: line.as_dict() for way, line in self.by_way.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                        choices=list(DTYPES))
    parser.add_argument("--model", default=None, help="the model whose shapes are measured")
    parser.add_argument("--threads", type=int, default=None, help="default: every core")
    args = parser.parse_args()
    from common.model_store import resolve_model

    folder = resolve_model(args.model)
    config = load_model_config(folder)
    start = time.perf_counter()
    peaks = measure_peaks(config, args.dtypes, args.threads)
    print(f"machine peaks at the shapes of {folder.name}, torch {torch.__version__} "
          f"({time.perf_counter() - start:.0f} s to measure):")
    for line in peaks.describe():
        print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
