"""store_kv: exact writes at slots, slot -1 skipped, any head size (interpreter and CUDA)."""

from __future__ import annotations

import pytest

from tests.gpu_runner.kernels.cases import StoreSpec, bad_store_messages, run_store_case
from tests.gpu_runner.kernels.paged_reference import CUDA


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize(
    ("kv_heads", "head_dim", "block_size"),
    [(2, 16, 16), (3, 24, 32), (1, 32, 1)],  # 24: padded to 32 and masked
)
def test_store_writes_exactly_the_mapped_slots(
    interpreter, dtype: str, kv_heads: int, head_dim: int, block_size: int
) -> None:
    spec = StoreSpec(num_tokens=40, kv_heads=kv_heads, head_dim=head_dim,
                     block_size=block_size, dtype=dtype)  # fmt: skip
    outcome = interpreter.run(run_store_case, spec)
    assert outcome.padded_tokens > 0
    assert outcome.mismatched_elements == 0


def test_store_reads_strided_rows_of_a_fused_qkv_tensor(interpreter) -> None:
    spec = StoreSpec(num_tokens=20, kv_heads=2, head_dim=24, block_size=16, fused_qkv=True)
    assert interpreter.run(run_store_case, spec).mismatched_elements == 0


def test_store_of_bfloat16_rows_is_a_plain_copy(interpreter) -> None:
    # No tl.dot here, so bfloat16 is safe under the interpreter.
    spec = StoreSpec(num_tokens=20, kv_heads=2, head_dim=16, block_size=16, dtype="bf16")
    assert interpreter.run(run_store_case, spec).mismatched_elements == 0


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize(("head_dim", "block_size"), [(24, 16), (128, 256), (80, 1)])
def test_store_compiled_on_cuda(dtype: str, head_dim: int, block_size: int) -> None:
    spec = StoreSpec(num_tokens=300, kv_heads=8, head_dim=head_dim, block_size=block_size,
                     dtype=dtype, device="cuda", fused_qkv=True)  # fmt: skip
    assert run_store_case(spec).mismatched_elements == 0


def test_store_refuses_rows_that_do_not_fit_the_cache(interpreter) -> None:
    messages = interpreter.run(bad_store_messages)
    assert "do not match cache rows" in messages["head_dim"]
    assert "slot_mapping must be [4]" in messages["slots"]
