"""The strict Kubernetes API test server, through the official client: each test
pins one API convention (resourceVersion, preconditions, selectors, patch
formats, subresources, watches) or one fault the server injects."""

import datetime
import threading
import time

import pytest
import urllib3
from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

from tests.integration.kube_apiserver import KubeApiServer, namespace, worker_pod

NS = "ml"
MERGE = "application/merge-patch+json"


@pytest.fixture
def api():
    with KubeApiServer() as server:
        server.create(namespace(NS))
        yield server


@pytest.fixture
def core(api):
    api_client = api.client()
    yield client.CoreV1Api(api_client)
    api_client.close()


@pytest.fixture
def leases(api):
    api_client = api.client()
    yield client.CoordinationV1Api(api_client)
    api_client.close()


def _pod(name, **labels):
    return {"metadata": {"name": name, "labels": labels},
            "spec": {"containers": [{"name": "main", "image": "busybox"}]}}


def _lease(name, holder="a"):
    return {"metadata": {"name": name}, "spec": {
        "holderIdentity": holder, "leaseDurationSeconds": 15,
        "renewTime": "2025-01-01T00:00:00.250000Z"}}


def _status(err: ApiException) -> tuple[int, str]:
    import json

    return err.status, json.loads(err.body)["reason"]


def test_create_assigns_identity_and_a_second_create_is_already_exists(core):
    pod = core.create_namespaced_pod(NS, _pod("a"))
    assert pod.metadata.uid and pod.metadata.resource_version.isdigit()
    assert pod.metadata.namespace == NS and pod.metadata.creation_timestamp is not None
    with pytest.raises(ApiException) as err:
        core.create_namespaced_pod(NS, _pod("a"))
    assert _status(err.value) == (409, "AlreadyExists")
    with pytest.raises(ApiException) as err:  # as etcd refuses it
        core.create_namespaced_pod(NS, {**_pod("b"), "metadata": {"name": "b",
                                                                 "resourceVersion": "7"}})
    assert err.value.status == 500
    generated = core.create_namespaced_pod(NS, {**_pod(""), "metadata": {"generateName": "w-"}})
    assert generated.metadata.name.startswith("w-") and len(generated.metadata.name) == 7
    with pytest.raises(ApiException) as err:
        core.read_namespaced_pod("missing", NS)
    assert _status(err.value) == (404, "NotFound")


def test_a_create_in_a_namespace_that_does_not_exist_is_not_found(api, core, leases):
    import json

    version = api.resource_version
    with pytest.raises(ApiException) as err:
        core.create_namespaced_pod("nowhere", _pod("a"))
    # The Status a kube-apiserver's NamespaceLifecycle admission answers.
    assert err.value.status == 404 and json.loads(err.value.body) == {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": 'namespaces "nowhere" not found', "reason": "NotFound",
        "details": {"name": "nowhere", "kind": "namespaces"}, "code": 404}
    with pytest.raises(ApiException) as err:  # a PUT that would create a lease
        leases.replace_namespaced_lease("l", "nowhere", _lease("l"))
    assert _status(err.value) == (404, "NotFound") and '"nowhere"' in err.value.body
    with pytest.raises(Exception, match='namespaces "nowhere" not found'):
        api.create(worker_pod("w", namespace="nowhere"))  # as a controller would write it
    assert api.resource_version == version  # nothing was written
    assert core.list_namespaced_pod("nowhere").items == []  # lists answer empty, as a cluster's


