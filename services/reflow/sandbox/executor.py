"""One execution in the sandbox: the bubblewrap command line a sandbox starts
with, starting one (`Executor.spawn`), and running one request in a started one
(`Executor.run`): handing the request over, reading stdout and stderr under a cap,
killing the sandbox at its wall-clock limit, and reading how it ended as a status.

What a sandbox is. A runner (reflow.sandbox.runner) under `bwrap`, in pid, network,
IPC and UTS namespaces of its own (the network one holds a loopback of its own and
nothing else: every connect fails, the host's 127.0.0.1 included), with:
- a view, not the host's root: read-only /usr and /etc, the interpreter's prefixes,
  the operator's `readable_paths`, and the runner; a fresh /proc and /dev; a
  size-bounded private tmpfs at /tmp holding the program's scratch directory
  (/tmp/scratch: its working directory and HOME). The rest of the host (the
  repository, run directories, home directories) is not there at all.
- every secret path that falls inside that view covered: an empty read-only tmpfs
  over a directory, /dev/null over a file.
- an environment of a few fixed variables (`program_env`): nothing of the
  service's, credentials included, reaches it or its /proc/*/environ.
- a uid other than root. A non-root service runs bubblewrap as itself, which gives
  the program a user namespace of its own (uid `nobody` inside, the service's uid
  to the kernel: a file of the service's own inside the view is readable unless
  covered). A root service runs bubblewrap as root (so the view can hold an
  interpreter only root can reach, a pyenv under /root say) and the runner gives
  root up at its start (runner step 1): the program is the host's `nobody`, and
  reads only what anyone may. Either way RLIMIT_NPROC binds, counted per sandbox,
  no capability is left and none can be gained (no_new_privs).

How it ends (`classify`): exit 0 is `ok`; MemoryError, or SIGKILL (which only the
OOM killer sends: the CPU budget ends a program with SIGPROF or SIGXCPU,
reflow.sandbox.runner) is `memory`; SIGPROF, SIGXCPU or the wall clock is
`timeout`; more than `max_output_bytes` on stdout or stderr is `output_limit`;
anything else is `error`. bubblewrap reports a program killed by signal N as exit
128+N, as a shell does, so a program that exits 137 by itself reads as killed.
`cpu_s` is what the runner reports at its exit; for a program killed, what /proc
showed just before (killed by the service), its budget (killed for CPU) or 0.

It knows nothing of pools, queues, clamping or metrics (reflow.sandbox.pool,
reflow.sandbox.service). Its namespaces and view (`namespace_args`, `view_args`)
are also an isolated agent's (reflow.sandbox.isolate).
"""

from __future__ import annotations

import atexit
import json
import logging
import marshal
import os
import select
import selectors
import shutil
import signal
import subprocess  # nosec B404 # argv lists, no shell
import tempfile
import time
from dataclasses import dataclass

from reflow.core.errors import Unavailable
from reflow.sandbox import runner
from reflow.sandbox.types import (ERROR, MEMORY, OK, OUTPUT_LIMIT, TIMEOUT, ExecLimits,
                                  ExecRequest, ExecResult)

logger = logging.getLogger(__name__)

# Where the runner and the program's scratch directory are inside every sandbox.
RUNNER_PATH = "/.sandbox/runner.py"
# The sandbox's own tmpfs, not the host's /tmp; a directory of its own in it, so
# that the program's working directory holds its files only (a readable path
# under the host's /tmp shows up in /tmp too).
TMP_DIR = "/tmp"  # nosec B108
SCRATCH_DIR = "/tmp/scratch"  # nosec B108
# Read-only in every sandbox: the system's programs and libraries, and its
# configuration (what is secret in /etc is readable by root only, and the program
# is never root).
SYSTEM_DIRS = ("/usr", "/etc")
# Links into /usr on a merged-/usr system, directories on older ones.
SYSTEM_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# Prints what a sandbox must show of the interpreter (run outside the sandbox, once).
PROBE = ("import json, sys; print(json.dumps(sorted({sys.prefix, sys.base_prefix, "
         "sys.exec_prefix, sys.base_exec_prefix})))")
