"""Advantage estimators (reflow.algorithms.advantages) against hand-worked
numbers, resolved only by registered name; and DAPO's two reward-side
treatments where a group is scored (rollout/scoring.py): over-long responses
masked or softly penalised, and the dynamic-sampling drop decision."""

from types import SimpleNamespace

import pytest

from reflow.algorithms.advantages import (GroupNormalised, GroupNormalisedSampleStd, LeaveOneOut,
                                          MeanCentered, equal_rewards, load_estimator,
                                          overlong_penalty)
from reflow.core import plugins
from reflow.core.config import JobSpecError, parse_job_spec
from reflow.core.types import Segment, group_advantages
from reflow.rollout.scoring import GroupScoring, group_trajectories
from reflow.tasks.rewards import RewardResult

ONE_OF_FOUR = [1.0, 0.0, 0.0, 0.0]  # mean 1/4


def _spec(**algorithm):
    return parse_job_spec({"model": {"path": "/m"}, "algorithm": algorithm})


def test_grpo_divides_by_the_population_std():
    # Deviations 3/4, -1/4 x3; population var (9/16 + 3/16) / 4 = 3/16, std √3/4:
    # 3/4 ÷ √3/4 = √3, -1/4 ÷ √3/4 = -1/√3 (less the eps in the denominator).
    adv = GroupNormalised().compute(ONE_OF_FOUR)
    assert adv == pytest.approx([3 ** 0.5] + [-(3 ** -0.5)] * 3, rel=1e-5)
    # Exactly today's core.types.group_advantages, flat groups included.
    for rewards in (ONE_OF_FOUR, [1.0, 0.0, 0.5, 0.5], [0.3, 0.3, 0.3], [2.0], []):
        assert GroupNormalised().compute(rewards) == group_advantages(rewards)
    assert GroupNormalised().compute([0.3, 0.3, 0.3]) == [0.0, 0.0, 0.0]


def test_grpo_sample_std_divides_by_the_n_minus_1_std():
    # Sample var (9/16 + 3/16) / 3 = 1/4, std 1/2: 3/4 ÷ 1/2 = 1.5, -1/4 ÷ 1/2 = -0.5.
    adv = GroupNormalisedSampleStd().compute(ONE_OF_FOUR)
    assert adv == pytest.approx([1.5, -0.5, -0.5, -0.5], rel=1e-5)
    # [1, 0]: mean 1/2, sample std √(1/2): ±(1/2)/√(1/2) = ±√(1/2).
    assert GroupNormalisedSampleStd().compute([1.0, 0.0]) == pytest.approx(
        [0.5 ** 0.5, -(0.5 ** 0.5)], rel=1e-5)
    assert GroupNormalisedSampleStd().compute([0.7, 0.7]) == [0.0, 0.0]
    assert GroupNormalisedSampleStd().compute([1.0]) == [0.0]  # no sample std of one


def test_mean_centered_does_not_divide_by_the_std():
    assert MeanCentered().compute(ONE_OF_FOUR) == [0.75, -0.25, -0.25, -0.25]
    assert MeanCentered().compute([3.0, 1.0]) == [1.0, -1.0]
    assert MeanCentered().compute([]) == []


def test_rloo_subtracts_the_mean_of_the_other_members():
    # 1 - mean(0, 0, 0) = 1; 0 - mean(1, 0, 0) = -1/3.
    assert LeaveOneOut().compute(ONE_OF_FOUR) == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])
    # 3 - 1 = 2, 1 - 3 = -2, 2 - (3 + 1) / 2 = 0.
    assert LeaveOneOut().compute([3.0, 1.0, 2.0]) == pytest.approx([1.5, -1.5, 0.0])
    assert LeaveOneOut().compute([5.0]) == [0.0]


def test_each_estimator_is_a_registered_name_and_the_spec_picks_it():
    assert plugins.registered("advantage") == ["grpo", "grpo_sample_std", "mean_centered", "rloo"]
    for name, cls in (("grpo", GroupNormalised), ("grpo_sample_std", GroupNormalisedSampleStd),
                      ("mean_centered", MeanCentered), ("rloo", LeaveOneOut)):
        assert type(load_estimator(name)) is cls
        assert type(GroupScoring(_spec(advantage=name).algorithm).estimator) is cls
    # None pairs with the loss: Dr.GRPO's loss with its advantages.
    assert type(GroupScoring(_spec(loss="dr_grpo").algorithm).estimator) is MeanCentered
    assert type(GroupScoring(_spec().algorithm).estimator) is GroupNormalised
    assert type(GroupScoring().estimator) is GroupNormalised


@pytest.mark.parametrize("name", ["os:system", "reflow.x:Y",
                                  "reflow.algorithms.advantages:LeaveOneOut", "builtins.eval"])
def test_a_module_path_is_refused_naming_the_field(name):
    with pytest.raises(JobSpecError, match=r"algorithm\.advantage: unknown advantage") as err:
        _spec(advantage=name)
    assert "module paths are not accepted" in str(err.value)
    with pytest.raises(ValueError, match=r"algorithm\.advantage"):
        load_estimator(name)