def test_namespaces_are_served_cluster_scoped_and_a_deleted_one_takes_its_objects(api, core):
    names = [ns.metadata.name for ns in core.list_namespace().items]
    assert names == ["default", "kube-node-lease", "kube-public", "kube-system", NS]
    created = core.create_namespace({"metadata": {"name": "team-a"}})
    assert created.status.phase == "Active" and created.metadata.uid
    assert created.metadata.labels == {"kubernetes.io/metadata.name": "team-a"}
    assert core.read_namespace("team-a").metadata.uid == created.metadata.uid
    with pytest.raises(ApiException) as err:
        core.create_namespace({"metadata": {"name": "team-a"}})
    assert _status(err.value) == (409, "AlreadyExists")
    core.create_namespaced_pod("team-a", _pod("a"))
    assert core.delete_namespace("team-a")
    with pytest.raises(ApiException) as err:
        core.read_namespace("team-a")
    assert _status(err.value) == (404, "NotFound")
    assert core.list_namespaced_pod("team-a").items == []
    with pytest.raises(ApiException) as err:
        core.create_namespaced_pod("team-a", _pod("b"))
    assert _status(err.value) == (404, "NotFound")
    resources = {r.name: r.namespaced for r in client.CoreV1Api(api.client()).get_api_resources()
                 .resources}
    assert resources["namespaces"] is False and resources["pods"] is True


def test_resource_versions_increase_across_all_objects_and_no_op_writes_keep_them(api, core,
                                                                                 leases):
    versions = [int(core.create_namespaced_pod(NS, _pod("a")).metadata.resource_version),
                int(leases.create_namespaced_lease(NS, _lease("l")).metadata.resource_version),
                int(core.patch_namespaced_pod("a", NS, {"metadata": {"labels": {"x": "1"}}})
                    .metadata.resource_version)]
    assert versions == sorted(set(versions))
    again = core.patch_namespaced_pod("a", NS, {"metadata": {"labels": {"x": "1"}}})
    assert int(again.metadata.resource_version) == versions[-1]  # nothing changed
    assert api.resource_version == str(versions[-1])
    assert int(core.list_namespaced_pod(NS).metadata.resource_version) == versions[-1]


def test_a_patch_with_a_stale_resource_version_conflicts_and_changes_nothing(core):
    created = core.create_namespaced_pod(NS, _pod("a", role="idle"))
    stale = created.metadata.resource_version
    fresh = core.patch_namespaced_pod("a", NS, {"metadata": {"labels": {"role": "trainer"},
                                                             "resourceVersion": stale}})
    assert fresh.metadata.labels["role"] == "trainer"
    for content_type in (None, MERGE):
        kwargs = {"_content_type": content_type} if content_type else {}
        with pytest.raises(ApiException) as err:
            core.patch_namespaced_pod("a", NS, {"metadata": {"labels": {"role": "rollout"},
                                                             "resourceVersion": stale}}, **kwargs)
        assert _status(err.value) == (409, "Conflict")
        assert "the object has been modified" in err.value.body
    after = core.read_namespaced_pod("a", NS)
    assert after.metadata.labels["role"] == "trainer"
    assert after.metadata.resource_version == fresh.metadata.resource_version


