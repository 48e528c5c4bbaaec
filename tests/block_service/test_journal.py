"""Crash recovery: the journal replays into exactly the state that was live.

The oracle is the live core itself: after any sequence of calls, a fresh core that replays the
journal directory must hold the same full state (tables, ref counts, free lists in order,
hashes, counters, sessions and their last Step answers), and both must satisfy the invariants.
The last test does it with the real process and kill -9.
"""

from __future__ import annotations

import contextlib
import random
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from block_service.core import BlockServiceCore, Limits
from block_service.journal import HEADER, Journal, JournalPolicy, log_name
from block_service.ops import (
    OP_ALLOCATE,
    OP_APPEND,
    OP_COMMIT,
    OP_FORK,
    OP_FREE,
    BlockServiceError,
    ErrorCode,
)
from block_service.sessions import LeasePolicy
from protos import block_pb2, block_pb2_grpc
from tests.helpers.services import ServiceProcess

from .conftest import FakeClock
from .invariants import check_invariants, full_state

POOLS = ["a", "b"]
TTL_S = 10.0
ALL = 1 << 20  # num_computed_tokens: replaced by the sequence's whole length (publishes blocks)


def make_core(clock: FakeClock, directory: Path, every: int = 1000) -> BlockServiceCore:
    """A core replaying `directory` (empty: a fresh one) and journaling into it."""
    core = BlockServiceCore(LeasePolicy(TTL_S, 1.0, TTL_S), Limits(max_seqs_per_session=6),
                            clock=clock)
    journal, recovered = Journal.open(directory, JournalPolicy(snapshot_every_records=every))
    core.replay(recovered.state, recovered.records)
    core.attach_journal(journal)
    return core


def reopened(directory: Path, live: BlockServiceCore | None = None) -> BlockServiceCore:
    """What a restart would rebuild from `directory` after `live` stopped journaling into it
    (the rebuilt core's journal is closed again)."""
    if live is not None and live._journal is not None:
        live._journal.close()
    core = make_core(FakeClock(), directory)
    assert core._journal is not None
    core._journal.close()
    return core


# ---- random call sequences ---------------------------------------------------------------
seq_st = st.integers(0, 3)
prompt_st = st.lists(st.integers(0, 3), min_size=1, max_size=7)
computed_st = st.sampled_from([-1, 0, 3, ALL, ALL])
salt_st = st.sampled_from(["", "", "salt"])
# (kind, seq_id, tokens, parent_seq_id, num_computed_tokens, cache_salt, num_lookahead_slots):
# mostly well-formed operations on a few seq ids (so they meet each other), APPENDs that
# reserve the next position (or only reserve it), some malformed ones.
op_st = st.one_of(
    st.tuples(st.just(OP_ALLOCATE), seq_st, prompt_st, st.just(0), st.just(-1), salt_st,
              st.just(0)),
    st.tuples(st.just(OP_APPEND), seq_st, st.lists(st.integers(0, 3), min_size=1, max_size=3),
              st.just(0), computed_st, st.just(""), st.sampled_from([0, 0, 1, 1, 2])),
    st.tuples(st.just(OP_APPEND), seq_st, st.just([]), st.just(0), computed_st, st.just(""),
              st.just(1)),
    st.tuples(st.sampled_from([OP_FREE, OP_FORK, OP_COMMIT]), seq_st, st.just([]), seq_st,
              computed_st, st.just(""), st.sampled_from([0] * 7 + [1])),
    st.tuples(st.sampled_from([0, OP_ALLOCATE, OP_APPEND, OP_FREE, 9]), seq_st,
              st.lists(st.integers(-1, 3), max_size=3), seq_st, st.integers(-2, 9), salt_st,
              st.integers(0, 2)),
)
# Mostly the first session and pool, so that operations meet the sequences they name.
which_session_st = st.sampled_from([0, 0, 0, 0, 1, 2, 3])
which_pool_st = st.sampled_from([0, 0, 0, 1])
step_st = st.tuples(st.just("step"), which_session_st, which_pool_st,
                    st.lists(op_st, max_size=6), st.integers(0, 4).map(lambda d: d == 0))
