"""Role flips of a job's worker pods (the elastic pool), through the official
client over HTTP to the strict API test server (kube_apiserver.py: resourceVersion
preconditions, 409 Conflict, watches with history; not a cluster): both
directions, conflicts from injected faults and from real concurrent writers, a
scheduler killed between the two patches of a flip and rolled back by the next
one, and flips refused for pods that are not the job's. Every pod IP has its own
idle worker (rollout + trainer services) on loopback, so addresses tell pods apart.
"""

import pytest
from kubernetes import client, watch

from reflow import procs, rpc
from reflow.rollout import server as rollout_server
from reflow.rollout.service import RolloutService
from reflow.scheduler.cluster.kube import (JOB_LABEL, ROLE_LABEL, ROLE_TARGET, ROLES, KubernetesBackend,
                                   KubeSettings, PodNotInJob)
from reflow.trainer import server as trainer_server
from reflow.trainer.service import TrainerService

from tests.integration.kube_apiserver import KubeApiServer, namespace, worker_pod

SELECTOR = "app.kubernetes.io/instance=rl,app.kubernetes.io/component=worker"
NUM_PODS = 6


def _ip(i: int) -> str:
    return f"127.0.0.{21 + i}"


class _SchedulerKilled(BaseException):
    """The scheduler process dies here: no `except Exception` clean-up runs, as under SIGKILL."""


@pytest.fixture
def api():
    with KubeApiServer() as server:
        server.create(namespace("ml"))
        yield server


@pytest.fixture
def worker_port():
    """One idle worker per pod IP, all on one port (as the StatefulSet's pods are)."""
    port, servers = procs.free_port(), []
    try:
        for i in range(NUM_PODS):
            register_rollout = rollout_server.register(RolloutService())
            register_trainer = trainer_server.register(TrainerService())
            servers.append(rpc.make_server(
                (rollout_server.SERVICE_NAME, trainer_server.SERVICE_NAME),
                lambda s, a=register_rollout, b=register_trainer: (a(s), b(s)),
                f"{_ip(i)}:{port}")[0])
        yield port
    finally:
        for server in servers:
            server.stop(0)


@pytest.fixture
def backend(api, worker_port):
    """`backend(**settings)`: a scheduler's backend on this API server, closed at the end."""
    made = []

    def make(**overrides):
        settings = KubeSettings(namespace="ml", worker_selector=SELECTOR, worker_port=worker_port,
                                replay_address="rl-replay:50052", health_timeout_s=10,
                                request_timeout_s=2, resync_s=2, **overrides)
        made.append(KubernetesBackend(settings, api.client()))
        return made[-1]

    yield make
    for each in made:
        each.close()


def _pods(api, num=3):
    for i in range(num):
        api.create(worker_pod(f"rl-worker-{i}", ip=_ip(i)))


def _meta(api, name):
    return api.get("pods", "ml", name)["metadata"]


def _address(port, i):
    return f"{_ip(i)}:{port}"


def _versions_since(api, version):
    """Every pod version written after `version`, replayed over HTTP by a watch
    from that resourceVersion (the server keeps its event history)."""
    end = api.resource_version
    if end == version:
        return []
    core, out, stream = client.CoreV1Api(api.client()), [], watch.Watch()
    for event in stream.stream(core.list_namespaced_pod, "ml", resource_version=version,
                               timeout_seconds=5):
        out.append(event["object"])
        if event["object"].metadata.resource_version == end:
            stream.stop()
    assert out and out[-1].metadata.resource_version == end, "history not replayed in full"
    return out


def _assert_always_a_role(versions):
    """Every version has a role label; a trainer or rollout one while it carries a job."""
    assert versions
    for pod in versions:
        labels = pod.metadata.labels or {}
        allowed = ROLES if labels.get(JOB_LABEL) else ("idle",)
        assert labels.get(ROLE_LABEL) in allowed, (
            f"pod {pod.metadata.name} at version {pod.metadata.resource_version} has role "
            f"{labels.get(ROLE_LABEL)!r}")


def _history(versions, name):
    """(role, pending target) of each version of pod `name`."""
    return [(p.metadata.labels.get(ROLE_LABEL), (p.metadata.annotations or {}).get(ROLE_TARGET))
            for p in versions if p.metadata.name == name]


def _killed_before_the_label(scheduler):
    """Make `scheduler` die as it sends its next role label: a flip's second patch."""
    patch = scheduler.core.patch_namespaced_pod

    def die_before_the_label(name, namespace, body, **kwargs):
        if ROLE_LABEL in body["metadata"].get("labels", {}):
            raise _SchedulerKilled(name)
        return patch(name, namespace, body, **kwargs)

    scheduler.core.patch_namespaced_pod = die_before_the_label
    return scheduler


