"""How other services reach the replay buffer: one interface, a gRPC
implementation for separate processes and an in-process one (over a
`ReplayStore`) for tests and single-process tools."""

from __future__ import annotations

import abc
import logging

from reflow.core.config import ReplayConfig
from reflow.core.types import Batch, Trajectory
from reflow.replay.store import BufferStats, ReplayStore

logger = logging.getLogger(__name__)


class ReplayClient(abc.ABC):
    @abc.abstractmethod
    def configure(self, job_id: str, config: ReplayConfig) -> None: ...

    @abc.abstractmethod
    def put(self, job_id: str, trajectories: list[Trajectory]) -> int: ...

    @abc.abstractmethod
    def sample(self, job_id: str, batch_size: int, lease_ttl_s: float,
               timeout_s: float) -> Batch | None: ...

    @abc.abstractmethod
    def release(self, job_id: str, lease_id: str,
                sample_stats: dict[str, dict[str, float]] | None = None) -> int: ...

    @abc.abstractmethod
    def renew_lease(self, job_id: str, lease_id: str, lease_ttl_s: float) -> bool: ...

    @abc.abstractmethod
    def return_lease(self, job_id: str, lease_id: str) -> int: ...

    @abc.abstractmethod
    def return_all_leases(self, job_id: str) -> int:
        """Every outstanding lease of the job back at once: its trainer leader
        died (a job has one leader at a time, so every lease was that one's)."""

    @abc.abstractmethod
    def acquire_dispatch(self, job_id: str, want: int, group_size: int, outstanding_limit: int,
                         version_limit: int) -> int: ...

    @abc.abstractmethod
    def publish_version(self, job_id: str, policy_version: int) -> None:
        """The job's next policy version (one already published is a no-op); one
        past the next raises core.errors.VersionGap and changes nothing."""

    @abc.abstractmethod
    def stats(self, job_id: str) -> BufferStats: ...

    @abc.abstractmethod
    def end_job(self, job_id: str) -> None:
        """The job ended: the buffer takes its passes no more (its samples stay,
        for a resume). Idempotent."""

    def close(self) -> None:
        """Release transport resources."""


class InprocReplayClient(ReplayClient):
    def __init__(self, store: ReplayStore) -> None:
        self.store = store

    def configure(self, job_id: str, config: ReplayConfig) -> None:
        self.store.configure(job_id, config)

    def put(self, job_id: str, trajectories: list[Trajectory]) -> int:
        return self.store.put(job_id, trajectories)

    def sample(self, job_id: str, batch_size: int, lease_ttl_s: float,
               timeout_s: float) -> Batch | None:
        return self.store.lease(job_id, batch_size, lease_ttl_s, timeout_s)

    def release(self, job_id: str, lease_id: str,
                sample_stats: dict[str, dict[str, float]] | None = None) -> int:
        return self.store.release(job_id, lease_id, sample_stats)

    def renew_lease(self, job_id: str, lease_id: str, lease_ttl_s: float) -> bool:
        return self.store.renew_lease(job_id, lease_id, lease_ttl_s)

    def return_lease(self, job_id: str, lease_id: str) -> int:
        return self.store.return_lease(job_id, lease_id)

    def return_all_leases(self, job_id: str) -> int:
        return self.store.return_all_leases(job_id)

    def acquire_dispatch(self, job_id: str, want: int, group_size: int, outstanding_limit: int,
                         version_limit: int) -> int:
        return self.store.acquire_dispatch(job_id, want, group_size, outstanding_limit,
                                           version_limit)

    def publish_version(self, job_id: str, policy_version: int) -> None:
        self.store.publish_version(job_id, policy_version)

    def stats(self, job_id: str) -> BufferStats:
        return self.store.stats(job_id)

    def end_job(self, job_id: str) -> None:
        self.store.end_job(job_id)


