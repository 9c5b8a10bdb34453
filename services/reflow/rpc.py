"""gRPC plumbing shared by every service: servers with health checking,
channels with sane limits, and deadlines on every call.

Servers here are synchronous `grpc.server` with a thread pool. Most handlers
are short (a Redis call, a queue hand-off); the long-running work (vLLM,
training) lives on its own threads behind the core objects. A few calls wait
for such work (a weight update, a batch long-poll): those are named as long
methods, wait no longer than the caller's deadline, and may hold at most
`MAX_LONG_CALLS` of the `MAX_WORKERS` handler threads at once, so short calls
and grpc.health.v1 (what Kubernetes probes) always find a free thread.

Transient faults, in layers: a handler runs inside its caller's deadline
(`core.deadline`), so a Redis that stays down past its retries is answered
UNAVAILABLE in time; a channel retries UNAVAILABLE by itself, by gRPC's retry
policy, for the methods that are safe to send twice (`RETRIED_METHODS`, each
with why); a caller that polls anyway tolerates a few failures in a row
(`core.errors.ConsecutiveFailures`). Every call carries a deadline, which
bounds its retries too.

Errors: servicers only do their work and raise; one interceptor (`ErrorStatus`)
answers whatever escapes a handler with its status code (`abort_on`), so a
user's mistake is INVALID_ARGUMENT with its message and only a bug is INTERNAL
(logged with its traceback).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from reflow import rpcauth
from reflow.core.deadline import scope as deadline_scope
from reflow.core.errors import Unavailable

logger = logging.getLogger(__name__)

# Batches of trajectories can exceed gRPC's 4 MiB default.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
]

# gRPC's retry policy (gRFC A6), for the methods below: five attempts, the
# retries about 0.5, 1, 2 and 4 s apart (gRPC adds ±20% jitter), so a server
# that restarts within about 6 s is not seen as down. Only UNAVAILABLE: the
# server was not reached, or went away. DEADLINE_EXCEEDED is not retried: the
# deadline covers every attempt, so when it passes no time is left to retry in.
RETRY_POLICY = {
    "maxAttempts": 5,
    "initialBackoff": "0.5s",
    "maxBackoff": "4s",
    "backoffMultiplier": 2,
    "retryableStatusCodes": ["UNAVAILABLE"],
}
# The methods a channel retries, and why sending each twice is safe (a reply
# may be lost after the server acted on the request).
RETRIED_METHODS: dict[str, dict[str, str]] = {
    "reflow.v1.ReplayBuffer": {
        "Configure": "stores the same settings again",
        "Put": "keyed by group id: a group put twice is stored once (store.put)",
        "Sample": "a lease whose reply was lost is never released: it expires after "
                  "lease_ttl_s and its samples go back to their pools (at-least-once "
                  "delivery); a retry leases others meanwhile",
        "Release": "an unknown or released lease releases nothing",
        "RenewLease": "sets the same deadline again",
        "ReturnLease": "a returned lease is gone; returning it again returns nothing",
        "AcquireDispatch": "a grant whose reply was lost counts toward the budget unused "
                           "whether or not the call is retried: it errs toward dispatching "
                           "less, never more",
        "PublishVersion": "a version already published is accepted and changes nothing "
                          "more (only the next one moves it)",
        "GetStats": "a read",
        "EndJob": "ending an ended job changes nothing",
    },
    "reflow.v1.Rollout": {
        "StartJob": "a start of the job the worker already runs is a no-op",
        "StopJob": "stopping a stopped job does nothing more",
        "UpdateWeights": "a call for the version being (or just) loaded joins that update",
        "SetSyncPlace": "the place the worker has already is accepted again",
        "GetStats": "a read",
        "SubmitGroup": "keyed by group id: a group submitted again is refused, not "
                       "generated twice",
        "WaitSamples": "a read of the events after since_seq",
        "ScoreTokens": "a read: one prefill under the loaded weights, which change only "
                       "by the trainer that calls it",
    },
    "reflow.v1.Trainer": {
        "StartJob": "a start of the job the trainer already runs (or serves) is a no-op",
        "StopJob": "stopping a stopped job does nothing more",
        "GetStatus": "a read",
        "Reconfigure": "the same replicas again take the same next epoch; engines "
                       "already retired are retired again to no effect",
        "LeaveGroup": "leaving a group already left does nothing",
    },
    "reflow.v1.Scheduler": {
        "GetJob": "a read",
        "StopJob": "stopping a stopped job returns its record",
        "ListJobs": "a read",
        "GetJobLogs": "a read",
        "GetJobMetrics": "a read",
    },
    "reflow.v1.Worker": {
        "SetRole": "a request for the role the worker has answers with its status",
        "GetRole": "a read",
    },
    "reflow.v1.Sandbox": {
        "Execute": "each execution runs in a fresh sandbox that keeps nothing: a program "
                   "run twice changes nothing outside it",
        "GetStats": "a read",
    },
}
# The methods sent once, and why; a caller that wants a retry decides itself.
NOT_RETRIED_METHODS: dict[str, dict[str, str]] = {
    "reflow.v1.Rollout": {
        "InitWeightSync": "once set up, the group refuses a second set-up: a retry after a "
                          "lost reply would fail a join that worked",
        "Evaluate": "minutes of generation, run again by a retry; the next version is "
                    "evaluated anyway",
    },
    "reflow.v1.Trainer": {
        "JoinGroup": "a join of an epoch already joined is refused: a retry after a lost "
                     "reply would fail a join that worked",
    },
    "reflow.v1.Scheduler": {
        "SubmitJob": "without a job id each call creates a job",
        "ResumeJob": "a repeat of a resume that worked finds the job active, and is refused",
        "RequestFlip": "each call queues one more flip",
    },
}


def service_config() -> str:
    """The channels' service config (JSON): the retry policy on `RETRIED_METHODS`."""
    names = [{"service": service, "method": method}
             for service, methods in RETRIED_METHODS.items() for method in methods]
    return json.dumps({"methodConfig": [{"name": names, "retryPolicy": RETRY_POLICY}]})


