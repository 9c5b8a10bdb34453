"""The pieces that make transient faults retried: the channels' retry service
config (valid, and deciding every method of every service), gRPC applying it to
a real in-process server, the bounded Redis retry, the request deadline scope,
and the tolerance of a poll for failures in a row."""

import json
import re
import threading
import time

import grpc
import pytest
import redis
from reflow import redisconn, rpc
from reflow.core import deadline
from reflow.core.errors import ConsecutiveFailures, Unavailable
from reflow.v1 import (
    common_pb2,
    replay_pb2,
    replay_pb2_grpc,
    rollout_pb2,
    scheduler_pb2,
    scheduler_pb2_grpc,
    trainer_pb2,
    worker_pb2,
    sandbox_pb2,
)

STATUS_CODES = {code.name for code in grpc.StatusCode}
GENERATED = (replay_pb2, rollout_pb2, trainer_pb2, scheduler_pb2, worker_pb2, sandbox_pb2)


def every_method() -> set[tuple[str, str]]:
    return {(service.full_name, method.name) for module in GENERATED
            for service in module.DESCRIPTOR.services_by_name.values()
            for method in service.methods}


def decided(table: dict[str, dict[str, str]]) -> set[tuple[str, str]]:
    return {(service, method) for service, methods in table.items() for method in methods}


def test_the_service_config_is_valid_json_with_one_retry_policy():
    config = json.loads(rpc.service_config())
    (method_config,) = config["methodConfig"]
    policy = method_config["retryPolicy"]
    # gRFC A6: maxAttempts 2 or more (gRPC caps it at 5), durations in seconds.
    assert 2 <= policy["maxAttempts"] <= 5
    for key in ("initialBackoff", "maxBackoff"):
        assert re.fullmatch(r"\d+(\.\d+)?s", policy[key]), policy[key]
    assert float(policy["maxBackoff"][:-1]) >= float(policy["initialBackoff"][:-1]) > 0
    assert policy["backoffMultiplier"] > 0
    assert set(policy["retryableStatusCodes"]) <= STATUS_CODES
    assert policy["retryableStatusCodes"] == ["UNAVAILABLE"]
    names = {(n["service"], n["method"]) for n in method_config["name"]}
    assert names == decided(rpc.RETRIED_METHODS)
    assert len(method_config["name"]) == len(names)  # each name once, as gRPC requires


def test_every_method_of_every_service_is_decided_once_with_a_reason():
    retried, not_retried = decided(rpc.RETRIED_METHODS), decided(rpc.NOT_RETRIED_METHODS)
    assert not retried & not_retried
    assert retried | not_retried == every_method()
    for table in (rpc.RETRIED_METHODS, rpc.NOT_RETRIED_METHODS):
        assert all(reason.strip() for methods in table.values() for reason in methods.values())


def test_calls_that_must_not_run_twice_are_not_retried():
    retried = decided(rpc.RETRIED_METHODS)
    for method in [("reflow.v1.Scheduler", "SubmitJob"), ("reflow.v1.Scheduler", "RequestFlip"),
                   ("reflow.v1.Scheduler", "ResumeJob"), ("reflow.v1.Trainer", "JoinGroup"),
                   ("reflow.v1.Rollout", "InitWeightSync"), ("reflow.v1.Rollout", "Evaluate")]:
        assert method not in retried
    assert ("reflow.v1.ReplayBuffer", "Put") in retried
    assert ("reflow.v1.Rollout", "GetStats") in retried


def test_every_channel_carries_the_policy():
    options = dict(rpc.CHANNEL_OPTIONS)
    assert options["grpc.service_config"] == rpc.service_config()
    assert options["grpc.enable_retries"] == 1


class Flaky(replay_pb2_grpc.ReplayBufferServicer):
    """GetStats answers UNAVAILABLE `failures` times, then OK."""

    def __init__(self, failures: int) -> None:
        self.failures, self.calls = failures, 0

    def GetStats(self, request, context):
        self.calls += 1
        if self.calls <= self.failures:
            context.abort(grpc.StatusCode.UNAVAILABLE, "restarting")
        return replay_pb2.BufferStats(put_total=7)


class FlakySubmit(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self) -> None:
        self.calls = 0

    def SubmitJob(self, request, context):
        self.calls += 1
        context.abort(grpc.StatusCode.UNAVAILABLE, "restarting")