def test_of_concurrent_claims_carrying_one_version_exactly_one_wins(api, core):
    version = core.create_namespaced_pod(NS, _pod("a")).metadata.resource_version
    outcomes = []

    def claim(job):
        api_client = api.client()
        try:
            client.CoreV1Api(api_client).patch_namespaced_pod("a", NS, {"metadata": {
                "labels": {"job": job}, "resourceVersion": version}})
            outcomes.append(("won", job))
        except ApiException as err:
            outcomes.append((err.status, job))
        finally:
            api_client.close()

    threads = [threading.Thread(target=claim, args=(f"j{i}",)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    winners = [job for outcome, job in outcomes if outcome == "won"]
    assert len(winners) == 1 and sorted(o for o, _ in outcomes if o != "won") == [409] * 7
    assert core.read_namespaced_pod("a", NS).metadata.labels == {"job": winners[0]}


def test_a_replace_with_a_stale_resource_version_conflicts(core):
    pod = core.create_namespaced_pod(NS, _pod("a"))
    pod.metadata.labels = {"v": "1"}
    core.replace_namespaced_pod("a", NS, pod)  # carries the current version: accepted
    pod.metadata.labels = {"v": "2"}
    with pytest.raises(ApiException) as err:
        core.replace_namespaced_pod("a", NS, pod)  # the version it carries is now stale
    assert _status(err.value) == (409, "Conflict")
    assert core.read_namespaced_pod("a", NS).metadata.labels == {"v": "1"}
    pod.metadata.name = "b"
    with pytest.raises(ApiException) as err:
        core.replace_namespaced_pod("a", NS, pod)
    assert _status(err.value) == (400, "BadRequest")


@pytest.mark.parametrize(("selector", "names"), [
    ("app=rl", ["a", "b", "c"]),
    ("app==rl,role=trainer", ["a"]),
    ("role!=trainer", ["b", "c", "d"]),  # d has no role: != matches it
    ("role in (trainer, rollout)", ["a", "b"]),
    ("role notin (trainer)", ["b", "c", "d"]),
    ("role", ["a", "b", "c"]),
    ("!role", ["d"]),
    ("app=rl,!job", ["a", "b"]),
    ("gpu>1", ["b"]),
    ("", ["a", "b", "c", "d"]),
])
def test_label_selector_operators(core, selector, names):
    for name, labels in (("a", {"app": "rl", "role": "trainer", "gpu": "1"}),
                         ("b", {"app": "rl", "role": "rollout", "gpu": "2"}),
                         ("c", {"app": "rl", "role": "idle", "job": "j"}), ("d", {"app": "x"})):
        core.create_namespaced_pod(NS, _pod(name, **labels))
    listed = core.list_namespaced_pod(NS, label_selector=selector).items
    assert [p.metadata.name for p in listed] == names


@pytest.mark.parametrize("selector", ["app=", "a=b,", ",a", "a b", "a in (x", "a in x",
                                      "a=b=c", "!", "a/b/c=d", "a=" + "v" * 64, "a>x", "=b"])
def test_a_malformed_label_selector_is_bad_request(core, selector):
    core.create_namespaced_pod(NS, _pod("a", app="rl"))
    if selector == "app=":  # an empty value is a valid selector (matches an empty label)
        assert core.list_namespaced_pod(NS, label_selector=selector).items == []
        return
    with pytest.raises(ApiException) as err:
        core.list_namespaced_pod(NS, label_selector=selector)
    assert _status(err.value) == (400, "BadRequest")


def test_field_selector_on_name_and_phase(api, core):
    api.create(worker_pod("w-0"))
    api.create(worker_pod("w-1"))
    assert [p.metadata.name for p in core.list_namespaced_pod(
        NS, field_selector="metadata.name=w-1").items] == ["w-1"]
    assert len(core.list_namespaced_pod(NS, field_selector="status.phase!=Running").items) == 0
    with pytest.raises(ApiException) as err:
        core.list_namespaced_pod(NS, field_selector="spec.unknown=x")
    assert err.value.status == 400


def test_merge_patch_sets_and_deletes_labels(core):
    core.create_namespaced_pod(NS, _pod("a", keep="1", drop="1"))
    pod = core.patch_namespaced_pod("a", NS, {"metadata": {"labels": {"drop": None, "new": "2"}}},
                                    _content_type=MERGE)
    assert pod.metadata.labels == {"keep": "1", "new": "2"}
    with pytest.raises(ApiException) as err:  # label values are validated
        core.patch_namespaced_pod("a", NS, {"metadata": {"labels": {"bad": "a b"}}},
                                  _content_type=MERGE)
    assert _status(err.value) == (422, "Invalid")


def test_json_patch_applies_operations_and_a_failed_test_applies_nothing(core):
    core.create_namespaced_pod(NS, _pod("a", role="idle"))
    pod = core.patch_namespaced_pod("a", NS, [
        {"op": "test", "path": "/metadata/labels/role", "value": "idle"},
        {"op": "replace", "path": "/metadata/labels/role", "value": "trainer"},
        {"op": "add", "path": "/metadata/labels/reflow.io~1job", "value": "j"},
        {"op": "copy", "from": "/metadata/labels/role", "path": "/metadata/labels/was"},
        {"op": "move", "from": "/metadata/labels/was", "path": "/metadata/labels/now"},
        {"op": "add", "path": "/spec/containers/-", "value": {"name": "side", "image": "x"}}])
    assert pod.metadata.labels == {"role": "trainer", "reflow.io/job": "j", "now": "trainer"}
    assert [c.name for c in pod.spec.containers] == ["main", "side"]
    for ops in ([{"op": "test", "path": "/metadata/labels/role", "value": "idle"},
                 {"op": "remove", "path": "/metadata/labels/role"}],
                [{"op": "remove", "path": "/metadata/labels/missing"}]):
        with pytest.raises(ApiException) as err:
            core.patch_namespaced_pod("a", NS, ops)
        assert _status(err.value) == (422, "Invalid")
    assert core.read_namespaced_pod("a", NS).metadata.labels["role"] == "trainer"
    with pytest.raises(ApiException) as err:
        core.patch_namespaced_pod("a", NS, [{"path": "/x"}])
    assert err.value.status == 400


def test_strategic_merge_patch_merges_labels_and_keyed_lists(core):
    core.create_namespaced_pod(NS, {**_pod("a", keep="1"), "spec": {"containers": [
        {"name": "main", "image": "busybox"}, {"name": "side", "image": "busybox"}]}})
    pod = core.patch_namespaced_pod("a", NS, {  # a dict body is sent as a strategic merge patch
        "metadata": {"labels": {"role": "trainer"}},
        "spec": {"containers": [{"name": "side", "image": "v2"}]}})
    assert pod.metadata.labels == {"keep": "1", "role": "trainer"}
    assert [(c.name, c.image) for c in pod.spec.containers] == [("main", "busybox"), ("side", "v2")]
    pod = core.patch_namespaced_pod("a", NS, {"spec": {"containers": [
        {"name": "side", "$patch": "delete"}]}})
    assert [c.name for c in pod.spec.containers] == ["main"]


def test_status_writes_change_only_status_and_other_writes_cannot(api, core):
    api.create(worker_pod("w"))
    pod = core.patch_namespaced_pod_status("w", NS, {
        "metadata": {"labels": {"ignored": "x"}},
        "status": {"phase": "Failed", "conditions": [{"type": "Ready", "status": "False"}]}})
    assert pod.status.phase == "Failed" and pod.status.pod_ip == "127.0.0.1"
    assert "ignored" not in pod.metadata.labels
    pod = core.patch_namespaced_pod("w", NS, {"metadata": {"labels": {"seen": "y"}},
                                              "status": {"phase": "Running"}})
    assert pod.status.phase == "Failed" and pod.metadata.labels["seen"] == "y"
    pod.status.phase = "Succeeded"
    assert core.replace_namespaced_pod("w", NS, pod).status.phase == "Failed"
    assert core.read_namespaced_pod_status("w", NS).status.phase == "Failed"
    with pytest.raises(ApiException) as err:  # /status takes the version precondition too
        core.patch_namespaced_pod_status("w", NS, {"metadata": {"resourceVersion": "1"},
                                                   "status": {"phase": "Running"}})
    assert err.value.status == 409
    api.update_status(NS, "w", {"podIP": None, "phase": "Running"})
    assert api.get("pods", NS, "w")["status"]["phase"] == "Running"
    assert "podIP" not in api.get("pods", NS, "w")["status"]


def test_lease_create_read_replace_with_precondition_and_patch(leases):
    created = leases.create_namespaced_lease(NS, _lease("sched"))
    lease = leases.read_namespaced_lease("sched", NS)
    assert lease.spec.holder_identity == "a" and lease.metadata.uid == created.metadata.uid
    lease.spec.holder_identity = "b"
    replaced = leases.replace_namespaced_lease("sched", NS, lease)
    assert replaced.spec.holder_identity == "b"
    lease.spec.holder_identity = "c"
    with pytest.raises(ApiException) as err:  # `lease` carries the version it was read at
        leases.replace_namespaced_lease("sched", NS, lease)
    assert _status(err.value) == (409, "Conflict")
    lease.metadata.resource_version = None
    with pytest.raises(ApiException) as err:  # leases allow no unconditional update
        leases.replace_namespaced_lease("sched", NS, lease)
    assert _status(err.value) == (422, "Invalid")
    patched = leases.patch_namespaced_lease("sched", NS, {"spec": {"leaseTransitions": 3}})
    assert patched.spec.lease_transitions == 3 and patched.spec.holder_identity == "b"
    with pytest.raises(ApiException) as err:
        leases.patch_namespaced_lease("sched", NS, {
            "metadata": {"resourceVersion": replaced.metadata.resource_version},
            "spec": {"holderIdentity": "d"}})
    assert err.value.status == 409
    with pytest.raises(ApiException) as err:  # a MicroTime has six fractional digits
        leases.patch_namespaced_lease("sched", NS, {"spec": {"renewTime": "2025-01-01T00:00:00Z"}})
    assert err.value.status == 400
    # The client writes a datetime with isoformat(), which leaves the fraction out when
    # the microseconds are zero: the API server cannot decode that.
    lease = leases.read_namespaced_lease("sched", NS)
    lease.spec.renew_time = datetime.datetime(2025, 1, 1, tzinfo=datetime.timezone.utc)
    with pytest.raises(ApiException) as err:
        leases.replace_namespaced_lease("sched", NS, lease)
    assert err.value.status == 400 and "cannot be handled as a Lease" in err.value.body
    # A PUT of a missing lease creates it.
    assert leases.replace_namespaced_lease("other", NS, _lease("other")).metadata.uid
    with pytest.raises(ApiException) as err:
        leases.read_namespaced_lease("missing", NS)
    assert err.value.status == 404 and "leases.coordination.k8s.io" in err.value.body


def test_delete_honours_preconditions_and_is_watched(api, core):
    pod = core.create_namespaced_pod(NS, _pod("a"))
    with pytest.raises(ApiException) as err:
        core.delete_namespaced_pod("a", NS, body=client.V1DeleteOptions(
            preconditions=client.V1Preconditions(uid="not-the-uid")))
    assert _status(err.value) == (409, "Conflict") and "Precondition failed" in err.value.body
    with pytest.raises(ApiException) as err:
        core.delete_namespaced_pod("a", NS, body=client.V1DeleteOptions(
            preconditions=client.V1Preconditions(resource_version="999", uid=pod.metadata.uid)))
    assert err.value.status == 409
    core.delete_namespaced_pod("a", NS, body=client.V1DeleteOptions(
        preconditions=client.V1Preconditions(uid=pod.metadata.uid)))
    with pytest.raises(ApiException) as err:
        core.read_namespaced_pod("a", NS)
    assert err.value.status == 404
    events = _collect(watch.Watch().stream(core.list_namespaced_pod, NS, timeout_seconds=5,
                                           resource_version=pod.metadata.resource_version), 1)
    assert [e["type"] for e in events] == ["DELETED"]
    assert int(events[0]["object"].metadata.resource_version) > int(pod.metadata.resource_version)


def _collect(stream, count):
    events = []
    for event in stream:
        events.append(event)
        if len(events) == count:
            break
    return events


def test_a_watch_from_a_version_sees_every_later_change_in_order(api, core):
    start = core.list_namespaced_pod(NS).metadata.resource_version
    core.create_namespaced_pod(NS, _pod("a"))
    core.patch_namespaced_pod("a", NS, {"metadata": {"labels": {"x": "1"}}})
    core.delete_namespaced_pod("a", NS)
    w = watch.Watch()
    events = _collect(w.stream(core.list_namespaced_pod, NS, resource_version=start,
                               timeout_seconds=5), 3)
    w.stop()
    assert [e["type"] for e in events] == ["ADDED", "MODIFIED", "DELETED"]
    versions = [int(e["object"].metadata.resource_version) for e in events]
    assert versions == sorted(set(versions)) and versions[0] > int(start)
    # Without a version, a watch starts with the current objects.
    api.create(worker_pod("w"))
    first = _collect(watch.Watch().stream(core.list_namespaced_pod, NS, timeout_seconds=1), 1)
    assert [(e["type"], e["object"].metadata.name) for e in first] == [("ADDED", "w")]


def test_a_watch_from_a_version_older_than_the_history_is_gone():
    with KubeApiServer(history=3) as api:
        api.create(namespace(NS))
        core = client.CoreV1Api(api.client())
        versions = [api.create(worker_pod(f"w-{i}"))["metadata"]["resourceVersion"]
                    for i in range(5)]  # the history keeps the last three events
        with pytest.raises(ApiException) as err:  # the client retries once, then raises
            list(watch.Watch().stream(core.list_namespaced_pod, NS, resource_version=versions[0]))
        assert err.value.status == 410 and "Expired" in err.value.reason
        events = _collect(watch.Watch().stream(core.list_namespaced_pod, NS, timeout_seconds=5,
                                               resource_version=versions[1]), 3)
        assert [e["object"].metadata.name for e in events] == ["w-2", "w-3", "w-4"]


def test_a_watch_with_a_selector_sees_only_matching_objects(api, core):
    start = api.resource_version
    core.create_namespaced_pod(NS, _pod("a", app="rl"))
    core.create_namespaced_pod(NS, _pod("b", app="other"))
    core.patch_namespaced_pod("b", NS, {"metadata": {"labels": {"app": "rl"}}})  # now matches
    core.patch_namespaced_pod("a", NS, {"metadata": {"labels": {"app": "gone"}}})  # no longer
    core.delete_namespaced_pod("a", NS)  # not seen: it did not match
    core.delete_namespaced_pod("b", NS)
    core.create_namespaced_pod(NS, _pod("z", app="rl"))  # the last event
    w, events = watch.Watch(), []
    for event in w.stream(core.list_namespaced_pod, NS, label_selector="app=rl",
                          resource_version=start, timeout_seconds=5):
        events.append((event["type"], event["object"].metadata.name))
        if events[-1][1] == "z":
            w.stop()
    assert events == [("ADDED", "a"), ("ADDED", "b"), ("DELETED", "a"), ("DELETED", "b"),
                      ("ADDED", "z")]


def test_an_injected_conflict_fails_the_next_patch_only(api, core):
    core.create_namespaced_pod(NS, _pod("a"))
    api.fail("PATCH", path="/pods/a$", status=409)
    with pytest.raises(ApiException) as err:
        core.patch_namespaced_pod("a", NS, {"metadata": {"labels": {"x": "1"}}})
    assert _status(err.value) == (409, "Conflict")
    assert "x" not in core.read_namespaced_pod("a", NS).metadata.labels  # not carried out
    assert core.patch_namespaced_pod("a", NS, {"metadata": {"labels": {"x": "1"}}})


def test_injected_server_errors_and_their_cancellation(api, core):
    api.fail(status=500)
    with pytest.raises(ApiException) as err:
        core.list_namespaced_pod(NS)
    assert _status(err.value) == (500, "InternalError")
    core.list_namespaced_pod(NS)
    api.fail("GET", path="/pods", status=503, count=100)
    api.fail("GET", path="/pods", count=0)  # the same rule with count 0 ends it
    core.list_namespaced_pod(NS)
    api.fail("GET", path="/pods", status=429)  # urllib3 honours Retry-After on a GET
    started = time.monotonic()
    core.list_namespaced_pod(NS)
    assert time.monotonic() - started >= 0.9
    assert api.requests[-2:] == [("GET", "/api/v1/namespaces/ml/pods")] * 2


def test_a_stall_times_out_the_client_until_unstalled(api, core):
    api.stall(2, method="POST")
    started = time.monotonic()
    with pytest.raises((urllib3.exceptions.TimeoutError, urllib3.exceptions.MaxRetryError)):
        core.create_namespaced_pod(NS, _pod("slow"), _request_timeout=0.5)
    assert time.monotonic() - started < 1.5
    api.unstall()
    # The stalled create goes on: a request the client gave up on may still be carried out.
    _wait(lambda: [p.metadata.name for p in core.list_namespaced_pod(NS).items] == ["slow"])
    started = time.monotonic()
    core.create_namespaced_pod(NS, _pod("fast"), _request_timeout=0.5)
    assert time.monotonic() - started < 0.5
    api.stall(0.3, count=1)  # a counted stall delays one request, then carries it out
    started = time.monotonic()
    core.read_namespaced_pod("slow", NS)
    assert time.monotonic() - started >= 0.3
    core.read_namespaced_pod("slow", NS, _request_timeout=0.5)


def test_dropping_watches_cuts_open_streams_and_a_new_watch_resumes(api, core):
    api.create(worker_pod("a"))

    def drop():
        deadline = time.monotonic() + 5
        while api.open_watches < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        api.drop_watches()

    threading.Thread(target=drop, daemon=True).start()
    seen, started = [], time.monotonic()
    with pytest.raises(urllib3.exceptions.ProtocolError):  # no final chunk: a broken response
        for event in watch.Watch().stream(core.list_namespaced_pod, NS, _request_timeout=10):
            seen.append(event["object"])
    assert [p.metadata.name for p in seen] == ["a"] and time.monotonic() - started < 5
    _wait(lambda: api.open_watches == 0)
    api.create(worker_pod("b"))
    events = _collect(watch.Watch().stream(core.list_namespaced_pod, NS, timeout_seconds=5,
                                           resource_version=seen[-1].metadata.resource_version), 1)
    assert [(e["type"], e["object"].metadata.name) for e in events] == [("ADDED", "b")]


def _wait(predicate, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_pod_log_honours_tail_lines(api, core):
    api.create(worker_pod("w"))
    api.set_log(NS, "w", "one\ntwo\nthree\n")
    assert core.read_namespaced_pod_log("w", NS) == "one\ntwo\nthree\n"
    assert core.read_namespaced_pod_log("w", NS, tail_lines=2) == "two\nthree\n"
    with pytest.raises(ApiException) as err:
        core.read_namespaced_pod_log("w", NS, container="other")
    assert err.value.status == 400
    with pytest.raises(ApiException) as err:
        core.read_namespaced_pod_log("missing", NS)
    assert err.value.status == 404


def test_a_kubeconfig_reaches_the_server(api, tmp_path):
    path = tmp_path / "kubeconfig"
    api.write_kubeconfig(path)
    api_client = config.new_client_from_config(config_file=str(path))
    try:
        api.create(worker_pod("w"))
        pods = client.CoreV1Api(api_client).list_namespaced_pod(NS).items
        assert [p.metadata.name for p in pods] == ["w"]
        assert api_client.configuration.host == api.url
    finally:
        api_client.close()


def test_shutdown_does_not_wait_for_open_watches():
    api = KubeApiServer().start()
    core = client.CoreV1Api(api.client())
    thread = threading.Thread(target=lambda: list(watch.Watch().stream(
        core.list_namespaced_pod, NS, timeout_seconds=60)), daemon=True)
    thread.start()
    _wait(lambda: api.open_watches == 1)
    started = time.monotonic()
    api.stop()
    assert time.monotonic() - started < 3
    thread.join(3)
    assert not thread.is_alive()