# A request up to this size is kept for a retry (gRPC's default keeps 256 KiB;
# a put of a few groups is larger).
RETRY_BUFFER_BYTES = 32 * 1024 * 1024
CHANNEL_OPTIONS = [
    *SERVER_OPTIONS,
    ("grpc.enable_retries", 1),
    ("grpc.service_config", service_config()),
    ("grpc.per_rpc_retry_buffer_size", RETRY_BUFFER_BYTES),
    # Reconnect to a restarted server within 2 s (gRPC's default backoff grows to
    # 120 s, and calls fail at once meanwhile).
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2000),
    # A worker pod recreated at a new IP keeps its DNS name: resolve it again within a
    # second of losing the connection (gRPC's default waits 30 s between lookups).
    ("grpc.dns_min_time_between_resolutions_ms", 1000),
]
DEFAULT_DEADLINE_S = 30.0
MAX_WORKERS = 16
MAX_LONG_CALLS = 8
# The longest any handler waits, whatever deadline the caller set (or none).
MAX_HANDLER_WAIT_S = 600.0
# What a handler leaves of its caller's deadline for the reply to travel.
REPLY_MARGIN_S = 0.05


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


class DeadlineScope(grpc.ServerInterceptor):
    """Runs every unary handler within its caller's remaining deadline
    (`core.deadline.scope`), less the reply's margin: core code that retries on
    its own (Redis) gives up in time for the handler to answer."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        inner = handler.unary_unary

        def scoped(request, context):
            remaining = context.time_remaining()
            with deadline_scope(None if remaining is None else remaining - REPLY_MARGIN_S):
                return inner(request, context)

        return grpc.unary_unary_rpc_method_handler(
            scoped, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)


class ErrorStatus(grpc.ServerInterceptor):
    """Answers an exception that escapes a unary handler with its status code
    (`abort_on`). Innermost: the authorizer's and the long-call guard's refusals
    never reach it. A status the handler set itself stands: `context.abort`
    raises once it has set the code, and that exception passes through. Unary
    handlers only, like the other interceptors here: every reflow RPC is
    unary-unary on a synchronous server (no streams, no grpc.aio)."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        inner, method = handler.unary_unary, handler_call_details.method

        def mapped(request, context):
            try:
                return inner(request, context)
            except Exception as err:  # noqa: BLE001 - mapped to a status code
                if context.code() is not None:  # set by the handler (context.abort)
                    raise
                abort_on(context, err, method)

        return grpc.unary_unary_rpc_method_handler(
            mapped, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)


