"""The job store: job records and their per-step metrics in Redis, so that a
scheduler or API restart loses no job. Owns the record layout; knows nothing
of how jobs run.

Redis outages: the scheduler's client (redisconn.connect) retries each command
for a bounded time and then raises `core.errors.Unavailable`; a job's last
save (`save_final`) keeps trying much longer, and logs rather than raises when
it gives up, so a job's watcher thread always ends cleanly.

Layout:
    reflow:jobs                 hash  job_id -> JobRecord JSON
    reflow:jobs:seq             int   submission counter
    reflow:jobs:order           zset  job_id scored by submission number (paging cursor)
    reflow:jobs:<id>:metrics    zset  step record JSON scored by step
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

import redis

from reflow.core.errors import Unavailable

logger = logging.getLogger(__name__)

PHASES = ("PENDING", "RUNNING", "SUCCEEDED", "FAILED", "STOPPED")
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
# The services of a job whose logs a user can read.
LOG_SERVICES = ("replay", "rollout", "trainer")

_JOBS = "reflow:jobs"
_SEQ = "reflow:jobs:seq"
_ORDER = "reflow:jobs:order"
# Job id -> the job's token (rpcauth): apart from the records, which the API shows.
# A job keeps at most this many step records (a 100k-step run's worth).
MAX_METRICS_RECORDS = 100_000
# How long a job's terminal record keeps being retried, and how often.
FINAL_SAVE_S, FINAL_SAVE_RETRY_S = 600.0, 5.0
# What a save gets when Redis does not answer: Unavailable from a redisconn
# client, redis' own errors from another.
_OUTAGE = (Unavailable, redis.ConnectionError, redis.TimeoutError)

# Insert and index in one step: a crash between the two would leave a job
# that exists but never shows up in a listing.
_CREATE = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
local seq = redis.call('INCR', KEYS[2])
redis.call('ZADD', KEYS[3], seq, ARGV[1])
return 1
"""


def _metrics_key(job_id: str) -> str:
    return f"reflow:jobs:{job_id}:metrics"


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
    # Where the job runs: role -> worker names (pods on Kubernetes; empty locally).
    workers: dict[str, list[str]] = field(default_factory=dict)
    # Services the job controller restarted after they died: service -> count.
    restarts: dict[str, int] = field(default_factory=dict)
    # When (Unix time) each was restarted within cluster.restart_window_s: the
    # crash-loop budget's memory, kept in the record so a standby continues it.
    restart_times: dict[str, list[float]] = field(default_factory=dict)

    @property
    def terminal(self) -> bool:
        return self.phase in TERMINAL


class JobStore:
    def __init__(self, client: redis.Redis) -> None:
        self.redis = client
        self._create = client.register_script(_CREATE)

    def create(self, record: JobRecord) -> tuple[JobRecord, bool]:
        """Insert a new job. An existing id returns the stored record unchanged and
        False (the caller decides whether that is an idempotent retry or a clash),
        unless the stored record is this one, byte for byte: this call's own insert,
        whose reply was lost and whose command was retried."""
        payload = json.dumps(asdict(record))
        created = self._create(keys=[_JOBS, _SEQ, _ORDER], args=[record.job_id, payload])
        # A reply lost after the insert, and the command retried, finds this very
        # record (its created_at too): it was created by this call all the same.
        if created or self.redis.hget(_JOBS, record.job_id) == payload.encode():
            return record, True
        return self.get(record.job_id), False

    def exists(self, job_id: str) -> bool:
        return bool(self.redis.hexists(_JOBS, job_id))

    def save(self, record: JobRecord) -> None:
        self.redis.hset(_JOBS, record.job_id, json.dumps(asdict(record)))

    def save_final(self, record: JobRecord, timeout_s: float = FINAL_SAVE_S) -> bool:
        """Save a job's terminal record, retrying a Redis outage for up to `timeout_s`;
        False (logged) if it could not. Never raises for an outage: the job's watcher
        ends either way, and a later scheduler's recover() marks a record it left
        RUNNING failed."""
        give_up = time.monotonic() + timeout_s
        while True:
            try:
                self.save(record)
                return True
            except _OUTAGE as err:
                if time.monotonic() + FINAL_SAVE_RETRY_S > give_up:
                    logger.error("job %s: its final state %s could not be stored (%s); the "
                                 "store shows it unfinished until a scheduler restart "
                                 "recovers it", record.job_id, record.phase, err)
                    return False
                logger.warning("job %s: final state %s not stored yet (%s); retrying",
                               record.job_id, record.phase, err)
                time.sleep(FINAL_SAVE_RETRY_S)

    def get(self, job_id: str) -> JobRecord:
        raw = self.redis.hget(_JOBS, job_id)
        if raw is None:
            raise KeyError(f"no job {job_id!r}")
        return JobRecord(**json.loads(raw))

    def page(self, limit: int = 100,  # nosec B107 # page_token is a cursor, not a secret
             page_token: str = "") -> tuple[list[JobRecord], str]:
        """Newest first. The token is the submission number of the last job returned,
        so pages stay stable while new jobs arrive."""
        if not 1 <= limit <= 1000:
            raise ValueError(f"limit: {limit} is out of range; use 1 to 1000")
        # ASCII digits only: str.isdigit() also accepts "²" or "١", which Redis
        # cannot read as a score (and answers with an error, not an empty page).
        if page_token and not (page_token.isascii() and page_token.isdigit()
                               and len(page_token) <= 20):
            raise ValueError("page_token: not a token this API returned; "
                             "pass next_page_token from the previous page")
        top = f"({page_token}" if page_token else "+inf"
        rows = self.redis.zrevrangebyscore(_ORDER, top, "-inf", start=0, num=limit + 1,
                                           withscores=True)
        more = len(rows) > limit
        rows = rows[:limit]
        if not rows:
            return [], ""
        raws = self.redis.hmget(_JOBS, [job_id for job_id, _ in rows])
        records = [JobRecord(**json.loads(r)) for r in raws if r is not None]
        return records, (str(int(rows[-1][1])) if more else "")

    def all(self) -> Iterator[JobRecord]:
        token = ""  # nosec B105 # a pagination cursor, not a secret
        while True:
            records, token = self.page(1000, token)
            yield from records
            if not token:
                return

    def append_metrics(self, job_id: str, records: list[dict[str, Any]]) -> None:
        if not records:
            return
        key = _metrics_key(job_id)
        pipe = self.redis.pipeline(transaction=True)
        pipe.zadd(key, {json.dumps(r, sort_keys=True): int(r["step"]) for r in records})
        pipe.zremrangebyrank(key, 0, -MAX_METRICS_RECORDS - 1)
        pipe.execute()

    def drop_metrics_after(self, job_id: str, step: int) -> int:
        """Forget the records of steps after `step`: a trainer resumed from that
        step's checkpoint trains them again, and each step keeps one record."""
        return int(self.redis.zremrangebyscore(_metrics_key(job_id), f"({step}", "+inf"))

    def metrics(self, job_id: str, since_step: int = 0, limit: int = 1000) -> list[dict[str, Any]]:
        if not 1 <= limit <= 10_000:
            raise ValueError(f"limit: {limit} is out of range; use 1 to 10000")
        self.get(job_id)  # NotFound for an unknown job, not an empty list
        raws = self.redis.zrangebyscore(_metrics_key(job_id), f"({since_step}", "+inf",
                                        start=0, num=limit)
        return [json.loads(r) for r in raws]
