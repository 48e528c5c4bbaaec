"""The runner's own Prometheus metrics (the RPC ones are common/metrics.py's), on the
process's /metrics (--metrics-port)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

LORA_SLOT_LOADS = Counter(
    "pagewire_runner_lora_slot_loads", "LoRA adapters written into a slot of the slot table")
LORA_SLOT_EVICTIONS = Counter(
    "pagewire_runner_lora_slot_evictions",
    "LoRA adapters taken out of the slot table for another (least recently used first)")
LORA_ADAPTERS = Gauge("pagewire_runner_lora_adapters", "LoRA adapters loaded (host memory)")
LORA_ADAPTER_BYTES = Gauge("pagewire_runner_lora_adapter_bytes",
                           "Host memory of the loaded LoRA adapters' weights")
