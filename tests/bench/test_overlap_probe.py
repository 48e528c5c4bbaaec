"""The overlap probe's Step load against a real block service: every operation it sends must
succeed (a failing APPEND is cheaper than a real one and would understate the cost), across the
point where its sequences are freed and allocated again."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from bench.overlap_probe import APPENDS_PER_SEQUENCE, NUM_SEQS, POOL_ID, StepLoad
from block_service.core import BlockServiceCore
from block_service.servicer import SERVICE_NAME, register
from common.server import ServerOptions, start_server


@pytest.fixture
def block_service() -> Iterator[tuple[str, BlockServiceCore]]:
    core = BlockServiceCore()
    options = ServerOptions(port=0)
    service = start_server(options, register(core, options.max_workers), [SERVICE_NAME])
    yield f"127.0.0.1:{service.port}", core
    service.stop(grace_s=0)


def test_step_load_appends_to_live_sequences_through_a_new_generation(block_service):
    address, core = block_service
    load = StepLoad(address, period_s=0.001)
    wanted = APPENDS_PER_SEQUENCE + 10  # past the free-and-allocate-again step
    deadline = time.monotonic() + 60
    while load.steps_sent < wanted and load.error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    load.stop()
    assert load.error is None
    assert load.steps_sent >= wanted
    assert load.failed_ops == 0
    stats = core.stats(POOL_ID)
    assert stats.num_sequences == NUM_SEQS  # the first generation was freed
    # Every live sequence holds its 16-token prompt plus the appends of this generation.
    seqs = next(iter(core.pools[POOL_ID].seqs.values()))
    lengths = {len(seq.tokens) for seq in seqs.values()}
    assert len(lengths) == 1 and 16 < lengths.pop() <= 16 + APPENDS_PER_SEQUENCE
