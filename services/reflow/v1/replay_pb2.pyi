from reflow.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ConfigureRequest(_message.Message):
    __slots__ = ("job_id", "replay_config_json")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REPLAY_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    replay_config_json: str
    def __init__(self, job_id: _Optional[str] = ..., replay_config_json: _Optional[str] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("job_id", "trajectories")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    trajectories: _containers.RepeatedCompositeFieldContainer[_common_pb2.Trajectory]
    def __init__(self, job_id: _Optional[str] = ..., trajectories: _Optional[_Iterable[_Union[_common_pb2.Trajectory, _Mapping]]] = ...) -> None: ...

class PutReply(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    def __init__(self, accepted: _Optional[int] = ...) -> None: ...

class SampleRequest(_message.Message):
    __slots__ = ("job_id", "batch_size", "lease_ttl_s", "timeout_s")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    batch_size: int
    lease_ttl_s: float
    timeout_s: float
    def __init__(self, job_id: _Optional[str] = ..., batch_size: _Optional[int] = ..., lease_ttl_s: _Optional[float] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class SampleReply(_message.Message):
    __slots__ = ("lease_id", "trajectories", "policy_version")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    trajectories: _containers.RepeatedCompositeFieldContainer[_common_pb2.Trajectory]
    policy_version: int
    def __init__(self, lease_id: _Optional[str] = ..., trajectories: _Optional[_Iterable[_Union[_common_pb2.Trajectory, _Mapping]]] = ..., policy_version: _Optional[int] = ...) -> None: ...

class SampleStats(_message.Message):
    __slots__ = ("sample_id", "values")
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    sample_id: str
    values: _containers.ScalarMap[str, float]
    def __init__(self, sample_id: _Optional[str] = ..., values: _Optional[_Mapping[str, float]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("job_id", "lease_id", "stats")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    lease_id: str
    stats: _containers.RepeatedCompositeFieldContainer[SampleStats]
    def __init__(self, job_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., stats: _Optional[_Iterable[_Union[SampleStats, _Mapping]]] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class RenewLeaseRequest(_message.Message):
    __slots__ = ("job_id", "lease_id", "lease_ttl_s")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    lease_id: str
    lease_ttl_s: float
    def __init__(self, job_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., lease_ttl_s: _Optional[float] = ...) -> None: ...

class RenewLeaseReply(_message.Message):
    __slots__ = ("renewed",)
    RENEWED_FIELD_NUMBER: _ClassVar[int]
    renewed: bool
    def __init__(self, renewed: _Optional[bool] = ...) -> None: ...

class ReturnLeaseRequest(_message.Message):
    __slots__ = ("job_id", "lease_id", "all")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    ALL_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    lease_id: str
    all: bool
    def __init__(self, job_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., all: _Optional[bool] = ...) -> None: ...

class ReturnLeaseReply(_message.Message):
    __slots__ = ("returned",)
    RETURNED_FIELD_NUMBER: _ClassVar[int]
    returned: int
    def __init__(self, returned: _Optional[int] = ...) -> None: ...

class AcquireDispatchRequest(_message.Message):
    __slots__ = ("job_id", "want", "group_size", "outstanding_limit", "version_limit")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    WANT_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_LIMIT_FIELD_NUMBER: _ClassVar[int]
    VERSION_LIMIT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    want: int
    group_size: int
    outstanding_limit: int
    version_limit: int
    def __init__(self, job_id: _Optional[str] = ..., want: _Optional[int] = ..., group_size: _Optional[int] = ..., outstanding_limit: _Optional[int] = ..., version_limit: _Optional[int] = ...) -> None: ...

class AcquireDispatchReply(_message.Message):
    __slots__ = ("granted",)
    GRANTED_FIELD_NUMBER: _ClassVar[int]
    granted: int
    def __init__(self, granted: _Optional[int] = ...) -> None: ...

class PublishVersionRequest(_message.Message):
    __slots__ = ("job_id", "policy_version")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    policy_version: int
    def __init__(self, job_id: _Optional[str] = ..., policy_version: _Optional[int] = ...) -> None: ...

class BufferStats(_message.Message):
    __slots__ = ("unused_samples", "leased_samples", "policy_version", "put_total", "trained_total", "expired_leases_total", "outstanding_leases", "replay_samples", "trained_unused_total", "evicted_total", "dropped_total", "evicted_unused_total", "retired_total", "dispatched_total")
    UNUSED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LEASED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    PUT_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TRAINED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_LEASES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_LEASES_FIELD_NUMBER: _ClassVar[int]
    REPLAY_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TRAINED_UNUSED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    EVICTED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DROPPED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    EVICTED_UNUSED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    RETIRED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DISPATCHED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    unused_samples: int
    leased_samples: int
    policy_version: int
    put_total: int
    trained_total: int
    expired_leases_total: int
    outstanding_leases: int
    replay_samples: int
    trained_unused_total: int
    evicted_total: int
    dropped_total: int
    evicted_unused_total: int
    retired_total: int
    dispatched_total: int
    def __init__(self, unused_samples: _Optional[int] = ..., leased_samples: _Optional[int] = ..., policy_version: _Optional[int] = ..., put_total: _Optional[int] = ..., trained_total: _Optional[int] = ..., expired_leases_total: _Optional[int] = ..., outstanding_leases: _Optional[int] = ..., replay_samples: _Optional[int] = ..., trained_unused_total: _Optional[int] = ..., evicted_total: _Optional[int] = ..., dropped_total: _Optional[int] = ..., evicted_unused_total: _Optional[int] = ..., retired_total: _Optional[int] = ..., dispatched_total: _Optional[int] = ...) -> None: ...
