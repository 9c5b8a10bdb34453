"""Who may call what over gRPC: authentication of every call, authorization
by job, and the optional TLS under both.

Three secrets, in call metadata:
- the **deployment credential** (`x-reflow-credential`): every ReFlow process
  holds it (on Kubernetes a Secret the chart creates once and keeps, or one the
  user names; locally a random one per `reflow run`). A call without it, or
  with another, is UNAUTHENTICATED, before anything of the request is read.
- the **control credential** (`x-reflow-control`): held by the scheduler and the
  API only. The services that take the scheduler's orders hold just its SHA-256
  (`REFLOW_CONTROL_CREDENTIAL_SHA256`), so a worker can tell the scheduler's
  calls from others without being able to make them. The calls that assign a
  job, its peers or a role (`CONTROL_METHODS`) need it: only the scheduler
  points a trainer at a replay buffer or rollout workers.
- a **job token** (`x-reflow-job-token`): the scheduler issues one per job at
  placement (`scheduler.jobs.JobStore.job_token`). A control call naming a job
  grants that job's token on the server it reaches; every other call naming the
  job must carry that token, or it is PERMISSION_DENIED. A call naming no job is
  the scheduler's alone. A server that holds no grant for a job runs nothing of
  it and answers NOT_FOUND, as it would for any job it does not run.

Grants live where the server's state does: in memory for rollout, trainer and
worker (a restarted process is granted again when the scheduler starts the job
on it), in Redis for the replay buffer (its state outlives the process; only a
digest is stored). The same book of tokens serves the client side: a process
sends each call naming a job with the token it was granted (or, the scheduler,
issued) for that job, so no caller passes tokens around by hand.

Secrets are compared in constant time, as digests. Health checks
(grpc.health.v1) need nothing: a kubelet probe holds no credential.

TLS: with REFLOW_TLS_CERT_FILE and REFLOW_TLS_KEY_FILE set, servers listen with
TLS and clients verify against REFLOW_TLS_CA_FILE; with a CA set, servers also
require a client certificate from it (mutual TLS). Pods are dialled by IP, so
certificates name REFLOW_TLS_SERVER_NAME (default "reflow") and clients check
that name.
"""

from __future__ import annotations

import hmac
import os
import secrets
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import grpc

from reflow.core.errors import Unavailable
from reflow.core.grants import JOB_TOKENS, RedisGrants, digest

CREDENTIAL_ENV = "REFLOW_GRPC_CREDENTIAL"
CONTROL_ENV = "REFLOW_CONTROL_CREDENTIAL"
CONTROL_DIGEST_ENV = "REFLOW_CONTROL_CREDENTIAL_SHA256"
TLS_CERT_ENV = "REFLOW_TLS_CERT_FILE"
TLS_KEY_ENV = "REFLOW_TLS_KEY_FILE"
TLS_CA_ENV = "REFLOW_TLS_CA_FILE"
TLS_SERVER_NAME_ENV = "REFLOW_TLS_SERVER_NAME"

CREDENTIAL_KEY = "x-reflow-credential"
CONTROL_KEY = "x-reflow-control"
JOB_TOKEN_KEY = "x-reflow-job-token"  # nosec B105 # a metadata key, not a secret
HEALTH_PREFIX = "/grpc.health.v1.Health/"
MIN_SECRET_CHARS = 16

# The calls only the scheduler (or the API, through it) makes, and why.
CONTROL_METHODS: dict[str, dict[str, str]] = {
    "reflow.v1.Scheduler": {
        "*": "job administration: the API's calls on a user's behalf",
    },
    "reflow.v1.Rollout": {
        "StartJob": "names the replay buffer and trainer the engine works for",
        "StopJob": "ends a job on the worker",
        "SetSyncPlace": "moves the engine within the trainer's weight-sync group",
    },
    "reflow.v1.Trainer": {
        "StartJob": "names the replay buffer, rollout workers and peers the trainer trusts",
        "StopJob": "ends a job on the trainer",
        "Reconfigure": "names the trainer group's members and the engines it publishes to",
    },
    "reflow.v1.Worker": {
        "SetRole": "flips a worker between trainer and rollout",
    },
}


def _same(secret: str, expected_digest: str) -> bool:
    return bool(secret) and hmac.compare_digest(digest(secret), expected_digest)


