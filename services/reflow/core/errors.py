"""Typed errors that cross service boundaries. Clients translate transport
status codes into these, so callers never see gRPC."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


class NotFound(KeyError):
    """The named job or object does not exist."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "not found"


class InvalidArgument(ValueError):
    """The request was malformed; the message names the field."""


class Unavailable(RuntimeError):
    """The service could not be reached; retry later."""


class Conflict(Exception):
    """The request clashes with existing state (an id reused for something else)."""


class NoCapacity(RuntimeError):
    """Not enough free workers for a job right now; it waits and retries.
    `short_of_workers`: too few are free (a running job with a range of rollout
    workers gives some back); False when the cluster could not be asked."""

    def __init__(self, message: str, short_of_workers: bool = True) -> None:
        super().__init__(message)
        self.short_of_workers = short_of_workers


class FailedPrecondition(RuntimeError):
    """The request is well-formed but the target is not in a state to take it
    (no such job on this worker, a weight version out of order)."""


class VersionGap(FailedPrecondition):
    """A policy version published past the next one (the replay buffer moves one
    version at a time); the message names `policy_version`, the buffer's current
    version and the rule. The publisher walks the buffer up to its own version."""


class TemporaryError(RuntimeError):
    """A fault the job controller recovers from and retries after `delay_s`: a
    service that died and can be restarted, an outage that may end. Modelled on
    kopf's TemporaryError."""

    def __init__(self, message: str, delay_s: float = 1.0) -> None:
        super().__init__(message)
        self.delay_s = delay_s


class PermanentError(RuntimeError):
    """A fault that ends the job FAILED: nothing retried would change it (restarts
    exhausted, a service that reports a failure of its own)."""


class ResourceExhausted(RuntimeError):
    """A ceiling is reached (active jobs, concurrent long calls); retry later."""


class ConsecutiveFailures:
    """A poll that runs anyway on its next tick (a watch loop, a per-step read)
    tolerates up to `limit` transient failures (`Unavailable`) in a row: each is
    logged in one line and the call's result is None; one more is raised, and a
    success starts the count again."""

    def __init__(self, what: str, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"limit: {limit}; at least 0 failures are tolerated")
        self.what, self.limit, self.count = what, limit, 0

    def call(self, fn, *args):
        """`fn(*args)`, or None after a tolerated transient failure."""
        try:
            result = fn(*args)
        except Unavailable as err:
            self.count += 1
            if self.count > self.limit:
                raise Unavailable(f"{self.what}: {self.count} failures in a row, "
                                  f"the last: {err}") from err
            logger.warning("%s: %s (%d of %d tolerated in a row)", self.what, err,
                           self.count, self.limit)
            return None
        self.count = 0
        return result


class ExitedWhileStarting(RuntimeError):
    """The process that was to serve an address exited before it was healthy: a
    restarted service that died again at once (counted as a death, not a failure
    to come back)."""
