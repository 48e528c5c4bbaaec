"""The runner's LoRA adapters: loaded by name into host memory, placed in the slot table on
demand, and checked against each batch.

Loading reads and checks the files off the forward thread (`read`), then registers the
adapter (`register`); the slot table is only touched from the forward thread (`for_batch`,
`unload`), so a forward never sees a slot change under it.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gpu_runner import metrics
from gpu_runner.config import ModelConfig
from gpu_runner.lora.peft_format import AdapterError, PeftAdapter, read_peft_adapter
from gpu_runner.lora.slots import LoraBatch, SlotTable
from gpu_runner.merging import BatchError

NAME = re.compile(r"[A-Za-z0-9._:/-]{1,128}")


class AdapterConflictError(AdapterError):
    """The name is taken by an adapter made of other files."""


class AdapterUnknownError(KeyError):
    """No adapter of that name is loaded."""


@dataclass(frozen=True)
class LoadedAdapter:
    name: str
    path: str
    adapter: PeftAdapter


class AdapterManager:
    """Adapters by name (host memory) and the slot table (the model's device)."""

    def __init__(self, config: ModelConfig, max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device,
                 qk_row_order: torch.Tensor | None = None) -> None:
        self.config = config
        self.max_rank = max_rank
        self.device = device
        self.table = SlotTable(config, max_loras, max_rank, dtype, device, qk_row_order)
        self._adapters: dict[str, LoadedAdapter] = {}
        self._holders: dict[str, set[str]] = {}  # name -> who holds it (runner.proto)
        self._lock = threading.Lock()

    @property
    def max_loras(self) -> int:
        return self.table.max_loras

    def adapters(self) -> list[LoadedAdapter]:
        with self._lock:
            return list(self._adapters.values())

    def read(self, name: str, path: str) -> LoadedAdapter:
        """The adapter at `path`, read and checked (AdapterError), not yet served."""
        if not NAME.fullmatch(name):
            raise AdapterError(f"adapter name {name[:140]!r} must be 1 to 128 characters of "
                               "[A-Za-z0-9._:/-]")
        if not path:
            raise AdapterError("the adapter's path is empty")
        adapter = read_peft_adapter(Path(path), self.config, self.max_rank)
        return LoadedAdapter(name, path, adapter)

    def register(self, loaded: LoadedAdapter, holder: str = "") -> LoadedAdapter:
        """Serves `loaded` under its name for `holder`; the one already there when it has the
        same files (AdapterConflictError when its files differ)."""
        with self._lock:
            held = self._adapters.get(loaded.name)
            if held is None:
                self._adapters[loaded.name] = held = loaded
                metrics.LORA_ADAPTERS.inc()
                metrics.LORA_ADAPTER_BYTES.inc(loaded.adapter.nbytes)
            elif held.adapter.digest != loaded.adapter.digest:
                raise AdapterConflictError(
                    f"adapter {loaded.name!r} is already loaded from other files "
                    f"({held.path}); unload it first")
            self._holders.setdefault(loaded.name, set()).add(holder)
        return held

    def unload(self, name: str, holder: str = "") -> bool:
        """`holder` lets go of `name`; once no holder has it, forgets it and frees its slot
        (forward thread). Whether it was forgotten; AdapterUnknownError when `holder` does
        not hold it."""
        with self._lock:
            holders = self._holders.get(name, set())
            if holder not in holders:
                raise AdapterUnknownError(name)
            holders.discard(holder)
            if holders:
                return False
            del self._holders[name]
            loaded = self._adapters.pop(name)
        metrics.LORA_ADAPTERS.dec()
        metrics.LORA_ADAPTER_BYTES.dec(loaded.adapter.nbytes)
        self.table.release(name)
        return True

    def check(self, adapters: tuple[str, ...]) -> None:
        """A batch's adapters column names loaded adapters, at most max_loras of them."""
        named = {name for name in adapters if name}
        if not named:
            return
        with self._lock:
            unknown = sorted(named - self._adapters.keys())
        if unknown:
            raise BatchError(f"adapter {unknown[0]!r} is not loaded on this runner")
        if len(named) > self.max_loras:
            raise BatchError(f"the batch names {len(named)} adapters; this runner runs at "
                             f"most {self.max_loras} per batch (--max-loras)")

    def for_batch(self, adapters: tuple[str, ...], num_new_tokens: np.ndarray
                  ) -> LoraBatch | None:
        """The forward's row groups, after placing its adapters in slots (forward thread;
        the batch was checked). None when every row runs on the base model."""
        named = {name for name in adapters if name}
        if not named:
            return None
        with self._lock:
            wanted = {name: self._adapters[name].adapter for name in sorted(named)}
        slots = self.table.place(wanted)
        seq_slots = np.array([slots.get(name, -1) for name in adapters], dtype=np.int64)
        return LoraBatch.build(self.table, np.repeat(seq_slots, num_new_tokens), self.device)
