"""gRPC plumbing shared by every service: servers with health checking,
channels with sane limits, and deadlines on every call.

Servers here are synchronous `grpc.server` with a thread pool. Most handlers
are short (a Redis call, a queue hand-off); the long-running work (vLLM,
training) lives on its own threads behind the core objects. A few calls wait
for such work (a weight update, a batch long-poll): those are named as long
methods, wait no longer than the caller's deadline, and may hold at most
`MAX_LONG_CALLS` of the `MAX_WORKERS` handler threads at once, so short calls
and grpc.health.v1 (what Kubernetes probes) always find a free thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from concurrent import futures

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
MAX_WORKERS = 16
MAX_LONG_CALLS = 8
# The longest any handler waits, whatever deadline the caller set (or none).
MAX_HANDLER_WAIT_S = 600.0


class LongCallGuard(grpc.ServerInterceptor):
    """Lets at most `limit` calls of the named long methods run at once; one more
    is answered RESOURCE_EXHAUSTED at once instead of taking a handler thread
    for the length of its wait."""

    def __init__(self, long_methods: Iterable[str], limit: int) -> None:
        self.long_methods = frozenset(long_methods)
        self.limit = limit
        self._slots = threading.BoundedSemaphore(limit)
        self._lock = threading.Lock()
        self.in_flight = 0

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method not in self.long_methods or handler.unary_unary is None:
            return handler
        inner = handler.unary_unary

        def guarded(request, context):
            if not self._slots.acquire(blocking=False):
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"{method}: {self.limit} long calls are already in progress "
                              "on this server; retry later")
            with self._lock:
                self.in_flight += 1
            try:
                return inner(request, context)
            finally:
                with self._lock:
                    self.in_flight -= 1
                self._slots.release()

        return grpc.unary_unary_rpc_method_handler(
            guarded, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)


def wait_budget_s(context: grpc.ServicerContext, cap_s: float = MAX_HANDLER_WAIT_S) -> float:
    """How long a handler may wait on long work: the caller's remaining deadline
    less a margin for the reply, never more than `cap_s`."""
    remaining = context.time_remaining()
    if remaining is None:
        return cap_s
    return max(0.0, min(cap_s, remaining - 0.05))


def make_server(
    service_name: str | tuple[str, ...],
    register: Callable[[grpc.Server], None],
    address: str,
    max_workers: int = MAX_WORKERS,
    long_methods: Iterable[str] = (),
    max_long_calls: int | None = None,
) -> tuple[grpc.Server, int]:
    """Build a server with the grpc.health.v1 service; returns it and the bound port.
    Several service names: one server hosts them all (the AsyncHybrid worker).
    `long_methods` ("/pkg.Service/Method") share `max_long_calls` handler threads
    (default `MAX_LONG_CALLS`, at most half the pool)."""
    names = (service_name,) if isinstance(service_name, str) else service_name
    limit = max_long_calls or min(MAX_LONG_CALLS, max_workers // 2)
    if not 1 <= limit < max_workers:
        raise ValueError(f"max_long_calls must leave handler threads free: {limit}/{max_workers}")
    guard = LongCallGuard(long_methods, limit)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=names[0]),
        options=CHANNEL_OPTIONS,
        interceptors=[guard],
    )
    server.long_call_guard = guard  # for tests and metrics
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
    a missing job NOT_FOUND, a clash ALREADY_EXISTS, a wrong state
    FAILED_PRECONDITION, a ceiling RESOURCE_EXHAUSTED, anything else INTERNAL."""
    from reflow.core.errors import Conflict, FailedPrecondition, ResourceExhausted

    if isinstance(err, FailedPrecondition):
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
    if isinstance(err, ResourceExhausted):
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))
    if isinstance(err, TimeoutError):
        context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(err))
    if isinstance(err, KeyError):  # str(KeyError) would quote the message
        context.abort(grpc.StatusCode.NOT_FOUND, str(err.args[0]) if err.args else "not found")
    if isinstance(err, Conflict):
        context.abort(grpc.StatusCode.ALREADY_EXISTS, str(err))
    if isinstance(err, ValueError):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
    logger.exception("internal error in handler")
    context.abort(grpc.StatusCode.INTERNAL, f"{type(err).__name__}: {err}")
