"""The kubernetes backend and the scheduler's leader lease, through the
official client over HTTP to an emulated API server (see kube_emulator.py
for what the emulator does not check)."""

import datetime as dt

import kmock
import pytest
from kubernetes import client

from reflow.core.paths import PathRoots
from reflow import rpc
from reflow.core.errors import NoCapacity
from reflow.scheduler.kube import JOB_LABEL, ROLE_LABEL, KubernetesBackend, KubeSettings, parse_selector

from tests.integration.kube_emulator import kube_emulator, worker_pod

SELECTOR = "app.kubernetes.io/instance=rl,app.kubernetes.io/component=worker"


@pytest.fixture
def kube():
    with kube_emulator() as (api_client, emulator):
        yield api_client, emulator


@pytest.fixture
def worker_port():
    """One real gRPC health endpoint stands for every worker pod (all on 127.0.0.1)."""
    server, port = rpc.make_server("reflow.v1.Worker", lambda s: None, "127.0.0.1:0")
    yield port
    server.stop(0)


def _backend(api_client, port, **overrides):
    settings = KubeSettings(namespace="ml", worker_selector=SELECTOR, worker_port=port,
                            replay_address="rl-replay:50052", health_timeout_s=10, **overrides)
    return KubernetesBackend(settings, api_client)


def _labels(core, name):
    return core.read_namespaced_pod(name, "ml").metadata.labels


def test_a_job_takes_ready_free_workers_of_its_release_and_gives_them_back(kube, worker_port, tmp_path):
    api_client, _ = kube
    core = client.CoreV1Api(api_client)
    for pod in (worker_pod("rl-worker-0"), worker_pod("rl-worker-1"), worker_pod("rl-worker-2"),
                worker_pod("rl-worker-3", ready=False),
                worker_pod("other-worker-0", labels={"app.kubernetes.io/instance": "other",
                                                     "app.kubernetes.io/component": "worker"})):
        core.create_namespaced_pod("ml", pod)
    backend = _backend(api_client, worker_port)

    placement = backend.place("job-a", tmp_path)
    assert placement.workers == {"trainer": ["rl-worker-0"], "rollout": ["rl-worker-1", "rl-worker-2"]}
    assert placement.trainer_address == f"127.0.0.1:{worker_port}"
    assert placement.replay_address == "rl-replay:50052"
    assert _labels(core, "rl-worker-0")[ROLE_LABEL] == "trainer"
    assert _labels(core, "rl-worker-2")[JOB_LABEL] == "job-a"
    assert ROLE_LABEL not in _labels(core, "rl-worker-3")  # not ready: untouched
    assert ROLE_LABEL not in _labels(core, "other-worker-0")  # another release: untouched
    assert placement.exited() == []

    with pytest.raises(NoCapacity, match="worker.replicas"):
        backend.place("job-b", tmp_path)  # every ready worker is busy

    backend.release(placement)
    assert _labels(core, "rl-worker-0")[ROLE_LABEL] == "idle"
    assert JOB_LABEL not in _labels(core, "rl-worker-0")
    assert [p.metadata.name for p in backend.free_workers()] == ["rl-worker-0", "rl-worker-1", "rl-worker-2"]


def test_a_restarted_or_deleted_worker_fails_the_placement(kube, worker_port, tmp_path):
    api_client, _ = kube
    core = client.CoreV1Api(api_client)
    for i in range(3):
        core.create_namespaced_pod("ml", worker_pod(f"rl-worker-{i}"))
    backend = _backend(api_client, worker_port, max_rollout_workers=1)
    placement = backend.place("job", tmp_path)
    assert placement.workers == {"trainer": ["rl-worker-0"], "rollout": ["rl-worker-1"]}
    core.patch_namespaced_pod("rl-worker-1", "ml", {"status": {"containerStatuses": [
        {"name": "worker", "ready": True, "restartCount": 1, "image": "reflow", "imageID": "",
         "state": {}, "lastState": {"terminated": {"exitCode": 137}}}]}})
    assert placement.exited() == [("rl-worker-1", 137)]
    core.delete_namespaced_pod("rl-worker-0", "ml")
    assert ("rl-worker-0", -1) in placement.exited()


def test_job_logs_come_from_the_pods_of_each_role(kube, worker_port, tmp_path):
    api_client, emulator = kube
    emulator["get /api/v1/namespaces/ml/pods/rl-worker-0/log"] << kmock.Response(
        payload=b"step 1 reward 0.1\n", headers={"Content-Type": "text/plain"})
    backend = _backend(api_client, worker_port)
    logs = backend.read_logs(tmp_path, ["trainer", "rollout"], 4096,
                             {"trainer": ["rl-worker-0"], "rollout": ["rl-worker-9"]})
    assert logs[0].service == "trainer" and "step 1 reward 0.1" in logs[0].text
    assert "rl-worker-9" in logs[1].text and "unavailable" in logs[1].text


def test_selectors_are_parsed_strictly():
    assert parse_selector("a=b, c=d") == {"a": "b", "c": "d"}
    with pytest.raises(ValueError, match="worker_selector"):
        parse_selector("a!=b")


def test_one_scheduler_holds_the_lease_until_it_expires(kube):
    api_client, _ = kube
    backend = _backend(api_client, 1)
    first = backend.leader_lease("rl-scheduler", "scheduler-a")
    second = backend.leader_lease("rl-scheduler", "scheduler-b")
    assert first.try_acquire() and first.try_acquire()  # a renewal
    assert not second.try_acquire()
    coordination = client.CoordinationV1Api(api_client)
    past = (dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=60)).isoformat()
    coordination.patch_namespaced_lease("rl-scheduler", "ml", {"spec": {"renewTime": past}})
    assert second.try_acquire()  # first stopped renewing: expired
    lease = coordination.read_namespaced_lease("rl-scheduler", "ml")
    assert lease.spec.holder_identity == "scheduler-b" and lease.spec.lease_transitions == 1
    assert not first.try_acquire()


def test_a_restarted_scheduler_takes_back_the_workers_of_jobs_it_failed(kube, worker_port, tmp_path,
                                                                          redis_server, redis_client):
    import redis

    from reflow.scheduler.jobs import JobRecord, JobStore
    from reflow.scheduler.service import Scheduler

    api_client, _ = kube
    core = client.CoreV1Api(api_client)
    busy = {"app.kubernetes.io/instance": "rl", "app.kubernetes.io/component": "worker",
            ROLE_LABEL: "trainer", JOB_LABEL: "was-running"}
    core.create_namespaced_pod("ml", worker_pod("rl-worker-0", labels=busy))
    core.create_namespaced_pod("ml", worker_pod("rl-worker-1", labels={**busy, ROLE_LABEL: "rollout"}))
    store = JobStore(redis.Redis.from_url(redis_server.url))
    store.create(JobRecord(job_id="was-running", name="a", spec_json="{}", phase="RUNNING",
                           workers={"trainer": ["rl-worker-0"], "rollout": ["rl-worker-1"]}))
    backend = _backend(api_client, worker_port)
    assert backend.free_workers() == []

    Scheduler(store, backend, PathRoots(tmp_path, tmp_path)).recover()
    assert store.get("was-running").phase == "FAILED"
    assert [p.metadata.name for p in backend.free_workers()] == ["rl-worker-0", "rl-worker-1"]
    assert _labels(core, "rl-worker-1")[ROLE_LABEL] == "idle"
