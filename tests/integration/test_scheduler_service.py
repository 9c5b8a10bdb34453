"""The scheduler over real gRPC with its job store in a real Redis."""

import pytest
import redis

from reflow.core.errors import InvalidArgument, NotFound
from reflow.scheduler.client import GrpcSchedulerClient
from reflow.scheduler.jobs import JobRecord, JobStore
from reflow.scheduler.local import LocalBackend
from reflow.scheduler.server import serve
from reflow.scheduler.service import Scheduler


@pytest.fixture
def scheduler(redis_server, redis_client, tmp_path):
    core = Scheduler(JobStore(redis.Redis.from_url(redis_server.url)),
                     LocalBackend(redis_server.url), tmp_path)
    server, port = serve(core, "127.0.0.1:0")
    client = GrpcSchedulerClient(f"127.0.0.1:{port}")
    yield core, client
    client.close()
    server.stop(0)


def test_invalid_spec_and_unknown_job_map_to_typed_errors(scheduler):
    _, client = scheduler
    with pytest.raises(InvalidArgument, match="batch_size"):
        client.submit('{"model": {"path": "/m"}, "trainer": {"batch_size": -1}}')
    with pytest.raises(NotFound, match="nope"):
        client.get("nope")


def test_job_records_survive_a_scheduler_restart(redis_server, redis_client, tmp_path):
    store = JobStore(redis.Redis.from_url(redis_server.url))
    store.create(JobRecord(job_id="done", name="a", spec_json="{}", phase="SUCCEEDED", step=5))
    store.create(JobRecord(job_id="mid", name="b", spec_json="{}", phase="RUNNING", step=2))
    # A new scheduler on the same Redis: finished jobs read back intact; a job that
    # was running under the dead scheduler is failed with a reason, not left RUNNING.
    core = Scheduler(JobStore(redis.Redis.from_url(redis_server.url)),
                     LocalBackend(redis_server.url), tmp_path)
    core.recover()
    server, port = serve(core, "127.0.0.1:0")
    client = GrpcSchedulerClient(f"127.0.0.1:{port}")
    try:
        assert client.get("done").phase == "SUCCEEDED" and client.get("done").step == 5
        mid = client.get("mid")
        assert mid.phase == "FAILED" and "restarted" in mid.reason
        assert {j.job_id for j in client.list()} == {"done", "mid"}
    finally:
        client.close()
        server.stop(0)


def test_submission_with_a_known_id_is_idempotent(redis_server, redis_client):
    store = JobStore(redis.Redis.from_url(redis_server.url))
    first = store.create(JobRecord(job_id="j", name="a", spec_json="{}"))
    again = store.create(JobRecord(job_id="j", name="other", spec_json="{}"))
    assert again.name == first.name == "a"
