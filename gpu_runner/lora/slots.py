"""The LoRA slot table on the model's device, and one batch's use of it.

The table holds up to max_loras adapters, each in the layout the forward wants: per layer and
fused projection (qkv, o, gate_up, down), lora_A stacked as `a [rows, in]` and lora_B, scaled
and transposed, as `bt [rows, out]`. A fused projection's parts (q, k, v) sit block-diagonally:
part j of an adapter with rank r takes rows j*r .. (j+1)*r - 1 of `a`, and the same rows of
`bt` in that part's output columns only, so one (x @ a.T) @ bt adds every part's product in
two matmuls. Only the parts an adapter targets take rows (`used_rows`); a projection it leaves
alone costs nothing.

A batch's rows run through their own adapter as groups: per group and projection,
y[rows] += (x[rows] @ a.T) @ bt, which is PEFT's base(x) + lora_B(lora_A(x)) * scaling.
Base-model rows belong to no group. On the CPU in float32 one C++ call per projection does
every group, each part in its own columns only (csrc/lora.cpp); elsewhere torch does two
matmuls per group (the rows as a slice when contiguous, else an index). This is the seam a
GPU kernel (Punica's BGMV / SGMV) replaces: same table, same groups.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from gpu_runner import cpu_kernels, metrics
from gpu_runner.config import ModelConfig
from gpu_runner.lora.peft_format import PROJECTIONS, PeftAdapter, projection_sizes


class SlotTable:
    """max_loras slots of stacked adapter weights, filled least-recently-used first."""

    def __init__(self, config: ModelConfig, max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device,
                 qk_row_order: torch.Tensor | None = None) -> None:
        self.config = config
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.qk_row_order = qk_row_order  # the model's per-head q/k row order (interleaving)
        self.sizes = projection_sizes(config)
        layers = config.num_layers
        self.a = {name: torch.zeros(layers, max_loras, len(parts) * max_rank, in_size,
                                    dtype=dtype, device=device)
                  for name, (in_size, parts) in self.sizes.items()}
        self.bt = {name: torch.zeros(layers, max_loras, len(parts) * max_rank, sum(parts),
                                     dtype=dtype, device=device)
                   for name, (_, parts) in self.sizes.items()}
        # For the C++ kernel, on the host: each slot's rank, and per projection the first row
        # of each part in its slot (-1: the adapter leaves that part alone); the parts'
        # output columns.
        self.ranks = torch.zeros(max_loras, dtype=torch.int64)
        self.part_rows = {name: torch.full((max_loras, len(parts)), -1, dtype=torch.int64)
                          for name, parts in PROJECTIONS.items()}
        self.part_offsets = {name: torch.tensor(np.cumsum((0, *parts)), dtype=torch.int64)
                             for name, (_, parts) in self.sizes.items()}
        self.holders: OrderedDict[str, int] = OrderedDict()  # key -> slot, least recent first
        self.loads = 0
        self.evictions = 0

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.a.values(), *self.bt.values()))

    def place(self, adapters: dict[str, PeftAdapter]) -> dict[str, int]:
        """Slots for a batch's adapters (key -> adapter; at most max_loras of them): those
        already held are kept, the others take free slots or evict the least recently used
        adapter that the batch does not name."""
        if len(adapters) > self.max_loras:
            raise ValueError(f"{len(adapters)} adapters for {self.max_loras} slots")
        for key in adapters:
            if key in self.holders:
                self.holders.move_to_end(key)
        slots = {}
        for key, adapter in adapters.items():
            if key not in self.holders:
                self.holders[key] = self._free_slot(adapters)
                self._write(self.holders[key], adapter)
            slots[key] = self.holders[key]
        return slots

    def release(self, key: str) -> None:
        """Empties the slot of `key` (nothing when it holds none)."""
        slot = self.holders.pop(key, None)
        if slot is not None:
            for part_rows in self.part_rows.values():
                part_rows[slot] = -1

    def used_rows(self, slot: int) -> dict[str, int]:
        """Per projection, the rows of `slot` its adapter takes (0: it leaves it alone)."""
        rank = int(self.ranks[slot])
        return {name: rank * int((rows[slot] >= 0).sum()) for name, rows in self.part_rows.items()}

    def _free_slot(self, keep: dict[str, PeftAdapter]) -> int:
        taken = set(self.holders.values())
        for slot in range(self.max_loras):
            if slot not in taken:
                return slot
        victim = next(key for key in self.holders if key not in keep)
        self.evictions += 1
        metrics.LORA_SLOT_EVICTIONS.inc()
        return self.holders.pop(victim)

    def _write(self, slot: int, adapter: PeftAdapter) -> None:
        rank = adapter.rank
        for name, parts in PROJECTIONS.items():
            self.a[name][:, slot].zero_()
            self.bt[name][:, slot].zero_()
            targeted = [part for part in parts if part in adapter.target_modules]
            self.part_rows[name][slot] = torch.tensor(
                [targeted.index(p) * rank if p in targeted else -1 for p in parts])
            offsets = np.cumsum((0, *self.sizes[name][1]))
            for layer in range(self.config.num_layers):
                for k, part in enumerate(targeted):
                    pair = adapter.weights.get((layer, part))
                    if pair is None:
                        continue  # zero rows: this layer leaves the part alone
                    a, b = pair
                    j = parts.index(part)
                    rows = slice(k * rank, (k + 1) * rank)
                    self.a[name][layer, slot, rows] = a
                    self.bt[name][layer, slot, rows, offsets[j]:offsets[j + 1]] = \
                        (self._model_rows(part, b) * adapter.scaling).t()
        self.ranks[slot] = rank
        self.loads += 1
        metrics.LORA_SLOT_LOADS.inc()

    def _model_rows(self, part: str, b: torch.Tensor) -> torch.Tensor:
        """lora_B's output rows in the order the model keeps that projection's rows: q and k
        heads are reordered once the rotary runs interleaved (models/llama.py)."""
        if self.qk_row_order is None or part not in ("q_proj", "k_proj"):
            return b
        head_dim = self.config.head_dim
        heads = b.shape[0] // head_dim
        return b.view(heads, head_dim, -1)[:, self.qk_row_order].reshape(b.shape)


@dataclass(frozen=True)
class RowGroup:
    """The rows of one adapter in a batch, and the rows it uses per projection."""

    slot: int
    rows: slice | torch.Tensor
    used: dict[str, int]


class LoraBatch:
    """One forward's adapters: which rows run through which slot."""

    def __init__(self, table: SlotTable, groups: list[RowGroup], rows: np.ndarray,
                 group_starts: np.ndarray) -> None:
        self.table = table
        self.groups = groups
        # The C++ kernel's view of the groups: their rows one after the other, where each
        # group starts in them, its slot.
        self.index = (torch.from_numpy(rows), torch.from_numpy(group_starts),
                      torch.tensor([g.slot for g in groups], dtype=torch.int64))
        self.use_kernel = (table.a["qkv"].dtype == torch.float32
                           and cpu_kernels.available(table.a["qkv"].device))
        # The projections some group's adapter changes: the others cost nothing.
        self.projections = {name for g in groups for name, rows in g.used.items() if rows}

    @classmethod
    def build(cls, table: SlotTable, row_slots: np.ndarray, device: torch.device
              ) -> LoraBatch:
        """From each token row's slot (-1: base model)."""
        groups, members = [], []
        for slot in np.unique(row_slots[row_slots >= 0]).tolist():
            rows = np.flatnonzero(row_slots == slot)
            members.append(rows)
            first, last = int(rows[0]), int(rows[-1])
            selected: slice | torch.Tensor
            if last - first + 1 == rows.shape[0]:
                selected = slice(first, last + 1)
            else:
                selected = torch.from_numpy(rows).to(device)
            groups.append(RowGroup(slot, selected, table.used_rows(slot)))
        starts = np.cumsum([0] + [len(rows) for rows in members]).astype(np.int64)
        return cls(table, groups, np.concatenate(members).astype(np.int64), starts)

    def add(self, layer: int, projection: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += each group's LoRA product of x, in place (y is the projection's output)."""
        if projection not in self.projections:
            return
        a_slots, bt_slots = self.table.a[projection][layer], self.table.bt[projection][layer]
        if self.use_kernel and x.stride(-1) == 1 and y.stride(-1) == 1:
            cpu_kernels.lora_add(y, x, a_slots, bt_slots, (
                *self.index, self.table.part_rows[projection], self.table.ranks,
                self.table.part_offsets[projection]))
            return
        for group in self.groups:
            used = group.used.get(projection, 0)
            if not used:
                continue
            a, bt = a_slots[group.slot, :used], bt_slots[group.slot, :used]
            if isinstance(group.rows, slice):
                y[group.rows].addmm_(torch.mm(x[group.rows], a.t()), bt)
            else:
                shrunk = torch.mm(x.index_select(0, group.rows), a.t())
                y.index_add_(0, group.rows, torch.mm(shrunk, bt))


class LayerLora(NamedTuple):
    """A batch's adapters as one decoder layer applies them."""

    batch: LoraBatch
    layer: int

    def add(self, projection: str, x: torch.Tensor, y: torch.Tensor) -> None:
        self.batch.add(self.layer, projection, x, y)
