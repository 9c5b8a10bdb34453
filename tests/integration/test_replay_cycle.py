"""The dual replay data cycle (paper §4) on a real Redis: the cap σ, the
staleness bound δ, the sampler and the replay filter."""

import pytest

from reflow.core.config import ReplayConfig
from reflow.core.errors import FailedPrecondition, VersionGap
from reflow.core.grants import RedisGrants
from reflow.core.types import Segment, Trajectory
from reflow.replay.store import ReplayStore


def group(gid, size=4, version=0, rewards=None, advantages=None):
    rewards = rewards or [float(i % 2) for i in range(size)]
    advantages = advantages or [r - sum(rewards) / size for r in rewards]
    return [Trajectory(f"{gid}-{i}", gid, [1], [2, 3], [-0.5, -0.5], [1, 1], [Segment(version, 2)],
                       reward=rewards[i], advantage=advantages[i]) for i in range(size)]


@pytest.fixture
def store(redis_server, redis_client):
    return ReplayStore.from_url(redis_server.url)


def test_batch_mixes_unused_and_replayed_within_the_cap(store):
    store.configure("j", ReplayConfig(replay_cap=0.5, max_staleness=10))
    store.put("j", group("a") + group("b"))
    first = store.lease("j", 8, 30, timeout_s=0.1)
    store.release("j", first.lease_id)
    # Only 4 unused samples now: with σ = 0.5 a batch of 8 may take 4 replayed.
    store.put("j", group("c"))
    batch = store.lease("j", 8, 30, timeout_s=0.1)
    assert batch is not None
    unused = [t for t in batch.trajectories if t.uses == 0]
    replayed = [t for t in batch.trajectories if t.uses > 0]
    assert {t.group_id for t in unused} == {"c"}
    assert len(replayed) == 4 and all(t.uses == 1 for t in replayed)


def test_too_few_unused_samples_wait_rather_than_break_the_cap(store):
    store.configure("j", ReplayConfig(replay_cap=0.5, max_staleness=10))
    store.put("j", group("a") + group("b"))
    store.release("j", store.lease("j", 8, 30, timeout_s=0.1).lease_id)
    # 8 replayable samples but no unused ones: a batch of 8 needs at least 4 unused.
    assert store.lease("j", 8, 30, timeout_s=0.2) is None
    # With σ = 0 replay is off: unused alone must fill the batch.
    store.configure("j", ReplayConfig(replay_cap=0.0, max_staleness=10))
    store.put("j", group("c"))
    assert store.lease("j", 8, 30, timeout_s=0.2) is None


def test_publish_evicts_samples_older_than_delta(store):
    store.configure("j", ReplayConfig(max_staleness=1))
    store.put("j", group("old", version=0) + group("new", version=1))
    assert store.publish_version("j", 1) == 0
    assert store.publish_version("j", 2) == 4  # "old" (v0) < 2 - 1
    stats = store.stats("j")
    assert (stats.unused_samples, stats.evicted_total) == (4, 4)
    # A group that arrives already too stale is counted and evicted at once.
    assert store.put("j", group("late", version=0)) == 4
    assert store.stats("j").evicted_total == 8
    # A leased group that goes stale is evicted at release instead of replayed.
    batch = store.lease("j", 4, 30, timeout_s=0.1)
    store.publish_version("j", 3)
    store.release("j", batch.lease_id)
    stats = store.stats("j")
    assert (stats.replay_samples, stats.evicted_total) == (0, 12)


def test_max_use_count_filter_drops_after_the_last_allowed_use(store):
    store.configure("j", ReplayConfig(replay_filter="max_use_count", filter_args={"max_uses": 1},
                                      max_staleness=10))
    store.put("j", group("a"))
    store.release("j", store.lease("j", 4, 30, timeout_s=0.1).lease_id)
    stats = store.stats("j")
    assert (stats.replay_samples, stats.dropped_total) == (0, 4)


def test_non_zero_advantage_filter_shrinks_the_group(store):
    store.configure("j", ReplayConfig(replay_filter="non_zero_advantage", max_staleness=10))
    store.put("j", group("a", advantages=[1.0, 0.0, -1.0, 0.0]))
    store.release("j", store.lease("j", 4, 30, timeout_s=0.1).lease_id)
    stats = store.stats("j")
    assert (stats.replay_samples, stats.dropped_total) == (2, 2)
    store.put("j", group("b"))
    store.put("j", group("c", size=2))
    batch = store.lease("j", 8, 30, timeout_s=0.1)
    kept = sorted(t.sample_id for t in batch.trajectories if t.group_id == "a")
    assert kept in ([], ["a-0", "a-2"])


def test_medium_reward_sampler_skips_solved_and_unsolved_groups(store):
    store.configure("j", ReplayConfig(sampler="medium_reward", replay_cap=0.0, max_staleness=10))
    store.put("j", group("solved", rewards=[1.0] * 4) + group("unsolved", rewards=[0.0] * 4))
    assert store.lease("j", 4, 30, timeout_s=0.1) is None
    store.put("j", group("mixed", rewards=[1.0, 0.0, 1.0, 0.0]))
    batch = store.lease("j", 4, 30, timeout_s=0.1)
    assert {t.group_id for t in batch.trajectories} == {"mixed"}


