"""Process helpers for the local backend: free ports, child processes that
die with their parent, and tree-wide shutdown that leaves nothing behind."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import os
import signal
import socket
import subprocess  # nosec B404 # services start from argv lists, never through a shell
import threading
import time

import psutil

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def tune_gc(gen0_threshold: int = 50_000) -> None:
    """Service-process GC settings: move everything allocated at start-up (modules,
    models, clients) out of the collector's view, and collect young objects less
    often. A full collection otherwise scans that whole heap and shows up as
    tens-of-milliseconds spikes in request latency (seen in bench/replay_buffer.py)."""
    import gc

    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(gen0_threshold, gen1, gen2)


CPU_AFFINITY_ENV = "REFLOW_CPU_AFFINITY"


def split_cpus(cpus: list[int]) -> tuple[list[int], list[int]]:
    """Split this machine's CPUs between a rollout engine (first half) and a trainer
    (the rest), so that the two never share a core: an OpenMP team that shares a
    core with a busy engine thread runs at the pace of its slowest member."""
    if len(cpus) < 2:
        return cpus, cpus
    half = max(1, len(cpus) // 2)
    return cpus[:half], cpus[half:]


def cpu_list(cpus: list[int]) -> str:
    return ",".join(str(c) for c in cpus)


def apply_cpu_affinity() -> int | None:
    """Pin this process to the CPUs in REFLOW_CPU_AFFINITY ("1,2,3"), if set, and
    return how many; torch users then size their thread pool to match."""
    raw = os.environ.get(CPU_AFFINITY_ENV)
    if not raw:
        return None
    cpus = _parse_cpus(raw)
    os.sched_setaffinity(0, cpus)
    return len(cpus)


# The cores a rollout engine's own process (vLLM's engine core, which runs the model)
# gets, when they differ from its front end's (REFLOW_CPU_AFFINITY).
ENGINE_CPU_AFFINITY_ENV = "REFLOW_ENGINE_CPU_AFFINITY"


def _parse_cpus(raw: str) -> set[int]:
    return {int(c) for c in raw.split(",") if c.strip()}


@contextlib.contextmanager
def engine_process_affinity():
    """Around the start of an inference engine: narrow the calling thread to the
    cores in REFLOW_ENGINE_CPU_AFFINITY, so the engine-core process it spawns
    inherits them, then give it and the threads started meanwhile its cores back.
    The engine core keeps a core to itself, and the front end (request streaming,
    output processing, gRPC) runs wherever there is room instead of taking a share
    of that core: bench/PROFILE.md measured it at about a fifth of the engine's."""
    raw = os.environ.get(ENGINE_CPU_AFFINITY_ENV)
    if not raw:
        yield
        return
    previous = os.sched_getaffinity(0)
    existing = set(os.listdir("/proc/self/task"))
    os.sched_setaffinity(0, _parse_cpus(raw))
    try:
        yield
    finally:
        os.sched_setaffinity(0, previous)
        # Threads started meanwhile (the engine client's I/O threads) inherited the
        # narrow set; affinity is per thread, so each is widened by its id. Threads
        # that were already there are left alone: another job's engine may be
        # starting on one of them.
        for tid in set(os.listdir("/proc/self/task")) - existing:
            with contextlib.suppress(OSError):  # a thread that has just exited
                os.sched_setaffinity(int(tid), previous)


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """`n` distinct free loopback ports. All sockets stay bound until every port is
    chosen: asking one at a time can return the same port twice, and two services
    of one job then fight over it (seen as 'Address already in use')."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


PARENT_PID_ENV = "REFLOW_PARENT_PID"


def die_with_parent() -> None:
    """Called first thing in a child we spawned: have the kernel SIGTERM us when
    the spawning process dies, so a killed launcher never strands a service.

    Done in the child itself rather than in a preexec_fn: running Python
    between fork and exec in a multi-threaded (gRPC) parent can deadlock."""
    expected = os.environ.pop(PARENT_PID_ENV, None)
    if expected is None:
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        return
    if os.getppid() != int(expected):
        # The parent died before the signal was armed.
        os.kill(os.getpid(), signal.SIGTERM)


# Set by a process about to start an inference engine: its pid. The engine's own
# processes end when that process does (watch_parent).
ENGINE_PARENT_ENV = "REFLOW_ENGINE_PARENT_PID"
# How long an engine process whose parent died has to shut down before SIGKILL.
ENGINE_EXIT_GRACE_S = 5.0


def watch_parent() -> None:
    """In a `multiprocessing` child of a process that set ENGINE_PARENT_ENV (vLLM's
    engine core, its workers): end this process when that parent dies, however it
    dies. SIGKILL of a rollout worker otherwise left its engine core running,
    re-parented to PID 1 and holding ~2 GB, where no process-tree sweep finds it.

    vLLM calls this in each of its processes as a general plugin (the
    `vllm.general_plugins` entry point in pyproject.toml). It waits on the
    parent's sentinel, the pipe `multiprocessing` keeps to each child, which
    closes when the parent process exits, rather than arming PR_SET_PDEATHSIG:
    that fires when the parent *thread* that started the child exits, and an
    engine may outlive the thread that built it. SIGTERM first (vLLM shuts down
    cleanly on it), SIGKILL after ENGINE_EXIT_GRACE_S. A no-op in any other
    process, the engine's own front end included."""
    expected = os.environ.get(ENGINE_PARENT_ENV, "")
    parent = multiprocessing.parent_process()
    if not expected.isdigit() or int(expected) == os.getpid() or parent is None:
        return
    # This process's own children (an engine core's tensor-parallel workers) watch it.
    os.environ[ENGINE_PARENT_ENV] = str(os.getpid())
    threading.Thread(target=_end_with, args=(parent, int(expected)), name="reflow-parent-watch",
                     daemon=True).start()


