"""The kubernetes backend and the scheduler's leader lease, through the
official client over HTTP to the strict API test server (kube_apiserver.py:
preconditions, selectors, watches and leases as the API conventions have them;
not a cluster). Every pod here points at one real, idle worker: the rollout and
trainer services on one gRPC server, as `reflow serve worker` hosts them. Jobs
that really run are in test_kube_cluster.py."""

import time

import pytest
from kubernetes import client

from reflow import rpc
from reflow.core.errors import NoCapacity
from reflow.core.paths import PathRoots
from reflow.rollout import server as rollout_server
from reflow.rollout.service import RolloutService
from reflow.scheduler.cluster.kube import JOB_LABEL, ROLE_LABEL, KubernetesBackend, KubeSettings, parse_selector
from reflow.scheduler.cluster.leader import LeaderLease
from reflow.trainer import server as trainer_server
from reflow.trainer.service import TrainerService

from tests.integration.kube_apiserver import KubeApiServer, namespace, worker_pod

SELECTOR = "app.kubernetes.io/instance=rl,app.kubernetes.io/component=worker"


@pytest.fixture
def kube():
    with KubeApiServer() as api:
        api.create(namespace("ml"))
        yield api.client(), api


def _idle_worker(address: str):
    """An idle worker (rollout + trainer services, as `reflow serve worker` hosts
    them) at `address`: its server and port."""
    register_rollout = rollout_server.register(RolloutService())
    register_trainer = trainer_server.register(TrainerService())
    return rpc.make_server((rollout_server.SERVICE_NAME, trainer_server.SERVICE_NAME),
                           lambda s: (register_rollout(s), register_trainer(s)), address)


@pytest.fixture
def worker_port():
    """An idle worker on 127.0.0.1, behind every pod."""
    server, port = _idle_worker("127.0.0.1:0")
    yield port
    server.stop(0)


def _backend(api_client, port, **overrides):
    settings = KubeSettings(namespace="ml", worker_selector=SELECTOR, worker_port=port,
                            replay_address="rl-replay:50052", health_timeout_s=10,
                            request_timeout_s=2, resync_s=2, **overrides)
    return KubernetesBackend(settings, api_client)


def _until(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)
    return value


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
    _until(backend.pod_watch.synced.is_set)
    assert placement.exited() == []
    # The kubelet reports a restart through /status; the watch brings it.
    core.patch_namespaced_pod_status("rl-worker-1", "ml", {"status": {"containerStatuses": [
        {"name": "worker", "ready": True, "restartCount": 1, "image": "reflow", "imageID": "",
         "state": {}, "lastState": {"terminated": {"exitCode": 137}}}]}})
    assert _until(placement.exited) == [("rl-worker-1", 137, "restarted")]
    core.delete_namespaced_pod("rl-worker-0", "ml")
    assert ("rl-worker-0", -1, "was deleted") in _until(lambda: len(placement.exited()) == 2
                                                        and placement.exited())
    backend.close()


def test_job_logs_come_from_the_pods_of_each_role(kube, worker_port, tmp_path):
    api_client, api = kube
    api.create(worker_pod("rl-worker-0"))
    api.set_log("ml", "rl-worker-0", "step 1 reward 0.1\n")
    backend = _backend(api_client, worker_port)
    logs = backend.read_logs(tmp_path, ["trainer", "rollout"], 4096,
                             {"trainer": ["rl-worker-0"], "rollout": ["rl-worker-9"]})
    assert logs[0].service == "trainer" and "step 1 reward 0.1" in logs[0].text
    assert "rl-worker-9" in logs[1].text and "unavailable" in logs[1].text


def test_selectors_are_parsed_strictly():
    assert parse_selector("a=b, c=d") == {"a": "b", "c": "d"}
    with pytest.raises(ValueError, match="worker_selector"):
        parse_selector("a!=b")


def _lease(api_client, identity, **timing):
    timing = {"duration_s": 3.0, "renew_deadline_s": 2.0, "retry_s": 0.5, **timing}
    return LeaderLease(client.CoordinationV1Api(api_client), "ml", "rl-scheduler", identity,
                       **timing)


