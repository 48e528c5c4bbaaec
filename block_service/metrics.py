"""Prometheus gauges of every pool's counters, read from the core at scrape time."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import REGISTRY, Collector

from block_service.core import BlockServiceCore

_COUNTERS = ("total_blocks", "free_blocks", "used_blocks", "cached_evictable_blocks",
             "num_sequences", "num_sessions", "prompt_tokens", "cached_prompt_tokens",
             "evictions", "copies", "no_space", "total_refs", "epoch")


class PoolStatsCollector(Collector):
    """One gauge per Stats field, labelled by pool."""

    def __init__(self, core: BlockServiceCore) -> None:
        self._core = core

    def collect(self) -> Iterator[GaugeMetricFamily]:
        stats = [asdict(self._core.stats(pool_id)) for pool_id in list(self._core.pools)]
        for name in _COUNTERS:
            gauge = GaugeMetricFamily(f"pagewire_block_{name}", f"Stats.{name} of each pool",
                                      labels=["pool"])
            for pool_stats in stats:
                gauge.add_metric([pool_stats["pool_id"]], pool_stats[name])
            yield gauge


def register_pool_metrics(core: BlockServiceCore) -> None:
    """Exports the pools' counters on the process's /metrics."""
    REGISTRY.register(PoolStatsCollector(core))