def _end_with(parent, parent_pid: int) -> None:
    # A parent that died before we looked has re-parented us already; else wait for it.
    if os.getppid() == parent_pid:
        parent.join()
    logger.warning("parent process %d is gone: pid %d shuts down", parent_pid, os.getpid())
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(ENGINE_EXIT_GRACE_S)
    os.kill(os.getpid(), signal.SIGKILL)


def stop_processes(processes: list[subprocess.Popen], timeout_s: float = 10.0) -> None:
    """Stop processes we started and everything they started, all at once: each
    process, its descendants and the other members of its process group (a
    process `spawn` started with `new_group`), which finds descendants that were
    re-parented when their parent died. SIGTERM, then SIGKILL for whatever is
    left after `timeout_s`; each process is reaped, so its returncode says how
    it ended."""
    leaders = {proc.pid for proc in processes}
    for proc in processes:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for p in leftovers(leaders):
        _signal(p, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for proc in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(0.0, deadline - time.monotonic()))
    while time.monotonic() < deadline and leftovers(leaders):
        time.sleep(0.1)
    remaining = leftovers(leaders)
    remaining += [psutil.Process(proc.pid) for proc in processes if proc.poll() is None]
    for p in remaining:
        with contextlib.suppress(psutil.Error):
            logger.warning("killing pid %d (%s) after %.0fs", p.pid, p.name(), timeout_s)
        _signal(p, signal.SIGKILL)
    for proc in processes:
        proc.wait()
    psutil.wait_procs(remaining, timeout=5)


def leftovers(leaders: set[int]) -> list[psutil.Process]:
    """The running (not zombie) descendants and process-group members of the
    processes `leaders`, without the leaders themselves."""
    found: dict[int, psutil.Process] = {}
    for pid in leaders:
        for p in _descendants_of(pid):
            found[p.pid] = p
    for p in psutil.process_iter():
        with contextlib.suppress(OSError):
            if os.getpgid(p.pid) in leaders:
                found.setdefault(p.pid, p)
    return [p for pid, p in found.items() if pid not in leaders and _running(p)]


def _descendants_of(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _signal(p: psutil.Process, sig: int) -> None:
    with contextlib.suppress(psutil.NoSuchProcess):
        p.send_signal(sig)


def terminate_tree(pid: int, timeout_s: float = 10.0) -> None:
    """SIGTERM a process and all its descendants, then SIGKILL what remains."""
    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    procs = [root, *root.children(recursive=True)]
    for p in procs:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    # Children spawned while we waited are caught by a second sweep.
    for p in alive + [c for c in _descendants(root) if c not in alive]:
        try:
            logger.warning("killing pid %d (%s) after %.0fs", p.pid, p.name(), timeout_s)
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)


def _descendants(p: psutil.Process) -> list[psutil.Process]:
    try:
        return p.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def spawn(args: list[str], log_path: str, env: dict[str, str] | None = None,
          new_group: bool = False) -> subprocess.Popen[bytes]:
    """Start a service. `new_group`: in a session and process group of its own,
    which every process it starts joins, so `stop_processes` finds them all even
    after the service itself has died."""
    log = open(log_path, "ab")
    # Callers pass sys.executable -m reflow.cli serve <service>, never spec or RPC input.
    proc = subprocess.Popen(  # nosec B603 # argv built in-process, no shell
        args,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env={**os.environ, **(env or {}), PARENT_PID_ENV: str(os.getpid())},
        start_new_session=new_group,
    )
    log.close()
    return proc


def stop_gracefully(proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """SIGTERM `proc` alone and give it `timeout_s` to stop what it started in its
    own order; then take down whatever of its tree is left (terminate_tree)."""
    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("pid %d still running %.0fs after SIGTERM", proc.pid, timeout_s)
    terminate_tree(proc.pid, timeout_s=10)
    for p in descendants:  # re-parented once their parent exited
        with contextlib.suppress(psutil.NoSuchProcess):
            if p.is_running():
                terminate_tree(p.pid, timeout_s=10)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)