def wait_budget_s(context: grpc.ServicerContext, cap_s: float = MAX_HANDLER_WAIT_S) -> float:
    """How long a handler may wait on long work: the caller's remaining deadline
    less a margin for the reply, never more than `cap_s`."""
    remaining = context.time_remaining()
    if remaining is None:
        return cap_s
    return max(0.0, min(cap_s, remaining - REPLY_MARGIN_S))


def make_server(
    service_name: str | tuple[str, ...],
    register: Callable[[grpc.Server], None],
    address: str,
    max_workers: int = MAX_WORKERS,
    long_methods: Iterable[str] = (),
    max_long_calls: int | None = None,
    grants=None,
    serving: bool = True,
) -> tuple[grpc.Server, int]:
    """Build a server with the grpc.health.v1 service; returns it and the bound port.
    Several service names: one server hosts them all (the AsyncHybrid worker).
    `long_methods` ("/pkg.Service/Method") share `max_long_calls` handler threads
    (default `MAX_LONG_CALLS`, at most half the pool). Every call is authenticated
    and authorized first (`rpcauth.Authorizer`; `grants`: where the server keeps
    its job grants, the process's book by default), over TLS where configured.
    `serving=False`: the process is up (health "" SERVING, which probes read) but
    its services report NOT_SERVING until `set_serving` (a standby scheduler)."""
    names = (service_name,) if isinstance(service_name, str) else service_name
    limit = max_long_calls or min(MAX_LONG_CALLS, max_workers // 2)
    if not 1 <= limit < max_workers:
        raise ValueError(f"max_long_calls must leave handler threads free: {limit}/{max_workers}")
    guard = LongCallGuard(long_methods, limit)
    authorizer = rpcauth.Authorizer(names, grants)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=names[0]),
        options=SERVER_OPTIONS,
        # Outermost first: the checks run within the caller's deadline (the replay's
        # grants are in Redis), a refused call takes no long-call slot, and only
        # what the servicer itself raises is mapped to a status code.
        interceptors=[DeadlineScope(), authorizer, guard, ErrorStatus()],
    )
    server.long_call_guard = guard  # for tests and metrics
    register(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    tls = rpcauth.TlsFiles.from_env()
    port = (server.add_secure_port(address, tls.server_credentials()) if tls
            else server.add_insecure_port(address))
    if port == 0:
        raise OSError(f"{'+'.join(names)}: cannot bind {address}")
    if tls is None:
        logger.warning("%s: gRPC WITHOUT TLS on port %d (%s): calls and the credential cross "
                       "the network in the clear, and any process can answer as this service",
                       "+".join(names), port, rpcauth.TlsSettings.from_env().plaintext_reason)
    # The address the capabilities of its control calls must name (rpcauth).
    authorizer.bind(address, port)
    server.start()
    if tls is not None and os.environ.get(HEALTH_PORT_ENV):
        # Kubelet's gRPC probe speaks plaintext: health alone, on a port of its own.
        server.health_server = _serve_health(health_servicer, os.environ[HEALTH_PORT_ENV])
    server.health_servicer = health_servicer
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    set_serving(server, names, serving)
    logger.info("%s serving gRPC on port %d (%s)", "+".join(names), port,
                "plaintext" if tls is None else
                "mutual TLS" if tls.ca is not None else "TLS, no client certificates")
    return server, port


def set_serving(server: grpc.Server, names: Iterable[str], serving: bool = True) -> None:
    """Report each of `names` SERVING (or NOT_SERVING) on the server's health service."""
    status = (health_pb2.HealthCheckResponse.SERVING if serving
              else health_pb2.HealthCheckResponse.NOT_SERVING)
    for name in names:
        server.health_servicer.set(name, status)


HEALTH_PORT_ENV = "REFLOW_GRPC_HEALTH_PORT"


def _serve_health(health_servicer, port: str) -> grpc.Server:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="health"))
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if server.add_insecure_port(f"0.0.0.0:{int(port)}") == 0:
        raise OSError(f"{HEALTH_PORT_ENV}: cannot bind port {port}")
    server.start()
    return server


