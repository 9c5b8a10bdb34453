"""Signed capabilities: the proof a control call carries (rpcauth checks them).

A control call (a job assigned, a peer named, a role flipped; the API's calls on
the scheduler) used to carry a shared secret, and the first such call a worker
received handed the secret to it. A capability is instead a short statement
signed with the caller role's Ed25519 key:

    v1.<payload>.<signature>      base64url, the signature over "v1.<payload>"

    payload = {"r": role, "m": "/pkg.Service/Method", "aud": "host:port",
               "job": job_id, "h": sha256(request bytes), "iat": t, "exp": t',
               "n": nonce}

It is good for one method, at one server (the address the caller dialled), on
one request body, until `exp`, once (the server keeps the nonces it has seen
until they expire). Servers hold only the public keys, so what a worker receives
lets it verify calls, never make one: a capability it was sent names it as the
audience, is spent, and expires within minutes.

Why signatures and not per-role mutual TLS: the proof must survive the paths a
call takes (pods dialled by IP, a Service name in front of replicas), must bind
the method and the request, and must not depend on TLS being on; a certificate
proves who opened the connection, not what it may ask. Mutual TLS with a
certificate per role (reflow.tlscerts, on by default) still runs under both: it
keeps the channel private and proves which role answers.

Keys are PEM: a PKCS#8 private key, and a SubjectPublicKeyInfo public key or an
X.509 certificate holding it (what Helm's genSelfSignedCertWithKey writes). No
gRPC here: the scheduler's core and the tests mint and check without a server.
"""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
import threading
import time
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

VERSION = "v1"
# How long a capability is good for, and the clock difference a server forgives.
LIFETIME_S = 120
CLOCK_SKEW_S = 30
MAX_TOKEN_CHARS = 4096
# The roles that sign control calls.
ROLES = ("api", "scheduler")


class CapabilityError(Exception):
    """A capability that does not grant the call; the message says why."""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def body_digest(request_bytes: bytes) -> str:
    return hashlib.sha256(request_bytes).hexdigest()


def normal_address(address: str) -> str:
    """A dialled target as servers name themselves: no scheme, no DNS authority
    (`dns://10.96.0.10:53/name:port` is `name:port`), lower case."""
    if address.startswith("dns://"):
        address = address[len("dns://"):].partition("/")[2]
    for scheme in ("dns:", "ipv4:", "ipv6:"):
        if address.startswith(scheme):
            address = address[len(scheme):]
    return address.strip().lower()


# --- keys -------------------------------------------------------------------


def new_private_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def private_pem(key: Ed25519PrivateKey) -> str:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption()).decode()


