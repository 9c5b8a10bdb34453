import json
import math
import re

import pytest

from reflow.scheduler.placement.planner import (
    PlacementPlanner,
    PlacementPolicy,
    WindowMeasurement,
)


def policy(**overrides) -> PlacementPolicy:
    values = {"replay_cap": 0.5, "cooldown_steps": 0, "min_gain": 0.0} | overrides
    return PlacementPolicy(**values)


def window(split, produced, consumed, blocked=0.0, idle=0.0, step=1, window_s=10.0):
    return WindowMeasurement(step=step, window_s=window_s, rollout_workers=split[0],
                             trainer_workers=split[1], produced_samples=produced,
                             consumed_samples=consumed, rollout_blocked_ratio=blocked,
                             trainer_idle_ratio=idle)


@pytest.mark.parametrize("total, overrides, expected", [
    (4, {}, [(1, 3), (2, 2), (3, 1)]),
    (8, {"rollout_unit": 2, "trainer_unit": 2}, [(2, 6), (4, 4), (6, 2)]),
    (8, {"rollout_unit": 4}, [(4, 4)]),
    (10, {"rollout_unit": 2, "trainer_unit": 4}, [(2, 8), (6, 4)]),
    (8, {"min_rollout": 3, "min_trainer": 4}, [(3, 5), (4, 4)]),
    (4, {"min_rollout": 0, "min_trainer": 0}, [(1, 3), (2, 2), (3, 1)]),
    (6, {"min_rollout": 4, "min_trainer": 4}, []),
], ids=["plain", "units-2-2", "rollout-unit-4", "units-2-4", "min-bounds",
        "zero-min-keeps-one-each", "none-fit"])
def test_feasible_splits(total, overrides, expected):
    assert PlacementPlanner(policy(**overrides), total).feasible_splits() == expected


# Pool of 8 (12 where noted), σ = 0.5 so the target coverage is 0.5, window 10 s.
# Capacities are produced / (10 · r) and consumed / (10 · t); coverage(r, t) = r·c_r / (t·c_t).
@pytest.mark.parametrize("total, split, produced, consumed, action, reason, chosen", [
    # c_r = 0.5, c_t = 1: coverage(4, 4) = 0.5 exactly.
    (8, (4, 4), 20, 40, "hold", "already_best", (4, 4)),
    # c_r = c_t = 1: coverage = r / (8 − r); (2, 6) → 1/3, |log(2/3)| = 0.405;
    # (3, 5) → 0.6, log 1.2 = 0.182; (4, 4) → 1, log 2 = 0.693.  Best (3, 5).
    (8, (2, 6), 20, 60, "rebalance", "more_rollout", (3, 5)),
    # Same capacities from the other side: (6, 2) → 3, log 6 = 1.79.  Best (3, 5).
    (8, (6, 2), 60, 20, "rebalance", "more_trainer", (3, 5)),
    # c_r = 1, c_t = 0.25: coverage = 4r / (12 − r) = 0.5 at r = 4/3 → (1, 11) (0.364,
    # log 1.375 = 0.318) beats (2, 10) (0.8, log 1.6 = 0.47).
    (12, (6, 6), 60, 15, "rebalance", "more_trainer", (1, 11)),
], ids=["balanced", "rollout-starved-trainer", "over-supply", "far-over-supply"])
def test_moves_toward_the_target_coverage(total, split, produced, consumed, action, reason,
                                          chosen):
    decision = PlacementPlanner(policy(), total).observe(window(split, produced, consumed))
    assert (decision.action, decision.reason) == (action, reason)
    assert (decision.chosen.rollout_workers, decision.chosen.trainer_workers) == chosen
    assert (decision.current.rollout_workers, decision.current.trainer_workers) == split


def test_scores_are_the_log_mismatch():
    decision = PlacementPlanner(policy(), 8).observe(window((2, 6), 20, 60))
    assert decision.rollout_capacity == pytest.approx(1.0)
    assert decision.trainer_capacity == pytest.approx(1.0)
    assert decision.target_coverage == 0.5
    assert decision.current.predicted_coverage == pytest.approx(1 / 3)
    assert decision.current.mismatch == pytest.approx(math.log(1.5))
    assert decision.chosen.predicted_coverage == pytest.approx(0.6)
    assert decision.chosen.mismatch == pytest.approx(math.log(1.2))


