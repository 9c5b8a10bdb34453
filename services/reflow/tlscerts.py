"""gRPC's mutual TLS identities: a certificate per service role, the names
clients check, the settings each process reads, and the certificates a local
run mints for itself.

Identities. A deployment (one `reflow run`, one Helm release) has a CA of its
own, and each role one certificate from it, server and client at once, that
names the role in its subjectAltName as `<role>.reflow.internal`:

    api, scheduler, replay, rollout, trainer,  their own name
    sandbox
    worker                                     worker, rollout and trainer: an
                                               AsyncHybrid worker serves the
                                               Rollout, Trainer and Worker
                                               services on one port

A client checks the callee's certificate against the name of the role it means
to reach (`TlsSettings.target_name`; each client class knows its service), and a
server requires a client certificate from the same CA. So a rollout process
cannot answer as the scheduler or the replay buffer, a process without a
certificate of this deployment is refused at the handshake, and so is one from
another run's CA. Pods are dialled by IP: the names are roles, not hosts, and
resolve nowhere.

What a certificate does not prove: what its holder may ask. That is the
capabilities' and job passes' job (reflow.rpcauth); TLS keeps the channel
private and the callee honest.

Settings, from the environment (`TlsSettings.from_env`):

    REFLOW_TLS              on | off | auto (default). on: TLS required, a
                            process without its certificate refuses to start;
                            off: plaintext whatever else is set, logged loudly
                            (for debugging); auto: TLS when a certificate is set
    REFLOW_TLS_CERT_FILE    this process's certificate (PEM), and
    REFLOW_TLS_KEY_FILE     its private key
    REFLOW_TLS_CA_FILE      the deployment's CA; with it, servers require client
                            certificates from it (mutual TLS)
    REFLOW_TLS_SERVER_NAME  one name for every service: a certificate that all
                            pods share (the old scheme: it proves "a pod of this
                            deployment", not a role). Unset: per-role names
    REFLOW_TLS_DIR          a run's per-role certificates (`mint`): the process
                            that starts services gives each its own files

`reflow run` mints per run (`setup_local_run`): a fresh CA and every role's
certificate in `<run_dir>/tls`, keys mode 0600, the CA's key never written (no
one can mint another certificate for the run); each service it starts is
given only its own key. On Kubernetes the chart mints the same set (or
cert-manager issues it). No gRPC here: rpcauth and rpc build the credentials.
"""

from __future__ import annotations

import datetime
import os
import secrets
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

TLS_ENV = "REFLOW_TLS"
TLS_CERT_ENV = "REFLOW_TLS_CERT_FILE"
TLS_KEY_ENV = "REFLOW_TLS_KEY_FILE"
TLS_CA_ENV = "REFLOW_TLS_CA_FILE"
TLS_SERVER_NAME_ENV = "REFLOW_TLS_SERVER_NAME"
TLS_DIR_ENV = "REFLOW_TLS_DIR"

NAME_SUFFIX = "reflow.internal"
# Role -> the roles whose services a process of it serves (its certificate's names).
SERVES: dict[str, tuple[str, ...]] = {
    "api": ("api",), "scheduler": ("scheduler",), "replay": ("replay",),
    "rollout": ("rollout",), "trainer": ("trainer",),
    "worker": ("worker", "rollout", "trainer"),
    # Rollout workers dial it as "sandbox" (reflow.sandbox.grpc_client).
    "sandbox": ("sandbox",),
}
ROLES = tuple(SERVES)
# The roles that start other services locally, and so are handed the run's
# certificate directory (the scheduler's local backend).
STARTS_SERVICES = frozenset({"scheduler"})
CA_FILE = "ca.crt"
# A local run's certificates outlive any run; a resumed run gets new ones.
LOCAL_VALIDITY_DAYS = 365
# Clocks of one machine agree; Kubernetes nodes' may not (the chart backdates too).
BACKDATE_S = 300


def dns_name(role: str) -> str:
    """The name a certificate carries, and a client checks, for `role`."""
    return f"{role}.{NAME_SUFFIX}"


def role_names(role: str) -> list[str]:
    """Every name the certificate of a process of `role` carries."""
    if role not in SERVES:
        raise ValueError(f"TLS role {role!r} is not one of {', '.join(ROLES)}")
    return [dns_name(r) for r in SERVES[role]]


