"""The dispatch budget (paper §4.1 step 1) on a real Redis: random production,
consumption, eviction and lease expiry by two rollout workers and a trainer,
for σ ∈ {0, 0.5} and δ ∈ {0, 1, 2}. After any such history a batch is always
eventually available, and the buffer's accounting of outstanding samples
(dispatched − trained − evicted) matches what is really generating or waiting."""

import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reflow.core.config import parse_job_spec
from reflow.core.types import Segment, Trajectory
from reflow.replay.store import ReplayStore

GROUP, BATCH, CAP = 4, 8, 8

actions = st.lists(
    st.one_of(
        st.tuples(st.just("dispatch"), st.integers(0, 1)),
        st.tuples(st.just("finish"), st.integers(0, 1), st.integers(0, 7)),
        st.tuples(st.just("train")),
        st.tuples(st.just("lease_and_return")),
    ),
    max_size=80,
)


class SimWorker:
    """Dispatch to one rollout worker, driven step by step: the job's real dispatch
    limits (at the version the buffer has published, as the dispatcher takes them)
    and the buffer's real grant, with generation simulated."""

    def __init__(self, store: ReplayStore, job: str, spec, rank: int) -> None:
        self.store, self.job, self.spec, self.rank = store, job, spec, rank
        self.version = 0  # the version this worker has loaded
        self.inflight: list[int] = []  # the version each in-flight group started under
        self.made = 0

    def dispatch(self) -> None:
        room = CAP - GROUP * len(self.inflight)
        granted = self.store.acquire_dispatch(self.job, room, GROUP,
                                              *self.spec.dispatch_limits(self.store.version(self.job)))
        assert granted % GROUP == 0 and 0 <= granted <= room
        self.inflight += [self.version] * (granted // GROUP)

    def finish(self, index: int) -> None:
        started = self.inflight.pop(index)
        gid = f"w{self.rank}g{self.made}"
        self.made += 1
        # Partial rollout: the first token under the start version, the rest under now.
        segments = [Segment(started, 1)] + ([Segment(self.version, 2)] if self.version != started
                                            else [])
        n = sum(s.num_tokens for s in segments)
        if len(segments) == 1:
            segments = [Segment(started, n + 2)]
            n += 2
        self.store.put(self.job, [
            Trajectory(f"{gid}-{i}", gid, [1], [2] * n, [-0.1] * n, [1] * n, segments,
                       reward=float(i), advantage=float(i) - 1.5)
            for i in range(GROUP)])


class Sim:
    def __init__(self, store: ReplayStore, spec) -> None:
        self.store, self.spec = store, spec
        self.job = uuid.uuid4().hex[:12]
        store.configure(self.job, spec.replay)
        self.workers = [SimWorker(store, self.job, spec, rank) for rank in (1, 2)]
        self.version = 0

    def train(self) -> bool:
        batch = self.store.try_lease(self.job, BATCH, lease_ttl_s=60)
        if batch is None:
            return False
        self.store.release(self.job, batch.lease_id)
        # The trainer publishes to the workers first, then to the buffer.
        self.version += 1
        for w in self.workers:
            w.version = self.version
        self.store.publish_version(self.job, self.version)
        return True

    def lease_and_return(self) -> None:
        batch = self.store.try_lease(self.job, BATCH, lease_ttl_s=60)
        if batch is not None:
            self.store.return_lease(self.job, batch.lease_id)

    def check_accounting(self) -> None:
        s = self.store.stats(self.job)
        outstanding = s.dispatched_total - s.trained_unused_total - s.evicted_unused_total
        generating = GROUP * sum(len(w.inflight) for w in self.workers)
        assert outstanding == generating + s.unused_samples
        assert outstanding <= self.spec.dispatch_limits(self.version)[0]


@pytest.mark.parametrize("replay_cap", [0.0, 0.5])
@pytest.mark.parametrize("max_staleness", [0, 1, 2])
@pytest.mark.parametrize("mode,evict_stale", [("reflow", True), ("fully_async", False)])
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=actions)
def test_a_batch_is_always_eventually_available(redis_server, replay_cap, max_staleness, mode,
                                                evict_stale, steps):
    if mode == "fully_async" and replay_cap:
        return  # fully_async fixes σ = 0
    replay = {"max_staleness": max_staleness}
    if mode == "reflow":
        replay["replay_cap"] = replay_cap
    spec = parse_job_spec({"model": {"path": "/m"}, "mode": mode, "replay": replay,
                           "rollout": {"group_size": GROUP},
                           "trainer": {"batch_size": BATCH}})
    assert spec.replay.evict_stale is evict_stale
    sim = Sim(ReplayStore.from_url(redis_server.url), spec)
    for step in steps:
        if step[0] == "dispatch":
            sim.workers[step[1]].dispatch()
        elif step[0] == "finish" and sim.workers[step[1]].inflight:
            w = sim.workers[step[1]]
            w.finish(step[2] % len(w.inflight))
        elif step[0] == "train":
            sim.train()
        elif step[0] == "lease_and_return":
            sim.lease_and_return()
        sim.check_accounting()
    # Liveness: from wherever the history left the job, rollout doing all it is
    # allowed to keeps yielding batches. Each round every worker dispatches what it
    # may and finishes one group (the newest, or in every third round the oldest,
    # so that some groups stay in flight across several versions), and the trainer
    # trains when it can. Groups that grow stale in flight are evicted on arrival;
    # the budget must come back for the job to go on.
    trained, rounds = 0, 0
    while trained < 6:
        rounds += 1
        if rounds > 60:
            pytest.fail(f"starved after {trained} batches: {sim.store.stats(sim.job)}")
        for w in sim.workers:
            w.dispatch()
            if w.inflight:
                w.finish(0 if rounds % 3 == 0 else -1)
        trained += sim.train()
        sim.check_accounting()


def test_evictions_refund_the_budget(redis_server):
    """δ = 0, versions by oldest segment: a group started under the previous version
    is evicted on arrival and its budget comes back at once, so rollout starts over
    under the new weights."""
    spec = parse_job_spec({"model": {"path": "/m"}, "mode": "reflow",
                           "replay": {"max_staleness": 0, "replay_cap": 0.0,
                                      "staleness_version": "oldest"},
                           "rollout": {"group_size": GROUP},
                           "trainer": {"batch_size": BATCH}})
    sim = Sim(ReplayStore.from_url(redis_server.url), spec)
    w = sim.workers[0]
    w.dispatch()
    assert len(w.inflight) == 2
    w.finish(0)
    w.finish(0)
    w.dispatch()  # the version bound: B_max for version 0 is spent
    assert not w.inflight
    assert sim.train()
    w.dispatch()
    assert len(w.inflight) == 2
    sim.version += 1  # another trainer step elsewhere makes them stale
    for x in sim.workers:
        x.version = sim.version
    sim.store.publish_version(sim.job, sim.version)
    w.finish(0)  # started under v1, the buffer is at v2 with δ = 0: evicted on arrival
    s = sim.store.stats(sim.job)
    assert s.evicted_unused_total == GROUP
    w.dispatch()
    assert len(w.inflight) == 2  # refunded: a whole new group could start
    sim.check_accounting()
