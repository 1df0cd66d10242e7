from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("data", "shape", "dtype")
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, data: _Optional[bytes] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("session_id", "max_context", "manifest_sha256", "resume", "owner")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_SHA256_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    max_context: int
    manifest_sha256: str
    resume: bool
    owner: str
    def __init__(self, session_id: _Optional[str] = ..., max_context: _Optional[int] = ..., manifest_sha256: _Optional[str] = ..., resume: _Optional[bool] = ..., owner: _Optional[str] = ...) -> None: ...

class OpenSessionReply(_message.Message):
    __slots__ = ("stage",)
    STAGE_FIELD_NUMBER: _ClassVar[int]
    stage: int
    def __init__(self, stage: _Optional[int] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionReply(_message.Message):
    __slots__ = ("existed", "freed_kv_bytes")
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    FREED_KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    freed_kv_bytes: int
    def __init__(self, existed: _Optional[bool] = ..., freed_kv_bytes: _Optional[int] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("session_id", "step_id", "stage", "input", "past_length", "start_position", "hide_slots", "route", "logits_count", "top_k", "reply_to", "manifest_sha256", "row_start_positions", "row_pads", "hide_rows", "keep_rows", "handle_ms", "timeout_ms", "token_mask")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    PAST_LENGTH_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    HIDE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    LOGITS_COUNT_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    REPLY_TO_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_SHA256_FIELD_NUMBER: _ClassVar[int]
    ROW_START_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    ROW_PADS_FIELD_NUMBER: _ClassVar[int]
    HIDE_ROWS_FIELD_NUMBER: _ClassVar[int]
    KEEP_ROWS_FIELD_NUMBER: _ClassVar[int]
    HANDLE_MS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_MASK_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    step_id: int
    stage: int
    input: Tensor
    past_length: int
    start_position: int
    hide_slots: _containers.RepeatedScalarFieldContainer[int]
    route: _containers.RepeatedScalarFieldContainer[str]
    logits_count: int
    top_k: int
    reply_to: str
    manifest_sha256: str
    row_start_positions: _containers.RepeatedScalarFieldContainer[int]
    row_pads: _containers.RepeatedScalarFieldContainer[int]
    hide_rows: _containers.RepeatedScalarFieldContainer[int]
    keep_rows: _containers.RepeatedScalarFieldContainer[int]
    handle_ms: _containers.RepeatedScalarFieldContainer[float]
    timeout_ms: float
    token_mask: Tensor
    def __init__(self, session_id: _Optional[str] = ..., step_id: _Optional[int] = ..., stage: _Optional[int] = ..., input: _Optional[_Union[Tensor, _Mapping]] = ..., past_length: _Optional[int] = ..., start_position: _Optional[int] = ..., hide_slots: _Optional[_Iterable[int]] = ..., route: _Optional[_Iterable[str]] = ..., logits_count: _Optional[int] = ..., top_k: _Optional[int] = ..., reply_to: _Optional[str] = ..., manifest_sha256: _Optional[str] = ..., row_start_positions: _Optional[_Iterable[int]] = ..., row_pads: _Optional[_Iterable[int]] = ..., hide_rows: _Optional[_Iterable[int]] = ..., keep_rows: _Optional[_Iterable[int]] = ..., handle_ms: _Optional[_Iterable[float]] = ..., timeout_ms: _Optional[float] = ..., token_mask: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class ForwardReply(_message.Message):
    __slots__ = ("compute_ms", "handle_ms")
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    HANDLE_MS_FIELD_NUMBER: _ClassVar[int]
    compute_ms: float
    handle_ms: float
    def __init__(self, compute_ms: _Optional[float] = ..., handle_ms: _Optional[float] = ...) -> None: ...

class LinkAck(_message.Message):
    __slots__ = ("session_id", "step_id", "code", "details")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    step_id: int
    code: int
    details: str
    def __init__(self, session_id: _Optional[str] = ..., step_id: _Optional[int] = ..., code: _Optional[int] = ..., details: _Optional[str] = ...) -> None: ...

class CompactRequest(_message.Message):
    __slots__ = ("session_id", "past_length", "hide_slots", "manifest_sha256", "hide_rows")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PAST_LENGTH_FIELD_NUMBER: _ClassVar[int]
    HIDE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_SHA256_FIELD_NUMBER: _ClassVar[int]
    HIDE_ROWS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    past_length: int
    hide_slots: _containers.RepeatedScalarFieldContainer[int]
    manifest_sha256: str
    hide_rows: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., past_length: _Optional[int] = ..., hide_slots: _Optional[_Iterable[int]] = ..., manifest_sha256: _Optional[str] = ..., hide_rows: _Optional[_Iterable[int]] = ...) -> None: ...

class CompactReply(_message.Message):
    __slots__ = ("length", "compute_ms")
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    length: int
    compute_ms: float
    def __init__(self, length: _Optional[int] = ..., compute_ms: _Optional[float] = ...) -> None: ...

class MergeRequest(_message.Message):
    __slots__ = ("session_id", "sources", "max_context", "manifest_sha256", "owner")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_SHA256_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    sources: _containers.RepeatedScalarFieldContainer[str]
    max_context: int
    manifest_sha256: str
    owner: str
    def __init__(self, session_id: _Optional[str] = ..., sources: _Optional[_Iterable[str]] = ..., max_context: _Optional[int] = ..., manifest_sha256: _Optional[str] = ..., owner: _Optional[str] = ...) -> None: ...

class MergeReply(_message.Message):
    __slots__ = ("length", "rows")
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    length: int
    rows: int
    def __init__(self, length: _Optional[int] = ..., rows: _Optional[int] = ...) -> None: ...

class CopyRequest(_message.Message):
    __slots__ = ("session_id", "source", "row", "tokens", "max_context", "manifest_sha256", "detach", "owner")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    ROW_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_SHA256_FIELD_NUMBER: _ClassVar[int]
    DETACH_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    source: str
    row: int
    tokens: int
    max_context: int
    manifest_sha256: str
    detach: bool
    owner: str
    def __init__(self, session_id: _Optional[str] = ..., source: _Optional[str] = ..., row: _Optional[int] = ..., tokens: _Optional[int] = ..., max_context: _Optional[int] = ..., manifest_sha256: _Optional[str] = ..., detach: _Optional[bool] = ..., owner: _Optional[str] = ...) -> None: ...

class CopyReply(_message.Message):
    __slots__ = ("length", "compute_ms")
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    length: int
    compute_ms: float
    def __init__(self, length: _Optional[int] = ..., compute_ms: _Optional[float] = ...) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("subscriber_id",)
    SUBSCRIBER_ID_FIELD_NUMBER: _ClassVar[int]
    subscriber_id: str
    def __init__(self, subscriber_id: _Optional[str] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("session_id", "step_id", "top_ids", "top_logprobs", "handle_ms")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    HANDLE_MS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    step_id: int
    top_ids: Tensor
    top_logprobs: Tensor
    handle_ms: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, session_id: _Optional[str] = ..., step_id: _Optional[int] = ..., top_ids: _Optional[_Union[Tensor, _Mapping]] = ..., top_logprobs: _Optional[_Union[Tensor, _Mapping]] = ..., handle_ms: _Optional[_Iterable[float]] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ("owner", "challenge")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    CHALLENGE_FIELD_NUMBER: _ClassVar[int]
    owner: str
    challenge: str
    def __init__(self, owner: _Optional[str] = ..., challenge: _Optional[str] = ...) -> None: ...

class InfoReply(_message.Message):
    __slots__ = ("worker_id", "stage", "num_stages", "layer_start", "layer_end", "manifest_sha256", "protocol_version", "model_id", "device", "sessions", "max_sessions", "kv_bytes", "busy", "openvino_version", "compactions", "kv_reserved_bytes", "kv_budget_bytes", "sequences", "load_source", "load_s", "load_detail", "empty", "memory_available_bytes", "ms_per_gb", "proof")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_STAGES_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_SHA256_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUSY_FIELD_NUMBER: _ClassVar[int]
    OPENVINO_VERSION_FIELD_NUMBER: _ClassVar[int]
    COMPACTIONS_FIELD_NUMBER: _ClassVar[int]
    KV_RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    LOAD_SOURCE_FIELD_NUMBER: _ClassVar[int]
    LOAD_S_FIELD_NUMBER: _ClassVar[int]
    LOAD_DETAIL_FIELD_NUMBER: _ClassVar[int]
    EMPTY_FIELD_NUMBER: _ClassVar[int]
    MEMORY_AVAILABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MS_PER_GB_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    stage: int
    num_stages: int
    layer_start: int
    layer_end: int
    manifest_sha256: str
    protocol_version: int
    model_id: str
    device: str
    sessions: int
    max_sessions: int
    kv_bytes: int
    busy: int
    openvino_version: str
    compactions: int
    kv_reserved_bytes: int
    kv_budget_bytes: int
    sequences: int
    load_source: str
    load_s: float
    load_detail: str
    empty: bool
    memory_available_bytes: int
    ms_per_gb: float
    proof: str
    def __init__(self, worker_id: _Optional[str] = ..., stage: _Optional[int] = ..., num_stages: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., manifest_sha256: _Optional[str] = ..., protocol_version: _Optional[int] = ..., model_id: _Optional[str] = ..., device: _Optional[str] = ..., sessions: _Optional[int] = ..., max_sessions: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., busy: _Optional[int] = ..., openvino_version: _Optional[str] = ..., compactions: _Optional[int] = ..., kv_reserved_bytes: _Optional[int] = ..., kv_budget_bytes: _Optional[int] = ..., sequences: _Optional[int] = ..., load_source: _Optional[str] = ..., load_s: _Optional[float] = ..., load_detail: _Optional[str] = ..., empty: _Optional[bool] = ..., memory_available_bytes: _Optional[int] = ..., ms_per_gb: _Optional[float] = ..., proof: _Optional[str] = ...) -> None: ...

class StageStatusRequest(_message.Message):
    __slots__ = ("model_id", "manifest_sha256", "manifest", "stage")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_SHA256_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    manifest_sha256: str
    manifest: bytes
    stage: int
    def __init__(self, model_id: _Optional[str] = ..., manifest_sha256: _Optional[str] = ..., manifest: _Optional[bytes] = ..., stage: _Optional[int] = ...) -> None: ...

class FileHeld(_message.Message):
    __slots__ = ("path", "bytes", "complete")
    PATH_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    path: str
    bytes: int
    complete: bool
    def __init__(self, path: _Optional[str] = ..., bytes: _Optional[int] = ..., complete: _Optional[bool] = ...) -> None: ...

class StageStatusReply(_message.Message):
    __slots__ = ("files", "free_bytes", "holds_stages")
    FILES_FIELD_NUMBER: _ClassVar[int]
    FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOLDS_STAGES_FIELD_NUMBER: _ClassVar[int]
    files: _containers.RepeatedCompositeFieldContainer[FileHeld]
    free_bytes: int
    holds_stages: bool
    def __init__(self, files: _Optional[_Iterable[_Union[FileHeld, _Mapping]]] = ..., free_bytes: _Optional[int] = ..., holds_stages: _Optional[bool] = ...) -> None: ...

class StageChunk(_message.Message):
    __slots__ = ("model_id", "manifest_sha256", "path", "offset", "data", "size")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_SHA256_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    manifest_sha256: str
    path: str
    offset: int
    data: bytes
    size: int
    def __init__(self, model_id: _Optional[str] = ..., manifest_sha256: _Optional[str] = ..., path: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., size: _Optional[int] = ...) -> None: ...

class PutStageReply(_message.Message):
    __slots__ = ("bytes_written", "completed")
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    bytes_written: int
    completed: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, bytes_written: _Optional[int] = ..., completed: _Optional[_Iterable[str]] = ...) -> None: ...

class Segment(_message.Message):
    __slots__ = ("offset", "size", "sha256")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    offset: int
    size: int
    sha256: bytes
    def __init__(self, offset: _Optional[int] = ..., size: _Optional[int] = ..., sha256: _Optional[bytes] = ...) -> None: ...

class ReuseRequest(_message.Message):
    __slots__ = ("model_id", "manifest_sha256", "path", "size", "segments")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_SHA256_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    manifest_sha256: str
    path: str
    size: int
    segments: _containers.RepeatedCompositeFieldContainer[Segment]
    def __init__(self, model_id: _Optional[str] = ..., manifest_sha256: _Optional[str] = ..., path: _Optional[str] = ..., size: _Optional[int] = ..., segments: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ...) -> None: ...

class ReuseReply(_message.Message):
    __slots__ = ("bytes", "reused_bytes", "held")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    REUSED_BYTES_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    reused_bytes: int
    held: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, bytes: _Optional[int] = ..., reused_bytes: _Optional[int] = ..., held: _Optional[_Iterable[bool]] = ...) -> None: ...

class LoadStageRequest(_message.Message):
    __slots__ = ("model_id", "manifest_sha256", "stage")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_SHA256_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    manifest_sha256: str
    stage: int
    def __init__(self, model_id: _Optional[str] = ..., manifest_sha256: _Optional[str] = ..., stage: _Optional[int] = ...) -> None: ...

class LoadStageReply(_message.Message):
    __slots__ = ("stage", "layer_start", "layer_end", "load_source", "load_s", "already_loaded")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    LOAD_SOURCE_FIELD_NUMBER: _ClassVar[int]
    LOAD_S_FIELD_NUMBER: _ClassVar[int]
    ALREADY_LOADED_FIELD_NUMBER: _ClassVar[int]
    stage: int
    layer_start: int
    layer_end: int
    load_source: str
    load_s: float
    already_loaded: bool
    def __init__(self, stage: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., load_source: _Optional[str] = ..., load_s: _Optional[float] = ..., already_loaded: _Optional[bool] = ...) -> None: ...
