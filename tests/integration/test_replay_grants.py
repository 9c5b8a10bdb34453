"""The replay buffer's job grants and policy version over real gRPC, on a real
Redis: a job's passes stop working there when the scheduler ends the job
(EndJob), come back only when the scheduler starts it again (its Configure),
and no pass can move the version more than one step per call."""

from __future__ import annotations

import logging

import grpc
import pytest

from reflow import capabilities, rpcauth
from reflow.core.config import ReplayConfig
from reflow.core.errors import VersionGap
from reflow.core.grants import JOB_TOKENS, RedisGrants
from reflow.replay.client import GrpcReplayClient
from reflow.replay.server import serve
from reflow.replay.store import ReplayStore
from reflow.v1 import common_pb2, replay_pb2, replay_pb2_grpc
from reflow.wire import trajectory_to_proto
from tests.integration.samples import make_group

JOB = "job-grants"


def _pass(role: str, job_id: str = JOB) -> str:
    """A job pass as the scheduler hands one to a worker of `role`."""
    return capabilities.issue_pass(rpcauth.credentials().signing["scheduler"], job_id, role)


def _redis_state(client) -> dict[bytes, bytes]:
    return {key: client.dump(key) for key in sorted(client.keys("*"))}


@pytest.fixture
def buffer(redis_server, redis_client):
    """The buffer's server, the scheduler's client of it (this process signs as the
    scheduler), and its store."""
    store = ReplayStore.from_url(redis_server.url)
    server, port = serve(store, "127.0.0.1:0")
    address = f"127.0.0.1:{port}"
    scheduler = GrpcReplayClient(address, retry_s=0.0)
    yield address, scheduler, store
    scheduler.close()
    server.stop(0)


def _as(address: str, role: str, method: str, request, job_id: str = JOB):
    """The call with a `role` pass of the job, as a worker sends it: (code, details)."""
    metadata = [(rpcauth.CREDENTIAL_KEY, rpcauth.credentials().credential),
                (rpcauth.JOB_TOKEN_KEY, _pass(role, job_id))]
    with grpc.insecure_channel(address) as ch:
        try:
            getattr(replay_pb2_grpc.ReplayBufferStub(ch), method)(request, metadata=metadata,
                                                                  timeout=10)
        except grpc.RpcError as err:
            return err.code(), err.details()
    return grpc.StatusCode.OK, ""


def _publish(version: int) -> replay_pb2.PublishVersionRequest:
    return replay_pb2.PublishVersionRequest(job_id=JOB, policy_version=version)


def _stats() -> common_pb2.JobRef:
    return common_pb2.JobRef(job_id=JOB)


def test_a_trainer_pass_cannot_skip_a_version_and_a_rollout_pass_cannot_publish(buffer,
                                                                               redis_client):
    address, scheduler, _ = buffer
    scheduler.configure(JOB, ReplayConfig(max_staleness=1))  # starts the job here
    assert _as(address, "trainer", "PublishVersion", _publish(1))[0] == grpc.StatusCode.OK
    before = _redis_state(redis_client)
    code, details = _as(address, "trainer", "PublishVersion", _publish(1 + 5))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "policy_version: 6" in details and "at version 1" in details and "(2)" in details
    assert _redis_state(redis_client) == before, "a refused publish wrote to Redis"
    # A retry of the version already published is accepted and changes nothing.
    assert _as(address, "trainer", "PublishVersion", _publish(1))[0] == grpc.StatusCode.OK
    assert _redis_state(redis_client) == before
    assert _as(address, "rollout", "PublishVersion", _publish(2))[0] == \
        grpc.StatusCode.PERMISSION_DENIED
    # The gRPC client raises the refusal as the type the store raises.
    with pytest.raises(VersionGap, match="policy_version: 9"):
        scheduler.publish_version(JOB, 9)
    assert scheduler.stats(JOB).policy_version == 1


