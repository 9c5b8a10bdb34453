"""The time left for the request this thread serves.

A transport sets it from its caller's deadline (rpc.py does, for every gRPC
handler); code that retries on its own (the Redis connections, redisconn.py)
reads it and gives up in time for the handler to answer with a status the
caller can act on, instead of running past a caller that has already timed
out. Knows nothing of gRPC or Redis.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

_local = threading.local()


@contextlib.contextmanager
def scope(seconds: float | None) -> Iterator[None]:
    """Within the block, this thread's request has `seconds` left (None: no
    deadline). Scopes nest; the inner one holds until it ends."""
    previous = getattr(_local, "at", None)
    _local.at = None if seconds is None else time.monotonic() + max(0.0, seconds)
    try:
        yield
    finally:
        _local.at = previous


def remaining_s() -> float | None:
    """Seconds left for this thread's request, or None when it has no deadline."""
    at = getattr(_local, "at", None)
    return None if at is None else max(0.0, at - time.monotonic())
