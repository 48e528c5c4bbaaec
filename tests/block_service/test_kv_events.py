"""KV events (SubscribeKvEvents): numbering, snapshots, resume, and the stream over gRPC.

The oracle is the pool itself: a subscriber that applies every batch it got (stored adds
hashes, removed deletes them, cleared empties the set) must hold exactly the hashes of the
pool's hash -> block map, whatever mix of batches and snapshots it was sent.
"""

from __future__ import annotations

import pickle
import random
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from block_service.core import BlockServiceCore
from block_service.event_sink import NO_EVENTS
from block_service.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    PoolEvents,
)
from block_service.events_servicer import batch_message
from block_service.hashing import ROOT_HASH, chain_hashes, root_hash
from block_service.journal import Journal, read_journal
from block_service.ops import OP_ALLOCATE, OP_APPEND, OP_FREE, BlockServiceError, ErrorCode
from block_service.servicer import SERVICE_NAME, UNARY_THREADS, BlockServicer, generic_handler
from common.server import GrpcService, ServerOptions, start_server
from protos import block_pb2, block_pb2_grpc

P = "pool"
WAIT_S = 10.0  # a bound on waits for another thread, so that a bug fails instead of hanging


def held_after(batches: list[Any]) -> set[bytes]:
    """The hashes a subscriber holds after applying `batches` (KvEventBatch messages, or
    EventBatch records) in order; each event must make sense for what it holds."""
    held: set[bytes] = set()
    for batch in batches:
        message = batch_message(batch) if isinstance(batch, EventBatch) else batch
        for event in message.events:
            kind = event.WhichOneof("event")
            if kind == "stored":
                assert not held & set(event.stored.block_hashes), "stored twice"
                held.update(event.stored.block_hashes)
            elif kind == "removed":
                assert set(event.removed.block_hashes) <= held, "removed, never stored"
                held.difference_update(event.removed.block_hashes)
            else:
                held.clear()
    return held


def cached(core: BlockServiceCore) -> set[bytes]:
    """The hashes the pool holds."""
    return set(core.pools[P].pool.hash_to_block)


def follow(core: BlockServiceCore, after: int = 0, instance: str = "",
           pool_id: str = P) -> Iterator[EventBatch]:
    """A subscription's batches, in this thread; a wait longer than WAIT_S ends it."""
    deadline = time.monotonic() + WAIT_S
    subscription = core.subscribe_events(pool_id, after, instance)
    return subscription.batches(lambda: time.monotonic() < deadline, poll_s=0.05)


def computed(core: BlockServiceCore, session: str, seq_id: int, tokens: list[int],
             salt: str = "") -> None:
    """Allocates `tokens` and frees them computed: their full blocks stay cached."""
    core.allocate(session, P, seq_id, tokens, salt)
    core.free(session, P, seq_id, len(tokens))


@pytest.fixture
def core_and_session(make_core) -> tuple[BlockServiceCore, str]:
    core = make_core()
    session, _ = core.open_session("test")
    core.create_pool(P, 4, 2, 1)
    return core, session


# ---- the core ------------------------------------------------------------------------------
def test_events_come_in_numbered_batches_one_per_call(core_and_session):
    core, session = core_and_session
    assert core.pools[P].pool.events is NO_EVENTS  # nothing recorded before a subscriber
    batches = follow(core)
    first = next(batches)
    assert (first.sequence, first.snapshot, first.epoch) == (0, True, 1)
    assert first.events == [AllBlocksCleared()]

    computed(core, session, 1, [1, 2, 3, 4])  # the allocate stores nothing: no batch
    h1, h2 = chain_hashes([1, 2, 3, 4], 2, 2, ROOT_HASH)
    stored = next(batches)
    assert (stored.sequence, stored.snapshot, stored.instance_id) == (
        1, False, core.kv_events.instance_id)
    assert stored.events == [BlockStored([h1, h2], ROOT_HASH, [1, 2, 3, 4], 2)]

    # 3 blocks: 2 never used, then the oldest cached one (the tail, released first).
    core.allocate(session, P, 2, [5, 6, 7, 8, 9, 10])
    assert next(batches).events == [BlockRemoved([h2])]
    core.create_pool(P, 4, 2, 2)
    cleared = next(batches)
    assert (cleared.sequence, cleared.epoch, cleared.events) == (3, 2, [AllBlocksCleared()])
    assert core.kv_events.dirty == []


