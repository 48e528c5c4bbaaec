"""SubscribeKvEvents: a pool's KV events as a server stream (a mixin of BlockServicer).

An open stream holds one server thread for as long as it lives, so it takes its thread from
BlockServicer's stream slots (--max-workers less the threads kept for unary calls; on the
threaded server StepStreams take theirs from the same budget, on the grpc.aio one they hold
none); a subscription past it is refused with RESOURCE_EXHAUSTED. A
stream waiting for events checks every POLL_S whether its call is still active, and is woken
at once when the client cancels, so a client that went away, or a server that stops, frees
the thread.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc

from block_service.core import BlockServiceCore
from block_service.events import POLL_S, BlockRemoved, BlockStored, EventBatch, KvEvent
from block_service.ops import BlockServiceError
from protos import block_pb2


def event_message(event: KvEvent) -> block_pb2.KvEvent:
    """One KvEvent message."""
    if isinstance(event, BlockStored):
        return block_pb2.KvEvent(stored=block_pb2.BlockStored(
            block_hashes=event.block_hashes, parent_block_hash=event.parent_block_hash,
            token_ids=event.token_ids, block_size=event.block_size))
    if isinstance(event, BlockRemoved):
        return block_pb2.KvEvent(removed=block_pb2.BlockRemoved(
            block_hashes=event.block_hashes))
    return block_pb2.KvEvent(cleared=block_pb2.AllBlocksCleared())


def batch_message(batch: EventBatch) -> block_pb2.KvEventBatch:
    """One KvEventBatch message."""
    return block_pb2.KvEventBatch(
        sequence=batch.sequence, pool_id=batch.pool_id, epoch=batch.epoch,
        instance_id=batch.instance_id, snapshot=batch.snapshot,
        events=[event_message(event) for event in batch.events],
        timestamp_ms=batch.timestamp_ms)


class KvEventsServicer:
    """The SubscribeKvEvents RPC, for BlockServicer (which sets the attributes below)."""

    core: BlockServiceCore
    max_step_streams: int  # the number of stream slots
    _stream_slots: threading.BoundedSemaphore | None  # None: no thread to spare for a stream

    def SubscribeKvEvents(self, request: block_pb2.SubscribeKvEventsRequest,
                          context: grpc.ServicerContext) -> Iterator[block_pb2.KvEventBatch]:
        slots = self._stream_slots
        if slots is None or not slots.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{self.max_step_streams} streams (StepStreams and KV event "
                          "subscriptions) are open, as many as this server has threads for "
                          "(--max-workers): subscribe again later")
            return
        try:
            subscription = self.core.subscribe_events(
                request.pool_id, request.after_sequence, request.instance_id)
            if not context.add_callback(subscription.cancel):
                return  # the call has ended already
            for batch in subscription.batches(context.is_active, POLL_S):
                yield batch_message(batch)
        except BlockServiceError as error:
            context.abort(getattr(grpc.StatusCode, error.code.value), error.message)
        finally:
            slots.release()
