from pagefleet.protos import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PreemptMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PREEMPT_MODE_UNSPECIFIED: _ClassVar[PreemptMode]
    PREEMPT_MODE_AUTO: _ClassVar[PreemptMode]
    PREEMPT_MODE_SWAP: _ClassVar[PreemptMode]
    PREEMPT_MODE_RECOMPUTE: _ClassVar[PreemptMode]

class PreemptOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PREEMPT_OUTCOME_UNSPECIFIED: _ClassVar[PreemptOutcome]
    PREEMPT_OUTCOME_KEPT: _ClassVar[PreemptOutcome]
    PREEMPT_OUTCOME_NOT_FOUND: _ClassVar[PreemptOutcome]
    PREEMPT_OUTCOME_REFUSED: _ClassVar[PreemptOutcome]

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_ROLE_UNSPECIFIED: _ClassVar[WorkerRole]
    WORKER_ROLE_BOTH: _ClassVar[WorkerRole]
    WORKER_ROLE_PREFILL: _ClassVar[WorkerRole]
    WORKER_ROLE_DECODE: _ClassVar[WorkerRole]

class MigrateReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MIGRATE_REASON_UNSPECIFIED: _ClassVar[MigrateReason]
    MIGRATE_REASON_BALANCE: _ClassVar[MigrateReason]
    MIGRATE_REASON_PREEMPTION: _ClassVar[MigrateReason]
    MIGRATE_REASON_DISAGGREGATION: _ClassVar[MigrateReason]
    MIGRATE_REASON_DRAIN: _ClassVar[MigrateReason]

class MigrateOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MIGRATE_OUTCOME_UNSPECIFIED: _ClassVar[MigrateOutcome]
    MIGRATE_OUTCOME_MIGRATED: _ClassVar[MigrateOutcome]
    MIGRATE_OUTCOME_GAVE_UP: _ClassVar[MigrateOutcome]
    MIGRATE_OUTCOME_FAILED: _ClassVar[MigrateOutcome]
    MIGRATE_OUTCOME_EXPIRED: _ClassVar[MigrateOutcome]
    MIGRATE_OUTCOME_REFUSED: _ClassVar[MigrateOutcome]
    MIGRATE_OUTCOME_NOT_FOUND: _ClassVar[MigrateOutcome]

class KvTransferState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_TRANSFER_STATE_UNSPECIFIED: _ClassVar[KvTransferState]
    KV_TRANSFER_STATE_IN_PROGRESS: _ClassVar[KvTransferState]
    KV_TRANSFER_STATE_DONE: _ClassVar[KvTransferState]
    KV_TRANSFER_STATE_FAILED: _ClassVar[KvTransferState]
PREEMPT_MODE_UNSPECIFIED: PreemptMode
PREEMPT_MODE_AUTO: PreemptMode
PREEMPT_MODE_SWAP: PreemptMode
PREEMPT_MODE_RECOMPUTE: PreemptMode
PREEMPT_OUTCOME_UNSPECIFIED: PreemptOutcome
PREEMPT_OUTCOME_KEPT: PreemptOutcome
PREEMPT_OUTCOME_NOT_FOUND: PreemptOutcome
PREEMPT_OUTCOME_REFUSED: PreemptOutcome
WORKER_ROLE_UNSPECIFIED: WorkerRole
WORKER_ROLE_BOTH: WorkerRole
WORKER_ROLE_PREFILL: WorkerRole
WORKER_ROLE_DECODE: WorkerRole
MIGRATE_REASON_UNSPECIFIED: MigrateReason
MIGRATE_REASON_BALANCE: MigrateReason
MIGRATE_REASON_PREEMPTION: MigrateReason
MIGRATE_REASON_DISAGGREGATION: MigrateReason
MIGRATE_REASON_DRAIN: MigrateReason
MIGRATE_OUTCOME_UNSPECIFIED: MigrateOutcome
MIGRATE_OUTCOME_MIGRATED: MigrateOutcome
MIGRATE_OUTCOME_GAVE_UP: MigrateOutcome
MIGRATE_OUTCOME_FAILED: MigrateOutcome
MIGRATE_OUTCOME_EXPIRED: MigrateOutcome
MIGRATE_OUTCOME_REFUSED: MigrateOutcome
MIGRATE_OUTCOME_NOT_FOUND: MigrateOutcome
KV_TRANSFER_STATE_UNSPECIFIED: KvTransferState
KV_TRANSFER_STATE_IN_PROGRESS: KvTransferState
KV_TRANSFER_STATE_DONE: KvTransferState
KV_TRANSFER_STATE_FAILED: KvTransferState