def test_one_scheduler_holds_the_lease_until_it_stops_renewing(kube):
    api_client, _ = kube
    first, second = _lease(api_client, "scheduler-a"), _lease(api_client, "scheduler-b")
    assert first.try_acquire() and first.try_acquire()  # a renewal
    assert first.held()
    assert not second.try_acquire()
    # A renewTime far in the past, as a holder with a skewed clock would write it,
    # does not make the lease look expired: expiry runs on the observer's clock.
    coordination = client.CoordinationV1Api(api_client)
    coordination.patch_namespaced_lease("rl-scheduler", "ml",
                                        {"spec": {"renewTime": "2001-01-01T00:00:00.000000Z"}})
    assert not second.try_acquire()  # a change was just observed
    time.sleep(2.2)
    assert not first.held()  # no renewal within the renew deadline: it stops acting
    time.sleep(1.2)  # a whole lease duration without change, seen from the candidate
    assert second.try_acquire()
    lease = coordination.read_namespaced_lease("rl-scheduler", "ml")
    assert lease.spec.holder_identity == "scheduler-b" and lease.spec.lease_transitions == 1
    assert not first.try_acquire()


def test_a_leader_that_cannot_renew_stops_acting_before_anyone_can_take_over(kube):
    api_client, api = kube
    leader, candidate = _lease(api_client, "scheduler-a"), _lease(api_client, "scheduler-b")
    assert leader.try_acquire()
    lost = []
    leader.keep(on_lost=lambda: lost.append(time.monotonic()))
    assert not candidate.try_acquire()
    started = time.monotonic()
    api.fail(path="/leases/", status=500, count=1000)  # the API refuses every lease call
    _until(lambda: lost, 5)
    assert not leader.held()
    lost_after = lost[0] - started
    assert lost_after < leader.duration_s  # it gave up within its renew deadline
    api.fail(path="/leases/", status=500, count=0)
    while not candidate.try_acquire():
        time.sleep(0.1)
    assert time.monotonic() - started >= candidate.duration_s  # never while the old one acted


def test_a_conflict_on_a_claim_is_retried_and_two_placements_never_share_a_pod(kube, worker_port,
                                                                              tmp_path):
    api_client, api = kube
    for i in range(4):
        api.create(worker_pod(f"rl-worker-{i}"))
    backend = _backend(api_client, worker_port, max_rollout_workers=1)
    api.fail("PATCH", path="/pods/", status=409, count=1)
    first = backend.place("job-a", tmp_path)
    # Another scheduler's view: a stale list whose claim must lose.
    other = _backend(api_client, worker_port, max_rollout_workers=1)
    second = other.place("job-b", tmp_path)
    assert not set(first.pods) & set(second.pods)
    labels = {n: api.get("pods", "ml", n)["metadata"]["labels"].get(JOB_LABEL)
              for n in (f"rl-worker-{i}" for i in range(4))}
    assert sorted(labels.values()) == ["job-a", "job-a", "job-b", "job-b"]
    # A release only takes back pods that still carry its job.
    client.CoreV1Api(api_client).patch_namespaced_pod(
        "rl-worker-0", "ml", {"metadata": {"labels": {JOB_LABEL: "job-z"}}})
    backend.release(first)
    assert api.get("pods", "ml", "rl-worker-0")["metadata"]["labels"][JOB_LABEL] == "job-z"
    assert JOB_LABEL not in api.get("pods", "ml", "rl-worker-1")["metadata"]["labels"]
    backend.close()
    other.close()


def test_transient_api_errors_are_retried_and_counted(kube, worker_port, tmp_path):
    api_client, api = kube
    for i in range(2):
        api.create(worker_pod(f"rl-worker-{i}"))
    backend = _backend(api_client, worker_port)
    api.fail("GET", path="/pods", status=500, count=2)
    api.fail("PATCH", path="/pods/", status=503, count=1)
    placement = backend.place("job", tmp_path)
    assert placement.workers == {"trainer": ["rl-worker-0"], "rollout": ["rl-worker-1"]}
    assert backend.api_errors.get("http_500", 0) >= 2 and backend.api_errors["http_503"] == 1
    backend.close()


def test_a_restarted_scheduler_takes_back_the_workers_of_jobs_it_failed(kube, worker_port, tmp_path,
                                                                          redis_server, redis_client):
    import redis

    from reflow.scheduler.jobcontrol.jobs import JobRecord, JobStore
    from reflow.scheduler.jobcontrol.service import Scheduler

    api_client, api = kube
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

    # The first reclaim patch hits a conflict (a kubelet status write, say): re-read, redo.
    api.fail("PATCH", path="/pods/rl-worker-0", status=409, count=1)
    Scheduler(store, backend, PathRoots(tmp_path, tmp_path)).recover()
    assert store.get("was-running").phase == "FAILED"
    assert [p.metadata.name for p in backend.free_workers()] == ["rl-worker-0", "rl-worker-1"]
    assert _labels(core, "rl-worker-1")[ROLE_LABEL] == "idle"


