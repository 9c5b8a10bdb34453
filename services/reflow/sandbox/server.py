"""gRPC transport for the sandbox: proto in, `SandboxService` call, proto out.
Errors are raised; `rpc.ErrorStatus` maps them to status codes (a request the
service refuses, ValueError, is INVALID_ARGUMENT naming the field).

Who may call: a rollout worker, with its pass for the job it names
(reflow.authz). The sandbox keeps no grants (`rpcauth.EVERY_JOB`): it runs a
program and forgets it, so there is no job to start or end here.
"""

from __future__ import annotations

import dataclasses
import logging

import grpc
from pydantic import ValidationError

from reflow import rpc, rpcauth
from reflow.sandbox.service import SandboxService, SandboxStats
from reflow.sandbox.types import ExecLimits, ExecRequest, ExecResult
from reflow.v1 import sandbox_pb2, sandbox_pb2_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = "reflow.v1.Sandbox"
# Every Execute waits for its program (up to its wall-clock limit): all of them
# are long calls, bounded by rpc.LongCallGuard so that health checks always
# find a handler thread.
LONG_METHODS = (f"/{SERVICE_NAME}/Execute",)
# Calls that may wait in the service's line on a handler thread each, at most.
MAX_WAITING_CALLS = 256
# Handler threads no Execute may take: GetStats and health checks.
SHORT_CALL_THREADS = 4


def limits_from_proto(message: sandbox_pb2.ExecLimits) -> ExecLimits:
    """The limits the request sets (an unset one takes its default); ValueError
    naming the field for one out of range."""
    fields = {f.name: getattr(message, f.name) for f in message.DESCRIPTOR.fields
              if message.HasField(f.name)}
    try:
        return ExecLimits.model_validate(fields)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise ValueError(f"limits.{where}: {first['msg']} (got {first.get('input')!r})") from None


def request_from_proto(message: sandbox_pb2.ExecuteRequest) -> ExecRequest:
    return ExecRequest(code=message.code, stdin=message.stdin, files=dict(message.files),
                       limits=limits_from_proto(message.limits))


def result_to_proto(result: ExecResult) -> sandbox_pb2.ExecuteReply:
    return sandbox_pb2.ExecuteReply(status=result.status, exit_code=result.exit_code,
                                    stdout=result.stdout, stderr=result.stderr,
                                    wall_s=result.wall_s, cpu_s=result.cpu_s,
                                    truncated=result.truncated)


def stats_to_proto(stats: SandboxStats) -> sandbox_pb2.SandboxStats:
    return sandbox_pb2.SandboxStats(**dataclasses.asdict(stats))


class SandboxServicer(sandbox_pb2_grpc.SandboxServicer):
    def __init__(self, service: SandboxService) -> None:
        self.service = service

    def Execute(self, request, context):
        return result_to_proto(self.service.execute(request_from_proto(request)))

    def GetStats(self, request, context):
        return stats_to_proto(self.service.stats())


def serve(service: SandboxService, address: str) -> tuple[grpc.Server, int]:
    """Serve `service` at `address`; returns the started server and its port. Its
    metrics are the service's own (`service.metrics`), which `reflow serve`
    exposes."""
    settings = service.settings
    # A handler thread per call running or waiting in the service's line; past
    # them the guard answers RESOURCE_EXHAUSTED at once, as the service does past
    # max_queued, and the client retries.
    long_calls = settings.max_concurrent + min(settings.max_queued, MAX_WAITING_CALLS)
    servicer = SandboxServicer(service)
    return rpc.make_server(
        SERVICE_NAME,
        lambda s: sandbox_pb2_grpc.add_SandboxServicer_to_server(servicer, s),
        address,
        max_workers=long_calls + SHORT_CALL_THREADS,
        max_long_calls=long_calls,
        long_methods=LONG_METHODS,
        grants=rpcauth.EVERY_JOB,
    )
