"""Redis users per role (reflow/redis_acl.py) on a real Redis (the embedded server
`reflow run` starts): each store does all it does as its own user, and nothing of
the other's; no user can administer Redis; a restart with new passwords (a resumed
run) keeps the data and refuses the old ones; the chart's ACL script makes the same
users."""

from __future__ import annotations

import os
import subprocess
import time

import pytest
import redis

from reflow import redis_acl, redisconn
from reflow.core.config import ReplayConfig
from reflow.core.errors import VersionGap
from reflow.core.grants import RedisGrants
from reflow.procs import free_port
from reflow.replay.embedded import EmbeddedRedis, redis_server_binary
from reflow.replay.metrics import BufferMetrics
from reflow.replay.store import ReplayStore
from reflow.scheduler.generation.inflight import DispatchLedger
from reflow.scheduler.jobcontrol.jobs import JobRecord, JobStore
from reflow.tasks.base import Prompt
from tests.integration.samples import make_group

JOB = "acl-job"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis-acl"), appendonly=False,
                           passwords=redis_acl.Passwords.mint()).start()
    yield server
    server.stop()


@pytest.fixture
def admin(server):
    client = redis.Redis.from_url(server.url_for(redis_acl.ADMIN_USER))
    client.flushall()
    client.execute_command("ACL", "LOG", "RESET")
    yield client
    client.close()


def as_user(server, name: str) -> redis.Redis:
    # No retries: a refusal must surface at once.
    return redisconn.connect(server.url_for(name), max_outage_s=0)


def _fill(server) -> None:
    """A job's records and ledger, and its buffer, each written by its own user."""
    store = ReplayStore(as_user(server, "replay"))
    store.configure(JOB, ReplayConfig(replay_cap=0.5, max_staleness=4))
    store.put(JOB, make_group("g1") + make_group("g2"))
    RedisGrants(store.redis).grant(JOB, "")
    jobs = JobStore(as_user(server, "scheduler"))
    jobs.create(JobRecord(JOB, "acl", "{}"))
    jobs.append_metrics(JOB, [{"step": 1}])
    DispatchLedger(jobs.redis, JOB).routed("g3", Prompt("p3", "2+2", "4"), from_stream=True)


def _refusals(admin, name: str) -> list[dict]:
    """The ACL log's refusals of `name`, less redis-py's optional CLIENT calls on
    connect (redis_acl.CLIENT_COMMANDS says why those stay refused)."""
    return [e for e in admin.acl_log(128) if e["username"] == name
            and not str(e["object"]).startswith("client")]


def _snapshot(admin) -> dict[bytes, bytes]:
    return {key: admin.dump(key) for key in sorted(admin.keys("*"))}


def test_the_buffer_does_all_it_does_as_the_replay_user(server, admin):
    store = ReplayStore(as_user(server, "replay"))
    store.configure(JOB, ReplayConfig(replay_cap=0.5, max_staleness=1))
    assert store.put(JOB, make_group("a") + make_group("b")) == 8
    # After a Redis restart the scripts are gone: a pipeline checks and loads its
    # own (SCRIPT EXISTS, SCRIPT LOAD), a lone call reloads on NOSCRIPT.
    admin.script_flush()
    assert store.put(JOB, make_group("c", version=1)) == 4
    admin.script_flush()
    batch = store.lease(JOB, 8, 30, timeout_s=1)
    assert batch is not None and store.renew_lease(JOB, batch.lease_id, 60)
    assert store.release(JOB, batch.lease_id, {t.sample_id: {"loss": 0.1}
                                               for t in batch.trajectories}) == 8
    other = store.lease(JOB, 4, 30, timeout_s=1)
    assert store.return_lease(JOB, other.lease_id) == 4
    store.lease(JOB, 4, 0.01, timeout_s=1)
    time.sleep(0.05)
    assert store.return_all_leases(JOB) == 4 and store.expire_leases(JOB) == 0
    assert store.acquire_dispatch(JOB, 8, 4, 64, 64) == 8
    # One version at a time, evicting what δ = 1 leaves behind.
    assert sum(store.publish_version(JOB, v) for v in (1, 2, 3)) > 0
    with pytest.raises(VersionGap):
        store.publish_version(JOB, 5)
    stats = store.stats(JOB)
    assert stats.policy_version == 3 and stats.put_total == 12 and stats.expired_leases_total >= 1
    grants = RedisGrants(store.redis)
    grants.grant(JOB, "")
    assert grants.granted(JOB)
    grants.revoke(JOB)
    assert not RedisGrants(store.redis).granted(JOB)
    RedisGrants(store.redis).grant_unless_ended(JOB)  # an ended job stays ended
    assert not RedisGrants(store.redis).granted(JOB)
    RedisGrants(store.redis).grant_unless_ended("acl-other")
    assert RedisGrants(store.redis).granted("acl-other")
    grants.grant(JOB, "")
    store.end_job(JOB)
    assert not RedisGrants(store.redis).granted(JOB)
    metrics = BufferMetrics(store)
    metrics.seen(JOB)
    families = {m.name for m in metrics.registry.collect()}
    assert "reflow_replay_pool_samples" in families and "reflow_replay_put_samples" in families
    # Nothing the buffer did was refused (a refusal raises, and would be logged here).
    assert _refusals(admin, "replay") == []