single_st = st.tuples(st.just("single"), which_session_st, which_pool_st, op_st)
CALLS = {
    "step": step_st,
    "single": single_st,
    "open": st.tuples(st.just("open")),
    "close": st.tuples(st.just("close"), st.integers(0, 3)),
    "expire": st.tuples(st.just("expire"), st.integers(0, 3), st.booleans()),
    "pool": st.tuples(st.just("pool"), st.integers(0, 1), st.integers(1, 3), st.integers(1, 12),
                      st.sampled_from([1, 2, 4])),
    "retry": st.tuples(st.just("retry"), st.integers(0, 3)),
}
# Steps and single operations most of the time; calls that wipe state now and then.
call_st = st.sampled_from(["step"] * 12 + ["single"] * 6 + ["retry"] * 2 + list(CALLS)).flatmap(
    CALLS.__getitem__)


class Driver:
    """Plays drawn calls against a core; whole-call errors are expected outcomes."""

    def __init__(self, core: BlockServiceCore, clock: FakeClock) -> None:
        self.core, self.clock = core, clock
        self.sessions: list[str] = []
        self.step_ids: dict[str, int] = {}

    def session(self, index: int) -> str:
        return self.sessions[index % len(self.sessions)] if self.sessions else "none"

    def computed(self, session: str, pool_id: str, seq_id: int, drawn: int) -> int:
        """The drawn num_computed_tokens, ALL turned into the sequence's length (which counts
        a reserved position: allowed for an APPEND that fills it, refused otherwise)."""
        if drawn != ALL:
            return drawn
        pm = self.core.pools.get(pool_id)
        seq = pm.seqs.get(session, {}).get(seq_id) if pm is not None else None
        return len(seq.tokens) if seq is not None else 0

    def play(self, call: tuple[Any, ...]) -> None:
        self.clock.advance(0.5)
        with contextlib.suppress(BlockServiceError):
            getattr(self, "do_" + call[0])(*call[1:])

    def do_open(self) -> None:
        self.sessions.append(self.core.open_session("t", 0)[0])

    def do_close(self, index: int) -> None:
        session = self.session(index)
        self.core.close_session(session)
        self.sessions.remove(session)

    def do_expire(self, index: int, by_reaper: bool) -> None:
        """The lease of one session runs out: found by the reaper or by the session's call."""
        session = self.core.sessions.open.get(self.session(index))
        if session is None:
            return
        session.expires_at = self.clock.now - 1
        if len(self.sessions) > 1:
            self.sessions.remove(session.session_id)  # else it stays, to meet its expiry
        if by_reaper:
            self.core.reap_expired()
        else:
            self.core.keep_alive(session.session_id)

    def do_pool(self, index: int, epoch: int, num_blocks: int, block_size: int) -> None:
        self.core.create_pool(POOLS[index], num_blocks, block_size, epoch)

    def do_step(self, index: int, pool: int, ops: list[tuple[Any, ...]], check: bool) -> None:
        session = self.session(index)
        step_id = self.step_ids[session] = self.step_ids.get(session, 0) + 1
        salts = {i: op[5] for i, op in enumerate(ops) if op[5]}
        pm = self.core.pools.get(POOLS[pool])
        epoch = pm.epoch if check and pm is not None else 0  # 0: no epoch check
        computed = [self.computed(session, POOLS[pool], op[3] if op[0] == OP_FORK else op[1],
                                  op[4]) for op in ops]
        lookaheads = [op[6] for op in ops]
        self.core.step(session, POOLS[pool], step_id, epoch,
                       [op[0] for op in ops], [op[1] for op in ops], [len(op[2]) for op in ops],
                       [t for op in ops for t in op[2]], [op[3] for op in ops], computed,
                       salts, lookaheads if any(lookaheads) else [])

    def do_single(self, index: int, pool: int, op: tuple[Any, ...]) -> None:
        kind, seq_id, tokens, parent, computed, salt, _ = op  # no lookahead outside Step
        session, pool_id = self.session(index), POOLS[pool]
        computed = self.computed(session, pool_id, seq_id, computed)
        if kind == OP_ALLOCATE:
            self.core.allocate(session, pool_id, seq_id, tokens, salt)
        elif kind == OP_APPEND:
            self.core.append(session, pool_id, seq_id, tokens, computed)
        elif kind == OP_FORK:
            self.core.fork(session, pool_id, parent, seq_id)
        else:
            self.core.free(session, pool_id, seq_id, computed)

    def do_retry(self, index: int) -> None:
        session = self.session(index)
        self.core.step(session, POOLS[0], self.step_ids.get(session, 0), 0, [], [], [], [], [],
                       [])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls=st.lists(call_st, min_size=10, max_size=60),
       every=st.sampled_from([2, 5, 1000, 1000]))
