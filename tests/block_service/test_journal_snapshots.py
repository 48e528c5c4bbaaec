"""Snapshots written by a forked child while the core goes on serving.

A due snapshot starts the next generation's log and forks under the core's lock; the child
writes the state as it was at the fork and the parent installs it. These tests make the child
wait on a file the test creates (no timing), kill it, make it fail, and stop the parent at the
points a kill -9 could, and check each time that the journal directory rebuilds exactly the
live state (or the state at the fork, for the snapshot itself).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import os
import random
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from block_service import journal as journal_module
from block_service.core import BlockServiceCore, Limits
from block_service.journal import (
    Journal,
    JournalPolicy,
    fork_refused,
    log_name,
    read_journal,
    read_snapshot,
    write_snapshot_file,
)
from block_service.ops import OP_APPEND
from block_service.sessions import LeasePolicy
from protos import block_pb2, block_pb2_grpc
from tests.helpers.services import ServiceProcess

from .conftest import FakeClock
from .invariants import check_invariants, full_state
from .test_journal import (
    POOL,
    TTL_S,
    Driver,
    call_st,
    decode,
    expected_slots,
    grow,
    make_core,
    reopened,
    start_decoding,
    table_after,
)

Writer = Callable[[BinaryIO, int, Any], None]


@pytest.fixture
def directory() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as name:
        yield Path(name)


def journal_of(core: BlockServiceCore) -> Journal:
    assert core._journal is not None
    return core._journal


def gated_writer(gate: Path) -> Writer:
    """A snapshot writer that (in the child) waits until the test creates `gate`."""

    def write(file: BinaryIO, generation: int, state: Any) -> None:
        while not gate.exists():
            time.sleep(0.002)
        write_snapshot_file(file, generation, state)

    return write


def failing_writer(file: BinaryIO, generation: int, state: Any) -> None:
    file.write(b"half a snapshot")
    raise OSError(errno.EIO, "Input/output error")


def rebuilt_from(directory: Path) -> BlockServiceCore:
    """A core replaying what `directory` holds now (read only: the live core goes on)."""
    recovered = read_journal(directory)
    core = BlockServiceCore(LeasePolicy(TTL_S, 1.0, TTL_S), Limits(max_seqs_per_session=6),
                            clock=FakeClock())
    core.replay(recovered.state, recovered.records)
    return core


def snapshot_state(directory: Path) -> tuple[int, dict[str, Any]]:
    """The snapshot's generation and the full state it alone rebuilds."""
    generation, state = read_snapshot(directory)
    core = BlockServiceCore(LeasePolicy(TTL_S, 1.0, TTL_S), Limits(max_seqs_per_session=6),
                            clock=FakeClock())
    core.replay(state, [])
    return generation, full_state(core)


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def decode_step(core: BlockServiceCore, session: str, step_id: int, token: int) -> None:
    """One decode token for sequence 1 (grown by `grow`)."""
    core.step(session, "a", step_id, 1, [OP_APPEND], [1], [1], [token], [0], [-1])


def test_steps_are_answered_while_the_child_writes_the_snapshot(directory, tmp_path):
    core = make_core(FakeClock(), directory, every=4)
    journal = journal_of(core)
    gate = tmp_path / "gate"
    journal.snapshot_writer = gated_writer(gate)
    session = grow(core)  # its 4th record makes a snapshot due: the child waits for the gate
    at_fork = full_state(core)
    assert journal.snapshot_running and journal.generation == 1

    # The lock is free and Steps are answered while the child cannot finish.
    assert core._lock.acquire(blocking=False)
    core._lock.release()
    for step_id in range(3, 8):
        decode_step(core, session, step_id, 10 + step_id)
    assert journal.snapshot_running
    assert "snapshot" not in names(directory)
    # Their records went into the new generation's log; the old one holds the first four.
    assert len(read_journal(directory).records) == 4 + 5
    assert (directory / log_name(1)).stat().st_size > 0

    gate.touch()
    assert journal.wait_snapshot() is True
    assert names(directory) == [log_name(1), "lock", "snapshot"]
    assert snapshot_state(directory) == (1, at_fork)  # the state at the fork, not later
    assert full_state(rebuilt_from(directory)) == full_state(core)
    rebuilt = reopened(directory, core)
    assert full_state(rebuilt) == full_state(core)
    check_invariants(rebuilt)