# Pool of 12, σ = 0.5, window 30 s, current (2, 10), produced 60 → c_r = 1, consumed 200 →
# raw c_t = 200 / 300 = 2/3.
#   Raw:       coverage = 1.5 r / (12 − r) = 0.5 at r = 3 exactly → (3, 9).
#   Idle 0.5:  c_t = 4/3, coverage = 0.75 r / (12 − r) = 0.5 at r = 4.8;
#              (5, 7) → 0.536, log 1.071 = 0.069; (4, 8) → 0.375, |log 0.75| = 0.288 → (5, 7).
# Pool of 12, σ = 0.5, window 10 s, current (6, 6), produced 30 → raw c_r = 0.5,
# consumed 60 → c_t = 1.
#   Raw:          coverage = 0.5 r / (12 − r) = 0.5 at r = 6 → stays at (6, 6).
#   Blocked 0.5:  c_r = 1, coverage = r / (12 − r) = 0.5 at r = 4 exactly → (4, 8).
@pytest.mark.parametrize("split, produced, consumed, blocked, idle, window_s, action, reason, "
                         "chosen, capacities", [
    ((2, 10), 60, 200, 0.0, 0.5, 30.0, "rebalance", "more_rollout", (5, 7), (1.0, 4 / 3)),
    ((2, 10), 60, 200, 0.0, 0.0, 30.0, "rebalance", "more_rollout", (3, 9), (1.0, 2 / 3)),
    ((6, 6), 30, 60, 0.5, 0.0, 10.0, "rebalance", "more_trainer", (4, 8), (1.0, 1.0)),
    ((6, 6), 30, 60, 0.0, 0.0, 10.0, "hold", "already_best", (6, 6), (0.5, 1.0)),
], ids=["trainer-starved-corrected", "trainer-starved-uncorrected",
        "rollout-blocked-corrected", "rollout-blocked-uncorrected"])
def test_blocked_and_starved_time_is_not_lost_capacity(split, produced, consumed, blocked, idle,
                                                       window_s, action, reason, chosen,
                                                       capacities):
    decision = PlacementPlanner(policy(), 12).observe(
        window(split, produced, consumed, blocked, idle, window_s=window_s))
    assert (decision.action, decision.reason) == (action, reason)
    assert (decision.chosen.rollout_workers, decision.chosen.trainer_workers) == chosen
    assert (decision.rollout_capacity, decision.trainer_capacity) == pytest.approx(capacities)


@pytest.mark.parametrize("step, action, reason", [
    (11, "hold", "cooldown"),
    (12, "hold", "cooldown"),
    (13, "hold", "cooldown"),
    (14, "hold", "cooldown"),
    (15, "rebalance", "more_rollout"),
    (16, "rebalance", "more_rollout"),
], ids=str)
def test_cooldown_counts_training_steps_since_the_applied_rebalance(step, action, reason):
    planner = PlacementPlanner(policy(cooldown_steps=5), 8)
    first = planner.observe(window((2, 6), 20, 60, step=10))
    assert (first.action, first.reason) == ("rebalance", "more_rollout")  # no cooldown yet
    planner.applied(10, 3, 5)
    # The new split still starves the trainer badly: c_r = 0.2, c_t = 1, coverage(3, 5) = 0.12,
    # log(0.5 / 0.12) = 1.43; (6, 2) → 0.6, log 1.2 = 0.18 is best and a large gain.
    decision = planner.observe(window((3, 5), 6, 50, step=step))
    assert (decision.action, decision.reason) == (action, reason)
    assert (decision.chosen.rollout_workers, decision.chosen.trainer_workers) == (6, 2)


# (2, 6) at c_r = c_t = 1: mismatch log 1.5 = 0.405 → best (3, 5) at log 1.2 = 0.182,
# a gain of log 1.25 = 0.223.
@pytest.mark.parametrize("min_gain, action, reason", [
    (0.0, "rebalance", "more_rollout"),
    (0.22, "rebalance", "more_rollout"),
    (0.23, "hold", "gain_below_threshold"),
    (1.0, "hold", "gain_below_threshold"),
], ids=["no-threshold", "just-below-gain", "just-above-gain", "far-above-gain"])
def test_min_gain(min_gain, action, reason):
    decision = PlacementPlanner(policy(min_gain=min_gain), 8).observe(window((2, 6), 20, 60))
    assert (decision.action, decision.reason) == (action, reason)
    assert (decision.chosen.rollout_workers, decision.chosen.trainer_workers) == (3, 5)


