"""How the API and the CLI reach the scheduler (gRPC)."""

from __future__ import annotations

import functools
import json

import grpc

from reflow.core.errors import (
    Conflict, FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, Unavailable,
)
from reflow.scheduler.jobcontrol.jobs import JobRecord
from reflow.scheduler.cluster.local import ServiceLog


def _translate(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except grpc.RpcError as err:
            code, details = err.code(), err.details()
            if code == grpc.StatusCode.NOT_FOUND:
                raise NotFound(details) from None
            if code == grpc.StatusCode.ALREADY_EXISTS:
                raise Conflict(details) from None
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidArgument(details) from None
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise ResourceExhausted(details) from None
            if code == grpc.StatusCode.FAILED_PRECONDITION:
                raise FailedPrecondition(details) from None
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise Unavailable(f"scheduler unavailable: {details}") from None
            raise
    return wrapper


def _from_proto(m) -> JobRecord:
    return JobRecord(
        job_id=m.job_id, name=m.name, spec_json="", phase=m.phase, reason=m.reason,
        step=m.step, num_steps=m.num_steps, policy_version=m.policy_version,
        reward_mean=m.reward_mean, trainer_tokens_per_s=m.trainer_tokens_per_s,
        created_at=m.created_at, started_at=m.started_at, finished_at=m.finished_at,
        run_dir=m.run_dir, workers={w.role: list(w.names) for w in m.workers},
    )


class GrpcSchedulerClient:
    def __init__(self, address: str, deadline_s: float = 30.0) -> None:
        from reflow import rpc
        from reflow.v1 import scheduler_pb2_grpc

        self.address = address
        self.deadline_s = deadline_s
        self._channel = rpc.channel(address, "scheduler")
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)

    @_translate
    def submit(self, spec_json: str, job_id: str = "", run_dir: str = "") -> tuple[JobRecord, bool]:
        """(job, created): created is False when job_id named an existing job with
        the same spec (an idempotent retry)."""
        from reflow.v1 import scheduler_pb2

        req = scheduler_pb2.SubmitJobRequest(job_id=job_id, spec_json=spec_json, run_dir=run_dir)
        reply = self._stub.SubmitJob(req, timeout=self.deadline_s)
        return _from_proto(reply.job), reply.created

    @_translate
    def get(self, job_id: str) -> JobRecord:
        from reflow.v1 import common_pb2

        return _from_proto(self._stub.GetJob(common_pb2.JobRef(job_id=job_id), timeout=self.deadline_s))

    @_translate
    def stop(self, job_id: str, deadline_s: float = 90.0) -> JobRecord:
        from reflow.v1 import common_pb2

        return _from_proto(self._stub.StopJob(common_pb2.JobRef(job_id=job_id), timeout=deadline_s))

    @_translate
    def resume(self, job_id: str) -> JobRecord:
        """Continue a stopped or failed job from its newest committed checkpoint."""
        from reflow.v1 import common_pb2

        return _from_proto(self._stub.ResumeJob(common_pb2.JobRef(job_id=job_id),
                                                timeout=self.deadline_s))

    @_translate
    def list(self, limit: int = 100,  # nosec B107 # page_token is a cursor, not a secret
             page_token: str = "") -> tuple[list[JobRecord], str]:
        """One page, newest first, and the token of the next page ("" on the last)."""
        from reflow.v1 import scheduler_pb2

        req = scheduler_pb2.ListJobsRequest(limit=limit, page_token=page_token)
        reply = self._stub.ListJobs(req, timeout=self.deadline_s)
        return [_from_proto(m) for m in reply.jobs], reply.next_page_token

    @_translate
    def logs(self, job_id: str, service: str = "", tail_bytes: int = 65536) -> list[ServiceLog]:
        from reflow.v1 import scheduler_pb2

        req = scheduler_pb2.JobLogsRequest(job_id=job_id, service=service, tail_bytes=tail_bytes)
        reply = self._stub.GetJobLogs(req, timeout=self.deadline_s)
        return [ServiceLog(l.service, l.text, l.truncated) for l in reply.logs]

    @_translate
    def metrics(self, job_id: str, since_step: int = 0, limit: int = 1000) -> list[dict]:
        from reflow.v1 import scheduler_pb2

        req = scheduler_pb2.JobMetricsRequest(job_id=job_id, since_step=since_step, limit=limit)
        reply = self._stub.GetJobMetrics(req, timeout=self.deadline_s)
        return [json.loads(r) for r in reply.records_json]

    @_translate
    def request_flip(self, job_id: str, worker: int, role: str) -> int:
        """Move a worker of an elastic job to `role` at the next sync boundary;
        returns the flips queued before this one."""
        from reflow.v1 import scheduler_pb2

        req = scheduler_pb2.FlipRequest(job_id=job_id, worker=worker, role=role)
        return self._stub.RequestFlip(req, timeout=self.deadline_s).queued_before

    def close(self) -> None:
        self._channel.close()
