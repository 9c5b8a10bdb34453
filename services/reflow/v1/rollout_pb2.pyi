from reflow.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScoreTokensRequest(_message.Message):
    __slots__ = ("job_id", "token_ids")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, job_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ScoreTokensReply(_message.Message):
    __slots__ = ("policy_version", "logprobs")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, policy_version: _Optional[int] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class SetSyncPlaceRequest(_message.Message):
    __slots__ = ("job_id", "rank", "world_size", "trainer_host")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    TRAINER_HOST_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    world_size: int
    trainer_host: str
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., trainer_host: _Optional[str] = ...) -> None: ...

class EvaluateRequest(_message.Message):
    __slots__ = ("job_id", "num_prompts", "greedy", "k", "temperature", "correct_threshold")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    GREEDY_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    CORRECT_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    num_prompts: int
    greedy: bool
    k: int
    temperature: float
    correct_threshold: float
    def __init__(self, job_id: _Optional[str] = ..., num_prompts: _Optional[int] = ..., greedy: _Optional[bool] = ..., k: _Optional[int] = ..., temperature: _Optional[float] = ..., correct_threshold: _Optional[float] = ...) -> None: ...

class EvalPromptOutcome(_message.Message):
    __slots__ = ("num_scored", "num_correct", "reward_sum", "num_errors", "majority_correct")
    NUM_SCORED_FIELD_NUMBER: _ClassVar[int]
    NUM_CORRECT_FIELD_NUMBER: _ClassVar[int]
    REWARD_SUM_FIELD_NUMBER: _ClassVar[int]
    NUM_ERRORS_FIELD_NUMBER: _ClassVar[int]
    MAJORITY_CORRECT_FIELD_NUMBER: _ClassVar[int]
    num_scored: int
    num_correct: int
    reward_sum: float
    num_errors: int
    majority_correct: bool
    def __init__(self, num_scored: _Optional[int] = ..., num_correct: _Optional[int] = ..., reward_sum: _Optional[float] = ..., num_errors: _Optional[int] = ..., majority_correct: _Optional[bool] = ...) -> None: ...

class EvaluateReply(_message.Message):
    __slots__ = ("reward_mean", "num_samples", "num_errors", "policy_version", "seconds", "k", "prompts", "voted")
    REWARD_MEAN_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    NUM_ERRORS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    VOTED_FIELD_NUMBER: _ClassVar[int]
    reward_mean: float
    num_samples: int
    num_errors: int
    policy_version: int
    seconds: float
    k: int
    prompts: _containers.RepeatedCompositeFieldContainer[EvalPromptOutcome]
    voted: bool
    def __init__(self, reward_mean: _Optional[float] = ..., num_samples: _Optional[int] = ..., num_errors: _Optional[int] = ..., policy_version: _Optional[int] = ..., seconds: _Optional[float] = ..., k: _Optional[int] = ..., prompts: _Optional[_Iterable[_Union[EvalPromptOutcome, _Mapping]]] = ..., voted: _Optional[bool] = ...) -> None: ...

class SubmitGroupRequest(_message.Message):
    __slots__ = ("job_id", "group_id", "prompt_id", "prompt_text", "prompt_answer", "concurrency_cap", "max_tokens", "min_tokens")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ANSWER_FIELD_NUMBER: _ClassVar[int]
    CONCURRENCY_CAP_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    group_id: str
    prompt_id: str
    prompt_text: str
    prompt_answer: str
    concurrency_cap: int
    max_tokens: int
    min_tokens: int
    def __init__(self, job_id: _Optional[str] = ..., group_id: _Optional[str] = ..., prompt_id: _Optional[str] = ..., prompt_text: _Optional[str] = ..., prompt_answer: _Optional[str] = ..., concurrency_cap: _Optional[int] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ...) -> None: ...

