"""The warm pool: sandboxes started ahead of the programs they will run, so that a
trivial execution costs a pipe round trip rather than a bubblewrap and interpreter
start.

Each sandbox runs exactly one program and is discarded (nothing a program did can
reach the next one); a background thread starts a new one for each taken, up to
`size` waiting. A caller that finds none waiting starts one itself (a cold start)
rather than queue behind the refill. Sandboxes are started, not awaited: the
first byte a sandbox writes says it is ready (reflow.sandbox.runner), and the
executor reads it when it hands the sandbox its program.

It knows nothing of what a sandbox is or runs: `spawn` and `Sandbox.close` are
the executor's.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable

from reflow.core.errors import Unavailable
from reflow.sandbox.executor import Sandbox

logger = logging.getLogger(__name__)

# After a failed start, the refill waits this long, doubling up to the maximum.
RETRY_FIRST_S = 0.5
RETRY_MAX_S = 30.0


class WarmPool:
    def __init__(self, spawn: Callable[[], Sandbox], size: int,
                 on_change: Callable[[int], None] | None = None,
                 on_cold_start: Callable[[], None] | None = None) -> None:
        """`spawn` starts one sandbox; `on_change(n)` hears the number waiting,
        `on_cold_start()` of each caller that found none."""
        if size < 0:
            raise ValueError(f"size: {size}; at least 0 sandboxes wait")
        self.size = size
        self._spawn = spawn
        self._on_change = on_change or (lambda n: None)
        self._on_cold_start = on_cold_start or (lambda: None)
        self._idle: collections.deque[Sandbox] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self.num_cold_starts = 0
        self.num_started = 0
        self._thread = threading.Thread(target=self._refill, name="sandbox-pool", daemon=True)

    def start(self) -> WarmPool:
        if self.size:
            self._thread.start()
        return self

    @property
    def num_warm(self) -> int:
        return len(self._idle)

    def take(self) -> Sandbox:
        """A sandbox of the pool's, or a new one if none waits."""
        with self._cond:
            if self._closed:
                raise Unavailable("the sandbox pool is closed")
            if self._idle:
                sandbox = self._idle.popleft()
                self._cond.notify()
                self._on_change(len(self._idle))
                return sandbox
            self.num_cold_starts += 1
            self.num_started += 1
        self._on_cold_start()
        return self._spawn()

    def _refill(self) -> None:
        delay_s = RETRY_FIRST_S
        while True:
            with self._cond:
                while not self._closed and len(self._idle) >= self.size:
                    self._cond.wait()
                if self._closed:
                    return
            try:
                sandbox = self._spawn()
            except Exception:  # noqa: BLE001 - logged; the pool retries, callers start their own
                logger.exception("sandbox pool: could not start a sandbox; again in %.1f s",
                                 delay_s)
                with self._cond:
                    self._cond.wait_for(lambda: self._closed, timeout=delay_s)
                delay_s = min(2 * delay_s, RETRY_MAX_S)
                continue
            delay_s = RETRY_FIRST_S
            with self._cond:
                if not self._closed:
                    self._idle.append(sandbox)
                    self.num_started += 1
                    self._on_change(len(self._idle))
                    continue
            sandbox.close()
            return

    def close(self) -> None:
        """Stop refilling and end every waiting sandbox."""
        with self._cond:
            self._closed = True
            idle, self._idle = list(self._idle), collections.deque()
            self._cond.notify_all()
        for sandbox in idle:
            sandbox.close()
        self._on_change(0)
        if self._thread.is_alive():
            self._thread.join(timeout=10)