def test_grpc_retries_a_retried_method_and_sends_another_once():
    replay, scheduler = Flaky(failures=2), FlakySubmit()

    def register(server):
        replay_pb2_grpc.add_ReplayBufferServicer_to_server(replay, server)
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(scheduler, server)

    server, port = rpc.make_server(("reflow.v1.ReplayBuffer", "reflow.v1.Scheduler"), register,
                                   "127.0.0.1:0")
    try:
        with rpc.channel(f"127.0.0.1:{port}") as ch:
            reply = replay_pb2_grpc.ReplayBufferStub(ch).GetStats(
                common_pb2.JobRef(job_id="j"), timeout=10)
            assert reply.put_total == 7 and replay.calls == 3
            with pytest.raises(grpc.RpcError) as err:
                scheduler_pb2_grpc.SchedulerStub(ch).SubmitJob(
                    scheduler_pb2.SubmitJobRequest(spec_json="{}"), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and scheduler.calls == 1
    finally:
        server.stop(0)


def test_transient_codes_become_unavailable_and_others_pass():
    server, port = rpc.make_server("reflow.v1.ReplayBuffer", lambda s: None, "127.0.0.1:0")
    server.stop(0)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = replay_pb2_grpc.ReplayBufferStub(ch)
        with (pytest.raises(Unavailable, match="buffer: UNAVAILABLE"),
              rpc.transient_as_unavailable("buffer")):
            stub.GetStats(common_pb2.JobRef(job_id="j"), timeout=2)
    with pytest.raises(ValueError), rpc.transient_as_unavailable("buffer"):
        raise ValueError("not a call")


def test_a_deadline_scope_nests_and_ends():
    assert deadline.remaining_s() is None
    with deadline.scope(5.0):
        assert 4.5 < deadline.remaining_s() <= 5.0
        with deadline.scope(1.0):
            assert deadline.remaining_s() <= 1.0
        assert deadline.remaining_s() > 4.0
        with deadline.scope(None):
            assert deadline.remaining_s() is None
    assert deadline.remaining_s() is None
    seen = []
    with deadline.scope(5.0):
        thread = threading.Thread(target=lambda: seen.append(deadline.remaining_s()))
        thread.start()
        thread.join()
    assert seen == [None]  # per thread: a handler's scope is its own


class Outage:
    """An operation that fails with `error` for `failures` attempts, then answers."""

    def __init__(self, failures: int, error: Exception) -> None:
        self.failures, self.error, self.attempts, self.cleanups = failures, error, 0, 0

    def __call__(self):
        self.attempts += 1
        if self.attempts <= self.failures:
            raise self.error
        return "ok"

    def fail(self, error) -> None:
        self.cleanups += 1


def test_redis_retry_rides_out_a_short_outage_and_counts_it():
    retry = redisconn.BoundedRetry(max_outage_s=5.0)
    op = Outage(3, redis.ConnectionError("refused"))
    assert retry.call_with_retry(op, op.fail) == "ok"
    assert op.attempts == 4 and op.cleanups == 3
    assert retry.snapshot() == {("connection", "retried"): 3}


def test_redis_retry_gives_up_past_its_bound_as_unavailable():
    retry = redisconn.BoundedRetry(max_outage_s=0.3)
    op = Outage(10**6, redis.BusyLoadingError("LOADING"))
    started = time.monotonic()
    with pytest.raises(redisconn.RedisUnavailable) as err:
        retry.call_with_retry(op, op.fail)
    assert time.monotonic() - started < 1.0
    # Both redis' error (redis-py's callers) and the core one (servers map it).
    assert isinstance(err.value, redis.ConnectionError) and isinstance(err.value, Unavailable)
    assert retry.snapshot()[("loading", "gave_up")] == 1


def test_redis_retry_stops_at_the_request_deadline():
    retry = redisconn.BoundedRetry(max_outage_s=30.0)
    op = Outage(10**6, redis.TimeoutError("slow"))
    started = time.monotonic()
    with deadline.scope(0.4), pytest.raises(redisconn.RedisUnavailable):
        retry.call_with_retry(op, op.fail)
    assert time.monotonic() - started < 0.5


def test_a_nested_redis_retry_makes_one_attempt_under_the_outer_bound():
    # redis-py reconnects inside a command's attempt with the same retry object:
    # the nested call must not wait out a bound of its own.
    retry = redisconn.BoundedRetry(max_outage_s=0.3)
    inner = Outage(10**6, redis.ConnectionError("refused"))

    def command():
        return retry.call_with_retry(inner, inner.fail)

    started = time.monotonic()
    with pytest.raises(redisconn.RedisUnavailable):
        retry.call_with_retry(command, lambda error: None)
    assert time.monotonic() - started < 1.0
    assert inner.cleanups == inner.attempts  # each nested failure cleaned up once


def test_redis_connections_share_the_retry_and_its_tally():
    client = redisconn.connect("redis://127.0.0.1:1/0", max_outage_s=0.0)
    retry = client.get_retry()
    assert isinstance(retry, redisconn.BoundedRetry)
    assert client.connection_pool.make_connection().retry is retry
    with pytest.raises(redisconn.RedisUnavailable):
        client.ping()  # nothing listens on port 1
    assert redisconn.errors_of(client) == {("connection", "gave_up"): 1}
    assert redisconn.errors_of(redis.Redis()) == {}


def test_a_poll_tolerates_failures_in_a_row_up_to_its_limit():
    polls = ConsecutiveFailures("poll", limit=2)
    results = iter([Unavailable("a"), Unavailable("b"), 1, Unavailable("c"), Unavailable("d"),
                    Unavailable("e")])

    def fn():
        value = next(results)
        if isinstance(value, Exception):
            raise value
        return value

    assert [polls.call(fn) for _ in range(5)] == [None, None, 1, None, None]
    with pytest.raises(Unavailable, match="3 failures in a row"):
        polls.call(fn)
    with pytest.raises(KeyError):  # only transient failures are tolerated
        ConsecutiveFailures("poll", 5).call(lambda: {}["x"])
