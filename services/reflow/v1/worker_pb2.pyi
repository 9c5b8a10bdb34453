from reflow.v1 import common_pb2 as _common_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class SetRoleRequest(_message.Message):
    __slots__ = ("job_id", "role", "drain_timeout_s", "hand_back")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DRAIN_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    HAND_BACK_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    role: str
    drain_timeout_s: float
    hand_back: bool
    def __init__(self, job_id: _Optional[str] = ..., role: _Optional[str] = ..., drain_timeout_s: _Optional[float] = ..., hand_back: _Optional[bool] = ...) -> None: ...

class RoleStatus(_message.Message):
    __slots__ = ("job_id", "role", "flips", "last_flip", "last_flip_s", "engine_inflight")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    FLIPS_FIELD_NUMBER: _ClassVar[int]
    LAST_FLIP_FIELD_NUMBER: _ClassVar[int]
    LAST_FLIP_S_FIELD_NUMBER: _ClassVar[int]
    ENGINE_INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    role: str
    flips: int
    last_flip: str
    last_flip_s: float
    engine_inflight: int
    def __init__(self, job_id: _Optional[str] = ..., role: _Optional[str] = ..., flips: _Optional[int] = ..., last_flip: _Optional[str] = ..., last_flip_s: _Optional[float] = ..., engine_inflight: _Optional[int] = ...) -> None: ...