def test_recovery_across_generations_after_killed_and_failed_children(directory, tmp_path,
                                                                      caplog):
    core = make_core(FakeClock(), directory, every=3)
    journal = journal_of(core)
    journal.snapshot_writer = gated_writer(tmp_path / "never")
    session = grow(core)  # the snapshot of generation 1 starts at the 3rd record
    running = journal._running
    assert running is not None
    os.kill(running.pid, signal.SIGKILL)  # killed mid-way (e.g. by the OOM killer)
    assert journal.wait_snapshot() is False
    assert names(directory) == [log_name(0), log_name(1), "lock"]  # its tmp file is gone

    journal.snapshot_writer = failing_writer
    for step_id in range(3, 6):  # the 3rd record since: generation 2's snapshot fails
        decode_step(core, session, step_id, step_id)
    assert journal.wait_snapshot() is False
    assert "Input/output error" in caplog.text
    assert names(directory) == [log_name(0), log_name(1), log_name(2), "lock"]
    decode_step(core, session, 6, 6)
    recovered = read_journal(directory)
    assert (recovered.generation, recovered.log_generations) == (0, [0, 1, 2])
    assert full_state(rebuilt_from(directory)) == full_state(core)

    journal.snapshot_writer = write_snapshot_file
    for step_id in range(7, 9):  # generation 3's snapshot succeeds and ends logs 0-2
        decode_step(core, session, step_id, step_id)
    assert journal.wait_snapshot() is True
    assert names(directory) == [log_name(3), "lock", "snapshot"]
    decode_step(core, session, 9, 9)
    rebuilt = reopened(directory, core)
    assert full_state(rebuilt) == full_state(core)
    check_invariants(rebuilt)


def test_a_kill_between_the_rename_and_the_removal_of_old_logs(directory, monkeypatch):
    core = make_core(FakeClock(), directory, every=4)
    journal = journal_of(core)
    monkeypatch.setattr(journal_module, "delete_leftovers", lambda *args: None)
    session = grow(core)
    assert journal.wait_snapshot() is True
    decode_step(core, session, 3, 3)
    # What a kill right after the rename leaves: the new snapshot and every older log.
    assert names(directory) == [log_name(0), log_name(1), "lock", "snapshot"]
    recovered = read_journal(directory)
    assert (recovered.generation, recovered.log_generations) == (1, [1])
    monkeypatch.undo()
    rebuilt = reopened(directory, core)
    assert full_state(rebuilt) == full_state(core)
    assert names(directory) == [log_name(1), "lock", "snapshot"]  # deleted on open


def test_a_kill_after_the_new_log_before_the_fork(directory, monkeypatch):
    """The new log is started, then the fork fails (as if killed between the two)."""
    core = make_core(FakeClock(), directory, every=4)

    def no_fork() -> int:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(os, "fork", no_fork)
    session = grow(core)
    monkeypatch.undo()
    assert journal_of(core).wait_snapshot() is False
    assert names(directory) == [log_name(0), log_name(1), "lock"]
    assert (directory / log_name(1)).stat().st_size == 0
    assert full_state(reopened(directory, core)) == full_state(core)
    journal, _ = Journal.open(directory)
    assert journal.generation == 1  # the reopened journal goes on in log 1
    journal.close()
    assert session


def test_a_hole_in_the_history_is_reported_not_replayed_around(directory):
    core = make_core(FakeClock(), directory, every=3)
    journal = journal_of(core)
    journal.snapshot_writer = failing_writer
    session = grow(core)  # generation 1's snapshot fails
    assert journal.wait_snapshot() is False
    for step_id in range(3, 5):  # and generation 2's
        decode_step(core, session, step_id, step_id)
    assert journal.wait_snapshot() is False
    journal.close()
    assert names(directory) == [log_name(0), log_name(1), log_name(2), "lock"]
    # A torn record at the end of an older log: only the newest can end in one.
    older = directory / log_name(1)
    whole = older.read_bytes()
    older.write_bytes(whole[:-1])
    with pytest.raises(ValueError, match=f"corrupt: {log_name(1)} has a torn"):
        Journal.open(directory)
    older.write_bytes(whole)
    # A missing log between the snapshot's and the newest.
    older.unlink()
    with pytest.raises(ValueError, match=r"generation\(s\) \[1\] are missing"):
        Journal.open(directory)


