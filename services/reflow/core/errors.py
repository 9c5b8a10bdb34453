"""Typed errors that cross service boundaries. Clients translate transport
status codes into these, so callers never see gRPC."""

from __future__ import annotations


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
    """Not enough free workers for a job right now; it waits and retries."""


class FailedPrecondition(RuntimeError):
    """The request is well-formed but the target is not in a state to take it
    (no such job on this worker, a weight version out of order)."""


class ResourceExhausted(RuntimeError):
    """A ceiling is reached (active jobs, concurrent long calls); retry later."""
