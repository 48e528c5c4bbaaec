"""The ceiling: the runner driven directly, with no services in between.

During pagewire's W1 run the runner records every ExecuteRequest it executes
(`--record-batches FILE`); replaying them here in-process through the same ModelRunner gives
the time the model itself needs for exactly those batch shapes, so
efficiency = pagewire end-to-end tokens/s ÷ ceiling tokens/s.
"""

from __future__ import annotations

import time
from pathlib import Path

from gpu_runner.batch import ExecuteBatch
from gpu_runner.recorder import read_recorded
from gpu_runner.runner import ModelRunner


def replay(runner: ModelRunner, path: Path) -> float:
    """Executes the recorded batches; returns the seconds they took. The batches of one
    recording write every K/V they read, so one runner can replay several recordings. No
    warm-up of its own: serve_bench warms the runner once, as it warms every engine."""
    batches = [ExecuteBatch.from_proto(request) for request in read_recorded(path)]
    start = time.perf_counter()
    for batch in batches:
        runner.execute(batch)
    return time.perf_counter() - start