def test_close_stops_the_child_and_leaves_no_zombie_or_tmp_file(directory, tmp_path):
    core = make_core(FakeClock(), directory, every=4)
    journal = journal_of(core)
    journal.snapshot_writer = gated_writer(tmp_path / "never")
    session = grow(core)
    running = journal._running
    assert running is not None
    while not (directory / running.temporary.name).exists():  # the child has begun writing
        time.sleep(0.002)
    decode_step(core, session, 3, 3)
    live = full_state(core)
    journal.close()
    with pytest.raises(ChildProcessError):  # killed and reaped: no zombie left
        os.waitpid(running.pid, os.WNOHANG)
    assert names(directory) == [log_name(0), log_name(1), "lock"]
    assert full_state(reopened(directory)) == live


def test_the_child_runs_none_of_the_parents_code(directory, tmp_path, monkeypatch):
    """A child never returns into the caller (not even on SystemExit), runs no atexit handler
    and no Python signal handler of the parent's (a SIGTERM waits until it has left)."""
    marker = tmp_path / "ran-in-child"
    parent = os.getpid()

    def only_in_child(*args: Any) -> None:
        if os.getpid() != parent:
            marker.touch()

    atexit.register(only_in_child)
    previous = signal.signal(signal.SIGTERM, only_in_child)
    try:
        core = make_core(FakeClock(), directory, every=2)
        journal = journal_of(core)

        def leaves(file: BinaryIO, generation: int, state: Any) -> None:
            raise SystemExit(0)

        journal.snapshot_writer = leaves
        session = grow(core)
        assert journal.wait_snapshot() is False

        gate = tmp_path / "gate"
        journal.snapshot_writer = gated_writer(gate)
        decode_step(core, session, 3, 3)
        decode_step(core, session, 4, 4)  # due: a child waits for the gate
        running = journal._running
        assert running is not None
        os.kill(running.pid, signal.SIGTERM)  # blocked in the child: its handler never runs
        gate.touch()
        assert journal.wait_snapshot() is True
        journal.close()
    finally:
        atexit.unregister(only_in_child)
        signal.signal(signal.SIGTERM, previous)
    assert not marker.exists()


def test_in_process_snapshots_where_no_child_can_be_forked(directory, monkeypatch):
    monkeypatch.setitem(os.environ, "GRPC_ENABLE_FORK_SUPPORT", "1")
    assert grpc is not None and "gRPC's fork support is on" in (fork_refused() or "")
    monkeypatch.setitem(os.environ, "GRPC_ENABLE_FORK_SUPPORT", "0")
    assert fork_refused() is None
    core = BlockServiceCore(LeasePolicy(TTL_S, 1.0, TTL_S), clock=FakeClock())
    journal, _ = Journal.open(directory, JournalPolicy(snapshot_every_records=4,
                                                       background_snapshots=False))
    core.attach_journal(journal)
    grow(core)
    assert not journal.snapshot_running and journal.last_snapshot_ok is True
    assert names(directory) == [log_name(1), "lock", "snapshot"]  # written under the lock
    assert full_state(reopened(directory, core)) == full_state(core)


def test_a_child_with_other_threads_turns_to_in_process_snapshots(directory, monkeypatch,
                                                                   caplog):
    monkeypatch.setattr(journal_module, "forks_refused", None)  # restored afterwards
    monkeypatch.setattr(journal_module, "other_threads", lambda: 4)  # as if gRPC's were there
    core = make_core(FakeClock(), directory, every=3)
    journal = journal_of(core)
    session = grow(core)
    assert journal.wait_snapshot() is False
    assert "found other threads" in caplog.text and journal_module.forks_refused is not None
    for step_id in range(3, 6):
        decode_step(core, session, step_id, step_id)
    assert not journal.snapshot_running and journal.last_snapshot_ok is True
    assert full_state(reopened(directory, core)) == full_state(core)