def test_snapshot_orders_parents_first_and_merges_chains(make_core):
    core = make_core()
    session, _ = core.open_session("test")
    core.create_pool(P, 64, 2, 1)
    computed(core, session, 1, [1, 2, 3, 4, 5, 6])
    computed(core, session, 2, [1, 2, 3, 4, 9, 9])  # a branch after two shared blocks
    computed(core, session, 3, [1, 2], salt="tenant")  # the same tokens, another root
    a1, a2, a3 = chain_hashes([1, 2, 3, 4, 5, 6], 2, 3, ROOT_HASH)
    (b3,) = chain_hashes([9, 9], 2, 1, a2)
    (c1,) = chain_hashes([1, 2], 2, 1, root_hash("tenant"))

    snapshot = next(follow(core))
    assert snapshot.snapshot and snapshot.sequence == 0
    assert snapshot.events == [
        AllBlocksCleared(),
        BlockStored([a1, a2, a3], ROOT_HASH, [1, 2, 3, 4, 5, 6], 2),
        BlockStored([b3], a2, [9, 9], 2),
        BlockStored([c1], root_hash("tenant"), [1, 2], 2)]
    assert held_after([snapshot]) == cached(core)


def test_resume_gets_every_later_batch_once(core_and_session):
    core, session = core_and_session
    first = follow(core)
    seen = [next(first)]
    for seq_id in range(1, 7):
        computed(core, session, seq_id, [seq_id, seq_id + 1, 7])
    newest = core.pools[P].pool.events.newest
    seen += [next(first) for _ in range(newest)]
    assert [batch.sequence for batch in seen] == list(range(newest + 1))

    resumed = follow(core, 3, seen[0].instance_id)
    again = [next(resumed) for _ in range(newest - 3)]
    assert [(batch.sequence, batch.snapshot) for batch in again] == [
        (sequence, False) for sequence in range(4, newest + 1)]
    assert again == seen[4:]
    assert held_after(seen) == cached(core)


def test_a_subscriber_behind_the_replay_buffer_gets_a_snapshot(core_and_session):
    core, session = core_and_session
    core.kv_events.replay_batches = 4
    instance = next(follow(core)).instance_id
    for seq_id in range(1, 11):
        computed(core, session, seq_id, [seq_id, 1, 2, 3])
    newest = core.pools[P].pool.events.newest
    assert newest >= 10

    behind = next(follow(core, newest - 5, instance))  # batch newest - 4 is gone
    assert (behind.snapshot, behind.sequence) == (True, newest)
    assert held_after([behind]) == cached(core)
    inside = next(follow(core, newest - 4, instance))  # the oldest batch kept comes next
    assert (inside.snapshot, inside.sequence) == (False, newest - 3)


def test_the_replay_buffer_is_bounded_by_events_too(core_and_session):
    core, session = core_and_session
    core.kv_events.replay_events = 3  # each batch below holds 2 (2 blocks stored or evicted)
    instance = next(follow(core)).instance_id
    for seq_id, tokens in enumerate([[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]], 1):
        computed(core, session, seq_id, tokens)
    newest = core.pools[P].pool.events.newest
    assert newest == 4  # stored, stored, removed (the 3rd allocate evicts), stored
    assert next(follow(core, newest - 2, instance)).snapshot
    assert (next(follow(core, newest - 1, instance)).sequence, newest) == (4, 4)
    # Bounds smaller than a batch (read by a log when it is attached): the newest one stays,
    # so a subscriber that keeps up gets it, not a snapshot.
    core.kv_events.replay_events = 1
    core.create_pool("other", 4, 2, 1)
    other = follow(core, pool_id="other")
    next(other)
    core.allocate(session, "other", 10, [1, 2, 3, 4])
    core.free(session, "other", 10, 4)
    batch = next(other)
    assert (batch.sequence, batch.snapshot) == (1, False)


