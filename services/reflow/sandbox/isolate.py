"""A long-lived program of the operator's (an agent) under bubblewrap, with the
sandbox's view (reflow.sandbox.executor) but the host's network: the command line
that starts it, built once per program (`Isolation`), and the limits it runs
under (`ProcessLimits`).

What the program gets, as a sandbox does: a view instead of the host's root
(read-only /usr and /etc, the interpreter's prefixes, the operator's
`readable_paths`, the runner), every secret path inside it covered, a fresh
/proc in a pid namespace of its own (no process of the host's, the worker's
/proc/<pid>/environ included, can be named), IPC and UTS namespaces of its own,
no capability, a uid other than root, and a size-bounded tmpfs at /tmp holding
its scratch directory (SCRATCH_DIR: its working directory, HOME and TMPDIR;
nothing it writes reaches the host's disk). What it gets unlike a sandbox: the
network namespace of whoever starts it (an agent calls the worker's endpoint on
127.0.0.1, so every other loopback port and abstract socket of that namespace is
in reach too), and its own argv rather than the runner's protocol.

Limits. A short preamble (`PREAMBLE`, an interpreter under `-I -S`) runs first
inside the view: it gives root up where bubblewrap ran as root (runner step 1,
the same `drop_root`), sets RLIMIT_AS, RLIMIT_NPROC (counted per user namespace
on Linux 5.14 and later: this program's processes and threads alone),
RLIMIT_FSIZE, RLIMIT_CPU and RLIMIT_CORE 0, soft and hard, then execs the
program. The wall clock is the caller's (it kills bubblewrap's process group,
and with bubblewrap's pid 1 every process in the pid namespace).

It knows nothing of agents, episodes or which paths are secret: the caller
says (reflow.rollout.agent_process).
"""

from __future__ import annotations

import math
import os
import subprocess  # nosec B404 # argv lists, no shell
from dataclasses import dataclass
from typing import Any

from reflow.sandbox import runner
from reflow.sandbox.executor import (MAX_ERROR_CHARS, RUNNER_PATH, SCRATCH_DIR, namespace_args,
                                     probe_prefixes, program_env, view_args)

# Runs as `python -I -S -c PREAMBLE <memory> <processes> <file> <cpu> <argv...>`:
# root given up (a no-op where bubblewrap made it nobody), the limits set, the
# program exec'ed. -S: nothing of site-packages is read before the limits bind.
PREAMBLE = f"""\
import os, resource, sys
sys.path.insert(0, {os.path.dirname(RUNNER_PATH)!r})
import runner
runner.drop_root()
limits = zip((resource.RLIMIT_AS, resource.RLIMIT_NPROC, resource.RLIMIT_FSIZE,
              resource.RLIMIT_CPU, resource.RLIMIT_CORE), [*map(int, sys.argv[1:5]), 0])
for which, value in limits:
    hard = resource.getrlimit(which)[1]
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(which, (value, value))
os.execv(sys.argv[5], sys.argv[5:])
"""
# How long the check in `Isolation.check` may take on a loaded machine.
CHECK_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class ProcessLimits:
    """What one isolated program may hold, each a per-process rlimit except
    `max_processes` (processes and threads together) and `scratch_bytes` (its
    tmpfs, all files together)."""

    memory_bytes: int
    max_processes: int
    file_bytes: int
    cpu_s: float
    scratch_bytes: int


@dataclass(frozen=True)
class IsolatedCommand:
    """What to start: `argv` with `env` as its whole environment, and the extra
    keyword arguments of subprocess.Popen (or asyncio's create_subprocess_exec)."""

    argv: list[str]
    env: dict[str, str]
    popen_kwargs: dict[str, Any]


class Isolation:
    """The command lines of programs run with `python` under bubblewrap, seeing
    `readable_paths` besides the interpreter, with `secret_paths` covered. Built
    once (it runs `python` to find its prefixes); `command` is then cheap.
    `privileged` as the sandbox's (None: bubblewrap runs as root when this
    process is root, the preamble then giving root up)."""

    def __init__(self, bwrap: str, python: str, readable_paths: list[str],
                 secret_paths: list[str], privileged: bool | None = None,
                 share_net: bool = True, hostname: str = "isolated") -> None:
        is_root = os.geteuid() == 0
        self.privileged = is_root if privileged is None else privileged
        if self.privileged and not is_root:
            raise ValueError("privileged: true needs a process that runs as root")
        self.bwrap, self.python = bwrap, os.path.abspath(python)
        self.readable_paths, self.secret_paths = list(readable_paths), list(secret_paths)
        self.prefixes = probe_prefixes(python)
        self._head = [bwrap, *namespace_args(self.privileged, share_net=share_net),
                      "--hostname", hostname]
        # A root process that runs bubblewrap unprivileged runs it as nobody.
        self._popen_kwargs: dict[str, Any] = {}
        if is_root and not self.privileged:
            self._popen_kwargs = {"user": runner.NOBODY_UID, "group": runner.NOBODY_UID,
                                  "extra_groups": []}

    def command(self, argv: list[str] | tuple[str, ...], env: dict[str, str],
                limits: ProcessLimits) -> IsolatedCommand:
        """`argv` (its first element an absolute path inside the view) under
        `limits`, with `env` over the sandbox's fixed environment (PATH, HOME and
        TMPDIR in SCRATCH_DIR, few malloc arenas for RLIMIT_AS's sake)."""
        view = view_args(self.python, self.prefixes, self.readable_paths, self.secret_paths,
                         limits.scratch_bytes)
        # Unprivileged, bubblewrap's pid 1 shares the program's user namespace and
        # counts; privileged, the preamble's namespace holds the program alone.
        max_processes = limits.max_processes + (0 if self.privileged else 1)
        preamble = [self.python, "-I", "-S", "-c", PREAMBLE, str(limits.memory_bytes),
                    str(max_processes), str(limits.file_bytes),
                    str(max(1, math.ceil(limits.cpu_s)))]
        return IsolatedCommand([*self._head, *view, "--chdir", SCRATCH_DIR, *preamble, *argv],
                               {**program_env(self.python), "TMPDIR": SCRATCH_DIR, **env},
                               dict(self._popen_kwargs))

    def check(self, limits: ProcessLimits) -> None:
        """Run the interpreter once under isolation: RuntimeError saying what
        bubblewrap or the preamble said where it cannot start (no user
        namespaces in this container, an interpreter nobody may read)."""
        cmd = self.command([self.python, "-c", "pass"], {}, limits)
        try:
            done = subprocess.run(cmd.argv, env=cmd.env, capture_output=True,  # nosec B603 # built here
                                  timeout=CHECK_TIMEOUT_S, check=False, stdin=subprocess.DEVNULL,
                                  start_new_session=True, cwd="/", **cmd.popen_kwargs)
        except (OSError, subprocess.TimeoutExpired) as err:
            raise RuntimeError(f"bubblewrap ({self.bwrap}) does not run: {err}") from err
        if done.returncode != 0:
            said = done.stderr.decode(errors="replace").strip()[-MAX_ERROR_CHARS:]
            raise RuntimeError(f"bubblewrap ({self.bwrap}) cannot start {self.python} isolated: "
                               f"exit {done.returncode}: {said or '(nothing on stderr)'}")

