"""The journal: an append-only log of state changes plus a periodic snapshot, in one directory.

Files in the journal directory:
- `snapshot`: the core's whole state at some point, `MAGIC` + pickle of (generation, state).
  Written to `snapshot.tmp`, fsynced, renamed over `snapshot`, directory fsynced: it is either
  the old or the new one, never a torn one.
- `journal-<generation>.log`: the records appended since the snapshot of that generation
  (generation 0: since an empty state). Each record is
  `u32 length | u32 crc32(body) | body`, body = one kind byte + the pickled call arguments.
  A record that is cut short or fails its CRC ends the log (a kill in the middle of a write
  leaves at most one such record, the last): recovery drops it and truncates the file there.

What is durable when (see docs/block_service.md, "Crash recovery"): every record is handed to
the kernel with os.write before the call's answer leaves the process, so a process kill loses
nothing that was answered. With `fsync=True` every record is also fdatasync'ed before the
answer, which survives a machine crash too, at the cost of one disk flush per state change.
Snapshots are always fsynced (they are rare).

The journal only stores and reads bytes; what a record means is the core's business
(BlockServiceCore.replay applies records through the same code as the live calls).
"""

from __future__ import annotations

import fcntl
import logging
import os
import pickle
import struct
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

log = logging.getLogger(__name__)

MAGIC = b"pagewire-block-snapshot-v1\n"
SNAPSHOT = "snapshot"
LOCK = "lock"  # flock'ed by the one process that journals into the directory
HEADER = struct.Struct("<II")  # body length, crc32 of the body
DEFAULT_SNAPSHOT_EVERY_RECORDS = 10_000
DEFAULT_SNAPSHOT_EVERY_S = 60.0
EXIT_JOURNAL_FAILED = 75  # EX_TEMPFAIL: a supervisor restarts the process, which replays


@dataclass(frozen=True)
class JournalPolicy:
    """When records are synced and snapshots taken."""

    fsync: bool = False
    snapshot_every_records: int = DEFAULT_SNAPSHOT_EVERY_RECORDS
    snapshot_every_s: float = DEFAULT_SNAPSHOT_EVERY_S


@dataclass
class Recovered:
    """What a journal directory held at start: the snapshot's state and the later records."""

    state: Any | None
    records: list[tuple[int, Any]] = field(default_factory=list)
    dropped_bytes: int = 0  # a torn or corrupt tail that was cut off
    generation: int = 0  # of the snapshot (0: none) and of the log after it


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
    """What a journal directory holds, read only (no lock, nothing cut or deleted)."""
    path = Path(directory)
    generation, state = read_snapshot(path)
    log_path = path / log_name(generation)
    data = log_path.read_bytes() if log_path.exists() else b""
    records, good = decode_records(data)
    return Recovered(state, records, len(data) - good, generation)


class Journal:
    """The open log of one journal directory, and its snapshots."""

    def __init__(self, directory: Path, policy: JournalPolicy, generation: int,
                 lock_fd: int) -> None:
        self.directory = directory
        self.policy = policy
        self.generation = generation
        self.records_since_snapshot = 0
        self.snapshot_at = time.monotonic()
        self._lock_fd = lock_fd
        self._fd = self._open_log(generation)

    @classmethod
    def open(cls, directory: str | os.PathLike[str],
             policy: JournalPolicy | None = None) -> tuple[Journal, Recovered]:
        """Opens (creating) a journal directory: its recovered contents and the open log.

        The log is cut back to its last whole record and logs of older generations (left by a
        kill between a snapshot's rename and their removal) are deleted.
        """
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        lock_fd = lock_directory(path)
        try:
            recovered = read_journal(path)
        except BaseException:
            os.close(lock_fd)
            raise
        generation = recovered.generation
        log_path = path / log_name(generation)
        if recovered.dropped_bytes:
            log.warning("journal %s: dropped a torn or corrupt tail of %d bytes after %d "
                        "records", log_path, recovered.dropped_bytes, len(recovered.records))
            os.truncate(log_path, log_path.stat().st_size - recovered.dropped_bytes)
        for old in path.glob("journal-*.log"):
            if old != log_path:
                old.unlink()
        journal = cls(path, policy or JournalPolicy(), generation, lock_fd)
        journal.records_since_snapshot = len(recovered.records)
        return journal, recovered

    def _open_log(self, generation: int) -> int:
        return os.open(self.directory / log_name(generation),
                       os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

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
        """Whether enough records or time have gone by since the last snapshot."""
        if not self.records_since_snapshot:
            return False
        return (self.records_since_snapshot >= self.policy.snapshot_every_records
                or time.monotonic() - self.snapshot_at >= self.policy.snapshot_every_s)

    def write_snapshot(self, state: Any) -> None:
        """Saves `state` as the next generation's snapshot and starts that generation's log.

        A failure before the new snapshot replaces the old one changes nothing (the log goes
        on; the next record tries again later); after it, the log must move to the new
        generation or the records that follow would be lost at the next start, so a failure
        there stops the process like a failed append.
        """
        generation = self.generation + 1
        temporary = self.directory / (SNAPSHOT + ".tmp")
        try:
            with open(temporary, "wb") as file:
                file.write(MAGIC)
                pickle.dump((generation, state), file, protocol=pickle.HIGHEST_PROTOCOL)
                file.flush()
                os.fsync(file.fileno())
        except OSError:
            log.error("journal snapshot failed; the log goes on", exc_info=True)
            self.snapshot_at = time.monotonic()
            self.records_since_snapshot = 0
            return
        try:
            os.replace(temporary, self.directory / SNAPSHOT)
            new_fd = self._open_log(generation)
            fsync_dir(self.directory)
        except OSError:
            fail_stop("journal snapshot could not be installed")
        os.close(self._fd)
        (self.directory / log_name(self.generation)).unlink(missing_ok=True)
        self._fd, self.generation = new_fd, generation
        self.records_since_snapshot = 0
        self.snapshot_at = time.monotonic()

    def close(self) -> None:
        """Closes the log and releases the directory."""
        if self._fd >= 0:
            os.close(self._fd)
            os.close(self._lock_fd)
            self._fd = -1


def fail_stop(what: str) -> NoReturn:
    """Logs and exits at once: the in-memory state is ahead of the journal (see append)."""
    log.critical("%s; stopping so that a restart replays the journal", what, exc_info=True)
    logging.shutdown()
    os._exit(EXIT_JOURNAL_FAILED)


def read_snapshot(directory: Path) -> tuple[int, Any | None]:
    """(generation, state) of the directory's snapshot, or (0, None) without one."""
    path = directory / SNAPSHOT
    if not path.exists():
        return 0, None
    with open(path, "rb") as file:
        if file.read(len(MAGIC)) != MAGIC:
            raise ValueError(f"{path} is not a pagewire block service snapshot")
        generation, state = pickle.load(file)
    return int(generation), state