def test_the_drop_decision_looks_at_scored_rewards_only():
    assert equal_rewards([1.0, 1.0, 1.0]) and equal_rewards([0.5, 0.5 + 1e-10])
    assert not equal_rewards([0.5, 0.5 + 1e-8]) and not equal_rewards([1.0, 0.0, 1.0])
    assert equal_rewards([0.3]) and equal_rewards([])  # fewer than two: no signal

    def traj(reward, error=""):
        return SimpleNamespace(reward=reward, reward_error=error)

    on = GroupScoring(_spec(dynamic_sampling=True).algorithm)
    assert on.drops([traj(1.0), traj(1.0)])
    assert not on.drops([traj(1.0), traj(0.0)])
    # A failed member (reward 0 as stored) does not make the group informative...
    assert on.drops([traj(1.0), traj(0.0, "timeout"), traj(1.0)])
    # ... and one scored member is no comparison.
    assert on.drops([traj(1.0), traj(0.0, "exception")])
    assert not GroupScoring(_spec().algorithm).drops([traj(1.0), traj(1.0)])  # off


def test_the_soft_overlong_penalty_by_hand():
    # L_max 20, L_cache 4: free up to 16, then -(L - 16) / 4 x penalty, -penalty at 20.
    assert [overlong_penalty(n, 20, 4, 1.0) for n in (0, 16, 17, 18, 20, 25)] == [
        0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    assert overlong_penalty(19, 20, 4, 0.5) == pytest.approx(-0.375)
    # A buffer as long as the limit: every response pays by its length.
    assert overlong_penalty(2, 8, 8, 1.0) == pytest.approx(-0.25)
    with pytest.raises(ValueError, match="max_tokens"):
        overlong_penalty(1, 0, 4, 1.0)


def _samples(lengths, finish):
    return [SimpleNamespace(response_ids=[5] * n, logprobs=[-0.1] * n,
                            segments=[Segment(0, n)] if n else [], finish_reason=f)
            for n, f in zip(lengths, finish)]


def test_penalty_is_added_to_the_reward_before_the_advantages():
    scoring = GroupScoring(_spec(advantage="mean_centered", overlong="penalty",
                                 overlong_buffer_tokens=4).algorithm)
    samples = _samples([10, 17, 20, 18], ["stop", "stop", "length", "stop"])
    results = [RewardResult(1.0)] * 4
    trajs = group_trajectories("g", [1], samples, results, scoring=scoring, max_tokens=20)
    # Rewards 1, 1 - 1/4, 1 - 1, 1 - 1/2; mean 9/16.
    assert [t.reward for t in trajs] == [1.0, 0.75, 0.0, 0.5]
    assert [t.advantage for t in trajs] == pytest.approx([0.4375, 0.1875, -0.5625, -0.0625])
    assert all(t.loss_mask == [1] * len(t.response_ids) for t in trajs)  # nothing masked
    # The limit is the one the samples were generated under (a curriculum stage's).
    # L_max 18: free up to 14; 17 pays 3/4, 18 and past it the whole penalty.
    shorter = group_trajectories("g", [1], samples, results, scoring=scoring, max_tokens=18)
    assert [t.reward for t in shorter] == [1.0, 0.25, 0.0, 0.0]
    # A sample without a reward gets no penalty, stays out of the baseline and the loss.
    failed = group_trajectories("g", [1], samples, [RewardResult(1.0)] * 3
                                + [RewardResult(0.0, "timeout")], scoring=scoring, max_tokens=20)
    assert [t.reward for t in failed] == [1.0, 0.75, 0.0, 0.0]
    assert [t.advantage for t in failed] == pytest.approx([5 / 12, 1 / 6, -7 / 12, 0.0])
    assert failed[3].loss_mask == [0] * 18


def test_mask_takes_a_cut_response_out_of_the_loss_but_not_out_of_the_baseline():
    scoring = GroupScoring(_spec(advantage="mean_centered", overlong="mask").algorithm)
    samples = _samples([3, 4, 2], ["stop", "length", "stop"])
    results = [RewardResult(1.0), RewardResult(0.0), RewardResult(0.5)]
    trajs = group_trajectories("g", [1], samples, results, scoring=scoring, max_tokens=4)
    assert [t.loss_mask for t in trajs] == [[1, 1, 1], [0, 0, 0, 0], [1, 1]]
    # Its reward is unchanged and still counts in the group's mean (1/2).
    assert [t.reward for t in trajs] == [1.0, 0.0, 0.5]
    assert [t.advantage for t in trajs] == [0.5, -0.5, 0.0]
    assert [t.num_tokens for t in trajs] == [3, 0, 2]
    # keep (the default) trains it like any other.
    kept = group_trajectories("g", [1], samples, results, max_tokens=4)
    assert kept[1].loss_mask == [1, 1, 1, 1]
