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

class Configure(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "kv_format")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    KV_FORMAT_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_format: str
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., kv_format: _Optional[str] = ...) -> None: ...

class Open(_message.Message):
    __slots__ = ("seq_ids",)
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Close(_message.Message):
    __slots__ = ("seq_ids",)
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Prefill(_message.Message):
    __slots__ = ("layer", "seq_ids", "lens", "k", "v")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    LENS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    V_FIELD_NUMBER: _ClassVar[int]
    layer: int
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    lens: _containers.RepeatedScalarFieldContainer[int]
    k: Tensor
    v: Tensor
    def __init__(self, layer: _Optional[int] = ..., seq_ids: _Optional[_Iterable[int]] = ..., lens: _Optional[_Iterable[int]] = ..., k: _Optional[_Union[Tensor, _Mapping]] = ..., v: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class Decode(_message.Message):
    __slots__ = ("layer", "seq_ids", "q", "k", "v")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    V_FIELD_NUMBER: _ClassVar[int]
    layer: int
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    q: Tensor
    k: Tensor
    v: Tensor
    def __init__(self, layer: _Optional[int] = ..., seq_ids: _Optional[_Iterable[int]] = ..., q: _Optional[_Union[Tensor, _Mapping]] = ..., k: _Optional[_Union[Tensor, _Mapping]] = ..., v: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class Request(_message.Message):
    __slots__ = ("call_id", "configure", "open", "close", "prefill", "decode")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIGURE_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    configure: Configure
    open: Open
    close: Close
    prefill: Prefill
    decode: Decode
    def __init__(self, call_id: _Optional[int] = ..., configure: _Optional[_Union[Configure, _Mapping]] = ..., open: _Optional[_Union[Open, _Mapping]] = ..., close: _Optional[_Union[Close, _Mapping]] = ..., prefill: _Optional[_Union[Prefill, _Mapping]] = ..., decode: _Optional[_Union[Decode, _Mapping]] = ...) -> None: ...

class Reply(_message.Message):
    __slots__ = ("call_id", "code", "message", "o", "kernel_s", "handler_s")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    O_FIELD_NUMBER: _ClassVar[int]
    KERNEL_S_FIELD_NUMBER: _ClassVar[int]
    HANDLER_S_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    code: int
    message: str
    o: Tensor
    kernel_s: float
    handler_s: float
    def __init__(self, call_id: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., o: _Optional[_Union[Tensor, _Mapping]] = ..., kernel_s: _Optional[float] = ..., handler_s: _Optional[float] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("sequences", "kv_tokens", "bytes_used", "capacity_bytes", "busy_s", "connections", "draining", "isa", "calls")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUSY_S_FIELD_NUMBER: _ClassVar[int]
    CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    ISA_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    sequences: int
    kv_tokens: int
    bytes_used: int
    capacity_bytes: int
    busy_s: float
    connections: int
    draining: bool
    isa: str
    calls: int
    def __init__(self, sequences: _Optional[int] = ..., kv_tokens: _Optional[int] = ..., bytes_used: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., busy_s: _Optional[float] = ..., connections: _Optional[int] = ..., draining: _Optional[bool] = ..., isa: _Optional[str] = ..., calls: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainReply(_message.Message):
    __slots__ = ("sequences",)
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    sequences: int
    def __init__(self, sequences: _Optional[int] = ...) -> None: ...
