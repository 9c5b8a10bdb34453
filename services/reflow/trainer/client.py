"""How the scheduler reaches a trainer (gRPC)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class TrainerStatus:
    job_id: str
    state: str
    step: int
    policy_version: int
    last_metrics: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    # Per-step records after the requested since_step, oldest first.
    metrics: list[dict[str, Any]] = field(default_factory=list)
    # The data-parallel group: replicas in it, membership epoch in force, and
    # how long its last rebuild took.
    group_size: int = 1
    membership_epoch: int = 0
    last_regroup_s: float = 0.0
    last_state_handoff: str = ""


class GrpcTrainerClient:
    def __init__(self, address: str, deadline_s: float = 30.0) -> None:
        from reflow import rpc
        from reflow.v1 import trainer_pb2_grpc

        self.address = address
        self.deadline_s = deadline_s
        self._channel = rpc.channel(address, "trainer")
        self._stub = trainer_pb2_grpc.TrainerStub(self._channel)

    def start_job(self, job_id: str, spec_json: str, replay_address: str,
                  rollout_addresses: list[str], run_dir: str = "",
                  trainer_peers: list[str] | None = None, leader_host: str = "",
                  resume_from: str = "") -> None:
        """With `leader_host`: load a warm replica of the job's trainer group;
        `resume_from`: a checkpoint directory name under the run's checkpoints."""
        from reflow.v1 import common_pb2

        req = common_pb2.StartJobRequest(
            job_id=job_id, spec_json=spec_json, replay_address=replay_address,
            rollout_addresses=rollout_addresses, run_dir=run_dir,
            trainer_peers=trainer_peers or [], leader_host=leader_host,
            resume_from=resume_from,
        )
        self._stub.StartJob(req, timeout=self.deadline_s)

    def stop_job(self, job_id: str, deadline_s: float = 60.0) -> None:
        from reflow.v1 import common_pb2

        self._stub.StopJob(common_pb2.JobRef(job_id=job_id), timeout=deadline_s)

    def status(self, job_id: str = "", since_step: int = -1) -> TrainerStatus:
        """since_step >= 0 also fetches the per-step records after that step."""
        from reflow import rpc
        from reflow.v1 import trainer_pb2

        req = trainer_pb2.TrainerStatusRequest(job_id=job_id, since_step=since_step)
        # Polled every second: a transient failure raises core.errors.Unavailable.
        with rpc.transient_as_unavailable(f"trainer {self.address}: GetStatus"):
            m = self._stub.GetStatus(req, timeout=self.deadline_s)
        return TrainerStatus(m.job_id, m.state, m.step, m.policy_version,
                             json.loads(m.last_metrics_json or "{}"), m.error,
                             [json.loads(r) for r in m.metrics_json],
                             m.group_size, m.membership_epoch, m.last_regroup_s,
                             m.last_state_handoff)

    def reconfigure(self, job_id: str, trainer_peers: list[str] | None,
                    rollout_addresses: list[str] | None = None,
                    scripted_flips: int = 0) -> int:
        """Leader: the group's next replicas (None: unchanged; and, given, the
        engines it publishes to from now on); `scripted_flips`: how many of the
        spec's cluster.flips are carried out or refused by now. Returns the epoch
        the replicas take effect as."""
        from reflow.v1 import trainer_pb2

        req = trainer_pb2.ReconfigureRequest(job_id=job_id, trainer_peers=trainer_peers or [],
                                             keep_peers=trainer_peers is None,
                                             rollout_addresses=rollout_addresses or [],
                                             scripted_flips=scripted_flips)
        return self._stub.Reconfigure(req, timeout=self.deadline_s).membership_epoch

    def join_group(self, job_id: str, master_port: int, rank: int, world_size: int,
                   membership_epoch: int, rendezvous_key: str) -> None:
        from reflow.v1 import trainer_pb2

        req = trainer_pb2.JoinGroupRequest(job_id=job_id, master_port=master_port, rank=rank,
                                           world_size=world_size,
                                           membership_epoch=membership_epoch,
                                           rendezvous_key=rendezvous_key)
        self._stub.JoinGroup(req, timeout=self.deadline_s)

    def leave_group(self, job_id: str, membership_epoch: int) -> None:
        from reflow.v1 import trainer_pb2

        from reflow import rpc

        req = trainer_pb2.LeaveGroupRequest(job_id=job_id, membership_epoch=membership_epoch)
        # A replica whose worker died does not answer: core.errors.Unavailable.
        with rpc.transient_as_unavailable(f"trainer {self.address}: LeaveGroup"):
            self._stub.LeaveGroup(req, timeout=self.deadline_s)

    def close(self) -> None:
        self._channel.close()
