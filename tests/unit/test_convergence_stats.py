"""bench/convergence_stats.py: the t-interval, curves on a grid, time to a target
and the paired bootstrap, on hand-made input."""

import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest

_PATH = Path(__file__).resolve().parents[2] / "bench" / "convergence_stats.py"
_spec = importlib.util.spec_from_file_location("convergence_stats", _PATH)
stats = importlib.util.module_from_spec(_spec)
sys.modules["convergence_stats"] = stats
_spec.loader.exec_module(stats)


def test_t_interval_by_hand():
    # 1, 2, 3: mean 2, sample std 1, t975(2) = 4.303: 2 ± 4.303 / √3 = 2 ± 2.4843.
    mean, lo, hi = stats.t_interval(np.array([1.0, 2.0, 3.0]))
    assert mean == pytest.approx(2.0)
    assert lo == pytest.approx(2.0 - 4.303 / math.sqrt(3), abs=1e-9)
    assert hi == pytest.approx(2.0 + 2.48434, abs=1e-4)
    # Over seeds (axis 0), point by point; one seed has no interval.
    mean, lo, hi = stats.t_interval(np.array([[0.0, 1.0], [2.0, 1.0]]))
    assert mean.tolist() == [1.0, 1.0]
    assert lo[1] == hi[1] == 1.0  # no spread, no width
    assert hi[0] == pytest.approx(1.0 + 12.706 * math.sqrt(2) / math.sqrt(2))
    _, lo, hi = stats.t_interval(np.array([[0.5, 0.7]]))
    assert np.isnan(lo).all() and np.isnan(hi).all()


def test_t_quantile_between_rows():
    assert stats.t975(8) == 2.306
    assert 2.000 > stats.t975(80) > 1.980
    assert stats.t975(10**6) == pytest.approx(1.960, abs=1e-4)
    with pytest.raises(ValueError):
        stats.t975(0)


def test_interpolation_on_a_common_grid():
    a_x, a_y = np.array([16, 32, 48, 64]), np.array([0.0, 1.0, 2.0, 3.0])
    b_x, b_y = np.array([8, 24, 40, 56, 72]), np.array([0.0, 0.0, 1.0, 1.0, 1.0])
    grid = stats.common_grid([a_x, b_x], num=5)
    assert grid.tolist() == [16.0, 28.0, 40.0, 52.0, 64.0]  # only where both have points
    assert stats.interpolate(a_x, a_y, grid) == pytest.approx([0.0, 0.75, 1.5, 2.25, 3.0])
    assert stats.interpolate(b_x, b_y, grid) == pytest.approx([0.0, 0.25, 1.0, 1.0, 1.0])
    # A step that added nothing to x: the later value counts.
    assert stats.interpolate([0, 10, 10, 20], [0.0, 1.0, 5.0, 5.0], np.array([10.0])) == [5.0]
    with pytest.raises(ValueError):
        stats.interpolate(a_x, a_y, np.array([8.0]))  # never extrapolated
    assert stats.common_grid([np.array([0, 1]), np.array([2, 3])]).size == 0


def test_trailing_mean_and_window_statistics():
    assert stats.trailing_mean([1, 2, 3, 4, 5], 3).tolist() == [1.0, 1.5, 2.0, 3.0, 4.0]
    grid = np.linspace(0.0, 10.0, 11)
    y = grid / 10.0
    assert stats.area_mean(grid, y) == pytest.approx(0.5)  # mean of a line from 0 to 1
    assert stats.window_mean(grid, y, 0.2) == pytest.approx(0.9)  # 0.8, 0.9, 1.0


def test_time_to_target_on_a_constructed_curve():
    t = [10.0, 20.0, 30.0, 40.0, 50.0, 60.0]
    rewards = [1.0, 0.0, 0.0, 0.25, 0.75, 0.75]
    smoothed = stats.trailing_mean(rewards, 2)  # 1, 0.5, 0, 0.125, 0.5, 0.75
    assert stats.time_to_target(t, smoothed, 0.5) == 10.0  # one lucky first batch
    assert stats.time_to_target(t, smoothed, 0.5, first_index=1) == 20.0
    assert stats.time_to_target(t, smoothed, 0.5, first_index=2) == 50.0
    assert stats.time_to_target(t, smoothed, 0.8, first_index=2) is None


def test_paired_bootstrap_contains_the_true_difference():
    # Eight seeds; each seed's own difficulty (shared by both entries: the pairing)
    # varies far more than the true difference of 0.05 between the entries.
    rng = np.random.default_rng(1234)
    seed_effect = rng.normal(0.5, 0.2, size=8)
    reference = seed_effect + rng.normal(0.0, 0.01, size=8)
    entry = seed_effect + 0.05 + rng.normal(0.0, 0.01, size=8)
    paired = stats.paired_bootstrap(entry, reference, seed=7)
    assert paired["low"] <= 0.05 <= paired["high"]
    assert paired["low"] > 0.0  # pairing removes the seed effect: the difference is seen
    assert paired["num_seeds"] == 8
    # Unpaired, the same numbers cannot tell the entries apart.
    unpaired_lo = (stats.bootstrap(entry, seed=7)["low"] - stats.bootstrap(reference, seed=7)["high"])
    assert unpaired_lo < 0.0
    with pytest.raises(ValueError):
        stats.paired_bootstrap(entry, reference[:4])


def test_paired_t_interval_beside_the_bootstrap_is_wider_at_four_seeds():
    # Four paired differences (SmolLM2 math, TRL - sync over the range): the
    # percentile bootstrap excludes 0, the t-interval (t975(3) = 3.182) does not.
    diffs = np.array([0.071, 0.057, -0.020, 0.108])
    paired = stats.paired_bootstrap(diffs, np.zeros(4), seed=0)
    half = 3.182 * diffs.std(ddof=1) / 2.0
    assert paired["t_low"] == pytest.approx(diffs.mean() - half, abs=1e-3)
    assert paired["t_high"] == pytest.approx(diffs.mean() + half, abs=1e-3)
    assert paired["low"] > 0.0 > paired["t_low"]
    assert paired["t_high"] > paired["high"]
    # A seed that never reached a target has no t-interval.
    reached = stats.paired_bootstrap([1.0, math.inf], [0.0, 0.0], seed=0)
    assert math.isnan(reached["t_low"]) and math.isnan(reached["t_high"])


def test_bootstrap_of_a_median_with_seeds_that_never_reached():
    result = stats.bootstrap([10.0, 12.0, 11.0, math.inf], np.median, seed=0)
    assert result["estimate"] == 11.5
    assert 10.0 <= result["low"] <= 11.5
    assert result["high"] == math.inf  # resamples with two or more inf
    # Deterministic for a fixed seed.
    assert stats.bootstrap([1.0, 2.0, 3.0], seed=3) == stats.bootstrap([1.0, 2.0, 3.0], seed=3)
