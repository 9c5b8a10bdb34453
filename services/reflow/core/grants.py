"""Job grants: which jobs run on a server, and the job pass this process sends
with its calls for each (reflow.rpcauth checks them; the scheduler signs the
passes, reflow.capabilities). Here without gRPC, so that the stores can hold
them.

A grant is made by the scheduler's signed call starting the job there, and
lasts until the job is stopped on the server (`revoke`). A pass proves the
caller's role in the job; a grant says the server runs the job at all (a server
that holds none answers NOT_FOUND, as for a job it never saw).
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
    outlive a restart and every replica sees them. The scheduler's starting call
    for a job grants it (`grant`); any other of its calls naming the job grants it
    only if the job never ended here (`grant_unless_ended`: a job placed before
    its grant was kept, or one a Redis that lost writes forgot). `revoke` (the
    scheduler's EndJob) leaves the job marked ended rather than forgotten, so that
    a later read of a finished job (its stats) does not serve its passes again;
    only a new start does (the marker stays, as the job's samples do). Read
    through a local copy that is trusted for CACHE_S (a grant revoked through
    another replica is seen within that)."""

    KEY = "reflow:job_grants"
    GRANTED, ENDED = b"1", b"0"
    CACHE_S = 5.0

    def __init__(self, redis_client) -> None:
        self.redis = redis_client
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[bool, float]] = {}

    def _remember(self, job_id: str, granted: bool) -> None:
        with self._lock:
            self._cache[job_id] = (granted, time.monotonic())

    def grant(self, job_id: str, token: str) -> None:
        """The job (re)starts here: granted, whether or not it ended before."""
        del token  # the buffer makes no calls of its own for a job
        self.redis.hset(self.KEY, job_id, self.GRANTED)
        self._remember(job_id, True)

    def grant_unless_ended(self, job_id: str) -> None:
        """Granted, unless the job ended here: then it stays ended (HSETNX, so an
        EndJob at the same moment is never undone). The scheduler's dispatch calls
        come through here, so the outcome, granted or ended, is cached as a lookup
        is: one round trip per job per CACHE_S."""
        with self._lock:
            cached = self._cache.get(job_id)
        if cached is not None and time.monotonic() - cached[1] < self.CACHE_S:
            return
        pipe = self.redis.pipeline(transaction=False)
        pipe.hsetnx(self.KEY, job_id, self.GRANTED)
        pipe.hget(self.KEY, job_id)
        _, value = pipe.execute()
        self._remember(job_id, value == self.GRANTED)

    def token(self, job_id: str) -> str:
        return ""

    def granted(self, job_id: str) -> bool:
        with self._lock:
            cached = self._cache.get(job_id)
        if cached is not None and time.monotonic() - cached[1] < self.CACHE_S:
            return cached[0]
        value = self.redis.hget(self.KEY, job_id) == self.GRANTED
        self._remember(job_id, value)
        return value

    def revoke(self, job_id: str) -> None:
        self.redis.hset(self.KEY, job_id, self.ENDED)
        self._remember(job_id, False)
