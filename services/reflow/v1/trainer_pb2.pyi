from reflow.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class TrainerStatusRequest(_message.Message):
    __slots__ = ("job_id", "since_step")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SINCE_STEP_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    since_step: int
    def __init__(self, job_id: _Optional[str] = ..., since_step: _Optional[int] = ...) -> None: ...

class TrainerStatus(_message.Message):
    __slots__ = ("job_id", "state", "step", "policy_version", "last_metrics_json", "error", "metrics_json")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_METRICS_JSON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    METRICS_JSON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    state: str
    step: int
    policy_version: int
    last_metrics_json: str
    error: str
    metrics_json: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, job_id: _Optional[str] = ..., state: _Optional[str] = ..., step: _Optional[int] = ..., policy_version: _Optional[int] = ..., last_metrics_json: _Optional[str] = ..., error: _Optional[str] = ..., metrics_json: _Optional[_Iterable[str]] = ...) -> None: ...
