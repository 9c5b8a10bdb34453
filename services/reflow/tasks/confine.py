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

4. Files: the worker lists the paths that hold its secrets (`secret_paths`,
   from its own environment: the directory of every `*_FILE` variable's file,
   REFLOW_TLS_DIR, REFLOW_SECRET_PATHS, /run/secrets and /var/run/secrets, the
   credential files of its HOME) and passes them on the command line; the
   namespace's init, in its own mount namespace, covers each directory with an
   empty read-only tmpfs and each file with /dev/null (`hide_files`) before it
   drops its capabilities, so the reward can neither read them nor unmount
   what covers them. A directory that is, or holds, something the task needs
   (the interpreter, the reflow package, PYTHONPATH, the datasets, models and
   HF roots, the process's own directory) or a system directory (/etc, /usr,
   ...) is never covered whole: the secret file alone is. Where the kernel
   refuses the namespaces, nothing is hidden (`files_hidden` false, and the
   note says so).

What this does not confine: every other file. The process keeps the worker's
effective uid, so it reads and writes whatever else the worker can: the job's
datasets and model files (which a reward may legitimately need), its run
directory's checkpoints and logs, a secret file named nowhere in the worker's
environment, and a secret reachable through a second mount of it (a bind
mount elsewhere) or a hard link. A mount namespace holding only the paths a
task needs would close that too.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import math
import os
import resource
import signal
import sys
from collections.abc import Iterable, Mapping
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

# Secret files and directories the worker names besides its *_FILE variables
# (os.pathsep-separated; `reflow run` lists its TLS directory, API token and Redis files).
SECRET_PATHS_ENV = "REFLOW_SECRET_PATHS"  # nosec B105 # a variable's name, not a secret
# Credential files under names that do not end in _FILE.
SECRET_FILE_ENV = ("GOOGLE_APPLICATION_CREDENTIALS", "HF_TOKEN_PATH", "KUBECONFIG")
# Always hidden where they exist: Kubernetes service-account tokens, Docker secrets.
ALWAYS_SECRET = ("/var/run/secrets", "/run/secrets")
# Credentials that tools keep under the worker's HOME.
HOME_SECRETS = (".ssh", ".aws", ".azure", ".config/gcloud", ".kube", ".docker", ".netrc",
                ".git-credentials", ".pypirc", ".cache/huggingface/token")
# Roots of what a task may need (besides the interpreter and PACKAGE_ROOT): a
# directory that is or holds one of these is never hidden whole.
NEEDED_ENV = ("REFLOW_DATASETS_DIR", "REFLOW_MODELS_DIR", "HF_HOME", "HF_HUB_CACHE")
# The system's own directories: a secret file in one is hidden alone.
SYSTEM_DIRS = frozenset({
    "/", "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/libx32",
    "/media", "/mnt", "/opt", "/proc", "/run", "/sbin", "/srv", "/sys", "/usr",
    "/usr/bin", "/usr/lib", "/usr/local", "/usr/share", "/var", "/var/lib", "/var/run",
    # Names to compare against, never written to.
    "/tmp", "/var/tmp"})  # nosec B108
# Bounds the reward process checks the list it is given against.
MAX_SECRET_PATHS = 256
MAX_PATH_CHARS = 4096

CLONE_NEWNS, CLONE_NEWUSER = 0x00020000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_BIND, MS_REC, MS_PRIVATE = 1 << 12, 1 << 14, 1 << 18
# What covers a hidden directory: empty, read-only, nothing to execute.
HIDING_TMPFS_OPTIONS = b"size=4k,mode=0555"
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
    # Every path of `secret_paths` that existed is covered (step 4).
    files_hidden: bool = False
    num_paths_hidden: int = 0
    note: str = ""

    def to_dict(self) -> dict[str, bool | int | str]:
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


def _real(path: str | os.PathLike[str]) -> str:
    return os.path.realpath(os.path.abspath(os.fspath(path)))


