"""The garbage collector's settings for a service that has started.

A service builds a large heap once (modules, protobuf descriptors, the tokenizer, the model)
and then makes many short-lived objects on every step. Python's cyclic collector walks every
tracked object on each full collection, so a step now and then paid for walking the whole
start-up heap again: 8% of the gateway's CPU at 256 streams was the collector (perf). Once a
service serves, its start-up heap is collected once and frozen (gc.freeze: never scanned
again), and the youngest generation is collected less often: almost everything a step makes
is freed by reference counting, and the rest waits a little longer.
"""

from __future__ import annotations

import gc

# Allocations (net of frees) between collections of the youngest generation; Python's
# default is 700, a few hundred times per second for a gateway at 256 streams.
YOUNG_THRESHOLD = 50_000


def freeze_start_up_heap() -> None:
    """Collects once, moves every surviving object out of the collector's view, and raises
    the youngest generation's threshold (the older ones keep their ratios)."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
