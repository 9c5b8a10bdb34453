"""gRPC transport for the Worker service (an AsyncHybrid worker's role).
Errors are raised; `rpc.ErrorStatus` maps them to status codes."""

from __future__ import annotations

from reflow.v1 import worker_pb2, worker_pb2_grpc
from reflow.worker.service import HybridWorker, RoleStatus


def _to_proto(s: RoleStatus) -> worker_pb2.RoleStatus:
    return worker_pb2.RoleStatus(job_id=s.job_id, role=s.role, flips=s.flips,
                                 last_flip=s.last_flip, last_flip_s=s.last_flip_s,
                                 engine_inflight=s.engine_inflight)


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, worker: HybridWorker) -> None:
        self.worker = worker

    def SetRole(self, request, context):
        return _to_proto(self.worker.set_role(request.job_id, request.role,
                                              request.drain_timeout_s or 60.0,
                                              request.hand_back))

    def GetRole(self, request, context):
        return _to_proto(self.worker.role(request.job_id))


SERVICE_NAME = "reflow.v1.Worker"
# A flip to the trainer role waits for the engine's samples in flight.
LONG_METHODS = (f"/{SERVICE_NAME}/SetRole",)


def register(worker: HybridWorker):
    servicer = WorkerServicer(worker)
    return lambda server: worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
