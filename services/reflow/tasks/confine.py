"""What a reward process may see and do: its environment (an allow-list), its
resource limits and, where the kernel allows it, namespaces without network
and without a view of the worker's processes.

A reward scores model-written text, and soon runs model-written code, so the
process that calls it is treated as hostile once it has built its task. The
rollout worker starts it with `environment()` (exec'ed with it: nothing of the
worker's environment, credentials included, ever reaches the process or its
/proc/self/environ), and the process confines itself with `confine()` as its
first action, before it imports the task (reflow.tasks.reward_child):

1. Limits (`RewardLimits`): RLIMIT_AS, RLIMIT_FSIZE, RLIMIT_CORE 0 and RLIMIT_CPU:
   the hard limit bounds the process's whole life (it retires before it gets
   there, reflow.tasks.rewards), the soft limit is re-armed before each call
   (`call_budget`) so one call's threads share a budget, and SIGXCPU interrupts the
   call rather than killing the process.
2. Processes: RLIMIT_NPROC counts every process of the *real* uid, and never
   binds root. A process started by root therefore first sets its real uid to
   `nobody` (65534) while keeping effective uid 0, so it still reads what the
   worker reads (an interpreter under /root, say); once it is in its own user
   namespace (3.) it can never name uid 0 again, so the limit sticks. Inside a
   fresh user namespace (kernel 5.14 and later) the count is per namespace: the
   limit is exactly `max_processes` plus this process and its namespace's
   init. Without one, the limit is set above the uid's current count (a looser
   bound: other processes of the uid count too), and root stays unbounded
   (`Confinement.process_limit` false).
3. Namespaces: `unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID |
   CLONE_NEWNS)`. The new network namespace holds one loopback, down: every
   connect() fails, the worker's 127.0.0.1 included. In its own user namespace
   the process passes no ptrace-access check on a process outside it, whatever
   its uid: the worker's /proc/<pid>/environ and memory are closed to it. The
   process then forks the new pid namespace's init, which scores: the worker's
   processes cannot be named (nor signalled) from in there, and killing the
   namespace kills every process the reward started, whatever session or group
   they moved to. The init mounts a /proc of its own (the rest of the machine's
   processes out of sight), then every capability is dropped and no_new_privs
   set, so none of this can be undone. If the kernel refuses (no unprivileged
   user namespaces), the process runs without and says so (`network_isolated`
   false): the pool logs it once and the job goes on.

What this does not confine: files. The process keeps the worker's effective
uid, so it can read and write what the worker can (its TLS key file, say); a
mount namespace with only the paths a task needs is the next step.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import math
import os
import resource
import signal
from dataclasses import asdict, dataclass
from pathlib import Path

from reflow.core.task_config import RewardLimits  # noqa: F401 - re-exported

# The real uid a process started by root scores under (RLIMIT_NPROC binds it).
NOBODY_UID = 65534

# Environment variables passed on from the worker: what a task needs to import
# and to find its data (read-only roots, reflow.core.paths), nothing that could
# authenticate anything.
PASSED_ENV = ("PATH", "LANG", "LANGUAGE", "TZ", "PYTHONHASHSEED", "REFLOW_DATASETS_DIR",
              "REFLOW_MODELS_DIR", "HF_HOME", "HF_HUB_CACHE")
PASSED_ENV_PREFIXES = ("LC_",)
# Set for every reward process: one thread per numeric library, no downloads,
# no bytecode written into the worker's package directories.
FIXED_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
             "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
             "PYTHONDONTWRITEBYTECODE": "1"}
# A name holding any of these never passes, allow-list or not.
SECRET_WORDS = ("CREDENTIAL", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "KEY", "AUTH")
# The directory holding the `reflow` package, put on the child's PYTHONPATH.
PACKAGE_ROOT = Path(__file__).resolve().parents[2]

CLONE_NEWNS, CLONE_NEWUSER = 0x00020000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 2, 4, 8, 1 << 14, 1 << 18
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
CAPABILITY_VERSION_3 = 0x20080522
# Namespaced RLIMIT_NPROC counting (ucounts) arrived in Linux 5.14.
PER_NAMESPACE_NPROC_KERNEL = (5, 14)


@dataclass
class Confinement:
    """What `confine` achieved, reported by the process when it is ready."""

    network_isolated: bool = False
    pid_namespace: bool = False
    proc_isolated: bool = False
    process_limit: bool = False
    note: str = ""

    def to_dict(self) -> dict[str, bool | str]:
        return asdict(self)


def environment(home: Path, inherited: dict[str, str] | None = None) -> dict[str, str]:
    """The whole environment a reward process is exec'ed with: the allow-list
    from `inherited` (default: this process's), HOME and TMPDIR in the process's
    private directory, reflow on PYTHONPATH, and FIXED_ENV."""
    inherited = dict(os.environ if inherited is None else inherited)
    env = {name: value for name, value in inherited.items()
           if name in PASSED_ENV or name.startswith(PASSED_ENV_PREFIXES)}
    paths = [p for p in inherited.get("PYTHONPATH", "").split(os.pathsep) if p]
    env.update(FIXED_ENV, HOME=str(home), TMPDIR=str(home / "tmp"),
               PYTHONPATH=os.pathsep.join([*paths, str(PACKAGE_ROOT)]))
    return {name: value for name, value in env.items()
            if not any(word in name.upper() for word in SECRET_WORDS)}


class CpuLimitExceeded(BaseException):
    """Raised in the scoring thread when a call spends its CPU budget (SIGXCPU).
    A BaseException, so a reward's own `except Exception` does not swallow it."""


_libc = ctypes.CDLL(None, use_errno=True)
_in_call = False


def _on_sigxcpu(signum, frame) -> None:
    if _in_call:
        raise CpuLimitExceeded("the call's CPU budget (RLIMIT_CPU) is spent")


def _set_limit(which: int, value: int) -> None:
    """Soft and hard at `value`, or at the hard limit already in force if lower
    (an unprivileged process may not raise it)."""
    hard = resource.getrlimit(which)[1]
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(which, (value, value))


def _processes_of(uid: int) -> int:
    """Processes (not threads) whose real uid is `uid`, from /proc."""
    count = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status", encoding="ascii", errors="replace") as f:
                for line in f:
                    if line.startswith("Uid:"):
                        count += int(line.split()[1]) == uid
                        break
        except OSError:
            continue  # gone meanwhile
    return count


def _kernel_at_least(version: tuple[int, int]) -> bool:
    parts = os.uname().release.split(".")
    try:
        return (int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)) >= version
    except (IndexError, ValueError):
        return False


