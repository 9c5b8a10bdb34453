import pytest

from reflow.core.config import JobSpecError, parse_job_spec


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


def test_baselines_are_run_as_their_authors_run_them():
    sync, off, fully, reflow = (spec(mode=m) for m in
                                ("sync", "one_step_off", "fully_async", "reflow"))
    # verl's hybrid-engine trainer: colocated, on-policy, whole samples.
    assert sync.colocated and not sync.rollout.partial_rollout
    # verl one_step_off_policy: whole batches under one version, nothing dropped.
    assert not off.rollout.partial_rollout and not off.replay.evict_stale
    assert not off.colocated
    # verl fully_async_policy / AReaL: partial rollout, in order, throttled, no eviction.
    assert fully.rollout.partial_rollout and not fully.replay.evict_stale
    assert fully.replay.sampler == "fifo"
    # ReFlow: the paper's settings (σ = τ = 0.5, δ = 1, B_max = b), eviction on.
    assert (reflow.replay.replay_cap, reflow.replay.replay_weight, reflow.replay.max_staleness,
            reflow.samples_per_step) == (0.5, 0.5, 1, reflow.trainer.batch_size)
    assert reflow.replay.evict_stale and reflow.rollout.partial_rollout
    assert reflow.replay.staleness_version == "completed"
    # The baselines order their queues by generation start, as measured before.
    assert (sync.replay.staleness_version, off.replay.staleness_version,
            fully.replay.staleness_version) == ("oldest",) * 3
    with pytest.raises(JobSpecError, match="mode=one_step_off fixes rollout.partial_rollout"):
        spec(mode="one_step_off", rollout={"group_size": 4, "partial_rollout": True})


def test_baselines_generate_without_adaptive_scheduling_at_their_budget_s_concurrency():
    # verl hands vLLM all its budget allows: the whole batch (sync), the next batch
    # too (one_step_off), required_samples x (staleness_threshold + 1) (fully_async).
    for mode, cap in (("sync", 16), ("one_step_off", 32), ("fully_async", 32)):
        s = spec(mode=mode)
        assert s.rollout.max_inflight_samples is None and s.concurrency_cap == cap, mode
        assert not s.scheduler.enabled("concurrency_control")
        assert not s.scheduler.enabled("token_admission")
    with pytest.raises(JobSpecError, match="mode=sync fixes rollout.max_inflight_samples"):
        spec(mode="sync", rollout={"group_size": 4, "max_inflight_samples": 8})
    reflow = spec(mode="reflow")
    assert reflow.concurrency_cap == 64 and reflow.scheduler.enabled("concurrency_control")
    off = spec(mode="reflow", scheduler={"token_admission": False})
    assert off.scheduler.enabled("concurrency_control")
    assert not off.scheduler.enabled("token_admission")
    assert not spec(mode="reflow", scheduler={"adaptive": False}).scheduler.enabled("placement")


def test_dispatch_limits_are_b_max_per_step_ahead_of_the_trainer():
    sync = spec(mode="sync")
    assert sync.dispatch_limits(0) == (16, 16)  # one batch, then wait for the trainer
    assert sync.dispatch_limits(3) == (16, 64)
    assert spec(mode="one_step_off").dispatch_limits(0) == (32, 32)  # one batch ahead
    custom = spec(mode="reflow", rollout={"group_size": 4, "max_samples_per_step": 8},
                  trainer={"batch_size": 16, "sync_interval": 2}, replay={"max_staleness": 2})
    assert custom.dispatch_limits(0) == (8 * 2 * 3, 8 * 2 * 3)


def test_sync_is_colocated_and_the_others_get_their_own_cores(monkeypatch):
    """Locally, sync gives rollout and trainer every core (they take turns, as verl's
    hybrid engine); the asynchronous modes split the cores between them."""
    import os

    from reflow.scheduler.cluster.local import LocalBackend

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.delenv("REFLOW_PIN_CPUS", raising=False)
    backend = LocalBackend("redis://unused")
    split = {s: backend._cpu_env(s) for s in ("rollout", "trainer")}
    # The engine core gets the rollout cores; its front end may run on any.
    assert split["rollout"]["REFLOW_ENGINE_CPU_AFFINITY"] == "0,1"
    assert split["rollout"]["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"
    assert split["rollout"]["REFLOW_CPU_AFFINITY"] == "0,1,2,3"
    assert split["trainer"]["REFLOW_CPU_AFFINITY"] == "2,3"
    together = {s: backend._cpu_env(s, colocated=True) for s in ("rollout", "trainer")}
    assert together["rollout"]["REFLOW_CPU_AFFINITY"] == "0,1,2,3"
    assert together["rollout"]["REFLOW_ENGINE_CPU_AFFINITY"] == "0,1,2,3"
    assert together["rollout"]["VLLM_CPU_OMP_THREADS_BIND"] == "0,1,2,3"
    assert together["trainer"]["REFLOW_CPU_AFFINITY"] == "0,1,2,3"
    assert together["rollout"]["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("REFLOW_COLOCATE", "0")
    assert backend._cpu_env("rollout", colocated=True) == backend._cpu_env("rollout")
