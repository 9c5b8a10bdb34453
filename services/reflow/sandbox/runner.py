"""The side of one execution that runs inside the sandbox: a warm interpreter that
waits for one program, runs it as `__main__` under the request's limits, and exits.

The executor (reflow.sandbox.executor) starts it under bubblewrap as
`python -I -B runner.py`. `-I` keeps the service's PYTHON* variables, the user site
and the script's own directory out; `-S` is not given, so the interpreter's
site-packages (numpy, sympy: read-only in the sandbox) stay importable, as a program
written for `python main.py` expects. The protocol, one request per process:

1. Where it starts as root (bubblewrap run by a root service, without a user
   namespace of its own), it gives root up first: uid and gid `nobody`, no groups,
   then a user namespace of its own and no capabilities. RLIMIT_NPROC never binds
   root (the kernel exempts uid 0), and in a user namespace of its own the count is
   this sandbox's alone (Linux 5.14 and later): the same two steps as
   reflow.tasks.confine takes for reward processes.
2. It writes READY (one byte) to stdout, then reads one request from stdin: an
   8-byte big-endian length, then that many bytes of a marshal'ed dict {code,
   stdin, files, limits} (format 4: any Python 3.4 and later reads it).
3. It writes the files into its working directory (the scratch tmpfs), puts the
   program's stdin in a memory file on fd 0, lowers its limits, and runs the code.
4. It exits as `python main.py` would (0, the SystemExit code, 1 after a
   traceback), except EXIT_MEMORY after a MemoryError and EXIT_SETUP when it
   could not get as far as the program. Last of all (an atexit hook, after the
   program's threads are joined) it writes the CPU seconds the program used to
   the status pipe named on its command line, as a decimal number; a program that
   dies by a signal or os._exit never gets there, and the executor then does
   without.

The CPU budget is a profiling timer (ITIMER_PROF: every thread's CPU time, to the
millisecond; SIGPROF ends the process), backed by a soft RLIMIT_CPU a second
later (SIGXCPU) for a program that ignores SIGPROF. No hard RLIMIT_CPU is set
below what is there: a program that ignores both spins until the wall clock, so a
SIGKILL only ever comes from the kernel's OOM killer.

It imports the standard library only, and little of it before the program runs
(json would pull in re, traceback a dozen modules: each a millisecond or more of
every sandbox's start); it knows nothing of the service: how the sandbox is
built, how output is read and how exits are read as statuses are the executor's.
"""

import atexit
import builtins
import marshal
import math
import os
import resource
import signal
import sys
import types

READY = b"R"
# Exit codes of the runner itself; the executor reads them as statuses.
EXIT_MEMORY = 121
EXIT_SETUP = 122
# The uid and gid a root-started runner takes (and bubblewrap maps others to).
NOBODY_UID = 65534
# The program's name in tracebacks and sys.argv[0].
PROGRAM_NAME = "main.py"
# A request is at most some 40 MB (reflow.sandbox.types bounds); anything far
# larger is not a request.
MAX_REQUEST_BYTES = 512 * 2**20

CLONE_NEWUSER = 0x10000000
CAPABILITY_VERSION_3 = 0x20080522


