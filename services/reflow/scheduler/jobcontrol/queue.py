"""The order in which PENDING jobs get workers: first come, first placed.

Each job's thread asks the backend for workers only at the head of this
queue, so a job submitted later never takes the workers an earlier one is
waiting for (with each thread retrying on its own timer, whichever woke first
after a release won). The head tries again as soon as a job releases its
workers (`notify`), and every `retry_s` otherwise, since workers can also come
back without a release here (a pod becoming ready, another scheduler's job).

Strict order is the promise: a large job at the head holds back a small one
behind it that would fit. A job leaves the queue when it is placed or stopped.
"""

from __future__ import annotations

import threading
import time


class PlacementQueue:
    def __init__(self) -> None:
        self._order: list[tuple[float, int, str]] = []  # (created_at, arrival, job id)
        self._arrivals = 0
        self._cond = threading.Condition()
        self._kicked = False
        # Jobs that reached the head and found too few free workers: what a running
        # job with a range of rollout workers gives back to (jobcontrol/resize.py).
        self._short: set[str] = set()

    def join(self, job_id: str, created_at: float) -> None:
        """Queue `job_id` by its submission time (a job resumed after a scheduler
        restart takes the place its submission gave it)."""
        with self._cond:
            if any(j == job_id for _, _, j in self._order):
                return
            self._arrivals += 1
            self._order.append((created_at, self._arrivals, job_id))
            self._order.sort()
            self._cond.notify_all()

    def leave(self, job_id: str) -> None:
        with self._cond:
            self._order = [entry for entry in self._order if entry[2] != job_id]
            self._short.discard(job_id)
            self._cond.notify_all()

    def short_of_workers(self, job_id: str) -> None:
        """`job_id` found too few free workers for its placement."""
        with self._cond:
            self._short.add(job_id)

    def starved(self) -> list[str]:
        """Queued jobs that found too few free workers, in queue order."""
        with self._cond:
            return [j for _, _, j in self._order if j in self._short]

    def waiting(self) -> list[str]:
        with self._cond:
            return [j for _, _, j in self._order]

    def notify(self) -> None:
        """Workers were released: the head tries again now."""
        with self._cond:
            self._kicked = True
            self._cond.notify_all()

    def wait_turn(self, job_id: str, stop: threading.Event, poll_s: float = 0.2) -> bool:
        """Block until `job_id` is at the head; False if `stop` was set first."""
        with self._cond:
            while not stop.is_set():
                if self._order and self._order[0][2] == job_id:
                    return True
                self._cond.wait(poll_s)
        return False

    def wait_retry(self, stop: threading.Event, retry_s: float, poll_s: float = 0.2) -> bool:
        """The head found no room: wait for a release or `retry_s`, whichever comes
        first; False if `stop` was set."""
        with self._cond:
            deadline = time.monotonic() + retry_s
            while not stop.is_set():
                if self._kicked:
                    self._kicked = False
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return True
                self._cond.wait(min(poll_s, left))
        return False
