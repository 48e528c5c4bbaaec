"""C++ kernels for the CPU: paged attention that reads the KV cache in place.

The torch path gathers every sequence's blocks into padded tensors and runs SDPA over them;
on CPU the gather, the padding and SDPA (poor at a few query rows per KV head) dominate a
decode step and a good part of a prefill. The kernel in csrc/paged_attention.cpp walks each
sequence's block table instead, for decodes, fresh prompts and continued chunks alike.

It is built on first use with torch.utils.cpp_extension (JIT, cached in the default torch
extensions folder, so later processes only load it). It is compiled with -march=native: the
build runs on the machine that uses it, and the extension's name carries a fingerprint of the
CPU's features so that a cache folder shared with another kind of CPU gets its own build.
When anything is missing (a compiler, ninja, a failing build), `available()` is False, one
warning says why, and callers keep the torch path.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "paged_attention.cpp"
_CFLAGS = ["-O3", "-march=native", "-fopenmp"]
_LDFLAGS = ["-fopenmp"]

_lock = threading.Lock()
_module: ModuleType | None = None
_failure: str | None = None  # why the build failed; set once, never retried


def _cpu_fingerprint() -> str:
    """A short hash of the CPU's model and feature flags (the target of -march=native)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "generic"
    wanted = [line for line in lines if line.startswith(("model name", "flags"))][:2]
    return hashlib.sha1("\n".join(wanted).encode()).hexdigest()[:10]


def _build() -> ModuleType:
    from torch.utils import cpp_extension  # imported here: it is slow and pulls setuptools

    return cpp_extension.load(
        name=f"pagewire_cpu_kernels_{_cpu_fingerprint()}",
        sources=[str(_SOURCE)],
        extra_cflags=_CFLAGS,
        extra_ldflags=_LDFLAGS,
        verbose=False,
    )


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
    if torch.device(device).type != "cpu":
        return False
    return _load() is not None


def failure_reason() -> str | None:
    """Why the kernel could not be built or loaded (None when it was, or was not tried)."""
    return _failure


def supports(query: torch.Tensor, cache: torch.Tensor) -> bool:
    """True when the kernel handles these tensors (float32 on the CPU)."""
    return (query.device.type == "cpu" and query.dtype == torch.float32
            and cache.dtype == torch.float32)


def paged_attention(
    query: torch.Tensor,  # [tokens, heads, head_dim] float32; head_dim contiguous
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim] float32
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
    module = _load()
    if module is None:
        raise RuntimeError(f"C++ CPU kernels unavailable: {_failure}")
    if query.stride(-1) != 1:
        query = query.contiguous()
    return module.paged_attention(query, key_cache, value_cache, block_tables, context_lens,
                                  query_start_locs, float(scale))
