"""A hostile client on the cluster network, over real gRPC: every RPC of every
service, enumerated from the proto descriptors (a new RPC is covered without
editing this file), is called with no credential, a wrong one, and the right
deployment credential with another job's token. Each is refused with the right
code, and Redis (the replay buffer's state and its grants) is unchanged after.

The servers are the real ones (reflow.rpc.make_server with its interceptors,
the real services behind them, a real Redis); the hostile calls go over a plain
channel that adds nothing of this process's credentials.
"""

from __future__ import annotations

import os
import subprocess  # nosec B404 # openssl and the CLI
from pathlib import Path

import grpc
import pytest
from google.protobuf import message_factory

from reflow import rpc, rpcauth
from reflow.replay.server import serve as serve_replay
from reflow.replay.store import ReplayStore
from reflow.rollout.server import serve as serve_rollout
from reflow.rollout.service import RolloutService
from reflow.scheduler.server import serve as serve_scheduler
from reflow.trainer.server import serve as serve_trainer
from reflow.trainer.service import TrainerService
from reflow.v1 import (common_pb2, replay_pb2, rollout_pb2, scheduler_pb2, trainer_pb2,
                       trainer_pb2_grpc, worker_pb2)
from reflow.worker.server import register as register_worker
from reflow.worker.service import HybridWorker

from tests.integration.api_fixtures import RecordOnlyScheduler

pytestmark = pytest.mark.security

JOB_A, JOB_B = "job-a", "job-b"
TOKEN_A, TOKEN_B = "token-of-job-a-0123456789abcdef", "token-of-job-b-0123456789abcdef"
PROTO_MODULES = (common_pb2, replay_pb2, rollout_pb2, scheduler_pb2, trainer_pb2, worker_pb2)


def every_rpc():
    """(service, method descriptor) for every RPC the protos declare."""
    for module in PROTO_MODULES:
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                yield service.full_name, method


def _request(method, job_id: str):
    cls = message_factory.GetMessageClass(method.input_type)
    fields = {f.name for f in method.input_type.fields}
    return cls(job_id=job_id) if "job_id" in fields else cls()


def _call(address: str, service: str, method, request, metadata) -> grpc.StatusCode:
    """The call's status code, over a plain channel with exactly `metadata`."""
    response_cls = message_factory.GetMessageClass(method.output_type)
    with grpc.insecure_channel(address) as ch:
        call = ch.unary_unary(f"/{service}/{method.name}",
                              request_serializer=lambda m: m.SerializeToString(),
                              response_deserializer=response_cls.FromString)
        try:
            call(request, metadata=metadata, timeout=5)
        except grpc.RpcError as err:
            return err.code()
    return grpc.StatusCode.OK


def _redis_state(client) -> dict[bytes, bytes]:
    return {key: client.dump(key) for key in sorted(client.keys("*"))}


@pytest.fixture
def cluster(redis_server, redis_client, tmp_path):
    """Each service on a server of its own, as in a release; jobs A and B granted
    on each by the scheduler's path (a control call carrying the job's token)."""
    from reflow.core.paths import PathRoots
    from reflow.scheduler.jobs import JobStore
    from reflow.scheduler.local import LocalBackend

    rollout, trainer = RolloutService(), TrainerService()
    scheduler = RecordOnlyScheduler(JobStore(redis_client), LocalBackend(redis_server.url),
                                    PathRoots(tmp_path, tmp_path, tmp_path))
    servers = [serve_replay(ReplayStore.from_url(redis_server.url), "127.0.0.1:0"),
               serve_rollout(rollout, "127.0.0.1:0"), serve_trainer(trainer, "127.0.0.1:0"),
               rpc.make_server("reflow.v1.Worker",
                               register_worker(HybridWorker(rollout, trainer)), "127.0.0.1:0"),
               serve_scheduler(scheduler, "127.0.0.1:0")]
    names = ("reflow.v1.ReplayBuffer", "reflow.v1.Rollout", "reflow.v1.Trainer",
             "reflow.v1.Worker", "reflow.v1.Scheduler")
    addresses = {name: f"127.0.0.1:{port}" for name, (_, port) in zip(names, servers)}
    creds = rpcauth.credentials()
    for name in names[:-1]:
        for job, token in ((JOB_A, TOKEN_A), (JOB_B, TOKEN_B)):
            method = next(m for s, m in every_rpc() if s == name and m.name in
                          ("GetStats", "GetStatus", "GetRole"))
            _call(addresses[name], name, method, _request(method, job),
                  [(rpcauth.CREDENTIAL_KEY, creds.credential),
                   (rpcauth.CONTROL_KEY, creds.control), (rpcauth.JOB_TOKEN_KEY, token)])
    yield addresses, trainer
    for server, _ in servers:
        server.stop(0)
    scheduler.shutdown()
    rollout.shutdown()


