"""When the trainer asks for an evaluation, and where its result goes
(`eval.interval`, `eval.num_prompts`, `eval.k`, ...): every `interval` policy
versions, the initial weights included, one rollout worker scores the task's
held-out split, k samples a prompt (rollout/evaluation.py), while training goes
on; the next step's metrics record carries the result, with the version it
scored. At most one evaluation runs at a time: one that would start while the
previous is still running is skipped, so evaluation never queues up behind
training.

The record's fields: `eval_reward` (the mean reward over every scored sample,
as before k existed; equal to avg@k when no reward failed), `eval_k`,
`eval_pass_at_1`, `eval_pass_at_k`, `eval_pass_at_<k'>` for each of
`eval.pass_k`, `eval_avg_at_k` and, for a task that gives final answers,
`eval_maj_at_k` (rollout/eval_metrics.py). A job has one task, so they are that
task's.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from reflow.rollout.evaluation import EvalPlan, result_fields

logger = logging.getLogger(__name__)

# The worker generates beside training: allow for a loaded engine.
EVAL_DEADLINE_S = 1800.0


class PeriodicEval:
    def __init__(self, job_id: str, spec, rollouts: list[Any]) -> None:
        self.job_id, self.config, self.rollouts = job_id, spec.eval, rollouts
        c = self.config
        self.plan = EvalPlan(num_prompts=c.num_prompts, greedy=not c.sampled, k=c.k,
                             temperature=c.temperature or 0.0,
                             correct_threshold=c.correct_threshold)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eval")
        self._pending: Future | None = None
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.config.interval > 0 and bool(self.rollouts)

    def maybe_start(self, policy_version: int) -> None:
        """Start an evaluation of `policy_version` if one is due and none is running."""
        if not self.enabled or policy_version % self.config.interval:
            return
        with self._lock:
            if self._pending is not None and not self._pending.done():
                logger.info("job %s: evaluation of v%d skipped: the previous one still runs",
                            self.job_id, policy_version)
                return
            if self._pending is not None:
                return  # a finished result not yet taken: keep it for the next record
            self._pending = self._pool.submit(self._evaluate)

    def _evaluate(self):
        last_error: Exception | None = None
        # The first rollout worker that is generating (one in standby refuses).
        for client in self.rollouts:
            try:
                return client.evaluate(self.job_id, self.plan, deadline_s=EVAL_DEADLINE_S)
            except Exception as err:  # noqa: BLE001 - the next worker may take it
                last_error = err
        raise RuntimeError(f"no rollout worker could evaluate ({last_error})")

    def take(self, wait_s: float = 0.0) -> dict[str, Any]:
        """The finished evaluation's fields for a metrics record ({} if none is
        done), waiting up to `wait_s` for one in progress."""
        with self._lock:
            pending = self._pending
        if pending is None:
            return {}
        try:
            result = pending.result(timeout=wait_s)
        except TimeoutError:
            return {}
        except Exception as err:  # noqa: BLE001 - an evaluation never fails the job
            logger.warning("job %s: evaluation failed: %s", self.job_id, err)
            result = None
        with self._lock:
            self._pending = None
        if result is None:
            return {}
        return result_fields(result, self.config.pass_k)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
