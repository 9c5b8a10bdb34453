"""A fixed-role job's range of rollout workers (cluster.min_rollout_workers to
cluster.max_rollout_workers): the spec's checks, the resizer's decisions (grow
while no job waits, give back while one starves, release only after the
trainer published over the smaller group), a joining worker routed to only
once its engine runs the buffer's version, the local backend's worker budget,
and the trainer's engine set keeping its order."""

from __future__ import annotations

import time

import pytest

from reflow.core.config import parse_job_spec
from reflow.core.errors import NoCapacity
from reflow.rollout.worker import RolloutWorker
from reflow.scheduler.cluster.local import LocalBackend
from reflow.scheduler.generation.dispatch import Dispatcher
from reflow.scheduler.jobcontrol.queue import PlacementQueue
from reflow.scheduler.jobcontrol.resize import RolloutResizer
from reflow.tasks import TaskContext
from reflow.tasks.repeat import RepeatTask
from tests.unit.test_dispatch import Budget, OneWorker, StaggeredEngine


def _spec(**cluster):
    return parse_job_spec({"model": {"path": "/m"}, "trainer": {"batch_size": 8},
                           "cluster": cluster})


def test_the_range_is_checked_naming_its_fields():
    assert _spec().cluster.rollout_range is None
    assert _spec(max_rollout_workers=3).cluster.rollout_range == (1, 3)
    assert _spec(min_rollout_workers=2, max_rollout_workers=2).cluster.rollout_range == (2, 2)
    with pytest.raises(ValueError, match="cluster.min_rollout_workers needs "
                                         "cluster.max_rollout_workers"):
        _spec(min_rollout_workers=2)
    with pytest.raises(ValueError, match=r"min_rollout_workers \(3\) must be at most"):
        _spec(min_rollout_workers=3, max_rollout_workers=2)
    with pytest.raises(ValueError, match="fixed-role jobs"):
        _spec(workers=3, max_rollout_workers=2)
    with pytest.raises(ValueError, match="max_rollout_workers"):
        _spec(max_rollout_workers=0)


