"""Who may call what over gRPC: authentication of every call, authorization
by role and job, and the optional TLS under both.

What a call carries, in its metadata:
- the **deployment credential** (`x-reflow-credential`): every ReFlow process
  holds it (on Kubernetes a Secret the chart creates once and keeps, or one the
  user names; locally a random one per `reflow run`). A call without it, or
  with another, is UNAUTHENTICATED, before anything of the request is read.
  It proves "a process of this deployment", nothing more.
- a **capability** (`x-reflow-capability`, reflow.capabilities): a control
  call's proof, signed with the calling role's Ed25519 key for that one method,
  at that one server, on that request body, for two minutes, once. The API
  signs its calls on the scheduler; the scheduler signs every call it makes
  (those that assign a job, its peers or a role need it). Servers hold only
  the public keys, so nothing a worker receives lets it make a control call:
  `CONTROL_TABLE` below says which role each control method needs.
- a **job pass** (`x-reflow-job-token`): every other call names a job and
  carries the caller's pass, signed by the scheduler (capabilities.issue_pass):
  this holder works for this job as a rollout or a trainer, for 15 minutes.
  JOB_CALLERS says which roles' passes each method takes. The scheduler hands a
  worker a fresh pass with each call it makes to it (the callee's role: a
  Rollout call carries a rollout pass), and the worker sends it with its own
  calls for the job from the process's book (core.grants.JOB_TOKENS).

A server runs a job once the scheduler's GRANTING call started it there (the
replay buffer: its Configure at placement, or any of its calls naming a job
that never ended there; kept in Redis so that it outlives a restart and every
replica sees it); REVOKING calls end it there (the buffer's EndJob when the job
reaches its end), and from then on the job's passes get NOT_FOUND, as for a job
the server never ran, until the scheduler starts it there again. The sandbox
keeps no such book (`EveryJob`): it serves any job whose pass verifies.

Secrets are compared in constant time, as digests. Health checks
(grpc.health.v1) need nothing: a kubelet probe holds no credential.

TLS, under all of it (`TlsFiles` here; the identities and settings in
reflow.tlscerts): mutual, one certificate per role from the deployment's own
CA, on by default under `reflow run` and the chart. A server presents its
role's certificate and requires a client certificate from the CA; a client
checks that the callee's certificate names the role it means to reach
(`<role>.reflow.internal`; REFLOW_TLS_SERVER_NAME instead names one shared
certificate). REFLOW_TLS=off turns it off for debugging, and each server says so
in its log. TLS proves which role answers and keeps the channel private; what a
caller may ask is still the capabilities' and passes' to say.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
import socket
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from reflow import capabilities as caps
from reflow.authz import (_CALLEE_ROLE, CONTROL_TABLE, GRANTING, JOB_CALLERS,  # noqa: F401
                          NO_JOB_ROLE, REVOKING, SERVICES, authorization_markdown,
                          authorization_rows, control_methods, job_callers)
from reflow.core.errors import Unavailable
from reflow.core.grants import JOB_TOKENS, RedisGrants, digest
from reflow.tlscerts import (TLS_CA_ENV, TLS_CERT_ENV, TLS_ENV, TLS_KEY_ENV,  # noqa: F401
                             TLS_SERVER_NAME_ENV, TlsSettings)
# The TLS half of a started service's environment: its own certificate and key.
from reflow.tlscerts import files_env as tls_env  # noqa: F401

CREDENTIAL_ENV = "REFLOW_GRPC_CREDENTIAL"
# Per signing role: its private key (that role's processes only) and its public
# key (every process that verifies the role's calls). PEM, or a file holding it.
SIGNING_KEY_ENVS = {"api": "REFLOW_API_SIGNING_KEY", "scheduler": "REFLOW_SCHEDULER_SIGNING_KEY"}
PUBLIC_KEY_ENVS = {"api": "REFLOW_API_PUBLIC_KEY", "scheduler": "REFLOW_SCHEDULER_PUBLIC_KEY"}
# More names a server answers to, comma-separated (a Service's DNS names): the
# audiences its capabilities may carry besides its own address.
ADVERTISE_HOSTS_ENV = "REFLOW_ADVERTISE_HOSTS"
POD_IP_ENV = "REFLOW_POD_IP"

CREDENTIAL_KEY = "x-reflow-credential"
CAPABILITY_KEY = "x-reflow-capability"
JOB_TOKEN_KEY = "x-reflow-job-token"  # nosec B105 # a metadata key, not a secret
HEALTH_PREFIX = "/grpc.health.v1.Health/"
MIN_SECRET_CHARS = 16



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
    """This process's deployment credential, the roles it signs as (their private
    keys) and the roles whose calls it can verify (their public keys)."""

    credential: str
    signing: dict = field(default_factory=dict)  # role -> Ed25519PrivateKey
    trusted: dict = field(default_factory=dict)  # role -> Ed25519PublicKey

    @classmethod
    def from_env(cls) -> "Credentials":
        credential = _read_secret(CREDENTIAL_ENV)
        if not credential:
            raise RuntimeError(
                f"no gRPC credential: set {CREDENTIAL_ENV} or {CREDENTIAL_ENV}_FILE (on "
                "Kubernetes the chart mounts its Secret; `reflow run` makes one per run)")
        signing, trusted = {}, {}
        for role, env in SIGNING_KEY_ENVS.items():
            pem = _read_secret(env)
            if pem:
                signing[role] = caps.load_private_key(pem, env)
                trusted[role] = signing[role].public_key()
        for role, env in PUBLIC_KEY_ENVS.items():
            pem = _read_secret(env)
            if pem:
                trusted[role] = caps.load_public_key(pem, env)
        return cls(credential, signing, trusted)


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
    """A local run's secrets, made once per launcher run where none are set: the
    deployment credential and a key pair per signing role. The processes it
    starts inherit them through `role_env`, each only its own private key."""
    os.environ.setdefault(CREDENTIAL_ENV, secrets.token_urlsafe(32))
    for role, env in SIGNING_KEY_ENVS.items():
        if not (os.environ.get(env) or os.environ.get(f"{env}_FILE")):
            key = caps.new_private_key()
            os.environ[env] = caps.private_pem(key)
            os.environ[PUBLIC_KEY_ENVS[role]] = caps.public_pem(key)
        elif not (os.environ.get(PUBLIC_KEY_ENVS[role])
                  or os.environ.get(f"{PUBLIC_KEY_ENVS[role]}_FILE")):
            os.environ[PUBLIC_KEY_ENVS[role]] = caps.public_pem(
                caps.load_private_key(_read_secret(env), env))
    reset_credentials()


def role_env(role: str | None = None) -> dict[str, str]:
    """The environment overrides of a process this one starts: every public key
    this process trusts, and of the private keys only `role`'s ("api",
    "scheduler"; None: a service that signs nothing)."""
    creds = credentials()
    env: dict[str, str] = {}
    for name, key_env in SIGNING_KEY_ENVS.items():
        if name != role:
            env[key_env] = env[f"{key_env}_FILE"] = ""
    for name, key in creds.trusted.items():
        env[PUBLIC_KEY_ENVS[name]] = caps.public_pem(key)
        env[f"{PUBLIC_KEY_ENVS[name]}_FILE"] = ""
    return env


def service_env() -> dict[str, str]:
    """What a service the scheduler starts gets: the public keys, no private one."""
    return role_env(None)


# --- the server side --------------------------------------------------------


class EveryJob:
    """The grants of a server that keeps no book of jobs: every job counts as
    granted, so a call is served when the pass it carries verifies (the
    scheduler's signature, unexpired, its job the one the request names, its
    role one JOB_CALLERS takes for the method). The sandbox's: it runs a
    program and forgets it, holds nothing of any job that a pass of another
    could reach, and no scheduler call starts or ends jobs there. Nothing is
    kept, so a grant or a revocation changes nothing and no pass is held."""

    def grant(self, job_id: str, token: str) -> None:
        pass

    def grant_unless_ended(self, job_id: str) -> None:
        pass

    def token(self, job_id: str) -> str:
        return ""

    def granted(self, job_id: str) -> bool:
        return True

    def revoke(self, job_id: str) -> None:
        pass


EVERY_JOB = EveryJob()


def _refusal(code: grpc.StatusCode, details: str):
    def refuse(request, context):
        context.abort(code, details)

    # Raw bytes in: a refused request is never parsed.
    return grpc.unary_unary_rpc_method_handler(refuse)


def own_audiences(host: str, port: int) -> frozenset[str]:
    """The addresses a server bound at host:port answers to, as capabilities
    name them: its bind address and the names in REFLOW_ADVERTISE_HOSTS (a
    worker's DNS name under its headless Service); bound to every interface, also
    its pod IP, its host name and the loopback names (a caller on the same host)."""
    host = host.strip("[]").lower()
    hosts = {host}
    if host in ("0.0.0.0", "::", ""):  # nosec B104 # naming a wildcard, not binding one
        hosts = {"localhost", "127.0.0.1", "::1", socket.gethostname().lower()}
        if os.environ.get(POD_IP_ENV):
            hosts.add(os.environ[POD_IP_ENV].strip().lower())
    hosts.update(h.strip().lower() for h in os.environ.get(ADVERTISE_HOSTS_ENV, "").split(",")
                 if h.strip())
    if host == "localhost":
        hosts.update({"127.0.0.1", "::1"})
    out = set()
    for h in hosts:
        try:
            literal = ipaddress.ip_address(h)
            out.add(f"[{h}]:{port}" if literal.version == 6 else f"{h}:{port}")
        except ValueError:
            out.add(f"{h}:{port}")
    return frozenset(out)


class Authorizer(grpc.ServerInterceptor):
    """Every call: the deployment credential (UNAUTHENTICATED without it); then, for
    the methods of CONTROL_TABLE and every call naming no job, a capability of the
    role it needs, addressed to this server, for this request, unexpired and not
    spent before; every other call, the token of the job it names
    (PERMISSION_DENIED without it). Before the long-call guard: a refused call
    takes no long-call slot. `bind` tells it the address it serves at."""

    def __init__(self, service_names: Iterable[str], grants=None) -> None:
        self.creds = credentials()
        self.control = control_methods(service_names)
        needed = set(self.control.values()) | {NO_JOB_ROLE}
        missing = sorted(needed - set(self.creds.trusted))
        if missing:
            raise RuntimeError(
                "no way to verify the calls of " + ", ".join(missing) + ": set " +
                " or ".join(PUBLIC_KEY_ENVS[r] for r in missing) + " (or its _FILE)")
        self.callers = job_callers(service_names)
        self._credential_digest = digest(self.creds.credential)
        self.grants = grants if grants is not None else JOB_TOKENS
        # The replay buffer is put on a job by any of the scheduler's calls naming
        # it, unless the job ended there: then only by its starting call (authz.
        # GRANTING); the workers by GRANTING calls alone.
        self.grant_on_any = isinstance(self.grants, RedisGrants)
        self.audiences: frozenset[str] = frozenset()
        self.nonces = caps.NonceBook()

    def bind(self, address: str, port: int) -> None:
        host = address.rsplit(":", 1)[0] if ":" in address else address
        self.audiences = own_audiences(host, port)

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(HEALTH_PREFIX):
            return continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        if not _same(str(metadata.get(CREDENTIAL_KEY, "")), self._credential_digest):
            return _refusal(grpc.StatusCode.UNAUTHENTICATED,
                            f"{method}: no valid credential in {CREDENTIAL_KEY}")
        capability = str(metadata.get(CAPABILITY_KEY, ""))
        role = self.control.get(method)
        if role is not None and not capability:
            return _refusal(grpc.StatusCode.PERMISSION_DENIED,
                            f"{method}: only the {role} may call this (no capability in "
                            f"{CAPABILITY_KEY})")
        handler = continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        inner, parse = handler.unary_unary, handler.request_deserializer
        token = str(metadata.get(JOB_TOKEN_KEY, ""))

        def authorized(raw: bytes, context):
            try:
                request = parse(raw) if parse is not None else raw
            except Exception:  # noqa: BLE001 - a body that does not parse is the caller's fault
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: malformed request")
            job_id = str(getattr(request, "job_id", "") or "")
            claims = None
            if capability:
                # A capability on any call is the scheduler's, unless the table
                # names another role for the method.
                claims = self._capability(method, capability, raw, role or NO_JOB_ROLE,
                                          context)
            try:
                refusal = self._check(method, job_id, token, claims, role)
            except Unavailable as err:  # the replay's Redis, past its retries
                if claims is not None:
                    self.nonces.release(claims.nonce)
                context.abort(grpc.StatusCode.UNAVAILABLE, f"{method}: {err}")
            if refusal is not None:
                context.abort(*refusal)
            try:
                return inner(request, context)
            except BaseException:
                # Nothing changed on UNAVAILABLE: the channel's retry of this very
                # call must not be taken for a replay.
                if claims is not None and _code(context) == grpc.StatusCode.UNAVAILABLE:
                    self.nonces.release(claims.nonce)
                raise
            finally:
                # The scheduler ended the job here, whatever the service answered:
                # its passes get NOT_FOUND from now on (a new start grants it again).
                if claims is not None and job_id and method in REVOKING:
                    self.grants.revoke(job_id)

        return grpc.unary_unary_rpc_method_handler(
            authorized, request_deserializer=None,
            response_serializer=handler.response_serializer)

    def _capability(self, method: str, token: str, raw: bytes, role: str, context):
        """The verified claims of the call's capability, spent; aborts the call
        with PERMISSION_DENIED when they do not grant it."""
        try:
            claims = caps.read(token, self.creds.trusted)
            caps.check(claims, method, self.audiences, raw)
        except caps.CapabilityError as err:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{method}: capability refused: {err}")
        if claims.role != role:
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"{method}: needs the {role}'s capability, not the {claims.role}'s")
        if not self.nonces.claim(claims.nonce, claims.expires_at):
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"{method}: capability already spent (a replayed call)")
        return claims

    def _check(self, method: str, job_id: str, token: str, claims,
               role: str | None) -> tuple[grpc.StatusCode, str] | None:
        """None if the call may go on, else its refusal."""
        if claims is not None:  # the scheduler's (or the API's) own call
            if job_id and method in GRANTING:
                self.grants.grant(job_id, token)
            elif job_id and self.grant_on_any:
                self.grants.grant_unless_ended(job_id)
            elif job_id and token and self._same_role(self.grants.token(job_id), token):
                # A fresh pass for its holder; a probe through the other service of a
                # hybrid worker (the other role's pass) leaves the holder's pass as it is.
                self.grants.grant(job_id, token)
            return None
        if role is not None:
            return grpc.StatusCode.PERMISSION_DENIED, f"{method}: only the {role} may call this"
        if not job_id:
            return (grpc.StatusCode.PERMISSION_DENIED,
                    f"{method}: a call naming no job_id is the {NO_JOB_ROLE}'s only")
        if not self.grants.granted(job_id):  # nothing of the job runs here (docstring)
            return grpc.StatusCode.NOT_FOUND, f"job {job_id!r} is not running here"
        allowed = self.callers.get(method, ())
        try:
            held = caps.read_pass(token, self.creds.trusted[NO_JOB_ROLE])
        except caps.CapabilityError as err:
            return (grpc.StatusCode.PERMISSION_DENIED,
                    f"{method}: job {job_id!r} needs a job pass in {JOB_TOKEN_KEY} ({err})")
        if held.job_id != job_id:
            return (grpc.StatusCode.PERMISSION_DENIED,
                    f"{method}: the pass is job {held.job_id!r}'s, not {job_id!r}'s")
        if held.role not in allowed:
            who = " or ".join(allowed) if allowed else f"the {NO_JOB_ROLE}"
            return (grpc.StatusCode.PERMISSION_DENIED,
                    f"{method}: {who} only, not a {held.role}")
        return None


    def _same_role(self, held: str, fresh: str) -> bool:
        """Whether `fresh` is a pass of the same role as the pass held (both the
        scheduler's; False when none is held)."""
        if not held:
            return False
        try:
            key = self.creds.trusted[NO_JOB_ROLE]
            # The held pass may have expired: its role still says whose it is.
            return caps.read_pass(held, key, now=0).role == caps.read_pass(fresh, key).role
        except caps.CapabilityError:
            return False


def _code(context) -> grpc.StatusCode | None:
    try:
        return context.code()
    except Exception:  # noqa: BLE001 - older servers have no code()
        return None


# --- the client side --------------------------------------------------------


class _CallAuth(grpc.UnaryUnaryClientInterceptor):
    """Adds this process's credential, a capability where this process signs as
    the role the call needs, and the token of the job the request names."""

    def __init__(self, creds: Credentials, address: str | None) -> None:
        self.fixed = [(CREDENTIAL_KEY, creds.credential)]
        self.signing = creds.signing
        self.audience = caps.normal_address(address) if address else ""
        self._control: dict[str, str] = {}
        if self.signing:
            self._control = control_methods(CONTROL_TABLE)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        metadata = list(client_call_details.metadata or ()) + self.fixed
        method = client_call_details.method
        method = method.decode() if isinstance(method, bytes) else method
        job_id = getattr(request, "job_id", "")
        # The control table's role for its methods; every other call of a process
        # that signs as the scheduler is signed too: the scheduler's calls naming a
        # job may grant it where it runs (the replay buffer's Configure at placement).
        role = self._control.get(method) or NO_JOB_ROLE
        key = self.signing.get(role) if self.audience else None
        token = JOB_TOKENS.token(job_id) if job_id else ""
        if key is not None:
            metadata.append((CAPABILITY_KEY, caps.mint(
                key, role, method, self.audience, job_id, request.SerializeToString())))
            if role == NO_JOB_ROLE and job_id:
                # The callee's pass for the job, fresh with every call the scheduler
                # makes to it: what it sends with its own calls for the job.
                service = method.split("/")[1]
                callee = _CALLEE_ROLE.get(service) or (
                    getattr(request, "role", "") if method == "/reflow.v1.Worker/SetRole"
                    else "")
                token = caps.issue_pass(key, job_id, callee) if callee in caps.PASS_ROLES \
                    else ""
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


def authenticated(channel: grpc.Channel, address: str | None = None) -> grpc.Channel:
    """`channel` with this process's credentials on every call; `address` is the
    target it dials, which the capabilities it signs are addressed to (None: it
    signs none)."""
    return grpc.intercept_channel(channel, _CallAuth(credentials(), address))


# --- TLS --------------------------------------------------------------------


@dataclass(frozen=True)
class TlsFiles:
    """This process's certificate, key and CA, read once, and the settings that
    named them."""

    cert: bytes
    key: bytes
    ca: bytes | None
    settings: TlsSettings

    @classmethod
    def from_env(cls) -> "TlsFiles | None":
        """The files the environment names; None when this process speaks
        plaintext (`TlsSettings.plaintext_reason` says why)."""
        settings = TlsSettings.from_env()
        if not settings.enabled:
            return None

        def read(path: str, env: str) -> bytes:
            try:
                return Path(path).read_bytes()
            except OSError as err:
                raise ValueError(f"{env}: cannot read {path}: {err.strerror}") from None

        return cls(read(settings.cert_file, TLS_CERT_ENV), read(settings.key_file, TLS_KEY_ENV),
                   read(settings.ca_file, TLS_CA_ENV) if settings.ca_file else None, settings)

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=self.ca is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    def target_name(self, role: str | None) -> str:
        """The name the callee's certificate must carry, dialling a `role` service."""
        return self.settings.target_name(role)
