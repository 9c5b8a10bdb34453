"""A step's record (trainer/records.py): the tokens of samples trained for the
first time beside all trained tokens, and the learning rate the step used."""

from types import SimpleNamespace

import pytest

from reflow.core.types import Batch, Segment, Trajectory
from reflow.replay.store import BufferStats
from reflow.trainer.loop import TrainLoop
from reflow.trainer.loss import LossStats
from reflow.trainer.records import step_record


def _sample(i: int, tokens: int, uses: int, reward: float = 0.0) -> Trajectory:
    return Trajectory(sample_id=f"s{i}", group_id="g", prompt_ids=[1],
                      response_ids=[2] * tokens, logprobs=[-1.0] * tokens,
                      loss_mask=[1] * tokens, segments=[Segment(3, tokens)], uses=uses,
                      reward=reward)


def test_first_use_tokens_count_only_samples_trained_for_the_first_time():
    loop = SimpleNamespace(
        step=4, policy_version=3, learning_rate=2.5e-4, startup_s=0.0, rollouts=[],
        job_id="job", group_size=1, membership_epoch=0, group_failures=0,
        retired_engines=[], reference_bytes=0, sync_bytes=0, last_sync_check=0.0,
        replay=SimpleNamespace(stats=lambda job_id: BufferStats()))
    batch = Batch(lease_id="l", policy_version=3,
                  trajectories=[_sample(0, 10, 0, 1.0), _sample(1, 30, 2, 1.0),
                                _sample(2, 20, 0, 0.0)])
    # No engine counters moved; one engine generating (the delta's shape is the loop's).
    delta = TrainLoop._rollout_delta({}, {})
    delta[-1] = 1.0
    stats = (LossStats(loss=0.1, clip_fraction=0.0, approx_kl=0.0, ratio_mean=1.0), 1.0)
    record = step_record(loop, batch, stats, wait_s=0.5, train_s=1.0, sync_s=0.0,
                         sync_wait_s=0.0, step_s=2.0,
                         rollout_delta=delta, wall_s=9.0)
    assert (record["trained_tokens"], record["trainer_tokens_per_s"]) == (60, 30.0)
    assert (record["first_use_tokens"], record["first_use_tokens_per_s"]) == (30, 15.0)
    assert record["replay_samples"] == 1
    # A replayed sample's reward counted when it was first trained: the first-use mean
    # leaves it out; a batch of replays alone has none.
    assert record["reward_mean"] == pytest.approx(2 / 3)
    assert record["first_use_reward_mean"] == pytest.approx(0.5)
    replays = Batch(lease_id="l", policy_version=3, trajectories=[_sample(1, 30, 2, 1.0)])
    assert "first_use_reward_mean" not in step_record(
        loop, replays, stats, wait_s=0.5, train_s=1.0, sync_s=0.0, sync_wait_s=0.0, step_s=2.0,
        rollout_delta=delta, wall_s=9.0)
    assert record["learning_rate"] == pytest.approx(2.5e-4)


def test_the_run_summary_gives_first_use_tokens_where_the_records_have_them():
    from reflow.report import summarize

    base = {"step": 1, "policy_version": 1, "wall_time_s": 1.0, "reward_mean": 0.0,
            "trained_tokens": 50, "trainer_tokens_per_s": 25.0, "step_time_s": 2.0,
            "trainer_idle_ratio": 0.0, "rollout_idle_ratio": 0.0, "max_staleness": 0}
    records = [dict(base, first_use_tokens=40, first_use_tokens_per_s=20.0),
               dict(base, step=2, first_use_tokens=20, first_use_tokens_per_s=10.0)]
    summary = summarize(records)
    assert (summary["first_use_tokens"], summary["first_use_tokens_per_s_mean"]) == (60, 15.0)
    assert "first_use_tokens" not in summarize([base])  # a run recorded before them
