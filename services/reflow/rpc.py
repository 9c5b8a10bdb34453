"""gRPC plumbing shared by every service: servers with health checking,
channels with sane limits, and deadlines on every call.

Servers here are synchronous `grpc.server` with a thread pool: every handler
is short (a Redis call, a queue hand-off), and the long-running work (vLLM,
training) lives on its own threads behind the core objects.
"""

from __future__ import annotations

import logging
from concurrent import futures
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

logger = logging.getLogger(__name__)

# Batches of trajectories can exceed gRPC's 4 MiB default.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
]
DEFAULT_DEADLINE_S = 30.0


def make_server(
    service_name: str | tuple[str, ...],
    register: Callable[[grpc.Server], None],
    address: str,
    max_workers: int = 16,
) -> tuple[grpc.Server, int]:
    """Build a server with the grpc.health.v1 service; returns it and the bound port.
    Several service names: one server hosts them all (the AsyncHybrid worker)."""
    names = (service_name,) if isinstance(service_name, str) else service_name
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=names[0]),
        options=CHANNEL_OPTIONS,
    )
    register(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"{'+'.join(names)}: cannot bind {address}")
    server.start()
    for name in ("", *names):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    logger.info("%s serving gRPC on port %d", "+".join(names), port)
    return server, port


def channel(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)


def wait_healthy(address: str, timeout_s: float, service: str = "") -> None:
    """Block until the server at `address` reports SERVING, or raise TimeoutError."""
    import time

    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    with channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError as err:
                last = err
            time.sleep(0.2)
    raise TimeoutError(f"{address} did not become healthy in {timeout_s:.0f}s: {last}")


def abort_on(context: grpc.ServicerContext, err: Exception) -> None:
    """Map a core exception to a status code: user errors are INVALID_ARGUMENT,
    a missing job NOT_FOUND, a clash ALREADY_EXISTS, anything else INTERNAL."""
    from reflow.core.errors import Conflict

    if isinstance(err, KeyError):  # str(KeyError) would quote the message
        context.abort(grpc.StatusCode.NOT_FOUND, str(err.args[0]) if err.args else "not found")
    if isinstance(err, Conflict):
        context.abort(grpc.StatusCode.ALREADY_EXISTS, str(err))
    if isinstance(err, ValueError):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
    logger.exception("internal error in handler")
    context.abort(grpc.StatusCode.INTERNAL, f"{type(err).__name__}: {err}")
