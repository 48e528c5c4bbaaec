"""The gRPC face of BlockServiceCore: protobuf in, core call, protobuf out.

Requests are turned into plain lists here, outside the core's lock; whole-call failures of the
core (BlockServiceError) become the gRPC status of the same name.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

import grpc

from block_service.core import BlockServiceCore
from block_service.events_servicer import KvEventsServicer
from block_service.ops import STATUS_OK, BlockServiceError, PoolInfo, StepResult
from common.handlers import lenient_handlers
from protos import block_pb2, block_pb2_grpc

SERVICE = block_pb2.DESCRIPTOR.services_by_name["BlockService"]
SERVICE_NAME = SERVICE.full_name

T = TypeVar("T")


def pool_message(info: PoolInfo) -> block_pb2.Pool:
    """A PoolInfo as a Pool message."""
    return block_pb2.Pool(pool_id=info.pool_id, num_blocks=info.num_blocks,
                          block_size=info.block_size, epoch=info.epoch, address=info.address)


def step_response(result: StepResult) -> block_pb2.StepResponse:
    """A StepResult as a StepResponse (the columns are copied in bulk)."""
    return block_pb2.StepResponse(
        step_id=result.step_id, epoch=result.epoch,
        op_statuses=result.op_statuses,  # type: ignore[arg-type]  # ints equal to OpStatus
        num_cached_tokens=result.num_cached_tokens, table_starts=result.table_starts,
        table_counts=result.table_counts, table_block_ids=result.table_block_ids,
        slot_counts=result.slot_counts, slot_mapping=result.slot_mapping,
        copies=[block_pb2.BlockCopy(src_block_id=src, dst_block_id=dst)
                for src, dst in result.copies],
        errors=result.errors)


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

    def Step(self, request: block_pb2.StepRequest,
             context: grpc.ServicerContext) -> block_pb2.StepResponse:
        # container[:] makes a list about twice as fast as list(container) does.
        result = self._call(context, lambda: self.core.step(
            request.session_id, request.pool_id, request.step_id, request.epoch,
            request.op_kinds[:], request.seq_ids[:], request.token_counts[:],
            request.token_ids[:], request.parent_seq_ids[:],
            request.num_computed_tokens[:], dict(request.cache_salts),
            request.num_lookahead_slots[:], request.num_waiting_tokens))
        return step_response(result)

    def StepStream(self, requests: Iterator[block_pb2.StepRequest],
                   context: grpc.ServicerContext) -> Iterator[block_pb2.StepResponse]:
        slots = self._stream_slots
        if slots is None or not slots.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{self.max_step_streams} StepStreams are open, as many as this "
                          "server has threads for (--max-workers): use Step")
            return
        try:
            for request in requests:
                yield self.Step(request, context)
        finally:
            slots.release()

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


def register(core: BlockServiceCore, max_workers: int) -> Callable[[grpc.Server], None]:
    """The `register` callback for common.server.start_server, for a server with
    `max_workers` threads."""
    servicer = BlockServicer(core, max(0, max_workers - UNARY_THREADS))

    def add(server: grpc.Server) -> None:
        server.add_generic_rpc_handlers((lenient_handlers(servicer, SERVICE, block_pb2),))
    return add
