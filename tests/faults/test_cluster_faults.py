"""Runners come and go under running gateways (docs/scaling.md, "Membership"): runners
register themselves with the block service under a lease, and gateways started without
--runner serve every registered one.

- A runner killed (SIGKILL) or stopped (SIGTERM) mid-generation: once its lease runs out, each
  gateway moves its requests to the other runner, where they are recomputed from prompt plus
  tokens so far; every stream ends with exactly the tokens of a fault-free run.
- A runner started while the cluster serves gets new requests within 10 s of serving.

Each test compares with a fault-free reference run through the same cluster first (greedy,
ignore_eos, MAX_TOKENS tokens per stream), as the other fault tests do.
"""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest

from tests.faults.conftest import (
    MAX_TOKENS,
    Cluster,
    StreamBatch,
    StreamRecord,
    assert_all_exact,
    make_prompts,
    record_timing,
    resumed_after,
    run_streams,
    wait_for,
)
from tests.helpers.services import GatewayProcess, ServiceProcess

NUM_STREAMS = 16
# How soon a runner that starts serving must get new requests (the promise; the
# gateways poll the membership every 0.5 s).
JOIN_WITHIN_S = 10.0


def split(prompts: list[list[int]], gateways: list[GatewayProcess]) -> list[list[list[int]]]:
    """The prompts dealt out to the gateways in equal consecutive shares."""
    share = len(prompts) // len(gateways)
    return [prompts[i * share:(i + 1) * share] for i in range(len(gateways))]


def reference_run(cluster: Cluster, gateways: list[GatewayProcess],
                  shares: list[list[list[int]]]) -> list[list[int]]:
    """The fault-free tokens of every stream (in share order); every pool idle after."""
    reference = [tokens for gateway, share in zip(gateways, shares, strict=True)
                 for tokens in run_streams(gateway.client, share)]
    for runner in cluster.runners:
        assert cluster.wait_idle(runner).used_blocks == 0
    return reference


def busiest(cluster: Cluster, runners: list[ServiceProcess]) -> ServiceProcess:
    """The runner whose pool holds the most live sequences."""
    return max(runners, key=lambda runner: cluster.stats(runner).num_sequences)


def leave_mid_generation(cluster: Cluster, num_gateways: int, leave: str, seed: int) -> None:
    """Two runners, `num_gateways` gateways, NUM_STREAMS streams over them; once every stream
    has a few tokens, the runner holding the most sequences is killed (leave="kill") or
    stopped (leave="stop"). Checks that every stream ends exactly as in the fault-free run,
    that the gateways moved requests, and that the other runner's pool ends idle."""
    runners = cluster.start_runners(2)
    gateways = cluster.start_gateways(num_gateways)
    shares = split(make_prompts(NUM_STREAMS, seed=seed), gateways)
    reference = reference_run(cluster, gateways, shares)
    assert all(cluster.stats(runner).prompt_tokens > 0 for runner in runners), \
        "the reference run did not use both runners"

    batches = [StreamBatch(gateway.client, share)
               for gateway, share in zip(gateways, shares, strict=True)]
    for batch in batches:
        batch.wait_until_each_has(4)
    leaving = busiest(cluster, runners)
    staying = next(runner for runner in runners if runner is not leaving)
    held = cluster.stats(leaving).num_sequences
    left_at = time.monotonic()
    assert leaving.process is not None
    if leave == "kill":
        leaving.kill()
    else:
        leaving.process.send_signal(signal.SIGTERM)
    progress_at_leave = [len(r.tokens) for batch in batches for r in batch.records]
    if leave == "stop":
        assert leaving.process.wait(10) == 0, leaving.log()
    gone_at = wait_for(lambda: leaving.address not in cluster.live_runners(), 30)
    records = [record for batch in batches for record in batch.join()]

    assert held > 0
    # Streams of the other runner may have ended; those moved (below) were mid-generation.
    assert min(progress_at_leave) < MAX_TOKENS, "the runner must leave mid-generation"
    assert_all_exact(records, reference)
    moved = [gateway.metric("pagewire_gateway_moved_requests_total") for gateway in gateways]
    assert sum(moved) > 0, "no gateway moved a request off the runner that left"
    assert leaving.address not in cluster.live_runners()
    stats = cluster.wait_idle(staying)
    assert stats.used_blocks == 0 and stats.num_sequences == 0 and stats.total_refs == 0
    # The pool of the runner that left is gone with its lease.
    with pytest.raises(grpc.RpcError) as error:
        cluster.stats(leaving)
    assert error.value.code() == grpc.StatusCode.NOT_FOUND

    record_timing(
        f"cluster_runner_{leave}",
        gateways=num_gateways,
        sequences_on_leaving_runner=held,
        moved_requests=int(sum(moved)),
        lease_ran_out_after_s=round(gone_at - left_at, 3),
        # The moved streams stall from the runner's last token until their first on the
        # other runner, after the lease ran out.
        all_streams_resumed_after_lease_s=round(resumed_after(records, gone_at), 3),
        worst_stream_stall_s=round(max(r.longest_gap(left_at, gone_at) for r in records), 3),
        tokens_before_min=min(progress_at_leave),
        tokens_before_max=max(progress_at_leave),
    )


