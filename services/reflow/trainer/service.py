"""The trainer service's core: runs one job's `TrainLoop` on a thread and
reports its state. Transport lives in `server.py`."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from reflow.core.config import JobSpec, check_job_id
from reflow.core.errors import FailedPrecondition
from reflow.core.paths import PathRoots
from reflow.replay.client import GrpcReplayClient
from reflow.rollout.client import GrpcRolloutClient
from reflow.trainer.loop import JobStopped, TrainLoop

logger = logging.getLogger(__name__)

# Rollout workers one trainer broadcasts weights to (its weight-sync group less itself).
MAX_ROLLOUT_WORKERS = 4095


class TrainerService:
    def __init__(self, replay_client_factory=GrpcReplayClient,
                 rollout_client_factory=GrpcRolloutClient, metrics=None,
                 roots: PathRoots | None = None) -> None:
        self.metrics = metrics
        self.roots = roots or PathRoots.from_env()
        self._replay_client_factory = replay_client_factory
        self._rollout_client_factory = rollout_client_factory
        self._lock = threading.Lock()
        self.job_id = ""
        self.state = "idle"
        self.error = ""
        self.loop: TrainLoop | None = None
        self._thread: threading.Thread | None = None

    def start_job(self, job_id: str, spec: JobSpec, replay_address: str,
                  rollout_addresses: list[str], run_dir: str) -> None:
        check_job_id(job_id)
        if not 1 <= len(rollout_addresses) <= MAX_ROLLOUT_WORKERS:
            raise ValueError(f"rollout_addresses: {len(rollout_addresses)} given; a job has 1 to "
                             f"{MAX_ROLLOUT_WORKERS} rollout workers")
        # Paths from the request resolve under this process's roots, or are refused.
        model_path = self.roots.model_dir(spec.model.path)
        spec = spec.model_copy(update={"model": spec.model.model_copy(
            update={"path": str(model_path)})})
        run_dir = str(self.roots.run_dir(run_dir)) if run_dir else ""
        with self._lock:
            if self.state in ("starting", "running"):
                if self.job_id == job_id:
                    return
                raise FailedPrecondition(f"this trainer already runs job {self.job_id}")
            self.job_id, self.state, self.error = job_id, "starting", ""
            replay = self._replay_client_factory(replay_address)
            rollouts = [self._rollout_client_factory(a) for a in rollout_addresses]
            self.loop = TrainLoop(
                job_id, spec, replay, rollouts, run_dir=run_dir or None,
                master_address=os.environ.get("REFLOW_POD_IP", "127.0.0.1"),
                metrics=self.metrics,
            )
            self._thread = threading.Thread(target=self._run, name="train-loop", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        loop = self.loop
        if loop is None:
            raise RuntimeError("trainer: _run started before start_job created the loop")
        try:
            from reflow.models.tiny import ensure_model

            ensure_model(loop.spec.model.path, loop.spec.model.build_if_missing, seed=loop.spec.seed)
            loop.load()
            loop.init_weight_sync()
            self.state = "running"
            loop.run()
            if loop.run_dir is not None:
                loop.save(Path(loop.run_dir) / "checkpoint")
            self.state = "succeeded"
        except JobStopped:
            self.state = "stopped"
        except Exception as err:  # noqa: BLE001 - reported through GetStatus
            logger.exception("job %s: training failed", self.job_id)
            self.state, self.error = "failed", f"{type(err).__name__}: {err}"
        finally:
            loop.close()

    def stop_job(self, job_id: str) -> None:
        if job_id != self.job_id or self.loop is None:
            raise KeyError(f"job {job_id!r} does not run on this trainer")
        self.loop.stop()
        if self._thread is not None:
            self._thread.join(30)

    def status(self, job_id: str, since_step: int = -1) -> dict:
        """State and progress; with since_step >= 0 also the metrics records of the
        steps after it that are still in the trainer's window."""
        if job_id and job_id != self.job_id:
            raise KeyError(f"job {job_id!r} does not run on this trainer")
        loop = self.loop
        return {
            "job_id": self.job_id,
            "state": self.state,
            "step": loop.step if loop else 0,
            "policy_version": loop.policy_version if loop else 0,
            "last_metrics": loop.last_metrics if loop else {},
            "error": self.error,
            "metrics": ([r for r in list(loop.recent_metrics) if r["step"] > since_step]
                        if loop and since_step >= 0 else []),
        }
