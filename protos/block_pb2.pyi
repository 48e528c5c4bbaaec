from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OpKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OP_KIND_UNSPECIFIED: _ClassVar[OpKind]
    OP_KIND_ALLOCATE: _ClassVar[OpKind]
    OP_KIND_APPEND: _ClassVar[OpKind]
    OP_KIND_FREE: _ClassVar[OpKind]
    OP_KIND_FORK: _ClassVar[OpKind]
    OP_KIND_COMMIT: _ClassVar[OpKind]

class OpStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OP_STATUS_UNSPECIFIED: _ClassVar[OpStatus]
    OP_STATUS_OK: _ClassVar[OpStatus]
    OP_STATUS_NO_SPACE: _ClassVar[OpStatus]
    OP_STATUS_INVALID_ARGUMENT: _ClassVar[OpStatus]
    OP_STATUS_NOT_FOUND: _ClassVar[OpStatus]
    OP_STATUS_ALREADY_EXISTS: _ClassVar[OpStatus]
    OP_STATUS_STALE: _ClassVar[OpStatus]

class RoutingPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROUTING_POLICY_UNSPECIFIED: _ClassVar[RoutingPolicy]
    ROUTING_POLICY_PREFIX: _ClassVar[RoutingPolicy]
    ROUTING_POLICY_LEAST_LOADED: _ClassVar[RoutingPolicy]
    ROUTING_POLICY_ROUND_ROBIN: _ClassVar[RoutingPolicy]
OP_KIND_UNSPECIFIED: OpKind
OP_KIND_ALLOCATE: OpKind
OP_KIND_APPEND: OpKind
OP_KIND_FREE: OpKind
OP_KIND_FORK: OpKind
OP_KIND_COMMIT: OpKind
OP_STATUS_UNSPECIFIED: OpStatus
OP_STATUS_OK: OpStatus
OP_STATUS_NO_SPACE: OpStatus
OP_STATUS_INVALID_ARGUMENT: OpStatus
OP_STATUS_NOT_FOUND: OpStatus
OP_STATUS_ALREADY_EXISTS: OpStatus
OP_STATUS_STALE: OpStatus
ROUTING_POLICY_UNSPECIFIED: RoutingPolicy
ROUTING_POLICY_PREFIX: RoutingPolicy
ROUTING_POLICY_LEAST_LOADED: RoutingPolicy
ROUTING_POLICY_ROUND_ROBIN: RoutingPolicy

