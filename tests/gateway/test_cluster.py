"""One gateway over several fake runners that register themselves with a real block service:
placement by Route, a runner that joins, a runner that leaves mid-generation."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from prometheus_client import REGISTRY

from common.registration import PoolShape, Registration
from common.server import GrpcService
from gateway.client import Completion, PagewireClient
from gateway.server import Gateway
from gateway.tokenizer import Tokenizer
from protos import block_pb2, block_pb2_grpc
from tests.gateway.conftest import start_fake_runner, start_gateway
from tests.gateway.fake_runner import FakeRunner, expected_tokens
from tests.helpers.services import ServiceProcess

BLOCK_SIZE = 4
NUM_BLOCKS = 256
LEASE_MS = 1000
PREFIX = list(range(300, 500))  # 50 full blocks: a long prefix
MAX_TOKENS = 12

pytestmark = pytest.mark.timeout(120)


class FakeMember:
    """A fake runner serving on loopback and registered with the block service."""

    def __init__(self, block_address: str, epoch: int) -> None:
        self.runner = FakeRunner(NUM_BLOCKS, BLOCK_SIZE, epoch=epoch)
        self.server: GrpcService = start_fake_runner(self.runner)
        self.address = f"127.0.0.1:{self.server.port}"
        self.registration = Registration(
            grpc.insecure_channel(block_address), self.address, self.address,
            lambda: PoolShape(NUM_BLOCKS, BLOCK_SIZE, epoch), LEASE_MS).start()

    def leave(self) -> None:
        """Stops renewing and serving (as a killed runner does)."""
        self.registration.stop()
        self.server.stop(0)


@pytest.fixture
def cluster(tokenizer: Tokenizer, block_service: ServiceProcess
            ) -> Iterator[tuple[list[FakeMember], Gateway, block_pb2_grpc.BlockServiceStub]]:
    members = [FakeMember(block_service.address, epoch) for epoch in (11, 12)]
    channel = grpc.insecure_channel(block_service.address)
    blocks = block_pb2_grpc.BlockServiceStub(channel)
    _wait_for_members(blocks, 2)
    gateway = start_gateway(tokenizer, block_service.address, runner_address=None)
    try:
        yield members, gateway, blocks
    finally:
        gateway.stop()
        for member in members:
            member.leave()
        channel.close()


def _wait_for_members(blocks: block_pb2_grpc.BlockServiceStub, count: int) -> None:
    deadline = time.monotonic() + 10
    while len(blocks.ListRunners(block_pb2.ListRunnersRequest()).runners) != count:
        assert time.monotonic() < deadline, "runners did not register"
        time.sleep(0.05)


def _client(gateway: Gateway) -> PagewireClient:
    assert gateway.service is not None
    return PagewireClient(f"127.0.0.1:{gateway.service.port}")


def _run(client: PagewireClient, prompt: list[int]) -> Completion:
    return client.complete(token_ids=prompt, max_tokens=MAX_TOKENS, temperature=0, timeout=60)


def _moved() -> float:
    return REGISTRY.get_sample_value("pagewire_gateway_moved_requests_total") or 0.0


def _prompt_tokens(blocks: block_pb2_grpc.BlockServiceStub, member: FakeMember) -> int:
    return blocks.GetStats(block_pb2.GetStatsRequest(pool_id=member.address)).stats.prompt_tokens


def test_shared_prefix_stays_on_its_runner_and_the_rest_spreads(
        cluster: tuple[list[FakeMember], Gateway, block_pb2_grpc.BlockServiceStub]) -> None:
    members, gateway, blocks = cluster
    assert {loop.address for loop in gateway.engine.loops} == {m.address for m in members}
    with _client(gateway) as client:
        warm = _run(client, [*PREFIX, 1])
        holder = next(m for m in members if _prompt_tokens(blocks, m))
        shared = [[*PREFIX, 10 + i, 20 + i] for i in range(6)]
        unrelated = [[1000 + 37 * i + j for j in range(20)] for i in range(8)]
        with ThreadPoolExecutor(14) as pool:
            results = list(pool.map(lambda p: _run(client, p), shared + unrelated))
    assert warm.token_ids[0] == expected_tokens([*PREFIX, 1], MAX_TOKENS)
    for prompt, result in zip(shared + unrelated, results, strict=True):
        assert result.token_ids[0] == expected_tokens(prompt, MAX_TOKENS)
    for result in results[:len(shared)]:
        assert result.usage.cached_tokens == len(PREFIX)  # every one on the holder
    holder_stats = blocks.GetStats(block_pb2.GetStatsRequest(pool_id=holder.address)).stats
    assert holder_stats.cached_prompt_tokens == len(shared) * len(PREFIX)
    other = next(m for m in members if m is not holder)
    assert _prompt_tokens(blocks, other) >= 2 * 20  # unrelated requests went there too


def test_a_runner_that_leaves_mid_generation_has_its_requests_recomputed_elsewhere(
        cluster: tuple[list[FakeMember], Gateway, block_pb2_grpc.BlockServiceStub]) -> None:
    members, gateway, blocks = cluster
    moved_before = _moved()
    prompts = [[2000 + 50 * i + j for j in range(9)] for i in range(8)]
    with _client(gateway) as client, ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(_run, client, prompt) for prompt in prompts]
        deadline = time.monotonic() + 30
        while not all(_prompt_tokens(blocks, m) for m in members):
            assert time.monotonic() < deadline, "the requests did not spread"
            time.sleep(0.01)
        leaving = members[0]
        leaving.runner.proceed.clear()  # it stops computing, then goes away
        time.sleep(0.2)
        leaving.leave()
        results = [future.result(timeout=60) for future in futures]
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids[0] == expected_tokens(prompt, MAX_TOKENS)
    assert [loop.address for loop in gateway.engine.loops] == [members[1].address]
    assert _moved() > moved_before  # some were running there, and finished elsewhere
    stats = blocks.GetStats(block_pb2.GetStatsRequest(pool_id=members[1].address)).stats
    assert stats.num_sequences == 0


def test_a_runner_that_joins_gets_requests(
        cluster: tuple[list[FakeMember], Gateway, block_pb2_grpc.BlockServiceStub],
        block_service: ServiceProcess) -> None:
    members, gateway, blocks = cluster
    joined = FakeMember(block_service.address, 13)
    members.append(joined)  # left by the fixture
    deadline = time.monotonic() + 10
    while joined.address not in {loop.address for loop in gateway.engine.loops}:
        assert time.monotonic() < deadline, "the gateway did not serve the new runner"
        time.sleep(0.05)
    prompts = [[3000 + 40 * i + j for j in range(11)] for i in range(9)]
    with _client(gateway) as client, ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: _run(client, p), prompts))
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids[0] == expected_tokens(prompt, MAX_TOKENS)
    assert _prompt_tokens(blocks, joined) > 0
