"""The scheduler over real gRPC with its job store in a real Redis."""

import threading
import time

import pytest
import redis

from reflow.core.paths import PathRoots
from reflow.core.errors import Conflict, InvalidArgument, NoCapacity, NotFound
from reflow.scheduler.client import GrpcSchedulerClient
from reflow.scheduler.jobcontrol.jobs import JobRecord, JobStore
from reflow.scheduler.cluster.local import LocalBackend, Placement
from reflow.scheduler.server import serve
from reflow.scheduler.jobcontrol.service import Scheduler


@pytest.fixture
def scheduler(redis_server, redis_client, tmp_path):
    core = Scheduler(JobStore(redis.Redis.from_url(redis_server.url)),
                     LocalBackend(redis_server.url), PathRoots(tmp_path, tmp_path))
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
                     LocalBackend(redis_server.url), PathRoots(tmp_path, tmp_path))
    core.recover()
    server, port = serve(core, "127.0.0.1:0")
    client = GrpcSchedulerClient(f"127.0.0.1:{port}")
    try:
        assert client.get("done").phase == "SUCCEEDED" and client.get("done").step == 5
        mid = client.get("mid")
        assert mid.phase == "FAILED" and "restarted" in mid.reason
        jobs, token = client.list()
        assert {j.job_id for j in jobs} == {"done", "mid"} and token == ""
    finally:
        client.close()
        server.stop(0)


def test_store_create_keeps_the_first_record_of_an_id(redis_server, redis_client):
    store = JobStore(redis.Redis.from_url(redis_server.url))
    first, created = store.create(JobRecord(job_id="j", name="a", spec_json="{}"))
    again, created_again = store.create(JobRecord(job_id="j", name="other", spec_json="{}"))
    assert (created, created_again) == (True, False)
    assert again.name == first.name == "a"


def test_pages_are_stable_while_jobs_arrive(redis_server, redis_client):
    store = JobStore(redis.Redis.from_url(redis_server.url))
    for i in range(5):
        store.create(JobRecord(job_id=f"j{i}", name="a", spec_json="{}"))
    first, token = store.page(2)
    assert [r.job_id for r in first] == ["j4", "j3"] and token
    store.create(JobRecord(job_id="late", name="a", spec_json="{}"))  # must not shift page 2
    second, token = store.page(2, token)
    third, last = store.page(2, token)
    assert [r.job_id for r in second] == ["j2", "j1"]
    assert [r.job_id for r in third] == ["j0"] and last == ""
    for bad in ("not-a-token", "²", "١٢", "1" * 21):  # Unicode digits are digits to str
        with pytest.raises(ValueError, match="page_token"):
            store.page(2, bad)


def test_step_metrics_are_kept_in_order_and_read_after_a_step(redis_server, redis_client):
    store = JobStore(redis.Redis.from_url(redis_server.url))
    store.create(JobRecord(job_id="m", name="a", spec_json="{}"))
    store.append_metrics("m", [{"step": 2, "reward_mean": 0.2}, {"step": 1, "reward_mean": 0.1}])
    store.append_metrics("m", [{"step": 3, "reward_mean": 0.3}])
    assert [r["step"] for r in store.metrics("m")] == [1, 2, 3]
    assert [r["step"] for r in store.metrics("m", since_step=1, limit=1)] == [2]
    with pytest.raises(KeyError):
        store.metrics("unknown")


