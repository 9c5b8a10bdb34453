"""The statistics of bench/convergence.py, as pure functions over numpy arrays:
learning curves put on a common grid, a t-interval over seeds, the time a curve
first reaches a target, and percentile bootstrap intervals (over seeds, and over
paired seeds for a difference between two entries).

What it deliberately doesn't know: runs, metrics files, entries or plots. Every
function takes arrays and returns numbers, so tests/unit/test_convergence_stats.py
checks each on hand-made input.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from reflow.benchmarks.modes import moving_average

# Student's t, two-sided 95 % (the 0.975 quantile), by degrees of freedom: the
# usual table (no scipy in the venv). Past 30, interpolated linearly in 1/df
# between the rows below and the normal quantile at infinity.
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
         9: 2.262, 10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131,
         16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086, 21: 2.080, 22: 2.074,
         23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048, 29: 2.045,
         30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980}
_Z975 = 1.960


def t975(df: int) -> float:
    """The 0.975 quantile of Student's t with `df` degrees of freedom."""
    if df < 1:
        raise ValueError(f"t975: df must be at least 1, got {df}")
    if df in _T975:
        return _T975[df]
    rows = sorted(_T975) + [None]  # None: infinity
    for lo, hi in zip(rows, rows[1:]):
        if hi is None or lo < df < hi:
            t_lo = _T975[lo]
            t_hi, inv_hi = (_Z975, 0.0) if hi is None else (_T975[hi], 1.0 / hi)
            frac = (1.0 / lo - 1.0 / df) / (1.0 / lo - inv_hi)
            return t_lo + frac * (t_hi - t_lo)
    raise AssertionError("unreachable")


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        for num in (m * (b - m) * x / ((qam + m2) * (a + m2)),
                    -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-14:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """I_x(a, b), the regularized incomplete beta function."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                     + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` degrees of freedom."""
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(q: float, df: int) -> float:
    """The q quantile of Student's t (bisection on t_cdf): any level, so an interval
    can be widened for the number of comparisons a table reads (`corrected_level`)."""
    if df < 1:
        raise ValueError(f"t_quantile: df must be at least 1, got {df}")
    if not 0.0 < q < 1.0:
        raise ValueError(f"t_quantile: q must be in (0, 1), got {q}")
    if q < 0.5:
        return -t_quantile(1.0 - q, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < q:
        hi *= 2.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        lo, hi = (mid, hi) if t_cdf(mid, df) < q else (lo, mid)
        if hi - lo < 1e-12:
            break
    return (lo + hi) / 2.0


def corrected_level(num_comparisons: int, level: float = 0.95) -> float:
    """Bonferroni: a table that reads m intervals gives each 1 - (1 - level)/m, so
    that all m hold together with probability at least `level`."""
    if num_comparisons < 1:
        raise ValueError(f"corrected_level: need at least one comparison, got {num_comparisons}")
    return 1.0 - (1.0 - level) / num_comparisons


def paired_t(values: Sequence[float], reference: Sequence[float],
             level: float = 0.95) -> dict[str, float]:
    """The convention of every learning table: the mean paired difference
    values[k] - reference[k] over seeds k (seed k: the same prompts and sampling
    seed in both entries) and its t-interval at `level`, mean ± t_q(n-1) · s/√n.
    NaN bounds with one pair; a pair with an infinite value (a target never
    reached) gives no interval either."""
    values, reference = np.asarray(values, dtype=float), np.asarray(reference, dtype=float)
    if values.shape != reference.shape or values.ndim != 1 or values.size == 0:
        raise ValueError("paired_t: one value per seed in each, in the same order")
    diff = values - reference
    n = diff.size
    out = {"estimate": float(diff.mean()) if np.all(np.isfinite(diff)) else float("nan"),
           "low": float("nan"), "high": float("nan"), "level": level, "num_seeds": int(n),
           "per_seed": diff.tolist()}
    if n >= 2 and np.all(np.isfinite(diff)):
        half = t_quantile(0.5 + level / 2.0, n - 1) * diff.std(ddof=1) / math.sqrt(n)
        out.update(low=float(diff.mean() - half), high=float(diff.mean() + half))
    return out


def t_interval(values: np.ndarray, axis: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(mean, low, high): the mean over `axis` (the seeds) and its 95 % t-interval,
    mean ± t975(n-1) · s / √n with s the sample standard deviation. With one
    seed there is no interval: low and high are NaN."""
    values = np.asarray(values, dtype=float)
    n = values.shape[axis]
    mean = values.mean(axis=axis)
    if n < 2:
        nan = np.full_like(mean, np.nan)
        return mean, nan, nan
    half = t975(n - 1) * values.std(axis=axis, ddof=1) / np.sqrt(n)
    return mean, mean - half, mean + half


def trailing_mean(values: Sequence[float], window: int) -> np.ndarray:
    """Each step's mean with the `window - 1` steps before it (fewer at the start):
    the smoothing of the modes benchmark (reflow.benchmarks.modes.moving_average)."""
    return np.asarray(moving_average(list(values), window), dtype=float)


def common_grid(xs: Sequence[np.ndarray], num: int = 101) -> np.ndarray:
    """`num` evenly spaced points over the range every curve covers: from the
    latest first x to the earliest last x, so no curve is extrapolated. Empty if
    the curves share no range."""
    lo = max(float(x[0]) for x in xs)
    hi = min(float(x[-1]) for x in xs)
    if hi < lo:
        return np.empty(0)
    if hi == lo:
        return np.array([lo])
    return np.linspace(lo, hi, num)


def interpolate(x: Sequence[float], y: Sequence[float], grid: np.ndarray) -> np.ndarray:
    """y at the grid points, linear between the curve's own points. x must not
    decrease; where it repeats (a step that added nothing to x) the later y counts.
    ValueError for a grid point outside [x[0], x[-1]]: curves are never extrapolated."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if x.size == 0 or x.shape != y.shape:
        raise ValueError("interpolate: x and y must be non-empty and of one length")
    if np.any(np.diff(x) < 0):
        raise ValueError("interpolate: x must not decrease")
    if grid.size and (grid[0] < x[0] - 1e-9 or grid[-1] > x[-1] + 1e-9):
        raise ValueError(f"interpolate: grid [{grid[0]}, {grid[-1]}] outside the curve's "
                         f"[{x[0]}, {x[-1]}]")
    keep = np.append(x[1:] != x[:-1], True)  # the last of each run of equal x
    return np.interp(grid, x[keep], y[keep])


def band(curves: np.ndarray) -> dict[str, list[float]]:
    """Mean and 95 % t-band over seeds of curves on one grid (seeds x points)."""
    mean, lo, hi = t_interval(curves, axis=0)
    return {"mean": mean.tolist(), "low": lo.tolist(), "high": hi.tolist()}


def time_to_target(t: Sequence[float], smoothed: Sequence[float], target: float,
                   first_index: int = 0) -> float | None:
    """The first t at which the smoothed curve reaches `target`, looking only from
    index `first_index` on (where the trailing window is full, so one lucky batch
    does not count); None if it never does."""
    for i in range(first_index, len(smoothed)):
        if smoothed[i] >= target:
            return float(t[i])
    return None


def window_mean(grid: np.ndarray, y: np.ndarray, fraction: float) -> float:
    """The mean of y over the grid points in the last `fraction` of the grid's range."""
    start = grid[-1] - fraction * (grid[-1] - grid[0])
    return float(y[grid >= start - 1e-9].mean())


def area_mean(grid: np.ndarray, y: np.ndarray) -> float:
    """The area under y over the grid (trapezoids) divided by the grid's range: the
    mean reward over the range, in reward units."""
    if grid.size < 2:
        return float(y[0])
    area = float(np.sum((y[1:] + y[:-1]) * np.diff(grid)) / 2.0)
    return area / float(grid[-1] - grid[0])


def bootstrap(values: Sequence[float], statistic: Callable[[np.ndarray], float] = np.mean,
              num_resamples: int = 10_000, seed: int = 0,
              level: float = 0.95) -> dict[str, float]:
    """A statistic over seeds and its percentile bootstrap interval: the seeds are
    resampled with replacement `num_resamples` times. Values may be +inf (a seed
    that never reached a target): quantiles are taken without interpolation
    (inverted CDF), so an interval bound is inf where that many resamples are."""
    values = np.asarray(values, dtype=float)
    if values.size == 0:
        raise ValueError("bootstrap: no values")
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, values.size, size=(num_resamples, values.size))
    with np.errstate(invalid="ignore"):
        stats = np.array([statistic(values[p]) for p in picks])
    tail = (1.0 - level) / 2.0
    lo, hi = np.quantile(stats, [tail, 1.0 - tail], method="inverted_cdf")
    return {"estimate": float(statistic(values)), "low": float(lo), "high": float(hi),
            "num_seeds": int(values.size)}


def paired_bootstrap(values: Sequence[float], reference: Sequence[float],
                     num_resamples: int = 10_000, seed: int = 0,
                     level: float = 0.95) -> dict[str, float]:
    """The mean paired difference values[k] - reference[k] over seeds k (one seed:
    the same prompts and sampling seed in both) and its bootstrap interval, the
    seeds resampled as pairs; beside it ("t_low", "t_high") the paired 95 %
    t-interval of the same differences. With few seeds the percentile bootstrap
    is too narrow (n seeds have few distinct resamples, and it ignores that the
    spread itself is estimated): at 4 seeds read the t-interval."""
    values, reference = np.asarray(values, dtype=float), np.asarray(reference, dtype=float)
    if values.shape != reference.shape:
        raise ValueError("paired_bootstrap: one value per seed in each, in the same order")
    out = bootstrap(values - reference, np.mean, num_resamples, seed, level)
    finite = values - reference
    _, t_low, t_high = t_interval(finite) if np.all(np.isfinite(finite)) else (0, np.nan, np.nan)
    out.update(t_low=float(t_low), t_high=float(t_high))
    return out


# Step-record figures of the off-policy correction, averaged over a run's steps (a
# slice's over the steps that had it), and the largest token lag it trained on.
OFFPOLICY = ("replay_fraction", "clip_fraction", "mismatch_kl", "importance_ess",
             "stale_clip_fraction", "stale_mismatch_kl", "replayed_clip_fraction",
             "replayed_mismatch_kl", "replayed_importance_ess", "entropy")


def offpolicy_means(records: list[dict]) -> dict[str, float]:
    out = {}
    for name in OFFPOLICY:
        values = [float(r[name]) for r in records if name in r]
        if values:
            out[name] = float(np.mean(values))
    lags = [int(r["max_staleness"]) for r in records if "max_staleness" in r]
    if lags:
        out["max_staleness"] = float(max(lags))
    return out