def public_pem(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    public = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return public.public_bytes(serialization.Encoding.PEM,
                               serialization.PublicFormat.SubjectPublicKeyInfo).decode()


def load_private_key(pem: str, where: str) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(pem.encode(), password=None)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{where}: not a PEM private key ({err})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{where}: an Ed25519 key is needed, got {type(key).__name__}")
    return key


def load_public_key(pem: str, where: str) -> Ed25519PublicKey:
    """A PEM public key, or the key of a PEM certificate."""
    from cryptography import x509

    try:
        if "CERTIFICATE" in pem:
            key = x509.load_pem_x509_certificate(pem.encode()).public_key()
        else:
            key = serialization.load_pem_public_key(pem.encode())
    except (ValueError, TypeError) as err:
        raise ValueError(f"{where}: not a PEM public key or certificate ({err})") from None
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError(f"{where}: an Ed25519 key is needed, got {type(key).__name__}")
    return key


# --- minting and checking ----------------------------------------------------


@dataclass(frozen=True)
class Claims:
    role: str
    method: str
    audience: str
    job_id: str
    body: str
    issued_at: int
    expires_at: int
    nonce: str


def _seal(key: Ed25519PrivateKey, version: str, payload: dict) -> str:
    """version.payload.signature, the signature over "version.payload"."""
    head = f"{version}.{_b64(json.dumps(payload, separators=(',', ':')).encode())}"
    return f"{head}.{_b64(key.sign(head.encode()))}"


def _open(token: str, version: str, what: str) -> tuple[dict, bytes, bytes]:
    """(payload, signature, signed bytes) of a sealed token, unverified;
    CapabilityError if it is not one."""
    if not token or len(token) > MAX_TOKEN_CHARS:
        raise CapabilityError(f"no {what}, or one too long")
    parts = token.split(".")
    if len(parts) != 3 or parts[0] != version:
        raise CapabilityError(f"not a {version} {what}")
    try:
        raw = json.loads(_unb64(parts[1]))
        signature = _unb64(parts[2])
    except ValueError as err:
        raise CapabilityError(f"malformed {what} ({type(err).__name__})") from None
    if not isinstance(raw, dict):
        raise CapabilityError(f"malformed {what} (not an object)")
    return raw, signature, f"{parts[0]}.{parts[1]}".encode()


def mint(key: Ed25519PrivateKey, role: str, method: str, audience: str, job_id: str,
         request_bytes: bytes, now: float | None = None, lifetime_s: int = LIFETIME_S) -> str:
    """A capability for one call of `method` at `audience` with this request."""
    issued = int(now if now is not None else time.time())
    payload = {"r": role, "m": method, "aud": normal_address(audience), "job": job_id,
               "h": body_digest(request_bytes), "iat": issued, "exp": issued + lifetime_s,
               "n": _b64(secrets.token_bytes(16))}
    return _seal(key, VERSION, payload)


def read(token: str, trusted: dict[str, Ed25519PublicKey]) -> Claims:
    """The claims of a capability signed by a trusted role's key; CapabilityError
    if it is malformed or its signature is not one of theirs."""
    raw, signature, signed = _open(token, VERSION, "capability")
    try:
        claims = Claims(role=str(raw["r"]), method=str(raw["m"]), audience=str(raw["aud"]),
                        job_id=str(raw["job"]), body=str(raw["h"]), issued_at=int(raw["iat"]),
                        expires_at=int(raw["exp"]), nonce=str(raw["n"]))
    except (ValueError, KeyError, TypeError) as err:
        raise CapabilityError(f"malformed capability ({type(err).__name__})") from None
    key = trusted.get(claims.role)
    if key is None:
        raise CapabilityError(f"no key of role {claims.role!r} is trusted here")
    try:
        key.verify(signature, signed)
    except InvalidSignature:
        raise CapabilityError(f"signature is not role {claims.role!r}'s") from None
    return claims


def check(claims: Claims, method: str, audiences: frozenset[str], request_bytes: bytes,
          now: float | None = None) -> None:
    """CapabilityError unless the claims grant this call, here, now."""
    now = now if now is not None else time.time()
    if claims.method != method:
        raise CapabilityError(f"granted for {claims.method}, not this method")
    if claims.audience not in audiences:
        raise CapabilityError(f"addressed to {claims.audience}, not to this server")
    if now > claims.expires_at + CLOCK_SKEW_S:
        raise CapabilityError("expired")
    if claims.issued_at > now + CLOCK_SKEW_S or claims.expires_at - claims.issued_at > 3600:
        raise CapabilityError("issued in the future, or for too long")
    if claims.body != body_digest(request_bytes):
        raise CapabilityError("granted for another request body")


class NonceBook:
    """The nonces this server has accepted, until their capability expires: a
    spent capability is refused if sent again (a replayed call)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[str, float] = {}

    def claim(self, nonce: str, expires_at: float, now: float | None = None) -> bool:
        """True the first time; False for a nonce already spent."""
        now = now if now is not None else time.time()
        with self._lock:
            if len(self._seen) > 1024:
                horizon = now - CLOCK_SKEW_S
                self._seen = {n: t for n, t in self._seen.items() if t >= horizon}
            if nonce in self._seen:
                return False
            self._seen[nonce] = expires_at
            return True

    def release(self, nonce: str) -> None:
        """Forget a nonce whose call failed before it changed anything (UNAVAILABLE),
        so that the channel's transparent retry of it is not taken for a replay."""
        with self._lock:
            self._seen.pop(nonce, None)


# --- job passes ---------------------------------------------------------------

PASS_VERSION = "p1"  # nosec B105 # a format tag, not a secret
# A pass lasts this long; the scheduler hands a fresh one with each call it makes
# to the holder, so a pass outlives its job by at most this.
PASS_LIFETIME_S = 900
PASS_ROLES = ("rollout", "trainer")


@dataclass(frozen=True)
class JobPass:
    job_id: str
    role: str
    expires_at: int


def issue_pass(key: Ed25519PrivateKey, job_id: str, role: str, now: float | None = None,
               lifetime_s: int = PASS_LIFETIME_S) -> str:
    """The scheduler's statement that the holder works for `job_id` as `role`: what
    a worker sends with the calls it makes for the job (rpcauth's job token)."""
    if role not in PASS_ROLES:
        raise ValueError(f"a job pass is for one of {PASS_ROLES}, not {role!r}")
    issued = int(now if now is not None else time.time())
    payload = {"job": job_id, "r": role, "exp": issued + lifetime_s}
    return _seal(key, PASS_VERSION, payload)


def read_pass(token: str, scheduler_key: Ed25519PublicKey, now: float | None = None) -> JobPass:
    """The pass's job and role; CapabilityError if it is not the scheduler's, or expired."""
    raw, signature, signed = _open(token, PASS_VERSION, "job pass")
    try:
        issued = JobPass(job_id=str(raw["job"]), role=str(raw["r"]), expires_at=int(raw["exp"]))
    except (ValueError, KeyError, TypeError) as err:
        raise CapabilityError(f"malformed job pass ({type(err).__name__})") from None
    try:
        scheduler_key.verify(signature, signed)
    except InvalidSignature:
        raise CapabilityError("job pass not signed by the scheduler") from None
    if (now if now is not None else time.time()) > issued.expires_at + CLOCK_SKEW_S:
        raise CapabilityError("job pass expired")
    return issued