@pytest.mark.timeout(150)
def test_runner_killed_mid_generation_its_streams_move_and_complete_exactly(
        cluster: Cluster) -> None:
    leave_mid_generation(cluster, num_gateways=2, leave="kill", seed=21)


@pytest.mark.timeout(150)
def test_runner_stopped_mid_generation_its_streams_move_and_complete_exactly(
        cluster: Cluster) -> None:
    leave_mid_generation(cluster, num_gateways=1, leave="stop", seed=22)


@pytest.mark.timeout(150)
def test_runner_started_while_serving_gets_requests_within_10_s(cluster: Cluster) -> None:
    first, = cluster.start_runners(1)
    gateway, = cluster.start_gateways(1)
    prompts = make_prompts(NUM_STREAMS, seed=23)
    reference = run_streams(gateway.client, prompts)

    # Rounds of the same streams, one after the other, until told to stop.
    rounds: list[list[StreamRecord]] = []
    stop = threading.Event()

    def keep_serving() -> None:
        while not stop.is_set():
            rounds.append(StreamBatch(gateway.client, prompts).join())

    serving = threading.Thread(target=keep_serving, name="rounds", daemon=True)
    serving.start()
    try:
        second = cluster.start_runner()
        second.wait_serving(120)
        serving_at = time.monotonic()
        placed_on_first_before = cluster.placed(first)
        deadline = serving_at + JOIN_WITHIN_S
        while cluster.placed(second) == 0:
            assert time.monotonic() < deadline, (
                f"no request placed on {second.address} within {JOIN_WITHIN_S:.0f} s of it "
                f"serving (live runners: {sorted(cluster.live_runners())})")
            time.sleep(0.02)
        placed_at = time.monotonic()
        # Two more whole rounds, the second of them started after the placement: they ran
        # on both runners.
        after = len(rounds)
        wait_for(lambda: len(rounds) >= after + 2, 60)
    finally:
        stop.set()
        serving.join(120)

    assert not serving.is_alive()
    for records in rounds:
        assert_all_exact(records, reference)
    stats = cluster.wait_idle(second)
    assert stats.prompt_tokens > 0 and stats.appended_tokens > 0, stats
    assert stats.used_blocks == 0 and stats.num_sequences == 0
    assert cluster.wait_idle(first).used_blocks == 0
    record_timing(
        "cluster_runner_join",
        placed_after_serving_s=round(placed_at - serving_at, 3),
        rounds=len(rounds),
        # Placements since the new runner served (the prompts are cached on the first).
        placed_on_new_runner=int(cluster.placed(second)),
        placed_on_first_runner=int(cluster.placed(first) - placed_on_first_before),
    )
