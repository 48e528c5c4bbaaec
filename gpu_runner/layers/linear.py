"""Projections (including the fused ones: q/k/v in one matmul, gate/up in another) and the
CPU GEMM dispatch that picks, per call, the kernel for the call's row count.

The kernels (`Gemm`), CPU float32:
- PLAIN: `F.linear`, MKL sgemm, which re-packs the weight into its own layout on every call
  (in bfloat16, oneDNN's GEMM at padded row counts: `onednn_rows`).
- MKL_PACKED: MKL sgemm on a weight packed once at load (`_mkl_reorder_linear_weight`): with few
  rows the per-call packing is most of PLAIN's time. A copy of the weight.
- PANELS: the C++ panel kernel (gpu_runner/cpu_kernels.py, csrc/panel_linear.cpp), which streams
  the weight from memory while it computes. A copy of the weight in its layout.
- ONEDNN: oneDNN's float32 matmul on a weight reordered once at load, up to ONEDNN_MAX_ROWS
  rows, at padded row counts (`onednn_rows`). A copy of the weight.

MKL picks its code path by CPU vendor: on an AMD CPU with AVX-512 it runs without it, and the
panels are then ~2x faster than either MKL path at every row count (bench/linear.py); on one
with AVX2 only, only up to 8 rows (`panel_rows`). oneDNN's matmul is as
fast as the panels there but is not used: it builds and caches a primitive per row count, ~1 MB
each, and a server sees every row count (docs/gpu_runner.md).

Which is fastest depends on the CPU, the row count and the weight's shape, so above the
panels' rows it is measured once per weight shape (N, K) at load, over power-of-two row
buckets (`tune_policy`), and each call rounds its row count up to a bucket and looks it up.
At `panel_rows()` (decode batches) the panels are used without a measurement: every decode step
reads all the weights, which do not fit in the cache, and a load-time measurement repeats one
weight, which then sits in the cache, the one case where the panels have no edge.

Cost: the panels are +100 % of the weight memory; MKL's layout, for the shapes whose policy
uses it, up to +100 % more (~+0.5 GB each for SmolLM2-135M in float32).

CPU bfloat16 (where the CPU multiplies bfloat16: `cpu_kernels.kernel_dtype`): PLAIN is
oneDNN's bfloat16 GEMM (AVX512_BF16 / AMX); PANELS multiply pairs of bfloat16 with VDPBF16PS
where the kernel is built with AVX512_BF16 (else they widen the weights to float32 as they
stream), at half float32's bytes. MKL has no bfloat16 packing. As in float32 the panels take
`panel_rows()` unmeasured; above, the two are measured. The 120 decoder projections of SmolLM2
cold, 2 threads, ms per pass (a loop like bench/linear.py's, 2026-12-02, the EPYC VM):

| rows | oneDNN bf16 | panels bf16 | panels float32 |
|---:|---:|---:|---:|
| 1 | 16.1 | 6.6 | 11.4 |
| 8 | 17.4 | 7.9 | 15.5 |
| 32 | 23.7 | 12.3 | 22.3 |
| 64 | 48.0 | 24.5 | 41.4 |
| 256 | 103.7 | 93.6 | 155.5 |

CUDA, float16 and the bfloat16 fallback always use plain `F.linear`.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.nn import functional as F

from gpu_runner import cpu_kernels

log = logging.getLogger(__name__)

# `--linear-backend`: auto = panels for the few rows of decode batches, elsewhere the kernel
# measured fastest (CPU float32, and bfloat16 where the CPU multiplies it); panels = the panels
# for those rows and plain above, unmeasured (a start without the measurement's seconds: what
# the test suite's services run, where the kernel choice is not what a test checks); packed =
# MKL-packed for every row count up to the last bucket (no measurement, no panels); plain = off.
LINEAR_BACKENDS = ("auto", "panels", "packed", "plain")
# The row counts that go through the panel kernel unmeasured (`panel_rows`). Built for
# AVX-512 (bench/linear.py: faster than every other kernel on the AVX-512 EPYC VM, 1.5-3.5x;
# on the Xeon VM 8-24 % faster than MKL-packed from 4 to 64 rows and 2-10 % slower at 1-2),
# both dtypes (bfloat16: the table in the docstring). Built for AVX2, its 8-row tiles spill
# half their accumulators: on the AVX2-only EPYC (2026-12-07) 1.57x MKL-packed at 4 rows,
# 1.14x at 8, 0.67x at 16, 0.34x at 64; above 8 rows it competes in the measurement. There
# oneDNN beat every other kernel at every row count from 1 to 128 (bench/linear.py, the whole
# model cold: 26.2 ms at 1 row against 32.9 for the panels and 33.8 for MKL-packed; 41.3
# against 68.0 / 75.2 at 8; 82.5 against 134.0 at 32), so `auto` measures every row count
# where the kernels are built for AVX2.
WIDE_PANEL_ROWS = range(1, 65)
NARROW_PANEL_ROWS = range(1, 9)
# oneDNN builds and keeps a primitive per row count (`onednn_rows` bounds how many): it is a
# candidate for decode batches only, where it pays.
ONEDNN_MAX_ROWS = 64
ONEDNN_ROWS_HINT = 32  # the row count its weight layout is reordered for

# Row counts are rounded up to a power of two; above the last bucket, and at buckets above a
# shape's measuring budget (TUNE_MAX_MACS), the last measured bucket's kernel is used.
ROW_BUCKETS = tuple(2**i for i in range(12))  # 1 .. 2048
# A bucket is measured only if rows * N * K stays under this (it bounds the start-up cost:
# the 49152x576 lm_head is measured up to 256 rows, the decoder's weights up to 2048).
TUNE_MAX_MACS = 1 << 33
# MKL lays the packed weight out for this many rows. The hint matters: on SmolLM2's shapes a
# hint of 256 is at least as fast as plain sgemm from 4 to 2048 rows, while a hint of 8 is
# up to 1.5x slower than plain from 256 rows on.
PACK_ROWS_HINT = 256
# MKL-packed, the one kernel that needs a copy made for it, must beat the fastest other kernel
# by this fraction to be chosen.
MIN_GAIN = 0.05
TUNE_ROUNDS = 5


class Gemm(enum.Enum):
    """The kernels a CPU projection can run on (see the module's docstring)."""

    PLAIN = "plain"
    MKL_PACKED = "mkl-packed"
    PANELS = "panels"
    ONEDNN = "onednn"


@dataclass(frozen=True)
class GemmPolicy:
    """For one weight shape: the kernel used at each row bucket."""

    kernels: tuple[Gemm, ...]  # aligned with ROW_BUCKETS

    def kernel(self, rows: int) -> Gemm:
        if rows <= 0:
            return Gemm.PLAIN
        bucket = (rows - 1).bit_length()  # the index of the smallest 2**i >= rows
        return self.kernels[min(bucket, len(self.kernels) - 1)]

    def uses(self, kernel: Gemm) -> bool:
        return kernel in self.kernels

    def describe(self) -> str:
        """Row ranges and their kernels, e.g. "rows 1-64: panels, 65-2048: plain"."""
        parts: list[str] = []
        first = 1
        for index, kernel in enumerate(self.kernels):
            last = ROW_BUCKETS[index]
            if index + 1 == len(self.kernels) or self.kernels[index + 1] is not kernel:
                parts.append(f"{first}-{last}: {kernel.value}")
                first = last + 1
        return "rows " + ", ".join(parts)


ALWAYS_MKL_PACKED = GemmPolicy(tuple(Gemm.MKL_PACKED for _ in ROW_BUCKETS))
ALWAYS_PLAIN = GemmPolicy(tuple(Gemm.PLAIN for _ in ROW_BUCKETS))


def panel_rows() -> range:
    """The row counts the `panels` backend gives the panels, for the vectors the kernels were
    built for."""
    return WIDE_PANEL_ROWS if cpu_kernels.wide_vectors() else NARROW_PANEL_ROWS


def unmeasured_panel_rows() -> range:
    """The row counts `auto` gives the panels without a measurement (none where the kernels
    are built for AVX2: there every kernel is measured at every row count)."""
    return panel_rows() if cpu_kernels.wide_vectors() else range(0)


def panels_then_plain() -> GemmPolicy:
    rows_of_panels = panel_rows()
    return GemmPolicy(tuple(Gemm.PANELS if rows in rows_of_panels else Gemm.PLAIN
                            for rows in ROW_BUCKETS))


@dataclass(frozen=True)
class GemmShape:
    """What a kernel choice depends on, on one machine (the thread count included)."""

    out_features: int
    in_features: int
    has_bias: bool
    threads: int
    panels: bool  # the panel kernel is built: it takes panel_rows(), and competes above
    dtype: torch.dtype = torch.float32


@dataclass
class PackedWeight:
    """A weight's packed layouts, and which kernel to use when (attached to one Linear)."""

    packed: torch.Tensor | None  # MKL's opaque packed layout (None: the policy never uses it)
    policy: GemmPolicy
    panels: torch.Tensor | None = None  # the panel kernel's layout (None: never used)
    onednn: torch.Tensor | None = None  # oneDNN's reordered weight (None: never used)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: PackedWeight | None) -> torch.Tensor:
    """y = x @ weight^T (+ bias), on the kernel `packed` names for x's row count."""
    if packed is not None:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        kernel = packed.policy.kernel(rows)
        if kernel is Gemm.PANELS and packed.panels is not None:
            return cpu_kernels.panel_linear(x, packed.panels, bias, weight.shape[0])
        if kernel is Gemm.MKL_PACKED and packed.packed is not None:
            return torch.ops.mkl._mkl_linear(x, packed.packed, weight, bias, rows)
        if kernel is Gemm.ONEDNN and packed.onednn is not None:
            return onednn_linear(x, packed.onednn, bias, reordered=True)
    if x.dtype == torch.bfloat16 and x.device.type == "cpu":
        return onednn_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def onednn_rows(rows: int) -> int:
    """The row count a oneDNN product runs at (CPU bfloat16, and ONEDNN in float32): `rows`
    rounded up to a step. oneDNN builds a primitive for every new row count, ~0.5 MB
    each for these shapes and 2-15 ms to build here, and keeps up to 1024 of them: a server
    sees a new row count most steps. With the steps below a shape has at most 59 (16 exact,
    15 of 16 rows, 28 of 64), and a padded row costs at most 1/2 of the work from 17 rows,
    1/4 from 257."""
    if rows <= 16:
        return rows
    step = 16 if rows <= 256 else 64
    return -(-rows // step) * step


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  reordered: bool = False) -> torch.Tensor:
    """x @ weight^T (+ bias) at onednn_rows (x padded with zero rows, the padding's outputs
    dropped): F.linear (oneDNN's in bfloat16), or oneDNN's matmul on a `reordered` weight
    (`reorder_for_onednn`)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    padded_rows = onednn_rows(rows)
    if padded_rows == rows:
        padded = x
    else:
        padded = x.new_zeros(padded_rows, x.shape[-1])
        padded[:rows] = x.reshape(rows, x.shape[-1])
    if reordered:
        out = torch.ops.mkldnn._linear_pointwise(padded, weight, bias, "none", [], "")
    else:
        out = F.linear(padded, weight, bias)
    if padded_rows == rows:
        return out
    return out[:rows].view(*x.shape[:-1], weight.shape[0])


def onednn_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN's float32 matmul on a reordered weight: CPU, a torch built with oneDNN."""
    if device.type != "cpu" or dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._linear_pointwise  # noqa: B018 (the lookup raises when it is missing)
        torch.ops.mkldnn._reorder_linear_weight  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return True


def reorder_for_onednn(weight: torch.Tensor) -> torch.Tensor:
    """The weight in oneDNN's layout for its matmul (it serves any row count)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ONEDNN_ROWS_HINT)


class Linear(nn.Module):
    """y = x @ W^T (+ b); weights are loaded, never trained."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        )
        # Set by install_linear_backend (not a buffer: the state dict stays the weights only).
        self.packed: PackedWeight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)