def test_a_subscriber_falling_behind_while_streaming_gets_a_snapshot(core_and_session):
    core, session = core_and_session
    core.kv_events.replay_batches = 4
    batches = follow(core)
    seen = [next(batches)]
    computed(core, session, 1, [1, 2, 3, 4])
    seen.append(next(batches))
    for seq_id in range(2, 12):  # more batches than the buffer holds, none read
        computed(core, session, seq_id, [seq_id, 9, 9, 9])
    caught_up = next(batches)
    assert (caught_up.snapshot, caught_up.sequence) == (True, core.pools[P].pool.events.newest)
    computed(core, session, 20, [20, 21, 22, 23])  # an eviction, then a store
    seen += [caught_up, next(batches), next(batches)]
    assert [batch.sequence for batch in seen[-3:]] == [caught_up.sequence + n for n in range(3)]
    assert held_after(seen) == cached(core)


def test_refused_subscriptions(core_and_session):
    core, session = core_and_session
    instance = next(follow(core)).instance_id
    computed(core, session, 1, [1, 2, 3, 4])
    with pytest.raises(BlockServiceError) as error:
        core.subscribe_events(P, 2, instance)
    assert error.value.code is ErrorCode.OUT_OF_RANGE
    assert "past the newest batch" in error.value.message
    with pytest.raises(BlockServiceError) as error:
        core.subscribe_events("nope", 0, "")
    assert error.value.code is ErrorCode.NOT_FOUND
    with pytest.raises(BlockServiceError) as error:
        core.subscribe_events("x" * 300, 0, "")
    assert error.value.code is ErrorCode.INVALID_ARGUMENT
    # A number of another instance means nothing here: a snapshot, not OUT_OF_RANGE.
    assert next(follow(core, 99, "an earlier instance")).snapshot


def drop(core: BlockServiceCore, pool_id: str) -> None:
    """What the core does when a runner's lease runs out (BlockServiceCore._drop_pool)."""
    with core._lock:
        pm = core.pools.pop(pool_id)
        core.kv_events.close(pm)


def test_a_dropped_pool_ends_its_streams_and_numbers_on_when_created_again(core_and_session):
    core, session = core_and_session
    batches = follow(core)
    seen = [next(batches)]
    computed(core, session, 1, [1, 2, 3, 4])
    drop(core, P)
    seen += [next(batches), next(batches)]
    assert seen[-1].events == [AllBlocksCleared()] and seen[-1].sequence == 2
    with pytest.raises(BlockServiceError) as error:
        next(batches)
    assert error.value.code is ErrorCode.NOT_FOUND

    core.create_pool(P, 4, 2, 1)
    computed(core, session, 2, [5, 6, 7, 8])
    # Its events before the first subscription were not recorded: a subscriber resuming
    # from the old pool's last batch must get a snapshot, never a silent gap.
    resumed = next(follow(core, 2, seen[0].instance_id))
    assert (resumed.snapshot, resumed.sequence) == (True, 3)
    assert held_after([*seen, resumed]) == cached(core)


def test_pools_pickle_without_their_log_and_a_replay_starts_over(make_core):
    with tempfile.TemporaryDirectory() as directory:
        core = make_core()
        journal, _ = Journal.open(directory)
        core.attach_journal(journal)
        session, _ = core.open_session("test")
        core.create_pool(P, 4, 2, 1)
        live = follow(core)
        seen = [next(live)]
        computed(core, session, 1, [1, 2, 3, 4])
        seen.append(next(live))
        core.snapshot_now()  # pickles the pool, log attached
        computed(core, session, 2, [3, 4, 5, 6])
        journal.close()

        # Pickled as a snapshot from before KV events was: no log of its own.
        pm = pickle.loads(pickle.dumps(core.pools[P]))
        assert "events" not in vars(pm.pool) and pm.pool.events is NO_EVENTS

        recovered = read_journal(directory)
        rebuilt = make_core()
        rebuilt.replay(recovered.state, recovered.records)
        assert rebuilt.pools[P].pool.events is NO_EVENTS  # replayed events went nowhere
        assert rebuilt.kv_events.instance_id != core.kv_events.instance_id
        resumed = next(follow(rebuilt, seen[-1].sequence, seen[-1].instance_id))
        assert resumed.snapshot
        assert held_after([resumed]) == cached(rebuilt) == cached(core)


# ---- over gRPC -----------------------------------------------------------------------------
class Servicer(BlockServicer):
    """BlockServicer that counts the event streams that have ended on the server."""

    def __init__(self, core: BlockServiceCore, max_step_streams: int) -> None:
        super().__init__(core, max_step_streams)
        self.streams_ended = threading.Semaphore(0)

    def SubscribeKvEvents(self, request: block_pb2.SubscribeKvEventsRequest,
                          context: grpc.ServicerContext) -> Iterator[block_pb2.KvEventBatch]:
        try:
            yield from super().SubscribeKvEvents(request, context)
        finally:
            self.streams_ended.release()