def test_replay_rebuilds_the_live_state(calls: list[tuple[Any, ...]], every: int) -> None:
    with tempfile.TemporaryDirectory() as name:
        clock = FakeClock()
        live = make_core(clock, Path(name), every)
        driver = Driver(live, clock)
        for call in [("open",), ("open",), ("pool", 0, 1, 8, 2), ("pool", 1, 1, 5, 1)]:
            driver.play(call)
        for call in calls:
            driver.play(call)
        check_invariants(live)
        rebuilt = reopened(Path(name), live)
        assert full_state(rebuilt) == full_state(live)
        check_invariants(rebuilt)


# ---- hand-made cases -----------------------------------------------------------------------
@pytest.fixture
def directory() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as name:
        yield Path(name)


def grow(core: BlockServiceCore) -> str:
    """A pool, a session and a few sequences (two of them sharing blocks)."""
    core.create_pool("a", 16, 4, 1)
    session, _ = core.open_session("t")
    core.step(session, "a", 1, 1, [OP_ALLOCATE, OP_ALLOCATE], [1, 2], [6, 5],
              [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 9], [0, 0], [-1, -1])
    core.step(session, "a", 2, 1, [OP_APPEND, OP_FORK], [1, 3], [1, 0], [7], [0, 1], [6, 6])
    return session


def log_path(directory: Path, core: BlockServiceCore) -> Path:
    assert core._journal is not None
    return directory / log_name(core._journal.generation)


def test_torn_last_record_is_dropped_and_the_log_continues(directory):
    clock = FakeClock()
    core = make_core(clock, directory)
    session = grow(core)
    before_last = full_state(core)
    core.step(session, "a", 3, 1, [OP_APPEND], [3], [1], [8], [0], [-1])
    path = log_path(directory, core)
    whole = path.read_bytes()
    last_length = record_length(whole)
    record_start = len(whole) - last_length
    for cut in (1, HEADER.size, HEADER.size + 1, last_length - 1):  # header, body
        torn_dir = directory / f"torn{cut}"
        torn_dir.mkdir()
        (torn_dir / path.name).write_bytes(whole[:record_start + cut])
        rebuilt = reopened(torn_dir)
        assert full_state(rebuilt) == before_last
        # The torn bytes are cut off, so what is appended next is readable again.
        assert (torn_dir / path.name).stat().st_size == record_start


def record_length(log: bytes) -> int:
    """The length of the last record of a log."""
    offset, last = 0, 0
    while offset < len(log):
        length, _ = HEADER.unpack_from(log, offset)
        last = HEADER.size + length
        offset += last
    return last


def test_corrupt_tail_is_dropped(directory):
    core = make_core(FakeClock(), directory)
    session = grow(core)
    before_last = full_state(core)
    core.close_session(session)
    path = log_path(directory, core)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # the CRC of the last record no longer matches
    path.write_bytes(bytes(data))
    assert full_state(reopened(directory, core)) == before_last


def test_snapshot_and_log(directory):
    clock = FakeClock()
    core = make_core(clock, directory, every=4)
    session = grow(core)  # 4 records: create, open, two steps -> a snapshot
    assert core._journal is not None and core._journal.generation == 1
    assert core._journal.wait_snapshot() is True  # written by a child: wait for it
    assert (directory / "snapshot").exists()
    core.step(session, "a", 3, 1, [OP_APPEND], [2], [1], [8], [0], [-1])
    assert sorted(p.name for p in directory.iterdir()) == ["journal-0000000001.log", "lock",
                                                           "snapshot"]
    rebuilt = reopened(directory, core)
    assert full_state(rebuilt) == full_state(core)
    check_invariants(rebuilt)


def test_a_directory_is_journaled_by_one_process_at_a_time(directory):
    core = make_core(FakeClock(), directory)
    with pytest.raises(RuntimeError, match="in use"):
        Journal.open(directory)
    core._journal.close()  # type: ignore[union-attr]
    Journal.open(directory)[0].close()