class MergedLinear(Linear):
    """Several projections of the same input stacked into one weight; `split` separates
    the outputs again (one large matmul is faster than several small ones)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(out_sizes), bias)
        self.out_sizes = list(out_sizes)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(y.split(self.out_sizes, dim=-1))


# ---- choosing and installing the backend ----


def packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """MKL's packed sgemm: CPU, float32, a torch built with MKL."""
    if device.type != "cpu" or dtype != torch.float32 or not torch.backends.mkl.is_available():
        return False
    try:
        torch.ops.mkl._mkl_linear  # noqa: B018 (the lookup raises when the op is missing)
    except (AttributeError, RuntimeError):
        return False
    return True


def resolve_linear_backend(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """The backend to install for `requested`: auto falls back to plain where neither packing
    nor the panels can run, panels where the panels cannot; a forced `packed` that cannot run
    is an error."""
    if requested not in LINEAR_BACKENDS:
        raise ValueError(f"unknown linear backend {requested!r} "
                         f"(choose from {', '.join(LINEAR_BACKENDS)})")
    if requested == "panels":
        return "panels" if panels_supported(device, dtype) else "plain"
    if requested == "plain" or packing_supported(device, dtype):
        return requested
    if requested == "auto" and bf16_panels_supported(device, dtype):
        return requested
    if requested == "packed":
        raise ValueError(f"--linear-backend packed needs float32 on a CPU with MKL "
                         f"(got {dtype} on {device})")
    return "plain"


def panels_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """The panel kernel is built and multiplies `dtype` on `device`."""
    return (device.type == "cpu" and bool(cpu_kernels.kernel_dtype(dtype))
            and cpu_kernels.available(device))


def bf16_panels_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """bfloat16 on a CPU that multiplies it natively (elsewhere: the plain torch fallback)."""
    return dtype == torch.bfloat16 and panels_supported(device, dtype)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight in MKL's packed layout (it serves any row count, fastest near the hint)."""
    return torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)


