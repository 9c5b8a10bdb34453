"""The rollout service's core: one rollout worker per job on this process.

Builds the job's engine, task and tokenizer, and hands weight-sync and stats
requests to the worker. Transport lives in `server.py`.
"""

from __future__ import annotations

import logging
import threading

from reflow.core.config import JobSpec
from reflow.replay.client import GrpcReplayClient, ReplayClient
from reflow.rollout.engine import WeightSyncSpec
from reflow.rollout.tasks import build_task
from reflow.rollout.worker import RolloutCounters, RolloutWorker

logger = logging.getLogger(__name__)


def _vllm_factory(spec: JobSpec):
    def build():
        from reflow.rollout.vllm_engine import VllmEngine

        return VllmEngine(
            spec.model.path,
            dtype=spec.model.dtype,
            kv_cache_gb=spec.rollout.kv_cache_gb,
            seed=spec.seed,
        )

    return build


class RolloutService:
    def __init__(self, replay_client_factory=GrpcReplayClient, engine_factory=None) -> None:
        self._replay_client_factory = replay_client_factory
        self._engine_factory = engine_factory or _vllm_factory
        self._lock = threading.Lock()
        self.worker: RolloutWorker | None = None
        self._replay: ReplayClient | None = None

    def start_job(self, job_id: str, spec: JobSpec, replay_address: str) -> None:
        from transformers import AutoTokenizer

        from reflow.models.tiny import ensure_model

        with self._lock:
            if self.worker is not None and self.worker.state in ("starting", "running"):
                if self.worker.job_id == job_id:
                    return  # a retried start is a no-op
                raise ValueError(f"this rollout worker already runs job {self.worker.job_id}")
            # A no-op when the scheduler built it already; a worker pod with its own
            # volume builds the preset itself (atomically, so racing pods are safe).
            ensure_model(spec.model.path, spec.model.build_if_missing, seed=spec.seed)
            tokenizer = AutoTokenizer.from_pretrained(spec.model.path)
            self._replay = self._replay_client_factory(replay_address)
            task = build_task(
                spec.task.name, spec.task.max_count, spec.task.num_symbols, seed=spec.seed + 1
            )
            self.worker = RolloutWorker(
                job_id,
                spec,
                self._engine_factory(spec),
                task,
                self._replay,
                encode=lambda text: tokenizer.encode(text, add_special_tokens=False),
                decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
            )
            self.worker.start()
            logger.info("job %s: rollout starting", job_id)

    def _worker_for(self, job_id: str) -> RolloutWorker:
        if self.worker is None or self.worker.job_id != job_id:
            raise KeyError(f"job {job_id!r} does not run on this rollout worker")
        return self.worker

    def stop_job(self, job_id: str) -> None:
        worker = self._worker_for(job_id)
        worker.stop()
        if self._replay is not None:
            self._replay.close()

    def init_weight_sync(self, job_id: str, spec: WeightSyncSpec) -> None:
        self._worker_for(job_id).init_weight_sync(spec)

    def update_weights(self, job_id: str, policy_version: int) -> tuple[float, float]:
        return self._worker_for(job_id).update_weights(policy_version)

    def stats(self, job_id: str) -> tuple[RolloutCounters, float, str, str]:
        worker = self._worker_for(job_id)
        return worker.counters, worker.idle_seconds(), worker.state, worker.error

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.stop()
