"""Triton kernels of the `triton` attention backend: KV store, paged decode, paged prefill.

Compiled on CUDA tensors. Tensors on other devices (CPU, in tests) need the Triton
interpreter, i.e. TRITON_INTERPRET=1 set before triton is first imported in the process;
without it a launch raises a RuntimeError that says so (see `_launch`).
"""

from gpu_runner.kernels.decode_attention import paged_decode_attention
from gpu_runner.kernels.kv_store import store_kv
from gpu_runner.kernels.prefill_attention import paged_prefill_attention

__all__ = ["paged_decode_attention", "paged_prefill_attention", "store_kv"]