def _read_secret(env: str) -> str:
    """`env`, or the file named by `env`_FILE (a mounted Secret), stripped."""
    value = os.environ.get(env, "")
    path = os.environ.get(f"{env}_FILE", "")
    if not value and path:
        value = Path(path).read_text().strip()
    if value and len(value) < MIN_SECRET_CHARS:
        raise ValueError(f"{env}: a credential needs at least {MIN_SECRET_CHARS} characters")
    return value


@dataclass(frozen=True)
class Credentials:
    """This process's secrets, as digests where it only verifies."""

    credential: str
    control: str  # "" unless this process is the scheduler or the API
    control_digest: str

    @classmethod
    def from_env(cls) -> "Credentials":
        credential = _read_secret(CREDENTIAL_ENV)
        if not credential:
            raise RuntimeError(
                f"no gRPC credential: set {CREDENTIAL_ENV} or {CREDENTIAL_ENV}_FILE (on "
                "Kubernetes the chart mounts its Secret; `reflow run` makes one per run)")
        control = _read_secret(CONTROL_ENV)
        control_digest = digest(control) if control else os.environ.get(CONTROL_DIGEST_ENV, "")
        return cls(credential, control, control_digest.lower())


_lock = threading.Lock()
_credentials: Credentials | None = None


def credentials() -> Credentials:
    global _credentials
    with _lock:
        if _credentials is None:
            _credentials = Credentials.from_env()
        return _credentials


def reset_credentials() -> None:
    """Read the environment again at the next call (after it changed)."""
    global _credentials
    with _lock:
        _credentials = None


def ensure_local_credentials() -> None:
    """A local run's secrets, made once per launcher run where none are set; the
    processes it starts inherit them."""
    os.environ.setdefault(CREDENTIAL_ENV, secrets.token_urlsafe(32))
    os.environ.setdefault(CONTROL_ENV, secrets.token_urlsafe(32))
    reset_credentials()


def service_env() -> dict[str, str]:
    """What a process the scheduler starts gets instead of the control credential:
    its digest, to verify the scheduler's calls by."""
    return {CONTROL_ENV: "", f"{CONTROL_ENV}_FILE": "",
            CONTROL_DIGEST_ENV: credentials().control_digest}


# --- the server side --------------------------------------------------------


def _refusal(code: grpc.StatusCode, details: str):
    def refuse(request, context):
        context.abort(code, details)

    # Raw bytes in: a refused request is never parsed.
    return grpc.unary_unary_rpc_method_handler(refuse)


def control_methods(service_names: Iterable[str]) -> frozenset[str]:
    """Full method names ("/pkg.Service/Method") of CONTROL_METHODS for these services;
    "*" stands for every method of the service."""
    from google.protobuf import descriptor_pool

    import reflow.v1  # noqa: F401 - registers the descriptors
    from reflow.v1 import (replay_pb2, rollout_pb2, scheduler_pb2, trainer_pb2,  # noqa: F401
                           worker_pb2)

    pool = descriptor_pool.Default()
    names = set()
    for service in service_names:
        declared = {m.name for m in pool.FindServiceByName(service).methods}
        methods = set(CONTROL_METHODS.get(service, {}))
        if "*" in methods:
            methods = declared
        if methods - declared:  # a misspelt name would protect nothing
            raise ValueError(f"CONTROL_METHODS names {sorted(methods - declared)}, which "
                             f"{service} does not declare")
        names.update(f"/{service}/{m}" for m in methods)
    return frozenset(names)