def test_the_scheduler_does_all_it_does_as_the_scheduler_user(server, admin):
    jobs = JobStore(as_user(server, "scheduler"))
    admin.script_flush()
    record, created = jobs.create(JobRecord(JOB, "acl", "{}"))
    assert created and jobs.exists(JOB)
    record.phase = "RUNNING"
    jobs.save(record)
    jobs.create(JobRecord("acl-other", "acl", "{}"))
    assert [r.job_id for r in jobs.all()] == ["acl-other", JOB]
    jobs.append_metrics(JOB, [{"step": 1}, {"step": 2}, {"step": 3}])
    assert jobs.drop_metrics_after(JOB, 2) == 1
    assert [m["step"] for m in jobs.metrics(JOB)] == [1, 2]
    record.phase = "SUCCEEDED"
    assert jobs.save_final(record, timeout_s=1) and jobs.get(JOB).phase == "SUCCEEDED"
    ledger = DispatchLedger(jobs.redis, JOB)
    ledger.routed("g1", Prompt("p1", "1+1", "2"), from_stream=True)
    ledger.routed("g2", Prompt("p2", "1+2", "3"), from_stream=True, replaces="g1")
    ledger.ended(["g0"])
    position, groups = ledger.load()
    assert position == 2 and [gid for gid, _ in groups] == ["g2"]
    assert _refusals(admin, "scheduler") == []


# Commands no service needs: reading the whole keyspace, reconfiguring or wiping
# Redis, managing users, running arbitrary Lua.
ADMIN_COMMANDS = (("CONFIG", "GET", "*"), ("CONFIG", "SET", "appendonly", "no"), ("FLUSHALL",),
                  ("FLUSHDB",), ("KEYS", "*"), ("SCAN", "0"), ("ACL", "LIST"),
                  ("ACL", "SETUSER", "replay", "+@all", "~*"), ("ACL", "WHOAMI"),
                  ("SCRIPT", "FLUSH"), ("EVAL", "return 1", "0"), ("DEBUG", "SLEEP", "0"),
                  ("BGREWRITEAOF",), ("CLIENT", "LIST"), ("MONITOR",), ("INFO",),
                  ("PUBLISH", "reflow", "x"), ("RENAME", "reflow:jobs", "reflow:{x}:config"))


def _refused(call) -> None:
    with pytest.raises(redis.exceptions.NoPermissionError):
        call()


@pytest.mark.parametrize("name", redis_acl.USER_NAMES)
def test_no_user_can_administer_redis(server, admin, name):
    _fill(server)
    before = _snapshot(admin)
    client = as_user(server, name)
    for command in ADMIN_COMMANDS:
        _refused(lambda: client.execute_command(*command))
    assert _snapshot(admin) == before


def test_the_replay_user_cannot_read_or_write_the_job_store_or_the_ledger(server, admin):
    _fill(server)
    before = _snapshot(admin)
    buffer = as_user(server, "replay")
    for key in ("reflow:jobs", f"reflow:{{{JOB}}}:dispatch", f"reflow:{{{JOB}}}:inflight"):
        _refused(lambda: buffer.hgetall(key))
        _refused(lambda: buffer.hset(key, "x", "1"))
        _refused(lambda: buffer.delete(key))
    _refused(lambda: buffer.hget("reflow:jobs", JOB))
    _refused(lambda: buffer.get("reflow:jobs:seq"))
    _refused(lambda: buffer.zrange("reflow:jobs:order", 0, -1))
    _refused(lambda: buffer.zrange(f"reflow:jobs:{JOB}:metrics", 0, -1))
    _refused(lambda: buffer.set("reflow:jobs:seq", "0"))
    # Not through a script either: Redis checks the keys a script declares and each
    # command it runs, undeclared keys included, against the caller's user.
    steal = buffer.register_script("return redis.call('HGETALL', KEYS[1])")
    _refused(lambda: steal(keys=["reflow:jobs"]))
    sneak = buffer.register_script("return redis.call('HGETALL', 'reflow:jobs')")
    with pytest.raises(redis.exceptions.ResponseError, match="(?i)permission|noperm|access"):
        sneak(keys=[f"reflow:{{{JOB}}}:stats"])
    assert _snapshot(admin) == before
    # Its own keys stay its own to use.
    assert ReplayStore(buffer).stats(JOB).unused_samples == 8