def test_calls_that_change_nothing_are_not_journaled(directory):
    core = make_core(FakeClock(), directory)
    session = grow(core)
    path = log_path(directory, core)
    size = path.stat().st_size
    core.keep_alive(session)
    core.create_pool("a", 16, 4, 1)  # confirms
    core.step(session, "a", 2, 1, [OP_APPEND], [1], [1], [9], [0], [-1])  # a retry
    core.stats("a")
    core.match_prefix("a", [1, 2, 3, 4])
    with pytest.raises(BlockServiceError):
        core.step(session, "a", 1, 1, [], [], [], [], [], [])  # an old step id
    assert path.stat().st_size == size


def test_leases_do_not_run_out_during_replay_and_are_fresh_after(directory):
    clock = FakeClock()
    core = make_core(clock, directory)
    session = grow(core)
    core._journal.close()  # type: ignore[union-attr]
    later = FakeClock()
    later.now = clock.now + 10 * TTL_S  # long after every lease would have run out
    rebuilt = make_core(later, directory)
    assert rebuilt.sessions.open[session].expires_at == later.now + TTL_S
    assert rebuilt.reap_expired() == 0
    assert rebuilt.keep_alive(session) == TTL_S * 1000


def test_retried_step_after_replay_returns_the_first_answer(directory):
    core = make_core(FakeClock(), directory)
    session = grow(core)
    first = core.step(session, "a", 3, 1, [OP_APPEND, OP_APPEND], [2, 3], [1, 1], [8, 9],
                      [0, 0], [-1, -1])
    rebuilt = reopened(directory, core)
    before = full_state(rebuilt)
    again = rebuilt.step(session, "a", 3, 1, [OP_APPEND, OP_APPEND], [2, 3], [1, 1], [8, 9],
                         [0, 0], [-1, -1])
    assert again == first
    assert full_state(rebuilt) == before


def test_expired_session_stays_expired_after_replay(directory):
    clock = FakeClock()
    core = make_core(clock, directory)
    session = grow(core)
    clock.advance(TTL_S + 1)
    assert core.reap_expired() == 1
    rebuilt = reopened(directory, core)
    with pytest.raises(BlockServiceError) as error:
        rebuilt.keep_alive(session)
    assert error.value.code is ErrorCode.FAILED_PRECONDITION
    assert rebuilt.stats("a").used_blocks == 0


# ---- the real process, killed ------------------------------------------------------------
POOL = "runner-0"


def start_decoding(stub: block_pb2_grpc.BlockServiceStub, num_seqs: int
                   ) -> tuple[str, list[int], dict[int, list[int]]]:
    """A pool with room for num_seqs sequences of 4,096 tokens (far more steps than a test
    makes), a session, and a Step allocating num_seqs 3-token prompts; returns the session,
    the seq ids and the client's copy of their tables."""
    stub.CreatePool(block_pb2.CreatePoolRequest(pool_id=POOL, num_blocks=num_seqs * 1024,
                                                block_size=4, epoch=3))
    session = stub.OpenSession(block_pb2.OpenSessionRequest(client_name="gw")).session_id
    seq_ids = list(range(1, num_seqs + 1))
    prompt_step = block_pb2.StepRequest(
        session_id=session, pool_id=POOL, step_id=1, epoch=3,
        op_kinds=[block_pb2.OP_KIND_ALLOCATE] * num_seqs, seq_ids=seq_ids,
        token_counts=[3] * num_seqs, token_ids=[5, 6, 7] * num_seqs,
        parent_seq_ids=[0] * num_seqs, num_computed_tokens=[-1] * num_seqs)
    tables: dict[int, list[int]] = {}
    table_after(tables, stub.Step(prompt_step), seq_ids)
    return session, seq_ids, tables


def table_after(tables: dict[int, list[int]], response: block_pb2.StepResponse,
                seq_ids: list[int]) -> None:
    """Applies a StepResponse's table changes to the client's copy of the tables."""
    offset = 0
    for index, seq_id in enumerate(seq_ids):
        assert response.op_statuses[index] == block_pb2.OP_STATUS_OK, response.errors
        count = response.table_counts[index]
        table = tables.setdefault(seq_id, [])
        del table[response.table_starts[index]:]
        table.extend(response.table_block_ids[offset:offset + count])
        offset += count


def decode(session: str, step_id: int, lengths: dict[int, int]) -> block_pb2.StepRequest:
    seq_ids = sorted(lengths)
    return block_pb2.StepRequest(
        session_id=session, pool_id=POOL, step_id=step_id, epoch=3,
        op_kinds=[block_pb2.OP_KIND_APPEND] * len(seq_ids), seq_ids=seq_ids,
        token_counts=[1] * len(seq_ids), token_ids=[40 + s for s in seq_ids],
        parent_seq_ids=[0] * len(seq_ids), num_computed_tokens=[lengths[s] for s in seq_ids])


