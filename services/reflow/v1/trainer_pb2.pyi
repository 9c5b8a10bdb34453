from reflow.v1 import common_pb2 as _common_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class TrainerStatus(_message.Message):
    __slots__ = ("job_id", "state", "step", "policy_version", "last_metrics_json", "error")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_METRICS_JSON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    state: str
    step: int
    policy_version: int
    last_metrics_json: str
    error: str
    def __init__(self, job_id: _Optional[str] = ..., state: _Optional[str] = ..., step: _Optional[int] = ..., policy_version: _Optional[int] = ..., last_metrics_json: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...
