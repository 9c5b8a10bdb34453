"""Job grants: which jobs run on a server, and the job pass this process sends
with its calls for each (reflow.rpcauth checks them; the scheduler signs the
passes, reflow.capabilities). Here without gRPC, so that the stores can hold
them.

A grant is made by the scheduler's signed call naming the job, and lasts until
the job is stopped on the server (`revoke`). A pass proves the caller's role in
the job; a grant says the server runs the job at all (a server that holds none
answers NOT_FOUND, as for a job it never saw).
"""

from __future__ import annotations

import hashlib
import threading
import time


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class JobTokens:
    """The process's book: for each job it was granted, the pass the scheduler
    gave it ("" where the call carried none). Clients send calls naming a job
    with its pass from here; the in-memory services check calls against it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tokens: dict[str, str] = {}

    def grant(self, job_id: str, token: str) -> None:
        with self._lock:
            self._tokens[job_id] = token

    def token(self, job_id: str) -> str:
        with self._lock:
            return self._tokens.get(job_id, "")

    def granted(self, job_id: str) -> bool:
        with self._lock:
            return job_id in self._tokens

    def revoke(self, job_id: str) -> None:
        with self._lock:
            self._tokens.pop(job_id, None)


JOB_TOKENS = JobTokens()


class RedisGrants:
    """The replay buffer's grants: the jobs it serves, in one Redis hash, so they
    outlive a restart and every replica sees them. Read through a local copy
    that is trusted for CACHE_S (a grant revoked through another replica is
    seen within that)."""

    KEY = "reflow:job_grants"
    CACHE_S = 5.0

    def __init__(self, redis_client) -> None:
        self.redis = redis_client
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[bool, float]] = {}

    def grant(self, job_id: str, token: str) -> None:
        del token  # the buffer makes no calls of its own for a job
        with self._lock:
            granted, at = self._cache.get(job_id, (False, 0.0))
            if granted and time.monotonic() - at < self.CACHE_S:
                return
        self.redis.hset(self.KEY, job_id, "1")
        with self._lock:
            self._cache[job_id] = (True, time.monotonic())

    def token(self, job_id: str) -> str:
        return ""

    def granted(self, job_id: str) -> bool:
        with self._lock:
            cached = self._cache.get(job_id)
        if cached is not None and time.monotonic() - cached[1] < self.CACHE_S:
            return cached[0]
        value = bool(self.redis.hexists(self.KEY, job_id))
        with self._lock:
            self._cache[job_id] = (value, time.monotonic())
        return value

    def revoke(self, job_id: str) -> None:
        self.redis.hdel(self.KEY, job_id)
        with self._lock:
            self._cache[job_id] = (False, time.monotonic())
