"""The job store: job records in Redis, so that a scheduler or API restart
loses no job. Owns the record layout; knows nothing of how jobs run."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

import redis

PHASES = ("PENDING", "RUNNING", "SUCCEEDED", "FAILED", "STOPPED")
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")

_JOBS = "reflow:jobs"
_ORDER = "reflow:jobs:order"


@dataclass
class JobRecord:
    job_id: str
    name: str
    spec_json: str
    phase: str = "PENDING"
    reason: str = ""
    step: int = 0
    num_steps: int = 0
    policy_version: int = 0
    reward_mean: float = 0.0
    trainer_tokens_per_s: float = 0.0
    created_at: float = field(default_factory=time.time)
    started_at: float = 0.0
    finished_at: float = 0.0
    run_dir: str = ""

    @property
    def terminal(self) -> bool:
        return self.phase in TERMINAL


class JobStore:
    def __init__(self, client: redis.Redis) -> None:
        self.redis = client

    def create(self, record: JobRecord) -> JobRecord:
        """Insert a new job; an existing id returns the stored record unchanged
        (idempotent submission)."""
        created = self.redis.hsetnx(_JOBS, record.job_id, json.dumps(asdict(record)))
        if created:
            self.redis.zadd(_ORDER, {record.job_id: record.created_at})
            return record
        return self.get(record.job_id)

    def save(self, record: JobRecord) -> None:
        self.redis.hset(_JOBS, record.job_id, json.dumps(asdict(record)))

    def get(self, job_id: str) -> JobRecord:
        raw = self.redis.hget(_JOBS, job_id)
        if raw is None:
            raise KeyError(f"no job {job_id!r}")
        return JobRecord(**json.loads(raw))

    def list(self, limit: int = 100) -> list[JobRecord]:
        ids = self.redis.zrevrange(_ORDER, 0, max(0, limit - 1))
        if not ids:
            return []
        raws = self.redis.hmget(_JOBS, ids)
        return [JobRecord(**json.loads(r)) for r in raws if r is not None]
