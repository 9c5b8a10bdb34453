"""The sandbox over gRPC: `GrpcSandboxClient`, the `SandboxClient` of a process
whose sandbox is a service (REFLOW_SANDBOX_ADDRESS; reflow.sandbox.client).

Calls go over the process's authenticated channel (reflow.rpc.channel): the
deployment credential, the callee checked to hold the `sandbox` role's
certificate under TLS, and the caller's pass for the job the request names
(core.grants.JOB_TOKENS: a rollout worker holds its rollout pass there). An
execution keeps nothing on the server, so a call the sandbox never ran, or
refused for being full, is sent again for up to `retry_s`; after that it
raises `core.errors.Unavailable`, as callers of every client expect.
"""

from __future__ import annotations

import logging
import threading
import time

import grpc

from reflow import rpc
from reflow.core.errors import InvalidArgument, Unavailable
from reflow.sandbox.client import SandboxClient
from reflow.sandbox.service import SandboxStats
from reflow.sandbox.types import ExecRequest, ExecResult
from reflow.v1 import sandbox_pb2, sandbox_pb2_grpc

logger = logging.getLogger(__name__)

# Codes that say the program never ran, or ran where its reply was lost to a
# restart: the call is sent again (running a program twice changes nothing).
RETRIED_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
                 grpc.StatusCode.CANCELLED)


def request_to_proto(request: ExecRequest, job_id: str) -> sandbox_pb2.ExecuteRequest:
    return sandbox_pb2.ExecuteRequest(
        job_id=job_id, code=request.code, stdin=request.stdin, files=request.files,
        limits=sandbox_pb2.ExecLimits(**request.limits.model_dump()))


def result_from_proto(reply: sandbox_pb2.ExecuteReply) -> ExecResult:
    return ExecResult(status=reply.status, exit_code=reply.exit_code, stdout=reply.stdout,
                      stderr=reply.stderr, wall_s=reply.wall_s, cpu_s=reply.cpu_s,
                      truncated=reply.truncated)


class GrpcSandboxClient(SandboxClient):
    """The sandbox service at `address`. Each call's deadline is the program's
    wall-clock limit plus `deadline_s` (a wait for a free slot, the sandbox's
    start, the transfer)."""

    def __init__(self, address: str, deadline_s: float = 30.0, retry_s: float = 60.0) -> None:
        if deadline_s <= 0 or retry_s < 0:
            raise ValueError(f"deadline_s must be > 0 and retry_s >= 0: {deadline_s}, {retry_s}")
        self.address = address
        self.deadline_s = deadline_s
        self.retry_s = retry_s
        self._channel = rpc.channel(address, "sandbox")
        self._stub = sandbox_pb2_grpc.SandboxStub(self._channel)
        self._closed = threading.Event()

    def execute(self, request: ExecRequest, job_id: str = "") -> ExecResult:
        if not job_id:
            # The call is authorized by the caller's pass for a job (reflow.authz).
            raise ValueError("job_id: the sandbox runs programs for a job; give the id of "
                             "the job this worker holds a rollout pass for")
        message = request_to_proto(request, job_id)
        reply = self._call("Execute", message, request.limits.wall_s + self.deadline_s)
        return result_from_proto(reply)

    def stats(self) -> SandboxStats:
        """The service's counters (the scheduler's call: it names no job)."""
        m = self._call("GetStats", sandbox_pb2.SandboxStatsRequest(), self.deadline_s)
        fields = {f: getattr(m, f) for f in SandboxStats.__dataclass_fields__}
        return SandboxStats(**{**fields, "executions_total": dict(m.executions_total)})

    def _call(self, method: str, message, timeout_s: float):
        give_up = time.monotonic() + self.retry_s
        delay = 0.1
        while True:
            if self._closed.is_set():
                raise Unavailable(f"sandbox {self.address}: {method} on a closed client")
            try:
                return getattr(self._stub, method)(message, timeout=timeout_s)
            except ValueError:  # grpc's "Cannot invoke RPC on closed channel!"
                if self._closed.is_set():
                    raise Unavailable(f"sandbox {self.address}: {method} on a closed "
                                      "client") from None
                raise
            except grpc.RpcError as err:
                code = err.code()
                if self._closed.is_set():  # CANCELLED by close() while in flight
                    raise Unavailable(f"sandbox {self.address}: {method} cut short by "
                                      "close()") from None
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise InvalidArgument(err.details()) from None
                if code in RETRIED_CODES and time.monotonic() + delay <= give_up:
                    logger.warning("sandbox %s: %s (%s); retrying", self.address, code.name,
                                   method)
                    self._closed.wait(delay)  # close() ends the wait
                    delay = min(delay * 2, 2.0)
                    continue
                if code in (*RETRIED_CODES, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise Unavailable(f"sandbox {self.address}: {method}: {code.name}: "
                                      f"{err.details()}") from err
                raise

    def close(self) -> None:
        """Ends the channel; a call in flight or in a retry wait raises Unavailable."""
        self._closed.set()
        self._channel.close()