class AssignRequest(_message.Message):
    __slots__ = ("request_id", "entry_id", "prompt_token_ids", "output_token_ids", "sampling", "priority", "traceparent", "deadline_unix_ms", "block_hashes", "hash_block_size", "epoch", "scheduler_epoch", "reply_to", "model", "gateway_chosen_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ENTRY_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    HASH_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    REPLY_TO_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_CHOSEN_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    entry_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generation_pb2.SamplingParams
    priority: int
    traceparent: str
    deadline_unix_ms: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    hash_block_size: int
    epoch: int
    scheduler_epoch: int
    reply_to: str
    model: str
    gateway_chosen_id: bool
    def __init__(self, request_id: _Optional[str] = ..., entry_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., traceparent: _Optional[str] = ..., deadline_unix_ms: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., hash_block_size: _Optional[int] = ..., epoch: _Optional[int] = ..., scheduler_epoch: _Optional[int] = ..., reply_to: _Optional[str] = ..., model: _Optional[str] = ..., gateway_chosen_id: _Optional[bool] = ...) -> None: ...

class AssignResponse(_message.Message):
    __slots__ = ("accepted", "stale_scheduler")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    STALE_SCHEDULER_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    stale_scheduler: bool
    def __init__(self, accepted: _Optional[bool] = ..., stale_scheduler: _Optional[bool] = ...) -> None: ...

class AssignBatchRequest(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[AssignRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[AssignRequest, _Mapping]]] = ...) -> None: ...

class AssignBatchResponse(_message.Message):
    __slots__ = ("responses",)
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    responses: _containers.RepeatedCompositeFieldContainer[AssignResponse]
    def __init__(self, responses: _Optional[_Iterable[_Union[AssignResponse, _Mapping]]] = ...) -> None: ...

class WorkerCancelRequest(_message.Message):
    __slots__ = ("request_id", "notify_client", "want_record")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NOTIFY_CLIENT_FIELD_NUMBER: _ClassVar[int]
    WANT_RECORD_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    notify_client: bool
    want_record: bool
    def __init__(self, request_id: _Optional[str] = ..., notify_client: _Optional[bool] = ..., want_record: _Optional[bool] = ...) -> None: ...

class WorkerCancelResponse(_message.Message):
    __slots__ = ("found", "record")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    RECORD_FIELD_NUMBER: _ClassVar[int]
    found: bool
    record: bytes
    def __init__(self, found: _Optional[bool] = ..., record: _Optional[bytes] = ...) -> None: ...

class PreemptRequest(_message.Message):
    __slots__ = ("request_id", "mode")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    mode: PreemptMode
    def __init__(self, request_id: _Optional[str] = ..., mode: _Optional[_Union[PreemptMode, str]] = ...) -> None: ...

class PreemptResponse(_message.Message):
    __slots__ = ("outcome", "num_freed_blocks")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    NUM_FREED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    outcome: PreemptOutcome
    num_freed_blocks: int
    def __init__(self, outcome: _Optional[_Union[PreemptOutcome, str]] = ..., num_freed_blocks: _Optional[int] = ...) -> None: ...

class OccupancyRequest(_message.Message):
    __slots__ = ("interval_s", "deltas")
    INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    interval_s: float
    deltas: bool
    def __init__(self, interval_s: _Optional[float] = ..., deltas: _Optional[bool] = ...) -> None: ...

