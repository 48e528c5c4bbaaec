"""Paged decode and prefill attention against a float64 torch reference.

CPU cases run through the Triton interpreter in the worker process (conftest.py); the same
cases run compiled on CUDA when a GPU is present, bfloat16 included (GPU only: the
interpreter multiplies bfloat16 wrongly inside tl.dot).
"""

from __future__ import annotations

import pytest

from tests.gpu_runner.kernels.cases import (
    AttentionSpec,
    bad_attention_messages,
    run_decode_case,
    run_generation_case,
    run_prefill_case,
)
from tests.gpu_runner.kernels.paged_reference import CUDA

TOLERANCE = {"fp32": 1e-3, "fp16": 1e-3, "bf16": 1e-2}
# Ends mid-block, exactly one block, a single token, longer than several blocks.
DECODE_CONTEXTS = (37, 16, 1, 100)


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("groups", [1, 3, 8])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(
    ("partition_size", "tile_size"),
    [(512, 32), (32, 16)],  # one partition; several (up to 4) merged by the reduce kernel
    ids=["one-partition", "partitions"],
)
def test_decode_matches_reference(
    interpreter, dtype: str, groups: int, block_size: int, partition_size: int, tile_size: int
) -> None:
    spec = AttentionSpec(
        context_lens=DECODE_CONTEXTS,
        block_size=block_size,
        kv_heads=2 if groups < 8 else 1,
        groups=groups,
        head_dim=24 if groups == 3 else 32,
        dtype=dtype,
        partition_size=partition_size,
        tile_size=tile_size,
    )
    assert interpreter.run(run_decode_case, spec) <= TOLERANCE[dtype]


@pytest.mark.parametrize("block_size", [1, 256])
def test_decode_with_extreme_block_sizes(interpreter, block_size: int) -> None:
    spec = AttentionSpec(context_lens=(40, 7), block_size=block_size, groups=3, head_dim=16,
                         partition_size=32, tile_size=16)  # fmt: skip
    assert interpreter.run(run_decode_case, spec) <= TOLERANCE["fp32"]


def test_int64_block_tables_and_lengths_as_the_runner_keeps_them(interpreter) -> None:
    decode = AttentionSpec(context_lens=(40, 7), groups=3, head_dim=16, index_dtype="int64",
                           partition_size=16, tile_size=16)  # fmt: skip
    assert interpreter.run(run_decode_case, decode) <= TOLERANCE["fp32"]
    prefill = AttentionSpec(context_lens=(40, 7), query_lens=(20, 7), groups=3, head_dim=16,
                            index_dtype="int64")  # fmt: skip
    assert interpreter.run(run_prefill_case, prefill) <= TOLERANCE["fp32"]


def test_decode_of_an_empty_padded_slot_gives_zeros(interpreter) -> None:
    # A batch slot with context 0 (the runner's padding) must not produce NaN.
    for partition_size in (512, 16):
        spec = AttentionSpec(context_lens=(0, 20, 33), head_dim=16,
                             partition_size=partition_size, tile_size=16)  # fmt: skip
        assert interpreter.run(run_decode_case, spec) <= TOLERANCE["fp32"]


# (context_len, query_len) per sequence: prefill from position 0, after a cached prefix,
# a one-token chunk, a chunk ending mid-block.
PREFILL_SEQUENCES = ((37, 37), (70, 25), (17, 1), (50, 50))


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("groups", [1, 3, 8])
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_matches_reference(interpreter, dtype: str, groups: int, block_size: int) -> None:
    spec = AttentionSpec(
        context_lens=tuple(context for context, _ in PREFILL_SEQUENCES),
        query_lens=tuple(query for _, query in PREFILL_SEQUENCES),
        block_size=block_size,
        kv_heads=2 if groups < 8 else 1,
        groups=groups,
        head_dim=24 if groups == 3 else 16,
        dtype=dtype,
        block_m=32 if block_size == 32 else 16,
        block_n=16 if block_size == 32 else 32,
    )
    assert interpreter.run(run_prefill_case, spec) <= TOLERANCE[dtype]


@pytest.mark.parametrize("block_size", [1, 256])
def test_prefill_with_extreme_block_sizes(interpreter, block_size: int) -> None:
    spec = AttentionSpec(context_lens=(45, 20), query_lens=(30, 20), block_size=block_size,
                         groups=3, head_dim=16)  # fmt: skip
    assert interpreter.run(run_prefill_case, spec) <= TOLERANCE["fp32"]


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_store_then_prefill_chunks_then_decode(interpreter, dtype: str) -> None:
    spec = AttentionSpec(context_lens=(45, 20, 64), groups=3, head_dim=24, dtype=dtype,
                         partition_size=16, tile_size=16)  # fmt: skip
    outcome = interpreter.run(run_generation_case, spec)
    assert outcome.prefill_error <= TOLERANCE[dtype]
    assert outcome.chunk_error <= TOLERANCE[dtype]
    assert outcome.decode_error <= TOLERANCE[dtype]


def test_malformed_inputs_get_clear_errors(interpreter) -> None:
    messages = interpreter.run(bad_attention_messages)
    assert "block_size must be a power of two; got 12" in messages["block_size"]
    assert "must share one of" in messages["dtype"]
    assert "q_heads must be a multiple of kv_heads" in messages["heads"]
    assert "must be a multiple of tile_size" in messages["tiling"]
    assert "query_start_loc [B + 1]" in messages["starts"]


# Compiled on CUDA, at model-like sizes (head_dim 80 is padded to 128).
CUDA_SHAPES = pytest.mark.parametrize(
    ("groups", "block_size", "head_dim"), [(1, 16, 128), (8, 256, 64), (4, 32, 80)]
)


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@CUDA_SHAPES
def test_decode_compiled_on_cuda(dtype: str, groups: int, block_size: int, head_dim: int) -> None:
    for contexts, partition_size in (((1, 333, 2048, 4000), 512), ((0, 777, 5), 256)):
        spec = AttentionSpec(context_lens=contexts, block_size=block_size, kv_heads=2,
                             groups=groups, head_dim=head_dim, dtype=dtype, device="cuda",
                             partition_size=partition_size, tile_size=64)  # fmt: skip
        assert run_decode_case(spec) <= TOLERANCE[dtype], spec


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@CUDA_SHAPES
def test_prefill_compiled_on_cuda(dtype: str, groups: int, block_size: int, head_dim: int) -> None:
    spec = AttentionSpec(context_lens=(600, 333, 17), query_lens=(600, 200, 1),
                         block_size=block_size, kv_heads=2, groups=groups, head_dim=head_dim,
                         dtype=dtype, device="cuda", block_m=64, block_n=64)  # fmt: skip
    assert run_prefill_case(spec) <= TOLERANCE[dtype]


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_generation_compiled_on_cuda(dtype: str) -> None:
    spec = AttentionSpec(context_lens=(300, 45, 1000), groups=4, head_dim=128, dtype=dtype,
                         device="cuda", partition_size=128, tile_size=64,
                         block_m=64, block_n=64)  # fmt: skip
    outcome = run_generation_case(spec)
    assert max(outcome.prefill_error, outcome.chunk_error, outcome.decode_error) <= TOLERANCE[dtype]
