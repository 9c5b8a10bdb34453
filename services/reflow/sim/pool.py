"""The elastic pool of a simulated job (paper §5): units of
`costs.gpus_per_engine` GPUs, each an engine or a share of the trainer group,
moved by the product's ElasticPool (scheduler/placement/elastic.py) as Algorithm 1 (its
PlacementPlanner, fed by its PlacementFeed from the simulated step records)
asks.

ElasticPool runs unchanged: its flips are driven by `step()` at the
simulation's events instead of its thread, on the virtual clock. What it calls
is simulated here, as the live services answer:
- a worker's role (worker/client.py): to trainer, the engine's groups in flight
  are handed back to the dispatcher (`cluster.flip_inflight: return`) or left
  to finish (`finish`); the call answers at once and the pool waits for the
  engine to hold nothing, as a live worker's call waits before it answers;
- the leader's membership (trainer/client.py): a change asked for is pending
  until the simulated trainer applies it at its next sync boundary, pausing
  for FlipCost.to_trainer_s (the group grew) or to_rollout_s (it shrank), as
  trainer/membership.py does between steps (with the job's `lora`, the pause's
  state transfer is the adapter's: sim/lora.py).
"""

from __future__ import annotations

from reflow.core.clock import VirtualClock
from reflow.core.errors import FailedPrecondition
from reflow.sim.engine import SimEngine
from reflow.trainer.client import TrainerStatus
from reflow.worker.service import RoleStatus


class SimWorkerClient:
    """An AsyncHybrid worker's role calls (GrpcWorkerClient's), on its SimEngine."""

    def __init__(self, engine: SimEngine, clock: VirtualClock) -> None:
        self.engine, self.clock = engine, clock
        self.current = ""
        self.flips = 0

    def set_role(self, job_id: str, role: str, drain_timeout_s: float = 60.0,
                 hand_back: bool = False) -> RoleStatus:
        self.engine.advance_to(self.clock.now)
        if role == "trainer" and hand_back:
            self.engine.hand_back()
        if self.current and self.current != role:
            self.flips += 1
        self.current = role
        return self.role(job_id)

    def role(self, job_id: str) -> RoleStatus:
        self.engine.advance_to(self.clock.now)
        return RoleStatus(job_id, self.current, self.flips,
                          engine_inflight=self.engine.inflight)


class SimLeader:
    """Trainer rank 0 as ElasticPool reaches it (GrpcTrainerClient's reconfigure
    and status): the simulation's trainer loop applies a pending membership at a
    sync boundary (`take_pending`, then `applied` after the pause)."""

    def __init__(self, job_id: str, peers: list[str]) -> None:
        self.job_id = job_id
        self.peers = list(peers)
        self.pending: list[str] | None = None
        self.epoch = 0
        self.last_regroup_s = 0.0
        self.state = "running"
        self.step = self.version = 0

    def reconfigure(self, job_id: str, peers: list[str] | None,
                    rollout_addresses: list[str] | None = None, scripted_flips: int = 0) -> int:
        if self.state != "running":
            raise FailedPrecondition(f"job {job_id!r} is not training on this trainer")
        if peers is None:  # a scripted flip reported without a membership
            return self.epoch
        self.pending = list(peers)
        return self.epoch + 1

    def status(self, job_id: str, since_step: int = -1) -> TrainerStatus:
        return TrainerStatus(job_id, self.state, self.step, self.version,
                             group_size=1 + len(self.peers), membership_epoch=self.epoch,
                             last_regroup_s=self.last_regroup_s)

    def take_pending(self) -> list[str] | None:
        pending, self.pending = self.pending, None
        return pending

    def applied(self, peers: list[str], regroup_s: float) -> None:
        self.peers, self.last_regroup_s = list(peers), regroup_s
        self.epoch += 1
