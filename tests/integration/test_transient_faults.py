"""Transient faults are retried, not fatal, over real processes: a Redis
SIGKILLed and started again on its port and data dir is ridden out by the
buffer's Redis retries (and counted); a Redis that stays down is answered
UNAVAILABLE, in time for the caller's deadline; a gRPC server SIGKILLed and
started again on its port is ridden out by the channel's retry policy; a
dispatcher whose buffer went away ends in one line, not a traceback; calls
cancelled by a stopping buffer are retried into its restart; and a job's
final record survives a Redis restart, its save never raising."""

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from reflow import redisconn, rpcauth
from reflow.core.config import ReplayConfig, parse_job_spec
from reflow.core.errors import Unavailable
from reflow.procs import free_port
from reflow.replay.client import GrpcReplayClient
from reflow.replay.embedded import EmbeddedRedis
from reflow.replay.metrics import BufferMetrics
from reflow.replay.server import serve
from reflow.replay.store import ReplayStore
from reflow.rollout.client import RolloutStats
from reflow.scheduler.jobcontrol import jobs
from reflow.scheduler.generation.dispatch import Dispatcher
from reflow.tasks import TaskContext
from reflow.tasks.repeat import RepeatTask
from reflow.v1 import common_pb2, replay_pb2_grpc

from tests.integration.samples import make_group

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def own_redis(tmp_path):
    """A Redis of this test alone, free to be killed; start() again restarts it on
    the same port and data dir. `always`: these tests count every acknowledged write
    after a SIGKILL, which `everysec` does not promise while another process loads the
    disk (Redis may then acknowledge a write up to 2 s before it reaches the file;
    docs/operations/faults.md, "Durability")."""
    server = EmbeddedRedis(tmp_path / "redis", appendfsync="always").start()
    yield server
    server.stop()


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def redis_errors(metrics: BufferMetrics, outcome: str) -> float:
    return metrics.registry.get_sample_value(
        "reflow_replay_redis_errors_total", {"kind": "connection", "outcome": outcome}) or 0.0


def test_buffer_calls_ride_out_a_redis_restart(own_redis):
    store = ReplayStore.from_url(own_redis.url)
    metrics = BufferMetrics(store)
    server, port = serve(store, "127.0.0.1:0", metrics)
    # retry_s=0: the client's own loop does not retry, so what rides the outage out
    # is the buffer's retrying of Redis.
    client = GrpcReplayClient(f"127.0.0.1:{port}", deadline_s=15, retry_s=0)
    done: list[int] = []
    errors: list[Exception] = []

    def write() -> None:
        try:
            for i in range(40):
                client.put("job", make_group(f"g{i}"))
                client.stats("job")
                done.append(i)
                time.sleep(0.05)
        except Exception as err:  # noqa: BLE001 - surfaced by the assertion below
            errors.append(err)

    try:
        client.configure("job", ReplayConfig(max_staleness=10, replay_cap=0.0))
        writer = threading.Thread(target=write)
        writer.start()
        while len(done) < 5 and writer.is_alive():
            time.sleep(0.01)
        kill(own_redis.proc)
        time.sleep(1.5)  # the writer's calls meet a dead Redis meanwhile
        own_redis.start()
        writer.join(60)
        assert not errors, errors
        assert len(done) == 40
        assert client.stats("job").put_total == 40 * 4  # nothing lost, nothing twice
        assert redis_errors(metrics, "retried") > 0
        assert redis_errors(metrics, "gave_up") == 0
    finally:
        client.close()
        server.stop(0)


