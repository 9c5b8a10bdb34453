"""gRPC transport for the replay buffer: proto in, `ReplayStore` call, proto out.
Errors are raised; `rpc.ErrorStatus` maps them to status codes."""

from __future__ import annotations

import dataclasses
import logging
import time

import grpc

from reflow import rpc
from reflow.core.config import ReplayConfig
from reflow.replay.metrics import BufferMetrics
from reflow.replay.store import ReplayStore
from reflow.v1 import common_pb2, replay_pb2, replay_pb2_grpc
from reflow.wire import trajectory_from_proto

logger = logging.getLogger(__name__)

# A Sample call may block this long at most, whatever the client asks, so a
# handler thread is never held indefinitely.
MAX_SAMPLE_WAIT_S = 60.0


class ReplayBufferServicer(replay_pb2_grpc.ReplayBufferServicer):
    def __init__(self, store: ReplayStore, metrics: BufferMetrics | None = None) -> None:
        self.store = store
        self.metrics = metrics or BufferMetrics(store)

    def Configure(self, request, context):
        config = ReplayConfig.model_validate_json(request.replay_config_json)
        self.store.configure(request.job_id, config)
        return common_pb2.Ack(ok=True)

    def Put(self, request, context):
        trajectories = [trajectory_from_proto(t) for t in request.trajectories]
        return replay_pb2.PutReply(accepted=self.store.put(request.job_id, trajectories))

    def Sample(self, request, context):
        start = time.monotonic()
        self.metrics.seen(request.job_id)
        wait_s = min(max(request.timeout_s, 0.0), MAX_SAMPLE_WAIT_S, rpc.wait_budget_s(context))
        batch = self.store.lease_raw(request.job_id, request.batch_size, request.lease_ttl_s,
                                     wait_s)
        if batch is None:
            return replay_pb2.SampleReply()
        if not context.is_active():
            # The trainer gave up waiting; hand the samples straight back.
            self.store.return_lease(request.job_id, batch.lease_id)
            return replay_pb2.SampleReply()
        # Stored bytes go straight into the reply: parsing them is C code; no
        # round trip through Python objects.
        reply = replay_pb2.SampleReply(lease_id=batch.lease_id, policy_version=batch.policy_version)
        for blob, uses in batch.samples:
            m = reply.trajectories.add()
            m.ParseFromString(blob)
            m.uses = uses
        self.metrics.observe_batch(request.job_id, reply.trajectories, batch.policy_version,
                                   time.monotonic() - start)
        return reply

    def Release(self, request, context):
        return replay_pb2.ReleaseReply(released=self.store.release(
            request.job_id, request.lease_id,
            {s.sample_id: dict(s.values) for s in request.stats}))

    def RenewLease(self, request, context):
        return replay_pb2.RenewLeaseReply(renewed=self.store.renew_lease(
            request.job_id, request.lease_id, request.lease_ttl_s))

    def ReturnLease(self, request, context):
        if request.all:
            if request.lease_id:
                raise ValueError("lease_id: leave it empty with all=true")
            returned = self.store.return_all_leases(request.job_id)
        else:
            returned = self.store.return_lease(request.job_id, request.lease_id)
        return replay_pb2.ReturnLeaseReply(returned=returned)

    def AcquireDispatch(self, request, context):
        return replay_pb2.AcquireDispatchReply(granted=self.store.acquire_dispatch(
            request.job_id, request.want, request.group_size, request.outstanding_limit,
            request.version_limit))

    def PublishVersion(self, request, context):
        self.store.publish_version(request.job_id, request.policy_version)
        return common_pb2.Ack(ok=True)

    def GetStats(self, request, context):
        stats = self.store.stats(request.job_id)
        return replay_pb2.BufferStats(**dataclasses.asdict(stats))

    def EndJob(self, request, context):
        self.store.end_job(request.job_id)
        return common_pb2.Ack(ok=True)


SERVICE_NAME = "reflow.v1.ReplayBuffer"
# Sample long-polls for up to MAX_SAMPLE_WAIT_S: bounded by rpc.LongCallGuard.
LONG_METHODS = (f"/{SERVICE_NAME}/Sample",)


def serve(store: ReplayStore, address: str,
          metrics: BufferMetrics | None = None) -> tuple[grpc.Server, int]:
    servicer = ReplayBufferServicer(store, metrics)
    return rpc.make_server(
        SERVICE_NAME,
        lambda s: replay_pb2_grpc.add_ReplayBufferServicer_to_server(servicer, s),
        address,
        # One buffer serves every job of a release, each trainer long-polling.
        max_workers=64,
        max_long_calls=48,
        long_methods=LONG_METHODS,
        # Job grants beside the job's data: they outlive this process (rpcauth). The
        # store's own, so that its EndJob and the authorizer share one cache.
        grants=store.grants,
    )
