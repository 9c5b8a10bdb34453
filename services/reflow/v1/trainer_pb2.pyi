from reflow.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class ReconfigureRequest(_message.Message):
    __slots__ = ("job_id", "trainer_peers", "rollout_addresses", "keep_peers", "scripted_flips")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TRAINER_PEERS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    KEEP_PEERS_FIELD_NUMBER: _ClassVar[int]
    SCRIPTED_FLIPS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    trainer_peers: _containers.RepeatedScalarFieldContainer[str]
    rollout_addresses: _containers.RepeatedScalarFieldContainer[str]
    keep_peers: bool
    scripted_flips: int
    def __init__(self, job_id: _Optional[str] = ..., trainer_peers: _Optional[_Iterable[str]] = ..., rollout_addresses: _Optional[_Iterable[str]] = ..., keep_peers: _Optional[bool] = ..., scripted_flips: _Optional[int] = ...) -> None: ...

class ReconfigureReply(_message.Message):
    __slots__ = ("membership_epoch",)
    MEMBERSHIP_EPOCH_FIELD_NUMBER: _ClassVar[int]
    membership_epoch: int
    def __init__(self, membership_epoch: _Optional[int] = ...) -> None: ...

class JoinGroupRequest(_message.Message):
    __slots__ = ("job_id", "master_port", "rank", "world_size", "membership_epoch", "rendezvous_key")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_EPOCH_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_KEY_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    master_port: int
    rank: int
    world_size: int
    membership_epoch: int
    rendezvous_key: str
    def __init__(self, job_id: _Optional[str] = ..., master_port: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., membership_epoch: _Optional[int] = ..., rendezvous_key: _Optional[str] = ...) -> None: ...

class LeaveGroupRequest(_message.Message):
    __slots__ = ("job_id", "membership_epoch")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_EPOCH_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    membership_epoch: int
    def __init__(self, job_id: _Optional[str] = ..., membership_epoch: _Optional[int] = ...) -> None: ...

class TrainerStatusRequest(_message.Message):
    __slots__ = ("job_id", "since_step")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SINCE_STEP_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    since_step: int
    def __init__(self, job_id: _Optional[str] = ..., since_step: _Optional[int] = ...) -> None: ...

class TrainerStatus(_message.Message):
    __slots__ = ("job_id", "state", "step", "policy_version", "last_metrics_json", "error", "metrics_json", "group_size", "membership_epoch", "last_regroup_s", "last_state_handoff")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_METRICS_JSON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    METRICS_JSON_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LAST_REGROUP_S_FIELD_NUMBER: _ClassVar[int]
    LAST_STATE_HANDOFF_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    state: str
    step: int
    policy_version: int
    last_metrics_json: str
    error: str
    metrics_json: _containers.RepeatedScalarFieldContainer[str]
    group_size: int
    membership_epoch: int
    last_regroup_s: float
    last_state_handoff: str
    def __init__(self, job_id: _Optional[str] = ..., state: _Optional[str] = ..., step: _Optional[int] = ..., policy_version: _Optional[int] = ..., last_metrics_json: _Optional[str] = ..., error: _Optional[str] = ..., metrics_json: _Optional[_Iterable[str]] = ..., group_size: _Optional[int] = ..., membership_epoch: _Optional[int] = ..., last_regroup_s: _Optional[float] = ..., last_state_handoff: _Optional[str] = ...) -> None: ...