# Pool of 12, trainer_unit 4: only (8, 4) and (4, 8) fit. σ = 0, c_r = c_t = 1: both miss the
# target 1 by exactly log 2, so the tie goes to the split fewer workers must leave, and between
# equally far ones to the side that does not under-supply fresh samples.
@pytest.mark.parametrize("split, chosen", [
    ((7, 5), (8, 4)),
    ((5, 7), (4, 8)),
    ((6, 6), (8, 4)),
], ids=["nearer-more-rollout", "nearer-more-trainer", "equidistant-no-under-supply"])
def test_ties_go_to_the_nearest_split(split, chosen):
    planner = PlacementPlanner(policy(replay_cap=0.0, trainer_unit=4), 12)
    decision = planner.observe(window(split, 10 * split[0], 10 * split[1]))
    assert (decision.chosen.rollout_workers, decision.chosen.trainer_workers) == chosen
    # The current split is off the grid and nearer the target, so no move is worth it.
    assert (decision.action, decision.reason) == ("hold", "gain_below_threshold")


@pytest.mark.parametrize("measurement, rollout_known, trainer_known", [
    (window((4, 4), 20, 40, blocked=0.9995), False, True),
    (window((4, 4), 20, 40, blocked=0.999), False, True),
    (window((4, 4), 20, 40, idle=1.0), True, False),
    (window((4, 4), 0, 40), False, True),
    (window((4, 4), 20, 0), True, False),
    (window((0, 8), 0, 40), False, True),
], ids=["rollout-blocked-almost-all", "rollout-blocked-at-guard", "trainer-idle-all",
        "nothing-produced", "nothing-consumed", "no-rollout-workers"])
def test_unknown_capacity_holds(measurement, rollout_known, trainer_known):
    decision = PlacementPlanner(policy(), 8).observe(measurement)
    assert (decision.action, decision.reason) == ("hold", "no_measurement")
    assert (decision.rollout_capacity is not None) == rollout_known
    assert (decision.trainer_capacity is not None) == trainer_known
    assert decision.current is None and decision.chosen is None


def test_no_feasible_split_holds():
    decision = PlacementPlanner(policy(min_rollout=4, min_trainer=4), 6).observe(
        window((3, 3), 30, 30))
    assert (decision.action, decision.reason) == ("hold", "no_feasible_split")
    assert decision.chosen is None
    assert (decision.current.rollout_workers, decision.current.trainer_workers) == (3, 3)


@pytest.mark.parametrize("windows, action, reason, rollout_capacity, pooled", [
    # The last window alone: c_r = 40 / (10 · 4) = 1, coverage 1 against 0.5.
    (1, "rebalance", "more_trainer", 1.0, 1),
    # The three pooled: c_r = 60 / (30 · 4) = 0.5, coverage 0.5 on target.
    (3, "hold", "already_best", 0.5, 3),
    # At most W windows are kept: the last two, c_r = 50 / 80, coverage 0.625 (log 1.25 =
    # 0.22) still nearer than (3, 5)'s 0.375 (log 4/3 = 0.29).
    (2, "hold", "already_best", 50 / 80, 2),
], ids=["one-window", "three-pooled", "two-of-three"])
def test_capacities_are_pooled_over_the_last_windows(windows, action, reason,
                                                     rollout_capacity, pooled):
    planner = PlacementPlanner(policy(windows=windows), 8)
    for step, produced in enumerate((10, 10, 40), start=1):
        decision = planner.observe(window((4, 4), produced, 40, step=step))
    assert (decision.action, decision.reason) == (action, reason)
    assert decision.rollout_capacity == pytest.approx(rollout_capacity)
    assert decision.trainer_capacity == pytest.approx(1.0)
    assert decision.pooled_windows == decision.as_event()["pooled_windows"] == pooled


def test_pooled_windows_weigh_busy_time_and_restart_at_a_new_split():
    planner = PlacementPlanner(policy(windows=5), 8)
    # Rollout blocked half of the first window: 20 + 40 busy worker-seconds for 50 samples.
    planner.observe(window((4, 4), 10, 40, blocked=0.5, step=1))
    decision = planner.observe(window((4, 4), 40, 40, step=2))
    assert decision.rollout_capacity == pytest.approx(50 / 60)
    # Blocked and idle corrections depend on the split, so a new split starts afresh.
    decision = planner.observe(window((5, 3), 25, 30, step=3))
    assert decision.pooled_windows == 1
    assert decision.rollout_capacity == pytest.approx(25 / 50)
    assert decision.trainer_capacity == pytest.approx(1.0)


