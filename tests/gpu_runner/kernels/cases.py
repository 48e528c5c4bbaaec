"""Kernel test cases, run either in the interpreter worker (CPU tensors) or on CUDA.

Every case builds its inputs from a seed, runs a kernel and compares with an oracle computed
here in plain torch; it returns plain numbers that the test asserts on. The kernels are
imported inside the functions: importing them here would import triton into the pytest
process (see conftest.py for why that must not happen on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tests.gpu_runner.kernels.paged_reference import (
    PagedCache,
    build_paged_cache,
    cdiv,
    reference_attention,
    reference_decode,
    reference_prefill,
    relative_error,
)

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class StoreSpec:
    num_tokens: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype: str = "fp32"
    device: str = "cpu"
    fused_qkv: bool = False  # key/value as strided views into one [N, 3, heads, dim] tensor
    seed: int = 0


@dataclass(frozen=True)
class StoreOutcome:
    mismatched_elements: int
    padded_tokens: int  # how many tokens had slot -1 (the case must include some)


def run_store_case(spec: StoreSpec) -> StoreOutcome:
    """store_kv against torch indexing; the cache must match bit for bit everywhere."""
    from gpu_runner.kernels import store_kv

    generator = torch.Generator().manual_seed(spec.seed)
    dtype = DTYPES[spec.dtype]
    num_blocks = cdiv(spec.num_tokens, spec.block_size) + 2
    shape = (2, 2, num_blocks, spec.block_size, spec.kv_heads, spec.head_dim)
    cache = torch.randn(shape, generator=generator).to(dtype)
    row_shape = (spec.num_tokens, 3, spec.kv_heads, spec.head_dim)
    rows = torch.randn(row_shape, generator=generator).to(dtype)
    slots = torch.randperm(num_blocks * spec.block_size, generator=generator)[: spec.num_tokens]
    slots[::3] = -1  # every third token is a padded one
    kept = slots >= 0
    expected = cache.clone()
    expected[1, 0].view(-1, spec.kv_heads, spec.head_dim)[slots[kept]] = rows[kept, 0]
    expected[1, 1].view(-1, spec.kv_heads, spec.head_dim)[slots[kept]] = rows[kept, 1]

    device = torch.device(spec.device)
    actual = cache.to(device)
    rows = rows.to(device)
    # Fused: key and value stay strided views into the [N, 3, heads, dim] rows.
    key, value = (
        (rows[:, 0], rows[:, 1]) if spec.fused_qkv else (rows[:, 0].clone(), rows[:, 1].clone())
    )
    assert key.is_contiguous() != spec.fused_qkv
    store_kv(key, value, actual[1, 0], actual[1, 1], slots.to(device))
    mismatched = int((actual.cpu() != expected).sum())
    return StoreOutcome(mismatched, int((~kept).sum()))


def bad_store_messages() -> dict[str, str]:
    """The ValueError message of store_kv for each kind of malformed input."""
    from gpu_runner.kernels import store_kv

    cache = torch.zeros((4, 16, 2, 32))
    rows = torch.zeros((4, 2, 32))
    slots = torch.arange(4)
    bad_inputs = {
        "head_dim": (rows[..., :16], rows[..., :16], cache, cache, slots),
        "slots": (rows, rows, cache, cache, slots[:3]),
    }
    messages = {}
    for name, args in bad_inputs.items():
        try:
            store_kv(*args)
        except ValueError as error:
            messages[name] = str(error)
    return messages


def bad_attention_messages() -> dict[str, str]:
    """The ValueError message of the attention kernels for each kind of malformed input."""
    from gpu_runner.kernels import paged_decode_attention, paged_prefill_attention

    cache = torch.zeros((4, 16, 2, 32))
    query = torch.zeros((2, 4, 32))
    tables = torch.zeros((2, 3), dtype=torch.int32)
    lens = torch.ones(2, dtype=torch.int32)
    starts = torch.tensor([0, 1, 2], dtype=torch.int32)
    bad_calls = {
        "block_size": lambda: paged_decode_attention(
            query, cache[:, :12], cache[:, :12], tables, lens, 1.0
        ),
        "dtype": lambda: paged_decode_attention(query.half(), cache, cache, tables, lens, 1.0),
        "heads": lambda: paged_decode_attention(query[:, :3], cache, cache, tables, lens, 1.0),
        "tiling": lambda: paged_decode_attention(
            query, cache, cache, tables, lens, 1.0, partition_size=48, tile_size=32
        ),
        "starts": lambda: paged_prefill_attention(
            query, cache, cache, tables, starts[:2], lens, 1.0
        ),
    }
    messages = {}
    for name, call in bad_calls.items():
        try:
            call()
        except ValueError as error:
            messages[name] = str(error)
    return messages


@dataclass(frozen=True)
class AttentionSpec:
    """Sequences of a paged batch; for prefill, query_lens[b] new tokens end each context."""

    context_lens: tuple[int, ...]
    block_size: int = 16
    kv_heads: int = 2
    groups: int = 1
    head_dim: int = 32
    dtype: str = "fp32"
    device: str = "cpu"
    query_lens: tuple[int, ...] = ()  # prefill only
    partition_size: int = 512  # decode only
    tile_size: int = 32  # decode only
    block_m: int = 16  # prefill only
    block_n: int = 16  # prefill only
    index_dtype: str = "int32"  # of block tables and lengths ("int64" as the runner's)
    seed: int = 0


def _scale(spec: AttentionSpec) -> float:
    return spec.head_dim**-0.5


def _index(values: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
    """An integer kernel argument in the spec's index dtype, on its device."""
    return values.to(device=spec.device, dtype=getattr(torch, spec.index_dtype))