def test_every_rpc_is_refused_without_credential_or_with_another_jobs_token(cluster,
                                                                           redis_client):
    addresses, trainer = cluster
    credential = rpcauth.credentials().credential
    before = _redis_state(redis_client)
    assert any(key == rpcauth.RedisGrants.KEY.encode() for key in before)  # A and B granted
    hostile = {
        "no credential": ([], grpc.StatusCode.UNAUTHENTICATED),
        "a wrong credential": ([(rpcauth.CREDENTIAL_KEY, "not-the-credential-0123456789")],
                               grpc.StatusCode.UNAUTHENTICATED),
        "job B's token for job A": ([(rpcauth.CREDENTIAL_KEY, credential),
                                     (rpcauth.JOB_TOKEN_KEY, TOKEN_B)],
                                    grpc.StatusCode.PERMISSION_DENIED),
        # The control credential's digest is what services hold; it is no credential.
        "the control credential's digest": ([(rpcauth.CREDENTIAL_KEY, credential),
                                             (rpcauth.CONTROL_KEY,
                                              rpcauth.credentials().control_digest),
                                             (rpcauth.JOB_TOKEN_KEY, TOKEN_B)],
                                            grpc.StatusCode.PERMISSION_DENIED),
    }
    covered, wrong = 0, []
    for service, method in every_rpc():
        covered += 1
        for what, (metadata, expected) in hostile.items():
            code = _call(addresses[service], service, method, _request(method, JOB_A), metadata)
            if code != expected:
                wrong.append(f"{service}/{method.name} with {what}: {code.name}")
    assert not wrong, wrong
    assert covered == sum(len(m.DESCRIPTOR.services_by_name[s].methods)
                          for m in PROTO_MODULES for s in m.DESCRIPTOR.services_by_name)
    assert covered >= 33, covered
    assert _redis_state(redis_client) == before, "a refused call wrote to Redis"
    assert trainer.state == "idle"

    # The same calls with job A's own token pass authorization (whatever the empty
    # request then gets); the scheduler's calls need the control credential.
    for service, method in every_rpc():
        control = f"/{service}/{method.name}" in rpcauth.control_methods([service])
        metadata = [(rpcauth.CREDENTIAL_KEY, credential), (rpcauth.JOB_TOKEN_KEY, TOKEN_A)]
        if control:
            continue
        code = _call(addresses[service], service, method, _request(method, JOB_A), metadata)
        assert code not in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED), \
            f"{service}/{method.name} refused job A's own token: {code.name}"


def test_an_idle_trainer_takes_no_peers_from_anyone_but_the_scheduler(cluster, tmp_path,
                                                                      tiny_model):
    """The attack: point an idle trainer at a fake replay and rollout worker, so that
    after one step it broadcasts a model's weights to the caller. Without the
    control credential, StartJob and Reconfigure are refused before the trainer
    reads them, whatever job token the caller makes up."""
    from reflow.core.config import parse_job_spec

    addresses, trainer = cluster
    credential = rpcauth.credentials().credential
    spec = parse_job_spec({"model": {"path": tiny_model}, "trainer": {"batch_size": 8}})
    made_up = "a-token-the-caller-made-up-0123456789"
    with grpc.insecure_channel(addresses["reflow.v1.Trainer"]) as ch:
        stub = trainer_pb2_grpc.TrainerStub(ch)
        for job in ("attack", JOB_A):
            with pytest.raises(grpc.RpcError) as err:
                stub.StartJob(common_pb2.StartJobRequest(
                    job_id=job, spec_json=spec.model_dump_json(), replay_address="10.0.0.66:1",
                    rollout_addresses=["10.0.0.66:2"], trainer_peers=["10.0.0.66:3"]),
                    metadata=[(rpcauth.CREDENTIAL_KEY, credential),
                              (rpcauth.JOB_TOKEN_KEY, made_up if job == "attack" else TOKEN_A)],
                    timeout=10)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "only the scheduler" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            stub.Reconfigure(trainer_pb2.ReconfigureRequest(job_id=JOB_A,
                                                            trainer_peers=["10.0.0.66:3"]),
                             metadata=[(rpcauth.CREDENTIAL_KEY, credential),
                                       (rpcauth.JOB_TOKEN_KEY, TOKEN_A)], timeout=10)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert trainer.state == "idle"


