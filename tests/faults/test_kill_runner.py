"""The runner is killed (SIGKILL) mid-generation and restarted on the same port: its KV cache
is gone and its epoch changes. Every stream must go on without an error and end with exactly
the tokens of a fault-free run, on each of the two gateways sharing the runner; no batch built
for the old epoch runs on the new runner."""

from __future__ import annotations

import time

import grpc
import pytest

from protos import runner_pb2, runner_pb2_grpc
from tests.faults.conftest import (
    MAX_TOKENS,
    Stack,
    StreamBatch,
    assert_all_exact,
    make_prompts,
    record_timing,
    resumed_after,
    run_streams,
)


def runner_info(address: str) -> runner_pb2.InfoResponse:
    with grpc.insecure_channel(address) as channel:
        return runner_pb2_grpc.RunnerServiceStub(channel).Info(runner_pb2.InfoRequest(),
                                                               timeout=5)


def execute_refused(address: str, epoch: int) -> grpc.StatusCode:
    """The status of a one-token batch built for `epoch` sent to the runner at `address`."""
    batch = runner_pb2.ExecuteRequest(
        epoch=epoch, num_new_tokens=[1], start_positions=[0], token_ids=[100],
        slot_mapping=[0], block_table_lens=[1], block_tables=[0], do_sample=[True],
        temperatures=[0.0], top_ps=[1.0], top_ks=[0], min_ps=[0.0], seeds=[0])
    with grpc.insecure_channel(address) as channel:
        try:
            runner_pb2_grpc.RunnerServiceStub(channel).Execute(batch, timeout=5)
        except grpc.RpcError as error:
            return error.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


@pytest.mark.timeout(150)
def test_runner_killed_mid_generation_streams_complete_exactly(stack: Stack) -> None:
    clients = [stack.gateway()[1], stack.gateway()[1]]
    prompts = make_prompts()
    half = len(prompts) // 2
    shares = [prompts[:half], prompts[half:]]  # 16 streams on each gateway
    reference = [tokens for client, share in zip(clients, shares, strict=True)
                 for tokens in run_streams(client, share)]
    assert stack.wait_idle().used_blocks == 0
    old_epoch = runner_info(stack.runner.address).epoch

    batches = [StreamBatch(client, share) for client, share in zip(clients, shares, strict=True)]
    for batch in batches:
        batch.wait_until_each_has(4)
    killed_at = time.monotonic()
    stack.runner.kill()
    progress_at_kill = [len(r.tokens) for batch in batches for r in batch.records]
    runner = stack.restart(stack.runner).wait_serving(120)
    serving_at = time.monotonic()
    records = [record for batch in batches for record in batch.join()]

    assert max(progress_at_kill) < MAX_TOKENS, "the kill must land mid-generation"
    assert_all_exact(records, reference)
    new_epoch = runner_info(runner.address).epoch
    assert new_epoch != old_epoch
    # Fencing: the new runner refuses a batch of the old epoch (nothing is written).
    assert execute_refused(runner.address, old_epoch) == grpc.StatusCode.FAILED_PRECONDITION
    stats = stack.wait_idle()
    assert stats.epoch == new_epoch  # the pool was emptied for the new epoch
    assert stats.used_blocks == 0 and stats.total_refs == 0
    assert stats.num_sequences == 0

    record_timing(
        "runner_kill",
        runner_restart_s=round(serving_at - killed_at, 3),
        all_streams_resumed_after_serving_s=round(resumed_after(records, serving_at), 3),
        worst_stream_stall_s=round(max(r.longest_gap(killed_at, serving_at) for r in records), 3),
        tokens_before_kill_min=min(progress_at_kill),
        tokens_before_kill_max=max(progress_at_kill),
    )
