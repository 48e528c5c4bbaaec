"""Which attention backend a runner uses, and installing it into a built model.

`auto` picks flash-attn when it imports on CUDA, else the Triton kernels on CUDA, else the
plain torch backend (the only one that runs on CPU without the Triton interpreter).
`--attention-backend torch|triton|flash_attn` forces one; a forced backend that cannot run
here is refused at start with the reason.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any, Protocol

import torch

from gpu_runner.attention.metadata import AttentionMetadata

if TYPE_CHECKING:
    from gpu_runner.models.llama import LlamaForCausalLM

BACKEND_CHOICES = ("auto", "torch", "triton", "flash_attn")


class AttentionBackend(Protocol):
    """What the model's attention layers call: plan once per batch, forward per layer."""

    name: str

    def plan(self, meta: AttentionMetadata) -> Any: ...

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                layer_cache: torch.Tensor, plan: Any) -> torch.Tensor: ...


class BackendSelectionError(ValueError):
    """The requested backend cannot run with these settings."""


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def choose_backend(requested: str, device: torch.device, block_size: int) -> str:
    """The backend name to use for `requested` ("auto" or a forced name)."""
    if requested not in BACKEND_CHOICES:
        raise BackendSelectionError(
            f"unknown attention backend {requested!r} (choose from {', '.join(BACKEND_CHOICES)})")
    if requested == "auto":
        if device.type != "cuda":
            return "torch"
        if flash_attn_available():
            # flash-attn's paged KV needs blocks of a multiple of 256 tokens: with smaller
            # blocks auto falls back to Triton instead of refusing to start.
            from gpu_runner.attention.flash_attn_backend import block_size_problem

            if block_size_problem(block_size) is None:
                return "flash_attn"
        return "triton" if triton_available() else "torch"
    if requested == "flash_attn":
        _require_flash_attn(device, block_size)
    return requested


def _require_flash_attn(device: torch.device, block_size: int) -> None:
    from gpu_runner.attention.flash_attn_backend import block_size_problem

    problem = block_size_problem(block_size)
    if problem is not None:
        raise BackendSelectionError(problem)
    if device.type != "cuda":
        raise BackendSelectionError("the flash_attn backend needs a CUDA device")
    if not flash_attn_available():
        raise BackendSelectionError(
            "the flash_attn backend needs the flash-attn package (pip install 'pagewire[gpu]')")


def make_backend(name: str, num_heads: int, num_kv_heads: int, head_dim: int
                 ) -> AttentionBackend:
    """A backend instance for the (possibly tensor-parallel shard of the) attention shape."""
    if name == "torch":
        from gpu_runner.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(num_heads, num_kv_heads, head_dim)
    if name == "triton":
        from gpu_runner.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(num_heads, num_kv_heads, head_dim)
    if name == "flash_attn":
        from gpu_runner.attention.flash_attn_backend import FlashAttentionBackend

        return FlashAttentionBackend(num_heads, num_kv_heads, head_dim)
    raise BackendSelectionError(f"unknown attention backend {name!r}")


def install_backend(model: LlamaForCausalLM, backend: AttentionBackend) -> None:
    """Makes `model` and every attention layer use `backend`."""
    from gpu_runner.models.llama import Attention

    model.backend = backend
    for module in model.modules():
        if isinstance(module, Attention):
            module.backend = backend
