"""Projections (including the fused ones: q/k/v in one matmul, gate/up in another) and the
CPU GEMM dispatch that picks, per call, between plain, MKL-packed and panel-packed weights.

Panels first: with PANEL_ROWS rows (decode batches) a CPU float32 projection goes through the
C++ panel kernel (gpu_runner/cpu_kernels.py, csrc/panel_linear.cpp), which streams
the weight from memory while it computes; at these row counts every decode step reads all the
weights, which do not fit in the cache, and MKL leaves the memory idle (12-24 % slower from 4
to 48 rows, ~8 % at 64, measured over all of SmolLM2-135M's layers with bench/linear.py; at 1
and 2 rows MKL is 2-10 % faster and keeps them). It is not measured
per machine at load like the MKL choice below: a load-time measurement repeats one weight,
which then sits in the cache, the one case where the panels have no edge. `--linear-backend
packed` (MKL for every row count) and `plain` do without them.

Above the panels' rows (and where the C++ kernels cannot be built), between plain and
MKL-packed weights: on CPU, `F.linear` (MKL sgemm) re-packs the weight into MKL's internal layout
on every call. With few rows (decode: one row per sequence) that packing is most of the time;
a weight packed once at load (`torch.ops.mkl._mkl_reorder_linear_weight`, multiplied with
`torch.ops.mkl._mkl_linear`) skips it and is up to 2-3x faster. With many rows (prefill) the
packed path is slower than plain sgemm, and where the crossover lies depends on the weight's
shape. So the choice is measured once per weight shape (N, K) at load over power-of-two row
buckets (`tune_policy`), and each call rounds its row count up to a bucket and looks it up.

Cost: each packed layout is another copy of the weight (panels: +100 % of the weight memory;
MKL's, for the shapes whose measured policy uses it outside PANEL_ROWS: up to +100 % more;
~+0.5 GB each for SmolLM2-135M in float32). CPU float32 only: CUDA and other dtypes always use
plain `F.linear`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.nn import functional as F

from gpu_runner import cpu_kernels

log = logging.getLogger(__name__)

# `--linear-backend`: auto = panels for PANEL_ROWS rows, elsewhere MKL-packed where measured
# faster (CPU float32), else plain; packed = MKL-packed for every row count up to the last
# bucket (no measurement, no panels); plain = off.
LINEAR_BACKENDS = ("auto", "packed", "plain")
# The row counts that go through the panel kernel (where bench/linear.py measured it faster).
PANEL_ROWS = range(3, 65)

# Row counts are rounded up to a power of two; above the last bucket (or above a shape's
# measuring budget, TUNE_MAX_MACS) plain sgemm is used: there the two tie on the shapes seen.
ROW_BUCKETS = tuple(2**i for i in range(12))  # 1 .. 2048
# A bucket is measured only if rows * N * K stays under this (it bounds the start-up cost:
# the 49152x576 lm_head is measured up to 256 rows, the decoder's weights up to 2048).
TUNE_MAX_MACS = 1 << 33
# MKL lays the packed weight out for this many rows. The hint matters: on SmolLM2's shapes a
# hint of 256 is at least as fast as plain sgemm from 4 to 2048 rows, while a hint of 8 is
# up to 1.5x slower than plain from 256 rows on.
PACK_ROWS_HINT = 256
# Packed must beat plain by this fraction to be chosen: a tie keeps plain (no extra memory).
MIN_GAIN = 0.05
TUNE_ROUNDS = 5
# Once packed has won and then lost at this many consecutive larger buckets, the larger ones
# are not measured (past its winning range it only gets worse with more rows); this keeps the
# lm_head's tuning short. Not before a win: packed often ties at 1-2 rows and wins at 4-32.
STOP_AFTER_LOSSES = 2


@dataclass(frozen=True)
class PackPolicy:
    """For one weight shape: whether the packed weight is used at each row bucket."""

    packed_buckets: tuple[bool, ...]  # aligned with ROW_BUCKETS

    def uses_packed(self, rows: int) -> bool:
        bucket = (rows - 1).bit_length()  # the index of the smallest 2**i >= rows
        return rows > 0 and bucket < len(self.packed_buckets) and self.packed_buckets[bucket]

    @property
    def packs_any(self) -> bool:
        return any(self.packed_buckets)

    def describe(self) -> str:
        """The row buckets that use the packed weight, e.g. "buckets 1,2,4,8" or "none"."""
        chosen = [str(ROW_BUCKETS[i]) for i, packed in enumerate(self.packed_buckets) if packed]
        return ("buckets " + ",".join(chosen)) if chosen else "none"


ALWAYS_PACKED = PackPolicy(tuple(True for _ in ROW_BUCKETS))
NEVER_PACKED = PackPolicy(tuple(False for _ in ROW_BUCKETS))


@dataclass(frozen=True)
class GemmShape:
    """What a packing decision depends on, on one machine (the thread count included)."""

    out_features: int
    in_features: int
    has_bias: bool
    threads: int
    panels: bool  # the panel kernel takes PANEL_ROWS rows: MKL is measured for the others


@dataclass
class PackedWeight:
    """A weight's packed layouts, and when to use them (attached to one Linear or LM head)."""

    packed: torch.Tensor | None  # MKL's opaque packed layout (None: the policy packs none)
    policy: PackPolicy  # when to use `packed`
    panels: torch.Tensor | None = None  # the panel kernel's layout, used for PANEL_ROWS rows


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: PackedWeight | None) -> torch.Tensor:
    """y = x @ weight^T (+ bias), through a packed layout where it is the faster one for x's
    row count."""
    if packed is not None:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if packed.panels is not None and rows in PANEL_ROWS:
            return cpu_kernels.panel_linear(x, packed.panels, bias, weight.shape[0])
        if packed.packed is not None and packed.policy.uses_packed(rows):
            return torch.ops.mkl._mkl_linear(x, packed.packed, weight, bias, rows)
    return F.linear(x, weight, bias)


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
    """The backend to install for `requested`: auto falls back to plain where packing cannot
    run; a forced `packed` that cannot run is an error."""
    if requested not in LINEAR_BACKENDS:
        raise ValueError(f"unknown linear backend {requested!r} "
                         f"(choose from {', '.join(LINEAR_BACKENDS)})")
    if requested == "plain" or packing_supported(device, dtype):
        return requested
    if requested == "packed":
        raise ValueError(f"--linear-backend packed needs float32 on a CPU with MKL "
                         f"(got {dtype} on {device})")
    return "plain"


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight in MKL's packed layout (it serves any row count, fastest near the hint)."""
    return torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)


