"""Property tests of the replay invariants over random sequences of arrivals,
batch requests, releases, lease expiries and version bumps, on a real Redis."""

import math
import uuid

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reflow.core.config import ReplayConfig
from reflow.core.types import Segment, Trajectory
from reflow.replay.store import ReplayStore

GROUP = 4

actions = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.integers(1, 3), st.integers(0, 3)),
        st.tuples(st.just("sample"), st.integers(1, 4)),
        st.tuples(st.just("release"), st.integers(0, 5)),
        st.tuples(st.just("expire"), st.integers(0, 5)),
        st.tuples(st.just("bump")),
    ),
    min_size=1,
    max_size=40,
)


def _group(gid, version, salt):
    return [Trajectory(f"{gid}-{i}", gid, [1], [2] * (1 + (salt + i) % 5), [-0.1] * (1 + (salt + i) % 5),
                       [1] * (1 + (salt + i) % 5), [Segment(version, 1 + (salt + i) % 5)],
                       reward=float((salt + i) % 3) / 2, advantage=float(i) - 1.5)
            for i in range(GROUP)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=actions, replay_cap=st.sampled_from([0.0, 0.25, 0.5, 0.75]),
       max_staleness=st.integers(0, 2), max_uses=st.integers(1, 3))
def test_replay_invariants(redis_server, steps, replay_cap, max_staleness, max_uses):
    store = ReplayStore.from_url(redis_server.url)
    job = uuid.uuid4().hex
    store.configure(job, ReplayConfig(replay_cap=replay_cap, max_staleness=max_staleness,
                                      replay_filter="max_use_count", filter_args={"max_uses": max_uses}))
    version, put_ids, leases, n = 0, set(), [], 0
    for step in steps:
        kind = step[0]
        if kind == "put":
            for _ in range(step[1]):
                group = _group(f"g{n}", max(0, version - step[2]), n)
                n += 1
                store.put(job, group)
                put_ids |= {t.sample_id for t in group}
        elif kind == "sample":
            b = step[1] * GROUP
            batch = store.try_lease(job, b, lease_ttl_s=60)
            if batch is not None:
                trajs = batch.trajectories
                assert len(trajs) == b
                # The cap: at least ceil(b(1-σ)) unused samples.
                assert sum(1 for t in trajs if t.uses == 0) >= math.ceil(b * (1 - replay_cap) - 1e-9)
                # The staleness bound: nothing older than δ versions.
                assert all(t.oldest_version >= version - max_staleness for t in trajs)
                assert all(t.uses < max_uses for t in trajs)
                leases.append(batch.lease_id)
        elif kind == "release" and leases:
            store.release(job, leases.pop(step[1] % len(leases)))
        elif kind == "expire" and leases:
            store.return_lease(job, leases.pop(step[1] % len(leases)))
        elif kind == "bump":
            version += 1
            store.publish_version(job, version)
        # Nothing is lost: every sample put is unused, replayable, leased, or has
        # left through staleness eviction or the filter, and the counts add up.
        s = store.stats(job)
        assert s.put_total == len(put_ids)
        assert s.put_total == (s.unused_samples + s.replay_samples + s.leased_samples
                               + s.evicted_total + s.dropped_total + s.retired_total)
        assert s.evicted_unused_total <= s.evicted_total
        if replay_cap == 0.0:
            assert s.replay_samples == 0 and s.dropped_total == 0
        live = {k.decode() for k in store.redis.hkeys(store._key(job, "samples"))}
        assert live <= put_ids
        assert len(live) == s.unused_samples + s.replay_samples + s.leased_samples
    # Drain: releasing every lease leaves no sample leased.
    for lease_id in leases:
        store.release(job, lease_id)
    s = store.stats(job)
    assert s.leased_samples == 0 and s.outstanding_leases == 0
    # Every sample trained for the first time is retired, replayable, filtered out or
    # evicted after training; the rest were never trained.
    assert s.trained_unused_total + s.unused_samples + s.evicted_unused_total == s.put_total
