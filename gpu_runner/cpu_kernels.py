"""C++ kernels for the CPU: paged attention that reads the KV cache in place and the panel
linear layers, and the decoder layer's fused elementwise steps; float32 or bfloat16.

- paged_attention (csrc/paged_attention.cpp): the torch path gathers every sequence's blocks
  into padded tensors and runs SDPA over them; on CPU the gather, the padding and SDPA (poor at
  a few query rows per KV head) dominate a decode step and a good part of a prefill. The kernel
  walks each sequence's block table instead, for decodes, fresh prompts and continued chunks.
- add_rms_norm, silu_and_mul and rotate_half (csrc/elementwise.cpp): one pass over the
  activations where torch makes five (the residual add and RMSNorm), two (silu, then the
  product) or six (the rotary embedding in rotate-half layout).
- pack_panels and panel_linear (csrc/panel_linear.cpp): linear layers for few rows (decode),
  streaming the weights from memory while computing, where MKL leaves the memory idle.
- lora_add (csrc/lora.cpp): every LoRA adapter group of a batch through one fused projection
  in one call, where torch takes two small matmuls per group.

It is built on first use with torch.utils.cpp_extension (JIT, cached in the default torch
extensions folder, so later processes only load it). It is compiled with -march=native: the
build runs on the machine that uses it, and the extension's name carries a fingerprint of the
CPU's features so that a cache folder shared with another kind of CPU gets its own build, and
one of every file in csrc/ (torch rebuilds when a listed source changes, not a header).
When anything is missing (a compiler, ninja, a failing build), `available()` is False, one
warning says why, and callers keep the torch path.

bfloat16: the kernels read bfloat16 and compute in float32, but a bfloat16 runner is fast only
where the CPU multiplies bfloat16 itself (AVX512_BF16 or AMX: oneDNN's GEMMs for many rows).
Elsewhere, or with PAGEWIRE_FORCE_BF16_FALLBACK=1 (how tests simulate such a CPU), bfloat16
runs on plain torch throughout (`bf16_native()` is False): correct, only slower.

A container image builds the kernel once, at image build time, into its TORCH_EXTENSIONS_DIR,
and runs it from there with a read-only file system (see the Dockerfile):
- $PAGEWIRE_CPU_KERNEL_MARCH (default `native`) is the -march target. An image built on one
  machine and run on others sets a portable one (e.g. `x86-64-v3`); the extension's name then
  carries the target instead of the build machine's CPU fingerprint, so every node finds it.
- A finished build in a folder this process cannot write is imported directly:
  cpp_extension.load would first create a lock file there, and fail.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import re
import threading
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = [_CSRC / name for name in ("bindings.cpp", "paged_attention.cpp", "elementwise.cpp",
                                       "panel_linear.cpp", "lora.cpp")]
_MARCH_ENV = "PAGEWIRE_CPU_KERNEL_MARCH"
FORCE_BF16_FALLBACK_ENV = "PAGEWIRE_FORCE_BF16_FALLBACK"
# /proc/cpuinfo flags of the instructions that multiply bfloat16 (Zen 4 and Cooper Lake on;
# AMX on Sapphire Rapids on).
_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
_LDFLAGS = ["-fopenmp"]

_lock = threading.Lock()
_module: ModuleType | None = None
_failure: str | None = None  # why the build failed; set once, never retried


@functools.cache
def _cpuinfo() -> list[str]:
    """The lines of /proc/cpuinfo (empty where there is none: not Linux)."""
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def _cpu_fingerprint() -> str:
    """A short hash of the CPU's model and feature flags (the target of -march=native)."""
    lines = _cpuinfo()
    if not lines:
        return "generic"
    wanted = [line for line in lines if line.startswith(("model name", "flags"))][:2]
    return hashlib.sha1("\n".join(wanted).encode()).hexdigest()[:10]


def _sources_fingerprint() -> str:
    """A short hash of every source and header the extension is built from."""
    digest = hashlib.sha1()
    for path in sorted(_CSRC.iterdir()):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:8]


