"""The block service over real gRPC on loopback ports."""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from block_service.core import BlockServiceCore
from block_service.reaper import LeaseReaper
from block_service.servicer import SERVICE_NAME, register, serve
from block_service.sessions import LeasePolicy
from common.server import ServerOptions, start_server
from protos import block_pb2, block_pb2_grpc
from tests.helpers.services import ServiceProcess, free_port

POOL = "runner-0"
OK = block_pb2.OP_STATUS_OK


# Both servers of the block service: grpc.aio (the default) and the threaded one.
@pytest.fixture(params=["aio", "threads"])
def stub(request: pytest.FixtureRequest) -> Iterator[block_pb2_grpc.BlockServiceStub]:
    core = BlockServiceCore(LeasePolicy(default_ttl_s=10.0, min_ttl_s=0.5, max_ttl_s=60.0))
    service, stop_loop = serve(core, ServerOptions(port=0), threaded=request.param == "threads")
    reaper = LeaseReaper(core, interval_s=0.1).start()
    channel = grpc.insecure_channel(f"127.0.0.1:{service.port}")
    stub = block_pb2_grpc.BlockServiceStub(channel)
    stub.CreatePool(block_pb2.CreatePoolRequest(pool_id=POOL, num_blocks=64, block_size=16,
                                                epoch=7))
    yield stub
    channel.close()
    reaper.stop()
    service.stop(grace_s=0)
    stop_loop()


def open_session(stub: block_pb2_grpc.BlockServiceStub, ttl_ms: int = 0) -> str:
    return stub.OpenSession(block_pb2.OpenSessionRequest(client_name="test",
                                                         lease_ttl_ms=ttl_ms)).session_id


def used_blocks(stub: block_pb2_grpc.BlockServiceStub) -> int:
    return stub.GetStats(block_pb2.GetStatsRequest(pool_id=POOL)).stats.used_blocks


def decode_step(session: str, step_id: int, seq_ids: list[int], lengths: list[int],
                token: int = 5) -> block_pb2.StepRequest:
    return block_pb2.StepRequest(
        session_id=session, pool_id=POOL, step_id=step_id, epoch=7,
        op_kinds=[block_pb2.OP_KIND_APPEND] * len(seq_ids), seq_ids=seq_ids,
        token_counts=[1] * len(seq_ids), token_ids=[token] * len(seq_ids),
        parent_seq_ids=[0] * len(seq_ids), num_computed_tokens=lengths)


def status_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as error:
        call()
    return error.value.code()


def test_two_sessions_share_a_prefix(stub):
    first, second = open_session(stub), open_session(stub)
    prompt = list(range(1000, 1040))  # 40 tokens: two full blocks of 16
    allocated = stub.Allocate(block_pb2.AllocateRequest(
        session_id=first, pool_id=POOL, seq_id=1, token_ids=prompt))
    assert allocated.allocated and allocated.num_cached_tokens == 0
    assert len(allocated.block_table) == 3 and len(allocated.slot_mapping) == 40
    # The first session's prompt is computed: it says so with its next step.
    stub.Step(block_pb2.StepRequest(
        session_id=first, pool_id=POOL, step_id=1, op_kinds=[block_pb2.OP_KIND_COMMIT],
        seq_ids=[1], token_counts=[0], parent_seq_ids=[0], num_computed_tokens=[40]))
    assert stub.MatchPrefix(block_pb2.MatchPrefixRequest(
        pool_id=POOL, token_ids=prompt)).num_cached_tokens == 32
    shared = stub.Allocate(block_pb2.AllocateRequest(
        session_id=second, pool_id=POOL, seq_id=1, token_ids=prompt))
    assert shared.num_cached_tokens == 32
    assert list(shared.block_table[:2]) == list(allocated.block_table[:2])
    assert len(shared.slot_mapping) == 8
    stats = stub.GetStats(block_pb2.GetStatsRequest(pool_id=POOL)).stats
    assert (stats.cached_prompt_tokens, stats.prompt_tokens, stats.used_blocks) == (32, 80, 4)
    assert stats.total_refs == 6 and stats.num_sessions == 2