def run_decode_case(spec: AttentionSpec) -> float:
    """paged_decode_attention against the float64 reference; returns the relative error."""
    from gpu_runner.kernels import paged_decode_attention

    generator = torch.Generator().manual_seed(spec.seed)
    dtype = DTYPES[spec.dtype]
    paged = build_paged_cache(
        list(spec.context_lens), spec.block_size, spec.kv_heads, spec.head_dim, dtype, generator
    )
    q_heads = spec.kv_heads * spec.groups
    query = torch.randn((len(spec.context_lens), q_heads, spec.head_dim), generator=generator)
    query = query.to(dtype)
    expected = reference_decode(query, paged, _scale(spec))
    device = torch.device(spec.device)
    actual = paged_decode_attention(
        query.to(device),
        paged.k_cache.to(device),
        paged.v_cache.to(device),
        _index(paged.block_tables, spec),
        _index(paged.context_lens, spec),
        _scale(spec),
        partition_size=spec.partition_size,
        tile_size=spec.tile_size,
    )
    assert actual.dtype == dtype and actual.shape == query.shape
    return relative_error(actual, expected)


def run_prefill_case(spec: AttentionSpec) -> float:
    """paged_prefill_attention against the float64 reference; returns the relative error."""
    from gpu_runner.kernels import paged_prefill_attention

    generator = torch.Generator().manual_seed(spec.seed)
    dtype = DTYPES[spec.dtype]
    paged = build_paged_cache(
        list(spec.context_lens), spec.block_size, spec.kv_heads, spec.head_dim, dtype, generator
    )
    starts = [0]
    for length in spec.query_lens:
        starts.append(starts[-1] + length)
    q_heads = spec.kv_heads * spec.groups
    query = torch.randn((starts[-1], q_heads, spec.head_dim), generator=generator).to(dtype)
    expected = reference_prefill(query, paged, starts, _scale(spec))
    device = torch.device(spec.device)
    actual = paged_prefill_attention(
        query.to(device),
        paged.k_cache.to(device),
        paged.v_cache.to(device),
        _index(paged.block_tables, spec),
        _index(torch.tensor(starts), spec),
        _index(paged.context_lens, spec),
        _scale(spec),
        block_m=spec.block_m,
        block_n=spec.block_n,
    )
    assert actual.dtype == dtype and actual.shape == query.shape
    return relative_error(actual, expected)


@dataclass(frozen=True)
class GenerationOutcome:
    prefill_error: float  # first chunk, from position 0
    chunk_error: float  # second chunk, over the cached first one
    decode_error: float  # one more token, over everything


