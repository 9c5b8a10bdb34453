"""Hostile and stray RPCs over real gRPC on loopback: they are refused at once
with the right status code, cannot make a service run code or touch paths
outside its roots, and cannot starve the health checks Kubernetes probes.

The rollout worker here runs the real RolloutService, worker loop, gRPC server
and replay buffer (real Redis); only the generation engine is a stand-in, so
that a weight update can be held "waiting for the trainer's broadcast" for as
long as a test needs, which is what a stray UpdateWeights does to a real engine.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from reflow import rpc
from reflow.core.config import parse_job_spec
from reflow.replay.server import serve as serve_replay
from reflow.replay.store import ReplayStore
from reflow.rollout.engine import TokenDelta, WeightSyncSpec
from reflow.rollout.server import serve as serve_rollout
from reflow.rollout.service import RolloutService
from reflow.trainer.server import serve as serve_trainer
from reflow.trainer.service import TrainerService
from reflow.v1 import common_pb2, replay_pb2, replay_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from reflow.v1 import trainer_pb2_grpc

pytestmark = pytest.mark.security

JOB = "sec-job"
TENSORS = [rollout_pb2.TensorMeta(name="w", shape=[4, 4], dtype="float32")]
KEY = "0123456789abcdef0123456789abcdef"  # a rendezvous key as the trainer draws one
# Rendezvous keys refused at the edge: none, or not what the trainer draws.
BAD_KEYS = ["", "0123456789ABCDEF0123456789ABCDEF", KEY[:-1], KEY + "0", "g" * 32,
            "reflow-wsync/" + KEY[13:]]


class HeldEngine:
    """A generation engine whose weight receive waits until the test lets the
    'trainer' broadcast arrive (`broadcast.set()`), like a real engine blocked in
    a collective that has no sender."""

    def __init__(self) -> None:
        self.broadcast = threading.Event()
        self.paused = False
        self.joined: list[WeightSyncSpec] = []

    async def generate(self, request_id, prompt_ids, sampling):
        await asyncio.sleep(0.01)
        yield TokenDelta(token_ids=[3], logprobs=[-0.5], finished=True, finish_reason="stop")

    async def abort(self, request_id):
        pass

    async def pause(self):
        self.paused = True

    async def resume(self):
        self.paused = False

    async def init_weight_sync(self, spec):
        self.joined.append(spec)

    async def receive_weights(self):
        while not self.broadcast.is_set():
            await asyncio.sleep(0.02)
        return 0.0

    def shutdown(self):
        pass


@pytest.fixture
def canary(tmp_path):
    path = tmp_path / "pwned"
    yield path
    assert not path.exists(), "an attack ran code: the canary file exists"


@pytest.fixture
def replay(redis_server, redis_client):
    server, port = serve_replay(ReplayStore.from_url(redis_server.url), "127.0.0.1:0")
    yield f"127.0.0.1:{port}", server
    server.stop(0)


@pytest.fixture
def rollout(replay, tiny_model):
    engine = HeldEngine()
    service = RolloutService(engine_factory=lambda spec, seed: lambda: engine)
    server, port = serve_rollout(service, "127.0.0.1:0")
    channel = rpc.channel(f"127.0.0.1:{port}")
    yield rollout_pb2_grpc.RolloutStub(channel), engine, server, channel
    engine.broadcast.set()
    service.shutdown()
    channel.close()
    server.stop(0)


def _spec_json(model_path: str, **replay) -> str:
    return parse_job_spec({"name": "sec", "model": {"path": model_path},
                           "rollout": {"group_size": 2, "max_tokens": 4,
                                       "max_inflight_samples": 4},
                           "trainer": {"batch_size": 4}, "replay": replay}).model_dump_json()


def _start(stub, replay_address: str, model_path: str, rank: int = 1, world: int = 2,
           host: str = "127.0.0.1") -> None:
    stub.StartJob(common_pb2.StartJobRequest(
        job_id=JOB, spec_json=_spec_json(model_path), replay_address=replay_address,
        weight_sync_rank=rank, weight_sync_world_size=world, trainer_host=host), timeout=60)


def _init(stub, **overrides):
    fields = dict(job_id=JOB, master_address="127.0.0.1", master_port=29511, rank=1,
                  world_size=2, backend="gloo", tensors=TENSORS, bucket_bytes=1 << 26,
                  rendezvous_key=KEY)
    fields.update(overrides)
    return stub.InitWeightSync(rollout_pb2.InitWeightSyncRequest(**fields), timeout=10)


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details()


def _until(predicate, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def _health_within(channel, timeout_s: float) -> bool:
    """The health check answered SERVING within its deadline."""
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                      timeout=timeout_s)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


MODULE_PATHS = ["subprocess:Popen", "os:system", "builtins:exec", "posix.system"]


@pytest.mark.parametrize("field", ["sampler", "replay_filter"])
@pytest.mark.parametrize("path", MODULE_PATHS)
def test_module_paths_in_rpc_specs_run_nothing(replay, rollout, tiny_model, canary, field, path):
    """Configure (replay), StartJob (rollout, trainer): each parses the spec it is
    given and refuses a plug-in named by module path, before importing anything."""
    replay_address, _ = replay
    stub, _, _, _ = rollout
    args_field = "sampler_args" if field == "sampler" else "filter_args"
    args = {"args": f"touch {canary}", "shell": True}
    spec = parse_job_spec({"model": {"path": tiny_model}}).model_dump(mode="json")
    spec["replay"].update({field: path, args_field: args})
    import json

    raw = json.dumps(spec)
    with rpc.channel(replay_address) as ch:
        code, details = _code(lambda: replay_pb2_grpc.ReplayBufferStub(ch).Configure(
            replay_pb2.ConfigureRequest(job_id=JOB, replay_config_json=json.dumps(spec["replay"])),
            timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and f"replay.{field}" in details
    code, details = _code(lambda: stub.StartJob(common_pb2.StartJobRequest(
        job_id=JOB, spec_json=raw, replay_address=replay_address, weight_sync_rank=1,
        weight_sync_world_size=2, trainer_host="127.0.0.1"), timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "module paths are not accepted" in details
    trainer_server, port = serve_trainer(TrainerService(), "127.0.0.1:0")
    try:
        with rpc.channel(f"127.0.0.1:{port}") as ch:
            code, details = _code(lambda: trainer_pb2_grpc.TrainerStub(ch).StartJob(
                common_pb2.StartJobRequest(job_id=JOB, spec_json=raw,
                                           replay_address=replay_address,
                                           rollout_addresses=["127.0.0.1:1"]), timeout=10))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and f"replay.{field}" in details
    finally:
        trainer_server.stop(0)


def test_paths_outside_the_roots_are_refused_over_rpc(replay, rollout, tiny_model, tmp_path,
                                                      roots):
    """model.path and run_dir: '..', absolute elsewhere, and a symlink leading out."""
    replay_address, _ = replay
    stub, _, _, _ = rollout
    outside = tmp_path.parent.parent  # still under /tmp, but outside this service's root
    escape = tmp_path / "models"
    escape.mkdir()
    (escape / "link").symlink_to("/etc")
    # The rollout service's roots are pytest's base temp dir (tests/conftest.py).
    for bad in ("/etc", "../../../../etc", str(escape / "link" / "ssl")):
        code, details = _code(lambda: _start(stub, replay_address, bad))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "model.path" in details, bad
    trainer = TrainerService(roots=roots)
    server, port = serve_trainer(trainer, "127.0.0.1:0")
    try:
        with rpc.channel(f"127.0.0.1:{port}") as ch:
            stub_t = trainer_pb2_grpc.TrainerStub(ch)
            model = tmp_path / "model"
            spec = _spec_json(str(model))
            for run_dir in ("/etc/cron.d", f"{tmp_path}/../x", str(outside)):
                code, details = _code(lambda: stub_t.StartJob(common_pb2.StartJobRequest(
                    job_id=JOB, spec_json=spec, replay_address=replay_address,
                    rollout_addresses=["127.0.0.1:1"], run_dir=run_dir), timeout=10))
                assert code == grpc.StatusCode.INVALID_ARGUMENT and "run_dir" in details, run_dir
            code, details = _code(lambda: stub_t.StartJob(common_pb2.StartJobRequest(
                job_id=JOB, spec_json=_spec_json(tiny_model), replay_address=replay_address,
                rollout_addresses=["127.0.0.1:1"], run_dir=str(tmp_path / "run")), timeout=10))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "model.path" in details
        assert trainer.state == "idle"
    finally:
        server.stop(0)


def test_weight_sync_rpcs_are_checked_against_the_jobs_group(replay, rollout, tiny_model):
    replay_address, _ = replay
    stub, engine, _, _ = rollout
    code, _ = _code(lambda: _init(stub))
    assert code == grpc.StatusCode.FAILED_PRECONDITION  # no job runs here yet
    code, details = _code(lambda: _start(stub, replay_address, tiny_model, rank=0))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "weight_sync_rank" in details
    _start(stub, replay_address, tiny_model, rank=1, world=3)

    wrong = [({"rank": 2}, "rank"), ({"rank": 0}, "rank"), ({"world_size": 2}, "world_size"),
             ({"master_address": "10.9.8.7"}, "master_address"),
             ({"backend": "mpi"}, "backend"), ({"bucket_bytes": 1}, "bucket_bytes"),
             ({"tensors": [rollout_pb2.TensorMeta(name="w", shape=[4], dtype="save")]}, "dtype"),
             ({"tensors": [rollout_pb2.TensorMeta(name="w", shape=[-1], dtype="float32")]},
              "shape"),
             ({"tensors": []}, "tensors"), ({"job_id": "other-job"}, "not running")]
    wrong += [({"rendezvous_key": key}, "rendezvous_key") for key in BAD_KEYS]
    for fields, named in wrong:
        code, details = _code(lambda: _init(stub, **{"world_size": 3, **fields}))
        assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
        assert named in details, (fields, details)
        if "rendezvous_key" in fields:
            assert code == grpc.StatusCode.INVALID_ARGUMENT
            # A secret, even a malformed one, is never echoed.
            assert not fields["rendezvous_key"] or fields["rendezvous_key"] not in details
    assert engine.joined == []  # nothing reached the engine
    code, details = _code(lambda: stub.UpdateWeights(
        rollout_pb2.UpdateWeightsRequest(job_id=JOB, policy_version=1), timeout=10))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "InitWeightSync" in details
    _init(stub, world_size=3)
    assert len(engine.joined) == 1
    assert engine.joined[0].rendezvous_key == KEY  # carried to the engine
    assert KEY not in repr(engine.joined[0])
    code, details = _code(lambda: _init(stub, world_size=3))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "once per trainer" in details

    # Out of order: refused at once, the engine never paused.
    for version in (0, 2, 7, -1):
        code, details = _code(lambda: stub.UpdateWeights(
            rollout_pb2.UpdateWeightsRequest(job_id=JOB, policy_version=version), timeout=10))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "next version (1)" in details
    assert not engine.paused

    # A resumed trainer's first version may skip ahead (resync), as the first update
    # after a join only; from then on versions go in order again.
    engine.broadcast.set()
    resync = lambda v: stub.UpdateWeights(  # noqa: E731
        rollout_pb2.UpdateWeightsRequest(job_id=JOB, policy_version=v, resync=True), timeout=30)
    assert resync(7).policy_version == 7
    code, details = _code(lambda: resync(9))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "next version (8)" in details

    # A rank never rises (engines join after the last one, leave from anywhere).
    place = lambda **f: stub.SetSyncPlace(rollout_pb2.SetSyncPlaceRequest(  # noqa: E731
        **{"job_id": JOB, **f}), timeout=10)
    for fields, named in [({"rank": 2, "world_size": 4}, "does not follow"),
                          ({"rank": 0, "world_size": 2}, "rank"),
                          ({"rank": 1, "world_size": 1}, "does not fit"),
                          ({"job_id": "other-job", "rank": 1, "world_size": 2}, "not running")]:
        code, details = _code(lambda: place(**fields))
        assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
        assert named in details, (fields, details)
    # Taken for the next join (a new trainer's group, at another port).
    place(rank=1, world_size=2)
    code, details = _code(lambda: _init(stub, world_size=3, master_port=29777))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "world_size" in details


def test_a_stray_update_honours_its_deadline_and_the_real_one_joins_it(replay, rollout,
                                                                       tiny_model):
    replay_address, _ = replay
    stub, engine, server, _ = rollout
    _start(stub, replay_address, tiny_model)
    _init(stub)
    update = lambda v, t: stub.UpdateWeights(  # noqa: E731
        rollout_pb2.UpdateWeightsRequest(job_id=JOB, policy_version=v), timeout=t)
    # A stray update for the next version: no broadcast comes, so it cannot finish;
    # the handler gives up at the caller's deadline instead of holding a thread.
    code, _ = _code(lambda: update(1, 1.0))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    _until(lambda: server.long_call_guard.in_flight == 0)
    # Another version while v1 is loading: refused at once.
    code, details = _code(lambda: update(2, 10))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "in progress" in details
    # The trainer's own call for v1 joins the update in progress; its broadcast lands.
    with ThreadPoolExecutor(1) as pool:
        real = pool.submit(update, 1, 30)
        time.sleep(0.3)
        engine.broadcast.set()
        assert real.result().policy_version == 1
    assert update(1, 10).policy_version == 1  # a retry of the update just done
    stats = stub.GetStats(common_pb2.JobRef(job_id=JOB), timeout=10)
    assert stats.policy_version == 1 and stats.state == "running"


def test_thirty_two_blocking_rpcs_leave_the_health_check_answering(replay, rollout, tiny_model):
    replay_address, replay_server = replay
    stub, engine, server, channel = rollout
    _start(stub, replay_address, tiny_model)
    _init(stub)
    update = lambda: stub.UpdateWeights(  # noqa: E731
        rollout_pb2.UpdateWeightsRequest(job_id=JOB, policy_version=1), timeout=60)
    with ThreadPoolExecutor(32) as pool:
        calls = [pool.submit(update) for _ in range(32)]
        _until(lambda: server.long_call_guard.in_flight == rpc.MAX_LONG_CALLS
               and sum(c.done() for c in calls) == 32 - rpc.MAX_LONG_CALLS)
        # Every long-call slot is held by a blocked update; the health check and a
        # short call still get a thread and answer within their 1 s deadline.
        assert server.long_call_guard.in_flight == rpc.MAX_LONG_CALLS
        for _ in range(5):
            assert _health_within(channel, 1.0)
        assert stub.GetStats(common_pb2.JobRef(job_id=JOB), timeout=1.0).state == "running"
        engine.broadcast.set()
        outcomes = []
        for call in calls:
            try:
                outcomes.append(call.result().policy_version)
            except grpc.RpcError as err:
                outcomes.append(err.code())
    # The slots' holders joined the one update; the rest were turned away at once.
    assert outcomes.count(1) == rpc.MAX_LONG_CALLS
    assert outcomes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 32 - rpc.MAX_LONG_CALLS

    # The replay buffer: 32 trainers long-polling an empty job, health still answers.
    with rpc.channel(replay_address) as ch:
        replay_stub = replay_pb2_grpc.ReplayBufferStub(ch)
        poll = lambda: replay_stub.Sample(replay_pb2.SampleRequest(  # noqa: E731
            job_id="empty-job", batch_size=4, lease_ttl_s=30, timeout_s=3), timeout=10)
        with ThreadPoolExecutor(32) as pool:
            polls = [pool.submit(poll) for _ in range(32)]
            _until(lambda: replay_server.long_call_guard.in_flight == 32)
            assert _health_within(ch, 1.0)
            assert all(not p.result().lease_id for p in polls)


def test_elastic_pool_rpcs_are_validated(replay, rollout, tiny_model, tmp_path):
    """The trainer group's and the length curriculum's fields arrive over the
    network: a peer that is not host:port, a join outside the group's bounds or
    from a stale membership, response bounds beyond the spec: refused, named."""
    from reflow.v1 import trainer_pb2

    from pathlib import Path

    from reflow.core.paths import PathRoots

    replay_address, _ = replay
    stub, engine, _, _ = rollout
    trainer = TrainerService(roots=PathRoots(runs=tmp_path, models=Path(tiny_model).parent))
    server, port = serve_trainer(trainer, "127.0.0.1:0")
    try:
        with rpc.channel(f"127.0.0.1:{port}") as ch:
            stub_t = trainer_pb2_grpc.TrainerStub(ch)
            spec = _spec_json(tiny_model)
            for peer in ("http://evil:80/x", "host-without-port", "a:99999", "a b:80"):
                code, details = _code(lambda: stub_t.StartJob(common_pb2.StartJobRequest(
                    job_id=JOB, spec_json=spec, replay_address=replay_address,
                    rollout_addresses=["127.0.0.1:1"], trainer_peers=[peer]), timeout=10))
                assert code == grpc.StatusCode.INVALID_ARGUMENT and "trainer_peers" in details
            # Nothing trains here: a reconfiguration has no loop to go to.
            code, _ = _code(lambda: stub_t.Reconfigure(trainer_pb2.ReconfigureRequest(
                job_id=JOB, trainer_peers=["127.0.0.1:2"]), timeout=10))
            assert code == grpc.StatusCode.FAILED_PRECONDITION
            # A replica: joins are bounded and ordered by membership epoch.
            stub_t.StartJob(common_pb2.StartJobRequest(
                job_id=JOB, spec_json=spec, replay_address=replay_address,
                leader_host="127.0.0.1"), timeout=30)
            bad_joins = [dict(master_port=0, rank=1, world_size=2, membership_epoch=1),
                         dict(master_port=29600, rank=0, world_size=2, membership_epoch=1),
                         dict(master_port=29600, rank=2, world_size=2, membership_epoch=1),
                         dict(master_port=29600, rank=1, world_size=5000, membership_epoch=1),
                         dict(master_port=29600, rank=1, world_size=2, membership_epoch=0)]
            for join in bad_joins:
                code, details = _code(lambda: stub_t.JoinGroup(trainer_pb2.JoinGroupRequest(
                    job_id=JOB, rendezvous_key=KEY, **join), timeout=10))
                assert code in (grpc.StatusCode.INVALID_ARGUMENT,
                                grpc.StatusCode.FAILED_PRECONDITION), (join, details)
            # A join otherwise in order, without the group's key (or a malformed one).
            for key in BAD_KEYS:
                code, details = _code(lambda: stub_t.JoinGroup(trainer_pb2.JoinGroupRequest(
                    job_id=JOB, master_port=29600, rank=1, world_size=2, membership_epoch=1,
                    rendezvous_key=key), timeout=10))
                assert code == grpc.StatusCode.INVALID_ARGUMENT, (key, details)
                assert "rendezvous_key" in details and (not key or key not in details)
            _until(lambda: trainer.status(JOB)["state"] == "standby")
    finally:
        server.stop(0)
    # A SubmitGroup asking for responses longer than the spec allows.
    _start(stub, replay_address, tiny_model)
    _until(lambda: stub.GetStats(common_pb2.JobRef(job_id=JOB), timeout=5).state == "running")
    for lo, hi in ((0, 5), (4, 3)):
        code, details = _code(lambda: stub.SubmitGroup(rollout_pb2.SubmitGroupRequest(
            job_id=JOB, group_id="g1", prompt_id="p", prompt_text="x", max_tokens=hi,
            min_tokens=lo), timeout=10))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens" in details
