"""Translation between a scheduling step and the two RPCs that carry it.

`build_step_request` packs a StepPlan into one block-service StepRequest (column by column),
`parse_step_response` unpacks its answer into one OpResult per operation, and
`build_execute_request` packs the step's Work into one runner ExecuteRequest (an `ExecuteCall`:
the block tables travel pre-encoded, see there).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gateway.scheduler import (
    OPERATION_ORDER,
    FreeOp,
    Grant,
    OpOutcome,
    OpResult,
    StepPlan,
    Work,
)
from gateway.sequence import SamplingConfig, Sequence
from protos import block_pb2, runner_pb2

_OUTCOMES = {
    block_pb2.OP_STATUS_OK: OpOutcome.OK,
    block_pb2.OP_STATUS_NO_SPACE: OpOutcome.NO_SPACE,
    block_pb2.OP_STATUS_STALE: OpOutcome.STALE,
}


@dataclass
class _Columns:
    """The StepRequest's per-operation columns, filled in operation order."""

    kinds: list[block_pb2.OpKind]
    seq_ids: list[int]
    token_counts: list[int]
    token_ids: list[int]
    parent_ids: list[int]
    computed: list[int]
    lookaheads: list[int]

    def add(self, kind: block_pb2.OpKind, seq_id: int, tokens: list[int], parent_id: int = 0,
            computed: int = -1, lookahead: int = 0) -> None:
        self.kinds.append(kind)
        self.seq_ids.append(seq_id)
        self.token_counts.append(len(tokens))
        self.token_ids.extend(tokens)
        self.parent_ids.append(parent_id)
        self.computed.append(computed)
        self.lookaheads.append(lookahead)


def build_step_request(plan: StepPlan, session_id: str, pool_id: str, step_id: int,
                       epoch: int, cache_salts: dict[str, str]) -> block_pb2.StepRequest:
    """One StepRequest with the plan's operations, group by group in OPERATION_ORDER.

    `cache_salts` maps request ids to their tenant salt (absent: no salt).
    """
    packer = _StepPacker(cache_salts)
    for group in OPERATION_ORDER:  # the packer's method for a group is named as the group
        getattr(packer, group)(getattr(plan, group))
    cols = packer.cols
    return block_pb2.StepRequest(
        session_id=session_id,
        pool_id=pool_id,
        step_id=step_id,
        epoch=epoch,
        op_kinds=cols.kinds,
        seq_ids=cols.seq_ids,
        token_counts=cols.token_counts,
        token_ids=cols.token_ids,
        parent_seq_ids=cols.parent_ids,
        num_computed_tokens=cols.computed,
        cache_salts=packer.salts,
        num_lookahead_slots=cols.lookaheads if any(cols.lookaheads) else [],
    )


class _StepPacker:
    """Adds a plan's operation groups to a StepRequest's columns, one method per group."""

    def __init__(self, salts_of: Mapping[str, str]) -> None:
        self.cols = _Columns([], [], [], [], [], [], [])
        self.salts_of = salts_of  # request id -> tenant salt
        self.salts: dict[int, str] = {}  # operation index -> tenant salt, for ALLOCATEs

    def frees(self, frees: list[FreeOp]) -> None:
        for free in frees:
            self.cols.add(block_pb2.OP_KIND_FREE, free.block_seq_id, [],
                          computed=free.num_computed)

    def commits(self, commits: list[Sequence]) -> None:
        for seq in commits:
            self.cols.add(block_pb2.OP_KIND_COMMIT, seq.block_seq_id, [],
                          computed=seq.reportable_computed)

    def forks(self, forks: list[tuple[Sequence, Sequence]]) -> None:
        for parent, child in forks:
            self.cols.add(block_pb2.OP_KIND_FORK, child.block_seq_id, [],
                          parent_id=parent.block_seq_id)

    def appends(self, appends: list[Grant]) -> None:
        """Decodes, the bulk of a step: the columns filled directly (no call per operation)."""
        cols = self.cols
        kinds, seq_ids, counts, token_ids = (cols.kinds, cols.seq_ids, cols.token_counts,
                                             cols.token_ids)
        parents, computed, lookaheads = cols.parent_ids, cols.computed, cols.lookaheads
        for grant in appends:
            seq = grant.seq
            new = seq.token_ids[seq.num_registered:grant.register_end]
            kinds.append(block_pb2.OP_KIND_APPEND)
            seq_ids.append(seq.block_seq_id)
            counts.append(len(new))
            token_ids.extend(new)
            parents.append(0)
            # The KV confirmed so far: the block service publishes full blocks within it, so
            # it must never count the Execute in flight (nor a position it has not been told).
            computed.append(seq.num_computed)
            lookaheads.append(grant.lookahead)

    def allocates(self, allocates: list[Grant]) -> None:
        for grant in allocates:
            seq = grant.seq
            salt = self.salts_of.get(seq.request_id, "")
            if salt:
                self.salts[len(self.cols.kinds)] = salt
            self.cols.add(block_pb2.OP_KIND_ALLOCATE, seq.block_seq_id,
                          seq.token_ids[:seq.alloc_len])


