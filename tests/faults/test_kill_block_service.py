"""The block service is killed (SIGKILL) mid-generation and restarted on the same port with
the same journal: sessions, block tables and each session's last Step answer come back, so the
gateway goes on where it was (retrying its in-flight Step with the same step id), the runner's
KV cache stays valid, every stream ends with exactly the tokens of a fault-free run, and no
block is leaked or double-owned afterwards."""

from __future__ import annotations

import time

import pytest

from tests.faults.conftest import (
    MAX_TOKENS,
    NUM_STREAMS,
    Stack,
    StreamBatch,
    assert_all_exact,
    make_prompts,
    record_timing,
    resumed_after,
    run_streams,
)


@pytest.mark.timeout(150)
def test_block_service_killed_mid_generation_streams_complete_exactly(stack: Stack) -> None:
    _, client = stack.gateway()
    prompts = make_prompts()
    before_reference = stack.stats()
    reference = run_streams(client, prompts)
    after_reference = stack.wait_idle()
    assert after_reference.used_blocks == 0
    reference_prompt_tokens = after_reference.prompt_tokens - before_reference.prompt_tokens
    assert reference_prompt_tokens == sum(len(p) for p in prompts)

    batch = StreamBatch(client, prompts)
    batch.wait_until_each_has(4)
    killed_at = time.monotonic()
    stack.block_service.kill()
    progress_at_kill = [len(r.tokens) for r in batch.records]
    stack.restart(stack.block_service).wait_serving(60)
    serving_at = time.monotonic()
    # Right after the replay: the tables of the running sequences are back, and every
    # referenced block is held by some sequence (ref counts add up; nothing double-owned
    # shows up as more references than the sequences' tables hold).
    restored = stack.stats()
    assert restored.num_sessions == 1
    assert 0 < restored.num_sequences <= NUM_STREAMS
    assert restored.used_blocks <= restored.total_refs
    assert restored.free_blocks + restored.used_blocks == restored.total_blocks
    records = batch.join()

    # Mid-generation for the streams still running (the first ones may have finished before
    # the last one had 4 tokens: the streams are admitted in waves, and steps got faster).
    assert min(progress_at_kill) < MAX_TOKENS, "the kill must land mid-generation"
    assert_all_exact(records, reference)
    stats = stack.wait_idle()
    assert stats.used_blocks == 0 and stats.total_refs == 0 and stats.num_sequences == 0
    assert stats.free_blocks == stats.total_blocks
    # Nothing was recomputed: every prompt was allocated exactly once in the faulted run, as
    # in the reference run (a lost session or table would have re-allocated them).
    assert stats.prompt_tokens - after_reference.prompt_tokens == reference_prompt_tokens

    record_timing(
        "block_service_kill",
        block_service_restart_s=round(serving_at - killed_at, 3),
        all_streams_resumed_after_serving_s=round(resumed_after(records, serving_at), 3),
        worst_stream_stall_s=round(max(r.longest_gap(killed_at, serving_at) for r in records), 3),
        tokens_before_kill_min=min(progress_at_kill),
        tokens_before_kill_max=max(progress_at_kill),
    )
