"""Operation kinds, statuses, errors and result records shared by the core's modules.

The integer values equal the proto enums `OpKind` and `OpStatus` of pagewire.block.v1, so the
servicer passes them through unchanged (the core itself does not import protobuf).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

# OpKind
OP_ALLOCATE = 1
OP_APPEND = 2
OP_FREE = 3
OP_FORK = 4
OP_COMMIT = 5

# OpStatus
STATUS_OK = 1
STATUS_NO_SPACE = 2
STATUS_INVALID_ARGUMENT = 3
STATUS_NOT_FOUND = 4
STATUS_ALREADY_EXISTS = 5
STATUS_STALE = 6

INT32_MAX = 2**31 - 1
NOT_CHANGED = -1  # num_computed_tokens value that leaves it unchanged


class ErrorCode(enum.Enum):
    """Whole-call failures; the servicer maps each to the gRPC status code of the same name."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    OUT_OF_RANGE = "OUT_OF_RANGE"  # a KV event batch number past the newest


class BlockServiceError(Exception):
    """A whole call failed; nothing was changed."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


MAX_SHOWN_CHARS = 64  # client-supplied names are cut to this in error messages


def shown(name: str) -> str:
    """A client-supplied name for an error message: repr'd and cut short (a 4 MB session id
    must not become a 4 MB status message)."""
    if len(name) <= MAX_SHOWN_CHARS:
        return repr(name)
    return repr(name[:MAX_SHOWN_CHARS]) + f"... ({len(name)} chars)"


# The whole-call error a single-operation RPC raises for each failed per-operation status.
STATUS_ERROR_CODES = {
    STATUS_INVALID_ARGUMENT: ErrorCode.INVALID_ARGUMENT,
    STATUS_NOT_FOUND: ErrorCode.NOT_FOUND,
    STATUS_ALREADY_EXISTS: ErrorCode.ALREADY_EXISTS,
    STATUS_STALE: ErrorCode.FAILED_PRECONDITION,
}


@dataclass
class OpResult:
    """What one operation did (the slow path's record; the Step fast path writes columns)."""

    status: int = STATUS_OK
    num_cached_tokens: int = 0
    table_start: int = 0
    table_block_ids: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    error: str = ""
    num_released_blocks: int = 0


@dataclass
class StepResult:
    """A Step's answer, column by column as in StepResponse."""

    step_id: int
    epoch: int
    op_statuses: list[int]
    num_cached_tokens: list[int]
    table_starts: list[int]
    table_counts: list[int]
    table_block_ids: list[int]
    slot_counts: list[int]
    slot_mapping: list[int]
    copies: list[tuple[int, int]]
    errors: dict[int, str]


@dataclass(frozen=True)
class PoolInfo:
    """A pool's shape and epoch."""

    pool_id: str
    num_blocks: int
    block_size: int
    epoch: int
    address: str = ""  # the runner's, for a registered pool


@dataclass(frozen=True)
class PoolStats:
    """Counters of a pool (see the proto's Stats message)."""

    pool_id: str
    epoch: int
    total_blocks: int
    free_blocks: int
    used_blocks: int
    cached_evictable_blocks: int
    num_sequences: int
    num_sessions: int
    prompt_tokens: int
    cached_prompt_tokens: int
    evictions: int
    copies: int
    no_space: int
    total_refs: int
    appended_tokens: int
