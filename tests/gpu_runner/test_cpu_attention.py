"""The C++ paged attention kernel against a plain per-token reference.

The reference gathers one sequence's keys in Python through its block table and computes,
for each new token, softmax(q k^T * scale) v over the keys up to its own position, in
float64: independent of the kernel's block walking, tiling, GQA mapping, causal limits and
softmax. Every cache slot the kernel must not read holds NaN, so reading one shows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch

from gpu_runner import cpu_kernels


@pytest.fixture(scope="module", autouse=True)
def _kernel() -> None:
    if not cpu_kernels.available():
        pytest.skip(f"C++ CPU kernels unavailable: {cpu_kernels.failure_reason()}")


@dataclass
class Case:
    query: torch.Tensor  # [tokens, heads, dim]
    layer_cache: torch.Tensor  # [2, blocks, block_size, kv_heads, dim]
    block_tables: torch.Tensor  # [seqs, max_blocks]
    context_lens: torch.Tensor  # [seqs]
    query_start_locs: torch.Tensor  # [seqs + 1]
    scale: float


def make_case(context_lens: Sequence[int], heads: int, kv_heads: int, dim: int,
              block_size: int, seed: int = 0, spare_blocks: int = 3, pad_blocks: int = 2,
              pad_id: int | None = None, new_tokens: Sequence[int] | None = None) -> Case:
    """Sequence i has new_tokens[i] query tokens (default: 1, a decode) at the end of its
    context. Blocks are handed out in a shuffled order (non-contiguous ids); each table gets
    `pad_blocks` entries past its context pointing at NaN blocks (or at `pad_id`)."""
    gen = torch.Generator().manual_seed(seed)
    needed = [(n + block_size - 1) // block_size for n in context_lens]
    num_blocks = sum(needed) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen).tolist()
    unused = order[sum(needed):]  # never written: stay NaN
    cache = torch.full((2, num_blocks, block_size, kv_heads, dim), float("nan"))
    max_blocks = max(needed) + pad_blocks
    tables = torch.empty(len(context_lens), max_blocks, dtype=torch.int64)
    next_block = 0
    for seq, (length, count) in enumerate(zip(context_lens, needed, strict=True)):
        ids = order[next_block:next_block + count]
        next_block += count
        pads = [pad_id if pad_id is not None else unused[i % len(unused)]
                for i in range(max_blocks - count)]
        tables[seq] = torch.tensor(ids + pads)
        for pos in range(length):  # only real tokens get values; the rest stays NaN
            cache[:, ids[pos // block_size], pos % block_size] = torch.randn(
                2, kv_heads, dim, generator=gen)
    new = [1] * len(context_lens) if new_tokens is None else list(new_tokens)
    starts = torch.tensor([0, *new]).cumsum(0)
    query = torch.randn(sum(new), heads, dim, generator=gen)
    return Case(query, cache, tables, torch.tensor(context_lens), starts, dim**-0.5)


def reference(case: Case) -> torch.Tensor:
    """softmax(q k^T * scale) v per new token and head over the keys up to the token's
    position, in float64."""
    tokens, heads, dim = case.query.shape
    block_size, kv_heads = case.layer_cache.shape[2], case.layer_cache.shape[3]
    group = heads // kv_heads
    out = torch.empty(tokens, heads, dim, dtype=torch.float64)
    for seq in range(len(case.context_lens)):
        length = int(case.context_lens[seq])
        first, end = int(case.query_start_locs[seq]), int(case.query_start_locs[seq + 1])
        positions = torch.arange(length)
        blocks = case.block_tables[seq, positions // block_size]
        keys = case.layer_cache[0, blocks, positions % block_size].double()  # [len, kv, dim]
        values = case.layer_cache[1, blocks, positions % block_size].double()
        for token in range(first, end):
            seen = length - (end - token) + 1  # keys up to this token's own position
            for head in range(heads):
                kv = head // group
                scores = keys[:seen, kv] @ case.query[token, head].double() * case.scale
                out[token, head] = torch.softmax(scores, dim=0) @ values[:seen, kv]
    return out


def run_kernel(case: Case, query: torch.Tensor | None = None,
               tables: torch.Tensor | None = None) -> torch.Tensor:
    return cpu_kernels.paged_attention(
        case.query if query is None else query, case.layer_cache[0], case.layer_cache[1],
        case.block_tables if tables is None else tables, case.context_lens,
        case.query_start_locs, case.scale)


def assert_matches(case: Case, out: torch.Tensor) -> None:
    assert out.shape == case.query.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference(case), rtol=1e-5, atol=1e-5)


SHAPES = {"gqa_smollm2": (9, 3, 64), "mha": (4, 4, 32), "dim128": (4, 2, 128)}


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("length_kind", ["one", "bs-1", "bs", "bs+1", "300"])
def test_single_length(shape: tuple[int, int, int], block_size: int, length_kind: str) -> None:
    length = {"one": 1, "bs-1": block_size - 1, "bs": block_size, "bs+1": block_size + 1,
              "300": 300}[length_kind]
    case = make_case([length, length], *shape, block_size=block_size, seed=length)
    assert_matches(case, run_kernel(case))


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("block_size", [16, 256])
def test_mixed_lengths_in_one_batch(shape: tuple[int, int, int], block_size: int) -> None:
    lengths = [1, block_size - 1, 300, block_size, 7, block_size + 1, 513, 2]
    case = make_case(lengths, *shape, block_size=block_size, seed=block_size)
    assert_matches(case, run_kernel(case))


def test_odd_head_dim_and_group_size() -> None:
    # head_dim 40 = two full vector steps + a scalar tail; 5 query heads per KV head make row
    # groups of 4 that straddle tokens.
    case = make_case([1, 17, 45], 10, 2, 40, block_size=16, seed=3, new_tokens=[1, 3, 19])
    assert_matches(case, run_kernel(case))


SHAPES_WITH_ODD = {**SHAPES, "odd_dim_group_of_5": (10, 2, 40)}


@pytest.mark.parametrize("shape", SHAPES_WITH_ODD.values(), ids=SHAPES_WITH_ODD.keys())
@pytest.mark.parametrize("block_size", [16, 5])
def test_many_decodes_across_threads(shape: tuple[int, int, int], block_size: int) -> None:
    # Enough decodes for one item per sequence over every KV head (attend_decode).
    gen = torch.Generator().manual_seed(5)
    lengths = torch.randint(1, 400, (40,), generator=gen).tolist()
    case = make_case(lengths, *shape, block_size=block_size, seed=5)
    assert_matches(case, run_kernel(case))


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("new_tokens", [2, 15, 16, 17, 40])
def test_fresh_prompts(shape: tuple[int, int, int], new_tokens: int) -> None:
    # Every key is new: each token sees the prompt up to itself (tiles of 16 tokens split
    # at 15/16/17 and 40).
    case = make_case([new_tokens, new_tokens + 3], *shape, block_size=16, seed=new_tokens,
                     new_tokens=[new_tokens, new_tokens + 3])
    assert_matches(case, run_kernel(case))


@pytest.mark.parametrize("block_size", [16, 256])
def test_chunks_after_a_cached_prefix(block_size: int) -> None:
    case = make_case([40, 300, 17], 9, 3, 64, block_size=block_size, seed=7,
                     new_tokens=[8, 100, 17])
    assert_matches(case, run_kernel(case))


def test_decodes_prompts_and_chunks_in_one_batch() -> None:
    gen = torch.Generator().manual_seed(11)
    lengths = torch.randint(20, 300, (12,), generator=gen).tolist()
    new = [1 if i % 3 == 0 else length if i % 3 == 1 else length // 2
           for i, length in enumerate(lengths)]
    case = make_case(lengths, 9, 3, 64, block_size=16, seed=11, new_tokens=new)
    assert_matches(case, run_kernel(case))


def test_padding_entries_out_of_range_are_ignored() -> None:
    case = make_case([5, 16, 33], 9, 3, 64, block_size=16, pad_blocks=3, pad_id=-1)
    assert_matches(case, run_kernel(case))


def test_int32_block_tables() -> None:
    case = make_case([20, 47], 9, 3, 64, block_size=16)
    assert_matches(case, run_kernel(case, tables=case.block_tables.to(torch.int32)))


def test_strided_query_view() -> None:
    # The query as the runner sees it: a slice of a fused q/k/v projection, not contiguous.
    case = make_case([30, 3], 9, 3, 64, block_size=16)
    fused = torch.randn(2, 15, 64)
    fused[:, :9] = case.query
    query = fused[:, :9]
    assert not query.is_contiguous()
    assert_matches(case, run_kernel(case, query=query))


def test_large_scores_stay_finite() -> None:
    # Scores in the thousands overflow exp without the max subtracted.
    case = make_case([40, 300], 9, 3, 64, block_size=16)
    case.query = case.query * 400.0
    out = run_kernel(case)
    assert torch.isfinite(out).all()
    assert_matches(case, out)


def test_float64_is_refused() -> None:
    case = make_case([4], 9, 3, 64, block_size=16)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_kernels.paged_attention(case.query.double(), case.layer_cache[0].double(),
                                    case.layer_cache[1].double(), case.block_tables,
                                    case.context_lens, case.query_start_locs, case.scale)


@pytest.mark.parametrize("bad_id", [-1, 10_000])
def test_block_id_out_of_range_is_refused(bad_id: int) -> None:
    case = make_case([20], 9, 3, 64, block_size=16)
    tables = case.block_tables.clone()
    tables[0, 1] = bad_id  # the second block is within the context: it would be read
    with pytest.raises(RuntimeError, match="outside"):
        run_kernel(case, tables=tables)


@pytest.mark.parametrize("length", [0, 10_000])
def test_context_length_out_of_range_is_refused(length: int) -> None:
    case = make_case([20], 9, 3, 64, block_size=16)
    case.context_lens = torch.tensor([length])
    with pytest.raises(RuntimeError, match="context"):
        run_kernel(case)


def test_more_new_tokens_than_context_is_refused() -> None:
    case = make_case([20], 9, 3, 64, block_size=16, new_tokens=[20])
    case.context_lens = torch.tensor([19])
    with pytest.raises(RuntimeError, match="new tokens"):
        run_kernel(case)


@pytest.mark.parametrize("starts", [[0, 0, 5], [0, 4, 6], [1, 3, 5], [0, 6, 5]])
def test_bad_query_start_locs_are_refused(starts: list[int]) -> None:
    case = make_case([20, 20], 9, 3, 64, block_size=16, new_tokens=[3, 2])
    case.query_start_locs = torch.tensor(starts)
    with pytest.raises(RuntimeError, match=r"new tokens|query_start_locs"):
        run_kernel(case)


def test_heads_not_a_multiple_of_kv_heads_is_refused() -> None:
    case = make_case([20], 9, 3, 64, block_size=16)
    with pytest.raises(RuntimeError, match="multiple"):
        run_kernel(case, query=case.query[:, :8])


def test_not_available_off_cpu() -> None:
    assert not cpu_kernels.available("meta")


def test_vector_registers_match_the_cpu_it_was_built_for() -> None:
    """The kernels' vectors are sized for the CPU's registers (-march=native here)."""
    flags = next((line for line in cpu_kernels._cpuinfo() if line.startswith("flags")), "")
    if not flags or cpu_kernels._march() != "native":
        pytest.skip("not built for this CPU's own flags")
    assert cpu_kernels.wide_vectors() == ("avx512f" in flags.split())


@pytest.mark.parametrize("wide", [True, False])
def test_the_torch_backend_gives_prompts_to_the_kernel_only_where_its_vectors_are_wide(
        monkeypatch: pytest.MonkeyPatch, wide: bool) -> None:
    from types import SimpleNamespace

    from gpu_runner.attention.torch_backend import TorchAttentionBackend

    monkeypatch.setattr(cpu_kernels, "wide_vectors", lambda: wide)
    case = make_case([5, 9], heads=4, kv_heads=2, dim=32, block_size=4)
    attends = TorchAttentionBackend._kernel_attends
    for decode_only in (True, False):
        plan = SimpleNamespace(decode_only=decode_only)
        expected = decode_only or wide
        assert attends(plan, case.query, case.layer_cache) is expected  # type: ignore[arg-type]


# ---- bfloat16: query, caches and output in bfloat16, computed in float32 ----

# The kernel rounds once, at the output: against the float64 reference over the same bfloat16
# inputs it may differ by the rounding (half a bfloat16 ulp, 2^-9 relative) plus float32's sums.
BF16_RTOL = 2**-8


def as_bf16(case: Case) -> Case:
    """The case in bfloat16 (its NaN slots stay NaN)."""
    return Case(case.query.bfloat16(), case.layer_cache.bfloat16(), case.block_tables,
                case.context_lens, case.query_start_locs, case.scale)


def assert_bf16_matches(case: Case) -> None:
    out = run_kernel(case)
    assert out.shape == case.query.shape and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), reference(case), rtol=BF16_RTOL, atol=2**-12)


@pytest.mark.parametrize("shape", SHAPES_WITH_ODD.values(), ids=SHAPES_WITH_ODD.keys())
@pytest.mark.parametrize("block_size", [16, 5])
def test_bf16_decodes_across_threads(shape: tuple[int, int, int], block_size: int) -> None:
    gen = torch.Generator().manual_seed(6)
    lengths = torch.randint(1, 400, (40,), generator=gen).tolist()
    assert_bf16_matches(as_bf16(make_case(lengths, *shape, block_size=block_size, seed=6)))


@pytest.mark.parametrize("shape", SHAPES_WITH_ODD.values(), ids=SHAPES_WITH_ODD.keys())
def test_bf16_decodes_prompts_and_chunks_in_one_batch(shape: tuple[int, int, int]) -> None:
    gen = torch.Generator().manual_seed(12)
    lengths = torch.randint(20, 300, (9,), generator=gen).tolist()
    new = [1 if i % 3 == 0 else length if i % 3 == 1 else length // 2
           for i, length in enumerate(lengths)]
    case = make_case(lengths, *shape, block_size=16, seed=12, new_tokens=new)
    assert_bf16_matches(as_bf16(case))


def test_bf16_large_scores_and_strided_query() -> None:
    case = as_bf16(make_case([40, 300], 9, 3, 64, block_size=16, new_tokens=[40, 1]))
    case.query = case.query * 400.0
    fused = torch.zeros(41, 15, 64, dtype=torch.bfloat16)
    fused[:, :9] = case.query
    out = run_kernel(case, query=fused[:, :9])
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), reference(case), rtol=BF16_RTOL, atol=2**-12)


def test_mixed_dtypes_are_refused() -> None:
    case = make_case([4], 9, 3, 64, block_size=16)
    with pytest.raises(RuntimeError, match="must all be float32 or all bfloat16"):
        run_kernel(case, query=case.query.bfloat16())


def test_bf16_kernels_take_bf16_on_this_cpu() -> None:
    bf16 = torch.zeros(2, dtype=torch.bfloat16)
    assert cpu_kernels.supports(bf16, bf16) == cpu_kernels.bf16_native()


@pytest.mark.usefixtures("forced_bf16_fallback")
def test_bf16_kernels_follow_the_cpu() -> None:
    # On a CPU without bfloat16 instructions (simulated by the variable) bfloat16 stays on
    # plain torch; float32 keeps the kernels either way.
    bf16, f32 = torch.zeros(2, dtype=torch.bfloat16), torch.zeros(2)
    assert not cpu_kernels.bf16_native()
    assert "PAGEWIRE_FORCE_BF16_FALLBACK is set" in str(cpu_kernels.bf16_fallback_reason())
    assert not cpu_kernels.supports(bf16, bf16)
    assert cpu_kernels.supports(f32, f32)
    assert not cpu_kernels.supports(f32, bf16)
