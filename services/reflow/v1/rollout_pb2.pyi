from reflow.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorMeta(_message.Message):
    __slots__ = ("name", "shape", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class InitWeightSyncRequest(_message.Message):
    __slots__ = ("job_id", "master_address", "master_port", "rank", "world_size", "backend", "tensors", "bucket_bytes")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MASTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    master_address: str
    master_port: int
    rank: int
    world_size: int
    backend: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    bucket_bytes: int
    def __init__(self, job_id: _Optional[str] = ..., master_address: _Optional[str] = ..., master_port: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., backend: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., bucket_bytes: _Optional[int] = ...) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("job_id", "policy_version")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    policy_version: int
    def __init__(self, job_id: _Optional[str] = ..., policy_version: _Optional[int] = ...) -> None: ...

class UpdateWeightsReply(_message.Message):
    __slots__ = ("policy_version", "pause_s", "receive_s")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    PAUSE_S_FIELD_NUMBER: _ClassVar[int]
    RECEIVE_S_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    pause_s: float
    receive_s: float
    def __init__(self, policy_version: _Optional[int] = ..., pause_s: _Optional[float] = ..., receive_s: _Optional[float] = ...) -> None: ...

class RolloutStats(_message.Message):
    __slots__ = ("generated_tokens_total", "finished_samples_total", "idle_seconds_total", "inflight_samples", "policy_version", "state", "error", "occupancy_seconds_total", "engine_startup_s")
    GENERATED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    FINISHED_SAMPLES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    IDLE_SECONDS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    OCCUPANCY_SECONDS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ENGINE_STARTUP_S_FIELD_NUMBER: _ClassVar[int]
    generated_tokens_total: int
    finished_samples_total: int
    idle_seconds_total: float
    inflight_samples: int
    policy_version: int
    state: str
    error: str
    occupancy_seconds_total: float
    engine_startup_s: float
    def __init__(self, generated_tokens_total: _Optional[int] = ..., finished_samples_total: _Optional[int] = ..., idle_seconds_total: _Optional[float] = ..., inflight_samples: _Optional[int] = ..., policy_version: _Optional[int] = ..., state: _Optional[str] = ..., error: _Optional[str] = ..., occupancy_seconds_total: _Optional[float] = ..., engine_startup_s: _Optional[float] = ...) -> None: ...