class SubmitGroupReply(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    def __init__(self, accepted: _Optional[bool] = ...) -> None: ...

class WaitSamplesRequest(_message.Message):
    __slots__ = ("job_id", "since_seq", "wait_s")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SINCE_SEQ_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    since_seq: int
    wait_s: float
    def __init__(self, job_id: _Optional[str] = ..., since_seq: _Optional[int] = ..., wait_s: _Optional[float] = ...) -> None: ...

class SampleEvent(_message.Message):
    __slots__ = ("seq", "group_id", "sample_index", "response_tokens", "prompt_tokens", "policy_version", "error")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    seq: int
    group_id: str
    sample_index: int
    response_tokens: int
    prompt_tokens: int
    policy_version: int
    error: str
    def __init__(self, seq: _Optional[int] = ..., group_id: _Optional[str] = ..., sample_index: _Optional[int] = ..., response_tokens: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., policy_version: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class SampleEvents(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[SampleEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[SampleEvent, _Mapping]]] = ...) -> None: ...

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
    __slots__ = ("job_id", "master_address", "master_port", "rank", "world_size", "backend", "tensors", "bucket_bytes", "tensor_parallel_size", "trainer_device_uuid", "rendezvous_key")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MASTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    TRAINER_DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_KEY_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    master_address: str
    master_port: int
    rank: int
    world_size: int
    backend: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    bucket_bytes: int
    tensor_parallel_size: int
    trainer_device_uuid: str
    rendezvous_key: str
    def __init__(self, job_id: _Optional[str] = ..., master_address: _Optional[str] = ..., master_port: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., backend: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., bucket_bytes: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., trainer_device_uuid: _Optional[str] = ..., rendezvous_key: _Optional[str] = ...) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("job_id", "policy_version", "resync")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    policy_version: int
    resync: bool
    def __init__(self, job_id: _Optional[str] = ..., policy_version: _Optional[int] = ..., resync: _Optional[bool] = ...) -> None: ...

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
    __slots__ = ("generated_tokens_total", "finished_samples_total", "idle_seconds_total", "inflight_samples", "policy_version", "state", "error", "occupancy_seconds_total", "engine_startup_s", "kv_usage_seconds_total", "preempted_requests_total", "kv_cache_tokens", "concurrency_cap", "engine_busy_seconds_total", "engine_decode_steps_total", "filtered_groups_total")
    GENERATED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    FINISHED_SAMPLES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    IDLE_SECONDS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    OCCUPANCY_SECONDS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ENGINE_STARTUP_S_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_SECONDS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONCURRENCY_CAP_FIELD_NUMBER: _ClassVar[int]
    ENGINE_BUSY_SECONDS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ENGINE_DECODE_STEPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    FILTERED_GROUPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    generated_tokens_total: int
    finished_samples_total: int
    idle_seconds_total: float
    inflight_samples: int
    policy_version: int
    state: str
    error: str
    occupancy_seconds_total: float
    engine_startup_s: float
    kv_usage_seconds_total: float
    preempted_requests_total: int
    kv_cache_tokens: int
    concurrency_cap: int
    engine_busy_seconds_total: float
    engine_decode_steps_total: int
    filtered_groups_total: int
    def __init__(self, generated_tokens_total: _Optional[int] = ..., finished_samples_total: _Optional[int] = ..., idle_seconds_total: _Optional[float] = ..., inflight_samples: _Optional[int] = ..., policy_version: _Optional[int] = ..., state: _Optional[str] = ..., error: _Optional[str] = ..., occupancy_seconds_total: _Optional[float] = ..., engine_startup_s: _Optional[float] = ..., kv_usage_seconds_total: _Optional[float] = ..., preempted_requests_total: _Optional[int] = ..., kv_cache_tokens: _Optional[int] = ..., concurrency_cap: _Optional[int] = ..., engine_busy_seconds_total: _Optional[float] = ..., engine_decode_steps_total: _Optional[int] = ..., filtered_groups_total: _Optional[int] = ...) -> None: ...
