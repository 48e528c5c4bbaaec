"""The journal: an append-only log of state changes plus a periodic snapshot, in one directory.

Files in the journal directory:
- `journal-<generation>.log`: the records of one generation, in order. Each record is
  `u32 length | u32 crc32(body) | body`, body = one kind byte + the pickled call arguments.
  Generation 0 starts from an empty state; every snapshot starts the next generation's log.
- `snapshot`: the core's whole state at the start of log <generation>, `MAGIC` + pickle of
  (generation, state). Written to `snapshot-<generation>.tmp`, fsynced, renamed over
  `snapshot`, directory fsynced: it is either the old or the new one, never a torn one.
- `lock`: flock'ed by the process that journals into the directory.

Recovery loads the snapshot of generation s (none: an empty state, s = 0) and replays the logs
s, s+1, ... n in order; log n is the open one. Older logs are left over from a kill between a
snapshot's rename and their removal and are ignored (and deleted on open). A record that is cut
short or fails its CRC can only be the last of log n (a kill in the middle of a write): it is
dropped and the file truncated there. Anywhere else, or a missing log between s and n, means
the history has a hole: that is reported as corruption, never replayed around.

Snapshots without a pause (Redis's BGSAVE): when one is due, the core (under its lock) calls
`start_snapshot`, which opens log g+1 (every later record goes there) and forks. The child
holds a copy-on-write image of the state as it was after the last record of log g, pickles it
into the temporary file, fsyncs it and leaves with os._exit; the parent returns at once. A
thread of the parent waits for the child and on success renames the file over `snapshot`,
fsyncs the directory and deletes the logs before g+1; on failure it logs why and keeps the
older snapshot and logs (the next due snapshot tries again). One snapshot runs at a time. Where
a child cannot be forked safely (no os.fork; gRPC's fork support on, see `fork_refused`) the
snapshot is written in-process, under the core's lock, as before.

What is durable when (see docs/block_service.md, "Crash recovery"): every record is handed to
the kernel with os.write before the call's answer leaves the process, so a process kill loses
nothing that was answered. With `fsync=True` every record is also fdatasync'ed before the
answer (and a new log's directory entry synced before its first record), which survives a
machine crash too, at the cost of one disk flush per state change. Snapshots are always
fsynced (they are rare).

The journal only stores and reads bytes; what a record means is the core's business
(BlockServiceCore.replay applies records through the same code as the live calls).
"""

from __future__ import annotations

import fcntl
import gc
import logging
import os
import pickle
import re
import signal
import struct
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, NoReturn

log = logging.getLogger(__name__)

MAGIC = b"pagewire-block-snapshot-v1\n"
SNAPSHOT = "snapshot"
LOCK = "lock"  # flock'ed by the one process that journals into the directory
HEADER = struct.Struct("<II")  # body length, crc32 of the body
LOG_NAME = re.compile(r"journal-(\d+)\.log")
TEMPORARY_NAME = re.compile(r"snapshot(-\d+)?\.tmp")  # snapshot.tmp: written by older versions
DEFAULT_SNAPSHOT_EVERY_RECORDS = 10_000
DEFAULT_SNAPSHOT_EVERY_S = 60.0
DEFAULT_SNAPSHOT_TIMEOUT_S = 600.0
EXIT_JOURNAL_FAILED = 75  # EX_TEMPFAIL: a supervisor restarts the process, which replays
EXIT_CHILD_FAILED = 1  # a snapshot child: the state could not be written (why: on its pipe)
EXIT_CHILD_THREADS = 3  # a snapshot child found threads besides its own (see fork_refused)
MAX_ERROR_BYTES = 4096  # what a failed child reports on its pipe

# gRPC's C core, as the grpcio wheel builds it on Linux, has fork support on unless this
# variable says otherwise when grpc is loaded: its pthread_atfork handlers then restart
# gRPC's EventEngine threads in every forked child (measured with grpcio 1.85 under a running
# server: 5 gRPC threads in each child, and children dying of SIGSEGV). A snapshot child must
# run nothing but its own code, so the block service turns gRPC's fork support off (it never
# uses gRPC in a forked child). This module is imported before grpc in `python -m
# block_service` (block_service/__main__.py imports the core first); an explicit setting wins,
# and `fork_refused` plus the child's own check below fall back to in-process snapshots when
# gRPC's handlers may be active.
GRPC_FORK_SUPPORT = "GRPC_ENABLE_FORK_SUPPORT"
os.environ.setdefault(GRPC_FORK_SUPPORT, "0")
# Set once a snapshot child found other threads (fork handlers are per process): why every
# later snapshot of this process is written in-process.
forks_refused: str | None = None


