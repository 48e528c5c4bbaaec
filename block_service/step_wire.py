"""A Step in its wire form: StepRequest bytes in, StepResponse bytes out.

The servicer hands BlockServiceCore.step_wire the request's bytes as they arrived, and sends
the bytes it returns: no protobuf message is made on either side. With the compiled module
(block_service/_stepwire.c, built by `make setup`) the request is read into C arrays, the
operations run there (decode appends inline, everything else through
block_service.step.apply_op) and the answer is written as bytes. Without it, or for a request
the C reader is unsure of, protobuf parses the request and block_service.step.run_step runs
it: the same answers (tests/block_service/test_step_wire.py compares both, operation by
operation).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from block_service.ops import StepResult
from protos import block_pb2

log = logging.getLogger(__name__)

try:
    from block_service import _stepwire as compiled_step
except ImportError:  # not built (no C compiler at set-up): the Python path serves
    compiled_step = None  # type: ignore[assignment]
    log.warning("block_service._stepwire is not built: Steps run on the Python path "
                "(several times the CPU per Step; `make setup` builds it)")


@dataclass(frozen=True)
class Columns:
    """A Step's operations as lists (the Python path's form)."""

    kinds: Sequence[int]
    seq_ids: Sequence[int]
    token_counts: Sequence[int]
    token_ids: Sequence[int]
    parent_ids: Sequence[int]
    computed: Sequence[int]
    lookaheads: Sequence[int]


@dataclass(frozen=True)
class WireStep:
    """A parsed StepRequest: its header, its columns' lengths, and the columns themselves,
    as C arrays (`parsed`, for block_service._stepwire.run) or as lists (`columns`)."""

    session_id: str
    pool_id: str
    step_id: int
    epoch: int
    num_waiting_tokens: int
    # Entries of kinds, seq_ids, token_counts, token_ids, parent_seq_ids, num_computed_tokens,
    # num_lookahead_slots.
    lengths: tuple[int, int, int, int, int, int, int]
    token_sum: int  # sum of token_counts
    salts: dict[int, str]
    parsed: Any = None
    columns: Columns | None = field(default=None, repr=False)


def parse_step(data: bytes, compiled: bool = True) -> WireStep:
    """The request in `data`; protobuf's DecodeError if it does not parse."""
    if compiled and compiled_step is not None:
        fields = compiled_step.parse(data)
        if fields is not None:
            session_id, pool_id, step_id, epoch, waiting, lengths, token_sum, salts, parsed = \
                fields
            return WireStep(session_id, pool_id, step_id, epoch, waiting, lengths, token_sum,
                            salts, parsed=parsed)
    request = block_pb2.StepRequest.FromString(data)
    # container[:] makes a list about twice as fast as list(container) does.
    columns = Columns(request.op_kinds[:], request.seq_ids[:], request.token_counts[:],
                      request.token_ids[:], request.parent_seq_ids[:],
                      request.num_computed_tokens[:], request.num_lookahead_slots[:])
    lengths = (len(columns.kinds), len(columns.seq_ids), len(columns.token_counts),
               len(columns.token_ids), len(columns.parent_ids), len(columns.computed),
               len(columns.lookaheads))
    return WireStep(request.session_id, request.pool_id, request.step_id, request.epoch,
                    request.num_waiting_tokens, lengths, sum(columns.token_counts),
                    dict(request.cache_salts), columns=columns)


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


def answer_bytes(answer: StepResult | bytes) -> bytes:
    """A Step's answer as StepResponse bytes."""
    if isinstance(answer, bytes):
        return answer
    return step_response(answer).SerializeToString()


def answer_result(answer: StepResult | bytes) -> StepResult:
    """A Step's answer as a StepResult."""
    if not isinstance(answer, bytes):
        return answer
    message = block_pb2.StepResponse.FromString(answer)
    return StepResult(
        message.step_id, message.epoch, list(map(int, message.op_statuses)),
        message.num_cached_tokens[:],
        message.table_starts[:], message.table_counts[:], message.table_block_ids[:],
        message.slot_counts[:], message.slot_mapping[:],
        [(copy.src_block_id, copy.dst_block_id) for copy in message.copies],
        dict(message.errors))
