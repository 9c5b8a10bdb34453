"""The scheduler's core: job lifecycles.

A submitted job is recorded PENDING, placed by the cluster backend, started
on its services (rollout first, so the engine warms while the trainer
loads), then watched: progress comes from the trainer's status, failures
from any service process exiting or reporting an error. At the end its
services are torn down and the record gets its terminal phase and reason.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from pathlib import Path

from reflow.core.config import JobSpec
from reflow.rollout.client import GrpcRolloutClient
from reflow.scheduler.jobs import JobRecord, JobStore
from reflow.scheduler.local import LocalBackend, Placement
from reflow.trainer.client import GrpcTrainerClient

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 1.0


class Scheduler:
    def __init__(self, store: JobStore, backend: LocalBackend, runs_root: Path) -> None:
        self.store = store
        self.backend = backend
        self.runs_root = Path(runs_root)
        self._stops: dict[str, threading.Event] = {}
        self._threads: dict[str, threading.Thread] = {}
        self._lock = threading.Lock()

    def recover(self) -> None:
        """Jobs that were running when a previous scheduler died lost their local
        processes with it: mark them failed rather than leave them RUNNING forever."""
        for record in self.store.list(limit=10_000):
            if not record.terminal:
                record.phase, record.reason = "FAILED", "scheduler restarted while the job ran"
                record.finished_at = time.time()
                self.store.save(record)

    def submit(self, spec_json: str, job_id: str = "", run_dir: str = "") -> JobRecord:
        spec = JobSpec.model_validate_json(spec_json)
        job_id = job_id or f"{spec.name}-{uuid.uuid4().hex[:8]}"
        record = JobRecord(
            job_id=job_id, name=spec.name, spec_json=spec.model_dump_json(),
            num_steps=spec.trainer.num_steps,
            run_dir=str(Path(run_dir) if run_dir else self.runs_root / job_id),
        )
        stored = self.store.create(record)
        if stored is record:
            stop = threading.Event()
            thread = threading.Thread(target=self._run_job, args=(record, stop),
                                      name=f"job-{job_id}", daemon=True)
            with self._lock:
                self._stops[job_id], self._threads[job_id] = stop, thread
            thread.start()
        return stored

    def get(self, job_id: str) -> JobRecord:
        return self.store.get(job_id)

    def list(self, limit: int = 100) -> list[JobRecord]:
        return self.store.list(limit)

    def stop(self, job_id: str) -> JobRecord:
        record = self.store.get(job_id)
        stop = self._stops.get(job_id)
        if stop is not None and not record.terminal:
            stop.set()
            self._threads[job_id].join(60)
        return self.store.get(job_id)

    def shutdown(self) -> None:
        for job_id in list(self._stops):
            self._stops[job_id].set()
        for thread in list(self._threads.values()):
            thread.join(60)

    # --- one job ---------------------------------------------------------------------

    def _run_job(self, record: JobRecord, stop: threading.Event) -> None:
        placement: Placement | None = None
        run_dir = Path(record.run_dir)
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            record.phase, record.started_at = "RUNNING", time.time()
            self.store.save(record)
            self._prepare_model(record)
            placement = self.backend.place(record.job_id, run_dir)
            rollouts = [GrpcRolloutClient(a) for a in placement.rollout_addresses]
            trainer = GrpcTrainerClient(placement.trainer_address)
            for client in rollouts:
                client.start_job(record.job_id, record.spec_json, placement.replay_address)
            trainer.start_job(record.job_id, record.spec_json, placement.replay_address,
                              placement.rollout_addresses, str(run_dir))
            record.phase, record.reason = self._watch(record, placement, trainer, rollouts, stop)
        except Exception as err:  # noqa: BLE001 - the job fails, the scheduler lives on
            logger.exception("job %s failed", record.job_id)
            record.phase, record.reason = "FAILED", f"{type(err).__name__}: {err}"
        finally:
            if placement is not None:
                self.backend.release(placement)
            record.finished_at = time.time()
            self.store.save(record)
            logger.info("job %s %s %s", record.job_id, record.phase, record.reason)

    @staticmethod
    def _prepare_model(record: JobRecord) -> None:
        """Build the model preset once, here, before two services race to load it."""
        from reflow.models.tiny import ensure_model

        spec = JobSpec.model_validate_json(record.spec_json)
        ensure_model(spec.model.path, spec.model.build_if_missing, seed=spec.seed)

    def _watch(self, record: JobRecord, placement: Placement, trainer: GrpcTrainerClient,
               rollouts: list[GrpcRolloutClient], stop: threading.Event) -> tuple[str, str]:
        while True:
            if stop.wait(POLL_INTERVAL_S):
                trainer.stop_job(record.job_id)
                return "STOPPED", "stopped by request"
            exited = placement.exited()
            if exited:
                name, code = exited[0]
                return "FAILED", f"{name} exited with code {code}; see {record.run_dir}/logs/{name}.log"
            for client in rollouts:
                stats = client.stats(record.job_id)
                if stats.state == "failed":
                    return "FAILED", f"rollout: {stats.error}"
            status = trainer.status(record.job_id)
            self._update_progress(record, status)
            if status.state == "succeeded":
                return "SUCCEEDED", ""
            if status.state == "failed":
                return "FAILED", f"trainer: {status.error}"

    def _update_progress(self, record: JobRecord, status) -> None:
        m = status.last_metrics
        record.step, record.policy_version = status.step, status.policy_version
        if m:
            record.reward_mean = float(m.get("reward_mean", 0.0))
            record.trainer_tokens_per_s = float(m.get("trainer_tokens_per_s", 0.0))
        self.store.save(record)