# ---- many snapshots under random calls ------------------------------------------------------
# What happens to the running snapshot child between two calls.
child_action_st = st.sampled_from(["nothing"] * 6 + ["wait", "kill", "check"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls=st.lists(st.tuples(call_st, child_action_st), min_size=10, max_size=50),
       every=st.sampled_from([1, 2, 3]))
def test_many_snapshots_under_random_calls_recover_exactly(calls: list[tuple[Any, str]],
                                                           every: int) -> None:
    with tempfile.TemporaryDirectory() as name:
        directory = Path(name)
        pids: list[int] = []
        fork = os.fork

        def counted_fork() -> int:
            pid = fork()
            if pid:
                pids.append(pid)
            return pid

        os.fork = counted_fork
        try:
            clock = FakeClock()
            live = make_core(clock, directory, every)
            journal = journal_of(live)
            driver = Driver(live, clock)
            for call in [("open",), ("open",), ("pool", 0, 1, 8, 2), ("pool", 1, 1, 5, 1)]:
                driver.play(call)
            for call, action in calls:
                driver.play(call)
                running = journal._running
                if action == "wait":
                    journal.wait_snapshot()
                elif action == "kill" and running is not None:
                    with contextlib.suppress(ProcessLookupError):  # (it just ended)
                        os.kill(running.pid, signal.SIGKILL)
                elif action == "check":  # what a kill -9 of the process now would leave
                    assert full_state(rebuilt_from(directory)) == full_state(live)
            check_invariants(live)
            rebuilt = reopened(directory, live)  # closes the live journal first
        finally:
            os.fork = fork
        assert full_state(rebuilt) == full_state(live)
        check_invariants(rebuilt)
        assert not [p for p in directory.iterdir() if p.name.endswith(".tmp")]
        for pid in pids:  # every child was reaped
            with pytest.raises(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)


# ---- the real process, killed while snapshots run --------------------------------------------
class DecodingClient:
    """A client decoding one token per sequence per Step, with its own copy of the tables."""

    def __init__(self, session: str, tables: dict[int, list[int]],
                 lengths: dict[int, int]) -> None:
        self.session, self.tables, self.lengths = session, tables, lengths
        self.step_id = 1

    def step(self, stub: block_pb2_grpc.BlockServiceStub, timeout: float | None = None) -> None:
        """The next Step: its table changes and slots must be the client's own."""
        seq_ids = sorted(self.lengths)
        response = stub.Step(decode(self.session, self.step_id + 1, self.lengths),
                             timeout=timeout)
        self.step_id += 1
        table_after(self.tables, response, seq_ids)
        assert list(response.slot_mapping) == expected_slots(self.tables, self.lengths)
        self.lengths.update({s: n + 1 for s, n in self.lengths.items()})

    def stream(self, stub: block_pb2_grpc.BlockServiceStub, stop: threading.Event,
               failures: list[BaseException]) -> None:
        """Steps until `stop` or until the server is killed (that Step stays unanswered)."""
        try:
            while not stop.is_set():
                self.step(stub, timeout=5)
        except grpc.RpcError:
            return
        except BaseException as error:  # re-raised in the test's thread
            failures.append(error)


def test_process_killed_while_snapshot_children_run_restarts_exactly(tmp_path):
    """A snapshot every 3 records while Steps stream, and kill -9 at a random point, three
    times over: after each restart the retried Step and the next ones get the client's own
    tables and slots (nothing answered was lost, nothing applied twice)."""
    journal_dir = tmp_path / "journal"
    service = ServiceProcess("block_service", ["--journal-dir", str(journal_dir),
                                               "--snapshot-every-records", "3"])
    service.start(tmp_path).wait_serving()
    try:
        channel = grpc.insecure_channel(service.address)
        stub = block_pb2_grpc.BlockServiceStub(channel)
        session, seq_ids, tables = start_decoding(stub, 16)
        client = DecodingClient(session, tables, dict.fromkeys(seq_ids, 3))
        for _ in range(3):
            stop = threading.Event()
            failures: list[BaseException] = []
            thread = threading.Thread(target=client.stream, args=(stub, stop, failures))
            thread.start()
            time.sleep(random.uniform(0.2, 0.5))
            service.kill()
            stop.set()
            thread.join()
            channel.close()
            if failures:
                raise failures[0]
            service.start(tmp_path).wait_serving()
            channel = grpc.insecure_channel(service.address)
            stub = block_pb2_grpc.BlockServiceStub(channel)
            for _ in range(3):  # the first one retries the unanswered Step
                client.step(stub)
            stats = stub.GetStats(block_pb2.GetStatsRequest(pool_id=POOL)).stats
            assert stats.used_blocks == len({b for table in tables.values() for b in table})
            assert stats.total_refs == sum(len(table) for table in tables.values())
        assert client.step_id > 20  # it streamed
        # Its records went through many generations (a snapshot due every 3 records, taken
        # once the one running has finished).
        assert read_journal(journal_dir).newest_generation > 10
        log = service.log_path.read_text() if service.log_path else ""
        assert "journal snapshot" not in log and "in-process" not in log  # children wrote them
        channel.close()
    finally:
        service.kill()