READ_CHUNK = 64 * 1024
# The request's format: readable by the runner on any Python 3.4 and later, the
# sandbox's interpreter being another than the service's.
MARSHAL_VERSION = 4
# A sandbox's interpreter starts in some 20 ms; this is for a loaded machine.
READY_TIMEOUT_S = 30.0
# What a failed start's stderr is quoted up to.
MAX_ERROR_CHARS = 2000


class SandboxUnavailable(Unavailable):
    """A sandbox that did not start, or broke before running the program (which
    never ran: the service can try another)."""


def program_env(python: str) -> dict[str, str]:
    """The whole environment of bubblewrap and so of the program: a PATH that finds
    the same interpreter first, HOME in the scratch directory, one thread per
    numeric library, few malloc arenas (each would reserve 64 MiB of the address
    space RLIMIT_AS bounds)."""
    bin_dir = os.path.dirname(os.path.abspath(python))
    return {"PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin", "HOME": SCRATCH_DIR,
            "TMPDIR": TMP_DIR, "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
            "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
            "MALLOC_ARENA_MAX": "2"}


def probe_prefixes(python: str) -> list[str]:
    """The prefixes of `python` (its venv and the installation beneath it)."""
    try:
        done = subprocess.run([python, "-I", "-c", PROBE], capture_output=True, text=True,  # nosec B603 # fixed probe
                              timeout=60, env={"PATH": os.defpath}, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise RuntimeError(f"sandbox python {python!r} does not run: {err}") from err
    if done.returncode != 0:
        raise RuntimeError(f"sandbox python {python!r} exited {done.returncode}: "
                           f"{done.stderr[-MAX_ERROR_CHARS:]}")
    return json.loads(done.stdout)


def _within(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def _ancestors(path: str) -> list[str]:
    parts = path.strip("/").split("/")[:-1]
    return ["/" + "/".join(parts[:i + 1]) for i in range(len(parts))]


def view_binds(python: str, prefixes: list[str], readable_paths: list[str]) -> list[str]:
    """Host paths bound read-only at the same place in every sandbox besides the
    system's: the interpreter's prefixes (as named and resolved: a venv finds its
    pyvenv.cfg by the path it was started from), its directory, `readable_paths`;
    none inside another, none that does not exist."""
    wanted = [os.path.dirname(os.path.abspath(python))]
    for path in [*prefixes, *readable_paths]:
        wanted += [os.path.abspath(path), os.path.realpath(path)]
    binds: list[str] = []
    for path in sorted(set(wanted)):  # a directory sorts before what it holds
        if not os.path.exists(path):
            logger.warning("sandbox: %s does not exist; programs will not see it", path)
        elif not any(_within(path, d) for d in [*SYSTEM_DIRS, *binds]):
            binds.append(path)
    return binds


def cover_args(secret_paths: list[str], visible: list[str], needed: list[str]) -> list[str]:
    """bubblewrap arguments that hide each secret path inside the view (`visible`);
    a secret path outside it is not there to hide. RuntimeError for one that holds
    something the sandbox runs on (`needed`)."""
    args: list[str] = []
    for path in sorted({os.path.realpath(p) for p in secret_paths}):
        for need in needed:
            if _within(need, path):
                raise RuntimeError(f"secret path {path} holds {need}, which every sandbox "
                                   "needs: list the secret files inside it instead")
        if not os.path.exists(path) or not any(_within(path, v) for v in visible):
            continue
        if os.path.isdir(path):
            args += ["--perms", "0555", "--size", "4096", "--tmpfs", path, "--remount-ro", path]
        else:
            args += ["--ro-bind", "/dev/null", path]
    return args


def namespace_args(privileged: bool, share_net: bool = False) -> list[str]:
    """bubblewrap's namespaces and capabilities: a pid, IPC and UTS namespace of
    its own, and a network one unless `share_net`; no capability left, but the
    two a root-started process needs to give root up (runner step 1)."""
    args = ["--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    if privileged:
        # Root, no user namespace here: the runner's own (runner step 1) follows.
        # It needs these two capabilities to become nobody, and loses them doing so.
        args += ["--unshare-pid", *([] if share_net else ["--unshare-net"]), "--unshare-ipc",
                 "--unshare-uts", "--unshare-cgroup-try",
                 "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        args += ["--unshare-all", *(["--share-net"] if share_net else []), "--unshare-user",
                 "--disable-userns", "--uid", str(runner.NOBODY_UID),
                 "--gid", str(runner.NOBODY_UID)]
    return args


def view_args(python: str, prefixes: list[str], readable_paths: list[str],
              secret_paths: list[str], scratch_bytes: int,
              runner_source: str | None = None) -> list[str]:
    """bubblewrap arguments that build the view (the module docstring's): the
    system's directories, the scratch tmpfs, the interpreter and `readable_paths`,
    the runner at RUNNER_PATH, every secret path inside covered, a fresh /proc and
    /dev, and a read-only root."""
    args: list[str] = []
    visible = [d for d in SYSTEM_DIRS if os.path.isdir(d)]
    for path in visible:
        args += ["--ro-bind", path, path]
    for link in SYSTEM_LINKS:
        if os.path.islink(link):
            args += ["--symlink", os.readlink(link), link]
        elif os.path.isdir(link):
            args += ["--ro-bind", link, link]
            visible.append(link)
    # The scratch tmpfs before the binds, so that one under the host's /tmp shows.
    args += ["--perms", "1777", "--size", str(scratch_bytes), "--tmpfs", TMP_DIR,
             "--perms", "1777", "--dir", SCRATCH_DIR]
    binds = view_binds(python, prefixes, readable_paths)
    made: set[str] = set()
    for path in binds:
        # bubblewrap makes missing parents 0700 when root: searchable for nobody.
        for parent in _ancestors(path):
            if parent not in made and not any(_within(parent, v) for v in visible):
                args += ["--perms", "0755", "--dir", parent]
                made.add(parent)
        args += ["--ro-bind", path, path]
        visible.append(path)
    args += ["--perms", "0755", "--dir", os.path.dirname(RUNNER_PATH),
             "--ro-bind", runner_source or os.path.realpath(runner.__file__), RUNNER_PATH]
    needed = [os.path.abspath(python), *prefixes, *readable_paths, *SYSTEM_DIRS]
    args += cover_args(secret_paths, visible, needed)
    return [*args, "--proc", "/proc", "--dev", "/dev", "--remount-ro", "/"]


def build_command(bwrap: str, python: str, prefixes: list[str], readable_paths: list[str],
                  secret_paths: list[str], scratch_bytes: int, privileged: bool,
                  runner_source: str | None = None) -> list[str]:
    """The command line every sandbox starts with (the limits come per request)."""
    return [bwrap, *namespace_args(privileged), "--hostname", "sandbox",
            *view_args(python, prefixes, readable_paths, secret_paths, scratch_bytes,
                       runner_source),
            "--chdir", SCRATCH_DIR, os.path.abspath(python), "-I", "-B", RUNNER_PATH]


@dataclass
class Sandbox:
    """A started sandbox; it runs one program, then is discarded."""

    proc: subprocess.Popen
    status_fd: int  # read end of the runner's status pipe
    started_at: float

    def kill(self) -> None:
        """The whole sandbox: bubblewrap's process group, and with bubblewrap's
        pid-1 (which dies with it) every process in its pid namespace."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def reap(self) -> int:
        """Wait for bubblewrap; its exit code. (Its rusage would not hold the
        program's: bubblewrap exits as its pid 1 reports the program's end,
        before it reaps pid 1.)"""
        if self.proc.returncode is None:
            _, status = os.waitpid(self.proc.pid, 0)
            self.proc.returncode = os.waitstatus_to_exitcode(status)
        return self.proc.returncode

    def tree_cpu_s(self) -> float:
        """CPU seconds of every process in the sandbox now, from /proc."""
        ticks, stack = 0, [self.proc.pid]
        while stack:
            pid = stack.pop()
            try:
                with open(f"/proc/{pid}/stat", encoding="ascii") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                ticks += sum(int(v) for v in fields[11:15])  # utime stime cutime cstime
                for tid in os.listdir(f"/proc/{pid}/task"):
                    with open(f"/proc/{pid}/task/{tid}/children", encoding="ascii") as f:
                        stack += [int(child) for child in f.read().split()]
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile
        return ticks / os.sysconf("SC_CLK_TCK")

    def reported_cpu_s(self) -> float | None:
        """What the runner wrote to its status pipe at exit, once it is gone."""
        poller = select.poll()
        poller.register(self.status_fd, select.POLLIN)
        # The report is one small write, there before bubblewrap exits; without
        # one, the pipe closes as the sandbox's last process goes, moments later.
        if not poller.poll(1000):
            return None
        try:
            return float(os.read(self.status_fd, 64))
        except ValueError:
            return None  # killed, os._exit, or the program wrote there itself

    def close(self) -> None:
        if self.proc.returncode is None:
            self.kill()
            self.reap()
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()
        if self.status_fd >= 0:
            os.close(self.status_fd)
            self.status_fd = -1


def encode_request(request: ExecRequest, limits: ExecLimits) -> bytes:
    """The runner's request (reflow.sandbox.runner step 2)."""
    body = marshal.dumps({"code": request.code, "stdin": request.stdin,
                          "files": dict(request.files), "limits": limits.model_dump()},
                         MARSHAL_VERSION)
    return len(body).to_bytes(8, "big") + body


def classify(exit_code: int) -> tuple[str, int]:
    """The status of a program that ended by itself (the module docstring's
    table) and its exit code as subprocess reports one: negative, the signal."""
    if exit_code == 0:
        return OK, 0
    if exit_code == runner.EXIT_MEMORY:
        return MEMORY, 1
    if exit_code > 128:
        sig = exit_code - 128
        if sig in (signal.SIGPROF, signal.SIGXCPU):
            return TIMEOUT, -sig
        if sig == signal.SIGKILL:
            return MEMORY, -sig
        return ERROR, -sig
    return ERROR, exit_code


def _decode(data: bytes | bytearray) -> str:
    return bytes(data).decode("utf-8", errors="replace")


def _public_runner() -> str:
    """A copy of the runner that nobody can read, for a root service that runs
    bubblewrap as nobody: its own copy may lie under a directory only root can
    enter (a checkout in a 0700 temporary directory, a pyenv under /root).
    Removed when the process exits."""
    directory = tempfile.mkdtemp(prefix="reflow-sandbox-runner-")
    atexit.register(shutil.rmtree, directory, True)
    os.chmod(directory, 0o755)  # nosec B103 # nobody must enter it; it holds no secret
    copy = os.path.join(directory, "runner.py")
    shutil.copyfile(os.path.realpath(runner.__file__), copy)
    os.chmod(copy, 0o644)  # nosec B103 # the runner's source, public
    return copy


class Executor:
    """Starts sandboxes (`spawn`) and runs one request in one (`run`). Stateless
    past its command line: any number of threads may use it at once."""

    def __init__(self, bwrap: str, python: str, secret_paths: list[str],
                 readable_paths: list[str], scratch_bytes: int,
                 privileged: bool | None = None) -> None:
        is_root = os.geteuid() == 0
        self.privileged = is_root if privileged is None else privileged
        if self.privileged and not is_root:
            raise ValueError("privileged: true needs a service that runs as root")
        self.python = python
        # A root service that runs bubblewrap unprivileged runs it as nobody.
        self._user = runner.NOBODY_UID if is_root and not self.privileged else None
        runner_source = _public_runner() if self._user is not None else None
        self.argv = build_command(bwrap, python, probe_prefixes(python), readable_paths,
                                  secret_paths, scratch_bytes, self.privileged, runner_source)
        self.env = program_env(python)

    def spawn(self) -> Sandbox:
        """Start a sandbox; its interpreter comes up while nobody waits for it."""
        kwargs = {}
        if self._user is not None:
            kwargs = {"user": self._user, "group": self._user, "extra_groups": []}
        status_r, status_w = os.pipe()
        try:
            proc = subprocess.Popen([*self.argv, str(status_w)], stdin=subprocess.PIPE,  # nosec B603 # built here
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0,
                                    env=self.env, start_new_session=True, close_fds=True,
                                    pass_fds=(status_w,), **kwargs)
        except BaseException:
            os.close(status_r)
            raise
        finally:
            os.close(status_w)
        return Sandbox(proc, status_r, time.monotonic())

    def run(self, sandbox: Sandbox, request: ExecRequest, limits: ExecLimits) -> ExecResult:
        """Run `request` in `sandbox` (which is spent afterwards) under `limits`.
        SandboxUnavailable if the sandbox never got as far as the program."""
        try:
            self._await_ready(sandbox)
            start = time.monotonic()
            try:
                payload = memoryview(encode_request(request, limits))
                while payload:  # a raw write may take part of it
                    payload = payload[sandbox.proc.stdin.write(payload):]
                sandbox.proc.stdin.close()
            except BrokenPipeError as err:
                raise SandboxUnavailable(f"sandbox closed its input: {self._failure(sandbox)}"
                                         ) from err
            stdout, stderr, killed_for = self._collect(sandbox, limits, start + limits.wall_s)
            cpu_s = 0.0
            if killed_for:
                cpu_s = sandbox.tree_cpu_s()
                sandbox.kill()
            exit_code = sandbox.reap()
            wall_s = time.monotonic() - start
            if killed_for:
                status, exit_code = killed_for, -signal.SIGKILL
            else:
                status, exit_code = classify(exit_code)
                reported = sandbox.reported_cpu_s()
                if reported is not None:
                    cpu_s = reported
                elif status == TIMEOUT:
                    cpu_s = limits.cpu_s
        finally:
            sandbox.close()
        return ExecResult(status=status, exit_code=exit_code, stdout=_decode(stdout),
                          stderr=_decode(stderr), wall_s=wall_s, cpu_s=cpu_s,
                          truncated=killed_for == OUTPUT_LIMIT)

    def _await_ready(self, sandbox: Sandbox) -> None:
        fd = sandbox.proc.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        if not poller.poll(READY_TIMEOUT_S * 1000):
            raise SandboxUnavailable(f"sandbox not ready after {READY_TIMEOUT_S:.0f} s")
        if os.read(fd, 1) != runner.READY:
            raise SandboxUnavailable(f"sandbox did not start: {self._failure(sandbox)}")

    @staticmethod
    def _failure(sandbox: Sandbox) -> str:
        """What a sandbox that failed to start said (bubblewrap's or the runner's
        stderr), once it is dead."""
        sandbox.kill()
        code = sandbox.reap()
        text = _decode(sandbox.proc.stderr.read(MAX_ERROR_CHARS * 4) or b"").strip()
        return f"exit {code}: {text[-MAX_ERROR_CHARS:] or '(nothing on stderr)'}"

    @staticmethod
    def _collect(sandbox: Sandbox, limits: ExecLimits,
                 deadline: float) -> tuple[bytearray, bytearray, str]:
        """Read stdout and stderr until the sandbox has exited and both are closed;
        each capped at max_output_bytes. Returns them and, where the sandbox must
        be killed, why (TIMEOUT, OUTPUT_LIMIT), else ""."""
        cap = limits.max_output_bytes
        proc = sandbox.proc
        outputs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
        # Becomes readable when bubblewrap exits: a program that closes its output
        # and lives on is still waited for only up to the deadline.
        pidfd = os.pidfd_open(proc.pid)
        try:
            with selectors.DefaultSelector() as selector:
                for fd in (*outputs, pidfd):
                    selector.register(fd, selectors.EVENT_READ)
                while selector.get_map():
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return *outputs.values(), TIMEOUT
                    for key, _ in selector.select(remaining):
                        if key.fd == pidfd:
                            selector.unregister(pidfd)
                            continue
                        chunk = os.read(key.fd, READ_CHUNK)
                        if not chunk:
                            selector.unregister(key.fd)
                            continue
                        buffer = outputs[key.fd]
                        buffer += chunk
                        if len(buffer) > cap:
                            del buffer[cap:]
                            return *outputs.values(), OUTPUT_LIMIT
        finally:
            os.close(pidfd)
        return *outputs.values(), ""