def parse_step_response(response: block_pb2.StepResponse, num_ops: int) -> list[OpResult]:
    """One OpResult per operation, with its table change and slots sliced out."""
    if len(response.op_statuses) != num_ops:
        raise ValueError(
            f"block service answered {len(response.op_statuses)} results for {num_ops} ops"
        )
    # Columns as lists once: indexing a protobuf repeated field or map costs far more than a
    # list's, and this runs for every operation of every step.
    table_ids = list(response.table_block_ids)
    slots = list(response.slot_mapping)
    table_counts = list(response.table_counts)
    table_starts = list(response.table_starts)
    slot_counts = list(response.slot_counts)
    cached = list(response.num_cached_tokens)
    errors = dict(response.errors)
    results: list[OpResult] = []
    append = results.append
    table_cursor = 0
    slot_cursor = 0
    ok, outcomes, failed = block_pb2.OP_STATUS_OK, _OUTCOMES, OpOutcome.FAILED
    for i, status in enumerate(response.op_statuses):
        table_end = table_cursor + table_counts[i]
        slot_end = slot_cursor + slot_counts[i]
        if status == ok and not errors:
            error = ""
        else:
            error = errors.get(i, "" if status == ok else block_pb2.OpStatus.Name(status))
        append(OpResult(outcomes.get(status, failed), table_starts[i],
                        table_ids[table_cursor:table_end], slots[slot_cursor:slot_end],
                        cached[i], error))
        table_cursor = table_end
        slot_cursor = slot_end
    return results


@dataclass(slots=True)
class ExecuteCall:
    """One ExecuteRequest whose block tables travel pre-encoded.

    A decode row's table only grows by a block every block_size steps, yet converting every
    id of every row into the message each step cost more than the rest of the Execute at long
    sequences (256 rows x 125 blocks: 1.3 ms against 10 us to join the rows' bytes). Each
    Sequence keeps its table encoded (`table_wire`); the runner receives an ordinary message.
    """

    request: runner_pb2.ExecuteRequest  # every column but block_tables
    # The block_tables column on the wire: each row's table as its own packed entry, which a
    # parser concatenates in order (protobuf's rule for a packed field met several times).
    block_tables: bytes

    def serialize(self) -> bytes:
        """The ExecuteRequest's wire form (the RPC's request serializer)."""
        return self.request.SerializeToString() + self.block_tables

    def message(self) -> runner_pb2.ExecuteRequest:
        """The whole ExecuteRequest as the runner reads it."""
        return runner_pb2.ExecuteRequest.FromString(self.serialize())


def table_wire(seq: Sequence) -> bytes:
    """`seq`'s block table as an ExecuteRequest's block_tables field (protobuf's own
    encoding), encoded again only when the table was replaced."""
    table = seq.block_table
    if seq.table_wire_of is not table:
        seq.table_wire = runner_pb2.ExecuteRequest(block_tables=table).SerializeToString()
        seq.table_wire_of = table
    return seq.table_wire


