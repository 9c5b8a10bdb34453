"""Job grants: which token each job's calls must carry (reflow.rpcauth checks
them; the scheduler issues them). Here without gRPC, so that the scheduler's
core and the stores can hold and issue tokens.
"""

from __future__ import annotations

import hashlib
import threading


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class JobTokens:
    """The process's book of job tokens: those the scheduler issued, or a server
    was granted. Clients send calls naming a job with its token from here; the
    in-memory services check calls against it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tokens: dict[str, str] = {}

    def grant(self, job_id: str, token: str) -> None:
        with self._lock:
            self._tokens[job_id] = token

    def token(self, job_id: str) -> str:
        with self._lock:
            return self._tokens.get(job_id, "")

    def granted_digest(self, job_id: str) -> str | None:
        token = self.token(job_id)
        return digest(token) if token else None


JOB_TOKENS = JobTokens()


class RedisGrants:
    """The replay buffer's grants: job -> token digest in one Redis hash, so they
    outlive a restart and every replica sees them. Read through a local copy; a
    copy that disagrees with a call is read again (another replica may have been
    granted a newer token)."""

    KEY = "reflow:job_grants"

    def __init__(self, redis_client) -> None:
        self.redis = redis_client
        self._lock = threading.Lock()
        self._cache: dict[str, str] = {}

    def grant(self, job_id: str, token: str) -> None:
        wanted = digest(token)
        with self._lock:
            if self._cache.get(job_id) == wanted:
                return
        self.redis.hset(self.KEY, job_id, wanted)
        with self._lock:
            self._cache[job_id] = wanted

    def granted_digest(self, job_id: str, fresh: bool = False) -> str | None:
        with self._lock:
            cached = self._cache.get(job_id)
        if cached is not None and not fresh:
            return cached
        raw = self.redis.hget(self.KEY, job_id)
        if raw is None:
            return None
        value = raw.decode() if isinstance(raw, bytes) else str(raw)
        with self._lock:
            self._cache[job_id] = value
        return value


