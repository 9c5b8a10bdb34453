"""Redis connections for the services that keep their state in Redis (the
replay buffer, the scheduler's job store): socket timeouts, bounded retries
with backoff, and a tally of what was retried.

A Redis restart (a pod rescheduled, the embedded server killed and started
again) shows as refused connections, reset sockets, and LOADING replies while
the server replays its append-only file. Every command retries those with
exponential backoff for up to `max_outage_s` from its first failure, and never
past the deadline of the request it serves (`core.deadline`): a restart of a
few seconds costs the caller latency, not an error. A longer outage raises
`RedisUnavailable`, both a redis `ConnectionError` and the core `Unavailable`,
so a gRPC server answers UNAVAILABLE (a code its callers retry), not INTERNAL.

A command whose reply was lost may run twice. The stores' writes allow that:
a repeat is a no-op (put, release, publish, renew, job saves and creation), or
errs safe as a lost reply does (a repeated lease expires and gives its samples
back; a repeated dispatch grant counts toward the budget without being used).

Not here: which commands to send (replay/store.py, scheduler/jobcontrol/jobs.py), and how
an error becomes a status code (rpc.py).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import Counter

import redis
from redis.backoff import ExponentialBackoff
from redis.exceptions import BusyLoadingError
from redis.retry import Retry

from reflow.core import deadline
from reflow.core.errors import Unavailable

logger = logging.getLogger(__name__)

# Below rpc.DEFAULT_DEADLINE_S (30 s), so that a handler whose Redis stays down
# answers UNAVAILABLE while its caller still waits for the answer.
MAX_OUTAGE_S = 20.0
# Backoff between attempts: 0.1, 0.2, 0.4, 0.8, then every second.
BACKOFF_BASE_S, BACKOFF_CAP_S = 0.05, 1.0
CONNECT_TIMEOUT_S = 2.0
# A reply slower than this is a dead peer (no command the stores send runs that long).
SOCKET_TIMEOUT_S = 15.0
# BusyLoadingError (LOADING) is a ConnectionError; named for the reader.
RETRIED_ERRORS = (redis.ConnectionError, BusyLoadingError, redis.TimeoutError, socket.timeout)
# A warning at most this often per client; the tally counts every attempt.
LOG_EVERY_S = 5.0


class RedisUnavailable(redis.ConnectionError, Unavailable):
    """Redis stayed unreachable past the retry bound."""


def error_kind(error: Exception) -> str:
    if isinstance(error, BusyLoadingError):
        return "loading"
    if isinstance(error, (redis.TimeoutError, socket.timeout)):
        return "timeout"
    return "connection"


class BoundedRetry(Retry):
    """redis-py's retry, bounded by time instead of a count of attempts.

    redis-py nests retries (a command's attempt reconnects, and the reconnect
    retries on its own): only the outermost call on a thread waits and retries
    here, the nested ones make one attempt, so the bound holds for the whole
    command. One instance serves every connection of a client (`__deepcopy__`),
    and `errors` counts (kind, outcome) over all of them: outcome `retried` for
    an attempt that was tried again, `gave_up` for the one that ended a call.
    """

    def __init__(self, max_outage_s: float = MAX_OUTAGE_S) -> None:
        if max_outage_s < 0:
            raise ValueError(f"max_outage_s: {max_outage_s}; use 0 (no retry) or more seconds")
        # retries=-1: redis-py's own count is unused (the bound is time).
        super().__init__(ExponentialBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S), -1,
                         RETRIED_ERRORS)
        self.max_outage_s = max_outage_s
        self.errors: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()
        self._nesting = threading.local()
        self._logged_at = 0.0

    def __deepcopy__(self, memo) -> BoundedRetry:
        return self

    def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):
        depth = getattr(self._nesting, "depth", 0)
        self._nesting.depth = depth + 1
        try:
            if depth:
                return self._once(do, fail, is_retryable, with_failure_count)
            return self._retried(do, fail, is_retryable, with_failure_count)
        finally:
            self._nesting.depth = depth

    def _once(self, do, fail, is_retryable, with_failure_count):
        try:
            return do()
        except self._supported_errors as error:
            if is_retryable is None or is_retryable(error):
                fail(error, 1) if with_failure_count else fail(error)
            raise

    def _retried(self, do, fail, is_retryable, with_failure_count):
        self._backoff.reset()
        failures, first_s, give_up_s = 0, 0.0, 0.0
        while True:
            try:
                return do()
            except self._supported_errors as error:
                if is_retryable is not None and not is_retryable(error):
                    raise
                failures += 1
                fail(error, failures) if with_failure_count else fail(error)
                now = time.monotonic()
                if failures == 1:
                    first_s, give_up_s = now, now + self.max_outage_s
                    left = deadline.remaining_s()
                    if left is not None:
                        give_up_s = min(give_up_s, now + left)
                delay = self._backoff.compute(failures)
                kind = error_kind(error)
                if now + delay > give_up_s:
                    self._count(kind, "gave_up")
                    raise RedisUnavailable(
                        f"Redis unreachable for {now - first_s:.1f}s ({failures} attempts, "
                        f"bound {self.max_outage_s:.0f}s): {error}") from error
                self._count(kind, "retried")
                if now - self._logged_at >= LOG_EVERY_S:
                    self._logged_at = now
                    logger.warning("Redis %s error (%s); retrying for up to %.1fs", kind,
                                   error, give_up_s - now)
                time.sleep(delay)

    def _count(self, kind: str, outcome: str) -> None:
        with self._lock:
            self.errors[(kind, outcome)] += 1

    def snapshot(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self.errors)


def connect(url: str, max_outage_s: float = MAX_OUTAGE_S) -> redis.Redis:
    """A client of the Redis at `url` that rides out outages up to `max_outage_s`."""
    return redis.Redis.from_url(
        url, retry=BoundedRetry(max_outage_s), retry_on_error=list(RETRIED_ERRORS),
        socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=SOCKET_TIMEOUT_S,
        socket_keepalive=True)


def errors_of(client: redis.Redis) -> dict[tuple[str, str], int]:
    """(kind, outcome) -> count so far, for a client made by `connect` (empty for
    another)."""
    retry = client.get_retry()
    return retry.snapshot() if isinstance(retry, BoundedRetry) else {}
