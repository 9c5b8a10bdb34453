"""The dispatcher's ledger in a real Redis: a dispatcher built for a resumed job
continues the prompt stream where the last one stopped and routes the groups
that were in flight again first, under their own ids, so across the two every
prompt of the stream goes out once and none is skipped."""

from __future__ import annotations

import threading
import time

from reflow.core.config import parse_job_spec
from reflow.rollout.client import RolloutStats
from reflow.rollout.records import SampleEvent
from reflow.scheduler.generation.dispatch import Dispatcher
from reflow.scheduler.generation.inflight import DispatchLedger
from reflow.tasks import TaskContext
from reflow.tasks.base import Prompt
from reflow.tasks.repeat import RepeatTask

GROUP = 2


def _index(prompt_id: str) -> int:
    """The stream index in a `repeat` prompt id ("p17" -> 17)."""
    return int(prompt_id.lstrip("p"))


class Budget:
    def acquire_dispatch(self, job_id, want, group_size, outstanding_limit, version_limit):
        return want // group_size * group_size

    def stats(self, job_id):
        return type("Stats", (), {"policy_version": 0})()


class HoldingWorker:
    """Takes every group; ends at once the ones `finish(prompt_id)` says, and holds
    the rest in flight, as a worker that then dies would."""

    def __init__(self, finish) -> None:
        self.finish = finish
        self.submitted: list[tuple[str, str]] = []
        self.events: list[SampleEvent] = []
        self.cond = threading.Condition()

    def submit_group(self, job_id, group_id, prompt, concurrency_cap=0, bounds=None):
        with self.cond:
            self.submitted.append((group_id, prompt.prompt_id))
            if self.finish(prompt.prompt_id):
                seq = len(self.events) + 1
                self.events.append(SampleEvent(seq, group_id, -1))
                self.cond.notify_all()
        return True

    def wait_events(self, job_id, since_seq, wait_s):
        with self.cond:
            self.cond.wait_for(lambda: len(self.events) > since_seq, wait_s)
            return self.events[since_seq:]

    def stats(self, job_id):
        return RolloutStats(0, 0, 0.0, 0, 0, "running", "")


def _dispatch(spec, ledger, worker, until, timeout_s=20.0) -> Dispatcher:
    task = RepeatTask(8, 3, context=TaskContext(seed=5))
    dispatcher = Dispatcher("ledger-job", spec, Budget(), {"w": worker}, task, ledger=ledger)
    dispatcher.start()
    deadline = time.monotonic() + timeout_s
    try:
        while not until() and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        dispatcher.stop()
    assert not dispatcher.error
    return dispatcher


def test_a_resumed_dispatcher_skips_nothing_and_repeats_nothing(redis_client):
    spec = parse_job_spec({"model": {"path": "/m"}, "mode": "reflow",
                           "trainer": {"batch_size": 4},
                           "rollout": {"group_size": GROUP, "max_inflight_samples": 12},
                           "scheduler": {"adaptive": False}})
    ledger = DispatchLedger(redis_client, "ledger-job")
    # The first dispatcher's worker finishes every third group and holds the rest,
    # until its caps are full: then the job's services go down.
    first = HoldingWorker(finish=lambda pid: _index(pid) % 3 == 0)
    _dispatch(spec, ledger, first, until=lambda: len(first.submitted) >= 8)
    held = {gid: pid for gid, pid in first.submitted
            if _index(pid) % 3 != 0}
    position, in_flight = ledger.load()
    assert position == len(first.submitted)
    assert {gid: p.prompt_id for gid, p in in_flight} == held

    second = HoldingWorker(finish=lambda pid: True)
    resumed = _dispatch(spec, ledger, second, until=lambda: len(second.submitted) >= 20)
    assert resumed.recovered_groups == len(held)
    # The held groups go out first, under the ids the first dispatcher gave them ...
    assert dict(second.submitted[:len(held)]) == held
    # ... then the stream continues exactly where it stopped: across both
    # dispatchers the prompts are the stream's prefix, each once.
    put = [pid for gid, pid in first.submitted if gid not in held] + [
        pid for _, pid in second.submitted]
    stream = RepeatTask(8, 3, context=TaskContext(seed=5)).prompts()
    expected = [next(stream).prompt_id for _ in range(len(put))]
    assert sorted(put) == sorted(expected)
    assert len(set(put)) == len(put)
    # The position counts each stream prompt once; what is left in flight is only
    # what ended after the dispatcher stopped reading (a resume would send it again
    # under its id, and the buffer's put is idempotent per group id). Events are
    # read in order, so that is a tail of what was sent; how long a tail depends on
    # how far the reader lagged when it stopped, not on anything the test controls.
    position, left = ledger.load()
    assert position == len(first.submitted) + len(second.submitted) - len(held)
    left_ids = {gid for gid, _ in left}
    assert len(left_ids) < len(second.submitted)
    tail = second.submitted[len(second.submitted) - len(left_ids):] if left_ids else []
    assert left_ids == {gid for gid, _ in tail}


def test_a_malformed_entry_is_dropped_not_fatal(redis_client):
    ledger = DispatchLedger(redis_client, "ledger-bad")
    ledger.routed("g1", Prompt("p-1", "text", "answer"), from_stream=True)
    redis_client.hset("reflow:{ledger-bad}:inflight", "g2", b"\xff not json")
    position, groups = ledger.load()
    assert position == 1 and [(g, p.prompt_id) for g, p in groups] == [("g1", "p-1")]
