"""One of two gateways on the same block service and runner is killed (SIGKILL) mid-generation:
its clients' streams end with UNAVAILABLE, the other gateway's streams end exactly as in a
fault-free run, and the dead gateway's blocks are reclaimed once its lease runs out (within
lease TTL + 1 s of the kill)."""

from __future__ import annotations

import time

import grpc
import pytest

from tests.faults.conftest import (
    LEASE_TTL_MS,
    MAX_TOKENS,
    NUM_STREAMS,
    Stack,
    StreamBatch,
    assert_all_exact,
    make_prompts,
    record_timing,
    run_streams,
    wait_for,
)


@pytest.mark.timeout(150)
def test_gateway_killed_other_gateway_unaffected_and_blocks_reclaimed(stack: Stack) -> None:
    doomed, doomed_client = stack.gateway()
    _, survivor_client = stack.gateway()
    prompts = make_prompts()
    half = NUM_STREAMS // 2
    survivor_prompts, doomed_prompts = prompts[:half], prompts[half:]
    reference = run_streams(survivor_client, survivor_prompts)
    assert stack.wait_idle().used_blocks == 0
    assert stack.stats().num_sessions == 2

    # Long enough streams on the survivor that they are still running when the lease ends.
    survivor = StreamBatch(survivor_client, survivor_prompts)
    victims = StreamBatch(doomed_client, doomed_prompts)
    victims.wait_until_each_has(4)
    survivor.wait_until_each_has(4)
    killed_at = time.monotonic()
    doomed.kill()
    reclaimed_at = wait_for(lambda: stack.stats().num_sessions == 1,
                            timeout_s=LEASE_TTL_MS / 1000 + 5, poll_s=0.01)
    after_expiry = stack.stats()
    survivor_records = survivor.join()
    victim_records = victims.join()

    for record in victim_records:
        assert record.error == grpc.StatusCode.UNAVAILABLE, record.error
        assert len(record.tokens) < MAX_TOKENS
    assert_all_exact(survivor_records, reference)
    reclaim_s = reclaimed_at - killed_at
    assert reclaim_s <= LEASE_TTL_MS / 1000 + 1.0
    # Once the dead session is gone only the survivor's sequences hold blocks.
    assert after_expiry.num_sequences <= half
    stats = stack.wait_idle()
    assert stats.used_blocks == 0 and stats.total_refs == 0 and stats.num_sequences == 0
    assert stats.num_sessions == 1

    record_timing("gateway_kill", lease_ttl_s=LEASE_TTL_MS / 1000,
                  blocks_reclaimed_after_kill_s=round(reclaim_s, 3),
                  survivor_worst_stall_s=round(
                      max(r.longest_gap(killed_at, reclaimed_at) for r in survivor_records), 3))
