"""Compile every kernel for an sm_90 GPU without one: ``python -m <this module> DTYPE...``.

Runs Triton's whole pipeline (front end, TTIR/TTGIR, LLVM, PTX, ptxas) on model-like
constants, so mistakes only the compiler sees (types, shapes, tl.dot limits) fail on a CPU
machine too. Must run in a process where triton was imported without TRITON_INTERPRET.
Prints one "<kernel> ok" line per compiled kernel.
"""

from __future__ import annotations

import sys
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource

from gpu_runner.kernels import decode_attention, kv_store, prefill_attention

TARGET = GPUTarget("cuda", 90, 32)


def compile_kernel(kernel: Any, pointer_types: dict[str, str], constants: dict[str, Any]) -> int:
    """Compiles `kernel`; other non-constant arguments are int32. Returns the cubin size."""
    signature = {
        name: "constexpr" if name in constants else pointer_types.get(name, "i32")
        for name in kernel.arg_names
    }
    compiled = triton.compile(ASTSource(kernel, signature, constants), target=TARGET)
    return len(compiled.asm["cubin"])


def compile_all(dtype: str, index: str) -> None:
    data = "*" + dtype
    upcast = dtype == "fp32"
    # Native 16-bit tiles as the launcher picks them; float32 (FMA dots) with smaller tiles
    # to keep the compile short.
    tile = 32 if upcast else 64
    dot = {"UPCAST_DOT": upcast, "DOT_PRECISION": "ieee" if upcast else "tf32"}
    cache = {"k_cache_ptr": data, "v_cache_ptr": data, "block_tables_ptr": index}
    partials = {"part_max_ptr": "*fp32", "part_sum_ptr": "*fp32", "part_out_ptr": "*fp32"}
    kernels: dict[str, tuple[Any, dict[str, str], dict[str, Any]]] = {
        "store_kv": (
            kv_store._store_kv_kernel,
            {"key_ptr": data, "value_ptr": data, "k_cache_ptr": data, "v_cache_ptr": data,
             "slot_mapping_ptr": "*i64"},
            {"BLOCK_SIZE": 16, "HEADS_PAD": 8, "HEAD_DIM_PAD": 128},
        ),
        "decode_partition": (
            decode_attention._decode_partition_kernel,
            {"query_ptr": data, "out_ptr": data, "context_lens_ptr": index,
             "qk_scale_log2": "fp32", **cache, **partials},
            {"GROUPS": 4, "GROUPS_PAD": 16, "HEAD_DIM_PAD": 128, "BLOCK_SIZE": 16,
             "PARTITION_SIZE": 512, "TILE_N": tile, "WRITE_FINAL": False,
             **dot},
        ),
        "decode_reduce": (
            decode_attention._decode_reduce_kernel,
            {"out_ptr": data, "context_lens_ptr": index, **partials},
            {"PARTITION_SIZE": 512, "PARTITIONS_PAD": 8,
             "HEAD_DIM_PAD": 128},
        ),
        "prefill": (
            prefill_attention._prefill_kernel,
            {"query_ptr": data, "out_ptr": data, "query_start_loc_ptr": index,
             "context_lens_ptr": index, "qk_scale_log2": "fp32", **cache},
            {"GROUPS": 4, "HEAD_DIM_PAD": 128, "BLOCK_SIZE": 256, "BLOCK_M": tile,
             "BLOCK_N": tile, **dot},
        ),
    }  # fmt: skip
    for name, (kernel, pointer_types, constants) in kernels.items():
        size = compile_kernel(kernel, pointer_types, constants)
        print(f"{dtype} {name} ok ({size} bytes of cubin)", flush=True)


if __name__ == "__main__":
    # bf16 with int64 metadata (the runner's), fp32 with int32: both tl.dot paths and both
    # index types.
    for dtype_name in sys.argv[1:]:
        compile_all(dtype_name, "*i32" if dtype_name == "fp32" else "*i64")
