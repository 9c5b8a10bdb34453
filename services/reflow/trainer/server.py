"""gRPC transport for the trainer service.
Errors are raised; `rpc.ErrorStatus` maps them to status codes."""

from __future__ import annotations

import json

import grpc

from reflow import rpc
from reflow.core.config import JobSpec
from reflow.trainer.service import TrainerService
from reflow.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    def __init__(self, service: TrainerService) -> None:
        self.service = service

    def StartJob(self, request, context):
        spec = JobSpec.model_validate_json(request.spec_json)
        self.service.start_job(request.job_id, spec, request.replay_address,
                               list(request.rollout_addresses), request.run_dir,
                               list(request.trainer_peers), request.leader_host,
                               request.resume_from)
        return common_pb2.Ack(ok=True)

    def StopJob(self, request, context):
        self.service.stop_job(request.job_id)
        return common_pb2.Ack(ok=True)

    def GetStatus(self, request, context):
        s = self.service.status(request.job_id, request.since_step)
        return trainer_pb2.TrainerStatus(
            job_id=s["job_id"], state=s["state"], step=s["step"],
            policy_version=s["policy_version"],
            last_metrics_json=json.dumps(s["last_metrics"]), error=s["error"],
            metrics_json=[json.dumps(r) for r in s["metrics"]],
            group_size=s["group_size"], membership_epoch=s["membership_epoch"],
            last_regroup_s=s["last_regroup_s"], last_state_handoff=s["last_state_handoff"],
        )

    def Reconfigure(self, request, context):
        peers = None if request.keep_peers else list(request.trainer_peers)
        epoch = self.service.reconfigure(request.job_id, peers,
                                         list(request.rollout_addresses),
                                         scripted_flips=request.scripted_flips)
        return trainer_pb2.ReconfigureReply(membership_epoch=epoch)

    def JoinGroup(self, request, context):
        self.service.join_group(request.job_id, request.master_port, request.rank,
                                request.world_size, request.membership_epoch,
                                request.rendezvous_key)
        return common_pb2.Ack(ok=True)

    def LeaveGroup(self, request, context):
        self.service.leave_group(request.job_id, request.membership_epoch)
        return common_pb2.Ack(ok=True)


SERVICE_NAME = "reflow.v1.Trainer"
# Calls that wait on the train loop: bounded by rpc.LongCallGuard.
LONG_METHODS = tuple(f"/{SERVICE_NAME}/{m}" for m in ("StartJob", "StopJob"))


def register(service: TrainerService):
    """Adds the trainer servicer to a server (alone, or beside the rollout in a worker)."""
    servicer = TrainerServicer(service)
    return lambda server: trainer_pb2_grpc.add_TrainerServicer_to_server(servicer, server)


def serve(service: TrainerService, address: str) -> tuple[grpc.Server, int]:
    return rpc.make_server(SERVICE_NAME, register(service), address, long_methods=LONG_METHODS)