@dataclass
class Server:
    core: BlockServiceCore
    servicer: Servicer
    service: GrpcService
    stub: block_pb2_grpc.BlockServiceStub
    channel: grpc.Channel


@pytest.fixture
def serve(make_core) -> Iterator[Any]:
    """Starts servers (`max_workers` threads) on loopback; stops them after the test."""
    started: list[Server] = []

    def start(max_workers: int = 8) -> Server:
        core = make_core()
        servicer = Servicer(core, max_workers - UNARY_THREADS)
        service = start_server(
            ServerOptions(port=0, max_workers=max_workers),
            lambda server: server.add_generic_rpc_handlers(
                (generic_handler(servicer, aio=False),)),
            [SERVICE_NAME])
        channel = grpc.insecure_channel(f"127.0.0.1:{service.port}")
        started.append(Server(core, servicer, service, block_pb2_grpc.BlockServiceStub(channel),
                              channel))
        return started[-1]

    yield start
    for server in started:
        server.channel.close()
        server.service.stop(grace_s=0)


def subscribe(stub: block_pb2_grpc.BlockServiceStub, after: int = 0,
              instance: str = "") -> Any:
    return stub.SubscribeKvEvents(block_pb2.SubscribeKvEventsRequest(
        pool_id=P, after_sequence=after, instance_id=instance), timeout=60)


@dataclass
class Reader:
    """Reads a stream in a thread of its own, as a router would."""

    call: Any
    batches: list[block_pb2.KvEventBatch] = field(default_factory=list)
    changed: threading.Condition = field(default_factory=threading.Condition)

    def __post_init__(self) -> None:
        self.error: grpc.RpcError | None = None
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for batch in self.call:
                with self.changed:
                    self.batches.append(batch)
                    self.changed.notify_all()
        except grpc.RpcError as error:
            self.error = error

    def wait_for(self, sequence: int) -> None:
        with self.changed:
            assert self.changed.wait_for(
                lambda: bool(self.batches) and self.batches[-1].sequence >= sequence, WAIT_S)

    def stop(self) -> list[block_pb2.KvEventBatch]:
        self.call.cancel()
        self.thread.join(WAIT_S)
        assert self.error is not None and self.error.code() == grpc.StatusCode.CANCELLED
        return self.batches


@dataclass
class Workload:
    """Steps of allocates, one-token appends (reporting every token computed, which
    publishes the full blocks) and frees, on a small pool: evictions all along."""

    stub: block_pb2_grpc.BlockServiceStub
    session: str
    rng: random.Random = field(default_factory=lambda: random.Random(7))
    lengths: dict[int, int] = field(default_factory=dict)  # live seq id -> tokens
    step_id: int = 0
    next_seq_id: int = 1

    def steps(self, count: int) -> None:
        for _ in range(count):
            self.step()

    def step(self) -> None:
        rng = self.rng
        ops: list[tuple[int, int, list[int], int]] = []  # kind, seq id, tokens, computed
        for seq_id, length in self.lengths.items():
            if rng.random() < 0.2:
                ops.append((OP_FREE, seq_id, [], length))
            else:
                ops.append((OP_APPEND, seq_id, [rng.randrange(3)], length))
        if len(self.lengths) < 4:
            prefix = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 7, 7, 7], [8] * 5][rng.randrange(3)]
            prompt = prefix + [rng.randrange(3) for _ in range(rng.randrange(6))]
            ops.append((OP_ALLOCATE, self.next_seq_id, prompt, -1))
            self.next_seq_id += 1
        self.step_id += 1
        response = self.stub.Step(block_pb2.StepRequest(
            session_id=self.session, pool_id=P, step_id=self.step_id,
            op_kinds=[op[0] for op in ops], seq_ids=[op[1] for op in ops],
            token_counts=[len(op[2]) for op in ops], token_ids=[t for op in ops for t in op[2]],
            parent_seq_ids=[0] * len(ops), num_computed_tokens=[op[3] for op in ops]),
            timeout=WAIT_S)
        for (kind, seq_id, tokens, _), status in zip(ops, response.op_statuses, strict=True):
            if status != block_pb2.OP_STATUS_OK:
                continue
            if kind == OP_FREE:
                del self.lengths[seq_id]
            else:
                self.lengths[seq_id] = self.lengths.get(seq_id, 0) + len(tokens)

    def new_epoch(self, epoch: int) -> None:
        self.stub.CreatePool(block_pb2.CreatePoolRequest(pool_id=P, num_blocks=16, block_size=4,
                                                         epoch=epoch), timeout=WAIT_S)
        self.lengths.clear()  # every sequence is stale


