"""How an agent program (task `agent`) runs: under bubblewrap by default
(reflow.sandbox.isolate), or as a plain process of the worker where the operator
says so; its environment, its stdin, the tails of its output, and its end.

Isolated, the agent sees the sandbox's view (read-only /usr and /etc, the
interpreter's prefixes with their site-packages, its own code: the script's
directory or the entry point's package), a private tmpfs scratch directory
(SCRATCH_DIR: its working directory, HOME and TMPDIR, AGENT_SCRATCH_BYTES at
most), a /proc of its own pid namespace, no capability, uid nobody, and the
worker's network namespace (it calls the worker's endpoint on 127.0.0.1). Every
path the worker knows to be secret (reflow.tasks.confine.secret_paths: its
*_FILE variables' directories, REFLOW_TLS_DIR, REFLOW_SECRET_PATHS, ...) is
covered where it falls inside that view; the run directory, the repository and
the worker's /proc/<pid>/environ are not in it at all. Limits
(`task.args.memory_bytes`, `max_processes`, per-file and scratch bytes, CPU
seconds per process at the episode timeout) are set before the agent starts;
the episode timeout is its wall clock.

Where bubblewrap is missing or cannot start a program here, the runner refuses
to start, naming `apt-get install bubblewrap`, unless the operator set
REFLOW_AGENTS_UNCONFINED=1: agents then run as plain processes of the worker
(a scrubbed environment and a scratch directory, but the worker's uid, files,
/proc and no limits), and a warning says so.

It knows nothing of tokens or the endpoint (reflow.rollout.agent_episode).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from reflow.sandbox.isolate import SCRATCH_DIR, Isolation, ProcessLimits
from reflow.tasks.agent import AgentProgram, AgentTask
from reflow.tasks.confine import secret_paths

logger = logging.getLogger(__name__)

# An operator setting of the rollout worker: "1" runs agents without bubblewrap.
UNCONFINED_ENV = "REFLOW_AGENTS_UNCONFINED"
# The agent's scratch tmpfs (in memory), and the largest file it may write anywhere.
AGENT_SCRATCH_BYTES = 128 * 2**20
# What is kept of the agent's output: its last line is its reward report.
STDOUT_TAIL_BYTES = 65536
STDERR_TAIL_BYTES = 4096
# How long a killed agent's pipes may stay open (a child that left its group).
DRAIN_WAIT_S = 2.0


@dataclass
class AgentExit:
    """How the agent's process ended: its exit status (None: killed by us), whether
    the episode timeout did it, and the tails of its output."""

    returncode: int | None
    timed_out: bool
    stdout: bytes
    stderr: bytes


def agent_environment(base_url: str, api_key: str, scratch: str) -> dict[str, str]:
    """Everything the agent's process sees of an environment: nothing of the worker's
    but PATH and the locale."""
    return {"PATH": os.environ.get("PATH", os.defpath), "LANG": "C.UTF-8", "HOME": scratch,
            "TMPDIR": scratch, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key,
            "NO_PROXY": "127.0.0.1,localhost", "PYTHONUNBUFFERED": "1",
            "PYTHONDONTWRITEBYTECODE": "1"}


async def _tail(stream: asyncio.StreamReader, max_bytes: int) -> bytes:
    kept = bytearray()
    while chunk := await stream.read(65536):
        kept = (kept + chunk)[-max_bytes:]
    return bytes(kept)


async def _feed(stream: asyncio.StreamWriter, data: bytes) -> None:
    with contextlib.suppress(ConnectionError):
        stream.write(data)
        await stream.drain()
        stream.close()


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


async def run_agent(argv: Sequence[str], stdin: bytes, env: dict[str, str], cwd: str,
                    timeout_s: float, ended: asyncio.Event,
                    popen_kwargs: dict[str, Any] | None = None) -> AgentExit:
    """Run the agent until it exits, `ended` is set or `timeout_s` passes; its whole
    process group is killed on the way out (under bubblewrap: bubblewrap's, and with
    its pid 1 every process of the agent's pid namespace, whatever group they are in)."""
    try:
        # argv comes from the operator's registry (reflow.tasks.agent), never from a spec.
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=env, cwd=cwd, start_new_session=True,
            **(popen_kwargs or {}))
    except OSError as err:  # the machine's trouble (no memory, no fds): this sample's
        return AgentExit(-1, False, b"", f"cannot start the agent: {err}".encode())
    tasks = [asyncio.create_task(c) for c in (_feed(proc.stdin, stdin),
                                              _tail(proc.stdout, STDOUT_TAIL_BYTES),
                                              _tail(proc.stderr, STDERR_TAIL_BYTES))]
    exited, stop = asyncio.create_task(proc.wait()), asyncio.create_task(ended.wait())
    try:
        done, _ = await asyncio.wait({exited, stop}, timeout=timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)
    finally:
        _kill_group(proc.pid)
        stop.cancel()
        # Shielded: a cancelled episode still reaps its agent.
        await asyncio.shield(exited)
        _, pending = await asyncio.wait(tasks[1:], timeout=DRAIN_WAIT_S)
        for task in [tasks[0], *pending]:
            task.cancel()
    out, err = (t.result() if t.done() and not t.cancelled() else b"" for t in tasks[1:])
    return AgentExit(proc.returncode if exited in done else None, not done, out, err)