def tune_policy(weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor,
                rounds: int = TUNE_ROUNDS, skip_rows: range = range(0)) -> PackPolicy:
    """Times plain vs packed at each row bucket (interleaved, best of `rounds`, so both see
    the same machine load) and keeps packed where it wins by MIN_GAIN. A bucket whose row
    counts all lie in `skip_rows` (the panels' rows) is not measured and never packed."""
    chosen: list[bool] = []
    losses_after_win = 0
    generator = torch.Generator().manual_seed(0)  # leaves the global RNG alone
    for rows in ROW_BUCKETS:
        smallest = rows // 2 + 1  # the bucket's row counts: smallest .. rows
        if ((smallest in skip_rows and rows in skip_rows)
                or losses_after_win >= STOP_AFTER_LOSSES
                or rows * weight.shape[0] * weight.shape[1] > TUNE_MAX_MACS):
            chosen.append(False)
            continue
        x = torch.randn(rows, weight.shape[1], dtype=weight.dtype, generator=generator)
        plain_s, packed_s = _best_of_interleaved(
            partial(F.linear, x, weight, bias),
            partial(torch.ops.mkl._mkl_linear, x, packed, weight, bias, rows),
            rounds)
        wins = packed_s < plain_s * (1 - MIN_GAIN)
        losses_after_win = 0 if wins else losses_after_win + (1 if any(chosen) else 0)
        chosen.append(wins)
    return PackPolicy(tuple(chosen))


def _best_of_interleaved(first: Callable[[], object], second: Callable[[], object],
                         rounds: int) -> tuple[float, float]:
    best = [float("inf"), float("inf")]
    first()  # warm-up: first-call allocations are not the steady state
    second()
    for _ in range(rounds):
        for index, run in enumerate((first, second)):
            start = time.perf_counter()
            run()
            best[index] = min(best[index], time.perf_counter() - start)
    return best[0], best[1]


class PolicyCache:
    """Measured policies by shape. One per process (`POLICIES`): every runner built in the
    process (tests build many) reuses the measurements, and layers of one shape share one."""

    def __init__(self) -> None:
        self._policies: dict[GemmShape, PackPolicy] = {}

    def policy(self, shape: GemmShape, weight: torch.Tensor, bias: torch.Tensor | None
               ) -> PackPolicy:
        """The cached policy of `shape`, measured on `weight` the first time."""
        if shape not in self._policies:
            self._policies[shape] = tune_policy(
                weight, bias, pack_weight(weight),
                skip_rows=PANEL_ROWS if shape.panels else range(0))
        return self._policies[shape]


POLICIES = PolicyCache()


def packable_modules(model: nn.Module) -> Iterator[Linear]:
    """Every projection of the model (the LM head included). The tensor-parallel subclasses
    have their own forward that ignores `packed`: the runner installs plain for them."""
    for module in model.modules():
        if isinstance(module, Linear):
            yield module


def install_linear_backend(model: nn.Module, backend: str,
                           cache: PolicyCache = POLICIES) -> dict[GemmShape, PackPolicy]:
    """Attaches packed weights to the model's projections per `backend` (a resolved one:
    plain, packed or auto); returns the policy used for each weight shape."""
    policies: dict[GemmShape, PackPolicy] = {}
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
                copies = (layouts.packed is not None) + (layouts.panels is not None)
                extra_bytes += copies * module.weight.numel() * module.weight.element_size()
    for shape, policy in policies.items():
        log.info("linear %dx%d: %sMKL-packed weight at %s", shape.out_features,
                 shape.in_features,
                 f"panels at {PANEL_ROWS.start}-{PANEL_ROWS.stop - 1} rows, "
                 if shape.panels else "",
                 policy.describe())
    if extra_bytes:
        log.info("packed weights: %.0f MiB extra", extra_bytes / 2**20)
    return policies


def _attach_packed(module: Linear, backend: str, cache: PolicyCache
                   ) -> tuple[GemmShape, PackPolicy]:
    weight, bias = module.weight, module.bias
    use_panels = backend == "auto" and cpu_kernels.available(weight.device)
    shape = GemmShape(weight.shape[0], weight.shape[1], bias is not None,
                      torch.get_num_threads(), use_panels)
    policy = ALWAYS_PACKED if backend == "packed" else cache.policy(shape, weight, bias)
    mkl_packed = pack_weight(weight) if policy.packs_any else None
    panels = cpu_kernels.pack_panels(weight) if use_panels else None
    if mkl_packed is not None or panels is not None:
        module.packed = PackedWeight(mkl_packed, policy, panels)
    return shape, policy
