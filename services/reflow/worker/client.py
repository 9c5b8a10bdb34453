"""How the scheduler reaches an AsyncHybrid worker's role: gRPC, or in process."""

from __future__ import annotations

from reflow.worker.service import RoleStatus


def _from_proto(m) -> RoleStatus:
    return RoleStatus(m.job_id, m.role, m.flips, m.last_flip, m.last_flip_s, m.engine_inflight)


class GrpcWorkerClient:
    def __init__(self, address: str, deadline_s: float = 30.0) -> None:
        from reflow import rpc
        from reflow.v1 import worker_pb2_grpc

        self.address = address
        self.deadline_s = deadline_s
        self._channel = rpc.channel(address, "worker")
        self._stub = worker_pb2_grpc.WorkerStub(self._channel)

    def set_role(self, job_id: str, role: str, drain_timeout_s: float = 60.0,
                 hand_back: bool = False) -> RoleStatus:
        from reflow.v1 import worker_pb2

        m = self._stub.SetRole(worker_pb2.SetRoleRequest(job_id=job_id, role=role,
                                                         drain_timeout_s=drain_timeout_s,
                                                         hand_back=hand_back),
                               timeout=drain_timeout_s + self.deadline_s)
        return _from_proto(m)

    def role(self, job_id: str) -> RoleStatus:
        from reflow.v1 import common_pb2

        return _from_proto(self._stub.GetRole(common_pb2.JobRef(job_id=job_id),
                                              timeout=self.deadline_s))

    def close(self) -> None:
        self._channel.close()


class InprocWorkerClient:
    """The same calls on a HybridWorker in this process (tests)."""

    def __init__(self, worker) -> None:
        self.worker = worker
        self.address = f"inproc-{id(worker):x}"

    def set_role(self, job_id: str, role: str, drain_timeout_s: float = 60.0,
                 hand_back: bool = False) -> RoleStatus:
        return self.worker.set_role(job_id, role, drain_timeout_s, hand_back)

    def role(self, job_id: str) -> RoleStatus:
        return self.worker.role(job_id)
