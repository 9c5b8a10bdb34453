"""The replay buffer over real gRPC on loopback, backed by a real Redis."""

import time

import grpc

from reflow import rpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from reflow.replay.client import GrpcReplayClient
from reflow.replay.server import serve
from reflow.core.types import Segment
from reflow.replay.store import ReplayStore
from tests.integration.samples import make_group


@pytest.fixture
def buffer(redis_server, redis_client):
    server, port = serve(ReplayStore.from_url(redis_server.url), "127.0.0.1:0")
    client = GrpcReplayClient(f"127.0.0.1:{port}")
    yield client, port
    client.close()
    server.stop(0)


def test_health_service_reports_serving(buffer):
    _, port = buffer
    with rpc.channel(f"127.0.0.1:{port}") as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="reflow.v1.ReplayBuffer"), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_put_sample_release_round_trip(buffer):
    client, _ = buffer
    assert client.put("job", make_group("g1") + make_group("g2")) == 8
    assert client.put("job", make_group("g1")) == 0  # a retried put is a no-op
    batch = client.sample("job", batch_size=8, lease_ttl_s=30, timeout_s=1)
    assert batch is not None and len(batch.trajectories) == 8
    assert {t.group_id for t in batch.trajectories} == {"g1", "g2"}
    t = next(t for t in batch.trajectories if t.sample_id == "g1-2")
    assert t.response_ids == [3, 4, 5] and t.reward == 2.0 and t.segments == [Segment(0, 3)]
    stats = client.stats("job")
    assert (stats.unused_samples, stats.leased_samples, stats.outstanding_leases) == (0, 8, 1)
    assert client.release("job", batch.lease_id) == 8
    assert client.release("job", batch.lease_id) == 0  # idempotent
    stats = client.stats("job")
    assert (stats.put_total, stats.trained_total, stats.leased_samples) == (8, 8, 0)
    # The default filter accepts everything back for replay.
    assert (stats.replay_samples, stats.unused_samples) == (8, 0)


def test_sample_waits_for_a_full_batch_then_times_out(buffer):
    client, _ = buffer
    client.put("job", make_group("g1"))
    start = time.monotonic()
    assert client.sample("job", batch_size=8, lease_ttl_s=30, timeout_s=0.5) is None
    assert time.monotonic() - start >= 0.45
    # Nothing was taken by the failed attempt.
    assert client.stats("job").unused_samples == 4


def test_expired_lease_returns_its_samples(buffer):
    client, _ = buffer
    client.put("job", make_group("g1"))
    client.put("job", make_group("g2"))
    first = client.sample("job", batch_size=4, lease_ttl_s=0.3, timeout_s=1)
    time.sleep(0.4)
    again = client.sample("job", batch_size=8, lease_ttl_s=30, timeout_s=1)
    # The expired lease's group is unused again and can fill a full batch.
    assert {t.group_id for t in again.trajectories} == {"g1", "g2"}
    assert all(t.uses == 0 for t in again.trajectories)
    assert client.release("job", first.lease_id) == 0  # the expired lease is gone
    assert client.stats("job").expired_leases_total == 1


def test_jobs_are_isolated(buffer):
    client, _ = buffer
    client.put("a", make_group("g1"))
    assert client.sample("b", batch_size=4, lease_ttl_s=30, timeout_s=0.1) is None
    assert client.sample("a", batch_size=4, lease_ttl_s=30, timeout_s=0.1) is not None


def test_buffer_restart_loses_nothing(redis_server, redis_client):
    server, port = serve(ReplayStore.from_url(redis_server.url), "127.0.0.1:0")
    client = GrpcReplayClient(f"127.0.0.1:{port}")
    client.put("job", make_group("g1") + make_group("g2"))
    leased = client.sample("job", batch_size=4, lease_ttl_s=0.5, timeout_s=1)
    client.close()
    server.stop(0)
    # A new buffer process on the same Redis sees everything: the unused group and,
    # once its lease expires, the leased one.
    server, port = serve(ReplayStore.from_url(redis_server.url), "127.0.0.1:0")
    client = GrpcReplayClient(f"127.0.0.1:{port}")
    try:
        time.sleep(0.6)
        batch = client.sample("job", batch_size=8, lease_ttl_s=30, timeout_s=1)
        assert batch is not None
        assert sorted(t.sample_id for t in batch.trajectories) == sorted(
            [f"g1-{i}" for i in range(4)] + [f"g2-{i}" for i in range(4)])
        assert leased.lease_id != batch.lease_id
    finally:
        client.close()
        server.stop(0)


