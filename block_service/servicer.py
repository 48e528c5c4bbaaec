"""The gRPC face of BlockServiceCore: protobuf in, core call, protobuf out.

Requests are turned into plain lists here, outside the core's lock; whole-call failures of the
core (BlockServiceError) become the gRPC status of the same name. Step and StepStream are the
exception: their handlers take the request's wire bytes and send the answer's as the core
returns them (BlockServiceCore.step_wire, block_service/step_wire.py). On the block service's
grpc.aio server (`serve`) a StepStream is a coroutine on the event loop and holds no thread;
on a threaded server (tests, `--server threads`) it holds one of the server's threads.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TypeVar

import grpc
from google.protobuf.message import DecodeError

from block_service.core import BlockServiceCore
from block_service.events_servicer import KvEventsServicer
from block_service.ops import STATUS_OK, BlockServiceError, PoolInfo
from common.handlers import lenient_handlers
from common.server import EventLoopThread, GrpcService, ServerOptions, start_server
from protos import block_pb2, block_pb2_grpc

SERVICE = block_pb2.DESCRIPTOR.services_by_name["BlockService"]
SERVICE_NAME = SERVICE.full_name

T = TypeVar("T")


def pool_message(info: PoolInfo) -> block_pb2.Pool:
    """A PoolInfo as a Pool message."""
    return block_pb2.Pool(pool_id=info.pool_id, num_blocks=info.num_blocks,
                          block_size=info.block_size, epoch=info.epoch, address=info.address)


# Server threads kept for unary calls (KeepAlive, health, Step) however many StepStreams are
# open: each open stream holds one thread of the server's pool for as long as it lives.
UNARY_THREADS = 4


class BlockServicer(KvEventsServicer, block_pb2_grpc.BlockServiceServicer):
    """Translates BlockService RPCs to BlockServiceCore calls."""

    def __init__(self, core: BlockServiceCore, max_step_streams: int) -> None:
        self.core = core
        self.max_step_streams = max_step_streams
        self._stream_slots = threading.BoundedSemaphore(max_step_streams) \
            if max_step_streams > 0 else None

    @staticmethod
    def _call(context: grpc.ServicerContext, work: Callable[[], T]) -> T:
        """Runs `work`, turning a BlockServiceError into the call's gRPC status."""
        try:
            return work()
        except BlockServiceError as error:
            context.abort(getattr(grpc.StatusCode, error.code.value), error.message)
            raise  # unreachable: abort raises

    def OpenSession(self, request: block_pb2.OpenSessionRequest,
                    context: grpc.ServicerContext) -> block_pb2.OpenSessionResponse:
        session_id, ttl_ms = self._call(context, lambda: self.core.open_session(
            request.client_name, request.lease_ttl_ms))
        return block_pb2.OpenSessionResponse(session_id=session_id, lease_ttl_ms=ttl_ms)

    def KeepAlive(self, request: block_pb2.KeepAliveRequest,
                  context: grpc.ServicerContext) -> block_pb2.KeepAliveResponse:
        ttl_ms = self._call(context, lambda: self.core.keep_alive(request.session_id))
        return block_pb2.KeepAliveResponse(lease_ttl_ms=ttl_ms)

    def CloseSession(self, request: block_pb2.CloseSessionRequest,
                     context: grpc.ServicerContext) -> block_pb2.CloseSessionResponse:
        freed = self._call(context, lambda: self.core.close_session(request.session_id))
        return block_pb2.CloseSessionResponse(num_freed_sequences=freed)

    def CreatePool(self, request: block_pb2.CreatePoolRequest,
                   context: grpc.ServicerContext) -> block_pb2.CreatePoolResponse:
        info = self._call(context, lambda: self.core.create_pool(
            request.pool_id, request.num_blocks, request.block_size, request.epoch))
        return block_pb2.CreatePoolResponse(pool=pool_message(info))

    def GetPool(self, request: block_pb2.GetPoolRequest,
                context: grpc.ServicerContext) -> block_pb2.GetPoolResponse:
        info = self._call(context, lambda: self.core.get_pool(request.pool_id))
        return block_pb2.GetPoolResponse(pool=pool_message(info))

    def Allocate(self, request: block_pb2.AllocateRequest,
                 context: grpc.ServicerContext) -> block_pb2.AllocateResponse:
        result = self._call(context, lambda: self.core.allocate(
            request.session_id, request.pool_id, request.seq_id, request.token_ids[:],
            request.cache_salt))
        if result.status != STATUS_OK:
            return block_pb2.AllocateResponse(allocated=False)
        return block_pb2.AllocateResponse(
            allocated=True, block_table=result.table_block_ids,
            num_cached_tokens=result.num_cached_tokens, slot_mapping=result.slots)

    def Append(self, request: block_pb2.AppendRequest,
               context: grpc.ServicerContext) -> block_pb2.AppendResponse:
        computed = (request.num_computed_tokens if request.HasField("num_computed_tokens")
                    else -1)
        result = self._call(context, lambda: self.core.append(
            request.session_id, request.pool_id, request.seq_id, request.token_ids[:],
            computed))
        if result.status != STATUS_OK:
            return block_pb2.AppendResponse(allocated=False)
        return block_pb2.AppendResponse(
            allocated=True, block_table=result.table_block_ids, slot_mapping=result.slots,
            copies=[block_pb2.BlockCopy(src_block_id=src, dst_block_id=dst)
                    for src, dst in result.copies])

    def Free(self, request: block_pb2.FreeRequest,
             context: grpc.ServicerContext) -> block_pb2.FreeResponse:
        computed = (request.num_computed_tokens if request.HasField("num_computed_tokens")
                    else -1)
        result = self._call(context, lambda: self.core.free(
            request.session_id, request.pool_id, request.seq_id, computed))
        return block_pb2.FreeResponse(num_released_blocks=result.num_released_blocks)

    def Fork(self, request: block_pb2.ForkRequest,
             context: grpc.ServicerContext) -> block_pb2.ForkResponse:
        result = self._call(context, lambda: self.core.fork(
            request.session_id, request.pool_id, request.parent_seq_id, request.child_seq_id))
        return block_pb2.ForkResponse(block_table=result.table_block_ids)

    def _step(self, data: bytes) -> bytes | tuple[grpc.StatusCode, str]:
        """A Step's answer bytes, or the status its call ends with."""
        try:
            return self.core.step_wire(data)
        except DecodeError as error:
            return grpc.StatusCode.INVALID_ARGUMENT, f"malformed StepRequest: {error}"
        except BlockServiceError as error:
            return getattr(grpc.StatusCode, error.code.value), error.message

    def Step(self, data: bytes, context: grpc.ServicerContext) -> bytes:
        answer = self._step(data)
        if isinstance(answer, bytes):
            return answer
        context.abort(*answer)
        raise AssertionError("unreachable: abort raises")

    def StepStream(self, requests: Iterator[bytes],
                   context: grpc.ServicerContext) -> Iterator[bytes]:
        slots = self._stream_slots
        if slots is None or not slots.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{self.max_step_streams} StepStreams are open, as many as this "
                          "server has threads for (--max-workers): use Step")
            return
        try:
            for data in requests:
                yield self.Step(data, context)
        finally:
            slots.release()

    async def step_stream_async(self, requests: AsyncIterator[bytes],
                                context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        """StepStream on the grpc.aio server: each Step runs on the event loop (the core's
        work for one is a fraction of a millisecond), so an open stream holds no thread."""
        async for data in requests:
            answer = self._step(data)
            if not isinstance(answer, bytes):
                await context.abort(*answer)
                return
            yield answer

    def MatchPrefix(self, request: block_pb2.MatchPrefixRequest,
                    context: grpc.ServicerContext) -> block_pb2.MatchPrefixResponse:
        cached = self._call(context, lambda: self.core.match_prefix(
            request.pool_id, request.token_ids[:], request.cache_salt))
        return block_pb2.MatchPrefixResponse(num_cached_tokens=cached)

    def GetStats(self, request: block_pb2.GetStatsRequest,
                 context: grpc.ServicerContext) -> block_pb2.GetStatsResponse:
        stats = self._call(context, lambda: self.core.stats(request.pool_id))
        return block_pb2.GetStatsResponse(stats=block_pb2.Stats(**vars(stats)))

    def RegisterRunner(self, request: block_pb2.RegisterRunnerRequest,
                       context: grpc.ServicerContext) -> block_pb2.RegisterRunnerResponse:
        info, ttl_ms = self._call(context, lambda: self.core.register_runner(
            request.pool_id, request.address, request.num_blocks, request.block_size,
            request.epoch, request.lease_ttl_ms))
        return block_pb2.RegisterRunnerResponse(pool=pool_message(info), lease_ttl_ms=ttl_ms)

    def UnregisterRunner(self, request: block_pb2.UnregisterRunnerRequest,
                         context: grpc.ServicerContext) -> block_pb2.UnregisterRunnerResponse:
        self._call(context, lambda: self.core.unregister_runner(request.pool_id,
                                                                request.epoch))
        return block_pb2.UnregisterRunnerResponse()

    def ListRunners(self, request: block_pb2.ListRunnersRequest,
                    context: grpc.ServicerContext) -> block_pb2.ListRunnersResponse:
        runners = self.core.list_runners()
        return block_pb2.ListRunnersResponse(runners=[
            block_pb2.RunnerLoad(
                pool=pool_message(info), free_blocks=load.free_blocks,
                num_sequences=load.num_sequences, queued_tokens=load.queued_tokens,
                load_tokens=load.load_tokens)
            for info, load in runners])

    def Route(self, request: block_pb2.RouteRequest,
              context: grpc.ServicerContext) -> block_pb2.RouteResponse:
        chosen, candidates = self._call(context, lambda: self.core.route(
            request.client_name, request.token_ids[:], request.cache_salt, request.policy,
            request.num_seqs, request.pool_ids[:]))
        return block_pb2.RouteResponse(pool_id=chosen.pool_id, candidates=[
            block_pb2.RouteCandidate(pool_id=c.pool_id, num_cached_tokens=c.num_cached_tokens,
                                     load_tokens=c.load_tokens, cost=c.cost,
                                     num_pending_tokens=c.num_pending_tokens)
            for c in candidates])


def generic_handler(servicer: BlockServicer, aio: bool) -> grpc.GenericRpcHandler:
    """Every BlockService method of `servicer`, for a grpc.aio server (`aio`) or a threaded
    one: Step and StepStream take and give wire bytes (no deserializer or serializer)."""
    stream = servicer.step_stream_async if aio else servicer.StepStream
    wire = {"Step": grpc.unary_unary_rpc_method_handler(servicer.Step),
            "StepStream": grpc.stream_stream_rpc_method_handler(stream)}
    return lenient_handlers(servicer, SERVICE, block_pb2, wire)


def register(core: BlockServiceCore, max_workers: int) -> Callable[[grpc.Server], None]:
    """The `register` callback for common.server.start_server, for a server with
    `max_workers` threads (a threaded one, or a grpc.aio one with that migration pool)."""
    servicer = BlockServicer(core, max(0, max_workers - UNARY_THREADS))

    def add(server: grpc.Server | grpc.aio.Server) -> None:
        server.add_generic_rpc_handlers(
            (generic_handler(servicer, isinstance(server, grpc.aio.Server)),))
    return add


def serve(core: BlockServiceCore, options: ServerOptions,
          threaded: bool = False) -> tuple[GrpcService, Callable[[], None]]:
    """Starts the block service's server: a grpc.aio one on an event loop thread of its own
    (`threaded`: a threaded one, as before it). Returns it and what ends the loop after it
    has stopped."""
    if threaded:
        return start_server(options, register(core, options.max_workers), [SERVICE_NAME]), \
            lambda: None
    loop = EventLoopThread("block-service-loop")
    service = start_server(options, register(core, options.max_workers), [SERVICE_NAME],
                           loop=loop.loop)
    return service, loop.stop