def _march() -> str:
    """The -march target: $PAGEWIRE_CPU_KERNEL_MARCH, else the CPU that builds it."""
    return os.environ.get(_MARCH_ENV, "").strip() or "native"


def _extension_name() -> str:
    """Keyed by the code's target (this CPU for `native`) and by the sources."""
    march = _march()
    target = _cpu_fingerprint() if march == "native" else re.sub(r"\W", "_", march)
    return f"pagewire_cpu_kernels_{target}_{_sources_fingerprint()}"


def _build() -> ModuleType:
    from torch.utils import cpp_extension  # imported here: it is slow and pulls setuptools

    name = _extension_name()
    # The folder torch builds `name` in (created when missing): $TORCH_EXTENSIONS_DIR/name,
    # or a per-Python, per-accelerator folder under ~/.cache/torch_extensions.
    folder = Path(cpp_extension._get_build_directory(name, verbose=False))
    prebuilt = _import_prebuilt(name, folder)
    if prebuilt is not None:
        return prebuilt
    return cpp_extension.load(
        name=name,
        sources=[str(source) for source in _SOURCES],
        extra_cflags=["-O3", f"-march={_march()}", "-fopenmp", "-Wno-psabi"],
        extra_ldflags=_LDFLAGS,
        verbose=False,
    )


def _import_prebuilt(name: str, folder: Path) -> ModuleType | None:
    """The finished extension in a folder this process cannot write (a container image's
    read-only TORCH_EXTENSIONS_DIR), imported directly; None where load() can run."""
    library = folder / f"{name}.so"
    if os.access(folder, os.W_OK) or not library.is_file():
        return None
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load() -> ModuleType | None:
    """Builds or loads the extension once per process; None (and one warning) on failure."""
    global _module, _failure
    if _module is not None or _failure is not None:
        return _module
    with _lock:
        if _module is None and _failure is None:
            try:
                _module = _build()
            except Exception as error:  # any build or load failure means: use the torch path
                _failure = f"{type(error).__name__}: {error}".strip()
                log.warning("C++ CPU kernels unavailable, using the torch path: %s",
                            _failure[:2000])
    return _module


def available(device: torch.device | str = "cpu") -> bool:
    """True when the kernel can run on `device` (CPU only); builds it on the first call."""
    if device != "cpu" and torch.device(device).type != "cpu":  # the str test: per-call cost
        return False
    return _load() is not None


def failure_reason() -> str | None:
    """Why the kernel could not be built or loaded (None when it was, or was not tried)."""
    return _failure


def supports(*tensors: torch.Tensor) -> bool:
    """True when the kernels take these tensors: on the CPU, all of one kernel dtype."""
    dtype = tensors[0].dtype
    if not kernel_dtype(dtype):
        return False
    return all(t.dtype == dtype and t.device.type == "cpu" for t in tensors)


def bf16_native() -> bool:
    """True when this CPU multiplies bfloat16 in hardware and no fallback is forced."""
    return bf16_fallback_reason() is None


@functools.cache
def bf16_fallback_reason() -> str | None:
    """Why bfloat16 runs on plain torch here (None: it does not). Decided once per process,
    like the CPU's flags (it is asked several times per layer); tests that set the variable
    clear the cache."""
    if os.environ.get(FORCE_BF16_FALLBACK_ENV, "").strip() not in ("", "0"):
        return f"{FORCE_BF16_FALLBACK_ENV} is set"
    if not _cpu_has_bf16():
        return "this CPU has no bfloat16 instructions (avx512_bf16 / amx_bf16)"
    return None


def _cpu_has_bf16() -> bool:
    lines = _cpuinfo()
    if not lines:  # not Linux: ask oneDNN (it checks the AVX-512 base, not BF16 itself)
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    flags = next((line for line in lines if line.startswith("flags")), "").split()
    return any(flag in flags for flag in _BF16_FLAGS)