def test_the_trainer_walks_a_buffer_that_lost_writes_up_to_its_version(buffer, monkeypatch,
                                                                       caplog):
    """A Redis under `appendfsync everysec` that crashed lost the last publishes:
    the buffer is 3 versions behind the trainer's next one. The trainer's publish
    (with its trainer pass) walks it up, each version evicting by δ."""
    from reflow.trainer.publish import publish_to_buffer

    address, scheduler, store = buffer
    scheduler.configure(JOB, ReplayConfig(max_staleness=1))
    # A process that signs nothing and holds the trainer's pass, as the trainer does.
    creds, held = rpcauth.credentials(), _pass("trainer")
    monkeypatch.setattr(rpcauth, "_credentials",
                        rpcauth.Credentials(creds.credential, {}, creds.trusted))
    JOB_TOKENS.grant(JOB, held)
    trainer = GrpcReplayClient(address, retry_s=0.0)
    try:
        with pytest.raises(grpc.RpcError) as refused:  # a trainer's pass indeed: no Put
            trainer.put(JOB, make_group("h"))
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        for version in range(1, 6):
            assert publish_to_buffer(trainer, JOB, version) == 0
        store.put(JOB, make_group("g", version=3))
        store.redis.set(store._key(JOB, "version"), 2)  # the writes Redis lost
        with caplog.at_level(logging.WARNING, logger="reflow.trainer.publish"):
            assert publish_to_buffer(trainer, JOB, 6) == 3
        assert "3 versions behind v6" in caplog.text
        stats = trainer.stats(JOB)
        # "g" (v3) aged past δ = 1 on the way: at v5.
        assert (stats.policy_version, stats.evicted_total, stats.unused_samples) == (6, 4, 0)
        # The walk cannot go past the trainer's own version, nor can one call.
        with pytest.raises(VersionGap):
            trainer.publish_version(JOB, 8)
    finally:
        trainer.close()
        JOB_TOKENS.revoke(JOB)


def test_ended_job_passes_are_not_found_until_the_scheduler_starts_it_again(buffer,
                                                                            redis_client):
    address, scheduler, store = buffer
    put = replay_pb2.PutRequest(job_id=JOB, trajectories=[trajectory_to_proto(t)
                                                          for t in make_group("g")])
    scheduler.configure(JOB, ReplayConfig())
    assert _as(address, "rollout", "Put", put)[0] == grpc.StatusCode.OK
    assert _as(address, "trainer", "GetStats", _stats())[0] == grpc.StatusCode.OK
    # A worker's pass cannot end the job.
    for role in ("rollout", "trainer"):
        code, details = _as(address, role, "EndJob", _stats())
        assert code == grpc.StatusCode.PERMISSION_DENIED and "only the scheduler" in details
    assert _as(address, "rollout", "GetStats", _stats())[0] == grpc.StatusCode.OK

    scheduler.end_job(JOB)
    scheduler.end_job(JOB)  # idempotent
    for role, method, request in (("rollout", "Put", put), ("rollout", "GetStats", _stats()),
                                  ("trainer", "PublishVersion", _publish(1)),
                                  ("trainer", "GetStats", _stats())):
        code, details = _as(address, role, method, request)
        assert code == grpc.StatusCode.NOT_FOUND, (role, method, code)
        assert "not running here" in details
    # The scheduler (the API) reading the finished job does not serve its passes
    # again, nor does any other of its calls but the starting one; the data stayed.
    assert scheduler.stats(JOB).unused_samples == 4
    assert scheduler.acquire_dispatch(JOB, 4, 4, 64, 64) == 4
    assert _as(address, "rollout", "GetStats", _stats())[0] == grpc.StatusCode.NOT_FOUND
    assert redis_client.hget(RedisGrants.KEY, JOB) == RedisGrants.ENDED
    # Past the authorizer's cache, too (another replica's view).
    fresh = RedisGrants(store.redis)
    assert not fresh.granted(JOB)

    scheduler.configure(JOB, ReplayConfig())  # the job is started (resumed) again
    assert _as(address, "rollout", "GetStats", _stats())[0] == grpc.StatusCode.OK
    assert _as(address, "trainer", "PublishVersion", _publish(1))[0] == grpc.StatusCode.OK
    # A job the buffer never saw end is still granted by any of the scheduler's calls.
    other = "job-never-ended"
    scheduler.stats(other)
    assert _as(address, "trainer", "GetStats", common_pb2.JobRef(job_id=other),
               job_id=other)[0] == grpc.StatusCode.OK