def test_the_scheduler_user_cannot_read_or_write_the_buffer(server, admin):
    _fill(server)
    before = _snapshot(admin)
    scheduler = as_user(server, "scheduler")
    names = ("samples", "sample_meta", "members", "meta", "stats", "config", "lease:x")
    for name in names:
        key = f"reflow:{{{JOB}}}:{name}"
        _refused(lambda: scheduler.hgetall(key))
        _refused(lambda: scheduler.hset(key, "x", "1"))
    for name in ("version", "config"):
        _refused(lambda: scheduler.get(f"reflow:{{{JOB}}}:{name}"))
    for name in ("unused", "replay", "by_version", "leases"):
        _refused(lambda: scheduler.zrange(f"reflow:{{{JOB}}}:{name}", 0, -1))
    _refused(lambda: scheduler.hgetall("reflow:job_grants"))
    _refused(lambda: scheduler.hset("reflow:job_grants", "other-job", "1"))
    _refused(lambda: ReplayStore(scheduler).stats(JOB))
    assert _snapshot(admin) == before
    assert JobStore(scheduler).get(JOB).name == "acl"


def test_no_login_without_a_password_and_the_acl_file_holds_hashes_only(server):
    for url, password in ((server.url, None), (server.url, "wrong"),
                          (redis_acl.user_url(server.url, "replay", "wrong"), None)):
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis.from_url(url, password=password).get("reflow:{j}:config")
    acl = server.data_dir / "users.acl"
    assert acl.stat().st_mode & 0o777 == 0o600
    text = acl.read_text()
    passwords = server.passwords
    for secret in (passwords.admin, *passwords.users.values()):
        assert secret not in text and redis_acl.password_hash(secret) in text
    assert passwords.admin not in repr(passwords)


def test_a_restart_with_new_passwords_keeps_the_data_and_refuses_the_old_ones(tmp_path):
    """What `reflow run --resume` does: the same data directory, new passwords."""
    first = EmbeddedRedis(tmp_path, passwords=redis_acl.Passwords.mint()).start()
    try:
        _fill(first)
        old_url = first.url_for("replay")
        port = first.port
    finally:
        first.stop()
    second = EmbeddedRedis(tmp_path, port=port, passwords=redis_acl.Passwords.mint()).start()
    try:
        assert ReplayStore(as_user(second, "replay")).stats(JOB).unused_samples == 8
        assert JobStore(as_user(second, "scheduler")).get(JOB).name == "acl"
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis.from_url(old_url).get(f"reflow:{{{JOB}}}:config")
    finally:
        second.stop()


def test_a_killed_redis_comes_back_with_the_same_users(tmp_path):
    """The supervisor of `reflow run` starts a dead Redis again: the services' URLs,
    which they hold for the whole run, still log in, and still only as themselves."""
    # `always`: under `everysec` a stalled disk may hold the last writes back.
    server = EmbeddedRedis(tmp_path, appendfsync="always",
                           passwords=redis_acl.Passwords.mint()).start()
    try:
        server.supervise(poll_s=0.05)
        _fill(server)
        server.proc.kill()
        buffer = redisconn.connect(server.url_for("replay"), max_outage_s=15)
        assert ReplayStore(buffer).stats(JOB).unused_samples == 8
        assert server.restarts == 1
        _refused(lambda: buffer.hgetall("reflow:jobs"))
    finally:
        server.stop()


def test_the_charts_acl_script_makes_the_same_users(tmp_path):
    """The Redis StatefulSet's start script, as rendered, run against this Redis."""
    pytest.importorskip("helm_python")
    from tests.unit.test_chart import by_kind, render

    docs, _ = render({})
    container = by_kind(docs, "StatefulSet")["rl-reflow-redis"]["spec"]["template"]["spec"][
        "containers"][0]
    port = free_port()
    script = (container["args"][0].replace("/tmp/users.acl", str(tmp_path / "users.acl"))
              .replace("exec redis-server", f"exec {redis_server_binary()} --port {port} "
                                            "--bind 127.0.0.1")
              .replace("--dir /data", f"--dir {tmp_path}"))
    passwords = redis_acl.Passwords.mint()
    env = {**os.environ, "REDIS_PASSWORD": passwords.admin,
           **{f"REDIS_{name.upper()}_PASSWORD": pw for name, pw in passwords.users.items()}}
    proc = subprocess.Popen(container["command"] + [script], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = EmbeddedRedis(tmp_path, port=port, passwords=passwords)
    try:
        admin = redis.Redis(port=port, password=passwords.admin)
        # A hang guard for the server's start, not a speed bound: it fails at once
        # if the start script exits (a rule Redis refused).
        deadline = time.monotonic() + 120
        while True:
            try:
                admin.ping()
                break
            except redis.ConnectionError:
                assert proc.poll() is None, "the chart's Redis start script exited"
                assert time.monotonic() < deadline, "Redis did not answer within 120 s"
                time.sleep(0.05)
        assert (tmp_path / "users.acl").stat().st_mode & 0o777 == 0o600
        # The same users as the embedded Redis makes from redis_acl.py.
        rules = {line.split()[1]: line for line in admin.acl_list()}
        assert set(rules) == {redis_acl.ADMIN_USER, *redis_acl.USER_NAMES}
        _fill(server)
        _refused(lambda: as_user(server, "replay").hgetall("reflow:jobs"))
        _refused(lambda: as_user(server, "scheduler").get(f"reflow:{{{JOB}}}:config"))
        _refused(lambda: as_user(server, "replay").flushall())
    finally:
        proc.terminate()
        proc.wait(10)
