"""What a scheduler does with the jobs another scheduler left: on start-up
(`recover`), and when a user resumes a stopped or failed job (`resume`).

A RUNNING job found in the job store was being watched by a scheduler that is
gone: killed, evicted, or shut down gracefully, handing its jobs over
(`Scheduler.shutdown`). What becomes of it depends on where it runs:

- **Re-adopted** where its services outlived that scheduler (worker pods on
  Kubernetes): the backend finds its pods again by their job label and checks
  that each worker still serves the job (`Backend.adopt`); the job is watched
  again as it runs, its trainer never stopped, and a new dispatcher continues
  the prompt stream from the dispatch ledger, sending the groups that were in
  flight again under their ids (the rollout worker takes a group id it still
  holds as a retry, and the buffer's put is idempotent per group id).
- **Resumed from its newest committed checkpoint** where they did not (local
  processes die with the scheduler that started them), or where adoption finds
  the job's workers gone or an elastic job (its pool's roles are the dead
  scheduler's state): the backend takes its workers back first, then the job is
  placed again and its trainer resumes the checkpoint's step, version,
  optimizer and RNG (trainer/checkpoint.py).
- **Failed**, saying why, when it has no committed checkpoint to resume from.

PENDING jobs wait for workers again in submission order (scheduler/jobcontrol/queue.py).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from reflow.core.config import JobSpec, check_job_id
from reflow.core.errors import FailedPrecondition, ResourceExhausted
from reflow.scheduler.jobcontrol.jobs import JobRecord
from reflow.trainer.checkpoint import CheckpointError, check_resume_dir

logger = logging.getLogger(__name__)


class JobRecovery:
    """Scheduler methods for jobs left by another scheduler (a mixin of
    scheduler.service.Scheduler: it uses its store, backend, roots and threads)."""

    def recover(self) -> None:
        """Take up every unfinished job of the store, oldest first: re-adopt,
        resume or fail each RUNNING one (see the module docstring), and queue the
        PENDING ones again."""
        # A flip a dead scheduler left half done (Kubernetes) is rolled back first.
        recover_flips = getattr(self.backend, "recover_flips", None)
        if recover_flips is not None:
            recover_flips()
        unfinished = sorted((r for r in self.store.all() if not r.terminal),
                            key=lambda r: r.created_at)
        adopted = self._adopt_running(unfinished)
        # Workers still labelled with a job no one watches any more go back to the pool.
        self.backend.reclaim_orphans(active_job_ids=set(adopted))
        for record in unfinished:
            if record.job_id in adopted:
                record.reason = (f"re-adopted at step {record.step} by a new scheduler; "
                                 "it ran on meanwhile")
                self.store.save(record)
                logger.info("job %s: %s", record.job_id, record.reason)
                self._start_thread(record, resume=False, adopted=adopted[record.job_id])
                continue
            resume = False
            if record.phase == "RUNNING":
                try:
                    info = check_resume_dir(self.roots.run_dir(record.run_dir))
                except (CheckpointError, ValueError) as err:
                    record.phase, record.finished_at = "FAILED", time.time()
                    record.reason = f"scheduler restarted while the job ran; no resume: {err}"
                    self.store.save(record)
                    continue
                resume = True
                record.phase, record.step = "PENDING", info.step
                record.reason = f"scheduler restarted; resuming from step {info.step}"
                self.store.drop_metrics_after(record.job_id, info.step)
                self._backfill_metrics(record, info.step)
                self.store.save(record)
            logger.info("job %s: %s", record.job_id, record.reason or "pending again")
            self._start_thread(record, resume)

    def _adopt_running(self, unfinished: list[JobRecord]) -> dict:
        """The RUNNING fixed-role jobs whose workers the backend finds still serving
        them: job id -> placement. A backend whose services die with the scheduler
        (local) adopts nothing."""
        adopt = getattr(self.backend, "adopt", None)
        if adopt is None:
            return {}
        adopted = {}
        for record in unfinished:
            if record.phase != "RUNNING":
                continue
            try:
                if JobSpec.model_validate_json(record.spec_json).cluster.workers:
                    # An elastic job's roles and flips in flight were the dead
                    # scheduler's: it resumes from its checkpoint instead.
                    continue
                placement = adopt(record.job_id)
            except Exception as err:  # noqa: BLE001 - not adoptable: it resumes instead
                logger.warning("job %s: not re-adopted: %s: %s", record.job_id,
                               type(err).__name__, err)
                continue
            if placement is not None:
                adopted[record.job_id] = placement
        return adopted

    def _backfill_metrics(self, record: JobRecord, upto_step: int) -> int:
        return backfill_metrics(self.store, record.job_id,
                                self.roots.run_dir(record.run_dir), upto_step)

    def resume(self, job_id: str) -> JobRecord:
        """Continue a STOPPED or FAILED job from its newest committed checkpoint
        (trainer/checkpoint.py): its services start again, the trainer resumes the
        checkpoint's step, version, optimizer and RNG, and the dispatcher its prompt
        stream and the groups that were in flight (scheduler/generation/inflight.py).
        FailedPrecondition when the job is active, succeeded, or has no checkpoint."""
        check_job_id(job_id)
        record = self.store.get(job_id)
        if record.phase not in ("STOPPED", "FAILED"):
            raise FailedPrecondition(f"job {job_id} is {record.phase}; only a stopped or "
                                     "failed job resumes")
        try:
            info = check_resume_dir(self.roots.run_dir(record.run_dir))
        except CheckpointError as err:
            raise FailedPrecondition(f"job {job_id} cannot resume: {err}") from None
        with self._lock:
            active = sum(1 for t in self._threads.values() if t.is_alive())
            thread = self._threads.get(job_id)
            if thread is not None and thread.is_alive():
                raise FailedPrecondition(f"job {job_id} is still tearing down; retry")
            if active >= self.limits.max_active_jobs:
                raise ResourceExhausted(
                    f"{active} jobs are pending or running, this cluster's ceiling "
                    f"(REFLOW_MAX_ACTIVE_JOBS={self.limits.max_active_jobs}); retry when one ends")
            record.phase, record.reason = "PENDING", f"resuming from step {info.step}"
            record.finished_at = 0.0
            record.step = info.step
            self.store.drop_metrics_after(job_id, info.step)
            self._backfill_metrics(record, info.step)
            self.store.save(record)
            self._start_thread(record, resume=True)
        return record


def backfill_metrics(store, job_id: str, run_dir: Path, upto_step: int) -> int:
    """Steps up to a checkpoint that the job store never got (trained after the last
    poll of a scheduler that died, or of a trainer that died after its checkpoint),
    from the trainer's own `metrics.jsonl` in the run directory; returns the
    records added."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    have = {int(m["step"]) for m in store.metrics(job_id, 0, 10_000)}
    missing = []
    for line in path.read_text().splitlines():
        try:
            m = json.loads(line)
            step = int(m["step"])
        except (ValueError, KeyError, TypeError):
            continue  # a torn last line
        if step <= upto_step and step not in have:
            missing.append(m)
            have.add(step)
    store.append_metrics(job_id, sorted(missing, key=lambda m: int(m["step"])))
    return len(missing)