@functools.cache
def wide_vectors() -> bool:
    """True when the kernels were built for AVX-512, whose 32 registers each hold one of
    their 16-lane vectors: the register tiles are sized for it. Built for AVX2 (16 registers,
    two per vector) the attention kernel's prefill tiles spill and run 3-4x slower than
    torch's SDPA, and the panels lose to MKL from 16 rows on (bench/cpu_attention.py,
    bench/linear.py on an AVX2-only EPYC)."""
    return available() and _require().vector_registers() == 1


def kernel_dtype(dtype: torch.dtype) -> bool:
    """True when the attention and panel kernels serve `dtype`: float32, and bfloat16 on a
    CPU that multiplies it natively (elsewhere bfloat16 stays on plain torch)."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and bf16_native())


def paged_attention(
    query: torch.Tensor,  # [tokens, heads, head_dim] float32 or bfloat16; head_dim contiguous
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim], query's dtype
    value_cache: torch.Tensor,  # same shape as key_cache
    block_tables: torch.Tensor,  # [seqs, max_blocks] int; entries past a context ignored
    context_lens: torch.Tensor,  # [seqs] int: keys per sequence, its new tokens' included
    query_start_locs: torch.Tensor,  # [seqs + 1] int: sequence i's tokens are rows [s_i, s_i+1)
    scale: float,
) -> torch.Tensor:
    """The new tokens of each sequence attend causally over its first context_lens keys: new
    token j of a sequence with n new tokens sits at position context_len - n + j and sees the
    keys up to it. Their K/V must already be in the cache.

    Returns [tokens, heads, head_dim]. Query head h uses KV head h // (heads // kv_heads).
    Raises RuntimeError when the kernel is unavailable or the inputs are invalid.
    """
    if query.stride(-1) != 1:
        query = query.contiguous()
    return _require().paged_attention(  # type: ignore[no-any-return]
        query, key_cache, value_cache, block_tables, context_lens, query_start_locs,
        float(scale))


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """residual += x (in place), then returns rms_norm(residual) * weight as a new tensor.
    x and residual: [rows, width] with contiguous rows; weight: [width]; all one dtype."""
    return _require().add_rms_norm(x, residual, weight, float(eps))  # type: ignore[no-any-return]


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[rows, 2 * width] = [gate | up] -> a new [rows, width] silu(gate) * up."""
    return _require().silu_and_mul(gate_up)  # type: ignore[no-any-return]


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, dim] (dim contiguous) -> a new x * cos + rotate_half(x) * sin, with
    cos and sin [tokens, dim / 2] (any shape of that many values, contiguous)."""
    return _require().rotate_half(x, cos, sin)  # type: ignore[no-any-return]


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> the panel layout panel_linear reads: [ceil(N / 16), K, 16], or in
    bfloat16 on a CPU with AVX512_BF16 pairs of k, [ceil(N / 16), ceil(K / 2), 32]."""
    return _require().pack_panels(weight)  # type: ignore[no-any-return]


def panel_linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None,
                 out_features: int) -> torch.Tensor:
    """x [..., K] @ weight^T (+ bias) -> [..., out_features], the weight given as its panels."""
    if x.dim() == 2 and x.is_contiguous():  # the decoder's case: no reshaping
        return _require().panel_linear(x, panels, bias, out_features)  # type: ignore[no-any-return]
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    y = _require().panel_linear(rows, panels, bias, out_features)
    return y.view(*x.shape[:-1], out_features)  # type: ignore[no-any-return]


def lora_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
             index: tuple[torch.Tensor, ...]) -> None:
    """y += each adapter group's LoRA product of x, in place (float32). `index` is (rows,
    group_starts, group_slots, part_rows, ranks, part_offsets): see gpu_runner/lora/slots.py."""
    _require().lora_add(y, x, a, bt, *index)


def _require() -> ModuleType:
    module = _load()
    if module is None:
        raise RuntimeError(f"C++ CPU kernels unavailable: {_failure}")
    return module
