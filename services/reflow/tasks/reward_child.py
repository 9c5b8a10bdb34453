"""A reward process: the child side of reflow.tasks.rewards.

Started as `python -m reflow.tasks.reward_child LIMITS_JSON SECRET_PATHS_JSON`
with a clean environment (reflow.tasks.confine.environment), it confines
itself before anything else (limits, namespaces, the worker's secret files
hidden, no capabilities: reflow.tasks.confine), then builds its task by
registered name and scores one request at a time, in its main thread
(math-verify's `signal.alarm`).

The protocol is newline-delimited JSON over the process's stdin and stdout,
which are moved to fds of their own first, so what a reward prints goes to
stderr and what it reads from stdin is empty. The pool never trusts what comes
back (a compromised reward may write anything there): it validates every line.

    pool -> child   {"task", "args", "seed", "datasets_root"}            once
    child -> pool   {"kind": "ready", <Confinement fields>}
                  | {"kind": "failed", "message"}                         (then exits)
    pool -> child   {"id", "prompt_id", "text", "answer", "response"}    per call
    child -> pool   {"id", "kind": "ok", "value", "retire"}
                  | {"id", "kind": "error", "message", "limit", "retire"}

`limit` says the call hit a resource limit (MemoryError, the call's CPU
budget, the file size limit); `retire` that the process is near its lifetime
CPU limit and exits: the pool replaces it. This module knows nothing of pools,
timeouts or how a failed call is counted.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import sys
from pathlib import Path
from typing import BinaryIO

from reflow.tasks import confine

MAX_MESSAGE_CHARS = 300


def _protocol_fds() -> tuple[int, int]:
    """The pipes to the pool, moved off fds 0 and 1: stdin becomes /dev/null and
    stdout a copy of stderr."""
    proto_in, proto_out = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    return proto_in, proto_out


def _send(fd: int, message: dict) -> None:
    view = memoryview((json.dumps(message) + "\n").encode())
    while view:
        view = view[os.write(fd, view):]


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"[:MAX_MESSAGE_CHARS]


def _is_limit(err: BaseException) -> bool:
    return (isinstance(err, (MemoryError, confine.CpuLimitExceeded))
            or (isinstance(err, OSError) and err.errno == errno.EFBIG))


def _exit_like(pid: int) -> None:
    """The forking process: wait for the namespace's init, then end as it ended
    (the same exit code, or the same signal), so the pool sees why it died."""
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        with contextlib.suppress(OSError, ValueError):
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


def _serve(requests: BinaryIO, out_fd: int, report: confine.Confinement,
           cpu_s_per_call: int) -> None:
    """Build the task, then score until the pool closes stdin (or the process retires)."""
    from reflow.tasks import Prompt, TaskContext, build_task_by_name

    init = json.loads(requests.readline())
    try:
        task = build_task_by_name(init["task"], init["args"], TaskContext(
            seed=init["seed"], datasets_root=Path(init["datasets_root"])))
    except BaseException as err:  # noqa: BLE001 - reported to the pool, which fails the call
        _send(out_fd, {"kind": "failed", "message": _describe(err)})
        return
    report.note = report.note[:MAX_MESSAGE_CHARS]
    _send(out_fd, {"kind": "ready", **report.to_dict()})
    for line in requests:
        request = json.loads(line)
        prompt = Prompt(request["prompt_id"], request["text"], request["answer"])
        try:
            with confine.call_budget(cpu_s_per_call):
                value = float(task.reward(prompt, request["response"]))
            reply = {"id": request["id"], "kind": "ok", "value": value}
        except BaseException as err:  # noqa: BLE001 - a plug-in's failure is data here
            reply = {"id": request["id"], "kind": "error", "message": _describe(err),
                     "limit": _is_limit(err)}
        reply["retire"] = confine.cpu_left_s() < cpu_s_per_call
        _send(out_fd, reply)
        if reply["retire"] or reply.get("limit"):
            return


def main(argv: list[str]) -> None:
    limits = confine.RewardLimits.model_validate_json(argv[1])
    secret_paths = confine.parse_secret_paths(argv[2])
    proto_in, proto_out = _protocol_fds()
    report = confine.confine(limits)
    if report.pid_namespace:
        pid = os.fork()
        if pid:
            os.close(proto_in)
            os.close(proto_out)
            confine.drop_privileges()
            _exit_like(pid)
        confine.set_parent_death_signal()
        report.proc_isolated = confine.mount_proc()
        confine.hide_files(secret_paths, report)
    confine.drop_privileges()
    with os.fdopen(proto_in, "rb") as requests:
        _serve(requests, proto_out, report, max(1, limits.cpu_s_per_call))


if __name__ == "__main__":
    main(sys.argv)
