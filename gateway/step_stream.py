"""Block-service Steps over one long-lived StepStream: the engine's fast path.

A unary Step pays gRPC's per-call set-up on both ends (about a fifth of its latency here); a
stream pays it once. The stream is only a fast path: any failure on it (the block service
restarted, refused the stream, a step took longer than the deadline) closes it and raises
StreamBroken, and the engine sends that same request as a unary Step under its retry policy.
Steps are idempotent by (session, step id), so a step the stream delivered before it broke is
answered from the block service's memory, never applied twice. The next step opens a new
stream (after a refusal, only once REOPEN_AFTER_REFUSAL_S has passed).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator

import grpc

from protos import block_pb2, block_pb2_grpc

REOPEN_AFTER_REFUSAL_S = 30.0
_WATCH_INTERVAL_S = 0.25


class StreamBroken(Exception):
    """The stream failed; the request in flight must be resent another way."""


class _Stream:
    """One open StepStream: requests fed from a queue, answers read in order."""

    def __init__(self, stub: block_pb2_grpc.BlockServiceStub) -> None:
        self._outbox: queue.SimpleQueue[block_pb2.StepRequest | None] = queue.SimpleQueue()
        self._call = stub.StepStream(self._requests())

    def _requests(self) -> Iterator[block_pb2.StepRequest]:
        while (request := self._outbox.get()) is not None:
            yield request

    def exchange(self, request: block_pb2.StepRequest) -> block_pb2.StepResponse:
        self._outbox.put(request)
        return next(self._call)  # type: ignore[no-any-return]

    def cancel(self) -> None:
        self._call.cancel()

    def close(self) -> None:
        self._outbox.put(None)
        self._call.cancel()


class StepStreamClient:
    """Sends Steps over a StepStream; called from one thread (a runner loop's) at a time."""

    def __init__(self, stub: block_pb2_grpc.BlockServiceStub, timeout_s: float) -> None:
        self._stub = stub
        self._timeout_s = timeout_s
        self._stream: _Stream | None = None
        self._refused_at: float | None = None
        # A step in flight since (monotonic), for the watchdog; None when idle.
        self._in_flight_since: float | None = None
        self._lock = threading.Lock()
        self._closed = threading.Event()
        threading.Thread(target=self._watch, name="step-stream-watchdog", daemon=True).start()

    def step(self, request: block_pb2.StepRequest) -> block_pb2.StepResponse:
        """The answer to `request`; StreamBroken when it must be resent as a unary Step."""
        stream = self._open_stream()
        if stream is None:
            raise StreamBroken("StepStream refused recently: using Step")
        with self._lock:
            self._in_flight_since = time.monotonic()
        try:
            return stream.exchange(request)
        except (grpc.RpcError, StopIteration) as error:
            self._drop(stream, error)
            raise StreamBroken(str(error)) from error
        finally:
            with self._lock:
                self._in_flight_since = None

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()

    def _open_stream(self) -> _Stream | None:
        if self._stream is None:
            refused_at = self._refused_at
            if refused_at is not None and time.monotonic() - refused_at < REOPEN_AFTER_REFUSAL_S:
                return None
            with self._lock:
                self._stream = _Stream(self._stub)
        return self._stream

    def _drop(self, stream: _Stream, error: BaseException) -> None:
        if isinstance(error, grpc.RpcError) and \
                error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:  # type: ignore[attr-defined]
            self._refused_at = time.monotonic()
        with self._lock:
            if self._stream is stream:
                self._stream = None
        stream.close()

    def _watch(self) -> None:
        """Cancels the stream when a step has been in flight longer than the deadline (a
        unary Step would time out then): the engine's retry takes over."""
        while not self._closed.wait(_WATCH_INTERVAL_S):
            with self._lock:
                since, stream = self._in_flight_since, self._stream
            if since is not None and stream is not None and \
                    time.monotonic() - since > self._timeout_s:
                stream.cancel()