def channel(address: str, role: str | None = None) -> grpc.Channel:
    """Every client's channel: message limits, the retry policy, fast reconnects,
    this process's credentials on every call (`rpcauth`), TLS where configured.
    `role`: the service role it means to reach (reflow.tlscerts.ROLES); under TLS
    the callee's certificate must name it, or the handshake fails."""
    tls = rpcauth.TlsFiles.from_env()
    if tls is None:
        raw = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    else:
        raw = grpc.secure_channel(address, tls.channel_credentials(), options=[
            *CHANNEL_OPTIONS, ("grpc.ssl_target_name_override", tls.target_name(role))])
    return rpcauth.authenticated(raw, address)


# Codes that say "not now" rather than "no": what a polling caller may tolerate.
TRANSIENT_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


@contextlib.contextmanager
def transient_as_unavailable(what: str, also: tuple = ()) -> Iterator[None]:
    """Within the block, a call that failed with a transient code (after the
    channel's own retries), or one of the codes in `also`, raises
    `core.errors.Unavailable` naming `what`, so callers that never see gRPC can
    tell it from a refusal."""
    try:
        yield
    except grpc.RpcError as err:
        if err.code() not in TRANSIENT_CODES and err.code() not in also:
            raise
        raise Unavailable(f"{what}: {err.code().name}: {err.details()}") from err


def wait_healthy(address: str, timeout_s: float, service: str = "",
                 role: str | None = None, alive: Callable[[], bool] | None = None) -> None:
    """Block until the server at `address` reports SERVING, or raise TimeoutError.
    `role`: the server's role, which its certificate must name under TLS;
    `alive()`: whether the process starting it still runs (ExitedWhileStarting
    as soon as it does not, rather than at the timeout)."""
    import time

    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    with channel(address, role) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            if alive is not None and not alive():
                from reflow.core.errors import ExitedWhileStarting

                raise ExitedWhileStarting(f"the process serving {address} exited before it "
                                          "was healthy")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError as err:
                last = err
            time.sleep(0.2)
    raise TimeoutError(f"{address} did not become healthy in {timeout_s:.0f}s: {last}")


def abort_on(context: grpc.ServicerContext, err: Exception, method: str = "handler") -> None:
    """Map a core exception to a status code (`ErrorStatus` calls it for every
    server): user errors are INVALID_ARGUMENT, a missing job NOT_FOUND, a clash
    ALREADY_EXISTS, a wrong state FAILED_PRECONDITION, a ceiling
    RESOURCE_EXHAUSTED, a store or peer that stayed unreachable UNAVAILABLE
    (callers retry it), anything else INTERNAL. `method` names the call in the log."""
    from reflow.core.errors import Conflict, FailedPrecondition, ResourceExhausted

    if isinstance(err, Unavailable):
        logger.warning("%s: %s", method, err)
        context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
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
    logger.exception("%s: internal error", method)
    context.abort(grpc.StatusCode.INTERNAL, f"{type(err).__name__}: {err}")
