from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProtocolVersion(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROTOCOL_VERSION_UNSPECIFIED: _ClassVar[ProtocolVersion]
    PROTOCOL_VERSION_CURRENT: _ClassVar[ProtocolVersion]

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]
    DTYPE_BOOL: _ClassVar[DType]

class Codec(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CODEC_UNSPECIFIED: _ClassVar[Codec]
    CODEC_NONE: _ClassVar[Codec]
    CODEC_FLOAT16: _ClassVar[Codec]
    CODEC_BFLOAT16: _ClassVar[Codec]
    CODEC_INT8_BLOCKWISE_LINEAR: _ClassVar[Codec]
    CODEC_INT8_BLOCKWISE_DYNAMIC: _ClassVar[Codec]
    CODEC_INT8_HADAMARD: _ClassVar[Codec]

class PeerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PEER_STATE_UNSPECIFIED: _ClassVar[PeerState]
    PEER_STATE_JOINING: _ClassVar[PeerState]
    PEER_STATE_ONLINE: _ClassVar[PeerState]
    PEER_STATE_DRAINING: _ClassVar[PeerState]
    PEER_STATE_OFFLINE: _ClassVar[PeerState]
PROTOCOL_VERSION_UNSPECIFIED: ProtocolVersion
PROTOCOL_VERSION_CURRENT: ProtocolVersion
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_INT64: DType
DTYPE_INT32: DType
DTYPE_BOOL: DType
CODEC_UNSPECIFIED: Codec
CODEC_NONE: Codec
CODEC_FLOAT16: Codec
CODEC_BFLOAT16: Codec
CODEC_INT8_BLOCKWISE_LINEAR: Codec
CODEC_INT8_BLOCKWISE_DYNAMIC: Codec
CODEC_INT8_HADAMARD: Codec
PEER_STATE_UNSPECIFIED: PeerState
PEER_STATE_JOINING: PeerState
PEER_STATE_ONLINE: PeerState
PEER_STATE_DRAINING: PeerState
PEER_STATE_OFFLINE: PeerState

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "codec", "block_size", "payload", "scales", "chunk_index", "num_chunks", "outliers", "outlier_indices", "outlier_values", "scale_dtype")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    OUTLIERS_FIELD_NUMBER: _ClassVar[int]
    OUTLIER_INDICES_FIELD_NUMBER: _ClassVar[int]
    OUTLIER_VALUES_FIELD_NUMBER: _ClassVar[int]
    SCALE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    codec: Codec
    block_size: int
    payload: bytes
    scales: bytes
    chunk_index: int
    num_chunks: int
    outliers: int
    outlier_indices: bytes
    outlier_values: bytes
    scale_dtype: DType
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., codec: _Optional[_Union[Codec, str]] = ..., block_size: _Optional[int] = ..., payload: _Optional[bytes] = ..., scales: _Optional[bytes] = ..., chunk_index: _Optional[int] = ..., num_chunks: _Optional[int] = ..., outliers: _Optional[int] = ..., outlier_indices: _Optional[bytes] = ..., outlier_values: _Optional[bytes] = ..., scale_dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class CodecChoice(_message.Message):
    __slots__ = ("codec", "block_size", "compress_min_bytes")
    CODEC_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    COMPRESS_MIN_BYTES_FIELD_NUMBER: _ClassVar[int]
    codec: Codec
    block_size: int
    compress_min_bytes: int
    def __init__(self, codec: _Optional[_Union[Codec, str]] = ..., block_size: _Optional[int] = ..., compress_min_bytes: _Optional[int] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("protocol_version", "start_block", "end_block", "hidden_states", "position", "response_codec", "request_id", "adapter", "prompts")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    START_BLOCK_FIELD_NUMBER: _ClassVar[int]
    END_BLOCK_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_CODEC_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: ProtocolVersion
    start_block: int
    end_block: int
    hidden_states: Tensor
    position: int
    response_codec: CodecChoice
    request_id: str
    adapter: AdapterRef
    prompts: Tensor
    def __init__(self, protocol_version: _Optional[_Union[ProtocolVersion, str]] = ..., start_block: _Optional[int] = ..., end_block: _Optional[int] = ..., hidden_states: _Optional[_Union[Tensor, _Mapping]] = ..., position: _Optional[int] = ..., response_codec: _Optional[_Union[CodecChoice, _Mapping]] = ..., request_id: _Optional[str] = ..., adapter: _Optional[_Union[AdapterRef, _Mapping]] = ..., prompts: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class ForwardResponse(_message.Message):
    __slots__ = ("hidden_states", "request_id")
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    hidden_states: Tensor
    request_id: str
    def __init__(self, hidden_states: _Optional[_Union[Tensor, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class BackwardRequest(_message.Message):
    __slots__ = ("protocol_version", "start_block", "end_block", "hidden_states", "grad_outputs", "position", "response_codec", "request_id", "adapter", "prompts")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    START_BLOCK_FIELD_NUMBER: _ClassVar[int]
    END_BLOCK_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    GRAD_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_CODEC_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: ProtocolVersion
    start_block: int
    end_block: int
    hidden_states: Tensor
    grad_outputs: Tensor
    position: int
    response_codec: CodecChoice
    request_id: str
    adapter: AdapterRef
    prompts: Tensor
    def __init__(self, protocol_version: _Optional[_Union[ProtocolVersion, str]] = ..., start_block: _Optional[int] = ..., end_block: _Optional[int] = ..., hidden_states: _Optional[_Union[Tensor, _Mapping]] = ..., grad_outputs: _Optional[_Union[Tensor, _Mapping]] = ..., position: _Optional[int] = ..., response_codec: _Optional[_Union[CodecChoice, _Mapping]] = ..., request_id: _Optional[str] = ..., adapter: _Optional[_Union[AdapterRef, _Mapping]] = ..., prompts: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class BackwardResponse(_message.Message):
    __slots__ = ("grad_inputs", "request_id", "adapter_grad", "grad_prompts")
    GRAD_INPUTS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_GRAD_FIELD_NUMBER: _ClassVar[int]
    GRAD_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    grad_inputs: Tensor
    request_id: str
    adapter_grad: NamedTensor
    grad_prompts: Tensor
    def __init__(self, grad_inputs: _Optional[_Union[Tensor, _Mapping]] = ..., request_id: _Optional[str] = ..., adapter_grad: _Optional[_Union[NamedTensor, _Mapping]] = ..., grad_prompts: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class AdapterRef(_message.Message):
    __slots__ = ("adapter_id", "version")
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    adapter_id: str
    version: int
    def __init__(self, adapter_id: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class NamedTensor(_message.Message):
    __slots__ = ("name", "tensor")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    name: str
    tensor: Tensor
    def __init__(self, name: _Optional[str] = ..., tensor: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class AdapterPart(_message.Message):
    __slots__ = ("protocol_version", "adapter", "start_block", "end_block", "scaling", "weight", "serve_as")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    START_BLOCK_FIELD_NUMBER: _ClassVar[int]
    END_BLOCK_FIELD_NUMBER: _ClassVar[int]
    SCALING_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    SERVE_AS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: ProtocolVersion
    adapter: AdapterRef
    start_block: int
    end_block: int
    scaling: float
    weight: NamedTensor
    serve_as: str
    def __init__(self, protocol_version: _Optional[_Union[ProtocolVersion, str]] = ..., adapter: _Optional[_Union[AdapterRef, _Mapping]] = ..., start_block: _Optional[int] = ..., end_block: _Optional[int] = ..., scaling: _Optional[float] = ..., weight: _Optional[_Union[NamedTensor, _Mapping]] = ..., serve_as: _Optional[str] = ...) -> None: ...

class AdapterAck(_message.Message):
    __slots__ = ("tensors",)
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    tensors: int
    def __init__(self, tensors: _Optional[int] = ...) -> None: ...

class InferenceOpen(_message.Message):
    __slots__ = ("protocol_version", "session_id", "start_block", "end_block", "batch_size", "max_length", "response_codec", "adapter", "push_token")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    START_BLOCK_FIELD_NUMBER: _ClassVar[int]
    END_BLOCK_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_CODEC_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    PUSH_TOKEN_FIELD_NUMBER: _ClassVar[int]
    protocol_version: ProtocolVersion
    session_id: str
    start_block: int
    end_block: int
    batch_size: int
    max_length: int
    response_codec: CodecChoice
    adapter: str
    push_token: bytes
    def __init__(self, protocol_version: _Optional[_Union[ProtocolVersion, str]] = ..., session_id: _Optional[str] = ..., start_block: _Optional[int] = ..., end_block: _Optional[int] = ..., batch_size: _Optional[int] = ..., max_length: _Optional[int] = ..., response_codec: _Optional[_Union[CodecChoice, _Mapping]] = ..., adapter: _Optional[str] = ..., push_token: _Optional[bytes] = ...) -> None: ...

class InferenceFence(_message.Message):
    __slots__ = ("push_token",)
    PUSH_TOKEN_FIELD_NUMBER: _ClassVar[int]
    push_token: bytes
    def __init__(self, push_token: _Optional[bytes] = ...) -> None: ...

class PushTarget(_message.Message):
    __slots__ = ("address", "session_id", "push_token")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PUSH_TOKEN_FIELD_NUMBER: _ClassVar[int]
    address: str
    session_id: str
    push_token: bytes
    def __init__(self, address: _Optional[str] = ..., session_id: _Optional[str] = ..., push_token: _Optional[bytes] = ...) -> None: ...

class InferenceStep(_message.Message):
    __slots__ = ("step_id", "position", "hidden_states", "push_to", "hypo_ids")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    PUSH_TO_FIELD_NUMBER: _ClassVar[int]
    HYPO_IDS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    position: int
    hidden_states: Tensor
    push_to: _containers.RepeatedCompositeFieldContainer[PushTarget]
    hypo_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step_id: _Optional[int] = ..., position: _Optional[int] = ..., hidden_states: _Optional[_Union[Tensor, _Mapping]] = ..., push_to: _Optional[_Iterable[_Union[PushTarget, _Mapping]]] = ..., hypo_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class InferenceRequest(_message.Message):
    __slots__ = ("open", "step", "fence")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    open: InferenceOpen
    step: InferenceStep
    fence: InferenceFence
    def __init__(self, open: _Optional[_Union[InferenceOpen, _Mapping]] = ..., step: _Optional[_Union[InferenceStep, _Mapping]] = ..., fence: _Optional[_Union[InferenceFence, _Mapping]] = ...) -> None: ...

class InferenceResponse(_message.Message):
    __slots__ = ("step_id", "position", "hidden_states", "pushed", "fenced")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    PUSHED_FIELD_NUMBER: _ClassVar[int]
    FENCED_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    position: int
    hidden_states: Tensor
    pushed: bool
    fenced: bool
    def __init__(self, step_id: _Optional[int] = ..., position: _Optional[int] = ..., hidden_states: _Optional[_Union[Tensor, _Mapping]] = ..., pushed: _Optional[bool] = ..., fenced: _Optional[bool] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("protocol_version", "session_id", "step", "push_token")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PUSH_TOKEN_FIELD_NUMBER: _ClassVar[int]
    protocol_version: ProtocolVersion
    session_id: str
    step: InferenceStep
    push_token: bytes
    def __init__(self, protocol_version: _Optional[_Union[ProtocolVersion, str]] = ..., session_id: _Optional[str] = ..., step: _Optional[_Union[InferenceStep, _Mapping]] = ..., push_token: _Optional[bytes] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BatchedStep(_message.Message):
    __slots__ = ("session_id", "step_id", "position", "batch", "new_tokens", "push_to", "hypo_ids", "push_token")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PUSH_TO_FIELD_NUMBER: _ClassVar[int]
    HYPO_IDS_FIELD_NUMBER: _ClassVar[int]
    PUSH_TOKEN_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    step_id: int
    position: int
    batch: int
    new_tokens: int
    push_to: _containers.RepeatedCompositeFieldContainer[PushTarget]
    hypo_ids: _containers.RepeatedScalarFieldContainer[int]
    push_token: bytes
    def __init__(self, session_id: _Optional[str] = ..., step_id: _Optional[int] = ..., position: _Optional[int] = ..., batch: _Optional[int] = ..., new_tokens: _Optional[int] = ..., push_to: _Optional[_Iterable[_Union[PushTarget, _Mapping]]] = ..., hypo_ids: _Optional[_Iterable[int]] = ..., push_token: _Optional[bytes] = ...) -> None: ...

class StepBatch(_message.Message):
    __slots__ = ("steps", "hidden_states")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    steps: _containers.RepeatedCompositeFieldContainer[BatchedStep]
    hidden_states: Tensor
    def __init__(self, steps: _Optional[_Iterable[_Union[BatchedStep, _Mapping]]] = ..., hidden_states: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class SessionFence(_message.Message):
    __slots__ = ("session_id", "push_token")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PUSH_TOKEN_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    push_token: bytes
    def __init__(self, session_id: _Optional[str] = ..., push_token: _Optional[bytes] = ...) -> None: ...

class SessionClose(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class SessionPrefix(_message.Message):
    __slots__ = ("session_id", "keys", "attach", "tails", "keep_tokens", "tail")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    ATTACH_FIELD_NUMBER: _ClassVar[int]
    TAILS_FIELD_NUMBER: _ClassVar[int]
    KEEP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TAIL_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    attach: bool
    tails: _containers.RepeatedCompositeFieldContainer[PrefixTail]
    keep_tokens: int
    tail: PrefixTail
    def __init__(self, session_id: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., attach: _Optional[bool] = ..., tails: _Optional[_Iterable[_Union[PrefixTail, _Mapping]]] = ..., keep_tokens: _Optional[int] = ..., tail: _Optional[_Union[PrefixTail, _Mapping]] = ...) -> None: ...

class PrefixTail(_message.Message):
    __slots__ = ("runs", "tokens", "key")
    RUNS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    runs: int
    tokens: int
    key: bytes
    def __init__(self, runs: _Optional[int] = ..., tokens: _Optional[int] = ..., key: _Optional[bytes] = ...) -> None: ...

class SessionsRequest(_message.Message):
    __slots__ = ("open", "steps", "fence", "close", "prefix")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    open: InferenceOpen
    steps: StepBatch
    fence: SessionFence
    close: SessionClose
    prefix: SessionPrefix
    def __init__(self, open: _Optional[_Union[InferenceOpen, _Mapping]] = ..., steps: _Optional[_Union[StepBatch, _Mapping]] = ..., fence: _Optional[_Union[SessionFence, _Mapping]] = ..., close: _Optional[_Union[SessionClose, _Mapping]] = ..., prefix: _Optional[_Union[SessionPrefix, _Mapping]] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("session_id", "step_id", "position", "batch", "new_tokens", "pushed")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PUSHED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    step_id: int
    position: int
    batch: int
    new_tokens: int
    pushed: bool
    def __init__(self, session_id: _Optional[str] = ..., step_id: _Optional[int] = ..., position: _Optional[int] = ..., batch: _Optional[int] = ..., new_tokens: _Optional[int] = ..., pushed: _Optional[bool] = ...) -> None: ...

class AnswerBatch(_message.Message):
    __slots__ = ("results", "hidden_states")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[StepResult]
    hidden_states: Tensor
    def __init__(self, results: _Optional[_Iterable[_Union[StepResult, _Mapping]]] = ..., hidden_states: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class SessionError(_message.Message):
    __slots__ = ("session_id", "step_id", "code", "message")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    step_id: int
    code: int
    message: str
    def __init__(self, session_id: _Optional[str] = ..., step_id: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class PrefixHeld(_message.Message):
    __slots__ = ("session_id", "tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tokens: int
    def __init__(self, session_id: _Optional[str] = ..., tokens: _Optional[int] = ...) -> None: ...

class SessionsResponse(_message.Message):
    __slots__ = ("answers", "error", "held")
    ANSWERS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    answers: AnswerBatch
    error: SessionError
    held: PrefixHeld
    def __init__(self, answers: _Optional[_Union[AnswerBatch, _Mapping]] = ..., error: _Optional[_Union[SessionError, _Mapping]] = ..., held: _Optional[_Union[PrefixHeld, _Mapping]] = ...) -> None: ...

class PushBatchRequest(_message.Message):
    __slots__ = ("protocol_version", "steps")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: ProtocolVersion
    steps: StepBatch
    def __init__(self, protocol_version: _Optional[_Union[ProtocolVersion, str]] = ..., steps: _Optional[_Union[StepBatch, _Mapping]] = ...) -> None: ...

class PushBatchResponse(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, accepted: _Optional[_Iterable[bool]] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("protocol_version", "peer_id", "model", "start_block", "end_block", "num_blocks_total", "hidden_size", "dtype", "state", "forward_tokens_per_s", "inference_steps_per_s", "queue_length", "cache_tokens_free", "cache_tokens_total", "max_message_bytes", "codecs")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    START_BLOCK_FIELD_NUMBER: _ClassVar[int]
    END_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    FORWARD_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_STEPS_PER_S_FIELD_NUMBER: _ClassVar[int]
    QUEUE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    CACHE_TOKENS_FREE_FIELD_NUMBER: _ClassVar[int]
    CACHE_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CODECS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: ProtocolVersion
    peer_id: str
    model: str
    start_block: int
    end_block: int
    num_blocks_total: int
    hidden_size: int
    dtype: DType
    state: PeerState
    forward_tokens_per_s: float
    inference_steps_per_s: float
    queue_length: int
    cache_tokens_free: int
    cache_tokens_total: int
    max_message_bytes: int
    codecs: _containers.RepeatedScalarFieldContainer[Codec]
    def __init__(self, protocol_version: _Optional[_Union[ProtocolVersion, str]] = ..., peer_id: _Optional[str] = ..., model: _Optional[str] = ..., start_block: _Optional[int] = ..., end_block: _Optional[int] = ..., num_blocks_total: _Optional[int] = ..., hidden_size: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., state: _Optional[_Union[PeerState, str]] = ..., forward_tokens_per_s: _Optional[float] = ..., inference_steps_per_s: _Optional[float] = ..., queue_length: _Optional[int] = ..., cache_tokens_free: _Optional[int] = ..., cache_tokens_total: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., codecs: _Optional[_Iterable[_Union[Codec, str]]] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("state", "protocol_version")
    STATE_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    state: PeerState
    protocol_version: ProtocolVersion
    def __init__(self, state: _Optional[_Union[PeerState, str]] = ..., protocol_version: _Optional[_Union[ProtocolVersion, str]] = ...) -> None: ...

class TrainRequest(_message.Message):
    __slots__ = ("protocol_version", "inputs", "grad_outputs", "labels", "response_codec", "request_id", "next")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    GRAD_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_CODEC_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NEXT_FIELD_NUMBER: _ClassVar[int]
    protocol_version: ProtocolVersion
    inputs: Tensor
    grad_outputs: Tensor
    labels: Tensor
    response_codec: CodecChoice
    request_id: str
    next: _containers.RepeatedCompositeFieldContainer[ChainHop]
    def __init__(self, protocol_version: _Optional[_Union[ProtocolVersion, str]] = ..., inputs: _Optional[_Union[Tensor, _Mapping]] = ..., grad_outputs: _Optional[_Union[Tensor, _Mapping]] = ..., labels: _Optional[_Union[Tensor, _Mapping]] = ..., response_codec: _Optional[_Union[CodecChoice, _Mapping]] = ..., request_id: _Optional[str] = ..., next: _Optional[_Iterable[_Union[ChainHop, _Mapping]]] = ...) -> None: ...

class ChainHop(_message.Message):
    __slots__ = ("address", "request_id")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    address: str
    request_id: str
    def __init__(self, address: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class HopReport(_message.Message):
    __slots__ = ("step", "compute_seconds", "queue_seconds", "averaging_seconds")
    STEP_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    AVERAGING_SECONDS_FIELD_NUMBER: _ClassVar[int]
    step: int
    compute_seconds: float
    queue_seconds: float
    averaging_seconds: float
    def __init__(self, step: _Optional[int] = ..., compute_seconds: _Optional[float] = ..., queue_seconds: _Optional[float] = ..., averaging_seconds: _Optional[float] = ...) -> None: ...

class TrainResponse(_message.Message):
    __slots__ = ("outputs", "grad_inputs", "loss", "step", "request_id", "compute_seconds", "queue_seconds", "averaging_seconds", "hops")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    GRAD_INPUTS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    AVERAGING_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HOPS_FIELD_NUMBER: _ClassVar[int]
    outputs: Tensor
    grad_inputs: Tensor
    loss: float
    step: int
    request_id: str
    compute_seconds: float
    queue_seconds: float
    averaging_seconds: float
    hops: _containers.RepeatedCompositeFieldContainer[HopReport]
    def __init__(self, outputs: _Optional[_Union[Tensor, _Mapping]] = ..., grad_inputs: _Optional[_Union[Tensor, _Mapping]] = ..., loss: _Optional[float] = ..., step: _Optional[int] = ..., request_id: _Optional[str] = ..., compute_seconds: _Optional[float] = ..., queue_seconds: _Optional[float] = ..., averaging_seconds: _Optional[float] = ..., hops: _Optional[_Iterable[_Union[HopReport, _Mapping]]] = ...) -> None: ...

class StageInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StageInfoResponse(_message.Message):
    __slots__ = ("peer_id", "run_id", "start_block", "end_block", "total_blocks", "step", "samples_accumulated", "samples_total", "averaging_rounds", "last_loss", "compute_seconds", "averaging_seconds")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    START_BLOCK_FIELD_NUMBER: _ClassVar[int]
    END_BLOCK_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_ACCUMULATED_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    AVERAGING_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    LAST_LOSS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    AVERAGING_SECONDS_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    run_id: str
    start_block: int
    end_block: int
    total_blocks: int
    step: int
    samples_accumulated: int
    samples_total: int
    averaging_rounds: int
    last_loss: float
    compute_seconds: float
    averaging_seconds: float
    def __init__(self, peer_id: _Optional[str] = ..., run_id: _Optional[str] = ..., start_block: _Optional[int] = ..., end_block: _Optional[int] = ..., total_blocks: _Optional[int] = ..., step: _Optional[int] = ..., samples_accumulated: _Optional[int] = ..., samples_total: _Optional[int] = ..., averaging_rounds: _Optional[int] = ..., last_loss: _Optional[float] = ..., compute_seconds: _Optional[float] = ..., averaging_seconds: _Optional[float] = ...) -> None: ...

class StepNowRequest(_message.Message):
    __slots__ = ("step", "peer_id")
    STEP_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    step: int
    peer_id: str
    def __init__(self, step: _Optional[int] = ..., peer_id: _Optional[str] = ...) -> None: ...

class StepNowResponse(_message.Message):
    __slots__ = ("step",)
    STEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    def __init__(self, step: _Optional[int] = ...) -> None: ...

class ProgressRequest(_message.Message):
    __slots__ = ("peer_id", "step", "samples", "params_digest")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    PARAMS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    step: int
    samples: int
    params_digest: bytes
    def __init__(self, peer_id: _Optional[str] = ..., step: _Optional[int] = ..., samples: _Optional[int] = ..., params_digest: _Optional[bytes] = ...) -> None: ...

class ProgressResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GradientsHeader(_message.Message):
    __slots__ = ("peer_id", "step", "attempt", "samples", "members", "num_tensors", "params_digest")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    step: int
    attempt: int
    samples: int
    members: _containers.RepeatedScalarFieldContainer[str]
    num_tensors: int
    params_digest: bytes
    def __init__(self, peer_id: _Optional[str] = ..., step: _Optional[int] = ..., attempt: _Optional[int] = ..., samples: _Optional[int] = ..., members: _Optional[_Iterable[str]] = ..., num_tensors: _Optional[int] = ..., params_digest: _Optional[bytes] = ...) -> None: ...

class GradientsPart(_message.Message):
    __slots__ = ("header", "tensor")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    header: GradientsHeader
    tensor: Tensor
    def __init__(self, header: _Optional[_Union[GradientsHeader, _Mapping]] = ..., tensor: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class GradientsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RelayHold(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class RelayIncoming(_message.Message):
    __slots__ = ("connection", "caller")
    CONNECTION_FIELD_NUMBER: _ClassVar[int]
    CALLER_FIELD_NUMBER: _ClassVar[int]
    connection: str
    caller: str
    def __init__(self, connection: _Optional[str] = ..., caller: _Optional[str] = ...) -> None: ...

class RelayBytes(_message.Message):
    __slots__ = ("data", "name", "connection")
    DATA_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONNECTION_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    name: str
    connection: str
    def __init__(self, data: _Optional[bytes] = ..., name: _Optional[str] = ..., connection: _Optional[str] = ...) -> None: ...
