"""Mutual TLS with a certificate per role, over real gRPC servers: each service
serves with its own role's certificate from the run's CA; a client that means to
reach one role refuses a server holding another's, and a server refuses a
client with no certificate or one from another run's CA. The handshake decides,
before any credential or capability is looked at.

The servers are the real ones (reflow.rpc.make_server with the real services
behind them); each reads its certificate from the environment when it starts,
as `reflow serve` does, and clients read theirs when they open a channel.
"""

from __future__ import annotations

import os
import subprocess  # nosec B404 # the CLI
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from reflow import rpc, rpcauth, tlscerts
from reflow.replay.client import GrpcReplayClient
from reflow.replay.server import serve as serve_replay
from reflow.replay.store import ReplayStore
from reflow.rollout import server as rollout_server
from reflow.rollout.service import RolloutService
from reflow.scheduler.server import serve as serve_scheduler
from reflow.trainer import server as trainer_server
from reflow.trainer.service import TrainerService
from reflow.worker import server as worker_server
from reflow.worker.service import HybridWorker

from tests.integration.api_fixtures import RecordOnlyScheduler

pytestmark = pytest.mark.security

ENVS = (tlscerts.TLS_ENV, tlscerts.TLS_CERT_ENV, tlscerts.TLS_KEY_ENV, tlscerts.TLS_CA_ENV,
        tlscerts.TLS_SERVER_NAME_ENV, tlscerts.TLS_DIR_ENV, rpc.HEALTH_PORT_ENV)


def _use(monkeypatch, directory, role: str) -> None:
    """This process's TLS settings become those of a `role` service of the run
    whose certificates are in `directory`."""
    monkeypatch.setenv(tlscerts.TLS_ENV, "on")
    monkeypatch.setenv(tlscerts.TLS_CERT_ENV, str(directory / f"{role}.crt"))
    monkeypatch.setenv(tlscerts.TLS_KEY_ENV, str(directory / f"{role}.key"))
    monkeypatch.setenv(tlscerts.TLS_CA_ENV, str(directory / tlscerts.CA_FILE))


def _health(channel: grpc.Channel) -> grpc.StatusCode:
    """A health check's outcome: it needs no credential, so only TLS can refuse it."""
    try:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def _dial(address: str, role: str) -> grpc.StatusCode:
    """A health check from this process, meaning to reach a `role` service."""
    with rpc.channel(address, role) as ch:
        return _health(ch)


@pytest.fixture
def run_certs(tmp_path):
    return tlscerts.mint(tmp_path / "run")


@pytest.fixture
def other_run_certs(tmp_path):
    return tlscerts.mint(tmp_path / "other-run")


@pytest.fixture
def services(run_certs, redis_server, redis_client, tmp_path, monkeypatch):
    """The services of one run, each on a server of its own holding its role's
    certificate (the AsyncHybrid worker: the worker's): role -> address."""
    from reflow.core.paths import PathRoots
    from reflow.scheduler.jobcontrol.jobs import JobStore
    from reflow.scheduler.cluster.local import LocalBackend

    for env in ENVS:
        monkeypatch.delenv(env, raising=False)
    rollout, trainer = RolloutService(), TrainerService()
    hybrid_rollout, hybrid_trainer = RolloutService(), TrainerService()
    scheduler = RecordOnlyScheduler(JobStore(redis_client), LocalBackend(redis_server.url),
                                    PathRoots(tmp_path, tmp_path, tmp_path))

    def worker(address):
        adders = (rollout_server.register(hybrid_rollout), trainer_server.register(hybrid_trainer),
                  worker_server.register(HybridWorker(hybrid_rollout, hybrid_trainer)))
        return rpc.make_server(
            (rollout_server.SERVICE_NAME, trainer_server.SERVICE_NAME, worker_server.SERVICE_NAME),
            lambda server: [add(server) for add in adders], address)

    starts = {
        "replay": lambda a: serve_replay(ReplayStore.from_url(redis_server.url), a),
        "rollout": lambda a: rollout_server.serve(rollout, a),
        "trainer": lambda a: trainer_server.serve(trainer, a),
        "worker": worker,
        "scheduler": lambda a: serve_scheduler(scheduler, a),
    }
    servers, addresses = [], {}
    for role, start in starts.items():
        _use(monkeypatch, run_certs, role)
        server, port = start("127.0.0.1:0")
        servers.append(server)
        addresses[role] = f"127.0.0.1:{port}"
    # This process is a client of the run from here on, as the API.
    _use(monkeypatch, run_certs, "api")
    yield addresses
    for server in servers:
        server.stop(0)
    scheduler.shutdown()
    for service in (rollout, hybrid_rollout):
        service.shutdown()


