"""The elastic pool of a simulated job (paper §5): units of
`costs.gpus_per_engine` GPUs, each an engine or a share of the trainer group,
moved by Algorithm 1 (the product's PlacementPlanner, fed by the product's
PlacementFeed from the simulated step records).

A flip is modelled on ElasticPool's protocol (scheduler/elastic.py), whose
threads drive live services: one flip at a time, each taking effect at a sync
boundary. rollout -> trainer: the dispatcher stops routing to the engine
(`set_standby`), the engine finishes what it holds (`cluster.flip_inflight:
finish`; the hand-back of `return` is not modelled), and at the next boundary
after that the unit joins the trainer group, the trainer pausing for
FlipCost.to_trainer_s. trainer -> rollout: at the next boundary the unit leaves
the group, the trainer pausing for FlipCost.to_rollout_s, and the engine is
routed to again after it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from reflow.scheduler.dispatch import Dispatcher
from reflow.sim.costs import FlipCost
from reflow.sim.engine import SimEngine


@dataclass
class _Flip:
    unit: str
    role: str
    reason: str


class SimPool:
    def __init__(self, engines: dict[str, SimEngine], rollout_units: int,
                 dispatcher: Dispatcher, costs: FlipCost) -> None:
        """`engines`: one per unit; the first `rollout_units` start on rollout, the
        rest in the trainer group (out of routing)."""
        self.engines, self.dispatcher, self.costs = engines, dispatcher, costs
        self.roles = {name: ("rollout" if i < rollout_units else "trainer")
                      for i, name in enumerate(engines)}
        self._queue: deque[_Flip] = deque()
        self._admit: list[str] = []  # back on rollout once the trainer's pause is over
        self.flips: list[dict] = []

    @property
    def rollout_units(self) -> list[str]:
        return [n for n, r in self.roles.items() if r == "rollout"]

    @property
    def trainer_units(self) -> int:
        return sum(1 for r in self.roles.values() if r == "trainer")

    @property
    def busy(self) -> bool:
        return bool(self._queue)

    def rebalance(self, rollout_workers: int, reason: str) -> int:
        """ElasticPool.rebalance: toward `rollout_workers` rollout units, the
        highest-numbered moving first; 0 while a flip is under way."""
        if self.busy:
            return 0
        names = list(self.engines)
        delta = rollout_workers - len(self.rollout_units)
        source, target = ("trainer", "rollout") if delta > 0 else ("rollout", "trainer")
        movable = [n for n in reversed(names) if self.roles[n] == source]
        for name in movable[:abs(delta)]:
            self._queue.append(_Flip(name, target, f"placement: {reason}"))
            if target == "trainer":
                # Out of routing at once, so the engine drains while the trainer steps.
                self.dispatcher.set_standby(name, True)
        return min(abs(delta), len(movable))

    def at_boundary(self, now: float) -> float:
        """A sync boundary: carry out the next flip if it is ready (a joining
        engine has finished what it held). Returns the trainer's pause for it."""
        if not self._queue:
            return 0.0
        flip = self._queue[0]
        engine = self.engines[flip.unit]
        if flip.role == "trainer":
            engine.advance_to(now)
            if engine.busy:
                return 0.0  # still draining: the next boundary
            pause = self.costs.to_trainer_s
        else:
            pause = self.costs.to_rollout_s
        self._queue.popleft()
        self.roles[flip.unit] = flip.role
        if flip.role == "rollout":
            self._admit.append(flip.unit)
        self.flips.append({"event": "role_flip", "time_s": round(now, 3), "worker": flip.unit,
                           "to": flip.role, "reason": flip.reason, "flip_s": pause})
        return pause

    def admit(self) -> None:
        """The units that came back to rollout at the last boundary are routed to
        again (called once the flip's pause is over)."""
        for name in self._admit:
            self.dispatcher.set_standby(name, False)
        self._admit.clear()
