"""How a request's messages travel from its runner loop's thread to whoever streams them.

A runner loop produces every message of a step at once (gateway/runner_loop.py). Handing each
to its stream one by one would wake the reader's thread or event loop once per message, which
at hundreds of streams costs more than making the messages. So a step's messages are gathered
in an `Outbox` and handed over with one wake-up per event loop (`AsyncSink`: the HTTP API and
the gRPC API both read on event loops). `ThreadSink` is the plain queue for a reader on a
thread of its own (tests, tools).

A sink counts what was put and what was taken, so the request can see when its reader falls
behind (`unread`) and merge its progress into fewer messages instead of queueing without
bound (gateway/request.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from protos import gateway_pb2


@dataclass
class StreamError:
    """Ends a stream with a gRPC status instead of a last message."""

    code_name: str  # a grpc.StatusCode name, e.g. "UNAVAILABLE"
    message: str


# What a stream carries: a message, an error, or None (the end).
Item = gateway_pb2.GenerateResponse | StreamError | None
Tag = TypeVar("Tag")


class ThreadSink:
    """A request's messages for a reader on its own thread (`items` blocks)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Item] = queue.SimpleQueue()
        # Each written by one side only: put by the producer, taken by the reader.
        self.put_count = 0
        self.taken_count = 0

    @property
    def unread(self) -> int:
        return self.put_count - self.taken_count

    def put(self, item: Item) -> None:
        self.put_count += 1
        self._queue.put(item)

    def items(self) -> Iterator[gateway_pb2.GenerateResponse | StreamError]:
        """The messages until the end marker."""
        while True:
            item = self._queue.get()
            self.taken_count += 1
            if item is None:
                return
            yield item


class AsyncSink(Generic[Tag]):
    """A request's messages for a coroutine on `loop`, as (tag, item) on a queue that several
    requests may share (an HTTP job of several prompts tags each with its index)."""

    def __init__(self, loop: asyncio.AbstractEventLoop,
                 shared: asyncio.Queue[tuple[Tag, Item]], tag: Tag) -> None:
        self.loop = loop
        self.queue = shared
        self.tag = tag
        self.put_count = 0
        self.taken_count = 0

    @property
    def unread(self) -> int:
        return self.put_count - self.taken_count

    def put(self, item: Item) -> None:
        """From any thread, alone (a runner loop batches through an Outbox instead)."""
        self.put_count += 1
        # A closed loop (the server stopped) has nobody left to read.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (self.tag, item))

    def taken(self) -> None:
        """The reader took one of this sink's items off the queue."""
        self.taken_count += 1


class MessageSink(Protocol):
    """Where a request's messages go."""

    @property
    def unread(self) -> int:
        """Messages put and not taken by the reader yet."""

    def put(self, item: Item) -> None: ...


class Outbox:
    """One step's messages, handed over with one wake-up per event loop when `send` is
    called; order is kept per sink (and per loop, as call_soon_threadsafe keeps it)."""

    def __init__(self) -> None:
        self._batches: dict[asyncio.AbstractEventLoop, list[tuple[AsyncSink, Item]]] = {}

    def put(self, sink: MessageSink, item: Item) -> None:
        if isinstance(sink, AsyncSink):
            sink.put_count += 1
            self._batches.setdefault(sink.loop, []).append((sink, item))
        else:
            sink.put(item)

    def send(self) -> None:
        batches, self._batches = self._batches, {}
        for loop, batch in batches.items():
            with contextlib.suppress(RuntimeError):  # a stopped server's loop
                loop.call_soon_threadsafe(_deliver, batch)


def _deliver(batch: list[tuple[AsyncSink, Item]]) -> None:
    for sink, item in batch:
        sink.queue.put_nowait((sink.tag, item))