class _NoDispatcher:
    """What a job's end asks of its dispatcher, for a job with no services."""

    def __init__(self, replay) -> None:
        self.replay = replay

    def stop(self) -> None:
        pass

    def record(self, event: dict) -> None:
        pass


class _OneBuffer:
    """A backend whose every job is placed on one real replay buffer, and no
    services besides: the job then ends as the test says."""

    def __init__(self, replay_address: str, redis_client=None) -> None:
        self.replay_address, self.redis = replay_address, redis_client
        self.job_id, self.grant_at_release = "", None

    def prepare(self, spec) -> None:
        pass

    def place(self, job_id, run_dir, colocated=False):
        from reflow.scheduler.cluster.local import Placement

        self.job_id = job_id
        return Placement(self.replay_address, [], "127.0.0.1:1")

    def release(self, placement) -> None:
        self.grant_at_release = self.redis.hget(RedisGrants.KEY, self.job_id)

    def close(self) -> None:
        pass


@pytest.mark.parametrize("phase", ["SUCCEEDED", "FAILED", "STOPPED", "RUNNING"])
def test_the_scheduler_ends_the_job_on_the_buffer_when_the_job_ends_not_at_a_handover(
        buffer, redis_server, redis_client, tmp_path, phase):
    """SUCCEEDED, FAILED, STOPPED: the scheduler's EndJob, before the placement is
    released. RUNNING (a scheduler that shut down handing the job over): the job
    goes on under the next scheduler, and its passes keep working at the buffer."""
    import redis

    from reflow.core.paths import PathRoots
    from reflow.scheduler.jobcontrol.jobs import JobStore
    from reflow.scheduler.jobcontrol.service import Scheduler

    address, _, store = buffer
    reason = "handed over at step 0" if phase == "RUNNING" else ""

    class Scripted(Scheduler):
        def _start_services(self, *args, **kwargs):
            return None

        def _start_dispatcher(self, record, spec, placement, rollouts, run_dir, standby=None):
            return _NoDispatcher(GrpcReplayClient(placement.replay_address))

        def _watch(self, record, *args, **kwargs):
            # Started here by the scheduler's Configure: the job's passes work.
            assert _as(address, "rollout", "GetStats", common_pb2.JobRef(
                job_id=record.job_id), job_id=record.job_id)[0] == grpc.StatusCode.OK
            return phase, reason

    backend = _OneBuffer(address, redis_client)
    core = Scripted(JobStore(redis.Redis.from_url(redis_server.url)), backend,
                    PathRoots(tmp_path, tmp_path))
    job_id = f"ends-{phase.lower()}"
    core.submit('{"model": {"path": "m"}}', job_id=job_id)
    core._threads[job_id].join(60)
    assert core.get(job_id).phase == phase
    code = _as(address, "rollout", "GetStats", common_pb2.JobRef(job_id=job_id),
               job_id=job_id)[0]
    if phase == "RUNNING":
        assert code == grpc.StatusCode.OK
        assert redis_client.hget(RedisGrants.KEY, job_id) == RedisGrants.GRANTED
    else:
        assert code == grpc.StatusCode.NOT_FOUND
        # Told before the release: a local buffer goes down with the job's processes.
        assert backend.grant_at_release == RedisGrants.ENDED
    core.shutdown()


def test_a_buffer_that_does_not_answer_never_holds_up_the_job_s_end(monkeypatch, caplog,
                                                                   redis_server, tmp_path):
    import redis

    from reflow.core.paths import PathRoots
    from reflow.scheduler.jobcontrol.jobs import JobStore
    from reflow.scheduler.cluster.local import Placement
    from reflow.scheduler.jobcontrol.service import Scheduler

    monkeypatch.setattr("reflow.scheduler.jobcontrol.service.END_JOB_DEADLINE_S", 0.5)
    core = Scheduler(JobStore(redis.Redis.from_url(redis_server.url)), _OneBuffer(""),
                     PathRoots(tmp_path, tmp_path))
    with caplog.at_level(logging.WARNING, logger="reflow.scheduler.jobcontrol.service"):
        core._end_on_buffer("gone", Placement("127.0.0.1:1", [], "127.0.0.1:1"))
    assert "was not told the job ended" in caplog.text
