"""Each training step's record as Algorithm 1's window (paper §6.2), and the
planner's decision carried out (an elastic pool's role flips) or recorded.

The window's rollout blocked ratio is the share of rollout worker-time held back
by the dispatch budget, the staleness bound δ or a weight sync, which the
planner removes from the rollout capacity estimate (a producer held back is not
a slow producer): the dispatcher's blocked worker-seconds over the window
(`Dispatcher.blocked_worker_seconds`), plus the step's weight sync, during which
every engine pauses to load. It is not the rollout idle ratio: an engine can idle
because the job has not routed to it yet, and one can be held below its cap
while it still runs.

The scheduler's job watcher feeds it the records it polls from the trainer; the
simulator (reflow/sim) feeds it its own, on its virtual clock.
"""

from __future__ import annotations

import logging
from typing import Protocol

from reflow.core.config import JobSpec
from reflow.scheduler.placement.planner import PlacementPlanner, PlacementPolicy, WindowMeasurement

logger = logging.getLogger(__name__)


def planner_for(spec: JobSpec, total_workers: int) -> PlacementPlanner | None:
    """Algorithm 1's planner for a job of `total_workers` workers (paper §6.2), when
    its placement is on and the pool has a split to choose."""
    if not spec.scheduler.enabled("placement") or total_workers < 2:
        return None
    # An hsdp trainer group moves by whole replicas and keeps one (elastic.py).
    unit = spec.trainer.shard_size or 1
    policy = PlacementPolicy(replay_cap=spec.replay.replay_cap,
                             cooldown_steps=spec.scheduler.placement_cooldown_steps,
                             min_gain=spec.scheduler.placement_min_gain,
                             windows=spec.scheduler.placement_windows,
                             trainer_unit=unit, min_trainer=unit)
    return PlacementPlanner(policy, total_workers)


class Rebalancer(Protocol):
    def rebalance(self, rollout_workers: int, reason: str) -> int:
        """Move toward `rollout_workers` rollout workers; the flips requested."""


class PlacementFeed:
    def __init__(self, planner: PlacementPlanner, dispatcher,
                 pool: Rebalancer | None = None) -> None:
        """`dispatcher`: the job's Dispatcher (its blocked time, its counters and
        event log); `pool` carries a rebalance out (None: fixed roles, recorded
        with carried_out false)."""
        self.planner, self.dispatcher, self.pool = planner, dispatcher, pool
        self._blocked_mark = dispatcher.blocked_worker_seconds()

    def window(self, m: dict, blocked_worker_s: float) -> WindowMeasurement:
        """Algorithm 1's window for one step record; `blocked_worker_s` the
        dispatcher's blocked worker-seconds during that step."""
        step_s = float(m["step_time_s"])
        rollout_workers = int(m.get("rollout_workers", 1))
        sync_s = max(0.0, float(m.get("weight_sync_s", 0.0)))
        blocked = blocked_worker_s + sync_s * rollout_workers
        return WindowMeasurement(
            step=int(m["step"]), window_s=step_s, rollout_workers=rollout_workers,
            trainer_workers=int(m.get("trainer_workers", 1)),
            produced_samples=float(m["generated_samples"]),
            consumed_samples=float(m["fresh_samples"] + m["stale_samples"]
                                   + m["replay_samples"]),
            rollout_blocked_ratio=min(1.0, blocked / (step_s * max(1, rollout_workers))),
            trainer_idle_ratio=min(1.0, float(m["trainer_idle_ratio"])))

    def observe(self, records: list[dict]) -> None:
        """Decide on each new step record, in order; adds the decision's fields to
        the record. The dispatcher's blocked time since the last call is shared out
        over the records by their step times (a poll can bring several steps)."""
        usable = [m for m in records
                  if "generated_samples" in m and float(m.get("step_time_s", 0)) > 0]
        now = self.dispatcher.blocked_worker_seconds()
        blocked, self._blocked_mark = max(0.0, now - self._blocked_mark), now
        span = sum(float(m["step_time_s"]) for m in usable)
        for m in usable:
            try:
                window = self.window(m, blocked * float(m["step_time_s"]) / span)
            except (KeyError, TypeError, ValueError) as err:
                # A step record Algorithm 1 cannot use is skipped, never fatal.
                logger.warning("placement skipped step %s: %s", m.get("step"), err)
                continue
            m["rollout_blocked_ratio"] = window.rollout_blocked_ratio
            self._decide(window, m)

    def resize(self, total_workers: int) -> None:
        """The job's workers changed (a fixed-role job grew, or gave one back;
        jobcontrol/resize.py): Algorithm 1 plans over the new pool from here, its
        windows begun afresh."""
        if total_workers != self.planner.total_workers:
            self.planner = PlacementPlanner(self.planner.policy, total_workers)

    def _decide(self, window: WindowMeasurement, m: dict) -> None:
        try:
            decision = self.planner.observe(window)
        except ValueError as err:
            # A step trained before the pool shrank counts more workers than it has.
            logger.warning("placement skipped step %s: %s", window.step, err)
            return
        carried_out = False
        if decision.action == "rebalance":
            self.dispatcher.placement_recommendations[decision.reason] += 1
            if self.pool is not None and decision.chosen is not None and self.pool.rebalance(
                    decision.chosen.rollout_workers, decision.reason):
                carried_out = True
                self.dispatcher.rebalances[decision.reason] += 1
                self.planner.applied(window.step, decision.chosen.rollout_workers,
                                     decision.chosen.trainer_workers)
        self.dispatcher.record({"event": "placement", **decision.as_event(),
                                "carried_out": carried_out})
        m["placement_action"], m["placement_reason"] = decision.action, decision.reason
        m["placement_carried_out"] = carried_out
        if decision.current is not None:
            m["placement_predicted_coverage"] = decision.current.predicted_coverage
