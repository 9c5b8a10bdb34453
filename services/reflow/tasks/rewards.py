"""Rewards run where they cannot hurt the rollout worker: in a pool of
processes, each scoring in its main thread, with a timeout per call.

The worker's event loop is also vLLM's output loop, so a reward computed on it
stalls generation and weight updates; one that raises would fail the worker,
and one that returns NaN would become NaN advantages and then NaN weights on
every engine. Here every outcome is data: `RewardResult.error` says "" (scored),
"exception", "timeout", "non_finite" or "crashed" (the process died), and the
worker decides what a failed sample becomes (rollout/worker.py: excluded from
the loss). A call that overruns its timeout has its process killed and
replaced, so a reward stuck in a C extension or an endless loop costs one
process, not the job. Processes are spawned (not forked: the parent runs
threads and vLLM) and build the task from its registered name, so nothing
unregistered is ever imported (reflow.core.plugins).

math-verify bounds its parsing with `signal.alarm`, which only works in a main
thread: a pool process calls `reward` in its main thread, as it requires.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import queue
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from reflow.tasks.base import Prompt, TaskContext

logger = logging.getLogger(__name__)

REWARD_ERRORS = ("exception", "timeout", "non_finite", "crashed")
# A pool process builds its task (imports, datasets) before its first call.
START_TIMEOUT_S = 120.0
MAX_MESSAGE_CHARS = 300


@dataclass(frozen=True)
class RewardResult:
    """A reward, or why there is none (`error` one of REWARD_ERRORS, `message` the detail)."""

    value: float
    error: str = ""
    message: str = ""


def _serve(conn: Connection, name: str, args: dict[str, Any], context: TaskContext) -> None:
    """A pool process: build the task once, then score until told to stop."""
    from reflow.tasks import build_task_by_name

    try:
        task = build_task_by_name(name, args, context)
    except BaseException as err:  # noqa: BLE001 - reported to the parent, which fails the call
        conn.send(("failed", f"{type(err).__name__}: {err}"[:MAX_MESSAGE_CHARS]))
        return
    conn.send(("ready", ""))
    while True:
        try:
            request = conn.recv()
        except EOFError:
            return
        if request is None:
            return
        prompt, text = request
        try:
            conn.send(("ok", float(task.reward(prompt, text))))
        except BaseException as err:  # noqa: BLE001 - a plug-in's failure is data here
            conn.send(("error", f"{type(err).__name__}: {err}"[:MAX_MESSAGE_CHARS]))


class _Scorer:
    """One pool process and its pipe."""

    def __init__(self, ctx, name: str, args: dict[str, Any], context: TaskContext) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, name, args, context),
                                   name="reflow-reward", daemon=True)
        self.process.start()
        child.close()
        self.ready = False

    def wait_ready(self) -> None:
        if self.ready:
            return
        if not self.conn.poll(START_TIMEOUT_S):
            raise RuntimeError(f"reward process not ready after {START_TIMEOUT_S:.0f}s")
        kind, message = self.conn.recv()
        if kind != "ready":
            raise RuntimeError(f"reward process could not build the task: {message}")
        self.ready = True

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5.0)
        self.conn.close()


class RewardPool:
    """`num_workers` processes scoring `task` (by registered name and its validated
    arguments) with at most `timeout_s` a call. `score` is thread-safe and blocks;
    the rollout worker calls it off its event loop."""

    def __init__(self, name: str, args: dict[str, Any], context: TaskContext,
                 num_workers: int = 1, timeout_s: float = 10.0) -> None:
        self._ctx = multiprocessing.get_context("spawn")
        self._spec = (name, dict(args), context)
        self.timeout_s = timeout_s
        self._idle: queue.Queue[_Scorer] = queue.Queue()
        self._all: list[_Scorer] = []
        self._lock = threading.Lock()
        self._closed = False
        for _ in range(num_workers):
            self._add(self._spawn())

    def _spawn(self) -> _Scorer:
        return _Scorer(self._ctx, *self._spec)

    def _add(self, scorer: _Scorer) -> None:
        with self._lock:
            self._all.append(scorer)
        self._idle.put(scorer)

    def _replace(self, scorer: _Scorer) -> None:
        scorer.kill()
        with self._lock:
            if scorer in self._all:
                self._all.remove(scorer)
            if self._closed:
                return
        self._add(self._spawn())

    def score(self, prompt: Prompt, response_text: str) -> RewardResult:
        if self._closed:
            raise RuntimeError("the reward pool is closed")
        scorer = self._idle.get()
        try:
            scorer.wait_ready()
            scorer.conn.send((prompt, response_text))
            if not scorer.conn.poll(self.timeout_s):
                logger.warning("reward of %s took over %.1fs: its process is replaced",
                               prompt.prompt_id, self.timeout_s)
                self._replace(scorer)
                return RewardResult(0.0, "timeout", f"over {self.timeout_s:g}s")
            kind, payload = scorer.conn.recv()
        except (EOFError, OSError, RuntimeError) as err:
            logger.warning("reward process lost (%s): replaced", err)
            self._replace(scorer)
            return RewardResult(0.0, "crashed", str(err)[:MAX_MESSAGE_CHARS])
        self._idle.put(scorer)
        if kind == "error":
            return RewardResult(0.0, "exception", payload)
        if not math.isfinite(payload):
            return RewardResult(0.0, "non_finite", repr(payload))
        return RewardResult(payload)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            scorers = list(self._all)
        for scorer in scorers:
            try:
                scorer.conn.send(None)
            except OSError:
                pass
            scorer.process.join(2.0)
            scorer.kill()