def drop_root() -> None:
    """Step 1. A no-op where bubblewrap already made this process someone else."""
    if os.getuid() != 0:
        return
    import ctypes

    class CapHeader(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class CapData(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    os.setgroups([])
    os.setresgid(NOBODY_UID, NOBODY_UID, NOBODY_UID)
    os.setresuid(NOBODY_UID, NOBODY_UID, NOBODY_UID)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(ctypes.c_int(CLONE_NEWUSER)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_NEWUSER): {os.strerror(err)}")
    # The new namespace gave this process every capability over it (and over
    # nothing else); it keeps none.
    data = (CapData * 2)()
    if libc.capset(ctypes.byref(CapHeader(CAPABILITY_VERSION_3, 0)), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


def _read_exactly(fd: int, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, min(n - len(buf), 1 << 20))
        if not chunk:
            raise EOFError(f"request cut short: {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def read_request(fd: int) -> dict:
    size = int.from_bytes(_read_exactly(fd, 8), "big")
    if size > MAX_REQUEST_BYTES:
        raise ValueError(f"request of {size} bytes")
    request = marshal.loads(_read_exactly(fd, size))  # nosec B302 # the service's pipe
    if not isinstance(request, dict):
        raise ValueError("request is not a dict")
    return request


def write_files(files: dict, scratch: str) -> None:
    """The request's files under `scratch`; names were checked by the service
    (ExecRequest.check) and are checked again here, as nothing may land outside."""
    for name, text in files.items():
        parts = name.split("/")
        if name.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"file name {name[:80]!r}")
        path = os.path.join(scratch, *parts)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with open(fd, "w", encoding="utf-8") as f:
            f.write(text)


def redirect_stdin(text: str) -> None:
    """The program's stdin: a memory file, so that no file of it shows in the
    scratch directory and any size fits without a writer beside the program."""
    fd = os.memfd_create("stdin", 0)
    data = text.encode("utf-8", "surrogateescape")
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    os.dup2(fd, 0)
    os.close(fd)


def _lower(which: int, soft: int, hard: int | None = None) -> None:
    """Set a limit, never above the hard limit already in force (which only root
    could raise, and this process is not root)."""
    hard = soft if hard is None else hard
    current = resource.getrlimit(which)[1]
    if current != resource.RLIM_INFINITY:
        soft, hard = min(soft, current), min(hard, current)
    resource.setrlimit(which, (soft, hard))


def _own_tasks() -> int:
    """Threads of every process in this user namespace: what RLIMIT_NPROC counts
    now (the runner, and bubblewrap's init where it shares the namespace)."""
    mine = os.readlink("/proc/self/ns/user")
    count = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{entry}/ns/user") == mine:
                count += len(os.listdir(f"/proc/{entry}/task"))
        except OSError:
            continue  # gone, or not ours to look at
    return count


def cpu_used_s() -> float:
    """CPU seconds of this process and the children it has reaped."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def apply_limits(limits: dict) -> None:
    _lower(resource.RLIMIT_CORE, 0)
    _lower(resource.RLIMIT_FSIZE, int(limits["max_file_bytes"]))
    _lower(resource.RLIMIT_AS, int(limits["memory_bytes"]))
    _lower(resource.RLIMIT_NPROC, _own_tasks() + int(limits["max_processes"]))
    cpu_s = float(limits["cpu_s"])
    # RLIMIT_CPU counts from the process's start, in whole seconds: the backstop
    # starts from what the runner used. Its hard limit is left where it is.
    used = resource.getrusage(resource.RUSAGE_SELF)
    soft = math.ceil(used.ru_utime + used.ru_stime + cpu_s) + 1
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))
    signal.setitimer(signal.ITIMER_PROF, cpu_s)


def report_cpu_at_exit(fd: int, start_s: float) -> None:
    """Step 4's report, to `fd` (kept from the program's children)."""
    os.set_inheritable(fd, False)

    def report() -> None:
        try:
            os.write(fd, repr(max(0.0, cpu_used_s() - start_s)).encode())
        except (OSError, ValueError):
            pass  # the program closed it: the executor does without

    atexit.register(report)


def _report(exc: BaseException, code: str) -> None:
    """The traceback as `python main.py` prints it: the runner's frame left out,
    the program's lines shown."""
    tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
    try:
        import linecache
        import traceback

        linecache.cache[PROGRAM_NAME] = (len(code), None, code.splitlines(True), PROGRAM_NAME)
        traceback.print_exception(type(exc), exc, tb)
        sys.stderr.flush()
    except BaseException:  # noqa: BLE001 - out of memory even for this
        os.write(2, f"{type(exc).__name__}\n".encode())


def run_program(code: str, scratch: str) -> None:
    """Run `code` as __main__ with `scratch` first on sys.path. Returns normally,
    or raises SystemExit with the exit code."""
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=PROGRAM_NAME, __builtins__=builtins)
    sys.modules["__main__"] = main
    sys.argv[:] = [PROGRAM_NAME]
    sys.path.insert(0, scratch)
    try:
        exec(compile(code, PROGRAM_NAME, "exec"), main.__dict__)  # nosec B102 # the point
    except SystemExit:
        raise
    except MemoryError as exc:
        # What the program holds in its globals goes first: the report needs memory.
        main.__dict__.clear()
        _report(exc, code)
        raise SystemExit(EXIT_MEMORY) from None
    except BaseException as exc:  # noqa: BLE001 - the program's failure, reported as Python does
        _report(exc, code)
        raise SystemExit(1) from None


def main() -> None:
    try:
        drop_root()
    except OSError as err:
        print(f"sandbox: could not give up root: {err}", file=sys.stderr, flush=True)
        os._exit(EXIT_SETUP)
    os.write(1, READY)
    scratch = os.getcwd()
    try:
        request = read_request(0)
        report_cpu_at_exit(int(sys.argv[1]), cpu_used_s())
        files = request.get("files") or {}
        # The program as a file too (multiprocessing's spawn, inspect, open(__file__)
        # read it there), unless the request brings a main.py of its own.
        write_files({PROGRAM_NAME: request["code"], **files}, scratch)
        redirect_stdin(request.get("stdin") or "")
        apply_limits(request["limits"])
        code = request["code"]
    except (OSError, ValueError, TypeError, EOFError, KeyError, IndexError) as err:
        print(f"sandbox: could not set the program up: {err}", file=sys.stderr, flush=True)
        os._exit(EXIT_SETUP)
    # The files and stdin are written: what is left of the request would only
    # count against the program's memory.
    del request
    run_program(code, scratch)
    # The interpreter's own exit follows: non-daemon threads are joined, atexit
    # handlers run and stdout is flushed, as for `python main.py`.


if __name__ == "__main__":
    main()