def test_a_client_accepts_only_a_server_whose_certificate_names_the_role_it_dials(services):
    """The rollout server cannot pass for the scheduler or the replay buffer; the
    worker passes for what it serves (rollout, trainer, worker) and nothing else."""
    wrong = []
    for server_role, address in services.items():
        for meant in tlscerts.ROLES:
            code = _dial(address, meant)
            expected = (grpc.StatusCode.OK if meant in tlscerts.SERVES[server_role]
                        else grpc.StatusCode.UNAVAILABLE)
            if code != expected:
                wrong.append(f"{server_role} server dialled as {meant}: {code.name}")
    assert not wrong, wrong
    # The clients themselves name the role they call: the scheduler's client refuses
    # the rollout server before a call is made.
    from reflow.core.errors import Unavailable
    from reflow.scheduler.client import GrpcSchedulerClient

    client = GrpcSchedulerClient(services["rollout"], deadline_s=3)
    with pytest.raises(Unavailable):
        client.get("job-x")
    client.close()
    # Through the real client, with a real call: the buffer is reached as itself.
    replay = GrpcReplayClient(services["replay"], retry_s=0)
    assert replay.stats("job-tls").policy_version == 0
    replay.close()


def test_a_client_without_a_certificate_of_the_run_is_refused_by_every_service(
        services, run_certs, other_run_certs, monkeypatch):
    ca = (run_certs / tlscerts.CA_FILE).read_bytes()
    strangers = {
        "plaintext": None,
        "no client certificate": grpc.ssl_channel_credentials(root_certificates=ca),
        # Signed by another run's CA: a certificate, but not one of this run.
        "another run's certificate": grpc.ssl_channel_credentials(
            root_certificates=ca,
            private_key=(other_run_certs / "scheduler.key").read_bytes(),
            certificate_chain=(other_run_certs / "scheduler.crt").read_bytes()),
    }
    wrong = []
    for role, address in services.items():
        name = tlscerts.dns_name(tlscerts.SERVES[role][0])
        for what, credentials in strangers.items():
            if credentials is None:
                channel = grpc.insecure_channel(address)
            else:
                channel = grpc.secure_channel(address, credentials, options=[
                    ("grpc.ssl_target_name_override", name)])
            with channel:
                code = _health(channel)
            if code != grpc.StatusCode.UNAVAILABLE:
                wrong.append(f"{role} with {what}: {code.name}")
        # The same process with this run's certificate gets through.
        assert _dial(address, tlscerts.SERVES[role][0]) == grpc.StatusCode.OK, role
    assert not wrong, wrong


def test_a_server_holding_another_runs_certificate_is_refused(run_certs, other_run_certs,
                                                              redis_server, monkeypatch):
    """A replay buffer of another run, with a certificate naming the right role,
    is not this run's: its CA is not the one this client trusts."""
    for env in ENVS:
        monkeypatch.delenv(env, raising=False)
    _use(monkeypatch, other_run_certs, "replay")
    server, port = serve_replay(ReplayStore.from_url(redis_server.url), "127.0.0.1:0")
    try:
        _use(monkeypatch, run_certs, "trainer")
        assert _dial(f"127.0.0.1:{port}", "replay") == grpc.StatusCode.UNAVAILABLE
        _use(monkeypatch, other_run_certs, "trainer")
        assert _dial(f"127.0.0.1:{port}", "replay") == grpc.StatusCode.OK
    finally:
        server.stop(0)


def test_health_checks_stay_plaintext_on_a_port_of_their_own(run_certs, redis_server,
                                                            monkeypatch):
    """What the kubelet's gRPC probe needs under TLS: health alone, in plaintext,
    on REFLOW_GRPC_HEALTH_PORT; the service port takes TLS only."""
    from reflow import procs

    for env in ENVS:
        monkeypatch.delenv(env, raising=False)
    health_port = procs.free_ports(1)[0]
    _use(monkeypatch, run_certs, "replay")
    monkeypatch.setenv(rpc.HEALTH_PORT_ENV, str(health_port))
    server, port = serve_replay(ReplayStore.from_url(redis_server.url), "127.0.0.1:0")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{health_port}") as ch:
            assert _health(ch) == grpc.StatusCode.OK
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            assert _health(ch) == grpc.StatusCode.UNAVAILABLE
    finally:
        server.health_server.stop(0)
        server.stop(0)


