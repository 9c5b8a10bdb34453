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

from reflow import capabilities, rpc, rpcauth
from reflow.core.grants import JOB_TOKENS
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


def _pass(job_id: str, role: str = "trainer") -> str:
    """A job pass as the scheduler hands one to a worker of `role`."""
    return capabilities.issue_pass(rpcauth.credentials().signing["scheduler"], job_id, role)


TOKEN_A, TOKEN_B = _pass(JOB_A), _pass(JOB_B)
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


def _signed(address: str, service: str, method, request, role: str = "scheduler",
            key=None, audience: str | None = None) -> tuple[str, str]:
    """A capability for this call, as the scheduler (or `role`) signs one: with its
    key from this process's credentials unless `key` is another."""
    key = key if key is not None else rpcauth.credentials().signing[role]
    return (rpcauth.CAPABILITY_KEY,
            capabilities.mint(key, role, f"/{service}/{method.name}", audience or address,
                              getattr(request, "job_id", ""), request.SerializeToString()))


def _redis_state(client) -> dict[bytes, bytes]:
    return {key: client.dump(key) for key in sorted(client.keys("*"))}


@pytest.fixture
def cluster(redis_server, redis_client, tmp_path):
    """Each service on a server of its own, as in a release; jobs A and B granted
    on each by the scheduler's path (a control call carrying the job's token)."""
    from reflow.core.paths import PathRoots
    from reflow.scheduler.jobcontrol.jobs import JobStore
    from reflow.scheduler.cluster.local import LocalBackend

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
    # The replay buffer is granted a job by any of the scheduler's calls naming it;
    # the workers by the call that starts it on them, which would start a real job
    # here: its effect on the process's book (the in-memory services') instead.
    method = next(m for s, m in every_rpc() if s == names[0] and m.name == "GetStats")
    for job in (JOB_A, JOB_B):
        request = _request(method, job)
        assert _call(addresses[names[0]], names[0], method, request,
                     [(rpcauth.CREDENTIAL_KEY, creds.credential),
                      _signed(addresses[names[0]], names[0], method, request)]) == \
            grpc.StatusCode.OK
        JOB_TOKENS.grant(job, _pass(job))
    yield addresses, trainer
    JOB_TOKENS.revoke(JOB_A)
    JOB_TOKENS.revoke(JOB_B)
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
    }
    stranger = capabilities.new_private_key()
    covered, wrong = 0, []
    for service, method in every_rpc():
        covered += 1
        address, request = addresses[service], _request(method, JOB_A)
        role = rpcauth.control_methods([service]).get(f"/{service}/{method.name}", "scheduler")
        # Capabilities that grant something else: another key, another server, another
        # method, another body, another role.
        other = next(m for s, m in every_rpc() if s == service and m.name != method.name)
        other_request = _request(method, JOB_B)
        forged = {
            "a capability signed by another key": _signed(address, service, method, request,
                                                          role, key=stranger),
            "a capability for another server": _signed(address, service, method, request, role,
                                                       audience="10.9.9.9:50051"),
            "a capability for another method": _signed(address, service, other, request, role),
        }
        if other_request.SerializeToString() != request.SerializeToString():
            forged["a capability for another request"] = _signed(address, service, method,
                                                                 other_request, role)
        if role == "scheduler" and "reflow.v1.Scheduler" != service:
            forged["the API's capability"] = _signed(address, service, method, request, "api")
        for what, capability in forged.items():
            code = _call(address, service, method, request,
                         [(rpcauth.CREDENTIAL_KEY, credential), capability,
                          (rpcauth.JOB_TOKEN_KEY, TOKEN_B)])
            if code != grpc.StatusCode.PERMISSION_DENIED:
                wrong.append(f"{service}/{method.name} with {what}: {code.name}")
    for service, method in every_rpc():
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

    # The same calls with a pass of job A pass authorization (whatever the empty
    # request then gets) for the roles the table names, and only for those; the
    # control calls need a capability.
    for service, method in every_rpc():
        name = f"/{service}/{method.name}"
        if name in rpcauth.control_methods([service]):
            continue
        allowed = rpcauth.job_callers([service])[name]
        for role in capabilities.PASS_ROLES:
            metadata = [(rpcauth.CREDENTIAL_KEY, credential),
                        (rpcauth.JOB_TOKEN_KEY, _pass(JOB_A, role))]
            code = _call(addresses[service], service, method, _request(method, JOB_A), metadata)
            refused = code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
            assert refused == (role not in allowed), f"{name} with a {role}'s pass: {code.name}"