class OccupancyReport(_message.Message):
    __slots__ = ("worker_id", "seq", "num_blocks", "num_free_blocks", "block_size", "num_swap_blocks", "num_free_swap_blocks", "num_swapped_blocks", "num_running", "num_waiting", "num_swapped", "blocks_per_request", "request_ids", "finished_request_ids", "max_num_seqs", "max_model_len", "draining", "num_preemptions", "stored_block_hashes", "evicted_block_hashes", "block_hashes_reset", "prefix_cache_queries_total", "prefix_cache_hits_total", "holdings_delta", "released_request_ids", "role", "drain_by_migration", "prefilled_request_ids", "kv_layout")
    class BlocksPerRequestEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_SWAP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAPPED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAPPED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    STORED_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    EVICTED_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_RESET_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    HOLDINGS_DELTA_FIELD_NUMBER: _ClassVar[int]
    RELEASED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DRAIN_BY_MIGRATION_FIELD_NUMBER: _ClassVar[int]
    PREFILLED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    seq: int
    num_blocks: int
    num_free_blocks: int
    block_size: int
    num_swap_blocks: int
    num_free_swap_blocks: int
    num_swapped_blocks: int
    num_running: int
    num_waiting: int
    num_swapped: int
    blocks_per_request: _containers.ScalarMap[str, int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    finished_request_ids: _containers.RepeatedScalarFieldContainer[str]
    max_num_seqs: int
    max_model_len: int
    draining: bool
    num_preemptions: int
    stored_block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    evicted_block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    block_hashes_reset: bool
    prefix_cache_queries_total: int
    prefix_cache_hits_total: int
    holdings_delta: bool
    released_request_ids: _containers.RepeatedScalarFieldContainer[str]
    role: WorkerRole
    drain_by_migration: bool
    prefilled_request_ids: _containers.RepeatedScalarFieldContainer[str]
    kv_layout: str
    def __init__(self, worker_id: _Optional[str] = ..., seq: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., num_swap_blocks: _Optional[int] = ..., num_free_swap_blocks: _Optional[int] = ..., num_swapped_blocks: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_swapped: _Optional[int] = ..., blocks_per_request: _Optional[_Mapping[str, int]] = ..., request_ids: _Optional[_Iterable[str]] = ..., finished_request_ids: _Optional[_Iterable[str]] = ..., max_num_seqs: _Optional[int] = ..., max_model_len: _Optional[int] = ..., draining: _Optional[bool] = ..., num_preemptions: _Optional[int] = ..., stored_block_hashes: _Optional[_Iterable[bytes]] = ..., evicted_block_hashes: _Optional[_Iterable[bytes]] = ..., block_hashes_reset: _Optional[bool] = ..., prefix_cache_queries_total: _Optional[int] = ..., prefix_cache_hits_total: _Optional[int] = ..., holdings_delta: _Optional[bool] = ..., released_request_ids: _Optional[_Iterable[str]] = ..., role: _Optional[_Union[WorkerRole, str]] = ..., drain_by_migration: _Optional[bool] = ..., prefilled_request_ids: _Optional[_Iterable[str]] = ..., kv_layout: _Optional[str] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("timeout_s",)
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    timeout_s: float
    def __init__(self, timeout_s: _Optional[float] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("num_requests",)
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    num_requests: int
    def __init__(self, num_requests: _Optional[int] = ...) -> None: ...

class KvLayout(_message.Message):
    __slots__ = ("model", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim", "layout")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    model: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layout: str
    def __init__(self, model: _Optional[str] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., layout: _Optional[str] = ...) -> None: ...

class KvPoolInfo(_message.Message):
    __slots__ = ("worker_id", "agent_name", "agent_metadata", "base_addr", "num_blocks", "layout", "hostname", "pid", "path")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    BASE_ADDR_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    agent_name: str
    agent_metadata: bytes
    base_addr: int
    num_blocks: int
    layout: KvLayout
    hostname: str
    pid: int
    path: str
    def __init__(self, worker_id: _Optional[str] = ..., agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., base_addr: _Optional[int] = ..., num_blocks: _Optional[int] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ..., hostname: _Optional[str] = ..., pid: _Optional[int] = ..., path: _Optional[str] = ...) -> None: ...

class MigrateRequest(_message.Message):
    __slots__ = ("request_id", "target_worker_id", "target_address", "reason", "deadline_s", "lease_s", "final_stage_blocks", "max_stages")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    FINAL_STAGE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_STAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    target_worker_id: str
    target_address: str
    reason: MigrateReason
    deadline_s: float
    lease_s: float
    final_stage_blocks: int
    max_stages: int
    def __init__(self, request_id: _Optional[str] = ..., target_worker_id: _Optional[str] = ..., target_address: _Optional[str] = ..., reason: _Optional[_Union[MigrateReason, str]] = ..., deadline_s: _Optional[float] = ..., lease_s: _Optional[float] = ..., final_stage_blocks: _Optional[int] = ..., max_stages: _Optional[int] = ...) -> None: ...

class MigrateResponse(_message.Message):
    __slots__ = ("outcome", "num_stages", "num_blocks_read", "num_bytes", "downtime_ms", "epoch", "error")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    NUM_STAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_READ_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    DOWNTIME_MS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    outcome: MigrateOutcome
    num_stages: int
    num_blocks_read: int
    num_bytes: int
    downtime_ms: float
    epoch: int
    error: str
    def __init__(self, outcome: _Optional[_Union[MigrateOutcome, str]] = ..., num_stages: _Optional[int] = ..., num_blocks_read: _Optional[int] = ..., num_bytes: _Optional[int] = ..., downtime_ms: _Optional[float] = ..., epoch: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class MigrateBeginRequest(_message.Message):
    __slots__ = ("request_id", "source_worker_id", "prompt_token_ids", "deadline_s", "lease_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    source_worker_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    deadline_s: float
    lease_s: float
    def __init__(self, request_id: _Optional[str] = ..., source_worker_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., deadline_s: _Optional[float] = ..., lease_s: _Optional[float] = ...) -> None: ...

class MigrateBeginResponse(_message.Message):
    __slots__ = ("accepted", "error")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    error: str
    def __init__(self, accepted: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class MigrateReadRequest(_message.Message):
    __slots__ = ("request_id", "first_block", "block_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_block: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., first_block: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class MigrateReadResponse(_message.Message):
    __slots__ = ("accepted", "num_blocks_read")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_READ_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    num_blocks_read: int
    def __init__(self, accepted: _Optional[bool] = ..., num_blocks_read: _Optional[int] = ...) -> None: ...

class MigratePollRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class MigratePollResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: KvTransferState
    def __init__(self, state: _Optional[_Union[KvTransferState, str]] = ...) -> None: ...

class MigrateCommitRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "output_token_ids", "sampling", "priority", "num_computed_tokens", "final_block_ids", "final_checksums", "epoch", "source_worker_id", "entry_id", "reply_to", "record", "traceparent")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINAL_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    FINAL_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SOURCE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ENTRY_ID_FIELD_NUMBER: _ClassVar[int]
    REPLY_TO_FIELD_NUMBER: _ClassVar[int]
    RECORD_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generation_pb2.SamplingParams
    priority: int
    num_computed_tokens: int
    final_block_ids: _containers.RepeatedScalarFieldContainer[int]
    final_checksums: _containers.RepeatedScalarFieldContainer[int]
    epoch: int
    source_worker_id: str
    entry_id: str
    reply_to: str
    record: bytes
    traceparent: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., num_computed_tokens: _Optional[int] = ..., final_block_ids: _Optional[_Iterable[int]] = ..., final_checksums: _Optional[_Iterable[int]] = ..., epoch: _Optional[int] = ..., source_worker_id: _Optional[str] = ..., entry_id: _Optional[str] = ..., reply_to: _Optional[str] = ..., record: _Optional[bytes] = ..., traceparent: _Optional[str] = ...) -> None: ...

class MigrateCommitResponse(_message.Message):
    __slots__ = ("committed", "epoch", "error")
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    committed: bool
    epoch: int
    error: str
    def __init__(self, committed: _Optional[bool] = ..., epoch: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class MigrateAbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class MigrateAbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class GetStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerState(_message.Message):
    __slots__ = ("worker_id", "address", "report", "num_owed_blocks", "request_ids", "num_assigned")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    NUM_OWED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_ASSIGNED_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    report: OccupancyReport
    num_owed_blocks: int
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    num_assigned: int
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., report: _Optional[_Union[OccupancyReport, _Mapping]] = ..., num_owed_blocks: _Optional[int] = ..., request_ids: _Optional[_Iterable[str]] = ..., num_assigned: _Optional[int] = ...) -> None: ...

class SchedulerState(_message.Message):
    __slots__ = ("active", "workers", "waiting_request_ids", "num_preemptions", "num_reassigned", "policy", "placement", "num_prefix_index_keys", "num_migrated", "num_transfers_expired", "num_in_transfer")
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_REASSIGNED_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_INDEX_KEYS_FIELD_NUMBER: _ClassVar[int]
    NUM_MIGRATED_FIELD_NUMBER: _ClassVar[int]
    NUM_TRANSFERS_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    NUM_IN_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    active: bool
    workers: _containers.RepeatedCompositeFieldContainer[WorkerState]
    waiting_request_ids: _containers.RepeatedScalarFieldContainer[str]
    num_preemptions: int
    num_reassigned: int
    policy: str
    placement: str
    num_prefix_index_keys: int
    num_migrated: int
    num_transfers_expired: int
    num_in_transfer: int
    def __init__(self, active: _Optional[bool] = ..., workers: _Optional[_Iterable[_Union[WorkerState, _Mapping]]] = ..., waiting_request_ids: _Optional[_Iterable[str]] = ..., num_preemptions: _Optional[int] = ..., num_reassigned: _Optional[int] = ..., policy: _Optional[str] = ..., placement: _Optional[str] = ..., num_prefix_index_keys: _Optional[int] = ..., num_migrated: _Optional[int] = ..., num_transfers_expired: _Optional[int] = ..., num_in_transfer: _Optional[int] = ...) -> None: ...

class StepOutput(_message.Message):
    __slots__ = ("request_id", "index", "token_ids", "text", "finish_reason", "error", "logprobs", "text_lengths", "stop_string", "stop_token_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TEXT_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    error: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprobs]
    text_lengths: _containers.RepeatedScalarFieldContainer[int]
    stop_string: str
    stop_token_id: int
    def __init__(self, request_id: _Optional[str] = ..., index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., error: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprobs, _Mapping]]] = ..., text_lengths: _Optional[_Iterable[int]] = ..., stop_string: _Optional[str] = ..., stop_token_id: _Optional[int] = ...) -> None: ...

class StepOutputs(_message.Message):
    __slots__ = ("outputs", "column_request_ids", "column_indices", "column_num_tokens", "column_token_ids", "column_texts")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    COLUMN_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    COLUMN_INDICES_FIELD_NUMBER: _ClassVar[int]
    COLUMN_NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COLUMN_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COLUMN_TEXTS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[StepOutput]
    column_request_ids: _containers.RepeatedScalarFieldContainer[str]
    column_indices: _containers.RepeatedScalarFieldContainer[int]
    column_num_tokens: _containers.RepeatedScalarFieldContainer[int]
    column_token_ids: _containers.RepeatedScalarFieldContainer[int]
    column_texts: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, outputs: _Optional[_Iterable[_Union[StepOutput, _Mapping]]] = ..., column_request_ids: _Optional[_Iterable[str]] = ..., column_indices: _Optional[_Iterable[int]] = ..., column_num_tokens: _Optional[_Iterable[int]] = ..., column_token_ids: _Optional[_Iterable[int]] = ..., column_texts: _Optional[_Iterable[str]] = ...) -> None: ...