def test_a_run_mints_a_certificate_per_role_and_gives_each_service_only_its_own_key(
        tmp_path, monkeypatch):
    from cryptography import x509

    for env in ENVS:
        monkeypatch.setenv(env, "")  # restored after: setup_local_run sets them
    directory = tmp_path / "run" / "tls"
    assert tlscerts.setup_local_run(directory) == ""
    ca = x509.load_pem_x509_certificate((directory / tlscerts.CA_FILE).read_bytes())
    files = {p.name for p in directory.iterdir()}
    assert files == {tlscerts.CA_FILE, *(f"{r}.{x}" for r in tlscerts.ROLES for x in ("crt", "key"))}
    assert directory.stat().st_mode & 0o777 == 0o700
    for role in tlscerts.ROLES:
        assert (directory / f"{role}.key").stat().st_mode & 0o777 == 0o600
        cert = x509.load_pem_x509_certificate((directory / f"{role}.crt").read_bytes())
        cert.verify_directly_issued_by(ca)
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert names.get_values_for_type(x509.DNSName) == tlscerts.role_names(role)
    assert tlscerts.role_names("worker") == ["worker.reflow.internal", "rollout.reflow.internal",
                                             "trainer.reflow.internal"]
    # The launcher is a client as the API; each service it starts gets its own key,
    # and the directory only the scheduler, which starts the job's services.
    assert os.environ[tlscerts.TLS_KEY_ENV] == str(directory / "api.key")
    for role in ("scheduler", "api", "replay", "rollout", "trainer", "worker"):
        env = rpcauth.tls_env(role)
        keys = [v for v in env.values() if v.endswith(".key")]
        assert keys == [str(directory / f"{role}.key")], role
        assert env[tlscerts.TLS_DIR_ENV] == (str(directory) if role == "scheduler" else "")
        assert env[tlscerts.TLS_ENV] == "on"
    # A process holding only its own certificate cannot give a service another's.
    monkeypatch.setenv(tlscerts.TLS_DIR_ENV, "")
    with pytest.raises(ValueError, match="REFLOW_TLS_DIR"):
        rpcauth.tls_env("replay")
    monkeypatch.setenv(tlscerts.TLS_DIR_ENV, str(directory))
    # A resume mints again: a new CA, the old one's certificates no longer trusted.
    tlscerts.setup_local_run(directory)
    again = x509.load_pem_x509_certificate((directory / tlscerts.CA_FILE).read_bytes())
    assert again.subject != ca.subject and again.public_key() != ca.public_key()


def test_plaintext_only_when_asked_and_bad_settings_are_named(tmp_path, monkeypatch):
    for env in ENVS:
        monkeypatch.setenv(env, "")
    warning = tlscerts.setup_local_run(tmp_path / "tls", plaintext=True)
    assert "TLS is OFF" in warning and not (tmp_path / "tls").exists()
    assert rpcauth.TlsFiles.from_env() is None and rpcauth.tls_env("replay") == {}
    monkeypatch.setenv(tlscerts.TLS_ENV, "maybe")
    with pytest.raises(ValueError, match="REFLOW_TLS='maybe'"):
        tlscerts.TlsSettings.from_env()
    monkeypatch.setenv(tlscerts.TLS_ENV, "on")
    with pytest.raises(ValueError, match="REFLOW_TLS_CERT_FILE"):
        tlscerts.TlsSettings.from_env()
    # `reflow serve` says so before serving anything.
    env = {**os.environ, tlscerts.TLS_ENV: "on", tlscerts.TLS_CERT_ENV: "",
           **rpcauth.role_env(None)}
    result = subprocess.run([sys.executable, "-m", "reflow.cli", "serve", "replay",  # nosec
                             "--port", "0"], env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode != 0
    assert "REFLOW_TLS=on: set REFLOW_TLS_CERT_FILE" in result.stderr, result.stderr