def _unconfined_allowed() -> bool:
    value = os.environ.get(UNCONFINED_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{UNCONFINED_ENV}={value[:20]!r}: 1 runs agents without bubblewrap, "
                         "0 or unset under it")
    return value == "1"


class AgentLauncher:
    """Starts one registered agent program per episode, isolated unless the
    operator allowed otherwise (the module docstring). Built once per runner:
    it checks here, once, that an isolated agent can start (RuntimeError
    saying what to install otherwise)."""

    def __init__(self, program: AgentProgram, args: AgentTask.Args) -> None:
        self.program = program
        self.limits = ProcessLimits(memory_bytes=args.memory_bytes,
                                    max_processes=args.max_processes,
                                    file_bytes=AGENT_SCRATCH_BYTES, cpu_s=args.episode_timeout_s,
                                    scratch_bytes=AGENT_SCRATCH_BYTES)
        self.isolation: Isolation | None = None
        if _unconfined_allowed():
            logger.warning("%s=1: agent %r runs as a plain process of the worker, with its uid, "
                           "its files and its /proc, and without limits", UNCONFINED_ENV,
                           program.name)
            return
        bwrap = shutil.which("bwrap")
        if bwrap is None:
            raise RuntimeError(f"agent {program.name!r}: bubblewrap (bwrap) not found; agent "
                               "programs run under it: install it (apt-get install bubblewrap), "
                               f"or set {UNCONFINED_ENV}=1 to run them unconfined")
        code = program.code_paths()
        try:
            self.isolation = Isolation(bwrap, program.argv[0], readable_paths=code,
                                       secret_paths=secret_paths(needed=code), hostname="agent")
            self.isolation.check(self.limits)
        except RuntimeError as err:
            raise RuntimeError(f"agent {program.name!r}: {err}; set {UNCONFINED_ENV}=1 to run "
                               "agents unconfined") from None

    async def run(self, stdin: bytes, base_url: str, api_key: str, timeout_s: float,
                  ended: asyncio.Event) -> AgentExit:
        """One episode's agent, as `run_agent` runs it."""
        if self.isolation is None:
            scratch = tempfile.mkdtemp(prefix="reflow-agent-")
            try:
                return await run_agent(self.program.argv, stdin,
                                       agent_environment(base_url, api_key, scratch), scratch,
                                       timeout_s, ended)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
        env = agent_environment(base_url, api_key, SCRATCH_DIR)
        del env["PATH"]  # the isolation's: the interpreter's directory, then the system's
        cmd = self.isolation.command(self.program.argv, env, self.limits)
        return await run_agent(cmd.argv, stdin, cmd.env, "/", timeout_s, ended, cmd.popen_kwargs)
