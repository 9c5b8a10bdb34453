from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Segment(_message.Message):
    __slots__ = ("policy_version", "num_tokens")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    num_tokens: int
    def __init__(self, policy_version: _Optional[int] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class Trajectory(_message.Message):
    __slots__ = ("sample_id", "group_id", "prompt_ids", "response_ids", "logprobs", "loss_mask", "segments", "reward", "advantage", "finish_reason", "created_at", "uses", "reward_error", "min_tokens")
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGE_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    USES_FIELD_NUMBER: _ClassVar[int]
    REWARD_ERROR_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    sample_id: str
    group_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    response_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    loss_mask: _containers.RepeatedScalarFieldContainer[int]
    segments: _containers.RepeatedCompositeFieldContainer[Segment]
    reward: float
    advantage: float
    finish_reason: str
    created_at: float
    uses: int
    reward_error: str
    min_tokens: int
    def __init__(self, sample_id: _Optional[str] = ..., group_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., response_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., loss_mask: _Optional[_Iterable[int]] = ..., segments: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ..., reward: _Optional[float] = ..., advantage: _Optional[float] = ..., finish_reason: _Optional[str] = ..., created_at: _Optional[float] = ..., uses: _Optional[int] = ..., reward_error: _Optional[str] = ..., min_tokens: _Optional[int] = ...) -> None: ...

class JobRef(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class StartJobRequest(_message.Message):
    __slots__ = ("job_id", "spec_json", "replay_address", "rollout_addresses", "run_dir", "weight_sync_rank", "weight_sync_world_size", "trainer_host", "trainer_peers", "leader_host", "resume_from")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    REPLAY_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    RUN_DIR_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_SYNC_RANK_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_SYNC_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    TRAINER_HOST_FIELD_NUMBER: _ClassVar[int]
    TRAINER_PEERS_FIELD_NUMBER: _ClassVar[int]
    LEADER_HOST_FIELD_NUMBER: _ClassVar[int]
    RESUME_FROM_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    spec_json: str
    replay_address: str
    rollout_addresses: _containers.RepeatedScalarFieldContainer[str]
    run_dir: str
    weight_sync_rank: int
    weight_sync_world_size: int
    trainer_host: str
    trainer_peers: _containers.RepeatedScalarFieldContainer[str]
    leader_host: str
    resume_from: str
    def __init__(self, job_id: _Optional[str] = ..., spec_json: _Optional[str] = ..., replay_address: _Optional[str] = ..., rollout_addresses: _Optional[_Iterable[str]] = ..., run_dir: _Optional[str] = ..., weight_sync_rank: _Optional[int] = ..., weight_sync_world_size: _Optional[int] = ..., trainer_host: _Optional[str] = ..., trainer_peers: _Optional[_Iterable[str]] = ..., leader_host: _Optional[str] = ..., resume_from: _Optional[str] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("ok", "message")
    OK_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    message: str
    def __init__(self, ok: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...
