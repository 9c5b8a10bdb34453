"""The dispatcher between the training loop and the experiment trackers.

The training thread only enqueues: a step record, a batch's generations, the
end of the job. One background thread builds the trackers and makes every call
to them, so a tracker that is slow, blocks or raises never holds a training step
up or changes what it computes. When the bounded queue is full the item is
dropped and counted; a tracker call that raises is counted for its backend and
logged (the first time with its traceback, then at most once a minute); a
tracker that fails to start is disabled with a warning and the job goes on.

Trackers are resolved by registered name only (core/tracking_config.py): the
built-ins' fixed references, entry points in group `reflow.trackers`, and
in-process registrations. This module knows no tracker package.
"""

from __future__ import annotations

import importlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from reflow.core.tracking_config import (BUILTIN_TRACKERS, in_process_tracker,
                                         installed_entry_points)
from reflow.tracking.base import GENERATION_COLUMNS, Tracker, TrackerContext, split_record, truncate

logger = logging.getLogger(__name__)

# A backend's repeated errors are logged at most this often.
ERROR_LOG_INTERVAL_S = 60.0
# How often the worker looks at the close flag while the queue is empty.
POLL_S = 0.2

_CLOSE = object()


def resolve_tracker(name: str) -> Callable[[TrackerContext], Tracker]:
    """The factory registered as `name`: an in-process registration, a built-in's
    fixed reference, or an installed entry point. Never a module a spec names."""
    factory = in_process_tracker(name)
    if factory is not None:
        return factory
    if name in BUILTIN_TRACKERS:
        module, _, attr = BUILTIN_TRACKERS[name][0].partition(":")
        return getattr(importlib.import_module(module), attr)
    if name in installed_entry_points():
        return installed_entry_points()[name].load()
    raise ValueError(f"tracking.backends: unknown tracker {name!r}")


def generation_rows(step: int, trajectories: list[Any], max_rows: int) -> list[tuple]:
    """Up to `max_rows` of the batch's samples, spread over it (one per group
    first), as token ids: decoding waits for the background thread."""
    picked, groups, taken = [], set(), set()
    for i, t in enumerate(trajectories):  # one sample per group first: a table of variety
        if t.group_id not in groups and len(picked) < max_rows:
            groups.add(t.group_id)
            taken.add(i)
            picked.append(t)
    for i, t in enumerate(trajectories):
        if len(picked) >= max_rows:
            break
        if i not in taken:
            picked.append(t)
    return [(step, t.newest_version, float(t.reward), list(t.prompt_ids), list(t.response_ids))
            for t in picked]


