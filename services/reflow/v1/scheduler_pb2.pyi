from reflow.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FlipRequest(_message.Message):
    __slots__ = ("job_id", "worker", "role")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    worker: int
    role: str
    def __init__(self, job_id: _Optional[str] = ..., worker: _Optional[int] = ..., role: _Optional[str] = ...) -> None: ...

class FlipReply(_message.Message):
    __slots__ = ("queued_before",)
    QUEUED_BEFORE_FIELD_NUMBER: _ClassVar[int]
    queued_before: int
    def __init__(self, queued_before: _Optional[int] = ...) -> None: ...

class SubmitJobReply(_message.Message):
    __slots__ = ("job", "created")
    JOB_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    job: JobStatus
    created: bool
    def __init__(self, job: _Optional[_Union[JobStatus, _Mapping]] = ..., created: _Optional[bool] = ...) -> None: ...

class SubmitJobRequest(_message.Message):
    __slots__ = ("job_id", "spec_json", "run_dir")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    RUN_DIR_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    spec_json: str
    run_dir: str
    def __init__(self, job_id: _Optional[str] = ..., spec_json: _Optional[str] = ..., run_dir: _Optional[str] = ...) -> None: ...

class JobStatus(_message.Message):
    __slots__ = ("job_id", "phase", "reason", "step", "num_steps", "policy_version", "reward_mean", "trainer_tokens_per_s", "created_at", "started_at", "finished_at", "run_dir", "name", "workers")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    REWARD_MEAN_FIELD_NUMBER: _ClassVar[int]
    TRAINER_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    RUN_DIR_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    phase: str
    reason: str
    step: int
    num_steps: int
    policy_version: int
    reward_mean: float
    trainer_tokens_per_s: float
    created_at: float
    started_at: float
    finished_at: float
    run_dir: str
    name: str
    workers: _containers.RepeatedCompositeFieldContainer[RoleWorkers]
    def __init__(self, job_id: _Optional[str] = ..., phase: _Optional[str] = ..., reason: _Optional[str] = ..., step: _Optional[int] = ..., num_steps: _Optional[int] = ..., policy_version: _Optional[int] = ..., reward_mean: _Optional[float] = ..., trainer_tokens_per_s: _Optional[float] = ..., created_at: _Optional[float] = ..., started_at: _Optional[float] = ..., finished_at: _Optional[float] = ..., run_dir: _Optional[str] = ..., name: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[RoleWorkers, _Mapping]]] = ...) -> None: ...

class RoleWorkers(_message.Message):
    __slots__ = ("role", "names")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    role: str
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, role: _Optional[str] = ..., names: _Optional[_Iterable[str]] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("limit", "page_token")
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    limit: int
    page_token: str
    def __init__(self, limit: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListJobsReply(_message.Message):
    __slots__ = ("jobs", "next_page_token")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[JobStatus]
    next_page_token: str
    def __init__(self, jobs: _Optional[_Iterable[_Union[JobStatus, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class JobLogsRequest(_message.Message):
    __slots__ = ("job_id", "service", "tail_bytes")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    TAIL_BYTES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    service: str
    tail_bytes: int
    def __init__(self, job_id: _Optional[str] = ..., service: _Optional[str] = ..., tail_bytes: _Optional[int] = ...) -> None: ...

class ServiceLog(_message.Message):
    __slots__ = ("service", "text", "truncated")
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    service: str
    text: str
    truncated: bool
    def __init__(self, service: _Optional[str] = ..., text: _Optional[str] = ..., truncated: _Optional[bool] = ...) -> None: ...

class JobLogsReply(_message.Message):
    __slots__ = ("logs",)
    LOGS_FIELD_NUMBER: _ClassVar[int]
    logs: _containers.RepeatedCompositeFieldContainer[ServiceLog]
    def __init__(self, logs: _Optional[_Iterable[_Union[ServiceLog, _Mapping]]] = ...) -> None: ...

class JobMetricsRequest(_message.Message):
    __slots__ = ("job_id", "since_step", "limit")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SINCE_STEP_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    since_step: int
    limit: int
    def __init__(self, job_id: _Optional[str] = ..., since_step: _Optional[int] = ..., limit: _Optional[int] = ...) -> None: ...

class JobMetricsReply(_message.Message):
    __slots__ = ("records_json",)
    RECORDS_JSON_FIELD_NUMBER: _ClassVar[int]
    records_json: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, records_json: _Optional[_Iterable[str]] = ...) -> None: ...