@dataclass(frozen=True)
class JournalPolicy:
    """When records are synced and snapshots taken."""

    fsync: bool = False
    snapshot_every_records: int = DEFAULT_SNAPSHOT_EVERY_RECORDS
    snapshot_every_s: float = DEFAULT_SNAPSHOT_EVERY_S
    # False: write every snapshot in-process under the core's lock (what a platform without
    # os.fork does anyway).
    background_snapshots: bool = True
    # A snapshot child still running after this long is killed (the snapshot counts as failed).
    snapshot_timeout_s: float = DEFAULT_SNAPSHOT_TIMEOUT_S


@dataclass
class Recovered:
    """What a journal directory held at start: the snapshot's state and the later records."""

    state: Any | None
    records: list[tuple[int, Any]] = field(default_factory=list)
    dropped_bytes: int = 0  # a torn or corrupt tail of the newest log that was cut off
    generation: int = 0  # of the snapshot (0: none)
    log_generations: list[int] = field(default_factory=list)  # the logs replayed, in order

    @property
    def newest_generation(self) -> int:
        """The generation of the log that records go on into."""
        return self.log_generations[-1] if self.log_generations else self.generation


def encode_record(kind: int, args: Any) -> bytes:
    """One framed record."""
    body = bytes((kind,)) + pickle.dumps(args, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(body), zlib.crc32(body)) + body


def decode_records(data: bytes) -> tuple[list[tuple[int, Any]], int]:
    """The whole records at the start of `data`, and the length they take."""
    records: list[tuple[int, Any]] = []
    offset = 0
    for kind, args, end in iter_records(data):
        records.append((kind, args))
        offset = end
    return records, offset


def iter_records(data: bytes) -> Iterator[tuple[int, Any, int]]:
    """(kind, args, end offset) of each whole, intact record; stops at the first bad one."""
    offset = 0
    while offset + HEADER.size <= len(data):
        length, crc = HEADER.unpack_from(data, offset)
        start, end = offset + HEADER.size, offset + HEADER.size + length
        if length == 0 or end > len(data):
            return
        body = data[start:end]
        if zlib.crc32(body) != crc:
            return
        try:
            args = pickle.loads(body[1:])
        except Exception:  # any unpickling failure means a corrupt record
            return
        yield body[0], args, end
        offset = end


def log_name(generation: int) -> str:
    return f"journal-{generation:010d}.log"


def temporary_name(generation: int) -> str:
    """Where the snapshot of `generation` is written before it is renamed over `snapshot`:
    one name per generation, so that a child left running by a killed process never writes
    into the file of the next process's snapshot."""
    return f"{SNAPSHOT}-{generation:010d}.tmp"


def log_generations(directory: Path) -> list[int]:
    """The generations of the logs in `directory`, in order."""
    found = (LOG_NAME.fullmatch(name) for name in os.listdir(directory))
    return sorted(int(match.group(1)) for match in found if match)