def _pod_patches(api, name):
    return [r for r in api.requests if r[0] == "PATCH" and r[1].split("?")[0].endswith(f"/{name}")]


def test_a_pod_flips_between_rollout_and_trainer_and_the_placement_follows(
        api, backend, worker_port, tmp_path):
    _pods(api)
    scheduler = backend()
    placement = scheduler.place("job-a", tmp_path)
    assert placement.workers == {"trainer": ["rl-worker-0"],
                                 "rollout": ["rl-worker-1", "rl-worker-2"]}
    start = api.resource_version

    assert scheduler.flip_role(placement, "rl-worker-1", "trainer") == "rollout"
    assert placement.workers == {"trainer": ["rl-worker-0", "rl-worker-1"],
                                 "rollout": ["rl-worker-2"]}
    assert placement.trainer_address == _address(worker_port, 0)  # the first trainer stays
    assert placement.trainer_addresses == [_address(worker_port, 0), _address(worker_port, 1)]
    assert placement.rollout_addresses == [_address(worker_port, 2)]
    assert _meta(api, "rl-worker-1")["labels"][ROLE_LABEL] == "trainer"

    assert scheduler.flip_role(placement, "rl-worker-0", "rollout") == "trainer"
    assert placement.workers == {"trainer": ["rl-worker-1"],
                                 "rollout": ["rl-worker-0", "rl-worker-2"]}
    assert placement.trainer_address == _address(worker_port, 1)
    assert placement.rollout_addresses == [_address(worker_port, 0), _address(worker_port, 2)]
    for i in range(3):
        meta = _meta(api, f"rl-worker-{i}")
        assert meta["labels"][JOB_LABEL] == "job-a"
        assert ROLE_TARGET not in (meta.get("annotations") or {})

    # Back again: the trainer that kept training stays the job's first trainer address.
    assert scheduler.flip_role(placement, "rl-worker-0", "trainer") == "rollout"
    assert placement.trainer_address == _address(worker_port, 1)
    assert placement.trainer_addresses == [_address(worker_port, 0), _address(worker_port, 1)]

    # Two patches per flip, and a flip to the role a pod has writes nothing.
    versions = _versions_since(api, start)
    assert len(versions) == 6
    _assert_always_a_role(versions)
    assert _history(versions, "rl-worker-0") == [("trainer", "rollout"), ("rollout", None),
                                                 ("rollout", "trainer"), ("trainer", None)]
    assert scheduler.flip_role(placement, "rl-worker-2", "rollout") == "rollout"
    assert api.resource_version == versions[-1].metadata.resource_version

    scheduler.release(placement)
    assert all(_meta(api, f"rl-worker-{i}")["labels"][ROLE_LABEL] == "idle" for i in range(3))


def test_an_injected_conflict_during_a_flip_is_read_again_and_the_flip_lands(
        api, backend, tmp_path):
    _pods(api)
    scheduler = backend()
    placement = scheduler.place("job-a", tmp_path)
    start = api.resource_version
    api.clear_requests()
    api.fail("PATCH", path="/pods/rl-worker-2$", status=409, count=1)
    assert scheduler.flip_role(placement, "rl-worker-2", "trainer") == "rollout"
    assert placement.workers == {"trainer": ["rl-worker-0", "rl-worker-2"],
                                 "rollout": ["rl-worker-1"]}
    assert _meta(api, "rl-worker-2")["labels"][ROLE_LABEL] == "trainer"
    assert len(_pod_patches(api, "rl-worker-2")) == 3  # refused phase one, phase one, two
    _assert_always_a_role(_versions_since(api, start))

    # Conflicts without end: a bounded number of tries, then a clear error; the pod and
    # the placement keep the role they had.
    api.fail("PATCH", path="/pods/rl-worker-2$", status=409, count=1000)
    with pytest.raises(RuntimeError, match="could not flip it to rollout for job job-a "
                                           r"\(11 conflicts\)"):
        scheduler.flip_role(placement, "rl-worker-2", "rollout")
    api.fail("PATCH", path="/pods/rl-worker-2$", status=409, count=0)
    assert _meta(api, "rl-worker-2")["labels"][ROLE_LABEL] == "trainer"
    assert placement.workers["trainer"] == ["rl-worker-0", "rl-worker-2"]


