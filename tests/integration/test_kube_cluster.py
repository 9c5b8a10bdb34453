"""The Kubernetes backend end to end, over real HTTP against the strict API test
server (kube_apiserver.py), with real `reflow serve worker` processes behind
the pods' IPs (127.0.0.1x on loopback) running real jobs (vLLM rollout, torch
trainer, real replay buffer on real Redis): a stalled API server, pods
recreated at new IPs, an idle pod replacing a lost one, leader fail-over
between two scheduler processes, elastic jobs flipping and shrinking (with an
injected conflict), and a job that grows into a released pod and gives it back
to a job that waits. (Placements racing for pods and a claim losing to
a 409: test_kube_backend.py.)

The API server is ours, not a kube-apiserver: these tests exercise our calls
against the API conventions (preconditions, watches, leases), not a cluster.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from reflow import procs, rpc
from reflow.core.config import parse_job_spec
from reflow.core.errors import Unavailable
from reflow.core.paths import PathRoots
from reflow.scheduler.cluster.kube import JOB_LABEL, ROLE_LABEL, KubernetesBackend
from reflow.scheduler.cluster.leader import LEADER_LABEL
from reflow.scheduler.jobcontrol.jobs import JobStore
from reflow.scheduler.jobcontrol.service import Scheduler
from tests.integration.kube_apiserver import worker_pod
# The cluster, pods and scheduler fixtures: conftest.py.
from tests.integration.kube_cluster import (NAMESPACE, NUM_WORKERS, REPO, SCHEDULER_SELECTOR,
                                            SELECTOR,
                                            _all_idle, _ip, _pod, _pod_labels, _settings,
                                            _spec, _wait)

pytestmark = [pytest.mark.slow, pytest.mark.k8s]

def test_a_stalled_api_server_does_not_fail_a_running_job(cluster, scheduler):
    api = cluster["api"]
    scheduler.submit(_spec(cluster, "long", 100_000), job_id="long")
    _wait(lambda: scheduler.get("long").step >= 2, 300, "the job to train")
    errors_before = sum(scheduler.backend.api_errors.values())
    api.stall(30)
    try:
        time.sleep(30)
        assert scheduler.get("long").phase == "RUNNING"
    finally:
        api.unstall()
    step = scheduler.get("long").step
    _wait(lambda: scheduler.get("long").step > step, 60, "training to go on")
    assert sum(scheduler.backend.api_errors.values()) > errors_before  # timeouts fired
    stopped = scheduler.stop("long")
    assert stopped.phase == "STOPPED" and stopped.reason == "stopped by request"
    _wait(lambda: _all_idle(api), 90, "the pods released")


def _worker_log_tails(cluster, lines: int = 15) -> str:
    """The last lines of every worker's log: what a failed job's services said."""
    out = []
    for path in sorted(cluster["logs"].glob("worker-*.log")):
        text = path.read_text(errors="replace").splitlines()[-lines:]
        out.append(f"--- {path.name} ---\n" + "\n".join(text))
    return "\n".join(out)


def _recreate(cluster, name: str, moved: bool = False) -> None:
    """The StatefulSet controller's move after a pod is deleted: a new pod of the
    same name (new UID, restart count 0), its container started; `moved`: on
    another node, at a new IP, which the cluster DNS then gives for its name."""
    api, i = cluster["api"], int(name.rsplit("-", 1)[1])
    api.delete("pods", NAMESPACE, name)
    cluster["restart_worker"](i, _ip(i, moved) if moved else None)
    api.create(_pod(cluster, i))


def test_worker_pods_killed_and_recreated_under_their_names_go_back_into_the_job(
        cluster, pods, redis_client, tmp_path):
    """A job on a trainer pod and two rollout pods. One rollout pod, then the
    trainer pod: its container SIGKILLed and the pod deleted, then recreated by its
    StatefulSet on another node, at a new IP, under its name. Each time the job
    takes the pod back once its worker answers (dialled by its DNS name, which now
    resolves to the new IP), starts the lost service on it again (the trainer
    resuming from its newest checkpoint, the engines told its new weight-sync
    host), the surviving rollout worker re-joins the new weight-sync group, and the
    job trains on. Then a rollout pod gone for good: the idle pod takes its place
    (its engine at the lost one's rank, with the trained weights). With no idle pod
    left, a pod that never comes back fails the job, naming it."""
    api = cluster["api"]
    backend = KubernetesBackend(_settings(cluster, max_rollout_workers=2), api.client())
    scheduler = Scheduler(JobStore(redis.Redis.from_url(cluster["redis"])), backend,
                          PathRoots(tmp_path, Path(cluster["model"]).parent))
    try:
        _kill_and_recreate_pods_of_a_running_job(cluster, scheduler, tmp_path)
    finally:
        scheduler.shutdown()


def _kill_and_recreate_pods_of_a_running_job(cluster, scheduler, tmp_path):
    api = cluster["api"]
    spec = parse_job_spec({
        "name": "victim", "model": {"path": cluster["model"]},
        "rollout": {"group_size": 4, "max_tokens": 12, "max_inflight_samples": 8,
                    "kv_cache_gb": 0.5},
        "trainer": {"batch_size": 8, "num_steps": 100_000, "batch_timeout_s": 240,
                    "checkpoint_interval": 2},
    }).model_dump_json()
    scheduler.submit(spec, job_id="victim")
    job = _wait(lambda: (r := scheduler.get("victim")).step >= 3 and r, 300, "the job to train")
    assert len(job.workers["rollout"]) == 2 and len(job.workers["trainer"]) == 1
    pods = dict(_claimed(api))
    version_at_kill, loss_to_step = {}, {}
    for role in ("rollout", "trainer"):
        name = job.workers[role][0]
        before = scheduler.get("victim").step
        version_at_kill[role] = scheduler.get("victim").policy_version
        old = api.get("pods", NAMESPACE, name)
        cluster["kill_worker"](int(name.rsplit("-", 1)[1]))
        lost_at = time.monotonic()
        _recreate(cluster, name, moved=True)
        new = api.get("pods", NAMESPACE, name)
        assert new["metadata"]["uid"] != old["metadata"]["uid"]
        assert new["status"]["podIP"] != old["status"]["podIP"]
        _wait(lambda: (r := scheduler.get("victim")).restarts.get(name) == 1 or r.terminal,
              300, f"the {role} pod back in the job")
        at_restart = scheduler.get("victim").step
        _wait(lambda: scheduler.get("victim").step > at_restart or scheduler.get("victim").terminal,
              300, "the next step")
        loss_to_step[f"{role}_new_ip"] = round(time.monotonic() - lost_at, 1)
        job = scheduler.get("victim")
        assert job.phase == "RUNNING", (job.reason, _worker_log_tails(cluster))
        # Claimed again for this job, in its role; no other pod changed hands.
        assert _claimed(api) == pods
        assert _pod_labels(api, name)[ROLE_LABEL] == role
        _wait(lambda: scheduler.get("victim").step >= before + 2, 300, "training to go on")
    records = scheduler.metrics("victim", 0, 10_000)
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    # The trainer resumed from a checkpoint, not from step 0.
    resumed = [r for r in records if "resumed_from_step" in r]
    assert len(resumed) == 1 and resumed[0]["resumed_from_step"] >= 2
    events = [json.loads(line) for line in
              (tmp_path / "victim" / "scheduler_events.jsonl").read_text().splitlines()]
    restarted = [e for e in events if e["event"] == "service_restarted"]
    assert [(e["service"], e["worker"]) for e in restarted] == [
        ("rollout", job.workers["rollout"][0]), ("trainer", job.workers["trainer"][0])]
    # From the pod found lost to its service started on it again (a measurement).
    print(json.dumps({"pod_restarts": [(e["service"], e["restart_s"]) for e in restarted]}))

    # Both engines hold weights the restarted trainer published: the surviving one
    # re-joined its new weight-sync group.
    from reflow.rollout.client import GrpcRolloutClient

    versions = []
    for name in job.workers["rollout"]:
        ip = api.get("pods", NAMESPACE, name)["status"]["podIP"]
        client = GrpcRolloutClient(f"{ip}:{cluster['port']}")
        versions.append(client.stats("victim").policy_version)
        client.close()
    assert min(versions) > version_at_kill["trainer"], (versions, version_at_kill)

    # A rollout pod gone for good (its node lost): once it has not come back within
    # replace_with_idle_s, the idle pod takes its place. Its engine takes the lost
    # one's rank in the weight-sync group and receives the trained weights, the
    # dispatcher routes to it, and the job trains on.
    settings = scheduler.backend.settings
    settings.replace_with_idle_s = 3
    idle = next(n for n in (f"rl-worker-{i}" for i in range(NUM_WORKERS)) if n not in pods)
    gone = [job.workers["rollout"][0]]
    before = scheduler.get("victim").step
    lost_at = time.monotonic()
    cluster["kill_worker"](int(gone[0].rsplit("-", 1)[1]))
    api.delete("pods", NAMESPACE, gone[0])
    job = _wait(lambda: (r := scheduler.get("victim")).terminal
                or idle in r.workers.get("rollout", []) and r, 300, "the idle pod in its place")
    assert job.phase == "RUNNING", (job.reason, _worker_log_tails(cluster))
    assert _claimed(api) == {**{n: j for n, j in pods.items() if n != gone[0]}, idle: "victim"}
    assert _pod_labels(api, idle)[ROLE_LABEL] == "rollout"
    _wait(lambda: scheduler.get("victim").step >= before + 2, 300, "training to go on")
    loss_to_step["replaced_by_idle"] = round(time.monotonic() - lost_at, 1)
    replacement = GrpcRolloutClient(f"{api.get('pods', NAMESPACE, idle)['status']['podIP']}:"
                                    f"{cluster['port']}")
    _wait(lambda: replacement.stats("victim").policy_version > version_at_kill["trainer"], 300,
          "the replacement engine to receive the trained weights")
    replacement.close()
    events = [json.loads(line) for line in
              (tmp_path / "victim" / "scheduler_events.jsonl").read_text().splitlines()]
    assert [(e["worker"], e["replaced_by"]) for e in events
            if e["event"] == "service_restarted" and "replaced_by" in e] == [(gone[0], idle)]
    records = scheduler.metrics("victim", 0, 10_000)
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    print(json.dumps({"loss_to_next_step_s": loss_to_step}))

    # No idle pod is left: the next rollout pod gone for good is waited for, then
    # the job fails, naming it.
    settings.replace_timeout_s = 5
    gone.append(next(n for n in scheduler.get("victim").workers["rollout"] if n != idle))
    cluster["kill_worker"](int(gone[1].rsplit("-", 1)[1]))
    api.delete("pods", NAMESPACE, gone[1])
    job = _wait(lambda: (r := scheduler.get("victim")).terminal and r, 120, "the job to fail")
    assert job.phase == "FAILED" and gone[1] in job.reason and "did not come back" in job.reason
    for name in gone:
        i = int(name.rsplit("-", 1)[1])
        cluster["restart_worker"](i)
        rpc.wait_healthy(f"{cluster['ips'][i]}:{cluster['port']}", 120)
        api.create(_pod(cluster, i))
    _wait(lambda: _all_idle(api), 120, "the pods released")


def _serve_scheduler(cluster, tmp_path, name: str, port: int, kubeconfig: Path):
    env = {**os.environ, "REDIS_URL": cluster["redis"], "REFLOW_BACKEND": "kubernetes",
           "KUBECONFIG": str(kubeconfig), "REFLOW_NAMESPACE": NAMESPACE,
           "REFLOW_POD_NAME": name, "REFLOW_WORKER_SELECTOR": SELECTOR,
           "REFLOW_WORKER_PORT": str(cluster["port"]), "REFLOW_REPLAY_ADDRESS": cluster["replay"],
           "REFLOW_SCHEDULER_SELECTOR": SCHEDULER_SELECTOR,
           "REFLOW_WORKER_ADDRESS": cluster["worker_address"],
           "REFLOW_MAX_ROLLOUT_WORKERS": "1", "REFLOW_KUBE_TIMEOUT_S": "2",
           "REFLOW_KUBE_RESYNC_S": "5", "REFLOW_LEASE_DURATION_S": "6",
           "REFLOW_LEASE_RENEW_DEADLINE_S": "4", "REFLOW_LEASE_RETRY_S": "1",
           "REFLOW_RUNS_DIR": str(tmp_path), "REFLOW_MODELS_DIR": str(Path(cluster["model"]).parent)}
    return subprocess.Popen([sys.executable, "-m", "reflow.cli", "serve", "scheduler", "--port",
                             str(port)], cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                            stdout=open(tmp_path / f"{name}.log", "wb"), stderr=subprocess.STDOUT)


def _healthy(port: int, timeout_s: float, service: str = "reflow.v1.Scheduler") -> bool:
    """The scheduler at `port` serves (it leads); `service=""`: its process is up,
    what the chart's probes read (a standby's is)."""
    try:
        rpc.wait_healthy(f"127.0.0.1:{port}", timeout_s, service=service)
        return True
    except TimeoutError:
        return False


def _leaders(api, names) -> list[str]:
    """The scheduler pods the scheduler Service selects (the chart's selector)."""
    return [n for n in names if _pod_labels(api, n).get(LEADER_LABEL) == "true"]


def _claimed(api) -> dict[str, str]:
    """Pod name -> the job it carries, for the pods there now that carry one."""
    out = {}
    for i in range(NUM_WORKERS):
        try:
            job = _pod_labels(api, f"rl-worker-{i}").get(JOB_LABEL)
        except Exception:  # noqa: BLE001 - a pod deleted for good
            continue
        if job:
            out[f"rl-worker-{i}"] = job
    return out


def _claimed_by(api, job_id: str) -> list[str]:
    """The pods there now that carry `job_id`."""
    return [name for name, job in _claimed(api).items() if job == job_id]


def test_schedulers_hand_a_running_job_over_and_a_new_leader_re_adopts_it(cluster, pods,
                                                                           redis_client,
                                                                           tmp_path):
    """Leader election and fail-over with the job running on: a SIGTERMed leader
    (helm upgrade) hands over and releases its lease; a SIGKILLed one is outlived
    by its lease. Either way the next leader finds the job's pods by their labels,
    checks that each worker still serves it, and watches it again: same pods, its
    trainer never restarted (no resume, no step trained twice), and it trains on."""
    from reflow.scheduler.client import GrpcSchedulerClient

    api = cluster["api"]
    kubeconfig = tmp_path / "kubeconfig"
    api.write_kubeconfig(kubeconfig)
    names = ("sched-a", "sched-b", "sched-c")
    ports = {n: procs.free_port() for n in names}
    # Their pods, as the chart's scheduler Deployment makes them (no leader label).
    for name in names:
        api.create(worker_pod(name, namespace=NAMESPACE,
                              labels=dict(t.split("=") for t in SCHEDULER_SELECTOR.split(","))))
    running = {"sched-a": _serve_scheduler(cluster, tmp_path, "sched-a", ports["sched-a"],
                                           kubeconfig)}
    try:
        assert _healthy(ports["sched-a"], 60)
        running["sched-b"] = _serve_scheduler(cluster, tmp_path, "sched-b", ports["sched-b"],
                                              kubeconfig)
        # The standby is up (its probes pass) but serves nothing until it holds the
        # lease: exactly one acts, and the Service selects its pod alone.
        assert _healthy(ports["sched-b"], 60, service="")
        assert not _healthy(ports["sched-b"], 5)
        lease = api.get("leases", NAMESPACE, "reflow-scheduler")
        assert lease["spec"]["holderIdentity"] == "sched-a"
        assert _leaders(api, names) == ["sched-a"]
        # A call that reaches it anyway is refused as retryable (the client retries
        # UNAVAILABLE until its deadline, then says so).
        with pytest.raises(Unavailable, match="scheduler unavailable"):
            GrpcSchedulerClient(f"127.0.0.1:{ports['sched-b']}", deadline_s=3).get("nothing")
        leader = GrpcSchedulerClient(f"127.0.0.1:{ports['sched-a']}")
        leader.submit(_spec(cluster, "failover", 100_000), job_id="failover")
        _wait(lambda: leader.get("failover").step >= 1, 300, "the job to train")
        claimed = _claimed(api)
        assert sorted(claimed.values()) == ["failover", "failover"]
        leader.close()

        takeovers = []
        for old, new, sig in (("sched-a", "sched-b", signal.SIGTERM),
                              ("sched-b", "sched-c", signal.SIGKILL)):
            if new not in running:
                running[new] = _serve_scheduler(cluster, tmp_path, new, ports[new], kubeconfig)
                assert _healthy(ports[new], 60, service="")
                assert not _healthy(ports[new], 3)
            before = _job_step(redis_client, "failover")
            at = time.monotonic()
            running[old].send_signal(sig)
            running[old].wait(180)
            # A released lease is taken at the standby's next try; a dead holder's
            # only after a whole lease duration (6 s here) without renewal.
            assert _healthy(ports[new], 6 + 1 + 60)
            takeovers.append({"signal": sig.name, "took_over_s": round(time.monotonic() - at, 1)})
            lease = api.get("leases", NAMESPACE, "reflow-scheduler")
            assert lease["spec"]["holderIdentity"] == new
            # The Service follows: the new leader's pod alone carries the label (a
            # SIGKILLed leader's pod still did; the new leader took it off).
            _wait(lambda: _leaders(api, names) == [new], 30, "the leader label to move")
            client = GrpcSchedulerClient(f"127.0.0.1:{ports[new]}")
            job = client.get("failover")
            assert job.phase == "RUNNING" and "re-adopted" in job.reason, (job.phase, job.reason)
            # The same pods, never released or claimed again in between.
            assert _claimed(api) == claimed
            _wait(lambda: client.get("failover").step >= before + 2, 300, "training to go on")
            client.close()

        client = GrpcSchedulerClient(f"127.0.0.1:{ports['sched-c']}")
        records = client.metrics("failover", 0, 10_000)
        steps = [r["step"] for r in records]
        # One trainer incarnation throughout: every step once, in order, none resumed.
        assert steps == list(range(1, len(steps) + 1))
        assert not any("resumed_from_step" in r for r in records)
        events = [json.loads(line) for line in
                  (tmp_path / "failover" / "scheduler_events.jsonl").read_text().splitlines()]
        assert sum(e["event"] == "job_adopted" for e in events) == 2
        assert client.stop("failover").phase == "STOPPED"
        # Its pods were given back, never claimed by two jobs.
        _wait(lambda: _all_idle(api), 120, "the pods released")
        client.submit(_spec(cluster, "after", 2), job_id="after")
        after = _wait(lambda: (r := client.get("after")).phase in ("SUCCEEDED", "FAILED") and r,
                      300, "a job under the new leader")
        assert after.phase == "SUCCEEDED", (after.reason, takeovers)
        print(json.dumps({"takeovers": takeovers}))
    finally:
        for name, proc in running.items():
            if proc.poll() is None:
                try:  # a failed run leaves no job running on the pods for the next test
                    GrpcSchedulerClient(f"127.0.0.1:{ports[name]}", deadline_s=90).stop("failover")
                except Exception:  # noqa: BLE001 - a standby, or the job already ended
                    pass
        for proc in running.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(30)
        for name in names:
            api.delete("pods", NAMESPACE, name)


def _job_step(redis_client, job_id: str) -> int:
    return JobStore(redis_client).get(job_id).step


def test_an_elastic_job_flips_pod_roles_both_ways_while_it_runs(cluster, scheduler):
    """Scheduled flips and one requested mid-run (through an injected 409) move
    pods between roles while the job trains: each worker flips, then its pod's
    reflow.io/role label follows, and no pod version is ever without a role."""
    from tests.integration.test_kube_role_flip import (_assert_always_a_role, _history,
                                                       _versions_since)

    api = cluster["api"]
    start = api.resource_version
    spec = parse_job_spec({
        "name": "elastic", "model": {"path": cluster["model"]},
        "rollout": {"group_size": 4, "max_tokens": 12, "kv_cache_gb": 0.5},
        "trainer": {"batch_size": 8, "num_steps": 24, "batch_timeout_s": 120},
        "scheduler": {"placement": False},
        "cluster": {"workers": 3, "trainer_workers": 1,
                    "flips": [{"at_step": 2, "worker": 2, "role": "trainer"},
                              {"at_step": 5, "worker": 2, "role": "rollout"}]},
    }).model_dump_json()
    scheduler.submit(spec, job_id="elastic")

    def flips_done():
        run_dir = scheduler.get("elastic").run_dir
        events = Path(run_dir) / "scheduler_events.jsonl"
        lines = events.read_text().splitlines() if run_dir and events.exists() else []
        return sum(json.loads(line)["event"] == "role_flip" for line in lines)

    # Flips run beside training and wait for a sync boundary, so on a loaded machine
    # the trainer may be several steps past a flip's step when it is done.
    _wait(lambda: flips_done() >= 2, 400, "two flips")
    # The job's record takes the pool's roles at the scheduler's next poll of the job.
    expected = {"trainer": ["rl-worker-0"], "rollout": ["rl-worker-1", "rl-worker-2"]}
    deadline = time.monotonic() + 30
    while (job := scheduler.get("elastic")).workers != expected and time.monotonic() < deadline:
        time.sleep(0.2)
    assert job.workers == expected, job.workers
    assert not job.terminal, "the job ended before its mid-run flip could be asked for"
    # Mid-run, as POST /v1/jobs/{id}/flips does, with the label patch refused once.
    api.fail("PATCH", path=r"/pods/rl-worker-1", status=409, count=1)
    scheduler.request_flip("elastic", 1, "trainer")
    job = _wait(lambda: (r := scheduler.get("elastic")).terminal and r, 400, "the job's end")
    assert job.phase == "SUCCEEDED", job.reason
    events = [json.loads(line) for line in
              (Path(job.run_dir) / "scheduler_events.jsonl").read_text().splitlines()]
    flips = [(e["name"], e["to"]) for e in events if e["event"] == "role_flip"]
    assert flips == [("rl-worker-2", "trainer"), ("rl-worker-2", "rollout"),
                     ("rl-worker-1", "trainer")], flips
    assert not [e for e in events if e["event"] in ("role_label_failed", "role_flip_failed")]
    versions = _versions_since(api, start)
    _assert_always_a_role(versions)
    roles_2 = [role for role, _ in _history(versions, "rl-worker-2")]
    assert roles_2[:1] == ["rollout"] and "trainer" in roles_2
    assert roles_2[roles_2.index("trainer"):].count("rollout") >= 1  # and back
    assert "trainer" in [role for role, _ in _history(versions, "rl-worker-1")]
    _wait(lambda: _all_idle(api), 90, "the pods released")


def test_an_elastic_job_whose_worker_pod_is_gone_for_good_shrinks_and_goes_on(cluster,
                                                                               scheduler):
    """The whole flow on the API server: an elastic job on three worker pods; worker
    2's container is SIGKILLed and its pod deleted, never recreated (a node lost, its
    StatefulSet scaled down). The job does not wait for it: the pool goes on with
    two workers (its groups in flight go out again, its engine leaves the
    weight-sync group), the pod is no longer the job's, and the job succeeds with
    every step recorded once."""
    api = cluster["api"]
    spec = parse_job_spec({
        "name": "shrink", "model": {"path": cluster["model"]},
        "rollout": {"group_size": 4, "max_tokens": 12, "kv_cache_gb": 0.5},
        "trainer": {"batch_size": 8, "num_steps": 12, "batch_timeout_s": 120},
        "scheduler": {"placement": False},
        "cluster": {"workers": 3, "trainer_workers": 1},
    }).model_dump_json()
    scheduler.submit(spec, job_id="shrink")
    job = _wait(lambda: (r := scheduler.get("shrink")).step >= 3 and r, 400, "the job to train")
    assert job.workers == {"trainer": ["rl-worker-0"], "rollout": ["rl-worker-1", "rl-worker-2"]}
    try:
        lost_at = time.monotonic()
        cluster["kill_worker"](2)
        api.delete("pods", NAMESPACE, "rl-worker-2")
        at_loss = scheduler.get("shrink").step
        _wait(lambda: (r := scheduler.get("shrink")).step > at_loss + 1 or r.terminal, 300,
              "training to go on")
        loss_to_step_s = round(time.monotonic() - lost_at, 1)
        job = _wait(lambda: (r := scheduler.get("shrink")).terminal and r, 400, "the job's end")
        assert job.phase == "SUCCEEDED", job.reason
        assert job.workers == {"trainer": ["rl-worker-0"], "rollout": ["rl-worker-1"],
                               "lost": ["rl-worker-2"]}
        records = scheduler.metrics("shrink", 0, 10_000)
        assert [r["step"] for r in records] == list(range(1, 13))
        assert records[-1]["retired_engines"] == 1
        events = [json.loads(line) for line in
                  (Path(job.run_dir) / "scheduler_events.jsonl").read_text().splitlines()]
        left = [e for e in events if e["event"] == "worker_left_pool"]
        assert len(left) == 1 and left[0]["name"] == "rl-worker-2", left
        assert left[0]["workers_left"] == 2
        print(json.dumps({"elastic_loss_to_next_step_s": loss_to_step_s}))
        _wait(lambda: not _claimed_by(api, "shrink"), 90, "the pods released")
    finally:
        cluster["restart_worker"](2)
        rpc.wait_healthy(f"{cluster['ips'][2]}:{cluster['port']}", 120)


def test_a_job_grows_into_a_freed_pod_and_gives_it_back_to_a_job_that_waits(cluster, pods,
                                                                             tmp_path):
    """A job with a range of rollout workers (1 to 2) starts with the one pod left
    free, grows into a pod another job released (its engine joins the weight-sync
    group at the next rank, loads the trained weights and gets work), and gives it
    back when a third job finds too few free pods; that job runs, and the first
    trains on throughout with every step recorded once."""
    api = cluster["api"]
    backend = KubernetesBackend(_settings(cluster, max_rollout_workers=0), api.client())
    scheduler = Scheduler(JobStore(redis.Redis.from_url(cluster["redis"])), backend,
                          PathRoots(tmp_path, Path(cluster["model"]).parent))

    def spec(name: str, steps: int, high: int) -> str:
        return parse_job_spec({**json.loads(_spec(cluster, name, steps)),
                               "cluster": {"max_rollout_workers": high}}).model_dump_json()

    try:
        scheduler.submit(spec("short", 6, 1), job_id="short")
        _wait(lambda: scheduler.get("short").phase == "RUNNING", 120, "short placed")
        scheduler.submit(spec("grows", 100_000, 2), job_id="grows")
        job = _wait(lambda: (r := scheduler.get("grows")).step >= 2 and r, 300, "grows to train")
        assert len(job.workers["rollout"]) == 1  # only two pods were free
        first = job.workers["rollout"][0]
        short = _wait(lambda: (r := scheduler.get("short")).terminal and r, 300, "short's end")
        assert short.phase == "SUCCEEDED", short.reason
        freed_at = time.monotonic()
        job = _wait(lambda: (r := scheduler.get("grows")).terminal
                    or len(r.workers.get("rollout", [])) == 2 and r, 120, "grows to grow")
        assert job.phase == "RUNNING", job.reason
        joined = next(n for n in job.workers["rollout"] if n != first)
        assert joined in short.workers["trainer"] + short.workers["rollout"]
        # The trainer publishes over the larger group: a step trained with two engines.
        _wait(lambda: any(r.get("rollout_engines") == 2
                          for r in scheduler.metrics("grows", 0, 10_000)), 120,
              "a step with two engines")
        freed_to_joined_s = round(time.monotonic() - freed_at, 1)
        from reflow.rollout.client import GrpcRolloutClient

        engine = GrpcRolloutClient(_pod_address(cluster, api, joined))
        _wait(lambda: engine.stats("grows").finished_samples_total > 0, 120,
              "the joined engine to generate")
        assert engine.stats("grows").policy_version > 0  # it loaded trained weights
        engine.close()

        # A job that needs two pods finds one free: grows gives its last engine back.
        waited_from = time.monotonic()
        scheduler.submit(spec("next", 4, 1), job_id="next")
        nxt = _wait(lambda: (r := scheduler.get("next")).terminal and r, 300, "next's end")
        assert nxt.phase == "SUCCEEDED", nxt.reason
        assert joined in nxt.workers["trainer"] + nxt.workers["rollout"]
        waited_s = round(nxt.started_at - (time.time() - (time.monotonic() - waited_from)), 1)
        events = [json.loads(line) for line in
                  (tmp_path / "grows" / "scheduler_events.jsonl").read_text().splitlines()]
        kinds = [e["event"] for e in events]
        assert kinds.count("rollout_worker_joined") >= 1, kinds
        leaving = [e for e in events if e["event"] == "rollout_worker_leaving"]
        assert leaving and leaving[0]["for_job"] == "next", leaving
        assert "rollout_worker_given_back" in kinds
        at = scheduler.get("grows").step
        _wait(lambda: scheduler.get("grows").step >= at + 2, 120, "grows to train on")
        stopped = scheduler.stop("grows")
        assert stopped.phase == "STOPPED", stopped.reason
        records = scheduler.metrics("grows", 0, 10_000)
        assert [r["step"] for r in records] == list(range(1, len(records) + 1))
        versions = [r["policy_version"] for r in records]
        assert versions == sorted(versions) and len(set(versions)) == len(versions)
        last = records[-1]
        assert last["put_samples_total"] == (last["trained_unused_samples_total"]
                                             + last["evicted_unused_samples_total"]
                                             + last["unused_pool_samples"]
                                             + last["leased_samples"]), last
        print(json.dumps({"freed_pod_to_step_with_it_s": freed_to_joined_s,
                          "waiting_job_placed_after_s": waited_s}))
        _wait(lambda: _all_idle(api), 90, "the pods released")
    finally:
        scheduler.shutdown()


def _pod_address(cluster, api, name: str) -> str:
    return f"{api.get('pods', NAMESPACE, name)['status']['podIP']}:{cluster['port']}"