def expected_slots(tables: dict[int, list[int]], lengths: dict[int, int]) -> list[int]:
    """The slot each sequence's next token must get from its (client-side) block table."""
    return [tables[s][lengths[s] // 4] * 4 + lengths[s] % 4 for s in sorted(lengths)]


def test_killed_process_restarts_with_the_same_state(tmp_path):
    journal_dir = tmp_path / "journal"
    service = ServiceProcess("block_service", ["--journal-dir", str(journal_dir)])
    service.start(tmp_path).wait_serving()
    try:
        channel = grpc.insecure_channel(service.address)
        stub = block_pb2_grpc.BlockServiceStub(channel)
        stub.CreatePool(block_pb2.CreatePoolRequest(pool_id=POOL, num_blocks=64, block_size=4,
                                                    epoch=3))
        session = stub.OpenSession(block_pb2.OpenSessionRequest(client_name="gw")).session_id
        prompts = {1: list(range(10)), 2: [*list(range(10)), 99], 3: [7] * 5}
        allocate = block_pb2.StepRequest(
            session_id=session, pool_id=POOL, step_id=1, epoch=3,
            op_kinds=[block_pb2.OP_KIND_ALLOCATE] * 3, seq_ids=[1, 2, 3],
            token_counts=[len(p) for p in prompts.values()],
            token_ids=[t for p in prompts.values() for t in p], parent_seq_ids=[0, 0, 0],
            num_computed_tokens=[-1, -1, -1])
        tables: dict[int, list[int]] = {}
        table_after(tables, stub.Step(allocate), [1, 2, 3])
        fork = block_pb2.StepRequest(
            session_id=session, pool_id=POOL, step_id=2, epoch=3,
            op_kinds=[block_pb2.OP_KIND_FORK, block_pb2.OP_KIND_FORK], seq_ids=[4, 5],
            token_counts=[0, 0], parent_seq_ids=[1, 3], num_computed_tokens=[10, 5])
        table_after(tables, stub.Step(fork), [4, 5])
        lengths = {1: 10, 2: 11, 3: 5, 4: 10, 5: 5}
        for step_id in range(3, 9):
            response = stub.Step(decode(session, step_id, lengths))
            table_after(tables, response, sorted(lengths))
            assert list(response.slot_mapping) == expected_slots(tables, lengths)
            lengths = {s: n + 1 for s, n in lengths.items()}
        last = decode(session, 8, {s: n - 1 for s, n in lengths.items()})
        last_answer = stub.Step(last)  # a retry while alive: the stored answer
        stats = stub.GetStats(block_pb2.GetStatsRequest(pool_id=POOL)).stats
        channel.close()

        service.kill()
        service.start(tmp_path).wait_serving()  # same port, same journal directory

        channel = grpc.insecure_channel(service.address)
        stub = block_pb2_grpc.BlockServiceStub(channel)
        assert stub.GetStats(block_pb2.GetStatsRequest(pool_id=POOL)).stats == stats
        assert stub.Step(last) == last_answer  # the retried Step across the restart
        assert stub.GetStats(block_pb2.GetStatsRequest(pool_id=POOL)).stats == stats
        for step_id in range(9, 13):  # decoding continues in the same block tables
            response = stub.Step(decode(session, step_id, lengths))
            table_after(tables, response, sorted(lengths))
            assert list(response.slot_mapping) == expected_slots(tables, lengths)
            lengths = {s: n + 1 for s, n in lengths.items()}
        for seq_id in sorted(lengths):
            stub.Free(block_pb2.FreeRequest(session_id=session, pool_id=POOL, seq_id=seq_id))
        after = stub.GetStats(block_pb2.GetStatsRequest(pool_id=POOL)).stats
        assert (after.used_blocks, after.total_refs, after.num_sequences) == (0, 0, 0)
        assert after.free_blocks == after.total_blocks == 64
        channel.close()
    finally:
        service.kill()


def test_step_in_flight_at_the_kill_is_applied_once_when_retried(tmp_path):
    """Steps stream from a thread; kill -9 lands at a random point, possibly mid-Step. The
    client retries its unanswered Step after the restart: whether or not it was journaled
    before the kill, it is applied exactly once (the tables and slots stay the client's)."""
    journal_dir = tmp_path / "journal"
    service = ServiceProcess("block_service", ["--journal-dir", str(journal_dir)])
    service.start(tmp_path).wait_serving()
    try:
        channel = grpc.insecure_channel(service.address)
        stub = block_pb2_grpc.BlockServiceStub(channel)
        session, seq_ids, tables = start_decoding(stub, 32)
        lengths = dict.fromkeys(seq_ids, 3)
        state = {"step_id": 1, "stop": False}

        def stream() -> None:
            while not state["stop"]:
                request = decode(session, state["step_id"] + 1, lengths)
                try:
                    response = stub.Step(request, timeout=5)
                except grpc.RpcError:
                    return  # the kill: this Step is unanswered
                state["step_id"] += 1
                table_after(tables, response, seq_ids)
                assert list(response.slot_mapping) == expected_slots(tables, lengths)
                lengths.update({s: n + 1 for s, n in lengths.items()})

        failures: list[BaseException] = []

        def run_stream() -> None:
            try:
                stream()
            except BaseException as error:  # re-raised in the test's thread below
                failures.append(error)

        thread = threading.Thread(target=run_stream)
        thread.start()
        time.sleep(random.uniform(0.2, 0.6))
        service.kill()
        state["stop"] = True
        thread.join()
        channel.close()
        if failures:
            raise failures[0]
        assert 5 < state["step_id"] < 4000  # it was streaming, and had room

        service.start(tmp_path).wait_serving()
        channel = grpc.insecure_channel(service.address)
        stub = block_pb2_grpc.BlockServiceStub(channel)
        for step_id in range(state["step_id"] + 1, state["step_id"] + 4):
            response = stub.Step(decode(session, step_id, lengths))  # first: the retry
            table_after(tables, response, seq_ids)
            assert list(response.slot_mapping) == expected_slots(tables, lengths)
            lengths.update({s: n + 1 for s, n in lengths.items()})
        stats = stub.GetStats(block_pb2.GetStatsRequest(pool_id=POOL)).stats
        assert stats.used_blocks == len({b for table in tables.values() for b in table})
        assert stats.total_refs == sum(len(table) for table in tables.values())
        channel.close()
    finally:
        service.kill()


def test_a_failed_snapshot_leaves_the_log_going(directory, monkeypatch, caplog):
    core = make_core(FakeClock(), directory, every=3)

    def disk_full(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("block_service.journal.pickle.dump", disk_full)
    session = grow(core)  # the snapshot due after 3 records fails (in its child)
    journal = core._journal
    assert journal is not None and journal.wait_snapshot() is False
    monkeypatch.undo()
    assert "No space left on device" in caplog.text  # the child's reason, logged by the parent
    # The older log and the one started for the snapshot both stay; no snapshot, no tmp file.
    assert sorted(p.name for p in directory.iterdir()) == [log_name(0), log_name(1), "lock"]
    core.step(session, "a", 3, 1, [OP_APPEND], [2], [1], [8], [0], [-1])
    assert full_state(reopened(directory, core)) == full_state(core)


def test_a_failed_journal_write_stops_the_process(directory, monkeypatch):
    """The state is already changed in memory and cannot be rolled back: exit (status 75)
    rather than answer, so that the restart replays only what was answered."""
    core = make_core(FakeClock(), directory)

    def io_error(fd: int, data: bytes) -> int:
        raise OSError(5, "Input/output error")

    def exit_now(status: int) -> None:
        raise SystemExit(status)

    monkeypatch.setattr("block_service.journal.os.write", io_error)
    monkeypatch.setattr("block_service.journal.os._exit", exit_now)
    monkeypatch.setattr("block_service.journal.logging.shutdown", lambda: None)
    with pytest.raises(SystemExit) as stopped:
        core.open_session("t")
    assert stopped.value.code == 75


def test_journal_dir_from_the_command_line_or_the_environment(monkeypatch):
    from block_service.__main__ import JOURNAL_DIR_ENV, parse_args

    monkeypatch.delenv(JOURNAL_DIR_ENV, raising=False)
    assert parse_args([]).journal_dir is None  # no journal by default
    assert parse_args(["--journal-dir", "d"]).journal_dir == "d"
    monkeypatch.setenv(JOURNAL_DIR_ENV, "from-env")
    args = parse_args(["--journal-fsync"])
    assert (args.journal_dir, args.journal_fsync) == ("from-env", True)