def _unshare(flags: int) -> int:
    """0, or the errno unshare(2) failed with."""
    if _libc.unshare(ctypes.c_int(flags)) == 0:
        return 0
    return ctypes.get_errno() or errno.EPERM


def confine(limits: RewardLimits) -> Confinement:
    """Steps 1 to 3 of the module docstring, up to (not including) the fork of
    the namespace's init: the caller forks when `pid_namespace` is true, then
    calls `mount_proc` in the child and `drop_privileges` in both."""
    # 1. Limits, before anything else runs here.
    _set_limit(resource.RLIMIT_CORE, 0)
    _set_limit(resource.RLIMIT_FSIZE, limits.file_bytes)
    _set_limit(resource.RLIMIT_AS, limits.memory_bytes)
    _set_limit(resource.RLIMIT_CPU, limits.cpu_s_lifetime)
    signal.signal(signal.SIGXCPU, _on_sigxcpu)
    # 2. A real uid that RLIMIT_NPROC binds.
    was_root = os.getuid() == 0
    if was_root:
        os.setresuid(NOBODY_UID, -1, -1)
    # 3. Namespaces: all four, or user and network alone, or none.
    report = Confinement()
    err = _unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWNS)
    if err == 0:
        report.network_isolated = report.pid_namespace = True
    elif _unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:
        report.network_isolated = True
        report.note = f"no pid namespace: unshare refused ({os.strerror(err)})"
    else:
        report.note = f"no network isolation: unshare refused ({os.strerror(err)})"
    # The namespace's init and this process count too.
    headroom = limits.max_processes + (2 if report.pid_namespace else 1)
    if report.network_isolated and _kernel_at_least(PER_NAMESPACE_NPROC_KERNEL):
        _set_limit(resource.RLIMIT_NPROC, headroom)
        report.process_limit = True
    else:
        _set_limit(resource.RLIMIT_NPROC, _processes_of(os.getuid()) + headroom)
        # Root with its capabilities, or able to take uid 0 back, is not bound.
        report.process_limit = not was_root or report.network_isolated
    return report


def set_parent_death_signal() -> None:
    """The namespace's init dies with the process that forked it."""
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def mount_proc() -> bool:
    """In the namespace's init: a /proc of this pid namespace only (the worker's
    processes out of sight), mounts kept from propagating back. False if refused
    (a container that masks parts of /proc refuses it)."""
    if _libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        return False
    return _libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None) == 0


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


def drop_privileges() -> None:
    """No capabilities, in any namespace, and none to gain by exec: the mounts,
    the uid and the limits above cannot be undone by what runs next."""
    if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
    data = (_CapData * 2)()
    if _libc.capset(ctypes.byref(_CapHeader(CAPABILITY_VERSION_3, 0)), data) != 0:
        raise OSError(ctypes.get_errno(), "capset failed")


@contextlib.contextmanager
def call_budget(cpu_s: int):
    """Around one reward call: the soft RLIMIT_CPU at the CPU used so far plus
    `cpu_s` (never past the hard limit, the process's lifetime budget), and
    SIGXCPU armed to raise CpuLimitExceeded in this thread."""
    global _in_call
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    soft = math.ceil(cpu_used_s()) + cpu_s
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))
    _in_call = True
    try:
        yield
    finally:
        _in_call = False


def cpu_left_s() -> float:
    """CPU seconds left before the hard RLIMIT_CPU kills this process."""
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    return math.inf if hard == resource.RLIM_INFINITY else hard - cpu_used_s()


def cpu_used_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime
