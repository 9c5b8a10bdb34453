from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ExecLimits(_message.Message):
    __slots__ = ("wall_s", "cpu_s", "memory_bytes", "max_processes", "max_file_bytes", "max_output_bytes")
    WALL_S_FIELD_NUMBER: _ClassVar[int]
    CPU_S_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_PROCESSES_FIELD_NUMBER: _ClassVar[int]
    MAX_FILE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_OUTPUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    wall_s: float
    cpu_s: float
    memory_bytes: int
    max_processes: int
    max_file_bytes: int
    max_output_bytes: int
    def __init__(self, wall_s: _Optional[float] = ..., cpu_s: _Optional[float] = ..., memory_bytes: _Optional[int] = ..., max_processes: _Optional[int] = ..., max_file_bytes: _Optional[int] = ..., max_output_bytes: _Optional[int] = ...) -> None: ...

class ExecuteRequest(_message.Message):
    __slots__ = ("job_id", "code", "stdin", "files", "limits")
    class FilesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    STDIN_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    code: str
    stdin: str
    files: _containers.ScalarMap[str, str]
    limits: ExecLimits
    def __init__(self, job_id: _Optional[str] = ..., code: _Optional[str] = ..., stdin: _Optional[str] = ..., files: _Optional[_Mapping[str, str]] = ..., limits: _Optional[_Union[ExecLimits, _Mapping]] = ...) -> None: ...

class ExecuteReply(_message.Message):
    __slots__ = ("status", "exit_code", "stdout", "stderr", "wall_s", "cpu_s", "truncated")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    WALL_S_FIELD_NUMBER: _ClassVar[int]
    CPU_S_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    status: str
    exit_code: int
    stdout: str
    stderr: str
    wall_s: float
    cpu_s: float
    truncated: bool
    def __init__(self, status: _Optional[str] = ..., exit_code: _Optional[int] = ..., stdout: _Optional[str] = ..., stderr: _Optional[str] = ..., wall_s: _Optional[float] = ..., cpu_s: _Optional[float] = ..., truncated: _Optional[bool] = ...) -> None: ...

class SandboxStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SandboxStats(_message.Message):
    __slots__ = ("executions_total", "running", "max_concurrent", "rejected_total", "queued", "warm_processes", "cold_starts_total")
    class ExecutionsTotalEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    EXECUTIONS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENT_FIELD_NUMBER: _ClassVar[int]
    REJECTED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    WARM_PROCESSES_FIELD_NUMBER: _ClassVar[int]
    COLD_STARTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    executions_total: _containers.ScalarMap[str, int]
    running: int
    max_concurrent: int
    rejected_total: int
    queued: int
    warm_processes: int
    cold_starts_total: int
    def __init__(self, executions_total: _Optional[_Mapping[str, int]] = ..., running: _Optional[int] = ..., max_concurrent: _Optional[int] = ..., rejected_total: _Optional[int] = ..., queued: _Optional[int] = ..., warm_processes: _Optional[int] = ..., cold_starts_total: _Optional[int] = ...) -> None: ...
