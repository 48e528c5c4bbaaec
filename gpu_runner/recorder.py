"""Recording of executed batches, for benchmarks that replay them (bench/ceiling.py).

`python -m gpu_runner --record-batches FILE` appends every ExecuteRequest it executes to FILE,
length-prefixed; `read_recorded` reads them back in order.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Iterator
from pathlib import Path

from protos import runner_pb2

_LENGTH = struct.Struct("<I")


class BatchRecorder:
    """Appends ExecuteRequests to a file (opened per write: the file may be truncated between
    workloads by the benchmark)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()

    def write(self, request: runner_pb2.ExecuteRequest) -> None:
        data = request.SerializeToString()
        with self._lock, open(self.path, "ab") as file:
            file.write(_LENGTH.pack(len(data)) + data)


def read_recorded(path: Path) -> Iterator[runner_pb2.ExecuteRequest]:
    """The recorded ExecuteRequests, in order (a torn last record is ignored)."""
    data = path.read_bytes()
    offset = 0
    while offset + _LENGTH.size <= len(data):
        (size,) = _LENGTH.unpack_from(data, offset)
        offset += _LENGTH.size
        if offset + size > len(data):
            break
        yield runner_pb2.ExecuteRequest.FromString(data[offset : offset + size])
        offset += size
