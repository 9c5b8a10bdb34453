"""gRPC transport for the scheduler.
Errors are raised; `rpc.ErrorStatus` maps them to status codes.

A standby scheduler (one waiting on the leader Lease) serves from the start, so
its pod passes its probes and a rolling update can count it ready, but it has
no core yet: every call is refused UNAVAILABLE, which callers retry, until
`activate` gives it one (the scheduler Service routes to the leader's pod alone,
so few calls reach it)."""

from __future__ import annotations

import json

import grpc

from reflow import rpc
from reflow.core.errors import Unavailable
from reflow.scheduler.jobcontrol.jobs import JobRecord
from reflow.scheduler.jobcontrol.service import Scheduler
from reflow.v1 import scheduler_pb2, scheduler_pb2_grpc


def record_to_proto(r: JobRecord) -> scheduler_pb2.JobStatus:
    return scheduler_pb2.JobStatus(
        job_id=r.job_id, phase=r.phase, reason=r.reason, step=r.step, num_steps=r.num_steps,
        policy_version=r.policy_version, reward_mean=r.reward_mean,
        trainer_tokens_per_s=r.trainer_tokens_per_s, created_at=r.created_at,
        started_at=r.started_at, finished_at=r.finished_at, run_dir=r.run_dir, name=r.name,
        workers=[scheduler_pb2.RoleWorkers(role=role, names=names)
                 for role, names in sorted(r.workers.items())],
    )


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, scheduler: Scheduler | None) -> None:
        self._scheduler = scheduler

    @property
    def scheduler(self) -> Scheduler:
        if self._scheduler is None:
            raise Unavailable("this scheduler is a standby: another one holds the leader "
                              "lease; retry (the scheduler Service routes to the leader)")
        return self._scheduler

    def SubmitJob(self, request, context):
        record, created = self.scheduler.submit(request.spec_json, request.job_id,
                                                request.run_dir)
        return scheduler_pb2.SubmitJobReply(job=record_to_proto(record), created=created)

    def GetJob(self, request, context):
        return record_to_proto(self.scheduler.get(request.job_id))

    def StopJob(self, request, context):
        return record_to_proto(self.scheduler.stop(request.job_id))

    def ResumeJob(self, request, context):
        return record_to_proto(self.scheduler.resume(request.job_id))

    def ListJobs(self, request, context):
        records, token = self.scheduler.list(request.limit or 100, request.page_token)
        return scheduler_pb2.ListJobsReply(jobs=[record_to_proto(r) for r in records],
                                           next_page_token=token)

    def GetJobLogs(self, request, context):
        logs = self.scheduler.logs(request.job_id, request.service,
                                   request.tail_bytes or 65536)
        return scheduler_pb2.JobLogsReply(logs=[
            scheduler_pb2.ServiceLog(service=l.service, text=l.text, truncated=l.truncated)
            for l in logs
        ])

    def GetJobMetrics(self, request, context):
        records = self.scheduler.metrics(request.job_id, request.since_step,
                                         request.limit or 1000)
        return scheduler_pb2.JobMetricsReply(records_json=[json.dumps(r) for r in records])

    def RequestFlip(self, request, context):
        queued = self.scheduler.request_flip(request.job_id, request.worker, request.role)
        return scheduler_pb2.FlipReply(queued_before=queued)


SERVICE_NAME = "reflow.v1.Scheduler"
# StopJob waits for the job's services to stop: bounded by rpc.LongCallGuard.
LONG_METHODS = (f"/{SERVICE_NAME}/StopJob",)


def serve(scheduler: Scheduler | None, address: str) -> tuple[grpc.Server, int]:
    """Serve `scheduler`; None serves a standby until `activate`."""
    servicer = SchedulerServicer(scheduler)
    server, port = rpc.make_server(
        SERVICE_NAME,
        lambda s: scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, s),
        address,
        long_methods=LONG_METHODS,
        serving=scheduler is not None,
    )
    server.scheduler_servicer = servicer
    return server, port


def activate(server: grpc.Server, scheduler: Scheduler) -> None:
    """A standby won the lease: it serves `scheduler` from now on."""
    server.scheduler_servicer._scheduler = scheduler
    rpc.set_serving(server, (SERVICE_NAME,))
