"""Rewards run where they cannot hurt the rollout worker: in a pool of
confined processes, each scoring in its main thread, with a timeout per call.

The worker's event loop is also vLLM's output loop, so a reward computed on it
stalls generation and weight updates; one that raises would fail the worker,
and one that returns NaN would become NaN advantages and then NaN weights on
every engine. Here every outcome is data: `RewardResult.error` says "" (scored)
or one of REWARD_ERRORS, and the worker decides what a failed sample becomes
(rollout/worker.py: excluded from the loss). A call that overruns its timeout
has its process (its whole process group and pid namespace) killed and
replaced, so a reward stuck in a C extension, an endless loop or a fork bomb
costs one process, not the job.

A reward scores model-written text, so its process is treated as hostile
(reflow.tasks.confine): it is exec'ed with an allow-listed environment (no
credential of the worker's reaches it), and before it builds its task it
limits its memory, CPU, processes and file sizes and, where the kernel allows
unprivileged user namespaces, leaves the network and the worker's /proc behind
and hides the worker's secret files, which the pool lists from its own
environment (`confine.secret_paths`) and passes on the command line
(`RewardPool.network_isolated` says whether it did; a warning is logged once if
not). It builds the task from its registered name, so nothing unregistered is
ever imported (reflow.core.plugins). The pool talks to it in newline-delimited
JSON over its stdin and stdout (reflow.tasks.reward_child), never pickle, and
validates every line it sends back: anything malformed fails the call
("protocol") and replaces the process.

math-verify bounds its parsing with `signal.alarm`, which only works in a main
thread: a pool process calls `reward` in its main thread, as it requires.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import queue
import select
import shutil
import signal
import subprocess  # nosec B404 # the reward process: a fixed module of this package
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reflow.tasks import confine
from reflow.tasks.base import Prompt, TaskContext
from reflow.tasks.confine import RewardLimits

logger = logging.getLogger(__name__)

# "exception": the reward raised; "timeout": it overran its call timeout;
# "non_finite": it returned NaN or an infinity; "crashed": its process died;
# "resource_limit": it hit a limit (memory, CPU, file size: RewardLimits);
# "protocol": its process sent something that is not a valid reply.
REWARD_ERRORS = ("exception", "timeout", "non_finite", "crashed", "resource_limit", "protocol")
# A pool process builds its task (imports, datasets) before its first call.
START_TIMEOUT_S = 120.0
MAX_MESSAGE_CHARS = 300
# The longest line a reward process may send: every valid reply is far shorter.
MAX_LINE_BYTES = 4096
# What is kept of a reward process's stderr (its last bytes), for the log.
MAX_STDERR_BYTES = 8192
# How long a process that closed its pipe, or was told to stop, gets to exit.
EXIT_WAIT_S = 1.0
# How often a call waiting for an idle process looks whether the pool closed.
CLOSE_POLL_S = 0.2
CHILD_MODULE = "reflow.tasks.reward_child"
# Signals that mean a limit stopped the process: the hard CPU limit (SIGKILL,
# also the kernel's OOM killer), the soft one unhandled, the file size limit.
LIMIT_SIGNALS = frozenset({signal.SIGKILL, signal.SIGXCPU, signal.SIGXFSZ})

# Every message a reward process may send: its keys and their types.
MESSAGES: dict[str, dict[str, type]] = {
    "ready": {"kind": str, "network_isolated": bool, "pid_namespace": bool,
              "proc_isolated": bool, "process_limit": bool, "files_hidden": bool,
              "num_paths_hidden": int, "note": str},
    "failed": {"kind": str, "message": str},
    "ok": {"id": int, "kind": str, "value": float, "retire": bool},
    "error": {"id": int, "kind": str, "message": str, "limit": bool, "retire": bool},
}


@dataclass(frozen=True)
class RewardResult:
    """A reward, or why there is none (`error` one of REWARD_ERRORS, `message` the detail)."""

    value: float
    error: str = ""
    message: str = ""


class ProtocolError(Exception):
    """A reward process sent a line that is not a valid message."""


class _CallFailed(Exception):
    """A call failed in a way that costs the process: `error` is its RewardResult.error."""

    def __init__(self, error: str, message: str) -> None:
        super().__init__(message)
        self.error, self.message = error, message[:MAX_MESSAGE_CHARS]


def decode(line: bytes, kinds: tuple[str, ...]) -> dict[str, Any]:
    """A line from a reward process as one of the message `kinds`, every key
    present with its type (a float finite or not, never a bool), strings cut to
    MAX_MESSAGE_CHARS; ProtocolError otherwise."""
    try:
        message = json.loads(line)
    except (ValueError, RecursionError):
        raise ProtocolError(f"a line that is not JSON: {line[:60]!r}") from None
    if not isinstance(message, dict) or message.get("kind") not in kinds:
        raise ProtocolError(f"not a {' or '.join(kinds)} message: {line[:60]!r}")
    schema = MESSAGES[message["kind"]]
    if set(message) != set(schema):
        raise ProtocolError(f"a {message['kind']} message with keys {sorted(message)[:8]}")
    for key, kind in schema.items():
        value = message[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            try:
                value = message[key] = float(value)
            except OverflowError:
                raise ProtocolError(f"{key}: an integer too large for a float") from None
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise ProtocolError(f"{key}: {type(value).__name__}, not {kind.__name__}")
        if kind is str:
            message[key] = value[:MAX_MESSAGE_CHARS]
    return message


@dataclass(frozen=True)
class _Spec:
    """What every process of a pool is started with."""

    limits_json: str
    # confine.secret_paths, as JSON: what the process hides from itself.
    secret_paths_json: str
    init: bytes


class _Process:
    """One reward process: its pipes, its private directory (HOME and TMPDIR),
    the tail of its stderr, and its pid namespace, to kill whatever is in it."""

    def __init__(self, spec: _Spec) -> None:
        self.home = Path(tempfile.mkdtemp(prefix="reflow-reward-"))
        (self.home / "tmp").mkdir()
        self._spec = spec
        # No preexec_fn (the worker runs threads): the child confines itself.
        self.popen = subprocess.Popen(  # nosec B603 # fixed argv, no shell
            [sys.executable, "-m", CHILD_MODULE, spec.limits_json, spec.secret_paths_json],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=confine.environment(self.home), cwd=self.home, start_new_session=True,
            close_fds=True)
        self._in, self._out = self.popen.stdin.fileno(), self.popen.stdout.fileno()
        os.set_blocking(self._in, False)
        self._buffer = bytearray()
        self._stderr = bytearray()
        self._stderr_lock = threading.Lock()
        threading.Thread(target=self._drain, args=(self.popen.stderr,),
                         name="reflow-reward-stderr", daemon=True).start()
        self._next_id = 0
        self._namespace: tuple[int, int] | None = None
        self._namespace_fd = -1
        self._kill_lock = threading.Lock()
        self.confinement: dict[str, Any] | None = None

    def _drain(self, stream) -> None:
        try:
            while chunk := os.read(stream.fileno(), 4096):
                with self._stderr_lock:
                    self._stderr += chunk
                    del self._stderr[:-MAX_STDERR_BYTES]
        except OSError:
            pass
        finally:
            stream.close()

    def stderr_tail(self, num_chars: int = 1000) -> str:
        with self._stderr_lock:
            return self._stderr[-num_chars:].decode("utf-8", "replace")

    # --- the pipes -------------------------------------------------------

    def _write(self, data: bytes, deadline: float) -> None:
        view = memoryview(data)
        poller = select.poll()
        poller.register(self._in, select.POLLOUT)
        while view:
            with contextlib.suppress(BlockingIOError):
                view = view[os.write(self._in, view):]
            if view and not poller.poll(max(0.0, deadline - time.monotonic()) * 1000):
                raise TimeoutError

    def _read(self, deadline: float, kinds: tuple[str, ...]) -> dict[str, Any]:
        poller = select.poll()
        poller.register(self._out, select.POLLIN)
        while True:
            end = self._buffer.find(b"\n", 0, MAX_LINE_BYTES + 1)
            if end >= 0:
                line = bytes(self._buffer[:end])
                del self._buffer[:end + 1]
                return decode(line, kinds)
            if len(self._buffer) > MAX_LINE_BYTES:
                raise ProtocolError(f"a line longer than {MAX_LINE_BYTES} bytes")
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not poller.poll(remaining * 1000):
                raise TimeoutError
            chunk = os.read(self._out, 65536)
            if not chunk:
                raise EOFError
            self._buffer += chunk

    def _exchange(self, data: bytes, deadline: float, kinds: tuple[str, ...],
                  timeout_message: str) -> dict[str, Any]:
        try:
            self._write(data, deadline)
            return self._read(deadline, kinds)
        except TimeoutError:
            raise _CallFailed("timeout", timeout_message) from None
        except ProtocolError as err:
            raise _CallFailed("protocol", str(err)) from None
        except (EOFError, OSError):
            raise _CallFailed(*self._death()) from None

    # --- calls -----------------------------------------------------------

    def wait_ready(self) -> bool:
        """Send the task and wait until the process has built it; True the first
        time (`confinement` then holds what it achieved)."""
        if self.confinement is not None:
            return False
        try:
            message = self._exchange(self._spec.init, time.monotonic() + START_TIMEOUT_S,
                                     ("ready", "failed"), "")
        except _CallFailed as failed:
            if failed.error == "timeout":
                raise _CallFailed("crashed", f"reward process not ready after "
                                  f"{START_TIMEOUT_S:.0f}s") from None
            raise
        if message["kind"] == "failed":
            raise _CallFailed("crashed", "reward process could not build the task: "
                              + message["message"])
        self.confinement = {k: v for k, v in message.items() if k != "kind"}
        if self.confinement["pid_namespace"]:
            self._hold_namespace()
        return True

    def call(self, prompt: Prompt, response_text: str, timeout_s: float) -> dict[str, Any]:
        """The process's reply ("ok" or "error") to one reward call."""
        if self._buffer:
            raise _CallFailed("protocol", "output nobody asked for, before the call")
        self._next_id += 1
        request = {"id": self._next_id, "prompt_id": prompt.prompt_id, "text": prompt.text,
                   "answer": prompt.answer, "response": response_text}
        reply = self._exchange((json.dumps(request) + "\n").encode(),
                               time.monotonic() + timeout_s, ("ok", "error"),
                               f"over {timeout_s:g}s")
        if reply["id"] != self._next_id:
            raise _CallFailed("protocol", f"a reply to call {reply['id']} during call "
                              f"{self._next_id}")
        return reply

    # --- ending ----------------------------------------------------------

    def _exit_info(self, timeout_s: float):
        """How the process ended (os.waitid's answer, the process left to reap),
        or None if it still runs after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                info = os.waitid(os.P_PID, self.popen.pid,
                                 os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return None
            if info is not None or time.monotonic() >= deadline:
                return info
            time.sleep(0.02)

    def _death(self) -> tuple[str, str]:
        """Why the process closed its pipe: (RewardResult.error, message)."""
        info = self._exit_info(EXIT_WAIT_S)
        if info is None:
            error, message = "crashed", "reward process closed its pipe"
        elif info.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
            try:
                name = signal.Signals(info.si_status).name
            except ValueError:
                name = str(info.si_status)
            error = "resource_limit" if info.si_status in LIMIT_SIGNALS else "crashed"
            message = f"reward process killed by {name}"
        else:
            error, message = "crashed", f"reward process exited with code {info.si_status}"
        logger.warning("%s; its stderr ended: %s", message, self.stderr_tail() or "(nothing)")
        return error, message

    def _hold_namespace(self) -> None:
        """Keep the process's pid namespace open (so its identity cannot be reused
        by another while this one is killed), and remember which it is."""
        try:
            fd = os.open(f"/proc/{self.popen.pid}/ns/pid_for_children",
                         os.O_RDONLY | os.O_CLOEXEC)
        except OSError as err:
            logger.warning("cannot open the reward process's pid namespace (%s): a timeout "
                           "kills its process group only", err)
            return
        st = os.fstat(fd)
        self._namespace, self._namespace_fd = (st.st_dev, st.st_ino), fd

    def _kill_namespace(self) -> None:
        """SIGKILL every process in the pid namespace, including any that left the
        process group (setsid)."""
        if self._namespace is None:
            return
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                st = os.stat(f"/proc/{entry}/ns/pid")
                if (st.st_dev, st.st_ino) == self._namespace:
                    os.kill(int(entry), signal.SIGKILL)
            except OSError:
                continue  # gone, or not ours to look at

    def kill(self) -> None:
        """Kill the process, its group and its namespace; reap it; remove its
        directory. Once: a second call (close racing a failed call) does nothing,
        as the pid and the namespace may by then be someone else's."""
        with self._kill_lock:
            if self.popen.returncode is not None:
                return
            self._kill_namespace()
            with contextlib.suppress(OSError):
                os.killpg(self.popen.pid, signal.SIGKILL)  # not reaped yet: the group is ours
            try:
                self.popen.wait(5.0)
            except subprocess.TimeoutExpired:
                logger.warning("reward process %d did not die", self.popen.pid)
            for stream in (self.popen.stdin, self.popen.stdout):
                with contextlib.suppress(OSError):
                    stream.close()
            if self._namespace_fd >= 0:
                os.close(self._namespace_fd)
            self._namespace, self._namespace_fd = None, -1
            shutil.rmtree(self.home, ignore_errors=True)

    def close(self) -> None:
        """Ask the process to stop (end of its stdin), then kill what is left."""
        with contextlib.suppress(OSError):
            self.popen.stdin.close()
        self._exit_info(2.0)
        self.kill()


