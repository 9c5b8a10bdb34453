"""Waiting in tests for what a real process does in its own time."""

from __future__ import annotations

import time


def wait_until(predicate, timeout_s: float, what: str, poll_s: float = 0.5):
    """`predicate()`'s first truthy value, polled every `poll_s`; AssertionError
    naming `what` after `timeout_s` (a hang guard, not a speed bound)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
