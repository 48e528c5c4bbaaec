"""CUDA graphs for decode-only batches.

A decode step launches hundreds of small kernels; replaying a captured graph removes their
launch cost. Graphs are captured at start for a ladder of batch sizes (1, 2, 4, 8, then
steps of 16) up to `max_batch`; a batch of n sequences replays the smallest graph of >= n
slots. The padded slots get slot -1 (the store kernel skips it: nothing is written) and
context length 0 (the decode kernel returns zeros for them), so padding never touches the
cache. Inputs are staged in pinned host buffers and copied with non-blocking copies into the
graph's static device buffers.

Only backends whose per-batch plan has no host-to-device copies can be captured (triton,
flash_attn); the torch backend runs eagerly. `--enforce-eager` turns graphs off.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from gpu_runner.attention.metadata import AttentionMetadata
from gpu_runner.batch import ExecuteBatch

log = logging.getLogger(__name__)

GRAPH_BACKENDS = ("triton", "flash_attn")


def batch_ladder(max_batch: int) -> list[int]:
    """The captured batch sizes: 1, 2, 4, 8, 16, 32, 48, ... up to max_batch (included)."""
    sizes = [size for size in (1, 2, 4, 8) if size < max_batch]
    sizes += list(range(16, max_batch, 16))
    return sorted({*sizes, max_batch})


def graph_size(num_seqs: int, ladder: list[int]) -> int | None:
    """The smallest captured size holding num_seqs sequences (None: too many)."""
    for size in ladder:
        if size >= num_seqs:
            return size
    return None


@dataclass
class StaticInputs:
    """Device buffers the graphs read, and their pinned host staging copies."""

    token_ids: torch.Tensor  # [max_batch] int64
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor  # [max_batch, max_blocks] int64
    query_lens: torch.Tensor
    query_start_locs: torch.Tensor
    logits_indices: torch.Tensor

    @classmethod
    def allocate(cls, max_batch: int, max_blocks: int, device: torch.device,
                 pinned: bool) -> StaticInputs:
        def zeros(*shape: int) -> torch.Tensor:
            tensor = torch.zeros(shape, dtype=torch.int64, device=device)
            return tensor.pin_memory() if pinned else tensor

        inputs = cls(zeros(max_batch), zeros(max_batch), zeros(max_batch), zeros(max_batch),
                     zeros(max_batch, max_blocks), zeros(max_batch), zeros(max_batch + 1),
                     zeros(max_batch))
        inputs.slot_mapping.fill_(-1)
        inputs.query_lens.fill_(1)
        inputs.query_start_locs.copy_(torch.arange(max_batch + 1))
        inputs.logits_indices.copy_(torch.arange(max_batch))
        return inputs

    def per_batch(self) -> tuple[torch.Tensor, ...]:
        """The buffers that change from batch to batch."""
        return (self.token_ids, self.positions, self.slot_mapping, self.context_lens,
                self.block_tables)


class DecodeGraphs:
    """Captured decode forwards for a ladder of batch sizes, over one KV cache."""

    def __init__(self, model: nn.Module, kv_cache: torch.Tensor, block_size: int,
                 max_model_len: int, max_batch: int) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // block_size)
        self.ladder = batch_ladder(max_batch)
        device = kv_cache.device
        self.device_inputs = StaticInputs.allocate(max_batch, self.max_blocks, device, False)
        self.host_inputs = StaticInputs.allocate(max_batch, self.max_blocks,
                                                  torch.device("cpu"), pinned=True)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0  # batches served by a graph (tests, logs)

    def _meta(self, size: int) -> AttentionMetadata:
        inputs = self.device_inputs
        # The host lengths only size the kernels' grids: use the bounds every batch respects.
        return AttentionMetadata(
            positions=inputs.positions[:size],
            slot_mapping=inputs.slot_mapping[:size],
            block_tables=inputs.block_tables[:size],
            query_lens=inputs.query_lens[:size],
            context_lens=inputs.context_lens[:size],
            query_start_locs=inputs.query_start_locs[: size + 1],
            logits_indices=inputs.logits_indices[:size],
            query_lens_host=np.ones(size, dtype=np.int64),
            context_lens_host=np.full(size, self.max_model_len, dtype=np.int64),
            block_table_lens_host=np.full(size, self.max_blocks, dtype=np.int64),
            block_size=self.block_size,
        )

    def capture(self) -> None:
        """Captures every ladder size, largest first (the others reuse its memory pool)."""
        pool = None
        with torch.inference_mode():
            for size in sorted(self.ladder, reverse=True):
                meta = self._meta(size)
                tokens = self.device_inputs.token_ids[:size]
                # Warm-up outside the graph: autotuning, lazy allocations, kernel compiles.
                self.model(tokens, self.kv_cache, meta)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self.model(tokens, self.kv_cache, meta)
                pool = graph.pool()
                self.graphs[size] = (graph, logits)
        torch.cuda.synchronize()
        log.info("captured decode CUDA graphs for batch sizes %s", self.ladder)

    def can_run(self, batch: ExecuteBatch) -> bool:
        """A decode-only batch that fits a captured size and the captured block tables."""
        num_seqs = batch.num_new_tokens.shape[0]
        return (num_seqs > 0 and bool(np.all(batch.num_new_tokens == 1))
                and graph_size(num_seqs, self.ladder) is not None
                and int(batch.block_table_lens.max()) <= self.max_blocks)

    def run(self, batch: ExecuteBatch) -> torch.Tensor:
        """Logits [sampled seqs, vocab] of a batch accepted by can_run."""
        num_seqs = batch.num_new_tokens.shape[0]
        size = graph_size(num_seqs, self.ladder)
        assert size is not None
        stage_batch(self.host_inputs, batch, size)
        for device_buffer, host_buffer in zip(self.device_inputs.per_batch(),
                                              self.host_inputs.per_batch(), strict=True):
            device_buffer[:size].copy_(host_buffer[:size], non_blocking=True)
        graph, logits = self.graphs[size]
        graph.replay()
        self.replays += 1
        sampled = np.nonzero(batch.do_sample)[0]
        if sampled.shape[0] == num_seqs:
            return logits[:num_seqs]
        return logits[torch.from_numpy(sampled).to(logits.device)]


def stage_batch(host: StaticInputs, batch: ExecuteBatch, size: int) -> None:
    """Writes a decode batch of n sequences into the host buffers, padding slots n..size-1
    with slot -1 and context length 0 (what the kernels skip)."""
    n = batch.num_new_tokens.shape[0]
    host.token_ids[:n] = torch.from_numpy(batch.token_ids)
    host.positions[:n] = torch.from_numpy(batch.start_positions)
    host.slot_mapping[:n] = torch.from_numpy(batch.slot_mapping)
    host.context_lens[:n] = torch.from_numpy(batch.start_positions + 1)
    host.token_ids[n:size] = 0
    host.positions[n:size] = 0
    host.slot_mapping[n:size] = -1
    host.context_lens[n:size] = 0
    tables = host.block_tables[:size]
    tables.zero_()
    lens = batch.block_table_lens
    rows = np.repeat(np.arange(n), lens)
    columns = np.arange(rows.shape[0]) - np.repeat(np.cumsum(lens) - lens, lens)
    tables[torch.from_numpy(rows), torch.from_numpy(columns)] = torch.from_numpy(
        batch.block_tables.astype(np.int64))