def test_pods_left_labelled_by_a_claim_cut_short_go_to_that_jobs_next_try(kube, worker_port,
                                                                          tmp_path):
    api_client, api = kube
    leftover = {"app.kubernetes.io/instance": "rl", "app.kubernetes.io/component": "worker",
                ROLE_LABEL: "trainer", JOB_LABEL: "job-x"}
    api.create(worker_pod("rl-worker-0", labels=leftover))
    api.create(worker_pod("rl-worker-1"))
    api.create(worker_pod("rl-worker-2", labels={**leftover, JOB_LABEL: "job-y"}))
    backend = _backend(api_client, worker_port)
    assert [p.metadata.name for p in backend.free_workers()] == ["rl-worker-1"]
    placement = backend.place("job-x", tmp_path)
    assert placement.workers == {"trainer": ["rl-worker-0"], "rollout": ["rl-worker-1"]}
    # Another job's pod is never taken.
    assert api.get("pods", "ml", "rl-worker-2")["metadata"]["labels"][JOB_LABEL] == "job-y"
    backend.close()


@pytest.fixture
def any_loopback_port(monkeypatch):
    """An idle worker answering on every loopback address (and to those names, as
    a pod's worker to its DNS name), so that pods at 127.0.0.1x are distinct
    workers for the backend."""
    monkeypatch.setenv("REFLOW_ADVERTISE_HOSTS", ",".join(f"127.0.0.1{i}" for i in range(4)))
    server, port = _idle_worker("0.0.0.0:0")  # nosec B104 # a test's loopback worker
    yield port
    server.stop(0)


def test_a_range_job_claims_its_minimum_grows_and_gives_back_in_engine_order(
        kube, any_loopback_port, tmp_path):
    from reflow.scheduler.cluster.kube_pods import ROLLOUT_INDEX

    api_client, api = kube
    for i in range(4):
        api.create(worker_pod(f"rl-worker-{i}", ip=f"127.0.0.1{i}"))
    core = client.CoreV1Api(api_client)
    backend = _backend(api_client, any_loopback_port)
    index = lambda name: (core.read_namespaced_pod(name, "ml").metadata.annotations  # noqa: E731
                          or {}).get(ROLLOUT_INDEX)
    # Another job holds rl-worker-2 (a stale claim or a later scheduler's): the range
    # job takes what is free, up to its maximum, and records each engine's index.
    other = backend.place("other", tmp_path, rollout_range=(1, 1))
    assert other.workers == {"trainer": ["rl-worker-0"], "rollout": ["rl-worker-1"]}
    placement = backend.place("job-a", tmp_path, rollout_range=(1, 3))
    assert placement.workers == {"trainer": ["rl-worker-2"], "rollout": ["rl-worker-3"]}
    assert (index("rl-worker-2"), index("rl-worker-3")) == (None, "0")
    with pytest.raises(NoCapacity):
        backend.place("job-b", tmp_path, rollout_range=(1, 1))
    assert backend.claim_rollout(placement) is None  # nothing free to grow into

    # The other job ends: job-a grows into its pods, each after the last engine.
    backend.release(other)
    grown = [backend.claim_rollout(placement), backend.claim_rollout(placement)]
    assert grown == ["127.0.0.10:%d" % any_loopback_port, "127.0.0.11:%d" % any_loopback_port]
    assert placement.rollout_addresses == ["127.0.0.13:%d" % any_loopback_port, *grown]
    assert (index("rl-worker-0"), index("rl-worker-1")) == ("1", "2")
    assert _labels(core, "rl-worker-0")[JOB_LABEL] == "job-a"

    # It gives the last engine back: the pod is idle again, its index gone, and the
    # next job can have it.
    detached = backend.detach_rollout(placement, grown[1])
    assert "rl-worker-1" not in placement.pods and grown[1] not in placement.rollout_addresses
    backend.release_detached(placement, detached)
    assert _labels(core, "rl-worker-1")[ROLE_LABEL] == "idle"
    assert JOB_LABEL not in _labels(core, "rl-worker-1") and index("rl-worker-1") is None
    assert [p.metadata.name for p in backend.free_workers()] == ["rl-worker-1"]
    backend.release(placement)
    backend.close()