def build_execute_request(work: list[Work], copies: list[block_pb2.BlockCopy], epoch: int,
                          client_id: str, step_id: int, params_of: dict[str, SamplingRow],
                          pending_rows: Mapping[Sequence, int] | None = None,
                          after_step_id: int = 0) -> ExecuteCall:
    """One ExecuteRequest for the step's work (`params_of` maps request id to its row), to
    run after step `after_step_id` (0: none) when that one is still running.

    A decode whose input token that step is still sampling leaves it to the runner:
    `pending_rows` maps each such sequence to its row in that step's answer.
    """
    request = runner_pb2.ExecuteRequest(epoch=epoch, client_id=client_id, step_id=step_id,
                                        after_step_id=after_step_id)
    request.copy_src_block_ids.extend(c.src_block_id for c in copies)
    request.copy_dst_block_ids.extend(c.dst_block_id for c in copies)
    token_ids: list[int] = []
    slots: list[int] = []
    tables: list[bytes] = []
    pending_indices: list[int] = []
    pending_sample_rows: list[int] = []
    for item in work:
        seq = item.seq
        start = item.start
        end = start + item.num_tokens
        token_ids.extend(seq.token_ids[start:end])
        if end > len(seq.token_ids):  # its last token is being sampled
            if pending_rows is None or seq not in pending_rows:
                raise RuntimeError(f"no step in flight samples the token at position "
                                   f"{seq.num_tokens} of {seq.request_id}")
            pending_indices.append(len(token_ids))
            pending_sample_rows.append(pending_rows[seq])
            token_ids.append(0)  # the runner writes the sampled token here
        slots.extend(item.slots)
        tables.append(table_wire(seq))
    # Whole lists into the columns: a list extends a repeated field faster than a generator.
    request.num_new_tokens.extend([item.num_tokens for item in work])
    request.start_positions.extend([item.start for item in work])
    request.token_ids.extend(token_ids)
    request.slot_mapping.extend(slots)
    request.block_table_lens.extend([len(item.seq.block_table) for item in work])
    request.do_sample.extend([item.do_sample for item in work])
    request.pending_token_indices.extend(pending_indices)
    request.pending_sample_rows.extend(pending_sample_rows)
    adapters = [item.seq.adapter for item in work]
    if any(adapters):  # base-only steps leave the column empty: nothing to send or read
        request.adapters.extend(adapters)
    _add_sampling_columns(request, work, params_of)
    return ExecuteCall(request, b"".join(tables))


@dataclass
class SamplingRow:
    """A request's sampling parameters as the runner takes them (seed is per sequence)."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    num_logprobs: int | None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    has_penalties: bool = False  # any of the three penalties is on (set by from_config)

    @classmethod
    def from_config(cls, config: SamplingConfig) -> SamplingRow:
        return cls(config.temperature, config.top_p, config.top_k, config.min_p,
                   config.logprobs, config.presence_penalty, config.frequency_penalty,
                   config.repetition_penalty, config.logit_bias, config.has_penalties)


def _add_sampling_columns(request: runner_pb2.ExecuteRequest, work: list[Work],
                          params_of: dict[str, SamplingRow]) -> None:
    rows = [params_of[item.seq.request_id] for item in work]
    request.temperatures.extend([row.temperature for row in rows])
    request.top_ps.extend([row.top_p for row in rows])
    request.top_ks.extend([row.top_k for row in rows])
    request.min_ps.extend([row.min_p for row in rows])
    request.seeds.extend([item.seq.seed for item in work])
    if any(row.num_logprobs is not None for row in rows):
        request.num_logprobs.extend(row.num_logprobs or 0 for row in rows)
    if any(row.has_penalties for row in rows):
        _add_penalty_columns(request, work, rows)
    if any(row.logit_bias for row in rows):
        request.logit_bias_counts.extend(len(row.logit_bias) for row in rows)
        for row in rows:
            request.logit_bias_token_ids.extend(token_id for token_id, _ in row.logit_bias)
            request.logit_bias_values.extend(bias for _, bias in row.logit_bias)


def _add_penalty_columns(request: runner_pb2.ExecuteRequest, work: list[Work],
                         rows: list[SamplingRow]) -> None:
    """The penalties, prompt lengths and, for each sampling row with a penalty on, its tokens
    before this step's (the runner adds the new ones, pending tokens included)."""
    request.presence_penalties.extend(row.presence_penalty for row in rows)
    request.frequency_penalties.extend(row.frequency_penalty for row in rows)
    request.repetition_penalties.extend(row.repetition_penalty for row in rows)
    request.prompt_lens.extend(item.seq.prompt_len for item in work)
    for item, row in zip(work, rows, strict=True):
        if item.do_sample and row.has_penalties:
            request.penalty_history_lens.append(item.start)
            request.penalty_token_ids.extend(item.seq.token_ids[:item.start])
        else:
            request.penalty_history_lens.append(0)


def sampled_sequences(work: list[Work]) -> list[Sequence]:
    """The sequences the runner answers for, in its answer's order."""
    return [item.seq for item in work if item.do_sample]