def test_resubmission_is_idempotent_and_a_changed_spec_conflicts(scheduler, tmp_path):
    _, client = scheduler
    spec = '{"model": {"path": "%s"}, "trainer": {"num_steps": 3}}' % (tmp_path / "absent")
    job, created = client.submit(spec, job_id="once")
    again, created_again = client.submit(spec, job_id="once")
    assert (created, created_again) == (True, False) and again.job_id == job.job_id == "once"
    with pytest.raises(Conflict, match="different spec"):
        client.submit(spec.replace('"num_steps": 3', '"num_steps": 4'), job_id="once")
    with pytest.raises(InvalidArgument, match="job_id"):
        client.submit(spec, job_id="Not_A_Label")
    # The model directory does not exist: the job fails with the field named.
    deadline = time.monotonic() + 30
    while (job := client.get("once")).phase not in ("FAILED", "SUCCEEDED"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert job.phase == "FAILED" and "model.path" in job.reason


class FullBackend:
    """A backend with no free workers until `free` is set; then it places the job
    on addresses where nothing listens."""

    def __init__(self):
        self.free = threading.Event()
        self.placed = []

    def prepare(self, spec):
        pass

    def place(self, job_id, run_dir, colocated=False):
        if not self.free.is_set():
            raise NoCapacity("job needs 2 free workers and 0 are free")
        self.placed.append(job_id)
        return Placement(replay_address="127.0.0.1:1", rollout_addresses=["127.0.0.1:1"],
                         trainer_address="127.0.0.1:1")

    def release(self, placement):
        pass


def _wait_for(fn, timeout_s=30):
    deadline = time.monotonic() + timeout_s
    while not (value := fn()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return value


def test_a_job_waits_pending_for_free_workers_and_can_be_stopped_there(redis_server, redis_client,
                                                                       tmp_path, monkeypatch):
    monkeypatch.setattr("reflow.scheduler.jobcontrol.service.QUEUE_RETRY_S", 0.05)
    backend = FullBackend()
    core = Scheduler(JobStore(redis.Redis.from_url(redis_server.url)), backend,
                     PathRoots(tmp_path, tmp_path))
    spec = '{"model": {"path": "m"}}'
    core.submit(spec, job_id="queued")
    job = _wait_for(lambda: (j := core.get("queued")).reason and j)
    assert job.phase == "PENDING" and "0 are free" in job.reason and job.started_at == 0
    stopped = core.stop("queued")
    assert stopped.phase == "STOPPED" and "waiting for workers" in stopped.reason

    core.submit(spec, job_id="lucky")
    _wait_for(lambda: core.get("lucky").reason)
    backend.free.set()
    # Placed once workers are free; nothing serves those addresses, so it then fails.
    job = _wait_for(lambda: (j := core.get("lucky")).terminal and j)
    assert backend.placed == ["lucky"] and job.phase == "FAILED" and job.started_at > 0


class OneSlotBackend(FullBackend):
    """Room for one job at a time; a release frees it."""

    def __init__(self):
        super().__init__()
        self.busy = threading.Lock()

    def place(self, job_id, run_dir, colocated=False):
        if not self.busy.acquire(blocking=False):
            raise NoCapacity("job needs 2 free workers and 0 are free")
        self.placed.append(job_id)
        return Placement(replay_address="127.0.0.1:1", rollout_addresses=["127.0.0.1:1"],
                         trainer_address="127.0.0.1:1")

    def release(self, placement):
        self.busy.release()

    def close(self):
        pass


def test_pending_jobs_are_placed_in_submission_order_and_a_handover_keeps_them_pending(
        redis_server, redis_client, tmp_path, monkeypatch):
    # Each waiting job would try again on its own timer; a second apart, submitted
    # half a second apart, whichever timer fired first after a release would win.
    monkeypatch.setattr("reflow.scheduler.jobcontrol.service.QUEUE_RETRY_S", 1.0)
    # Each job's end tells a buffer that is not there, which waits out EndJob's
    # deadline (5 s a job).
    monkeypatch.setattr("reflow.scheduler.jobcontrol.service.END_JOB_DEADLINE_S", 0.5)
    backend = OneSlotBackend()
    core = Scheduler(JobStore(redis.Redis.from_url(redis_server.url)), backend,
                     PathRoots(tmp_path, tmp_path))
    spec = '{"model": {"path": "m"}}'
    backend.busy.acquire()  # another job holds the workers for now
    order = [f"fifo-{i}" for i in range(4)]
    for job_id in order:
        core.submit(spec, job_id=job_id)
        time.sleep(0.5)
    assert core.queue.waiting() == order
    assert all(core.get(j).phase == "PENDING" for j in order)
    backend.release(None)
    # Each is placed, fails to start (nothing listens there) and releases the slot,
    # which goes to the oldest job still waiting, however the timers fall.
    _wait_for(lambda: all(core.get(j).terminal for j in order), 120)
    assert backend.placed == order
    assert core.queue.waiting() == []

    # A scheduler handing over leaves a waiting job PENDING for the next one.
    backend.busy.acquire()
    core.submit(spec, job_id="fifo-waiting")
    _wait_for(lambda: core.get("fifo-waiting").reason)
    core.shutdown(handover=True)
    job = core.get("fifo-waiting")
    assert job.phase == "PENDING" and job.finished_at == 0 and "0 are free" in job.reason