def test_plugins_are_named_by_registry_name_never_by_import_path():
    config = ReplayConfig(sampler="medium_reward", sampler_args={"low": 0.1, "high": 0.9},
                          replay_filter="max_use_count", filter_args={"max_uses": 3})
    assert config.filter_args == {"max_uses": 3}
    # Even a path to a real built-in class is refused: specs name, never locate.
    with pytest.raises(ValueError, match="module paths are not accepted"):
        ReplayConfig(sampler="reflow.replay.plugins:UniformSampler")
    # Arguments are checked against the plug-in's own model, field named.
    with pytest.raises(ValueError, match=r"replay.sampler_args: low \(0.9\) must be below"):
        ReplayConfig(sampler="medium_reward", sampler_args={"low": 0.9, "high": 0.1})
    with pytest.raises(ValueError, match="replay.filter_args.max_uses"):
        ReplayConfig(replay_filter="max_use_count", filter_args={"max_uses": 0})


def straggler_group(gid):
    """A GRPO group dispatched at version 0: three members finished under it, the
    fourth was partially rolled out across two weight updates (segments 0, 1, 2)."""
    members = group(gid, size=3, version=0)
    return members + [Trajectory(f"{gid}-3", gid, [1], [2, 3, 4], [-0.5] * 3, [1] * 3,
                                 [Segment(0, 1), Segment(1, 1), Segment(2, 1)],
                                 reward=1.0, advantage=0.5)]


@pytest.mark.parametrize("reference, evicted", [("oldest", 4), ("newest", 4), ("completed", 0)])
def test_the_staleness_reference_decides_whether_a_straggler_condemns_its_group(
        store, reference, evicted):
    """δ = 1 at version 2: by `oldest` (and by `newest`, whose group version is its
    earliest-finished member's) the group is version 0 and arrives too stale; by
    `completed` it is version 2, the version its last member finished under."""
    store.configure("j", ReplayConfig(max_staleness=1, staleness_version=reference))
    store.publish_version("j", 1)
    store.publish_version("j", 2)
    assert store.put("j", straggler_group("g")) == 4
    stats = store.stats("j")
    assert (stats.evicted_total, stats.unused_samples) == (evicted, 4 - evicted)
    if not evicted:
        # It then ages from version 2: still there at 3, evicted at 4.
        assert store.publish_version("j", 3) == 0
        assert store.publish_version("j", 4) == 4


def _keys(store) -> dict[bytes, bytes]:
    return {key: store.redis.dump(key) for key in sorted(store.redis.keys("*"))}


def test_a_version_is_published_one_at_a_time(store):
    """The next version is published; one already reached is accepted and changes
    nothing (a retry after a lost reply); one past the next is refused in the
    script, before anything is written, with a message naming the field, the
    buffer's version and the rule."""
    store.configure("j", ReplayConfig(max_staleness=1))
    store.put("j", group("old", version=0) + group("new", version=1))
    assert store.publish_version("j", 1) == 0
    assert store.publish_version("j", 2) == 4  # "old" (v0) < 2 - 1
    before = _keys(store)
    for again in (2, 1, 0):
        assert store.publish_version("j", again) == 0
        assert _keys(store) == before, again
    for skip in (4, 3 + 10**6):
        with pytest.raises(VersionGap, match=r"policy_version: \d+ .* at version 2.* next "
                                             r"one \(3\)") as err:
            store.publish_version("j", skip)
        assert isinstance(err.value, FailedPrecondition)
        assert _keys(store) == before, skip
    assert store.version("j") == 2 and store.stats("j").unused_samples == 4
    assert store.publish_version("j", 3) == 4  # "new" (v1) < 3 - 1
    with pytest.raises(ValueError, match="policy_version must be >= 0"):
        store.publish_version("j", -1)


def test_returned_leases_are_still_judged_at_the_current_version(store):
    """expire_leases publishes the current version again: accepted, and what aged
    past δ while leased leaves the pools."""
    store.configure("j", ReplayConfig(max_staleness=1))
    store.put("j", group("a", version=0))
    batch = store.lease("j", 4, 30, timeout_s=0.1)
    store.publish_version("j", 1)
    store.publish_version("j", 2)
    assert store.return_lease("j", batch.lease_id) == 4
    stats = store.stats("j")
    assert (stats.unused_samples, stats.evicted_total, stats.policy_version) == (0, 4, 2)


def test_ending_a_job_revokes_its_grant_and_keeps_its_data(store):
    store.configure("j", ReplayConfig())
    store.put("j", group("a"))
    store.grants.grant("j", "")
    data = {k: v for k, v in _keys(store).items() if k != RedisGrants.KEY.encode()}
    store.end_job("j")
    store.end_job("j")  # idempotent
    assert not RedisGrants(store.redis).granted("j")
    assert {k: v for k, v in _keys(store).items() if k != RedisGrants.KEY.encode()} == data
    # An ended job is not granted again by anything but a new start.
    store.grants.grant_unless_ended("j")
    assert not RedisGrants(store.redis).granted("j")
    store.grants.grant("j", "")
    assert RedisGrants(store.redis).granted("j")