def write_all(fd: int, data: bytes) -> None:
    """os.write until every byte is written (a regular file may take fewer at once)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def fsync_dir(directory: Path) -> None:
    """Makes a rename or a new file in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def lock_directory(directory: Path) -> int:
    """An exclusive flock on the directory's lock file (released when the process dies), so
    that a second instance never interleaves its records with a live one's."""
    fd = os.open(directory / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RuntimeError(f"journal directory {directory} is in use by another process "
                           "(or another journal of this one)") from None
    return fd


def read_journal(directory: str | os.PathLike[str]) -> Recovered:
    """What a journal directory holds, read only (no lock, nothing cut or deleted).

    The directory may be live: a snapshot installed while it is read (which deletes the logs
    before it) makes it read again.
    """
    path = Path(directory)
    for _ in range(10):
        before = file_identity(path / SNAPSHOT)
        generation, state = read_snapshot(path)
        generations = [g for g in log_generations(path) if g >= generation]
        try:
            logs = [(path / log_name(g)).read_bytes() for g in generations]
        except FileNotFoundError:  # deleted by a snapshot installed meanwhile
            continue
        if file_identity(path / SNAPSHOT) == before:
            break
    else:
        raise RuntimeError(f"journal directory {path} kept changing while it was read")
    if generations != list(range(generation, generation + len(generations))):
        missing = sorted(set(range(generation, generations[-1])) - set(generations))
        raise ValueError(
            f"journal {path} is corrupt: the snapshot is of generation {generation} and the "
            f"newest log of generation {generations[-1]}, but the logs of generation(s) "
            f"{missing} are missing: replaying around them would build a wrong state")
    records: list[tuple[int, Any]] = []
    dropped = 0
    for index, data in enumerate(logs):
        log_records, good = decode_records(data)
        records.extend(log_records)
        if good == len(data):
            continue
        if index < len(logs) - 1:
            raise ValueError(
                f"journal {path} is corrupt: {log_name(generations[index])} has a torn or "
                f"corrupt record at byte {good} of {len(data)}, but newer logs follow it (only "
                f"the newest log can end in a torn record, from a kill in the middle of a "
                f"write). To start from the state before it, truncate that log to {good} bytes "
                f"and move its newer logs away")
        dropped = len(data) - good
    return Recovered(state, records, dropped, generation, generations)


def file_identity(path: Path) -> tuple[int, int, int] | None:
    """(inode, size, mtime) of a file, or None: which version of it a reader saw."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return stat.st_ino, stat.st_size, stat.st_mtime_ns


def write_snapshot_file(file: BinaryIO, generation: int, state: Any) -> None:
    """The snapshot format: MAGIC + pickle of (generation, state)."""
    file.write(MAGIC)
    pickle.dump((generation, state), file, protocol=pickle.HIGHEST_PROTOCOL)


def fork_refused() -> str | None:
    """Why a snapshot may not be written by a forked child in this process, or None.

    The child runs only `Journal._run_child`: it pickles objects that are quiet (the parent
    forked holding the core's lock, and the child has no other thread), writes one file of its
    own and leaves with os._exit, so it needs no lock another thread of the parent might have
    held at the fork: no logging, no gRPC, no atexit handler, no buffered stdout flushed twice.
    What could still run in it is the fork handlers of libraries. CPython's own (logging,
    threading, random) only reset locks. gRPC's would restart its threads in the child (see
    GRPC_FORK_SUPPORT above), so with grpc loaded its fork support must be off; the child also
    checks that it has no other thread and otherwise exits at once (EXIT_CHILD_THREADS), after
    which this journal writes its snapshots in-process.
    """
    if forks_refused is not None:
        return forks_refused
    if not hasattr(os, "fork"):
        return "this platform has no os.fork"
    if ("grpc._cython.cygrpc" in sys.modules
            and os.environ.get(GRPC_FORK_SUPPORT, "").strip().lower() not in ("0", "false",
                                                                               "no")):
        return (f"gRPC's fork support is on ({GRPC_FORK_SUPPORT} is not 0 when grpc is loaded): "
                f"its fork handlers would run gRPC threads in the child")
    return None


def other_threads() -> int:
    """How many threads this process has besides the calling one (0 where /proc cannot say)."""
    try:
        return len(os.listdir("/proc/self/task")) - 1
    except OSError:
        return 0


@dataclass
class RunningSnapshot:
    """A snapshot child and what its parent needs to finish its work."""

    generation: int
    pid: int
    temporary: Path
    error_fd: int  # read end of the pipe the child reports a failure on
    done: threading.Event = field(default_factory=threading.Event)


class Journal:
    """The open log of one journal directory, and its snapshots."""

    def __init__(self, directory: Path, policy: JournalPolicy, generation: int,
                 lock_fd: int) -> None:
        self.directory = directory
        self.policy = policy
        self.generation = generation  # of the open log
        self.records_since_snapshot = 0
        self.snapshot_at = time.monotonic()
        # Writes a snapshot's bytes into the open temporary file (tests replace it, e.g. to
        # make a child wait). In a child it runs in the child.
        self.snapshot_writer: Callable[[BinaryIO, int, Any], None] = write_snapshot_file
        self.last_snapshot_ok: bool | None = None  # of the last snapshot finished (None: none)
        self._lock_fd = lock_fd
        self._fd = self._open_log(generation)
        self._running: RunningSnapshot | None = None
        self._closing = threading.Event()
        self._in_process_logged = False
        # The parent's thread that waits for each snapshot child: started once, here, so that
        # starting a snapshot under the core's lock only hands it the child (starting a thread
        # waits until the new thread runs: milliseconds on a busy machine).
        self._child_started = threading.Event()
        self._waiter: threading.Thread | None = None
        if policy.background_snapshots and hasattr(os, "fork"):
            self._waiter = threading.Thread(target=self._wait_for_children, daemon=True,
                                            name=f"journal-snapshots-{directory.name}")
            self._waiter.start()

    @classmethod
    def open(cls, directory: str | os.PathLike[str],
             policy: JournalPolicy | None = None) -> tuple[Journal, Recovered]:
        """Opens (creating) a journal directory: its recovered contents and the open log.

        The newest log is cut back to its last whole record; logs of generations before the
        snapshot (left by a kill between a snapshot's rename and their removal) and temporary
        snapshot files (of a snapshot that never finished) are deleted.
        """
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        lock_fd = lock_directory(path)
        try:
            recovered = read_journal(path)
        except BaseException:
            os.close(lock_fd)
            raise
        generation = recovered.newest_generation
        log_path = path / log_name(generation)
        if recovered.dropped_bytes:
            log.warning("journal %s: dropped a torn or corrupt tail of %d bytes after %d "
                        "records", log_path, recovered.dropped_bytes, len(recovered.records))
            os.truncate(log_path, log_path.stat().st_size - recovered.dropped_bytes)
        delete_leftovers(path, recovered.generation)
        journal = cls(path, policy or JournalPolicy(), generation, lock_fd)
        journal.records_since_snapshot = len(recovered.records)
        return journal, recovered

    def _open_log(self, generation: int) -> int:
        return os.open(self.directory / log_name(generation),
                       os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    @property
    def closed(self) -> bool:
        return self._fd < 0 or self._closing.is_set()

    @property
    def snapshot_running(self) -> bool:
        return self._running is not None

    def append(self, kind: int, args: Any) -> None:
        """Writes one record (and syncs it under the fsync policy) before the caller answers.

        A failed write leaves the in-memory state ahead of the log with no way to undo it, so
        the process stops at once (the supervisor restarts it; the unanswered call is retried
        by its client and replay restores exactly what was answered).
        """
        try:
            write_all(self._fd, encode_record(kind, args))
            if self.policy.fsync:
                os.fdatasync(self._fd)
        except OSError:
            fail_stop("journal write failed")
        self.records_since_snapshot += 1

    def snapshot_due(self) -> bool:
        """Whether enough records or time have gone by since the last snapshot started (never
        while one is running: the next record after it finishes asks again)."""
        if not self.records_since_snapshot or self._running is not None:
            return False
        return (self.records_since_snapshot >= self.policy.snapshot_every_records
                or time.monotonic() - self.snapshot_at >= self.policy.snapshot_every_s)

    def start_snapshot(self, state: Callable[[], Any]) -> bool:
        """Starts the next generation: its log, and a snapshot of `state()` as it is now.

        Called under the core's lock, right after a record (or with no call in between), so
        that the state is exactly what the logs up to this generation rebuild. In a forked
        child `state()` is called there and the lock is held only for the log switch and the
        fork; otherwise the snapshot is written here. False (nothing done) while a snapshot is
        running or after close.
        """
        if self._running is not None or self.closed:
            return False
        generation = self.generation + 1
        self.records_since_snapshot = 0  # a failure waits for the next due time, too
        self.snapshot_at = time.monotonic()
        new_fd = -1
        try:
            new_fd = self._open_log(generation)
            if self.policy.fsync:  # its records are synced: so must its name be
                fsync_dir(self.directory)
        except OSError:
            log.error("journal: could not start log %s; no snapshot, the log goes on",
                      log_name(generation), exc_info=True)
            if new_fd >= 0:
                os.close(new_fd)  # an empty log: harmless where it stays
            self.last_snapshot_ok = False
            return True
        os.close(self._fd)
        self._fd, self.generation = new_fd, generation
        refused = fork_refused()
        if refused is None and self.policy.background_snapshots:
            try:
                self._fork_child(generation, state)
            except OSError:  # pipe or fork failed (out of memory, process limit)
                log.error("journal snapshot %d: could not fork; the logs go on", generation,
                          exc_info=True)
                self.last_snapshot_ok = False
            return True
        if refused is not None and not self._in_process_logged:
            log.warning("journal: snapshots are written in-process, with the lock held, "
                        "because %s", refused)
            self._in_process_logged = True
        self._write_in_process(generation, state)
        return True

    def wait_snapshot(self) -> bool | None:
        """Waits for the running snapshot, if any; whether the last one finished succeeded."""
        running = self._running
        if running is not None:
            running.done.wait()
        return self.last_snapshot_ok

    # ---- in-process ----------------------------------------------------------------------
    def _write_in_process(self, generation: int, state: Callable[[], Any]) -> None:
        temporary = self.directory / temporary_name(generation)
        try:
            with open(temporary, "wb") as file:
                self.snapshot_writer(file, generation, state())
                file.flush()
                os.fsync(file.fileno())
        except Exception:  # a full disk, or a state that does not pickle: the logs go on
            log.error("journal snapshot %d failed; the logs go on", generation, exc_info=True)
            temporary.unlink(missing_ok=True)
            self.last_snapshot_ok = False
            return
        self.last_snapshot_ok = self._install(generation, temporary)

    def _install(self, generation: int, temporary: Path) -> bool:
        """Renames a written snapshot over `snapshot`; then the logs before it are dead.

        Until the directory is synced the rename may not survive a machine crash, so the old
        logs are deleted only after that (left behind, they are ignored and deleted on open).
        """
        try:
            os.replace(temporary, self.directory / SNAPSHOT)
        except OSError:
            log.error("journal snapshot %d could not be renamed into place; the logs go on",
                      generation, exc_info=True)
            temporary.unlink(missing_ok=True)
            return False
        try:
            fsync_dir(self.directory)
        except OSError:
            log.error("journal snapshot %d: the directory could not be synced; the older "
                      "logs are kept", generation, exc_info=True)
            return False
        delete_leftovers(self.directory, generation)
        return True

    # ---- in a child ----------------------------------------------------------------------
    def _fork_child(self, generation: int, state: Callable[[], Any]) -> None:
        """Forks the child that writes the snapshot, and the thread that waits for it."""
        temporary = self.directory / temporary_name(generation)
        temporary.unlink(missing_ok=True)  # the child creates it with O_EXCL
        error_read, error_write = os.pipe()
        # Signals stay blocked in the child: no handler of the parent's (e.g. a graceful stop
        # on SIGTERM) may run there. It is killed with SIGKILL when it must stop.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        try:
            pid = os.fork()
            if pid == 0:
                self._run_child(generation, state, temporary, error_write)  # never returns
        except BaseException:
            os.close(error_read)
            os.close(error_write)
            raise
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # (only the parent gets here)
        os.close(error_write)
        self._running = RunningSnapshot(generation, pid, temporary, error_read)
        self._child_started.set()

    def _run_child(self, generation: int, state: Callable[[], Any], temporary: Path,
                   error_fd: int) -> NoReturn:
        """The forked child: writes the snapshot and exits, whatever happens (see
        `fork_refused` for why nothing here can wait for another thread)."""
        status = EXIT_CHILD_FAILED
        try:
            gc.disable()  # no finalizer of the parent's garbage runs here
            threads = other_threads()
            if threads:
                status = EXIT_CHILD_THREADS
                raise RuntimeError(f"{threads} other threads run in the snapshot child")
            # Drop the parent's descriptors (its listening socket, connections, directory lock,
            # logs): a child outliving a killed parent must not keep the port or the lock.
            os.closerange(3, error_fd)
            os.closerange(error_fd + 1, max_fd())
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with open(fd, "wb") as file:
                self.snapshot_writer(file, generation, state())
                file.flush()
                os.fsync(file.fileno())
            status = 0
        except BaseException as error:
            try:
                message = f"{type(error).__name__}: {error}".encode("utf-8", "replace")
                os.write(error_fd, message[:MAX_ERROR_BYTES])
            except BaseException:  # nothing more can be said
                pass
        finally:
            os._exit(status)

    def _wait_for_children(self) -> None:
        """The waiter thread: finishes each child's snapshot in turn, until close."""
        while True:
            self._child_started.wait()
            self._child_started.clear()
            running = self._running
            if running is not None:
                self._finish_child(running)
            if self._closing.is_set() and self._running is None:
                return

    def _finish_child(self, running: RunningSnapshot) -> None:
        """The parent's thread for one child: waits for it, then installs or cleans up."""
        ok = False
        try:
            code = self._reap(running)
            try:
                os.set_blocking(running.error_fd, False)
                error = os.read(running.error_fd, MAX_ERROR_BYTES).decode("utf-8", "replace")
            except OSError:
                error = ""
            if code == 0:
                ok = self._install(running.generation, running.temporary)
            else:
                running.temporary.unlink(missing_ok=True)
                self._child_failed(running.generation, code, error)
        except Exception:
            log.exception("journal snapshot %d: could not finish", running.generation)
            running.temporary.unlink(missing_ok=True)
        finally:
            os.close(running.error_fd)
            self.last_snapshot_ok = ok
            self._running = None
            running.done.set()

    def _reap(self, running: RunningSnapshot) -> int | None:
        """The child's exit code (negative: the signal that ended it; None: unknown). Kills it
        when the journal closes or the child runs past the policy's timeout."""
        deadline = time.monotonic() + self.policy.snapshot_timeout_s
        delay = 0.001
        while True:
            try:
                pid, status = os.waitpid(running.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by someone else: its result is unknown
                return None
            if pid:
                return os.waitstatus_to_exitcode(status)
            if self._closing.is_set() or time.monotonic() >= deadline:
                if not self._closing.is_set():
                    log.error("journal snapshot %d: the child ran for more than %.0f s; "
                              "killing it", running.generation, self.policy.snapshot_timeout_s)
                os.kill(running.pid, signal.SIGKILL)  # not reaped yet: the pid is still its
                _, status = os.waitpid(running.pid, 0)
                return os.waitstatus_to_exitcode(status)
            self._closing.wait(delay)
            delay = min(delay * 2, 0.05)

    def _child_failed(self, generation: int, code: int | None, error: str) -> None:
        global forks_refused
        if code == EXIT_CHILD_THREADS:
            forks_refused = (f"a snapshot child found other threads ({error}): set "
                             f"{GRPC_FORK_SUPPORT}=0 before grpc is imported")
            log.error("journal snapshot %d failed: %s; from now on snapshots are written "
                      "in-process", generation, forks_refused)
        elif code == -signal.SIGKILL and self._closing.is_set():
            log.info("journal snapshot %d stopped by close; the logs stay", generation)
        else:
            log.error("journal snapshot %d failed (child exit %s): %s; the logs go on",
                      generation, code, error or "no reason given")

    def close(self) -> None:
        """Stops a running snapshot child (killed and reaped, its file deleted; the logs are
        complete without it), closes the log and releases the directory. Called after the
        last record (no call of the core runs any more)."""
        self._closing.set()
        self._child_started.set()  # wakes the waiter thread: it stops a running child, ends
        if self._waiter is not None:
            self._waiter.join()
        running = self._running
        if running is not None:  # started by a call that raced with close
            self._finish_child(running)
        if self._fd >= 0:
            os.close(self._fd)
            os.close(self._lock_fd)
            self._fd = -1


def delete_leftovers(directory: Path, generation: int) -> None:
    """Deletes the logs before `generation` (the snapshot's) and temporary snapshot files
    (called when no snapshot of this process is running; a child left by a killed process
    may still write one: it then writes into a deleted file)."""
    for name in os.listdir(directory):
        match = LOG_NAME.fullmatch(name)
        if (match and int(match.group(1)) < generation) or TEMPORARY_NAME.fullmatch(name):
            (directory / name).unlink(missing_ok=True)


def max_fd() -> int:
    try:
        return max(os.sysconf("SC_OPEN_MAX"), 256)
    except (OSError, ValueError):
        return 65536


def fail_stop(what: str) -> NoReturn:
    """Logs and exits at once: the in-memory state is ahead of the journal (see append)."""
    log.critical("%s; stopping so that a restart replays the journal", what, exc_info=True)
    logging.shutdown()
    os._exit(EXIT_JOURNAL_FAILED)


def read_snapshot(directory: Path) -> tuple[int, Any | None]:
    """(generation, state) of the directory's snapshot, or (0, None) without one."""
    path = directory / SNAPSHOT
    try:
        with open(path, "rb") as file:
            if file.read(len(MAGIC)) != MAGIC:
                raise ValueError(f"{path} is not a pagewire block service snapshot")
            generation, state = pickle.load(file)
    except FileNotFoundError:  # (one being renamed into place is there before and after)
        return 0, None
    return int(generation), state
