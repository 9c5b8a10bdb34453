"""Rollout/trainer placement from a producer/consumer model (paper §6.2, Algorithm 1).

Rollout workers produce fresh samples; trainer replicas consume samples (fresh and
replayed). Once per window (one training step) the planner:

1. Estimates the capacity of one rollout worker and one trainer replica from the window,
   with blocked or starved time removed (the paper's idle-ratio correction):
       rollout_capacity = produced / (window_s · rollout_workers · (1 − rollout_blocked_ratio))
       trainer_capacity = consumed / (window_s · trainer_workers · (1 − trainer_idle_ratio))
   A trainer that waited for data is not a slow trainer, and a rollout worker held back by the
   dispatch budget, the staleness bound δ or a weight sync is not a slow producer.
   With `windows` W > 1 the sums run over the last W windows at the current split (samples
   over busy worker-seconds): with long-tailed response lengths one step's window can differ
   from the next by 2×, and a decision on one of them moves the pool back and forth. A
   window at another split starts the count again, since the corrections depend on the split.
2. Extrapolates every feasible split (r, t) of the pool linearly:
       predicted_coverage = r · rollout_capacity / (t · trainer_capacity).
3. Scores it against the target coverage 1 − σ (σ = `replay_cap`, the largest share of a
   batch that may be replayed) by mismatch = |log(predicted_coverage / (1 − σ))|; the log
   makes the score scale-free and penalises under- and over-supply of fresh samples alike.
4. Picks the split of least mismatch and moves only past the cooldown gate (K =
   `cooldown_steps` training steps since the last rebalance) and only when the mismatch drops
   by at least `min_gain`.

The planner owns the arithmetic and the gates, nothing else: it does not know how workers are
started, stopped or re-roled, nor how the measurements were taken. It never changes its own
notion of the current split; the caller reports a carried-out move with `applied()`, and the
next window carries the new split. Standard library only.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, fields

# Ratios a little outside [0, 1] are float noise from summing times; clamp them.
_RATIO_SLACK = 1e-6
# At or past this blocked/idle ratio the busy time is too short to say anything about capacity.
_MAX_UNAVAILABLE_RATIO = 0.999
# Mismatches equal to this many decimals are ties, so float noise does not pick the split.
_TIE_DECIMALS = 9


def _check(ok: bool, field: str, allowed: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{field} must be {allowed}, got {value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_counts(**counts: object) -> None:
    for name, value in counts.items():
        _check(_is_int(value) and value >= 0, name, "an integer >= 0", value)


def _is_number(value: object) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


@dataclass(frozen=True)
class PlacementPolicy:
    replay_cap: float
    """σ in [0, 1): largest share of a batch that may be replayed; target coverage is 1 − σ."""
    cooldown_steps: int
    """K >= 0: training steps that must pass after a rebalance before the next."""
    min_gain: float
    """>= 0: least drop in |log(coverage / target)| worth a move."""
    rollout_unit: int = 1
    """Rollout workers move in multiples of this (tensor-parallel size of one engine)."""
    trainer_unit: int = 1
    """Trainer replicas move in multiples of this (the trainer's group/shard size)."""
    min_rollout: int = 1
    """Never fewer rollout workers than this (at least one is always kept)."""
    min_trainer: int = 1
    """Never fewer trainer replicas than this (at least one is always kept)."""
    windows: int = 1
    """W >= 1: the capacities are estimated over the last W windows at the current split
    (1: the paper's one window)."""

    def __post_init__(self) -> None:
        _check(_is_number(self.replay_cap) and 0 <= self.replay_cap < 1,
               "replay_cap", "a number in [0, 1)", self.replay_cap)
        _check_counts(cooldown_steps=self.cooldown_steps)
        _check(_is_number(self.min_gain) and self.min_gain >= 0,
               "min_gain", "a number >= 0", self.min_gain)
        for name in ("rollout_unit", "trainer_unit"):
            value = getattr(self, name)
            _check(_is_int(value) and value >= 1, name, "an integer >= 1", value)
        _check_counts(min_rollout=self.min_rollout, min_trainer=self.min_trainer)
        _check(_is_int(self.windows) and self.windows >= 1, "windows", "an integer >= 1",
               self.windows)


@dataclass(frozen=True)
class WindowMeasurement:
    step: int
    """Training step that closed the window."""
    window_s: float
    """Wall seconds of the window (> 0)."""
    rollout_workers: int
    trainer_workers: int
    """The split the window ran with."""
    produced_samples: float
    """Fresh samples finished by rollout in the window."""
    consumed_samples: float
    """Samples the trainer trained on in the window (fresh + replayed)."""
    rollout_blocked_ratio: float
    """Share of rollout worker-time blocked by the dispatch budget, staleness bound or weight
    sync (0..1): not lost capacity."""
    trainer_idle_ratio: float
    """Share of trainer time spent waiting (0..1), for a batch or for the rollout workers
    to pause for a weight update: not lost capacity."""

    def __post_init__(self) -> None:
        _check_counts(step=self.step)
        _check(_is_number(self.window_s) and self.window_s > 0,
               "window_s", "a number > 0", self.window_s)
        _check_counts(rollout_workers=self.rollout_workers, trainer_workers=self.trainer_workers)
        for name in ("produced_samples", "consumed_samples"):
            value = getattr(self, name)
            _check(_is_number(value) and value >= 0, name, "a number >= 0", value)
        for name in ("rollout_blocked_ratio", "trainer_idle_ratio"):
            value = getattr(self, name)
            _check(_is_number(value) and -_RATIO_SLACK <= value <= 1 + _RATIO_SLACK,
                   name, "a ratio in [0, 1]", value)
            object.__setattr__(self, name, min(1.0, max(0.0, float(value))))


@dataclass(frozen=True)
class Candidate:
    rollout_workers: int
    trainer_workers: int
    predicted_coverage: float
    """Predicted fresh production / predicted consumption."""
    mismatch: float
    """|log(predicted_coverage / target)|."""


@dataclass(frozen=True)
class PlacementDecision:
    step: int
    action: str
    """"rebalance" or "hold"."""
    reason: str
    """more_rollout, more_trainer, cooldown, gain_below_threshold, already_best,
    no_feasible_split or no_measurement."""
    current: Candidate | None
    chosen: Candidate | None
    """The split to move to on "rebalance", else the best found (None if none was scored)."""
    rollout_capacity: float | None
    """Corrected samples/s per rollout worker; None when the window cannot tell."""
    trainer_capacity: float | None
    """Corrected samples/s per trainer replica; None when the window cannot tell."""
    target_coverage: float
    window: WindowMeasurement | None = None
    """The measurement decided on, so the event can be replayed offline."""
    pooled_windows: int = 1
    """How many windows at the current split the capacities were estimated over."""

    def as_event(self) -> dict:
        """Flat JSON-able dict of inputs and outputs; every key is always present (None when
        unknown) so metrics.jsonl keeps one schema."""
        event: dict = {"step": self.step, "action": self.action, "reason": self.reason,
                       "target_coverage": self.target_coverage,
                       "pooled_windows": self.pooled_windows,
                       "rollout_capacity": self.rollout_capacity,
                       "trainer_capacity": self.trainer_capacity}
        for f in fields(WindowMeasurement):
            if f.name != "step":
                event[f.name] = getattr(self.window, f.name) if self.window else None
        for prefix, candidate in (("current", self.current), ("chosen", self.chosen)):
            for f in fields(Candidate):
                event[f"{prefix}_{f.name}"] = getattr(candidate, f.name) if candidate else None
        event["mismatch_gain"] = (self.current.mismatch - self.chosen.mismatch
                                  if self.current and self.chosen else None)
        return event


def _capacity(windows: Sequence[WindowMeasurement], samples: str, workers: str,
              unavailable_ratio: str) -> float | None:
    """Samples/s of one worker over its busy time in `windows` (fields named by the
    arguments); None when they cannot tell."""
    total = sum(getattr(w, samples) for w in windows)
    worker_s = sum(w.window_s * getattr(w, workers) for w in windows)
    busy_s = sum(w.window_s * getattr(w, workers) * (1.0 - getattr(w, unavailable_ratio))
                 for w in windows)
    if worker_s <= 0 or total <= 0 or busy_s <= worker_s * (1.0 - _MAX_UNAVAILABLE_RATIO):
        return None
    return total / busy_s


class PlacementPlanner:
    """Algorithm 1 of the paper over a fixed pool of `total_workers` workers."""

    def __init__(self, policy: PlacementPolicy, total_workers: int) -> None:
        _check(_is_int(total_workers) and total_workers >= 2,
               "total_workers", "an integer >= 2", total_workers)
        self.policy = policy
        self.total_workers = total_workers
        self.last_rebalance_step: int | None = None
        self.applied_split: tuple[int, int] | None = None
        self._recent: deque[WindowMeasurement] = deque(maxlen=policy.windows)
        p = policy
        self._splits = [(r, total_workers - r) for r in range(1, total_workers)
                        if r % p.rollout_unit == 0 and (total_workers - r) % p.trainer_unit == 0
                        and r >= p.min_rollout and total_workers - r >= p.min_trainer]

    def feasible_splits(self) -> list[tuple[int, int]]:
        """Every (rollout, trainer) that fills the pool and respects units and minimums,
        by rollout count ascending."""
        return list(self._splits)

    def _check_fits(self, rollout_workers: int, trainer_workers: int) -> None:
        # Fewer is allowed (a worker may be restarting); more than the pool is a wiring bug.
        _check(rollout_workers + trainer_workers <= self.total_workers,
               "rollout_workers + trainer_workers", f"<= total_workers ({self.total_workers})",
               rollout_workers + trainer_workers)

    def observe(self, window: WindowMeasurement) -> PlacementDecision:
        """Score every feasible split against this window and say whether to move."""
        current_split = (window.rollout_workers, window.trainer_workers)
        self._check_fits(*current_split)
        target = 1.0 - self.policy.replay_cap
        if self._recent and (self._recent[-1].rollout_workers,
                             self._recent[-1].trainer_workers) != current_split:
            self._recent.clear()
        self._recent.append(window)
        rollout_capacity = _capacity(self._recent, "produced_samples", "rollout_workers",
                                     "rollout_blocked_ratio")
        trainer_capacity = _capacity(self._recent, "consumed_samples", "trainer_workers",
                                     "trainer_idle_ratio")
        pooled = len(self._recent)

        def decide(action: str, reason: str, current: Candidate | None = None,
                   chosen: Candidate | None = None) -> PlacementDecision:
            return PlacementDecision(window.step, action, reason, current, chosen,
                                     rollout_capacity, trainer_capacity, target, window,
                                     pooled)

        if rollout_capacity is None or trainer_capacity is None:
            return decide("hold", "no_measurement")

        def score(rollout: int, trainer: int) -> Candidate:
            coverage = (rollout * rollout_capacity) / (trainer * trainer_capacity)
            return Candidate(rollout, trainer, coverage, abs(math.log(coverage / target)))

        current = score(*current_split)
        if not self._splits:
            return decide("hold", "no_feasible_split", current)

        def rank(c: Candidate) -> tuple:
            # Least mismatch; then the fewest workers changing role; then, of two equally far,
            # the one that does not under-supply fresh samples (that would breach σ); then
            # fewer rollout workers, only so that the choice is deterministic.
            moved = (abs(c.rollout_workers - current_split[0])
                     + abs(c.trainer_workers - current_split[1]))
            return (round(c.mismatch, _TIE_DECIMALS), moved, c.predicted_coverage < target,
                    c.rollout_workers)

        best = min((score(r, t) for r, t in self._splits), key=rank)
        # The cooldown gate counts training steps since the last carried-out rebalance.
        if (self.last_rebalance_step is not None
                and window.step - self.last_rebalance_step < self.policy.cooldown_steps):
            return decide("hold", "cooldown", current, best)
        if (best.rollout_workers, best.trainer_workers) == current_split:
            return decide("hold", "already_best", current, best)
        if current.mismatch - best.mismatch < self.policy.min_gain:
            return decide("hold", "gain_below_threshold", current, best)
        # The chosen split fills the pool, so if rollout does not grow the trainer does.
        reason = "more_rollout" if best.rollout_workers > current_split[0] else "more_trainer"
        return decide("rebalance", reason, current, best)

    def applied(self, step: int, rollout_workers: int, trainer_workers: int) -> None:
        """Record a carried-out rebalance; the cooldown counts from `step`."""
        _check_counts(step=step, rollout_workers=rollout_workers, trainer_workers=trainer_workers)
        self._check_fits(rollout_workers, trainer_workers)
        self.last_rebalance_step = step
        self.applied_split = (rollout_workers, trainer_workers)