def test_a_job_a_server_was_never_granted_is_not_found_and_nothing_is_written(cluster,
                                                                             redis_client):
    addresses, _ = cluster
    before = _redis_state(redis_client)
    metadata = [(rpcauth.CREDENTIAL_KEY, rpcauth.credentials().credential),
                (rpcauth.JOB_TOKEN_KEY, TOKEN_A)]
    for service, method in every_rpc():
        if service == "reflow.v1.Scheduler" or \
                f"/{service}/{method.name}" in rpcauth.control_methods([service]):
            continue
        code = _call(addresses[service], service, method, _request(method, "job-never-placed"),
                     metadata)
        assert code == grpc.StatusCode.NOT_FOUND, f"{service}/{method.name}: {code.name}"
    assert _redis_state(redis_client) == before


def test_health_checks_need_no_credential(cluster):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    addresses, _ = cluster
    for address in addresses.values():
        with grpc.insecure_channel(address) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                         timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def _certificates(root: Path) -> dict[str, Path]:
    """A CA, and a certificate for the name "reflow" signed by it (client and server)."""
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=root, check=True, capture_output=True)  # nosec

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
            "ca.crt", "-days", "1", "-subj", "/CN=reflow-test-ca")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "tls.key", "-out", "tls.csr",
            "-subj", "/CN=reflow")
    (root / "san.ext").write_text("subjectAltName=DNS:reflow\nextendedKeyUsage=serverAuth,"
                                  "clientAuth\n")
    openssl("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", "tls.crt", "-days", "1", "-extfile", "san.ext")
    return {"cert": root / "tls.crt", "key": root / "tls.key", "ca": root / "ca.crt"}


def test_mutual_tls_refuses_plain_and_certificate_less_clients(redis_server, redis_client,
                                                               tmp_path, monkeypatch):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    files = _certificates(tmp_path)
    monkeypatch.setenv(rpcauth.TLS_CERT_ENV, str(files["cert"]))
    monkeypatch.setenv(rpcauth.TLS_KEY_ENV, str(files["key"]))
    monkeypatch.setenv(rpcauth.TLS_CA_ENV, str(files["ca"]))
    server, port = serve_replay(ReplayStore.from_url(redis_server.url), "127.0.0.1:0")
    address = f"127.0.0.1:{port}"
    try:
        from reflow.replay.client import GrpcReplayClient

        client = GrpcReplayClient(address, retry_s=0)
        assert client.stats("job-tls").policy_version == 0  # our channel: TLS, both ways
        client.close()
        request = health_pb2.HealthCheckRequest()
        with grpc.insecure_channel(address) as ch, pytest.raises(grpc.RpcError):
            health_pb2_grpc.HealthStub(ch).Check(request, timeout=3)
        # Server verified, but no client certificate: mutual TLS refuses it.
        no_cert = grpc.ssl_channel_credentials(root_certificates=files["ca"].read_bytes())
        with grpc.secure_channel(address, no_cert, options=[
                ("grpc.ssl_target_name_override", "reflow")]) as ch, \
                pytest.raises(grpc.RpcError):
            health_pb2_grpc.HealthStub(ch).Check(request, timeout=3)
    finally:
        server.stop(0)


def test_a_service_will_not_start_without_its_secrets(tmp_path):
    import sys

    base = {k: v for k, v in os.environ.items() if not k.startswith(("REFLOW_GRPC_",
                                                                     "REFLOW_CONTROL_"))}

    def serve(service: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "reflow.cli", "serve", service,  # nosec
                               "--port", "0"], env={**base, **env}, capture_output=True,
                              text=True, timeout=120)

    result = serve("replay")
    assert result.returncode != 0 and "REFLOW_GRPC_CREDENTIAL" in result.stderr
    result = serve("trainer", REFLOW_GRPC_CREDENTIAL="c" * 32)
    assert result.returncode != 0 and "REFLOW_CONTROL_CREDENTIAL_SHA256" in result.stderr
    result = serve("scheduler", REFLOW_GRPC_CREDENTIAL="c" * 32,
                   REFLOW_CONTROL_CREDENTIAL_SHA256="0" * 64)
    assert result.returncode != 0 and "REFLOW_CONTROL_CREDENTIAL" in result.stderr
    result = serve("worker", REFLOW_GRPC_CREDENTIAL="short")
    assert result.returncode != 0 and "at least 16 characters" in result.stderr