class RewardPool:
    """`num_workers` processes scoring `task` (by registered name and its validated
    arguments) with at most `timeout_s` a call, each confined by `limits`.
    `score` is thread-safe and blocks; the rollout worker calls it off its event
    loop. `network_isolated` is None until a process is ready, then whether they
    run without network."""

    def __init__(self, name: str, args: dict[str, Any], context: TaskContext,
                 num_workers: int = 1, timeout_s: float = 10.0,
                 limits: RewardLimits | None = None) -> None:
        limits = limits or RewardLimits()
        if not limits.cpu_s_per_call:
            limits = limits.model_copy(update={"cpu_s_per_call": max(1, math.ceil(2 * timeout_s))})
        try:
            init = json.dumps({"task": name, "args": dict(args), "seed": context.seed,
                               "datasets_root": str(Path(context.datasets_root).absolute())})
        except (TypeError, ValueError) as err:
            raise ValueError(f"task.args: not representable as JSON ({err})") from None
        # Every process's private directory lies under the temporary directory:
        # nothing that holds it, nor the datasets, is hidden whole.
        hidden = confine.secret_paths(needed=(tempfile.gettempdir(), context.datasets_root))
        self._spec = _Spec(limits.model_dump_json(), json.dumps(hidden),
                           (init + "\n").encode())
        self.limits = limits
        self.timeout_s = timeout_s
        self.network_isolated: bool | None = None
        self.confinement: dict[str, Any] | None = None
        self._idle: queue.Queue[_Process] = queue.Queue()
        self._all: list[_Process] = []
        self._lock = threading.Lock()
        self._closed = False
        self._warned = False
        for _ in range(num_workers):
            self._add(_Process(self._spec))

    def _add(self, process: _Process) -> None:
        with self._lock:
            self._all.append(process)
        self._idle.put(process)

    def _replace(self, process: _Process) -> None:
        process.kill()
        with self._lock:
            if process in self._all:
                self._all.remove(process)
            if self._closed:
                return
        self._add(_Process(self._spec))

    def _ready(self, confinement: dict[str, Any]) -> None:
        """Record what a new process achieved; say once if it is less than asked."""
        with self._lock:
            self.confinement = confinement
            isolated = confinement["network_isolated"]
            self.network_isolated = isolated if self.network_isolated is None else (
                self.network_isolated and isolated)
            warn, self._warned = not self._warned, True
        if not warn:
            return
        if isolated and confinement["process_limit"] and confinement["files_hidden"]:
            logger.info("reward processes confined: %s", confinement)
        else:
            logger.warning("reward processes run with network_isolated: %s, process_limit: "
                           "%s, files_hidden: %s (%s); the job goes on", isolated,
                           confinement["process_limit"], confinement["files_hidden"],
                           confinement["note"] or "the kernel refused")

    def _take(self) -> _Process:
        """An idle process. A call waiting here when the pool closes raises
        instead of waiting for ever: its thread is one the interpreter joins at
        exit (asyncio.to_thread), so a stuck wait would hold the worker's
        shutdown until it is killed."""
        while not self._closed:
            try:
                process = self._idle.get(timeout=CLOSE_POLL_S)
            except queue.Empty:
                continue
            if not self._closed:
                return process
            self._idle.put(process)
        raise RuntimeError("the reward pool is closed")

    def score(self, prompt: Prompt, response_text: str) -> RewardResult:
        process = self._take()
        try:
            if process.wait_ready():
                self._ready(process.confinement)
            reply = process.call(prompt, response_text, self.timeout_s)
        except _CallFailed as failed:
            logger.warning("reward of %s failed (%s: %s): its process is replaced",
                           prompt.prompt_id, failed.error, failed.message)
            self._replace(process)
            return RewardResult(0.0, failed.error, failed.message)
        if reply["retire"] or (reply["kind"] == "error" and reply["limit"]):
            self._replace(process)
        else:
            self._idle.put(process)
        if reply["kind"] == "error":
            return RewardResult(0.0, "resource_limit" if reply["limit"] else "exception",
                                reply["message"])
        if not math.isfinite(reply["value"]):
            return RewardResult(0.0, "non_finite", repr(reply["value"]))
        return RewardResult(reply["value"])

    def close(self) -> None:
        with self._lock:
            self._closed = True
            processes = list(self._all)
        for process in processes:
            process.close()
