from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LoadAdapterRequest(_message.Message):
    __slots__ = ("name", "path", "holder")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    holder: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., holder: _Optional[str] = ...) -> None: ...

class AdapterInfo(_message.Message):
    __slots__ = ("name", "path", "rank", "target_modules", "digest")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    rank: int
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    digest: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., rank: _Optional[int] = ..., target_modules: _Optional[_Iterable[str]] = ..., digest: _Optional[str] = ...) -> None: ...

class LoadAdapterResponse(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: AdapterInfo
    def __init__(self, adapter: _Optional[_Union[AdapterInfo, _Mapping]] = ...) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("name", "holder")
    NAME_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    name: str
    holder: str
    def __init__(self, name: _Optional[str] = ..., holder: _Optional[str] = ...) -> None: ...

class UnloadAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListAdaptersResponse(_message.Message):
    __slots__ = ("adapters", "max_loras", "max_lora_rank")
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterInfo]
    max_loras: int
    max_lora_rank: int
    def __init__(self, adapters: _Optional[_Iterable[_Union[AdapterInfo, _Mapping]]] = ..., max_loras: _Optional[int] = ..., max_lora_rank: _Optional[int] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("model", "architecture", "vocab_size", "eos_token_ids", "max_model_len", "num_blocks", "block_size", "dtype", "device", "epoch", "attention_backend", "tensor_parallel_size", "max_loras", "max_lora_rank")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    model: str
    architecture: str
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_model_len: int
    num_blocks: int
    block_size: int
    dtype: str
    device: str
    epoch: int
    attention_backend: str
    tensor_parallel_size: int
    max_loras: int
    max_lora_rank: int
    def __init__(self, model: _Optional[str] = ..., architecture: _Optional[str] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_model_len: _Optional[int] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., epoch: _Optional[int] = ..., attention_backend: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ..., max_loras: _Optional[int] = ..., max_lora_rank: _Optional[int] = ...) -> None: ...

class ExecuteRequest(_message.Message):
    __slots__ = ("epoch", "client_id", "step_id", "copy_src_block_ids", "copy_dst_block_ids", "num_new_tokens", "start_positions", "token_ids", "slot_mapping", "block_table_lens", "block_tables", "do_sample", "temperatures", "top_ps", "top_ks", "min_ps", "seeds", "num_logprobs", "after_step_id", "pending_token_indices", "pending_sample_rows", "presence_penalties", "frequency_penalties", "repetition_penalties", "prompt_lens", "penalty_history_lens", "penalty_token_ids", "logit_bias_counts", "logit_bias_token_ids", "logit_bias_values", "mask_seq_indices", "masks", "masks_follow", "adapters")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    COPY_SRC_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    COPY_DST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    START_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SLOT_MAPPING_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_LENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLES_FIELD_NUMBER: _ClassVar[int]
    DO_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURES_FIELD_NUMBER: _ClassVar[int]
    TOP_PS_FIELD_NUMBER: _ClassVar[int]
    TOP_KS_FIELD_NUMBER: _ClassVar[int]
    MIN_PS_FIELD_NUMBER: _ClassVar[int]
    SEEDS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    AFTER_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    PENDING_TOKEN_INDICES_FIELD_NUMBER: _ClassVar[int]
    PENDING_SAMPLE_ROWS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTIES_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTIES_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTIES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LENS_FIELD_NUMBER: _ClassVar[int]
    PENALTY_HISTORY_LENS_FIELD_NUMBER: _ClassVar[int]
    PENALTY_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_COUNTS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_VALUES_FIELD_NUMBER: _ClassVar[int]
    MASK_SEQ_INDICES_FIELD_NUMBER: _ClassVar[int]
    MASKS_FIELD_NUMBER: _ClassVar[int]
    MASKS_FOLLOW_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    client_id: str
    step_id: int
    copy_src_block_ids: _containers.RepeatedScalarFieldContainer[int]
    copy_dst_block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_new_tokens: _containers.RepeatedScalarFieldContainer[int]
    start_positions: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    slot_mapping: _containers.RepeatedScalarFieldContainer[int]
    block_table_lens: _containers.RepeatedScalarFieldContainer[int]
    block_tables: _containers.RepeatedScalarFieldContainer[int]
    do_sample: _containers.RepeatedScalarFieldContainer[bool]
    temperatures: _containers.RepeatedScalarFieldContainer[float]
    top_ps: _containers.RepeatedScalarFieldContainer[float]
    top_ks: _containers.RepeatedScalarFieldContainer[int]
    min_ps: _containers.RepeatedScalarFieldContainer[float]
    seeds: _containers.RepeatedScalarFieldContainer[int]
    num_logprobs: _containers.RepeatedScalarFieldContainer[int]
    after_step_id: int
    pending_token_indices: _containers.RepeatedScalarFieldContainer[int]
    pending_sample_rows: _containers.RepeatedScalarFieldContainer[int]
    presence_penalties: _containers.RepeatedScalarFieldContainer[float]
    frequency_penalties: _containers.RepeatedScalarFieldContainer[float]
    repetition_penalties: _containers.RepeatedScalarFieldContainer[float]
    prompt_lens: _containers.RepeatedScalarFieldContainer[int]
    penalty_history_lens: _containers.RepeatedScalarFieldContainer[int]
    penalty_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logit_bias_counts: _containers.RepeatedScalarFieldContainer[int]
    logit_bias_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logit_bias_values: _containers.RepeatedScalarFieldContainer[float]
    mask_seq_indices: _containers.RepeatedScalarFieldContainer[int]
    masks: bytes
    masks_follow: bool
    adapters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, epoch: _Optional[int] = ..., client_id: _Optional[str] = ..., step_id: _Optional[int] = ..., copy_src_block_ids: _Optional[_Iterable[int]] = ..., copy_dst_block_ids: _Optional[_Iterable[int]] = ..., num_new_tokens: _Optional[_Iterable[int]] = ..., start_positions: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., slot_mapping: _Optional[_Iterable[int]] = ..., block_table_lens: _Optional[_Iterable[int]] = ..., block_tables: _Optional[_Iterable[int]] = ..., do_sample: _Optional[_Iterable[bool]] = ..., temperatures: _Optional[_Iterable[float]] = ..., top_ps: _Optional[_Iterable[float]] = ..., top_ks: _Optional[_Iterable[int]] = ..., min_ps: _Optional[_Iterable[float]] = ..., seeds: _Optional[_Iterable[int]] = ..., num_logprobs: _Optional[_Iterable[int]] = ..., after_step_id: _Optional[int] = ..., pending_token_indices: _Optional[_Iterable[int]] = ..., pending_sample_rows: _Optional[_Iterable[int]] = ..., presence_penalties: _Optional[_Iterable[float]] = ..., frequency_penalties: _Optional[_Iterable[float]] = ..., repetition_penalties: _Optional[_Iterable[float]] = ..., prompt_lens: _Optional[_Iterable[int]] = ..., penalty_history_lens: _Optional[_Iterable[int]] = ..., penalty_token_ids: _Optional[_Iterable[int]] = ..., logit_bias_counts: _Optional[_Iterable[int]] = ..., logit_bias_token_ids: _Optional[_Iterable[int]] = ..., logit_bias_values: _Optional[_Iterable[float]] = ..., mask_seq_indices: _Optional[_Iterable[int]] = ..., masks: _Optional[bytes] = ..., masks_follow: _Optional[bool] = ..., adapters: _Optional[_Iterable[str]] = ...) -> None: ...

class SupplyMasksRequest(_message.Message):
    __slots__ = ("client_id", "step_id", "masks")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    MASKS_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    step_id: int
    masks: bytes
    def __init__(self, client_id: _Optional[str] = ..., step_id: _Optional[int] = ..., masks: _Optional[bytes] = ...) -> None: ...

class SupplyMasksResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExecuteResponse(_message.Message):
    __slots__ = ("token_ids", "logprobs", "top_counts", "top_token_ids", "top_logprobs", "epoch", "forward_ms", "sample_ms", "total_ms")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_COUNTS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_counts: _containers.RepeatedScalarFieldContainer[int]
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    epoch: int
    forward_ms: float
    sample_ms: float
    total_ms: float
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_counts: _Optional[_Iterable[int]] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., epoch: _Optional[int] = ..., forward_ms: _Optional[float] = ..., sample_ms: _Optional[float] = ..., total_ms: _Optional[float] = ...) -> None: ...
