import pytest

from reflow.core.config import JobSpecError, parse_job_spec
from reflow.rollout.tasks import RepeatTask
from reflow.rollout.worker import RolloutWorker


def spec(**extra):
    return parse_job_spec({"model": {"path": "/m"}, "trainer": {"batch_size": 16},
                           "rollout": {"group_size": 4}, **extra})


@pytest.mark.parametrize("mode,cap,delta,ahead", [
    ("sync", 0.0, 0, 0), ("one_step_off", 0.0, 1, 1), ("fully_async", 0.0, 1, 1),
    ("reflow", 0.5, 1, 1),
])
def test_modes_fix_their_fields(mode, cap, delta, ahead):
    s = spec(mode=mode)
    assert (s.replay.replay_cap, s.replay.max_staleness, s.dispatch_ahead_versions) == (cap, delta, ahead)
    if mode in ("sync", "one_step_off"):
        assert s.replay.sampler == "fifo" and s.trainer.sync_interval == 1


def test_a_mode_rejects_a_conflicting_field_instead_of_overriding_it():
    with pytest.raises(JobSpecError, match="mode=fully_async fixes replay.replay_cap"):
        spec(mode="fully_async", replay={"replay_cap": 0.5})
    # Stating the fixed value is fine; async modes keep a user's δ.
    assert spec(mode="sync", replay={"replay_cap": 0.0}).mode == "sync"
    assert spec(mode="fully_async", replay={"max_staleness": 3}).dispatch_ahead_versions == 3


def test_dispatch_budget_is_b_max_per_step_ahead_of_the_trainer():
    def worker(s):
        return RolloutWorker("j", s, lambda: None, RepeatTask(), replay=None,
                             encode=lambda t: [], decode=lambda ids: "")

    sync = worker(spec(mode="sync"))
    assert sync.dispatch_budget() == 16  # one batch, then wait for the trainer
    sync.counters.policy_version = 3
    assert sync.dispatch_budget() == 64
    off = worker(spec(mode="one_step_off"))
    assert off.dispatch_budget() == 32  # one batch ahead
    custom = worker(spec(mode="reflow", rollout={"group_size": 4, "max_samples_per_step": 8},
                         trainer={"batch_size": 16, "sync_interval": 2}, replay={"max_staleness": 2}))
    assert custom.dispatch_budget() == 8 * 2 * 3