class GrpcReplayClient(ReplayClient):
    """gRPC client. Two layers ride out a buffer that is briefly gone: the channel
    retries UNAVAILABLE for a few seconds (rpc.RETRIED_METHODS says why each method
    may be sent twice), and every call here retries UNAVAILABLE and
    RESOURCE_EXHAUSTED (every long-poll slot busy) for up to `retry_s`, which
    covers a restart of the buffer process. After that a transient failure
    raises `core.errors.Unavailable`, as does a call on (or during) `close()`."""

    def __init__(self, address: str, deadline_s: float = 30.0, retry_s: float = 120.0) -> None:
        import threading

        from reflow import rpc
        from reflow.v1 import replay_pb2_grpc

        self.address = address
        self.deadline_s = deadline_s
        self.retry_s = retry_s
        self._channel = rpc.channel(address, "replay")
        self._stub = replay_pb2_grpc.ReplayBufferStub(self._channel)
        self._closed = threading.Event()

    def _call(self, method: str, request, timeout: float):
        import time

        import grpc

        from reflow.core.errors import Unavailable

        give_up = time.monotonic() + self.retry_s
        delay = 0.1
        while True:
            if self._closed.is_set():
                raise Unavailable(f"replay buffer {self.address}: {method} on a closed client")
            try:
                return getattr(self._stub, method)(request, timeout=timeout)
            except ValueError:  # grpc's "Cannot invoke RPC on closed channel!"
                if self._closed.is_set():
                    raise Unavailable(f"replay buffer {self.address}: {method} on a closed "
                                      "client") from None
                raise
            except grpc.RpcError as err:
                code = err.code()
                if self._closed.is_set():  # CANCELLED by close() while in flight
                    raise Unavailable(f"replay buffer {self.address}: {method} cut short by "
                                      "close()") from None
                # CANCELLED that close() did not cause is the server's: a buffer
                # stopping cancels the calls in flight, so it is a restart like
                # UNAVAILABLE (a put is idempotent by group id).
                retryable = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
                             grpc.StatusCode.CANCELLED)
                if code in retryable and time.monotonic() + delay <= give_up:
                    logger.warning("replay buffer %s: %s (%s); retrying", self.address,
                                   code.name, method)
                    self._closed.wait(delay)  # close() ends the wait
                    delay = min(delay * 2, 2.0)
                    continue
                if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                            grpc.StatusCode.CANCELLED):
                    raise Unavailable(f"replay buffer {self.address}: {method}: {code.name}: "
                                      f"{err.details()}") from err
                raise

    def configure(self, job_id: str, config: ReplayConfig) -> None:
        from reflow.v1 import replay_pb2

        req = replay_pb2.ConfigureRequest(job_id=job_id, replay_config_json=config.model_dump_json())
        self._call("Configure", req, self.deadline_s)

    def put(self, job_id: str, trajectories: list[Trajectory]) -> int:
        from reflow.v1 import replay_pb2
        from reflow.wire import trajectory_to_proto

        req = replay_pb2.PutRequest(
            job_id=job_id, trajectories=[trajectory_to_proto(t) for t in trajectories]
        )
        return self._call("Put", req, self.deadline_s).accepted

    def sample(self, job_id: str, batch_size: int, lease_ttl_s: float,
               timeout_s: float) -> Batch | None:
        from reflow.v1 import replay_pb2
        from reflow.wire import trajectory_from_proto

        req = replay_pb2.SampleRequest(
            job_id=job_id, batch_size=batch_size, lease_ttl_s=lease_ttl_s, timeout_s=timeout_s
        )
        # The server waits up to timeout_s; the deadline leaves room for the transfer.
        reply = self._call("Sample", req, timeout_s + self.deadline_s)
        if not reply.lease_id:
            return None
        return Batch(
            lease_id=reply.lease_id,
            trajectories=[trajectory_from_proto(t) for t in reply.trajectories],
            policy_version=reply.policy_version,
        )

    def release(self, job_id: str, lease_id: str,
                sample_stats: dict[str, dict[str, float]] | None = None) -> int:
        from reflow.v1 import replay_pb2

        stats = [replay_pb2.SampleStats(sample_id=sid, values=values)
                 for sid, values in (sample_stats or {}).items()]
        req = replay_pb2.ReleaseRequest(job_id=job_id, lease_id=lease_id, stats=stats)
        return self._call("Release", req, self.deadline_s).released

    def renew_lease(self, job_id: str, lease_id: str, lease_ttl_s: float) -> bool:
        from reflow.v1 import replay_pb2

        req = replay_pb2.RenewLeaseRequest(job_id=job_id, lease_id=lease_id,
                                           lease_ttl_s=lease_ttl_s)
        return self._call("RenewLease", req, self.deadline_s).renewed

    def return_lease(self, job_id: str, lease_id: str) -> int:
        from reflow.v1 import replay_pb2

        req = replay_pb2.ReturnLeaseRequest(job_id=job_id, lease_id=lease_id)
        return self._call("ReturnLease", req, self.deadline_s).returned

    def return_all_leases(self, job_id: str) -> int:
        from reflow.v1 import replay_pb2

        req = replay_pb2.ReturnLeaseRequest(job_id=job_id, all=True)
        return self._call("ReturnLease", req, self.deadline_s).returned

    def acquire_dispatch(self, job_id: str, want: int, group_size: int, outstanding_limit: int,
                         version_limit: int) -> int:
        # A grant whose reply is lost stays counted: the budget then errs toward
        # dispatching less, never more.
        from reflow.v1 import replay_pb2

        req = replay_pb2.AcquireDispatchRequest(
            job_id=job_id, want=want, group_size=group_size,
            outstanding_limit=outstanding_limit, version_limit=version_limit)
        return self._call("AcquireDispatch", req, self.deadline_s).granted

    def publish_version(self, job_id: str, policy_version: int) -> None:
        import grpc

        from reflow.core.errors import VersionGap
        from reflow.v1 import replay_pb2

        req = replay_pb2.PublishVersionRequest(job_id=job_id, policy_version=policy_version)
        try:
            self._call("PublishVersion", req, self.deadline_s)
        except grpc.RpcError as err:
            # The buffer's one refusal of a well-formed publish: a skipped version.
            if err.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise VersionGap(err.details()) from None
            raise

    def stats(self, job_id: str) -> BufferStats:
        from reflow.v1 import common_pb2

        m = self._call("GetStats", common_pb2.JobRef(job_id=job_id), self.deadline_s)
        return BufferStats(**{f: getattr(m, f) for f in BufferStats.__dataclass_fields__})

    def end_job(self, job_id: str) -> None:
        from reflow.v1 import common_pb2

        self._call("EndJob", common_pb2.JobRef(job_id=job_id), self.deadline_s)

    def close(self) -> None:
        """Ends the channel; a call in flight or in a retry wait raises Unavailable."""
        self._closed.set()
        self._channel.close()