def run_generation_case(spec: AttentionSpec) -> GenerationOutcome:
    """The three kernels as a runner chains them, against attention on unpaged K/V.

    Each sequence's K/V is written by store_kv, in two prefill chunks then one decode token,
    into shuffled blocks; the oracle is plain causal attention over the contiguous K/V, so
    it shares nothing with the kernels' paging (no block table, no gather).
    """
    from gpu_runner.kernels import paged_decode_attention

    generator = torch.Generator().manual_seed(spec.seed)
    dtype, device = DTYPES[spec.dtype], torch.device(spec.device)
    lengths = list(spec.context_lens)
    q_heads = spec.kv_heads * spec.groups
    seqs = [
        torch.randn((3, length, q_heads, spec.head_dim), generator=generator).to(dtype)
        for length in lengths
    ]  # [q|k|v, length, heads, dim]; k and v use only the first kv_heads heads
    paged = build_paged_cache(
        lengths, spec.block_size, spec.kv_heads, spec.head_dim, dtype, generator, spec.device
    )
    # The cache starts as random garbage: reading a slot before store_kv wrote it shows.
    first = [length // 2 for length in lengths]
    # Chunks: [0, first), [first, length - 1), then the decode token at length - 1.
    chunks = [
        [(0, f) for f in first],
        [(f, length - 1) for f, length in zip(first, lengths, strict=True)],
    ]
    errors = []
    for chunk in chunks:
        errors.append(_run_prefill_chunk(spec, paged, seqs, chunk, device))
    decode_chunk = [(length - 1, length) for length in lengths]
    _store_chunk(paged, seqs, decode_chunk, spec, device)
    paged.context_lens.copy_(torch.tensor(lengths, dtype=torch.int32))
    query = torch.stack([seq[0, length - 1] for seq, length in zip(seqs, lengths, strict=True)])
    actual = paged_decode_attention(
        query.to(device), paged.k_cache, paged.v_cache, paged.block_tables,
        paged.context_lens, _scale(spec), partition_size=spec.partition_size,
        tile_size=spec.tile_size,
    )  # fmt: skip
    expected = torch.cat(
        [
            _plain_attention(spec, seq, length - 1, length)
            for seq, length in zip(seqs, lengths, strict=True)
        ]
    )
    errors.append(relative_error(actual, expected))
    return GenerationOutcome(*errors)


def _run_prefill_chunk(
    spec: AttentionSpec,
    paged: PagedCache,
    seqs: list[torch.Tensor],
    chunk: list[tuple[int, int]],
    device: torch.device,
) -> float:
    """Store then attend positions [start, stop) of each sequence; returns the error."""
    from gpu_runner.kernels import paged_prefill_attention

    _store_chunk(paged, seqs, chunk, spec, device)
    paged.context_lens.copy_(torch.tensor([stop for _, stop in chunk], dtype=torch.int32))
    starts = [0]
    for start, stop in chunk:
        starts.append(starts[-1] + stop - start)
    query = torch.cat([seq[0, start:stop] for seq, (start, stop) in zip(seqs, chunk, strict=True)])
    actual = paged_prefill_attention(
        query.to(device), paged.k_cache, paged.v_cache, paged.block_tables,
        torch.tensor(starts, dtype=torch.int32, device=device), paged.context_lens,
        _scale(spec), block_m=spec.block_m, block_n=spec.block_n,
    )  # fmt: skip
    expected = torch.cat(
        [
            _plain_attention(spec, seq, start, stop)
            for seq, (start, stop) in zip(seqs, chunk, strict=True)
        ]
    )
    return relative_error(actual, expected)


def _store_chunk(
    paged: PagedCache,
    seqs: list[torch.Tensor],
    chunk: list[tuple[int, int]],
    spec: AttentionSpec,
    device: torch.device,
) -> None:
    """store_kv of positions [start, stop) of each sequence, slots from its block table."""
    from gpu_runner.kernels import store_kv

    keys, values, slots = [], [], []
    tables = paged.block_tables.cpu().long()
    for seq_index, (seq, (start, stop)) in enumerate(zip(seqs, chunk, strict=True)):
        positions = torch.arange(start, stop)
        blocks = tables[seq_index, positions // spec.block_size]
        slots.append(blocks * spec.block_size + positions % spec.block_size)
        keys.append(seq[1, start:stop, : spec.kv_heads])
        values.append(seq[2, start:stop, : spec.kv_heads])
    store_kv(
        torch.cat(keys).to(device), torch.cat(values).to(device),
        paged.k_cache, paged.v_cache, torch.cat(slots).to(device),
    )  # fmt: skip


def _plain_attention(spec: AttentionSpec, seq: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Causal attention of positions [start, stop) over the contiguous K/V [0, stop)."""
    keys = seq[1, :stop, : spec.kv_heads]
    values = seq[2, :stop, : spec.kv_heads]
    return reference_attention(
        seq[0, start:stop], keys, values, torch.arange(start, stop), _scale(spec)
    )
