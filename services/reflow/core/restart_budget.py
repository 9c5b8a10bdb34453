"""A restart budget that catches a crash loop and forgives a preemption.

A service that dies is restarted while it has died at most `max_restarts` times
within the last `window_s` seconds; one more death inside the window is a crash
loop and fails the job, naming it. Deaths spread wider than the window never
add up, so a week-long job on preemptible nodes is not failed by its fourth
preemption. Restarts inside the window back off (`backoff_s`, doubling, at most
`backoff_max_s`) so that a service that dies at start does not spin.

Times are wall-clock seconds (`time.time()`), stored in the job's record, so that
a standby scheduler that takes the job over keeps counting where the last one
stopped.
"""

from __future__ import annotations

from dataclasses import dataclass


class CrashLoop(RuntimeError):
    """A service died more than `max_restarts` times within `window_s` seconds."""


@dataclass(frozen=True)
class RestartBudget:
    """`max_restarts` deaths of one service within `window_s` seconds (k8s's
    CrashLoopBackOff counts the same way: recent deaths, not a lifetime)."""

    max_restarts: int
    window_s: float
    backoff_s: float = 0.0
    backoff_max_s: float = 0.0

    def recent(self, times: list[float], now: float) -> list[float]:
        """The restart times still inside the window at `now`."""
        return [t for t in times if now - t < self.window_s]

    def spent(self, times: list[float], now: float) -> bool:
        """No restart is left inside the window at `now`."""
        return len(self.recent(times, now)) >= self.max_restarts

    def admit(self, what: str, times: list[float], now: float) -> float:
        """Seconds to wait before restarting `what`, which has been restarted at
        `times`; raises CrashLoop when that would exceed the budget."""
        recent = self.recent(times, now)
        if len(recent) >= self.max_restarts:
            raise CrashLoop(
                f"crash loop: {what} died {len(recent) + 1} times within "
                f"{self.window_s:g} s (restarted {len(recent)} times, the budget is "
                f"cluster.max_restarts={self.max_restarts} within "
                f"cluster.restart_window_s={self.window_s:g})")
        if not recent or self.backoff_s <= 0:
            return 0.0
        return min(self.backoff_s * 2 ** (len(recent) - 1), self.backoff_max_s or float("inf"))