class Client:
    """A rollout client as the resizer sees it: the places and stops it is told."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.places: list[tuple[int, int]] = []
        self.stopped = self.closed = False

    def set_sync_place(self, job_id, rank, world_size):
        self.places.append((rank, world_size))

    def stop_job(self, job_id):
        self.stopped = True

    def close(self):
        self.closed = True


class Pods:
    """A backend with `free` workers to claim, recording what it is given back."""

    def __init__(self, free: int) -> None:
        self.free = [f"pod-{i}:1" for i in range(free)]
        self.released: list[str] = []

    def claim_rollout(self, placement):
        if not self.free:
            return None
        address = self.free.pop(0)
        placement.rollout_addresses.append(address)
        return address

    def detach_rollout(self, placement, address):
        placement.rollout_addresses.remove(address)
        return address

    def release_detached(self, placement, detached):
        self.released.append(detached)
        self.free.append(detached)


class Routes:
    def __init__(self) -> None:
        self.added, self.retired = [], []

    def add_worker(self, address, client):
        self.added.append(address)

    def worker_retired(self, address):
        self.retired.append(address)
        return 2


class Trainer:
    def __init__(self) -> None:
        self.engines: list[list[str]] = []

    def reconfigure(self, job_id, peers, rollout_addresses=None):
        self.engines.append(rollout_addresses)
        return 0


def _resizer(free: int, low: int = 1, high: int = 3):
    spec = _spec(min_rollout_workers=low, max_rollout_workers=high)
    record = type("Record", (), {"job_id": "j"})()
    placement = type("Placement", (), {"rollout_addresses": ["first:1"]})()
    rollouts = [Client("first:1")]
    started, queue, events = [], PlacementQueue(), []
    resizer = RolloutResizer(record, spec, Pods(free), placement, Routes(), Trainer(),
                             rollouts, started.append, Client, queue, events=events.append)
    resizer.started, resizer.event_log = started, events
    return resizer


def _grow(resizer) -> None:
    resizer._next_look = 0.0
    resizer.tick(policy_version=1)


def test_a_job_grows_into_free_workers_up_to_its_maximum_each_at_the_next_rank():
    resizer = _resizer(free=5, high=3)
    _grow(resizer)
    _grow(resizer)
    _grow(resizer)  # at the maximum: no third claim
    assert [c.address for c in resizer.rollouts] == ["first:1", "pod-0:1", "pod-1:1"]
    assert resizer.placement.rollout_addresses == ["first:1", "pod-0:1", "pod-1:1"]
    assert resizer.started == [1, 2]  # each new engine started at its index
    # Every engine already there learns the larger group's size, its rank unchanged
    # (rank 0 is the trainer's).
    assert resizer.rollouts[0].places == [(1, 3), (1, 4)]
    assert resizer.rollouts[1].places == [(2, 4)]
    assert resizer.dispatcher.added == ["pod-0:1", "pod-1:1"]
    assert resizer.trainer.engines[-1] == ["first:1", "pod-0:1", "pod-1:1"]
    joined = [e for e in resizer.event_log if e["event"] == "rollout_worker_joined"]
    assert [(e["rank"], e["rollout_workers"]) for e in joined] == [(2, 2), (3, 3)]


def test_a_job_does_not_grow_while_another_waits_and_gives_back_while_one_starves():
    resizer = _resizer(free=2, low=1, high=3)
    _grow(resizer)
    _grow(resizer)
    assert len(resizer.rollouts) == 3
    # A job queued (not yet refused) holds growth back; none is given back to it yet.
    resizer.queue.join("next", time.time())
    resizer.tick(policy_version=1)
    assert len(resizer.rollouts) == 3 and not resizer.backend.released
    # It found too few free workers: the last engine leaves (the others keep their
    # ranks), its groups go out again, and the trainer gets the smaller set.
    resizer.queue.short_of_workers("next")
    resizer.tick(policy_version=4)
    assert [c.address for c in resizer.rollouts] == ["first:1", "pod-0:1"]
    assert resizer.dispatcher.retired == ["pod-1:1"]
    assert resizer.rollouts[0].places[-1] == (1, 3) and resizer.rollouts[1].places[-1] == (2, 3)
    assert resizer.trainer.engines[-1] == ["first:1", "pod-0:1"]
    # Released only once the trainer published over the smaller group.
    resizer.tick(policy_version=4)
    assert not resizer.backend.released
    resizer.tick(policy_version=5)
    assert resizer.backend.released == ["pod-1:1"]
    # One at a time, and never below the minimum.
    resizer.tick(policy_version=5)
    resizer.tick(policy_version=6)
    resizer.tick(policy_version=7)
    assert [c.address for c in resizer.rollouts] == ["first:1"]
    assert resizer.backend.released == ["pod-1:1", "pod-0:1"]
    events = [e["event"] for e in resizer.event_log]
    assert events.count("rollout_worker_given_back") == 2


def test_a_worker_that_fails_to_start_is_released_and_the_others_keep_their_place():
    resizer = _resizer(free=1)

    def fail(i):
        raise RuntimeError("engine did not start")

    resizer.start_rollout = fail
    _grow(resizer)
    assert [c.address for c in resizer.rollouts] == ["first:1"]
    assert resizer.placement.rollout_addresses == ["first:1"]
    assert resizer.backend.released == ["pod-0:1"]
    assert resizer.rollouts[0].places == [(1, 2)]  # told the group it stays in
    assert not resizer.dispatcher.added and not resizer.trainer.engines


def test_a_joining_worker_is_routed_to_once_its_engine_runs_the_buffer_s_version():
    spec = parse_job_spec({"model": {"path": "/m"}, "trainer": {"batch_size": 8},
                           "rollout": {"group_size": 2, "max_inflight_samples": 4}})
    budget = Budget(limit=10**6)
    workers = []
    for i in range(2):
        worker = RolloutWorker("j", spec, lambda: StaggeredEngine(0.01),
                               RepeatTask(8, 3, context=TaskContext(seed=i)), budget,
                               encode=lambda text: [1, 2], decode=lambda ids: "a")
        worker.start()
        workers.append(OneWorker(worker))
    dispatcher = Dispatcher("j", spec, budget, {"w0": workers[0]},
                            RepeatTask(8, 3, context=TaskContext(seed=1)))
    dispatcher.start()
    try:
        dispatcher.policy_version = 3  # the buffer's published version, as read
        dispatcher.add_worker("w1", workers[1])
        time.sleep(1.5)
        assert not dispatcher.routable("w1") and not workers[1].prompts
        workers[1].worker.counters.policy_version = 3  # the trainer's resync reached it
        deadline = time.monotonic() + 10
        while not workers[1].prompts and time.monotonic() < deadline:
            time.sleep(0.05)
        assert workers[1].prompts, "the joined worker was never routed to"
        with pytest.raises(ValueError, match="already a rollout worker"):
            dispatcher.add_worker("w1", workers[1])
        # Given back, then taken in again: a new worker, read from a new thread.
        dispatcher.worker_retired("w1")
        dispatcher.add_worker("w1", workers[1])
    finally:
        dispatcher.stop()
        for w in workers:
            w.worker.stop()
    assert not dispatcher.error


def test_the_local_backend_shares_its_worker_budget_among_jobs():
    backend = LocalBackend("redis://unused", max_workers=4)
    assert backend._take("a", 3, at_least=2) == 3  # a trainer and two rollouts
    with pytest.raises(NoCapacity, match="REFLOW_LOCAL_MAX_WORKERS=4"):
        backend._take("b", 3, at_least=2)
    assert backend._take("c", 1) == 1
    backend._give("a", 1)  # a gave a rollout worker back
    with pytest.raises(NoCapacity):
        backend._take("b", 3, at_least=2)
    backend._give("a", 2)
    assert backend._take("b", 3, at_least=2) == 3
    assert LocalBackend("redis://unused")._take("x", 50, at_least=2) == 50  # no limit


def test_the_trainer_s_engines_keep_their_order_and_new_ones_need_a_client():
    from reflow.trainer.membership import GroupMembership

    class Loop(GroupMembership):
        def __init__(self):
            import threading
            from concurrent.futures import ThreadPoolExecutor

            self.rollouts = [Client("a:1"), Client("b:1")]
            self._membership_lock = threading.Lock()
            self._pending_engines = None
            self._stats_polls, self.retired_engines, self.job_id = {}, [], "j"
            self._pool = ThreadPoolExecutor(max_workers=3)
            self._check_pool = ThreadPoolExecutor(max_workers=3)

    import threading

    loop, ready = Loop(), threading.Event()
    with pytest.raises(ValueError, match="keep their order"):
        loop.set_engines(["b:1", "a:1"], Client)
    with pytest.raises(ValueError, match="cannot reach new ones"):
        loop.set_engines(["a:1", "b:1", "c:1"])
    with pytest.raises(ValueError, match="listed twice"):
        loop.set_engines(["a:1", "a:1"], Client)
    loop.set_engines(["b:1"])  # one below it left
    assert loop._pending_engines[0] == ["b:1"]
    loop.set_engines(["a:1", "b:1", "c:1"], Client)  # one joins after the last
    assert loop._pending_engines[0] == ["a:1", "b:1", "c:1"]
    loop._apply_engines()
    assert [c.address for c in loop.rollouts] == ["a:1", "b:1", "c:1"] and loop._engines_changed
    # A publish runs each engine's update beside the broadcast, one thread each: the
    # pools grew with the job (with 3 threads the broadcast would wait behind them).
    assert loop._pool._max_workers == loop._check_pool._max_workers == 4
    updates = [loop._pool.submit(ready.wait, 10) for _ in loop.rollouts]
    assert loop._pool.submit(ready.set).result(10) is None
    assert all(f.result(10) for f in updates)


def test_a_resize_that_fails_never_fails_the_job():
    """A trainer being restarted refuses the new engine set (it starts with the
    placement's, which has it); a backend that cannot be asked is tried later."""
    resizer = _resizer(free=2)

    def restarting(*args, **kwargs):
        raise RuntimeError("job 'j' is not training on this trainer")

    resizer.trainer.reconfigure = restarting
    _grow(resizer)
    assert [c.address for c in resizer.rollouts] == ["first:1", "pod-0:1"]

    def api_down(placement):
        raise ConnectionError("the API server is unavailable")

    resizer.backend.claim_rollout = api_down
    _grow(resizer)  # logged; the job runs on with what it has
    assert len(resizer.rollouts) == 2 and resizer._next_look > time.monotonic()