def test_a_subscriber_that_leaves_and_resumes_sees_every_batch_once(serve):
    server = serve()
    core, stub = server.core, server.stub
    core.kv_events.replay_batches = 64
    session = stub.OpenSession(block_pb2.OpenSessionRequest(client_name="t")).session_id
    work = Workload(stub, session)
    work.new_epoch(1)
    reader = Reader(subscribe(stub))
    reader.wait_for(0)  # subscribed: the log records from here
    log = core.pools[P].pool.events
    assert isinstance(log, PoolEvents)

    work.steps(40)
    reader.wait_for(log.newest)
    first = reader.stop()
    work.steps(20)  # while nobody listens
    work.new_epoch(2)
    work.steps(20)
    assert log.newest - first[-1].sequence < 64  # all still in the replay buffer

    again = Reader(subscribe(stub, first[-1].sequence, first[-1].instance_id))
    work.steps(10)  # while it catches up
    again.wait_for(log.newest)
    second = again.stop()

    everything = first + second
    assert [batch.snapshot for batch in everything] == [True] + [False] * (len(everything) - 1)
    assert [batch.sequence for batch in everything] == list(range(len(everything)))
    assert {batch.epoch for batch in second} == {1, 2}
    kinds = {event.WhichOneof("event") for batch in everything for event in batch.events}
    assert kinds == {"stored", "removed", "cleared"}
    assert held_after(everything) == cached(core)

    # One too far behind for the buffer gets a snapshot that also matches.
    while log.newest <= 70:
        work.step()
    late = subscribe(stub, 1, first[0].instance_id)
    snapshot = next(late)
    late.cancel()
    assert (snapshot.snapshot, snapshot.sequence) == (True, log.newest)
    assert held_after([snapshot]) == cached(core)


def test_refusals_over_grpc(serve):
    stub = serve().stub
    stub.CreatePool(block_pb2.CreatePoolRequest(pool_id=P, num_blocks=4, block_size=2,
                                                epoch=1))
    cases = [(block_pb2.SubscribeKvEventsRequest(pool_id="nope"), grpc.StatusCode.NOT_FOUND),
             (block_pb2.SubscribeKvEventsRequest(pool_id="x" * 300),
              grpc.StatusCode.INVALID_ARGUMENT)]
    instance = next(subscribe(stub)).instance_id
    cases.append((block_pb2.SubscribeKvEventsRequest(pool_id=P, after_sequence=5,
                                                     instance_id=instance),
                  grpc.StatusCode.OUT_OF_RANGE))
    for request, code in cases:
        with pytest.raises(grpc.RpcError) as error:
            next(stub.SubscribeKvEvents(request, timeout=WAIT_S))
        assert error.value.code() == code, request


def test_streams_share_the_thread_budget_and_free_their_thread(serve):
    server = serve(max_workers=UNARY_THREADS + 1)  # one stream at a time
    stub = server.stub
    stub.CreatePool(block_pb2.CreatePoolRequest(pool_id=P, num_blocks=4, block_size=2,
                                                epoch=1))
    held = subscribe(stub)
    next(held)
    with pytest.raises(grpc.RpcError) as error:
        next(subscribe(stub))
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "KV event subscriptions" in error.value.details()
    assert server.servicer.streams_ended.acquire(timeout=WAIT_S)  # the refused one

    held.cancel()  # the client goes away: the server's thread returns, its slot is free
    assert server.servicer.streams_ended.acquire(timeout=WAIT_S)
    after = subscribe(stub)
    assert next(after).snapshot
    server.service.stop(grace_s=0)  # the server stops: the stream ends there too
    with pytest.raises(grpc.RpcError):
        next(after)
    assert server.servicer.streams_ended.acquire(timeout=WAIT_S)