class OpenSessionRequest(_message.Message):
    __slots__ = ("client_name", "lease_ttl_ms")
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    client_name: str
    lease_ttl_ms: int
    def __init__(self, client_name: _Optional[str] = ..., lease_ttl_ms: _Optional[int] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("session_id", "lease_ttl_ms")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    lease_ttl_ms: int
    def __init__(self, session_id: _Optional[str] = ..., lease_ttl_ms: _Optional[int] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class KeepAliveResponse(_message.Message):
    __slots__ = ("lease_ttl_ms",)
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    lease_ttl_ms: int
    def __init__(self, lease_ttl_ms: _Optional[int] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ("num_freed_sequences",)
    NUM_FREED_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    num_freed_sequences: int
    def __init__(self, num_freed_sequences: _Optional[int] = ...) -> None: ...

class CreatePoolRequest(_message.Message):
    __slots__ = ("pool_id", "num_blocks", "block_size", "epoch")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    num_blocks: int
    block_size: int
    epoch: int
    def __init__(self, pool_id: _Optional[str] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class GetPoolRequest(_message.Message):
    __slots__ = ("pool_id",)
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    def __init__(self, pool_id: _Optional[str] = ...) -> None: ...

class CreatePoolResponse(_message.Message):
    __slots__ = ("pool",)
    POOL_FIELD_NUMBER: _ClassVar[int]
    pool: Pool
    def __init__(self, pool: _Optional[_Union[Pool, _Mapping]] = ...) -> None: ...

class GetPoolResponse(_message.Message):
    __slots__ = ("pool",)
    POOL_FIELD_NUMBER: _ClassVar[int]
    pool: Pool
    def __init__(self, pool: _Optional[_Union[Pool, _Mapping]] = ...) -> None: ...

class Pool(_message.Message):
    __slots__ = ("pool_id", "num_blocks", "block_size", "epoch", "address")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    num_blocks: int
    block_size: int
    epoch: int
    address: str
    def __init__(self, pool_id: _Optional[str] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., epoch: _Optional[int] = ..., address: _Optional[str] = ...) -> None: ...

class AllocateRequest(_message.Message):
    __slots__ = ("session_id", "pool_id", "seq_id", "token_ids", "cache_salt")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    pool_id: str
    seq_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    def __init__(self, session_id: _Optional[str] = ..., pool_id: _Optional[str] = ..., seq_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class AllocateResponse(_message.Message):
    __slots__ = ("allocated", "block_table", "num_cached_tokens", "slot_mapping")
    ALLOCATED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SLOT_MAPPING_FIELD_NUMBER: _ClassVar[int]
    allocated: bool
    block_table: _containers.RepeatedScalarFieldContainer[int]
    num_cached_tokens: int
    slot_mapping: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, allocated: _Optional[bool] = ..., block_table: _Optional[_Iterable[int]] = ..., num_cached_tokens: _Optional[int] = ..., slot_mapping: _Optional[_Iterable[int]] = ...) -> None: ...

class AppendRequest(_message.Message):
    __slots__ = ("session_id", "pool_id", "seq_id", "token_ids", "num_computed_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    pool_id: str
    seq_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    def __init__(self, session_id: _Optional[str] = ..., pool_id: _Optional[str] = ..., seq_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ...) -> None: ...

class AppendResponse(_message.Message):
    __slots__ = ("allocated", "block_table", "slot_mapping", "copies")
    ALLOCATED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    SLOT_MAPPING_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    allocated: bool
    block_table: _containers.RepeatedScalarFieldContainer[int]
    slot_mapping: _containers.RepeatedScalarFieldContainer[int]
    copies: _containers.RepeatedCompositeFieldContainer[BlockCopy]
    def __init__(self, allocated: _Optional[bool] = ..., block_table: _Optional[_Iterable[int]] = ..., slot_mapping: _Optional[_Iterable[int]] = ..., copies: _Optional[_Iterable[_Union[BlockCopy, _Mapping]]] = ...) -> None: ...

class BlockCopy(_message.Message):
    __slots__ = ("src_block_id", "dst_block_id")
    SRC_BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    src_block_id: int
    dst_block_id: int
    def __init__(self, src_block_id: _Optional[int] = ..., dst_block_id: _Optional[int] = ...) -> None: ...

class FreeRequest(_message.Message):
    __slots__ = ("session_id", "pool_id", "seq_id", "num_computed_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    pool_id: str
    seq_id: int
    num_computed_tokens: int
    def __init__(self, session_id: _Optional[str] = ..., pool_id: _Optional[str] = ..., seq_id: _Optional[int] = ..., num_computed_tokens: _Optional[int] = ...) -> None: ...

class FreeResponse(_message.Message):
    __slots__ = ("num_released_blocks",)
    NUM_RELEASED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_released_blocks: int
    def __init__(self, num_released_blocks: _Optional[int] = ...) -> None: ...

class ForkRequest(_message.Message):
    __slots__ = ("session_id", "pool_id", "parent_seq_id", "child_seq_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    CHILD_SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    pool_id: str
    parent_seq_id: int
    child_seq_id: int
    def __init__(self, session_id: _Optional[str] = ..., pool_id: _Optional[str] = ..., parent_seq_id: _Optional[int] = ..., child_seq_id: _Optional[int] = ...) -> None: ...

class ForkResponse(_message.Message):
    __slots__ = ("block_table",)
    BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    block_table: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_table: _Optional[_Iterable[int]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("session_id", "pool_id", "step_id", "epoch", "op_kinds", "seq_ids", "token_counts", "token_ids", "parent_seq_ids", "num_computed_tokens", "cache_salts", "num_lookahead_slots", "num_waiting_tokens")
    class CacheSaltsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: str
        def __init__(self, key: _Optional[int] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    OP_KINDS_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARENT_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALTS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOOKAHEAD_SLOTS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    pool_id: str
    step_id: int
    epoch: int
    op_kinds: _containers.RepeatedScalarFieldContainer[OpKind]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    token_counts: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    parent_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: _containers.RepeatedScalarFieldContainer[int]
    cache_salts: _containers.ScalarMap[int, str]
    num_lookahead_slots: _containers.RepeatedScalarFieldContainer[int]
    num_waiting_tokens: int
    def __init__(self, session_id: _Optional[str] = ..., pool_id: _Optional[str] = ..., step_id: _Optional[int] = ..., epoch: _Optional[int] = ..., op_kinds: _Optional[_Iterable[_Union[OpKind, str]]] = ..., seq_ids: _Optional[_Iterable[int]] = ..., token_counts: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., parent_seq_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[_Iterable[int]] = ..., cache_salts: _Optional[_Mapping[int, str]] = ..., num_lookahead_slots: _Optional[_Iterable[int]] = ..., num_waiting_tokens: _Optional[int] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("step_id", "op_statuses", "num_cached_tokens", "table_starts", "table_counts", "table_block_ids", "slot_counts", "slot_mapping", "copies", "errors", "epoch")
    class ErrorsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: str
        def __init__(self, key: _Optional[int] = ..., value: _Optional[str] = ...) -> None: ...
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    OP_STATUSES_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TABLE_STARTS_FIELD_NUMBER: _ClassVar[int]
    TABLE_COUNTS_FIELD_NUMBER: _ClassVar[int]
    TABLE_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SLOT_COUNTS_FIELD_NUMBER: _ClassVar[int]
    SLOT_MAPPING_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    op_statuses: _containers.RepeatedScalarFieldContainer[OpStatus]
    num_cached_tokens: _containers.RepeatedScalarFieldContainer[int]
    table_starts: _containers.RepeatedScalarFieldContainer[int]
    table_counts: _containers.RepeatedScalarFieldContainer[int]
    table_block_ids: _containers.RepeatedScalarFieldContainer[int]
    slot_counts: _containers.RepeatedScalarFieldContainer[int]
    slot_mapping: _containers.RepeatedScalarFieldContainer[int]
    copies: _containers.RepeatedCompositeFieldContainer[BlockCopy]
    errors: _containers.ScalarMap[int, str]
    epoch: int
    def __init__(self, step_id: _Optional[int] = ..., op_statuses: _Optional[_Iterable[_Union[OpStatus, str]]] = ..., num_cached_tokens: _Optional[_Iterable[int]] = ..., table_starts: _Optional[_Iterable[int]] = ..., table_counts: _Optional[_Iterable[int]] = ..., table_block_ids: _Optional[_Iterable[int]] = ..., slot_counts: _Optional[_Iterable[int]] = ..., slot_mapping: _Optional[_Iterable[int]] = ..., copies: _Optional[_Iterable[_Union[BlockCopy, _Mapping]]] = ..., errors: _Optional[_Mapping[int, str]] = ..., epoch: _Optional[int] = ...) -> None: ...

class MatchPrefixRequest(_message.Message):
    __slots__ = ("pool_id", "token_ids", "cache_salt")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    def __init__(self, pool_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class MatchPrefixResponse(_message.Message):
    __slots__ = ("num_cached_tokens",)
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_cached_tokens: int
    def __init__(self, num_cached_tokens: _Optional[int] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ("pool_id",)
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    def __init__(self, pool_id: _Optional[str] = ...) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("stats",)
    STATS_FIELD_NUMBER: _ClassVar[int]
    stats: Stats
    def __init__(self, stats: _Optional[_Union[Stats, _Mapping]] = ...) -> None: ...

class Stats(_message.Message):
    __slots__ = ("pool_id", "epoch", "total_blocks", "free_blocks", "used_blocks", "cached_evictable_blocks", "num_sequences", "num_sessions", "prompt_tokens", "cached_prompt_tokens", "evictions", "copies", "no_space", "total_refs", "appended_tokens")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_EVICTABLE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    NUM_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    NO_SPACE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_REFS_FIELD_NUMBER: _ClassVar[int]
    APPENDED_TOKENS_FIELD_NUMBER: _ClassVar[int]
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
    def __init__(self, pool_id: _Optional[str] = ..., epoch: _Optional[int] = ..., total_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., used_blocks: _Optional[int] = ..., cached_evictable_blocks: _Optional[int] = ..., num_sequences: _Optional[int] = ..., num_sessions: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., evictions: _Optional[int] = ..., copies: _Optional[int] = ..., no_space: _Optional[int] = ..., total_refs: _Optional[int] = ..., appended_tokens: _Optional[int] = ...) -> None: ...

class RegisterRunnerRequest(_message.Message):
    __slots__ = ("pool_id", "address", "num_blocks", "block_size", "epoch", "lease_ttl_ms")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    address: str
    num_blocks: int
    block_size: int
    epoch: int
    lease_ttl_ms: int
    def __init__(self, pool_id: _Optional[str] = ..., address: _Optional[str] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., epoch: _Optional[int] = ..., lease_ttl_ms: _Optional[int] = ...) -> None: ...

class RegisterRunnerResponse(_message.Message):
    __slots__ = ("pool", "lease_ttl_ms")
    POOL_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    pool: Pool
    lease_ttl_ms: int
    def __init__(self, pool: _Optional[_Union[Pool, _Mapping]] = ..., lease_ttl_ms: _Optional[int] = ...) -> None: ...

class UnregisterRunnerRequest(_message.Message):
    __slots__ = ("pool_id", "epoch")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    epoch: int
    def __init__(self, pool_id: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class UnregisterRunnerResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListRunnersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListRunnersResponse(_message.Message):
    __slots__ = ("runners",)
    RUNNERS_FIELD_NUMBER: _ClassVar[int]
    runners: _containers.RepeatedCompositeFieldContainer[RunnerLoad]
    def __init__(self, runners: _Optional[_Iterable[_Union[RunnerLoad, _Mapping]]] = ...) -> None: ...

class RunnerLoad(_message.Message):
    __slots__ = ("pool", "free_blocks", "num_sequences", "queued_tokens", "load_tokens")
    POOL_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    pool: Pool
    free_blocks: int
    num_sequences: int
    queued_tokens: int
    load_tokens: int
    def __init__(self, pool: _Optional[_Union[Pool, _Mapping]] = ..., free_blocks: _Optional[int] = ..., num_sequences: _Optional[int] = ..., queued_tokens: _Optional[int] = ..., load_tokens: _Optional[int] = ...) -> None: ...

class RouteRequest(_message.Message):
    __slots__ = ("client_name", "token_ids", "cache_salt", "policy", "num_seqs", "pool_ids")
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    POOL_IDS_FIELD_NUMBER: _ClassVar[int]
    client_name: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    policy: RoutingPolicy
    num_seqs: int
    pool_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, client_name: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ..., policy: _Optional[_Union[RoutingPolicy, str]] = ..., num_seqs: _Optional[int] = ..., pool_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class RouteResponse(_message.Message):
    __slots__ = ("pool_id", "candidates")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    candidates: _containers.RepeatedCompositeFieldContainer[RouteCandidate]
    def __init__(self, pool_id: _Optional[str] = ..., candidates: _Optional[_Iterable[_Union[RouteCandidate, _Mapping]]] = ...) -> None: ...

class RouteCandidate(_message.Message):
    __slots__ = ("pool_id", "num_cached_tokens", "load_tokens", "cost", "num_pending_tokens")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    NUM_PENDING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    num_cached_tokens: int
    load_tokens: int
    cost: int
    num_pending_tokens: int
    def __init__(self, pool_id: _Optional[str] = ..., num_cached_tokens: _Optional[int] = ..., load_tokens: _Optional[int] = ..., cost: _Optional[int] = ..., num_pending_tokens: _Optional[int] = ...) -> None: ...

class SubscribeKvEventsRequest(_message.Message):
    __slots__ = ("pool_id", "after_sequence", "instance_id")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    after_sequence: int
    instance_id: str
    def __init__(self, pool_id: _Optional[str] = ..., after_sequence: _Optional[int] = ..., instance_id: _Optional[str] = ...) -> None: ...

class KvEventBatch(_message.Message):
    __slots__ = ("sequence", "pool_id", "epoch", "instance_id", "snapshot", "events", "timestamp_ms")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    pool_id: str
    epoch: int
    instance_id: str
    snapshot: bool
    events: _containers.RepeatedCompositeFieldContainer[KvEvent]
    timestamp_ms: int
    def __init__(self, sequence: _Optional[int] = ..., pool_id: _Optional[str] = ..., epoch: _Optional[int] = ..., instance_id: _Optional[str] = ..., snapshot: _Optional[bool] = ..., events: _Optional[_Iterable[_Union[KvEvent, _Mapping]]] = ..., timestamp_ms: _Optional[int] = ...) -> None: ...

class KvEvent(_message.Message):
    __slots__ = ("stored", "removed", "cleared")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    stored: BlockStored
    removed: BlockRemoved
    cleared: AllBlocksCleared
    def __init__(self, stored: _Optional[_Union[BlockStored, _Mapping]] = ..., removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ...) -> None: ...

class BlockStored(_message.Message):
    __slots__ = ("block_hashes", "parent_block_hash", "token_ids", "block_size")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    parent_block_hash: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., parent_block_hash: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