def test_concurrent_writers_between_read_and_patch_cost_a_retry_not_the_flip(
        api, backend, tmp_path):
    """The kubelet writes the pod's status right after the flip reads it, and a user
    labels the pod right after phase one: both patches meet a stale resourceVersion
    (a real 409), are read again and land; the other writers' changes are kept."""
    _pods(api)
    scheduler = backend()
    placement = scheduler.place("job-a", tmp_path)
    start = api.resource_version
    core = client.CoreV1Api(api.client())
    read, patch = scheduler.core.read_namespaced_pod, scheduler.core.patch_namespaced_pod
    calls = {"read": 0, "patch": 0}

    def read_then_kubelet_writes(name, *args, **kwargs):
        pod = read(name, *args, **kwargs)
        calls["read"] += 1
        if calls["read"] == 1:
            api.update_status("ml", name, {"conditions": [{"type": "Ready", "status": "True",
                                                           "reason": "Probed"}]})
        return pod

    def patch_then_user_labels(name, *args, **kwargs):
        pod = patch(name, *args, **kwargs)
        calls["patch"] += 1
        if calls["patch"] == 1:
            core.patch_namespaced_pod(name, "ml", {"metadata": {"labels": {"team": "rl"}}})
        return pod

    scheduler.core.read_namespaced_pod = read_then_kubelet_writes
    scheduler.core.patch_namespaced_pod = patch_then_user_labels
    api.clear_requests()
    assert scheduler.flip_role(placement, "rl-worker-1", "trainer") == "rollout"
    assert placement.workers == {"trainer": ["rl-worker-0", "rl-worker-1"],
                                 "rollout": ["rl-worker-2"]}
    meta = _meta(api, "rl-worker-1")
    assert meta["labels"][ROLE_LABEL] == "trainer" and meta["labels"]["team"] == "rl"
    assert ROLE_TARGET not in (meta.get("annotations") or {})
    # refused phase one, phase one, the user's label, refused phase two, phase two
    assert len(_pod_patches(api, "rl-worker-1")) == 5
    assert calls["read"] == 3  # the first read and one after each conflict
    _assert_always_a_role(_versions_since(api, start))


def test_a_flip_cut_off_between_its_patches_is_rolled_back_and_no_pod_lacks_a_role(
        api, backend, tmp_path):
    _pods(api)
    placement = backend().place("job-a", tmp_path)
    start = api.resource_version
    with pytest.raises(_SchedulerKilled):
        _killed_before_the_label(backend()).flip_role(placement, "rl-worker-1", "trainer")
    meta = _meta(api, "rl-worker-1")
    assert meta["labels"][ROLE_LABEL] == "rollout" and meta["annotations"][ROLE_TARGET] == "trainer"
    assert placement.workers["trainer"] == ["rl-worker-0"]  # the flip never landed
    # Another job's pod with a flip of its own cut off: not this job's to roll back.
    api.create(worker_pod("rl-worker-3", ip=_ip(3), labels={
        **meta["labels"], JOB_LABEL: "job-b", ROLE_LABEL: "trainer"}))
    client.CoreV1Api(api.client()).patch_namespaced_pod(
        "rl-worker-3", "ml", {"metadata": {"annotations": {ROLE_TARGET: "rollout"}}})

    # The next scheduler rolls back what the dead one left for the job, through a conflict.
    successor = backend()
    api.fail("PATCH", path="/pods/rl-worker-1$", status=409, count=1)
    assert successor.recover_flips("job-a") == ["rl-worker-1"]
    meta = _meta(api, "rl-worker-1")
    assert meta["labels"][ROLE_LABEL] == "rollout" and ROLE_TARGET not in (meta.get("annotations") or {})
    assert _meta(api, "rl-worker-3")["annotations"][ROLE_TARGET] == "rollout"
    assert successor.recover_flips("job-a") == []
    assert successor.recover_flips() == ["rl-worker-3"]
    assert _meta(api, "rl-worker-3")["labels"][ROLE_LABEL] == "trainer"

    # The placement is as it was, and the same flip then lands.
    assert successor.flip_role(placement, "rl-worker-1", "trainer") == "rollout"
    assert placement.workers == {"trainer": ["rl-worker-0", "rl-worker-1"],
                                 "rollout": ["rl-worker-2"]}

    # A flip cut off on a pod that is then released leaves no target behind either.
    with pytest.raises(_SchedulerKilled):
        _killed_before_the_label(backend()).flip_role(placement, "rl-worker-0", "rollout")
    assert _meta(api, "rl-worker-0")["annotations"][ROLE_TARGET] == "rollout"
    successor.release(placement)
    meta = _meta(api, "rl-worker-0")
    assert meta["labels"][ROLE_LABEL] == "idle" and ROLE_TARGET not in (meta.get("annotations") or {})
    versions = _versions_since(api, start)
    _assert_always_a_role(versions)
    assert _history(versions, "rl-worker-1") == [
        ("rollout", "trainer"), ("rollout", None),  # cut off, rolled back
        ("rollout", "trainer"), ("trainer", None),  # done again
        ("idle", None)]
    assert _history(versions, "rl-worker-0") == [("trainer", "rollout"), ("idle", None)]