def test_ratios_within_float_noise_are_clamped():
    measurement = window((4, 4), 20, 40, blocked=-1e-9, idle=1 + 1e-9)
    assert (measurement.rollout_blocked_ratio, measurement.trainer_idle_ratio) == (0.0, 1.0)


def test_event_is_json_and_holds_inputs_and_outputs():
    decision = PlacementPlanner(policy(), 8).observe(window((2, 6), 20, 60, step=7))
    event = json.loads(json.dumps(decision.as_event()))
    assert event["step"] == 7
    assert (event["action"], event["reason"]) == ("rebalance", "more_rollout")
    assert event["target_coverage"] == 0.5
    assert event["rollout_capacity"] == pytest.approx(1.0)
    assert event["trainer_capacity"] == pytest.approx(1.0)
    assert (event["current_rollout_workers"], event["current_trainer_workers"]) == (2, 6)
    assert (event["chosen_rollout_workers"], event["chosen_trainer_workers"]) == (3, 5)
    assert event["chosen_mismatch"] == pytest.approx(math.log(1.2))
    assert event["mismatch_gain"] == pytest.approx(math.log(1.25))
    assert (event["window_s"], event["produced_samples"], event["consumed_samples"]) == (
        10.0, 20, 60)
    assert (event["rollout_workers"], event["trainer_workers"]) == (2, 6)


def test_event_keeps_its_keys_when_nothing_was_scored():
    scored = PlacementPlanner(policy(), 8).observe(window((2, 6), 20, 60)).as_event()
    unscored = PlacementPlanner(policy(), 8).observe(window((2, 6), 0, 60)).as_event()
    json.dumps(unscored, allow_nan=False)
    assert unscored.keys() == scored.keys()
    assert unscored["rollout_capacity"] is None and unscored["chosen_rollout_workers"] is None


@pytest.mark.parametrize("make, field", [
    (lambda: policy(replay_cap=1.0), "replay_cap"),
    (lambda: policy(replay_cap=-0.1), "replay_cap"),
    (lambda: policy(replay_cap=math.nan), "replay_cap"),
    (lambda: policy(cooldown_steps=-1), "cooldown_steps"),
    (lambda: policy(cooldown_steps=1.5), "cooldown_steps"),
    (lambda: policy(min_gain=-0.1), "min_gain"),
    (lambda: policy(rollout_unit=0), "rollout_unit"),
    (lambda: policy(trainer_unit=0), "trainer_unit"),
    (lambda: policy(min_rollout=-1), "min_rollout"),
    (lambda: policy(min_trainer=-1), "min_trainer"),
    (lambda: policy(windows=0), "windows"),
    (lambda: PlacementPlanner(policy(), 1), "total_workers"),
    (lambda: window((4, 4), 20, 40, window_s=0.0), "window_s"),
    (lambda: window((4, 4), 20, 40, window_s=-1.0), "window_s"),
    (lambda: window((-1, 4), 20, 40), "rollout_workers"),
    (lambda: window((4, -1), 20, 40), "trainer_workers"),
    (lambda: window((4, 4), -1, 40), "produced_samples"),
    (lambda: window((4, 4), 20, -1), "consumed_samples"),
    (lambda: window((4, 4), 20, 40, blocked=1.5), "rollout_blocked_ratio"),
    (lambda: window((4, 4), 20, 40, idle=-0.2), "trainer_idle_ratio"),
    (lambda: window((4, 4), 20, 40, step=-1), "step"),
    (lambda: PlacementPlanner(policy(), 8).observe(window((5, 4), 20, 40)),
     "rollout_workers + trainer_workers"),
    (lambda: PlacementPlanner(policy(), 8).applied(3, -1, 9), "rollout_workers"),
    (lambda: PlacementPlanner(policy(), 8).applied(3, 5, 4), "rollout_workers + trainer_workers"),
], ids=["replay-cap-one", "replay-cap-negative", "replay-cap-nan", "cooldown-negative",
        "cooldown-float", "min-gain-negative", "rollout-unit-zero", "trainer-unit-zero",
        "min-rollout-negative", "min-trainer-negative", "windows-zero", "total-one", "window-zero",
        "window-negative", "rollout-negative", "trainer-negative", "produced-negative",
        "consumed-negative", "blocked-1.5", "idle-minus-0.2", "step-negative",
        "split-over-pool", "applied-negative", "applied-over-pool"])
def test_bad_input_names_the_field(make, field):
    with pytest.raises(ValueError, match=f"^{re.escape(field)} must be"):
        make()