def _within(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def _needed(env: Mapping[str, str], needed: Iterable[str | os.PathLike[str]]) -> list[str]:
    """What a reward process may need to read, resolved: the interpreter, the
    reflow package, every PYTHONPATH entry, the roots of NEEDED_ENV, `needed`."""
    paths: list[str | os.PathLike[str]] = [
        sys.executable, sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
        PACKAGE_ROOT, *needed]
    paths += [env[name] for name in NEEDED_ENV if env.get(name)]
    paths += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return [_real(p) for p in paths if os.fspath(p)]


def _may_hide(path: str, needed: list[str]) -> bool:
    if path in SYSTEM_DIRS:
        return False
    return not any(_within(keep, path) for keep in needed)


def _candidates(env: Mapping[str, str]) -> list[tuple[str, str]]:
    """(path to hide, the file to hide instead if that path may not be): for a
    secret file, its directory as named and as resolved; for a directory, itself."""
    found: list[tuple[str, str]] = []
    files = [value for name, value in env.items()
             if value and (name.endswith("_FILE") or name in SECRET_FILE_ENV)]
    if env.get("KUBECONFIG"):
        files += env["KUBECONFIG"].split(os.pathsep)
    for value in files:
        if not value or not os.path.exists(value):
            continue
        real = _real(value)
        if os.path.isdir(real):
            found.append((real, ""))
        else:
            found += [(_real(os.path.dirname(os.path.abspath(value))), real),
                      (os.path.dirname(real), real)]
    listed = [env.get("REFLOW_TLS_DIR", ""), *env.get(SECRET_PATHS_ENV, "").split(os.pathsep),
              *ALWAYS_SECRET]
    if env.get("HOME"):
        listed += [os.path.join(env["HOME"], name) for name in HOME_SECRETS]
    if env.get("HF_HOME"):
        listed.append(os.path.join(env["HF_HOME"], "token"))
    found += [(_real(value), "") for value in listed if value and os.path.exists(value)]
    return found


def secret_paths(env: Mapping[str, str] | None = None,
                 needed: Iterable[str | os.PathLike[str]] = ()) -> list[str]:
    """The resolved paths a reward process hides (step 4), from the worker's
    environment `env` (default: this process's); `needed` adds what the task
    reads besides `_needed`'s roots (its datasets root, the process's own
    directory). Nested paths are dropped: their directory covers them."""
    env = os.environ if env is None else env
    keep = _needed(env, needed)
    chosen = set()
    for path, file in _candidates(env):
        if _may_hide(path, keep):
            chosen.add(path)
        elif file and _may_hide(file, keep):
            chosen.add(file)
    paths: list[str] = []
    for path in sorted(chosen):  # a directory sorts before what it holds
        if not any(_within(path, kept) for kept in paths):
            paths.append(path)
    if len(paths) > MAX_SECRET_PATHS:
        raise ValueError(f"{len(paths)} secret paths to hide from reward processes, more than "
                         f"{MAX_SECRET_PATHS}: list their directories in {SECRET_PATHS_ENV}")
    return paths


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
        report.note = (f"no pid or mount namespace, secret files not hidden: unshare "
                       f"refused ({os.strerror(err)})")
    else:
        report.note = (f"no network isolation, secret files not hidden: unshare refused "
                       f"({os.strerror(err)})")
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


def _make_private() -> bool:
    """Mounts made from here on stay in this mount namespace."""
    return _libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) == 0


def mount_proc() -> bool:
    """In the namespace's init: a /proc of this pid namespace only (the worker's
    processes out of sight), mounts kept from propagating back. False if refused
    (a container that masks parts of /proc refuses it)."""
    if not _make_private():
        return False
    return _libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None) == 0


def hide_files(paths: list[str], report: Confinement) -> None:
    """Step 4, in the namespace's init before `drop_privileges`: an empty
    read-only tmpfs over each directory of `paths`, /dev/null over each file (a
    read returns nothing). Both follow a symlink, as the reward's open would.
    A path this process cannot reach (gone, or behind a directory it may not
    search) has nothing to hide; any other failure is named in the note."""
    if not _make_private():
        report.note = _joined(report.note, "secret files not hidden: mounts not private")
        return
    failures = []
    for path in paths:
        if not os.path.exists(path):
            continue
        target = os.fsencode(path)
        if os.path.isdir(path):
            done = _libc.mount(b"tmpfs", target, b"tmpfs",
                               MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
                               HIDING_TMPFS_OPTIONS) == 0
        else:
            done = _libc.mount(b"/dev/null", target, None, MS_BIND, None) == 0
        if done:
            report.num_paths_hidden += 1
        else:
            failures.append(f"{path} ({os.strerror(ctypes.get_errno())})")
    report.files_hidden = not failures
    if failures:
        report.note = _joined(report.note, "secret files not hidden: " + ", ".join(failures))


def _joined(note: str, more: str) -> str:
    return f"{note}; {more}" if note else more


def parse_secret_paths(text: str) -> list[str]:
    """The list a reward process is given (`secret_paths`, as JSON), checked:
    at most MAX_SECRET_PATHS absolute paths; ValueError otherwise."""
    paths = json.loads(text)
    if not isinstance(paths, list) or len(paths) > MAX_SECRET_PATHS:
        raise ValueError(f"secret paths: a JSON list of at most {MAX_SECRET_PATHS} paths")
    for path in paths:
        if (not isinstance(path, str) or not os.path.isabs(path) or "\0" in path
                or len(path) > MAX_PATH_CHARS):
            raise ValueError(f"secret paths: {str(path)[:80]!r} is not an absolute path")
    return paths


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