GemmRun = Callable[[torch.Tensor], object]  # runs one kernel on an input x


def candidate_kernels(weight: torch.Tensor, bias: torch.Tensor | None,
                      panels: torch.Tensor | None) -> dict[Gemm, GemmRun]:
    """The kernels a shape's tuning compares (MKL's layout, where MKL serves the dtype, made
    here for the measurement)."""
    candidates: dict[Gemm, GemmRun] = {Gemm.PLAIN: lambda x: linear(x, weight, bias, None)}
    if packing_supported(weight.device, weight.dtype):
        mkl_packed = pack_weight(weight)
        candidates[Gemm.MKL_PACKED] = lambda x: torch.ops.mkl._mkl_linear(
            x, mkl_packed, weight, bias, x.shape[0])
    if panels is not None:
        candidates[Gemm.PANELS] = lambda x: cpu_kernels.panel_linear(x, panels, bias,
                                                                     weight.shape[0])
    if onednn_supported(weight.device, weight.dtype):
        reordered = reorder_for_onednn(weight)
        candidates[Gemm.ONEDNN] = lambda x: onednn_linear(x, reordered, bias, reordered=True)
    return candidates


def tune_policy(weight: torch.Tensor, candidates: dict[Gemm, GemmRun],
                rounds: int = TUNE_ROUNDS, panel_rows: range = range(0)) -> GemmPolicy:
    """Times the candidates at each row bucket (interleaved, best of `rounds`, so all see the
    same machine load) and keeps the fastest (`_fastest`). A bucket whose row counts all lie in
    `panel_rows` is not measured: it takes the panels; one over the budget takes the kernel of
    the bucket below."""
    chosen: list[Gemm] = []
    generator = torch.Generator().manual_seed(0)  # leaves the global RNG alone
    for rows in ROW_BUCKETS:
        smallest = rows // 2 + 1  # the bucket's row counts: smallest .. rows
        if smallest in panel_rows and rows in panel_rows:
            chosen.append(Gemm.PANELS)
            continue
        if rows * weight.shape[0] * weight.shape[1] > TUNE_MAX_MACS:
            chosen.append(chosen[-1] if chosen else Gemm.PLAIN)
            continue
        x = torch.randn(rows, weight.shape[1], dtype=weight.dtype, generator=generator)
        runs = {kernel: run for kernel, run in candidates.items()
                if kernel is not Gemm.ONEDNN or rows <= ONEDNN_MAX_ROWS}
        seconds = best_of_interleaved([partial(run, x) for run in runs.values()], rounds)
        chosen.append(_fastest(dict(zip(runs, seconds, strict=True))))
    return GemmPolicy(tuple(chosen))


def _fastest(seconds: dict[Gemm, float]) -> Gemm:
    """The fastest kernel; MKL-packed only if it beats the fastest other by MIN_GAIN (a copy of
    the weight made for it alone, which only serves the rows where it wins)."""
    others = {kernel: s for kernel, s in seconds.items() if kernel is not Gemm.MKL_PACKED}
    best = min(others, key=others.__getitem__)
    packed_s = seconds.get(Gemm.MKL_PACKED)
    if packed_s is not None and packed_s < others[best] * (1 - MIN_GAIN):
        return Gemm.MKL_PACKED
    return best


def best_of_interleaved(runs: Sequence[Callable[[], object]], rounds: int) -> list[float]:
    """Best time of each run, measured interleaved so that all see the same machine load."""
    best = [float("inf")] * len(runs)
    for run in runs:  # warm-up: first-call allocations are not the steady state
        run()
    for _ in range(rounds):
        for index, run in enumerate(runs):
            start = time.perf_counter()
            run()
            best[index] = min(best[index], time.perf_counter() - start)
    return best


class PolicyCache:
    """Measured policies by shape. One per process (`POLICIES`): every runner built in the
    process (tests build many) reuses the measurements, and layers of one shape share one."""

    def __init__(self) -> None:
        self._policies: dict[GemmShape, GemmPolicy] = {}

    def policy(self, shape: GemmShape, weight: torch.Tensor, bias: torch.Tensor | None,
               panels: torch.Tensor | None) -> GemmPolicy:
        """The cached policy of `shape`, measured on `weight` the first time."""
        if shape not in self._policies:
            self._policies[shape] = tune_policy(
                weight, candidate_kernels(weight, bias, panels),
                panel_rows=unmeasured_panel_rows() if panels is not None else range(0))
        return self._policies[shape]


POLICIES = PolicyCache()




def packable_modules(model: nn.Module) -> Iterator[Linear]:
    """Every projection of the model (the LM head included). The tensor-parallel subclasses
    have their own forward that ignores `packed`: the runner installs plain for them."""
    for module in model.modules():
        if isinstance(module, Linear):
            yield module


def install_linear_backend(model: nn.Module, backend: str,
                           cache: PolicyCache = POLICIES) -> dict[GemmShape, GemmPolicy]:
    """Attaches packed weights and kernel policies to the model's projections per `backend`
    (a resolved one: plain, packed or auto); returns the policy used for each weight shape."""
    policies: dict[GemmShape, GemmPolicy] = {}
    extra_bytes = 0
    with torch.inference_mode():
        for module in packable_modules(model):
            module.packed = None
            if backend == "plain":
                continue
            shape, policy = _attach_packed(module, backend, cache)
            policies[shape] = policy
            layouts = module.packed
            if layouts is not None:
                copies = sum(layout is not None for layout in
                             (layouts.packed, layouts.panels, layouts.onednn))
                extra_bytes += copies * module.weight.numel() * module.weight.element_size()
    for shape, policy in policies.items():
        log.info("linear %dx%d: %s", shape.out_features, shape.in_features, policy.describe())
    if extra_bytes:
        log.info("packed weights: %.0f MiB extra", extra_bytes / 2**20)
    return policies


def _attach_packed(module: Linear, backend: str, cache: PolicyCache
                   ) -> tuple[GemmShape, GemmPolicy]:
    weight, bias = module.weight, module.bias
    use_panels = (backend in ("auto", "panels") and cpu_kernels.available(weight.device)
                  and cpu_kernels.kernel_dtype(weight.dtype))
    shape = GemmShape(weight.shape[0], weight.shape[1], bias is not None,
                      torch.get_num_threads(), use_panels, weight.dtype)
    panels = cpu_kernels.pack_panels(weight) if use_panels else None
    if backend == "packed":
        policy = ALWAYS_MKL_PACKED
    elif backend == "panels":
        policy = panels_then_plain() if panels is not None else ALWAYS_PLAIN
    else:
        policy = cache.policy(shape, weight, bias, panels)
    if policy != ALWAYS_PLAIN:
        module.packed = PackedWeight(
            pack_weight(weight) if policy.uses(Gemm.MKL_PACKED) else None, policy,
            panels if policy.uses(Gemm.PANELS) else None,
            reorder_for_onednn(weight) if policy.uses(Gemm.ONEDNN) else None)
    return shape, policy
