"""The sandbox service's core: `SandboxService.execute` runs one request, blocking,
from any number of threads; at most `max_concurrent` run at once and the rest
wait in line (up to `max_queued`). Each request is checked (ValueError naming the
field) and its limits clamped to the service's maxima before it runs. Its
settings (`SandboxSettings`) come from REFLOW_SANDBOX_* variables.

It owns admission, clamping, retries of sandboxes that failed to start, counters
and metrics; how a program is isolated and read is reflow.sandbox.executor's, the
warm sandboxes reflow.sandbox.pool's. It never imports gRPC (server.py is the
transport).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import threading
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, field_validator

from reflow.core.errors import ResourceExhausted, Unavailable
from reflow.sandbox.executor import Executor, SandboxUnavailable
from reflow.sandbox.metrics import SandboxMetrics
from reflow.sandbox.pool import WarmPool
from reflow.sandbox.types import OK, STATUSES, ExecLimits, ExecRequest, ExecResult

logger = logging.getLogger(__name__)

ENV_PREFIX = "REFLOW_SANDBOX_"
# REFLOW_SANDBOX_* variables that are not the service's settings (the callers' one).
OTHER_ENV = ("REFLOW_SANDBOX_ADDRESS",)
# Settings given as os.pathsep-separated lists.
LIST_FIELDS = ("secret_paths", "readable_paths")
# Secret paths named elsewhere in the service's environment (as reward processes
# read them, reflow.tasks.confine): the list `reflow run` and the chart set, the
# run's TLS directory, credential files by variable, and the usual secret mounts.
SECRET_PATHS_ENV = "REFLOW_SECRET_PATHS"  # nosec B105 # a variable's name
SECRET_DIR_ENV = ("REFLOW_TLS_DIR",)
SECRET_FILE_ENV = ("GOOGLE_APPLICATION_CREDENTIALS", "HF_TOKEN_PATH")
ALWAYS_SECRET = ("/var/run/secrets", "/run/secrets")
# Sandboxes that fail to start in a row before a request is answered Unavailable.
START_ATTEMPTS = 3


class SandboxSettings(BaseModel):
    """The sandbox service's settings; each field is REFLOW_SANDBOX_<FIELD> in
    `from_env`. The max_* fields bound what any request may ask for."""

    model_config = ConfigDict(extra="forbid")

    pool_size: int = Field(default=4, ge=0, le=256, description="Sandboxes kept started "
                           "and waiting for a program (0: every execution starts its own).")
    max_concurrent: int = Field(default=4, ge=1, le=1024, description="Executions that run "
                                "at once; more wait in line.")
    max_queued: int = Field(default=1024, ge=0, le=100_000, description="Requests that may "
                            "wait in line for a slot; one more is refused (ResourceExhausted, "
                            "to retry).")
    max_wall_s: float = Field(default=60.0, gt=0.0, le=600.0,
                              description="Largest wall-clock limit, seconds.")
    max_cpu_s: float = Field(default=60.0, gt=0.0, le=600.0,
                             description="Largest CPU-time limit, seconds.")
    max_memory_bytes: int = Field(default=2 * 2**30, ge=16 * 2**20, le=64 * 2**30,
                                  description="Largest address-space limit (RLIMIT_AS).")
    max_processes: int = Field(default=64, ge=1, le=1024, description="Largest number of "
                               "processes and threads a program may hold.")
    max_file_bytes: int = Field(default=64 * 2**20, ge=0, le=2**30,
                                description="Largest file a program may write.")
    max_output_bytes: int = Field(default=8 * 2**20, ge=1024, le=64 * 2**20,
                                  description="Largest stdout (and stderr) kept.")
    scratch_bytes: int = Field(default=64 * 2**20, ge=2**20, le=16 * 2**30,
                               description="Size of each sandbox's scratch tmpfs (/tmp, its "
                               "working directory), in memory: files, the request's included.")
    bwrap: str = Field(default="bwrap", min_length=1,
                       description="bubblewrap: a path, or a name on PATH.")
    python: str = Field(default="", description="The interpreter programs run with, a path "
                        "or a name on PATH; empty: this service's own. Its prefixes (venv, "
                        "site-packages) are visible read-only.")
    secret_paths: list[str] = Field(default_factory=list, description="Files and "
                                    "directories hidden from programs wherever they fall "
                                    "inside a sandbox's view (absolute paths).")
    readable_paths: list[str] = Field(default_factory=list, description="More host paths "
                                      "programs may read (datasets, say), read-only.")
    privileged: bool | None = Field(default=None, description="Run bubblewrap as root, the "
                                    "runner dropping to nobody inside (needed where only "
                                    "root reaches the interpreter); false: as nobody. Unset: "
                                    "as root when the service is root. Only a root service "
                                    "may set it.")

    @field_validator("secret_paths", "readable_paths")
    @classmethod
    def _absolute(cls, paths: list[str]) -> list[str]:
        for path in paths:
            if not os.path.isabs(path) or "\0" in path:
                raise ValueError(f"{path[:80]!r} is not an absolute path")
        return paths

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> SandboxSettings:
        """Settings from REFLOW_SANDBOX_<FIELD> variables (lists os.pathsep-separated;
        `privileged` true, false or auto), plus the secret paths the environment
        names elsewhere (SECRET_PATHS_ENV and the like). ValueError naming an unknown
        variable or a bad value."""
        env = dict(os.environ if env is None else env)
        values: dict[str, object] = {}
        for name, raw in env.items():
            if not name.startswith(ENV_PREFIX) or name in OTHER_ENV:
                continue
            field = name[len(ENV_PREFIX):].lower()
            if field not in cls.model_fields:
                raise ValueError(f"{name}: not a sandbox setting (known: "
                                 f"{', '.join(ENV_PREFIX + f.upper() for f in cls.model_fields)})")
            if field in LIST_FIELDS:
                values[field] = [p for p in raw.split(os.pathsep) if p]
            elif field == "privileged" and raw.strip().lower() in ("", "auto"):
                values[field] = None
            else:
                values[field] = raw
        values["secret_paths"] = [*values.get("secret_paths", []), *named_secret_paths(env)]
        return cls.model_validate(values)


def named_secret_paths(env: dict[str, str]) -> list[str]:
    """Secret paths the environment names besides REFLOW_SANDBOX_SECRET_PATHS."""
    paths = env.get(SECRET_PATHS_ENV, "").split(os.pathsep)
    paths += [env.get(name, "") for name in (*SECRET_DIR_ENV, *SECRET_FILE_ENV)]
    paths += [value for name, value in env.items() if name.endswith("_FILE")]
    paths += ALWAYS_SECRET
    return sorted({p for p in paths if p and os.path.isabs(p)})


@dataclass(frozen=True)
class SandboxStats:
    executions_total: dict[str, int]  # finished executions, by status
    running: int
    max_concurrent: int
    rejected_total: int  # refused before running: invalid, or the queue full
    queued: int
    warm_processes: int
    cold_starts_total: int


def _resolve(program: str, what: str) -> str:
    path = shutil.which(program)
    if path is None:
        raise RuntimeError(f"{what} {program!r} not found")
    return os.path.abspath(path)


class SandboxService:
    def __init__(self, settings: SandboxSettings | None = None,
                 metrics: SandboxMetrics | None = None) -> None:
        """Builds the sandbox's command line, runs one program cold to prove it
        works (RuntimeError saying what is missing otherwise), then fills the pool."""
        self.settings = settings = settings or SandboxSettings()
        try:
            bwrap = _resolve(settings.bwrap, "bubblewrap")
        except RuntimeError as err:
            raise RuntimeError(f"{err}: the sandbox runs every program under bubblewrap; "
                               "install it (apt-get install bubblewrap) or set "
                               f"{ENV_PREFIX}BWRAP to its path") from None
        python = _resolve(settings.python, "python") if settings.python else sys.executable
        self.metrics = metrics or SandboxMetrics()
        self.executor = Executor(bwrap, python, settings.secret_paths, settings.readable_paths,
                                 settings.scratch_bytes, settings.privileged)
        self._check_start()
        self.pool = WarmPool(self.executor.spawn, settings.pool_size,
                             on_change=self.metrics.warm_processes.set,
                             on_cold_start=self.metrics.cold_starts.inc).start()
        self._slots = threading.Semaphore(settings.max_concurrent)
        self._lock = threading.Lock()
        self._closed = False
        self._queued = self._running = self._rejected = 0
        self._counts = dict.fromkeys(STATUSES, 0)
        logger.info("sandbox: ready (%s bubblewrap, %d warm, %d at once, python %s)",
                    "privileged" if self.executor.privileged else "unprivileged",
                    settings.pool_size, settings.max_concurrent, python)

    def _check_start(self) -> None:
        try:
            result = self.executor.run(self.executor.spawn(), ExecRequest("print('ok')"),
                                       ExecLimits(wall_s=30.0))
        except SandboxUnavailable as err:
            raise RuntimeError(f"the sandbox cannot start a program: {err}") from None
        if result.status != OK or result.stdout != "ok\n":
            raise RuntimeError(f"the sandbox's first program ended {result.status} "
                               f"(exit {result.exit_code}): {result.stderr[-2000:]}")

    def clamp(self, limits: ExecLimits) -> ExecLimits:
        """`limits`, none above the service's maxima."""
        s = self.settings
        return limits.model_copy(update={
            "wall_s": min(limits.wall_s, s.max_wall_s), "cpu_s": min(limits.cpu_s, s.max_cpu_s),
            "memory_bytes": min(limits.memory_bytes, s.max_memory_bytes),
            "max_processes": min(limits.max_processes, s.max_processes),
            "max_file_bytes": min(limits.max_file_bytes, s.max_file_bytes),
            "max_output_bytes": min(limits.max_output_bytes, s.max_output_bytes)})

    def execute(self, request: ExecRequest) -> ExecResult:
        """Run one program and wait for its result. ValueError for a request the
        service refuses, ResourceExhausted when the line is full, Unavailable when
        closed or when sandboxes fail to start."""
        try:
            request.check()
        except ValueError:
            self._reject()
            raise
        limits = self.clamp(request.limits)
        if not self._slots.acquire(blocking=False):
            self._enter_queue()
            try:
                self._slots.acquire()
            finally:
                self._leave_queue()
        try:
            with self._lock:
                if self._closed:
                    raise Unavailable("the sandbox service is closed")
                self._running += 1
            self.metrics.running.inc()
            try:
                result = self._run(request, limits)
            finally:
                with self._lock:
                    self._running -= 1
                self.metrics.running.dec()
        finally:
            self._slots.release()
        with self._lock:
            self._counts[result.status] += 1
        self.metrics.observe(result)
        return result

    def _run(self, request: ExecRequest, limits: ExecLimits) -> ExecResult:
        error: SandboxUnavailable | None = None
        for _ in range(START_ATTEMPTS):
            try:
                return self.executor.run(self.pool.take(), request, limits)
            except SandboxUnavailable as err:
                logger.warning("sandbox: a sandbox failed before its program ran: %s", err)
                error = err
        raise Unavailable(f"the sandbox failed to start a program {START_ATTEMPTS} times in "
                          f"a row; the last: {error}")

    def _enter_queue(self) -> None:
        with self._lock:
            if self._closed:
                raise Unavailable("the sandbox service is closed")
            if self._queued >= self.settings.max_queued:
                self._rejected += 1
                self.metrics.rejected.inc()
                raise ResourceExhausted(f"the sandbox's line is full ({self._queued} requests "
                                        f"waiting, max_queued {self.settings.max_queued})")
            self._queued += 1
            self.metrics.queue_depth.set(self._queued)

    def _leave_queue(self) -> None:
        with self._lock:
            self._queued -= 1
            self.metrics.queue_depth.set(self._queued)

    def _reject(self) -> None:
        with self._lock:
            self._rejected += 1
        self.metrics.rejected.inc()

    def stats(self) -> SandboxStats:
        with self._lock:
            return SandboxStats(
                executions_total=dict(self._counts), running=self._running,
                max_concurrent=self.settings.max_concurrent, rejected_total=self._rejected,
                queued=self._queued, warm_processes=self.pool.num_warm,
                cold_starts_total=self.pool.num_cold_starts)

    def close(self) -> None:
        """Refuse new requests and end the waiting sandboxes; executions running now
        finish."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.pool.close()
