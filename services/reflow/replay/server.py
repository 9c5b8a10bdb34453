"""gRPC transport for the replay buffer: proto in, `ReplayStore` call, proto out."""

from __future__ import annotations

import dataclasses
import logging

import grpc

from reflow import rpc
from reflow.replay.store import ReplayStore
from reflow.v1 import common_pb2, replay_pb2, replay_pb2_grpc
from reflow.wire import trajectory_from_proto, trajectory_to_proto

logger = logging.getLogger(__name__)

# A Sample call may block this long at most, whatever the client asks, so a
# handler thread is never held indefinitely.
MAX_SAMPLE_WAIT_S = 60.0


class ReplayBufferServicer(replay_pb2_grpc.ReplayBufferServicer):
    def __init__(self, store: ReplayStore) -> None:
        self.store = store

    def Put(self, request, context):
        try:
            trajectories = [trajectory_from_proto(t) for t in request.trajectories]
            return replay_pb2.PutReply(accepted=self.store.put(request.job_id, trajectories))
        except Exception as err:  # noqa: BLE001 - mapped to a status code
            rpc.abort_on(context, err)

    def Sample(self, request, context):
        try:
            wait_s = min(max(request.timeout_s, 0.0), MAX_SAMPLE_WAIT_S)
            batch = self.store.lease(
                request.job_id, request.batch_size, request.lease_ttl_s, wait_s
            )
        except Exception as err:  # noqa: BLE001
            rpc.abort_on(context, err)
        if batch is None:
            return replay_pb2.SampleReply()
        if not context.is_active():
            # The trainer gave up waiting; hand the samples straight back.
            self.store.return_lease(request.job_id, batch.lease_id)
            return replay_pb2.SampleReply()
        return replay_pb2.SampleReply(
            lease_id=batch.lease_id,
            trajectories=[trajectory_to_proto(t) for t in batch.trajectories],
            policy_version=batch.policy_version,
        )

    def Release(self, request, context):
        try:
            return replay_pb2.ReleaseReply(
                released=self.store.release(request.job_id, request.lease_id)
            )
        except Exception as err:  # noqa: BLE001
            rpc.abort_on(context, err)

    def PublishVersion(self, request, context):
        try:
            self.store.publish_version(request.job_id, request.policy_version)
            return common_pb2.Ack(ok=True)
        except Exception as err:  # noqa: BLE001
            rpc.abort_on(context, err)

    def GetStats(self, request, context):
        try:
            stats = self.store.stats(request.job_id)
        except Exception as err:  # noqa: BLE001
            rpc.abort_on(context, err)
        return replay_pb2.BufferStats(**dataclasses.asdict(stats))


def serve(store: ReplayStore, address: str) -> tuple[grpc.Server, int]:
    servicer = ReplayBufferServicer(store)
    return rpc.make_server(
        "reflow.v1.ReplayBuffer",
        lambda s: replay_pb2_grpc.add_ReplayBufferServicer_to_server(servicer, s),
        address,
    )