def test_bad_arguments_are_invalid_argument(buffer):
    client, _ = buffer
    with pytest.raises(grpc.RpcError) as err:
        client.sample("job", batch_size=0, lease_ttl_s=30, timeout_s=0.1)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "batch_size" in err.value.details()


def test_prometheus_metrics_follow_the_buffer(redis_server, redis_client):
    from prometheus_client import generate_latest

    from reflow.replay.metrics import BufferMetrics

    store = ReplayStore.from_url(redis_server.url)
    metrics = BufferMetrics(store)
    server, port = serve(store, "127.0.0.1:0", metrics)
    client = GrpcReplayClient(f"127.0.0.1:{port}")
    try:
        client.put("job", make_group("g1") + make_group("g2"))
        batch = client.sample("job", batch_size=4, lease_ttl_s=30, timeout_s=1)
        client.release("job", batch.lease_id)
        text = generate_latest(metrics.registry).decode()
    finally:
        client.close()
        server.stop(0)
    assert 'reflow_replay_pool_samples{job_id="job",pool="unused"} 4.0' in text
    assert 'reflow_replay_pool_samples{job_id="job",pool="replay"} 4.0' in text
    assert 'reflow_replay_batch_samples_total{job_id="job",kind="fresh"} 4.0' in text
    assert 'reflow_replay_sample_staleness_versions_count{job_id="job"} 4.0' in text
    assert 'reflow_replay_put_samples_total{job_id="job"} 8.0' in text
    assert 'reflow_replay_evicted_samples_total{job_id="job"} 0.0' in text


def test_a_renewed_lease_outlives_its_ttl_and_a_lapsed_one_gives_its_samples_back(buffer):
    client, _ = buffer
    client.put("job", make_group("g1"))
    batch = client.sample("job", batch_size=4, lease_ttl_s=1.0, timeout_s=1)
    deadline = time.monotonic() + 2.5
    while time.monotonic() < deadline:  # a long training step, renewing every 1/3 TTL
        assert client.renew_lease("job", batch.lease_id, 1.0)
        time.sleep(0.3)
    assert client.stats("job").outstanding_leases == 1
    assert client.sample("job", batch_size=4, lease_ttl_s=1.0, timeout_s=0.1) is None
    time.sleep(1.3)  # no more renewals: the lease lapses and its samples return
    again = client.sample("job", batch_size=4, lease_ttl_s=30, timeout_s=1)
    assert again is not None and {t.sample_id for t in again.trajectories} == \
        {t.sample_id for t in batch.trajectories}
    assert not client.renew_lease("job", batch.lease_id, 1.0)  # gone: nothing to renew
    assert client.release("job", again.lease_id) == 4
    assert not client.renew_lease("job", again.lease_id, 30)


def test_dispatch_grants_and_lease_return_over_grpc(buffer):
    """One dispatch budget per job, in whole groups; a lease given back untrained
    returns its samples without counting them as trained."""
    client, _ = buffer
    assert client.acquire_dispatch("disp", 10, 4, 8, 8) == 8  # whole groups, within 8
    assert client.acquire_dispatch("disp", 8, 4, 8, 8) == 0  # outstanding is at its bound
    client.put("disp", make_group("d1") + make_group("d2"))
    batch = client.sample("disp", batch_size=8, lease_ttl_s=30, timeout_s=1)
    assert client.return_lease("disp", batch.lease_id) == 8
    stats = client.stats("disp")
    assert (stats.dispatched_total, stats.unused_samples, stats.trained_total) == (8, 8, 0)
    with pytest.raises(grpc.RpcError) as err:
        client.acquire_dispatch("disp", 8, 0, 8, 8)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "group_size" in err.value.details()
