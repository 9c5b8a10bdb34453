"""The one clock the control path reads.

The dispatcher (scheduler/generation/dispatch.py) takes a `Clock`: production passes
nothing and runs on wall time; the simulator (reflow.sim) passes a
`VirtualClock` it moves itself, so the same classes decide on virtual time
and a simulated hour of a 128-GPU job takes minutes, not an hour.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (intervals, deadlines)."""

    def time(self) -> float:
        """Seconds since the epoch (event timestamps)."""


class WallClock:
    """time.monotonic and time.time."""

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()


WALL_CLOCK = WallClock()


class VirtualClock:
    """A clock that moves only when its owner says (a discrete-event simulation):
    `now` seconds since the start, at `epoch` seconds since the epoch."""

    def __init__(self, epoch: float = 0.0) -> None:
        self.epoch = epoch
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.epoch + self.now

    def advance_to(self, t: float) -> None:
        if t < self.now:
            raise ValueError(f"a virtual clock never goes back: at {self.now}, asked for {t}")
        self.now = t