class TrackerHub:
    """A bounded queue and one thread in front of the job's trackers."""

    def __init__(self, names: list[str], context: TrackerContext, config: dict[str, Any],
                 on_error: Callable[[str], None] | None = None,
                 on_drop: Callable[[], None] | None = None) -> None:
        self.names = list(names)
        self.context = context
        self.settings = context.settings
        self.errors: dict[str, int] = {name: 0 for name in self.names}
        self.dropped = 0
        self._on_error = on_error
        self._on_drop = on_drop
        self._queue: queue.Queue = queue.Queue(maxsize=self.settings.queue_size)
        self._closing = threading.Event()
        self._closed = False
        self._last_logged: dict[str, float] = {}
        self._unlogged: dict[str, int] = {}
        self.trackers: dict[str, Tracker] = {}
        self._thread = threading.Thread(target=self._work, args=(config,),
                                        name="trackers", daemon=True)
        self._thread.start()

    # --- the training thread's side: enqueue, never wait ----------------------

    def _put(self, item: Any) -> bool:
        if self._closed:
            return False
        try:
            self._queue.put_nowait(item)
            return True
        except queue.Full:
            self.dropped += 1
            if self._on_drop is not None:
                self._on_drop()
            if self.dropped == 1 or self.dropped % 1000 == 0:
                logger.warning("job %s: tracker queue full (tracking.queue_size=%d); %d "
                               "records dropped so far", self.context.job_id,
                               self.settings.queue_size, self.dropped)
            return False

    def log_record(self, record: dict[str, Any]) -> bool:
        """A step's record (metrics.jsonl); False when it was dropped."""
        return self._put(("record", dict(record)))

    def log_generations(self, step: int, trajectories: list[Any], tokenizer: Any) -> bool:
        """Every `tracking.generations_interval` steps, a table of the batch's
        samples (decoded with `tokenizer` on the tracker thread)."""
        interval = self.settings.generations_interval
        if not interval or step % interval or not trajectories:
            return False
        rows = generation_rows(step, trajectories, self.settings.generations_per_table)
        return self._put(("generations", step, rows, tokenizer))

    def close(self, timeout_s: float | None = None) -> None:
        """Let the thread flush what is queued and close the trackers, waiting at
        most `timeout_s` (tracking.close_timeout_s); a tracker still stuck then is
        left behind (the thread is a daemon)."""
        if self._closed:
            return
        self._closed = True
        self._closing.set()
        self._thread.join(self.settings.close_timeout_s if timeout_s is None else timeout_s)
        if self._thread.is_alive():
            logger.warning("job %s: trackers did not finish within %.1fs (tracking."
                           "close_timeout_s); left behind with %d items still queued",
                           self.context.job_id,
                           self.settings.close_timeout_s if timeout_s is None else timeout_s,
                           self._queue.qsize())

    # --- the tracker thread ----------------------------------------------------

    def _work(self, config: dict[str, Any]) -> None:
        self._start_all(config)
        while True:
            try:
                item = self._queue.get(timeout=POLL_S)
            except queue.Empty:
                if self._closing.is_set():
                    break
                continue
            try:
                self._handle(item)
            except Exception:  # noqa: BLE001 - never lose the thread to one bad item
                logger.exception("job %s: tracker item failed", self.context.job_id)
        for name, tracker in self.trackers.items():
            self._call(name, tracker.close)

    def _start_all(self, config: dict[str, Any]) -> None:
        for name in self.names:
            try:
                tracker = resolve_tracker(name)(self.context)
                tracker.start(config)
            except Exception as err:  # noqa: BLE001 - a tracker is never worth the job
                self._count(name)
                logger.warning("job %s: tracker %s disabled, it failed to start: %s: %s",
                               self.context.job_id, name, type(err).__name__, err)
                continue
            self.trackers[name] = tracker
            logger.info("job %s: tracker %s started", self.context.job_id, name)

    def _handle(self, item: tuple) -> None:
        if item[0] == "record":
            step, train, version, evals = split_record(item[1])
            for name, tracker in self.trackers.items():
                self._call(name, tracker.log_step, step, train)
                if version is not None:
                    self._call(name, tracker.log_eval, step, version, evals)
        elif item[0] == "generations":
            _, step, raw, tokenizer = item
            rows = [self._decode(row, tokenizer) for row in raw]
            for name, tracker in self.trackers.items():
                self._call(name, tracker.log_generations, step, rows)

    def _decode(self, row: tuple, tokenizer: Any) -> dict[str, Any]:
        step, version, reward, prompt_ids, response_ids = row
        limit = self.settings.generations_max_chars
        # The prompt's tail is what the response follows; the response's head is
        # what the policy chose first.
        prompt = tokenizer.decode(prompt_ids, skip_special_tokens=False)
        if len(prompt) > limit:
            prompt = "…" + prompt[-(limit - 1):]
        response = truncate(tokenizer.decode(response_ids, skip_special_tokens=False), limit)
        return dict(zip(GENERATION_COLUMNS, (step, version, reward, prompt, response)))

    def _call(self, name: str, method: Callable, *args: Any) -> None:
        try:
            method(*args)
        except Exception:  # noqa: BLE001 - counted and logged; training never sees it
            self._count(name)
            now = time.monotonic()
            last = self._last_logged.get(name)
            if last is None or now - last >= ERROR_LOG_INTERVAL_S:
                skipped = self._unlogged.pop(name, 0)
                logger.warning("job %s: tracker %s: %s failed (%d errors so far, %d not logged "
                               "since the last line)", self.context.job_id, name,
                               getattr(method, "__name__", "call"), self.errors[name], skipped,
                               exc_info=last is None)
                self._last_logged[name] = now
            else:
                self._unlogged[name] = self._unlogged.get(name, 0) + 1

    def _count(self, name: str) -> None:
        self.errors[name] = self.errors.get(name, 0) + 1
        if self._on_error is not None:
            try:
                self._on_error(name)
            except Exception:  # noqa: BLE001 - a metrics hiccup is not the tracker's error
                logger.debug("tracker error counter failed", exc_info=True)