class Authorizer(grpc.ServerInterceptor):
    """Every call: the deployment credential (UNAUTHENTICATED without it), then the
    control credential for CONTROL_METHODS and calls naming no job, then the job
    token of the job the request names (PERMISSION_DENIED without it). Before the
    long-call guard: a refused call takes no long-call slot."""

    def __init__(self, service_names: Iterable[str], grants=None) -> None:
        self.creds = credentials()
        if not self.creds.control_digest:
            raise RuntimeError(f"no way to tell the scheduler's calls: set {CONTROL_DIGEST_ENV} "
                               f"(or, the scheduler and the API, {CONTROL_ENV})")
        self._credential_digest = digest(self.creds.credential)
        self.control = control_methods(service_names)
        self.grants = grants if grants is not None else JOB_TOKENS

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(HEALTH_PREFIX):
            return continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        if not _same(str(metadata.get(CREDENTIAL_KEY, "")), self._credential_digest):
            return _refusal(grpc.StatusCode.UNAUTHENTICATED,
                            f"{method}: no valid credential in {CREDENTIAL_KEY}")
        is_control = bool(self.creds.control_digest) and _same(
            str(metadata.get(CONTROL_KEY, "")), self.creds.control_digest)
        if method in self.control and not is_control:
            return _refusal(grpc.StatusCode.PERMISSION_DENIED,
                            f"{method}: only the scheduler may call this")
        handler = continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        inner = handler.unary_unary
        token = str(metadata.get(JOB_TOKEN_KEY, ""))

        def authorized(request, context):
            job_id = str(getattr(request, "job_id", "") or "")
            try:
                refusal = self._check(method, job_id, token, is_control)
            except Unavailable as err:  # the replay's Redis, past its retries
                context.abort(grpc.StatusCode.UNAVAILABLE, f"{method}: {err}")
            if refusal is not None:
                context.abort(*refusal)
            return inner(request, context)

        return grpc.unary_unary_rpc_method_handler(
            authorized, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)

    def _check(self, method: str, job_id: str, token: str,
               is_control: bool) -> tuple[grpc.StatusCode, str] | None:
        """None if the call may go on, else its refusal."""
        if is_control:
            if job_id and token:
                self.grants.grant(job_id, token)
            return None
        if not job_id:
            return (grpc.StatusCode.PERMISSION_DENIED,
                    f"{method}: a call naming no job_id is the scheduler's only")
        granted = self.grants.granted_digest(job_id)
        if granted is None:  # nothing of the job runs here (module docstring)
            return grpc.StatusCode.NOT_FOUND, f"job {job_id!r} is not running here"
        if _same(token, granted):
            return None
        if isinstance(self.grants, RedisGrants):  # granted anew through another replica?
            fresh = self.grants.granted_digest(job_id, fresh=True)
            if fresh is not None and _same(token, fresh):
                return None
        return (grpc.StatusCode.PERMISSION_DENIED,
                f"{method}: job {job_id!r} needs its job token in {JOB_TOKEN_KEY}")


# --- the client side --------------------------------------------------------


class _CallAuth(grpc.UnaryUnaryClientInterceptor):
    """Adds this process's credentials, and the token of the job the request
    names, to every call."""

    def __init__(self, creds: Credentials) -> None:
        self.fixed = [(CREDENTIAL_KEY, creds.credential)]
        if creds.control:
            self.fixed.append((CONTROL_KEY, creds.control))

    def intercept_unary_unary(self, continuation, client_call_details, request):
        metadata = list(client_call_details.metadata or ()) + self.fixed
        job_id = getattr(request, "job_id", "")
        token = JOB_TOKENS.token(job_id) if job_id else ""
        if token:
            metadata.append((JOB_TOKEN_KEY, token))
        details = _CallDetails(client_call_details.method, client_call_details.timeout,
                               metadata, client_call_details.credentials,
                               client_call_details.wait_for_ready,
                               client_call_details.compression)
        return continuation(details, request)


@dataclass(frozen=True)
class _CallDetails(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: list
    credentials: object
    wait_for_ready: bool | None
    compression: object


def authenticated(channel: grpc.Channel) -> grpc.Channel:
    return grpc.intercept_channel(channel, _CallAuth(credentials()))


# --- TLS --------------------------------------------------------------------


@dataclass(frozen=True)
class TlsFiles:
    cert: bytes
    key: bytes
    ca: bytes | None
    server_name: str

    @classmethod
    def from_env(cls) -> "TlsFiles | None":
        cert, key = os.environ.get(TLS_CERT_ENV, ""), os.environ.get(TLS_KEY_ENV, "")
        if not cert and not key:
            return None
        if not (cert and key):
            raise ValueError(f"TLS needs both {TLS_CERT_ENV} and {TLS_KEY_ENV}")
        ca = os.environ.get(TLS_CA_ENV, "")
        return cls(Path(cert).read_bytes(), Path(key).read_bytes(),
                   Path(ca).read_bytes() if ca else None,
                   os.environ.get(TLS_SERVER_NAME_ENV, "reflow"))

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=self.ca is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)
