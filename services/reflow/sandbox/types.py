"""What one execution in the sandbox is: the program and its inputs
(`ExecRequest`), the bounds it runs under (`ExecLimits`), and what came of it
(`ExecResult`). Shared by the executor, the service, its transport and every
caller (tasks, environments); it knows nothing of how isolation is done."""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

# ExecResult.status values.
OK = "ok"                    # exited 0
ERROR = "error"              # exited non-zero or raised (the traceback is in stderr)
TIMEOUT = "timeout"          # past its wall-clock or CPU-time limit, killed
MEMORY = "memory"            # past its memory limit (MemoryError or killed for it)
OUTPUT_LIMIT = "output_limit"  # wrote more than max_output_bytes, killed
STATUSES = (OK, ERROR, TIMEOUT, MEMORY, OUTPUT_LIMIT)

MAX_CODE_BYTES = 256 * 1024
MAX_STDIN_BYTES = 1024 * 1024
MAX_FILES = 32
MAX_FILE_BYTES = 1024 * 1024


class ExecLimits(BaseModel):
    """The bounds of one execution. A caller may ask for less than the service's
    own maxima (reflow.sandbox.service), never more: the service clamps."""

    model_config = ConfigDict(extra="forbid")

    wall_s: float = Field(default=10.0, gt=0.0, le=600.0,
                          description="Wall-clock seconds before the program is killed "
                          "(status `timeout`).")
    cpu_s: float = Field(default=10.0, gt=0.0, le=600.0,
                         description="CPU seconds, all threads together (RLIMIT_CPU), before "
                         "it is killed (status `timeout`).")
    memory_bytes: int = Field(default=512 * 2**20, ge=16 * 2**20, le=64 * 2**30,
                              description="Address space (RLIMIT_AS); an allocation past it "
                              "fails (status `memory`).")
    max_processes: int = Field(default=16, ge=1, le=1024,
                               description="Processes and threads the program may hold at "
                               "once (RLIMIT_NPROC in its own user namespace).")
    max_file_bytes: int = Field(default=16 * 2**20, ge=0, le=2**30,
                                description="Largest file it may write in its scratch "
                                "directory (RLIMIT_FSIZE).")
    max_output_bytes: int = Field(default=2**20, ge=1024, le=64 * 2**20,
                                  description="stdout and stderr each are cut here, and a "
                                  "program writing past it is killed (status `output_limit`).")


@dataclass(frozen=True)
class ExecRequest:
    """A Python program to run: `code` is the script (run as `__main__`), `stdin`
    its standard input, `files` more files (relative name -> text) written into its
    scratch directory, which is its working directory."""

    code: str
    stdin: str = ""
    files: dict[str, str] = field(default_factory=dict)
    limits: ExecLimits = field(default_factory=ExecLimits)

    def check(self) -> None:
        """ValueError naming the field for what the service refuses to run."""
        if len(self.code.encode()) > MAX_CODE_BYTES:
            raise ValueError(f"code: {len(self.code.encode())} bytes, more than "
                             f"{MAX_CODE_BYTES}")
        if len(self.stdin.encode()) > MAX_STDIN_BYTES:
            raise ValueError(f"stdin: more than {MAX_STDIN_BYTES} bytes")
        if len(self.files) > MAX_FILES:
            raise ValueError(f"files: {len(self.files)} files, more than {MAX_FILES}")
        for name, text in self.files.items():
            parts = name.split("/")
            if (not name or name.startswith("/") or any(p in ("", ".", "..") for p in parts)
                    or "\0" in name or len(name) > 255):
                raise ValueError(f"files: {name[:80]!r} is not a relative path inside the "
                                 "scratch directory (no '..', no leading '/')")
            if len(text.encode()) > MAX_FILE_BYTES:
                raise ValueError(f"files[{name!r}]: more than {MAX_FILE_BYTES} bytes")


@dataclass(frozen=True)
class ExecResult:
    """What came of one execution. `stdout`/`stderr` are decoded with
    errors="replace" and cut at the limit (`truncated`)."""

    status: str
    exit_code: int = 0
    stdout: str = ""
    stderr: str = ""
    wall_s: float = 0.0
    cpu_s: float = 0.0
    truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.status == OK