def test_an_idle_trainer_takes_no_peers_from_anyone_but_the_scheduler(cluster, tmp_path,
                                                                      tiny_model):
    """The attack: point an idle trainer at a fake replay and rollout worker, so that
    after one step it broadcasts a model's weights to the caller. Without the
    scheduler's capability, StartJob and Reconfigure are refused before the trainer
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


def test_a_spent_an_expired_and_a_future_capability_are_refused(cluster):
    """A capability is good once, for two minutes: the call sent again with it (a
    replayed call), or one signed long ago or dated ahead, is PERMISSION_DENIED;
    a fresh one for the same call passes."""
    addresses, _ = cluster
    credential = rpcauth.credentials().credential
    key = rpcauth.credentials().signing["scheduler"]
    service = "reflow.v1.Worker"
    method = next(m for s, m in every_rpc() if s == service and m.name == "GetRole")
    request, address = _request(method, ""), addresses[service]
    name = f"/{service}/{method.name}"

    def call(capability: str) -> grpc.StatusCode:
        return _call(address, service, method, request,
                     [(rpcauth.CREDENTIAL_KEY, credential), (rpcauth.CAPABILITY_KEY, capability)])

    import time

    fresh = capabilities.mint(key, "scheduler", name, address, "", request.SerializeToString())
    assert call(fresh) == grpc.StatusCode.OK
    assert call(fresh) == grpc.StatusCode.PERMISSION_DENIED  # replayed
    old = capabilities.mint(key, "scheduler", name, address, "", request.SerializeToString(),
                            now=time.time() - capabilities.LIFETIME_S
                            - capabilities.CLOCK_SKEW_S - 5)
    assert call(old) == grpc.StatusCode.PERMISSION_DENIED  # expired
    ahead = capabilities.mint(key, "scheduler", name, address, "", request.SerializeToString(),
                              now=time.time() + 3600)
    assert call(ahead) == grpc.StatusCode.PERMISSION_DENIED
    assert call(capabilities.mint(key, "scheduler", name, address, "",
                                  request.SerializeToString())) == grpc.StatusCode.OK


@pytest.mark.parametrize("role", [None, "api"], ids=["rollout-or-trainer", "api"])
def test_a_compromised_process_cannot_make_a_control_call_with_what_it_holds(
        cluster, redis_client, tmp_path, role):
    """A real process with the environment a worker (or the API) is given, after
    the scheduler has made its calls to it (a job started, a sync place set, a
    role asked: it holds their capabilities and job A's token), tries every
    control call on every service, the other job, calls naming no job, and
    capabilities it signs: each is UNAUTHENTICATED or PERMISSION_DENIED, and Redis
    and the services are as they were."""
    import json
    import sys
    import time

    from reflow.v1 import rollout_pb2_grpc, worker_pb2_grpc

    addresses, trainer = cluster
    env = {**os.environ, **rpcauth.role_env(role), "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])}
    hostile = subprocess.Popen([sys.executable, "-m", "tests.integration.hostile_process",  # nosec
                                str(tmp_path)], env=env, cwd=Path(__file__).resolve().parents[2])
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "port").exists():
            assert hostile.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        address = f"127.0.0.1:{(tmp_path / 'port').read_text()}"
        # The scheduler's calls to it, signed as the scheduler signs them.
        with rpc.channel(address) as ch:
            rollout = rollout_pb2_grpc.RolloutStub(ch)
            rollout.StartJob(common_pb2.StartJobRequest(
                job_id=JOB_A, spec_json="{}", replay_address=addresses["reflow.v1.ReplayBuffer"],
                trainer_peers=[addresses["reflow.v1.Trainer"]]), timeout=10)
            rollout.SetSyncPlace(rollout_pb2.SetSyncPlaceRequest(job_id=JOB_A), timeout=10)
            rollout.GetStats(common_pb2.JobRef(job_id=JOB_A), timeout=10)
            worker_pb2_grpc.WorkerStub(ch).GetRole(common_pb2.JobRef(), timeout=10)
            rollout.StopJob(common_pb2.JobRef(job_id=JOB_A), timeout=10)
        before = _redis_state(redis_client)
        (tmp_path / "targets.json").write_text(json.dumps(
            {"addresses": addresses, "job": JOB_A, "other_job": JOB_B}))
        assert hostile.wait(timeout=240) == 0
    finally:
        if hostile.poll() is None:
            hostile.kill()
    report = json.loads((tmp_path / "attempts.json").read_text())
    assert not report["private_key_in_environment"] or role == "api"
    assert report["signing_keys"] == (["REFLOW_API_SIGNING_KEY"] if role else [])
    received = {r["method"].rsplit("/", 1)[1] for r in report["received"]}
    assert {"StartJob", "SetSyncPlace", "GetStats", "GetRole", "StopJob"} <= received
    assert all(rpcauth.CAPABILITY_KEY in r["keys"] for r in report["received"])
    attempts = report["attempts"]
    replayed = [a for a in attempts if "replayed elsewhere" in a["what"]]
    as_rollout = {a["method"].rsplit("/", 1)[1] for a in attempts if a["what"] == "job A as a rollout"}
    assert len(attempts) > 300 and replayed
    assert {"Configure", "PublishVersion", "Sample", "UpdateWeights", "JoinGroup"} <= as_rollout
    # It holds the deployment credential, so each refusal is the authorization's.
    allowed = [a for a in attempts if a["code"] != "PERMISSION_DENIED"]
    assert not allowed, allowed[:10]
    assert _redis_state(redis_client) == before, "a refused call wrote to Redis"
    assert trainer.state == "idle"


def test_an_expired_pass_a_stopped_jobs_pass_and_a_forged_one_are_refused(cluster):
    """A job pass lasts PASS_LIFETIME_S: an old one is PERMISSION_DENIED. Once the
    scheduler stops the job on a worker, the job's passes get NOT_FOUND there. A
    pass signed by any key but the scheduler's is PERMISSION_DENIED."""
    import time

    addresses, _ = cluster
    credential = rpcauth.credentials().credential
    service, job = "reflow.v1.Rollout", "job-c"
    update = next(m for s, m in every_rpc() if s == service and m.name == "UpdateWeights")
    stop = next(m for s, m in every_rpc() if s == service and m.name == "StopJob")
    address = addresses[service]

    def update_with(token: str) -> grpc.StatusCode:
        return _call(address, service, update, _request(update, job),
                     [(rpcauth.CREDENTIAL_KEY, credential), (rpcauth.JOB_TOKEN_KEY, token)])

    JOB_TOKENS.grant(job, _pass(job, "rollout"))
    try:
        fresh = _pass(job)
        assert update_with(fresh) not in (grpc.StatusCode.PERMISSION_DENIED,
                                          grpc.StatusCode.NOT_FOUND)  # authorized
        expired = capabilities.issue_pass(
            rpcauth.credentials().signing["scheduler"], job, "trainer",
            now=time.time() - capabilities.PASS_LIFETIME_S - capabilities.CLOCK_SKEW_S - 1)
        assert update_with(expired) == grpc.StatusCode.PERMISSION_DENIED
        forged = capabilities.issue_pass(capabilities.new_private_key(), job, "trainer")
        assert update_with(forged) == grpc.StatusCode.PERMISSION_DENIED
        request = _request(stop, job)
        _call(address, service, stop, request, [(rpcauth.CREDENTIAL_KEY, credential),
                                                _signed(address, service, stop, request)])
        assert not JOB_TOKENS.granted(job)
        assert update_with(fresh) == grpc.StatusCode.NOT_FOUND  # revoked with the job
    finally:
        JOB_TOKENS.revoke(job)


def test_a_probe_through_the_other_service_leaves_a_hybrid_workers_pass_as_it_is(cluster):
    """A new scheduler re-adopting a job asks each worker through both services; the
    rollout pass its Rollout call carries must not replace the pass of a process
    that runs the job as its trainer (its next Release would be refused), while a
    fresh pass of the same role does replace it."""
    addresses, _ = cluster
    credential = rpcauth.credentials().credential
    service, job = "reflow.v1.Rollout", "job-d"
    method = next(m for s, m in every_rpc() if s == service and m.name == "GetStats")
    address, request = addresses[service], _request(method, job)
    import time

    held = capabilities.issue_pass(rpcauth.credentials().signing["scheduler"], job, "trainer",
                                   now=time.time() - 60)  # older: a fresh one differs
    JOB_TOKENS.grant(job, held)
    try:
        for role in ("rollout", "trainer"):
            fresh = _pass(job, role)
            _call(address, service, method, request,
                  [(rpcauth.CREDENTIAL_KEY, credential),
                   _signed(address, service, method, request), (rpcauth.JOB_TOKEN_KEY, fresh)])
            expected = held if role == "rollout" else fresh
            assert held != fresh and JOB_TOKENS.token(job) == expected, role
    finally:
        JOB_TOKENS.revoke(job)


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
    # One certificate that every service shares names one name, which every client
    # checks (per-role certificates: test_tls_roles.py).
    monkeypatch.setenv(rpcauth.TLS_SERVER_NAME_ENV, "reflow")
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

    base = {k: v for k, v in os.environ.items() if not k.startswith(
        ("REFLOW_GRPC_", "REFLOW_API_", "REFLOW_SCHEDULER_"))}

    def serve(service: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "reflow.cli", "serve", service,  # nosec
                               "--port", "0"], env={**base, **env}, capture_output=True,
                              text=True, timeout=120)

    result = serve("replay")
    assert result.returncode != 0 and "REFLOW_GRPC_CREDENTIAL" in result.stderr
    result = serve("trainer", REFLOW_GRPC_CREDENTIAL="c" * 32)
    assert result.returncode != 0 and "REFLOW_SCHEDULER_PUBLIC_KEY" in result.stderr
    public = capabilities.public_pem(capabilities.new_private_key())
    result = serve("scheduler", REFLOW_GRPC_CREDENTIAL="c" * 32,
                   REFLOW_SCHEDULER_PUBLIC_KEY=public)
    assert result.returncode != 0 and "REFLOW_SCHEDULER_SIGNING_KEY" in result.stderr
    result = serve("trainer", REFLOW_GRPC_CREDENTIAL="c" * 32,
                   REFLOW_SCHEDULER_PUBLIC_KEY="-----BEGIN PUBLIC KEY-----\nnot a key\n")
    assert result.returncode != 0 and "REFLOW_SCHEDULER_PUBLIC_KEY" in result.stderr
    result = serve("worker", REFLOW_GRPC_CREDENTIAL="short")
    assert result.returncode != 0 and "at least 16 characters" in result.stderr