class TlsSettings(BaseModel):
    """How this process speaks gRPC: with TLS and which files, or in plaintext."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["auto", "on", "off"] = Field(
        default="auto", description="REFLOW_TLS: on (required), off (plaintext), or auto "
                                    "(TLS when a certificate is set).")
    cert_file: str = Field(default="", description="REFLOW_TLS_CERT_FILE: this process's "
                                                   "certificate (PEM).")
    key_file: str = Field(default="", description="REFLOW_TLS_KEY_FILE: its private key (PEM).")
    ca_file: str = Field(default="", description="REFLOW_TLS_CA_FILE: the deployment's CA; "
                                                 "servers then require client certificates.")
    server_name: str = Field(default="", description="REFLOW_TLS_SERVER_NAME: one name every "
                                                     "service's certificate carries (shared "
                                                     "certificate); empty: per-role names.")
    directory: str = Field(default="", description="REFLOW_TLS_DIR: a run's per-role "
                                                   "certificates, for the services this "
                                                   "process starts.")

    @classmethod
    def from_env(cls) -> "TlsSettings":
        """The settings in the environment; a bad value raises ValueError naming
        the variable and the fix. An empty variable counts as unset."""
        envs = {"mode": TLS_ENV, "cert_file": TLS_CERT_ENV, "key_file": TLS_KEY_ENV,
                "ca_file": TLS_CA_ENV, "server_name": TLS_SERVER_NAME_ENV,
                "directory": TLS_DIR_ENV}
        values = {field: os.environ[env].strip() for field, env in envs.items()
                  if os.environ.get(env, "").strip()}
        if "mode" in values:
            values["mode"] = values["mode"].lower()
        try:
            settings = cls.model_validate(values)
        except ValidationError as err:
            field = str(err.errors()[0]["loc"][0])
            raise ValueError(f"{envs[field]}={values.get(field)!r}: "
                             f"{err.errors()[0]['msg']}") from None
        settings.check()
        return settings

    def check(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError(f"TLS needs both {TLS_CERT_ENV} and {TLS_KEY_ENV} (this "
                             "service's certificate and its key), or neither")
        if self.mode == "on" and not (self.cert_file and self.ca_file):
            raise ValueError(
                f"{TLS_ENV}=on: set {TLS_CERT_ENV}, {TLS_KEY_ENV} and {TLS_CA_ENV} (this "
                f"service's certificate, its key and the deployment's CA; `python -m "
                f"reflow.tlscerts DIR` mints a set), or {TLS_ENV}=off to run without TLS")

    @property
    def enabled(self) -> bool:
        return self.mode != "off" and bool(self.cert_file)

    @property
    def plaintext_reason(self) -> str:
        """Why this process speaks plaintext ('' when it does not)."""
        if self.mode == "off":
            return f"{TLS_ENV}=off"
        return "" if self.cert_file else f"no certificate ({TLS_CERT_ENV} unset)"

    def target_name(self, role: str | None) -> str:
        """The name a client checks the callee's certificate against when it
        dials a service of `role`."""
        if self.server_name:
            return self.server_name
        if not role:
            raise ValueError(f"with TLS on, a client must name the role it dials (its "
                             f"certificate is checked for it), or set {TLS_SERVER_NAME_ENV} "
                             "for a certificate every service shares")
        if role not in SERVES:
            raise ValueError(f"TLS role {role!r} is not one of {', '.join(ROLES)}")
        return dns_name(role)


def files_env(role: str) -> dict[str, str]:
    """The TLS environment of a service of `role` that this process starts: that
    role's certificate and key from the run's directory (REFLOW_TLS_DIR), no
    other key; the directory itself only for a role that starts services in
    turn. Empty where the child is to inherit this process's settings
    (plaintext, or one certificate that every service shares)."""
    settings = TlsSettings.from_env()
    if role not in SERVES:
        raise ValueError(f"TLS role {role!r} is not one of {', '.join(ROLES)}")
    if not settings.enabled or (settings.server_name and not settings.directory):
        return {}
    if not settings.directory:
        # This process's certificate names its own role: the child would answer as it.
        raise ValueError(f"starting a {role} service under TLS needs {TLS_DIR_ENV}, the "
                         "directory of the run's per-role certificates (`python -m "
                         "reflow.tlscerts DIR` mints one), so that it gets its own")
    directory = Path(settings.directory)
    return {TLS_ENV: "on", TLS_CERT_ENV: str(directory / f"{role}.crt"),
            TLS_KEY_ENV: str(directory / f"{role}.key"), TLS_CA_ENV: str(directory / CA_FILE),
            TLS_SERVER_NAME_ENV: "",
            TLS_DIR_ENV: str(directory) if role in STARTS_SERVICES else ""}


# --- minting -----------------------------------------------------------------


def _write(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.fchmod(fd, mode)  # an older file keeps its mode through O_CREAT
        os.write(fd, data)
    finally:
        os.close(fd)


def mint(directory: Path, roles: tuple[str, ...] = ROLES,
         validity_days: int = LOCAL_VALIDITY_DAYS) -> Path:
    """A new CA and, signed by it, a certificate and key per role in `directory`
    (`ca.crt`, `<role>.crt`, `<role>.key`; keys 0600, the directory 0700);
    files of an earlier mint are replaced. The CA's key is dropped once they
    are signed: nothing can mint another certificate of this set."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)
    start = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=BACKDATE_S)
    end = start + datetime.timedelta(days=validity_days)

    def named(common_name: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "reflow"),
                          x509.NameAttribute(NameOID.COMMON_NAME, common_name)])

    def usage(ca: bool) -> x509.KeyUsage:
        return x509.KeyUsage(digital_signature=True, key_cert_sign=ca, crl_sign=ca,
                             content_commitment=False, key_encipherment=False,
                             data_encipherment=False, key_agreement=False,
                             encipher_only=False, decipher_only=False)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    # A random CA name: two runs' CAs never pass for one another, even by name.
    ca_name = named(f"reflow gRPC CA {secrets.token_hex(6)}")
    ca_cert = (x509.CertificateBuilder()
               .subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(start).not_valid_after(end)
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(usage(ca=True), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
                              critical=False)
               .sign(ca_key, hashes.SHA256()))
    authority = x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key())
    for role in roles:
        key = ec.generate_private_key(ec.SECP256R1())
        names = role_names(role)
        cert = (x509.CertificateBuilder()
                .subject_name(named(names[0])).issuer_name(ca_name).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(start).not_valid_after(end)
                .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in names]),
                               critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(usage(ca=False), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]),
                               critical=False)
                .add_extension(authority, critical=False)
                .sign(ca_key, hashes.SHA256()))
        _write(directory / f"{role}.key", key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()), 0o600)
        _write(directory / f"{role}.crt", cert.public_bytes(serialization.Encoding.PEM), 0o644)
    _write(directory / CA_FILE, ca_cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return directory


def setup_local_run(directory: Path, plaintext: bool = False) -> str:
    """This launcher's TLS, set in its environment for every service it starts:
    a fresh CA and per-role certificates in `directory`, this process itself a
    client as the API (it submits and stops jobs on the API's behalf). With
    `plaintext` (or REFLOW_TLS=off already set), none: every service speaks
    plaintext. Returns a warning to show the user ('' with TLS on)."""
    if plaintext or os.environ.get(TLS_ENV, "").strip().lower() == "off":
        os.environ[TLS_ENV] = "off"
        return (f"WARNING: gRPC TLS is OFF for this run ({TLS_ENV}=off or "
                "--insecure-plaintext): the services' calls, job passes and credential "
                "cross loopback in the clear, and any local process can pose as a service. "
                "For debugging only.")
    mint(directory)
    os.environ.update({TLS_ENV: "on", TLS_DIR_ENV: str(directory),
                       TLS_CERT_ENV: str(directory / "api.crt"),
                       TLS_KEY_ENV: str(directory / "api.key"),
                       TLS_CA_ENV: str(directory / CA_FILE)})
    os.environ.pop(TLS_SERVER_NAME_ENV, None)
    return ""


def main(argv: list[str] | None = None) -> int:
    """`python -m reflow.tlscerts DIR`: mint a CA and every role's certificate
    into DIR (for services started by hand), and print each role's settings."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--days", type=int, default=LOCAL_VALIDITY_DAYS,
                        help="validity of the certificates, in days")
    args = parser.parse_args(argv)
    if args.days < 1:
        parser.error("--days: at least 1")
    directory = mint(args.directory.absolute(), validity_days=args.days)
    for role in ROLES:
        extra = f" {TLS_DIR_ENV}={directory}" if role in STARTS_SERVICES else ""
        print(f"{role}: {TLS_ENV}=on {TLS_CERT_ENV}={directory}/{role}.crt "
              f"{TLS_KEY_ENV}={directory}/{role}.key {TLS_CA_ENV}={directory}/{CA_FILE}{extra}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