def test_session_without_keepalives_is_reclaimed(stub):
    quiet, alive = open_session(stub, ttl_ms=1000), open_session(stub, ttl_ms=1000)
    for session in (quiet, alive):
        stub.Allocate(block_pb2.AllocateRequest(session_id=session, pool_id=POOL, seq_id=1,
                                                token_ids=list(range(40))))
    assert used_blocks(stub) == 6
    last_call = time.monotonic()
    deadline = last_call + 1.0 + 1.0  # TTL + 1 s
    while used_blocks(stub) != 3:
        stub.KeepAlive(block_pb2.KeepAliveRequest(session_id=alive))
        assert time.monotonic() < deadline, "the quiet session's blocks were not reclaimed"
        time.sleep(0.05)
    code = status_of(lambda: stub.KeepAlive(block_pb2.KeepAliveRequest(session_id=quiet)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert stub.KeepAlive(block_pb2.KeepAliveRequest(session_id=alive)).lease_ttl_ms == 1000


def test_retried_step_is_applied_once(stub):
    session = open_session(stub)
    request = block_pb2.StepRequest(
        session_id=session, pool_id=POOL, step_id=1, epoch=7,
        op_kinds=[block_pb2.OP_KIND_ALLOCATE, block_pb2.OP_KIND_FORK],
        seq_ids=[1, 2], token_counts=[17, 0], token_ids=list(range(17)),
        parent_seq_ids=[0, 1], num_computed_tokens=[-1, -1])
    first = stub.Step(request)
    assert list(first.op_statuses) == [OK, OK]
    assert used_blocks(stub) == 2
    again = stub.Step(request)
    assert again == first
    assert used_blocks(stub) == 2
    appended = stub.Step(decode_step(session, 2, [1, 2], [17, 17]))
    assert len(appended.copies) == 1  # the shared partial block is copied once
    assert stub.Step(decode_step(session, 2, [1, 2], [17, 17])) == appended
    stats = stub.GetStats(block_pb2.GetStatsRequest(pool_id=POOL)).stats
    assert (stats.used_blocks, stats.copies) == (3, 1)
    code = status_of(lambda: stub.Step(decode_step(session, 1, [1], [18])))
    assert code == grpc.StatusCode.FAILED_PRECONDITION


def test_single_sequence_rpcs(stub):
    session = open_session(stub)
    stub.Allocate(block_pb2.AllocateRequest(session_id=session, pool_id=POOL, seq_id=1,
                                            token_ids=list(range(16))))
    appended = stub.Append(block_pb2.AppendRequest(session_id=session, pool_id=POOL, seq_id=1,
                                                   token_ids=[3], num_computed_tokens=16))
    assert appended.allocated and len(appended.block_table) == 2
    assert list(appended.slot_mapping) == [appended.block_table[1] * 16]
    forked = stub.Fork(block_pb2.ForkRequest(session_id=session, pool_id=POOL,
                                             parent_seq_id=1, child_seq_id=2))
    assert forked.block_table == appended.block_table
    copied = stub.Append(block_pb2.AppendRequest(session_id=session, pool_id=POOL, seq_id=2,
                                                 token_ids=[4]))
    assert [(c.src_block_id, c.dst_block_id) for c in copied.copies] == [
        (appended.block_table[1], copied.block_table[1])]
    freed = stub.Free(block_pb2.FreeRequest(session_id=session, pool_id=POOL, seq_id=1))
    assert freed.num_released_blocks == 1  # its private last block; block 0 is shared
    assert stub.CloseSession(block_pb2.CloseSessionRequest(
        session_id=session)).num_freed_sequences == 1
    assert used_blocks(stub) == 0


def test_bad_input_statuses(stub):
    session = open_session(stub)
    stub.Allocate(block_pb2.AllocateRequest(session_id=session, pool_id=POOL, seq_id=1,
                                            token_ids=[1, 2, 3]))
    before = stub.GetStats(block_pb2.GetStatsRequest(pool_id=POOL)).stats
    invalid, not_found = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
    precondition = grpc.StatusCode.FAILED_PRECONDITION
    calls = [
        (lambda: stub.KeepAlive(block_pb2.KeepAliveRequest(session_id="nope")), not_found),
        (lambda: stub.GetPool(block_pb2.GetPoolRequest(pool_id="nope")), not_found),
        (lambda: stub.CreatePool(block_pb2.CreatePoolRequest(
            pool_id="p", num_blocks=8, block_size=3, epoch=1)), invalid),
        (lambda: stub.CreatePool(block_pb2.CreatePoolRequest(
            pool_id="p", num_blocks=0, block_size=4, epoch=1)), invalid),
        (lambda: stub.CreatePool(block_pb2.CreatePoolRequest(
            pool_id=POOL, num_blocks=8, block_size=16, epoch=7)), precondition),
        (lambda: stub.Allocate(block_pb2.AllocateRequest(
            session_id=session, pool_id=POOL, seq_id=2)), invalid),
        (lambda: stub.Allocate(block_pb2.AllocateRequest(
            session_id=session, pool_id=POOL, seq_id=2, token_ids=[1, -3])), invalid),
        (lambda: stub.Allocate(block_pb2.AllocateRequest(
            session_id=session, pool_id=POOL, seq_id=2, token_ids=[1] * 2000)), invalid),
        (lambda: stub.Allocate(block_pb2.AllocateRequest(
            session_id=session, pool_id=POOL, seq_id=1, token_ids=[1])),
         grpc.StatusCode.ALREADY_EXISTS),
        (lambda: stub.Allocate(block_pb2.AllocateRequest(
            session_id="nope", pool_id=POOL, seq_id=2, token_ids=[1])), not_found),
        (lambda: stub.Allocate(block_pb2.AllocateRequest(
            session_id=session, pool_id="nope", seq_id=2, token_ids=[1])), not_found),
        (lambda: stub.Free(block_pb2.FreeRequest(
            session_id=session, pool_id=POOL, seq_id=2)), not_found),
        (lambda: stub.Fork(block_pb2.ForkRequest(
            session_id=session, pool_id=POOL, parent_seq_id=1, child_seq_id=1)),
         grpc.StatusCode.ALREADY_EXISTS),
        (lambda: stub.Step(block_pb2.StepRequest(
            session_id=session, pool_id=POOL, step_id=1, op_kinds=[block_pb2.OP_KIND_FREE],
            seq_ids=[1, 2], token_counts=[0], parent_seq_ids=[0],
            num_computed_tokens=[-1])), invalid),
        (lambda: stub.Step(block_pb2.StepRequest(
            session_id=session, pool_id=POOL, step_id=1, op_kinds=[block_pb2.OP_KIND_APPEND],
            seq_ids=[1], token_counts=[2], token_ids=[1], parent_seq_ids=[0],
            num_computed_tokens=[-1])), invalid),
        (lambda: stub.Step(decode_step(session, 1, [1], [3]).__class__(
            session_id=session, pool_id=POOL, step_id=1, epoch=8)), precondition),
    ]
    for call, code in calls:
        assert status_of(call) == code
    after = stub.GetStats(block_pb2.GetStatsRequest(pool_id=POOL)).stats
    assert after == before
    # Per-operation errors come back in the answer, not as a failed call.
    answer = stub.Step(block_pb2.StepRequest(
        session_id=session, pool_id=POOL, step_id=1,
        op_kinds=[block_pb2.OP_KIND_FREE, block_pb2.OP_KIND_APPEND], seq_ids=[9, 1],
        token_counts=[0, 1], token_ids=[4], parent_seq_ids=[0, 0], num_computed_tokens=[-1, 3]))
    assert list(answer.op_statuses) == [block_pb2.OP_STATUS_NOT_FOUND, OK]
    assert 0 in answer.errors and 1 not in answer.errors
    full = stub.Allocate(block_pb2.AllocateRequest(session_id=session, pool_id=POOL, seq_id=3,
                                                   token_ids=[1] * (63 * 16 + 1)))
    assert not full.allocated  # no space is an answer, not an error


def test_new_epoch_makes_sequences_stale(stub):
    session = open_session(stub)
    stub.Allocate(block_pb2.AllocateRequest(session_id=session, pool_id=POOL, seq_id=1,
                                            token_ids=[1, 2, 3]))
    stub.Allocate(block_pb2.AllocateRequest(session_id=session, pool_id=POOL, seq_id=2,
                                            token_ids=[1, 2, 3]))
    pool = stub.CreatePool(block_pb2.CreatePoolRequest(pool_id=POOL, num_blocks=64,
                                                       block_size=16, epoch=8)).pool
    assert pool.epoch == 8 and used_blocks(stub) == 0
    code = status_of(lambda: stub.Append(block_pb2.AppendRequest(
        session_id=session, pool_id=POOL, seq_id=1, token_ids=[4])))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    answer = stub.Step(block_pb2.StepRequest(
        session_id=session, pool_id=POOL, step_id=1, epoch=8,
        op_kinds=[block_pb2.OP_KIND_APPEND], seq_ids=[2], token_counts=[1], token_ids=[4],
        parent_seq_ids=[0], num_computed_tokens=[-1]))
    assert list(answer.op_statuses) == [block_pb2.OP_STATUS_STALE] and answer.epoch == 8


def test_concurrent_sessions_keep_the_state_consistent(stub):
    """Eight clients step at once; every block ends up accounted for."""
    errors: list[BaseException] = []

    def client(worker: int) -> None:
        try:
            session = open_session(stub)
            seq_ids = [worker * 100 + i for i in range(4)]
            for seq_id in seq_ids:
                stub.Allocate(block_pb2.AllocateRequest(session_id=session, pool_id=POOL,
                                                        seq_id=seq_id, token_ids=[worker] * 5))
            for step_id in range(1, 28):  # 32 tokens each: the 64 blocks, exactly
                lengths = [4 + step_id] * len(seq_ids)
                answer = stub.Step(decode_step(session, step_id, seq_ids, lengths, worker))
                assert list(answer.op_statuses) == [OK] * len(seq_ids)
            for seq_id in seq_ids[:2]:
                stub.Free(block_pb2.FreeRequest(session_id=session, pool_id=POOL, seq_id=seq_id))
        except BaseException as error:  # reported in the main thread
            errors.append(error)

    threads = [threading.Thread(target=client, args=(w,)) for w in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    stats = stub.GetStats(block_pb2.GetStatsRequest(pool_id=POOL)).stats
    # 8 workers x 2 live sequences of 32 tokens = 2 blocks each.
    assert stats.num_sequences == 16
    assert stats.used_blocks == 32 and stats.total_refs == 32
    assert stats.free_blocks + stats.used_blocks == 64


def test_process_serves_health_reflection_metrics_and_stops_on_sigterm(tmp_path: Path):
    metrics_port = free_port()
    service = ServiceProcess("block_service", ["--metrics-port", str(metrics_port)])
    service.start(tmp_path)
    try:
        service.wait_serving(timeout_s=60)
        with grpc.insecure_channel(service.address) as channel:
            reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
            answers = reflection.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
            names = {s.name for a in answers for s in a.list_services_response.service}
            block_pb2_grpc.BlockServiceStub(channel).CreatePool(block_pb2.CreatePoolRequest(
                pool_id="p", num_blocks=8, block_size=4, epoch=1))
        assert SERVICE_NAME == "pagewire.block.v1.BlockService"
        assert SERVICE_NAME in names and "grpc.health.v1.Health" in names
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics") as page:
            metrics = page.read().decode()
        assert 'pagewire_block_free_blocks{pool="p"} 8.0' in metrics
        started = time.monotonic()
        assert service.terminate(timeout_s=5) == 0
        assert time.monotonic() - started < 5
    finally:
        service.kill()


def test_step_stream_answers_each_step_as_step_does(stub):
    session = open_session(stub)
    allocate = block_pb2.StepRequest(
        session_id=session, pool_id=POOL, step_id=1, epoch=7,
        op_kinds=[block_pb2.OP_KIND_ALLOCATE] * 2, seq_ids=[1, 2], token_counts=[20, 3],
        token_ids=list(range(23)), parent_seq_ids=[0, 0], num_computed_tokens=[-1, -1])
    requests = [allocate, decode_step(session, 2, [1, 2], [20, 3]),
                decode_step(session, 2, [1, 2], [20, 3]),  # a resent step: answered again
                decode_step(session, 3, [1, 2], [21, 4])]
    answers = list(stub.StepStream(iter(requests)))
    assert len(answers) == len(requests)
    assert [a.step_id for a in answers] == [1, 2, 2, 3]
    assert answers[2] == answers[1]
    # Blocks as Step would hand them out: 2 + 1 for the prompts, none for these appends
    # (slot 20 and 21 of sequence 1 are in its second block, 3 and 4 in sequence 2's first).
    assert list(answers[1].slot_mapping) == [answers[0].table_block_ids[1] * 16 + 4,
                                             answers[0].table_block_ids[2] * 16 + 3]
    assert used_blocks(stub) == 3
    # The same step id once more, now over a unary Step: the answer kept from the stream.
    assert stub.Step(requests[3]) == answers[3]


def test_step_stream_ends_with_the_status_step_would_answer(stub):
    session = open_session(stub)
    stale = decode_step(session, 1, [1], [0])  # an unknown sequence is an op error, not a call
    unknown_session = decode_step("no-such-session", 1, [1], [0])
    stream = stub.StepStream(iter([stale, unknown_session]))
    first = next(stream)
    assert list(first.op_statuses) == [block_pb2.OP_STATUS_NOT_FOUND]
    with pytest.raises(grpc.RpcError) as error:
        next(stream)
    assert error.value.code() == grpc.StatusCode.NOT_FOUND


def test_step_stream_beyond_the_servers_threads_is_refused():
    core = BlockServiceCore(LeasePolicy(default_ttl_s=10.0, min_ttl_s=0.5, max_ttl_s=60.0))
    options = ServerOptions(port=0, max_workers=6)  # 6 - 4 unary threads: 2 streams
    service = start_server(options, register(core, options.max_workers), [SERVICE_NAME])
    channel = grpc.insecure_channel(f"127.0.0.1:{service.port}")
    stub = block_pb2_grpc.BlockServiceStub(channel)
    stub.CreatePool(block_pb2.CreatePoolRequest(pool_id=POOL, num_blocks=8, block_size=16,
                                                epoch=7))
    session = open_session(stub)
    feeds = [threading.Event() for _ in range(3)]

    def held_open(done: threading.Event) -> Iterator[block_pb2.StepRequest]:
        yield decode_step(session, 1, [1], [0])
        done.wait(10)

    try:
        open_streams = [stub.StepStream(held_open(feeds[i])) for i in range(2)]
        for stream in open_streams:
            next(stream)  # both are being served
        refused = stub.StepStream(held_open(feeds[2]))
        with pytest.raises(grpc.RpcError) as error:
            next(refused)
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "use Step" in error.value.details()
        assert used_blocks(stub) == 0  # unary calls are still served
    finally:
        for feed in feeds:
            feed.set()
        channel.close()
        service.stop(grace_s=0)


def test_step_streams_on_the_aio_server_hold_no_thread():
    """More open StepStreams than the server has threads are all served (the threaded
    server refuses them: the test above), and unary calls go on meanwhile."""
    core = BlockServiceCore(LeasePolicy(default_ttl_s=10.0, min_ttl_s=0.5, max_ttl_s=60.0))
    service, stop_loop = serve(core, ServerOptions(port=0, max_workers=6))
    channel = grpc.insecure_channel(f"127.0.0.1:{service.port}")
    stub = block_pb2_grpc.BlockServiceStub(channel)
    stub.CreatePool(block_pb2.CreatePoolRequest(pool_id=POOL, num_blocks=64, block_size=16,
                                                epoch=7))
    feeds = [threading.Event() for _ in range(10)]
    sessions = [open_session(stub) for _ in feeds]

    def held_open(session: str, done: threading.Event) -> Iterator[block_pb2.StepRequest]:
        yield block_pb2.StepRequest(
            session_id=session, pool_id=POOL, step_id=1, epoch=7,
            op_kinds=[block_pb2.OP_KIND_ALLOCATE], seq_ids=[1], token_counts=[1],
            token_ids=[5], parent_seq_ids=[0], num_computed_tokens=[-1])
        done.wait(10)

    try:
        streams = [stub.StepStream(held_open(session, feed))
                   for session, feed in zip(sessions, feeds, strict=True)]
        for stream in streams:
            assert list(next(stream).op_statuses) == [OK]
        assert used_blocks(stub) == len(streams)  # one block each, and unary calls answer
    finally:
        for feed in feeds:
            feed.set()
        channel.close()
        service.stop(grace_s=0)
        stop_loop()