def test_a_flip_of_a_pod_that_is_not_the_jobs_is_refused(api, backend, tmp_path):
    _pods(api, NUM_PODS)
    scheduler = backend(max_rollout_workers=2)
    job_a, job_b = scheduler.place("job-a", tmp_path), scheduler.place("job-b", tmp_path)
    assert job_b.workers == {"trainer": ["rl-worker-3"], "rollout": ["rl-worker-4", "rl-worker-5"]}
    api.clear_requests()

    # Another job's pod, by name, and requests a job cannot keep: refused before any API call.
    with pytest.raises(PodNotInJob, match="rl-worker-3 is not one of job job-a's pods"):
        scheduler.flip_role(job_a, "rl-worker-3", "rollout")
    with pytest.raises(ValueError, match="role must be one of"):
        scheduler.flip_role(job_a, "rl-worker-1", "idle")
    with pytest.raises(ValueError, match="rl-worker-0 is job job-a's last trainer worker"):
        scheduler.flip_role(job_a, "rl-worker-0", "rollout")
    assert api.requests == []

    # A pod another job took since the claim: refused, and nothing is written to it.
    core = client.CoreV1Api(api.client())
    core.patch_namespaced_pod("rl-worker-1", "ml", {"metadata": {"labels": {JOB_LABEL: "job-z"}}})
    version = _meta(api, "rl-worker-1")["resourceVersion"]
    with pytest.raises(PodNotInJob,
                       match="rl-worker-1 is no longer job job-a's: it carries job job-z"):
        scheduler.flip_role(job_a, "rl-worker-1", "trainer")
    assert _meta(api, "rl-worker-1")["resourceVersion"] == version
    assert job_a.workers == {"trainer": ["rl-worker-0"], "rollout": ["rl-worker-1", "rl-worker-2"]}

    # The StatefulSet replaced a pod under the same name: a new pod, not the job's.
    labels = _meta(api, "rl-worker-2")["labels"]
    api.delete("pods", "ml", "rl-worker-2")
    api.create(worker_pod("rl-worker-2", ip=_ip(2), labels=labels))
    with pytest.raises(PodNotInJob, match="rl-worker-2 is no longer job job-a's: .*new UID"):
        scheduler.flip_role(job_a, "rl-worker-2", "trainer")
    assert _meta(api, "rl-worker-2")["labels"] == labels

    # Taken by another job between the flip's read and its patch: the 409 read finds it.
    read = scheduler.core.read_namespaced_pod

    def read_then_taken(name, *args, **kwargs):
        pod = read(name, *args, **kwargs)
        scheduler.core.read_namespaced_pod = read
        core.patch_namespaced_pod(name, "ml", {"metadata": {"labels": {JOB_LABEL: "job-z"}}})
        return pod

    scheduler.core.read_namespaced_pod = read_then_taken
    with pytest.raises(PodNotInJob, match="rl-worker-5 is no longer job job-b's: it carries job "
                                          "job-z"):
        scheduler.flip_role(job_b, "rl-worker-5", "trainer")
    meta = _meta(api, "rl-worker-5")
    assert meta["labels"][ROLE_LABEL] == "rollout" and ROLE_TARGET not in (meta.get("annotations") or {})
    assert job_b.workers["rollout"] == ["rl-worker-4", "rl-worker-5"]


def test_a_lost_pod_of_an_elastic_job_leaves_its_placement_and_is_idle_again(
        api, backend, worker_port, tmp_path):
    """The job goes on without it (scheduler/placement/elastic.py worker_lost): the pod is no
    longer the job's, watched for loss or released with it, and a pod that kept its
    labels (its container restarted) is free for the next job."""
    _pods(api)
    scheduler = backend()
    placement = scheduler.place("job-a", tmp_path)
    scheduler.retire(placement, "rl-worker-2")
    assert placement.workers == {"trainer": ["rl-worker-0"], "rollout": ["rl-worker-1"]}
    assert "rl-worker-2" not in placement.pods
    labels = _meta(api, "rl-worker-2")["labels"]
    assert labels[ROLE_LABEL] == "idle" and JOB_LABEL not in labels
    assert _meta(api, "rl-worker-1")["labels"][JOB_LABEL] == "job-a"
    scheduler.retire(placement, "rl-worker-2")  # reported twice: nothing more happens
    scheduler.release(placement)
    assert all(_meta(api, f"rl-worker-{i}")["labels"][ROLE_LABEL] == "idle" for i in range(3))