def test_a_redis_down_past_the_bound_is_unavailable(own_redis):
    store = ReplayStore.from_url(own_redis.url, max_outage_s=1.0)
    metrics = BufferMetrics(store)
    server, port = serve(store, "127.0.0.1:0", metrics)
    # The default bound (20 s), under a caller's deadline shorter than it.
    patient = ReplayStore.from_url(own_redis.url)
    patient_server, patient_port = serve(patient, "127.0.0.1:0")
    try:
        store.configure("job", ReplayConfig())
        kill(own_redis.proc)
        # A plain channel (no retry policy): the server's own answer, once.
        with rpcauth.authenticated(grpc.insecure_channel(f"127.0.0.1:{port}")) as ch:
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                replay_pb2_grpc.ReplayBufferStub(ch).GetStats(
                    common_pb2.JobRef(job_id="job"), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
            assert "Redis unreachable" in err.value.details()
            assert time.monotonic() - started < 5
        assert redis_errors(metrics, "gave_up") >= 1
        # A handler gives up on Redis within its caller's deadline, to answer in time.
        with rpcauth.authenticated(grpc.insecure_channel(f"127.0.0.1:{patient_port}")) as ch:
            with pytest.raises(grpc.RpcError) as err:
                replay_pb2_grpc.ReplayBufferStub(ch).GetStats(
                    common_pb2.JobRef(job_id="job"), timeout=1.5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
        # The client (channel retries included) surfaces it as the core error.
        client = GrpcReplayClient(f"127.0.0.1:{port}", deadline_s=2, retry_s=0)
        try:
            with pytest.raises(Unavailable):
                client.stats("job")
        finally:
            client.close()
    finally:
        server.stop(0)
        patient_server.stop(0)


def standby_server(port: int, redis_url: str, log) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.replay_standby", str(port), redis_url],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
    assert proc.stdout.readline().strip() == b"ready"
    return proc


def go(proc: subprocess.Popen) -> None:
    proc.stdin.write(b"go\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == b"serving"


def test_a_call_to_a_server_killed_and_restarted_succeeds_by_the_retry_policy(
        redis_server, redis_client, tmp_path):
    address = f"127.0.0.1:{free_port()}"
    port = int(address.rpartition(":")[2])
    procs: list[subprocess.Popen] = []
    # retry_s=0: the client's own loop does not retry; only the channel's policy does.
    client = GrpcReplayClient(address, deadline_s=30, retry_s=0)
    with open(tmp_path / "servers.log", "ab") as log:
        try:
            procs.append(standby_server(port, redis_server.url, log))
            go(procs[0])
            client.configure("job", ReplayConfig())
            client.put("job", make_group("g1"))
            procs.append(standby_server(port, redis_server.url, log))  # the restart, warm
            kill(procs[0])
            # Without the policy a call now fails at once.
            with rpcauth.authenticated(grpc.insecure_channel(address)) as ch:
                with pytest.raises(grpc.RpcError) as err:
                    replay_pb2_grpc.ReplayBufferStub(ch).GetStats(
                        common_pb2.JobRef(job_id="job"), timeout=5)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            result: dict = {}

            def call() -> None:
                try:
                    result["stats"] = client.stats("job")
                except Exception as err:  # noqa: BLE001 - surfaced by the assertion below
                    result["error"] = err

            caller = threading.Thread(target=call)
            caller.start()
            time.sleep(1.0)  # attempts fail meanwhile, the policy backs off
            assert caller.is_alive() and not result, result
            go(procs[1])
            caller.join(15)
            assert "error" not in result, result
            assert result["stats"].put_total == 4
        finally:
            client.close()
            for proc in procs:
                if proc.poll() is None:
                    kill(proc)


class IdleWorker:
    """A rollout worker that is up and generates nothing (the buffer is under test)."""

    address = "idle"

    def submit_group(self, job_id, group_id, prompt, concurrency_cap=0, bounds=None):
        return True

    def wait_events(self, job_id, since_seq, wait_s):
        time.sleep(min(wait_s, 0.2))
        return []

    def stats(self, job_id):
        return RolloutStats(0, 0, 0.0, 0, 0, "running", "")


def dispatcher_on(replay: GrpcReplayClient) -> Dispatcher:
    spec = parse_job_spec({"model": {"path": "/m"}, "mode": "reflow",
                           "trainer": {"batch_size": 8}, "replay": {"max_staleness": 1},
                           # Room for every grant: the loop keeps asking the buffer.
                           "rollout": {"group_size": 2, "max_inflight_samples": 1024},
                           "scheduler": {"adaptive": False}})
    return Dispatcher("job", spec, replay, {"w0": IdleWorker()},
                      RepeatTask(8, 3, context=TaskContext(seed=0)))


def dispatch_tracebacks(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records
            if r.name == "reflow.scheduler.generation.dispatch" and r.exc_info is not None]


def test_a_dispatcher_whose_buffer_went_away_ends_in_one_line(redis_server, redis_client,
                                                              caplog):
    caplog.set_level(logging.INFO, logger="reflow.scheduler.generation.dispatch")
    server, port = serve(ReplayStore.from_url(redis_server.url), "127.0.0.1:0")
    address = f"127.0.0.1:{port}"
    # The job's end: its buffer is gone and the scheduler closes the client while
    # the dispatch thread still retries through it.
    replay = GrpcReplayClient(address)
    dispatcher = dispatcher_on(replay)
    dispatcher.start()
    time.sleep(0.5)  # granting
    server.stop(0)
    time.sleep(0.5)  # the dispatch thread now retries a dead buffer
    dispatcher.stop(timeout_s=0.5)
    replay.close()
    for thread in dispatcher._threads:
        thread.join(10)
        assert not thread.is_alive(), thread.name
    assert not dispatch_tracebacks(caplog)
    assert any("ended while stopping" in r.getMessage() for r in caplog.records)
    assert not dispatcher.error
    # A buffer gone for good while the job runs: a one-line error for the watcher.
    replay = GrpcReplayClient(address, deadline_s=1, retry_s=0)
    dispatcher = dispatcher_on(replay)
    dispatcher.start()
    try:
        deadline = time.monotonic() + 10
        while not dispatcher.error and time.monotonic() < deadline:
            time.sleep(0.05)
        assert dispatcher.error.startswith("Unavailable: replay buffer"), dispatcher.error
        assert not dispatch_tracebacks(caplog)
    finally:
        dispatcher.stop(timeout_s=2)
        replay.close()


def test_calls_cancelled_by_a_stopping_buffer_are_retried_into_its_restart(redis_server):
    """A buffer stopping cancels the calls it is serving (CANCELLED, not UNAVAILABLE;
    about one stop in three catches a call in flight): the client takes that as the
    restart it is, not as an error of the call."""
    store = ReplayStore.from_url(redis_server.url)
    store.configure("cancelled", ReplayConfig())
    server, port = serve(store, "127.0.0.1:0")
    client = GrpcReplayClient(f"127.0.0.1:{port}", deadline_s=30, retry_s=30)
    calls: list[int] = []
    errors: list[Exception] = []
    stop = threading.Event()

    def hammer() -> None:
        try:
            while not stop.is_set():
                client.stats("cancelled")
                calls.append(1)
        except Exception as err:  # noqa: BLE001 - surfaced by the assertion below
            errors.append(err)

    caller = threading.Thread(target=hammer)
    caller.start()
    try:
        for _ in range(10):
            time.sleep(0.3)
            server.stop(0)
            server, _ = serve(store, f"127.0.0.1:{port}")
        time.sleep(0.3)
    finally:
        stop.set()
        caller.join(30)
        client.close()
        server.stop(0)
    assert not errors, errors
    assert len(calls) > 10


def test_a_job_s_final_save_rides_out_a_redis_restart_and_never_raises(own_redis, monkeypatch,
                                                                        caplog):
    monkeypatch.setattr(jobs, "FINAL_SAVE_RETRY_S", 0.2)
    store = jobs.JobStore(redisconn.connect(own_redis.url, max_outage_s=0.5))
    record, created = store.create(jobs.JobRecord("j1", "n", "{}"))
    assert created
    # The same insert again (a retry whose first reply was lost) is still this
    # call's creation; another record under the id is not.
    assert store.create(record) == (record, True)
    assert not store.create(jobs.JobRecord("j1", "other", "{}"))[1]
    kill(own_redis.proc)
    record.phase, record.reason = "FAILED", "a test"
    restart = threading.Timer(1.5, own_redis.start)
    restart.start()
    try:
        assert store.save_final(record, timeout_s=15)  # past the client's own 0.5 s bound
    finally:
        restart.join()
    assert store.get("j1").phase == "FAILED"
    kill(own_redis.proc)
    record.phase = "STOPPED"
    assert not store.save_final(record, timeout_s=1.0)  # logged, not raised
    assert any(r.levelname == "ERROR" and "could not be stored" in r.getMessage()
               for r in caplog.records)
