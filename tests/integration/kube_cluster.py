"""The test cluster of test_kube_cluster.py: the strict API test server, a
cluster DNS, four `reflow serve worker` processes behind four pod IPs, a replay
buffer, and the helpers its tests read pods and jobs with. Its fixtures reach
that module through conftest.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from reflow import procs, rpc, rpcauth
from reflow.core.config import parse_job_spec
from reflow.core.paths import PathRoots
from reflow.replay.server import serve as serve_replay
from reflow.replay.store import ReplayStore
from reflow.scheduler.cluster.kube import JOB_LABEL, ROLE_LABEL, KubernetesBackend, KubeSettings
from reflow.scheduler.jobcontrol.jobs import JobStore
from reflow.scheduler.jobcontrol.service import Scheduler
from tests.integration.kube_apiserver import KubeApiServer, namespace, worker_pod
from tests.integration.kube_dns import ClusterDns
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
NAMESPACE = "ml"
SELECTOR = "app.kubernetes.io/instance=rl,app.kubernetes.io/component=worker"
NUM_WORKERS = 4
SCHEDULER_SELECTOR = "app.kubernetes.io/instance=rl,app.kubernetes.io/component=scheduler"
SUBDOMAIN = "rl-worker"


def _ip(i: int, moved: bool = False) -> str:
    """Pod i's IP; `moved`: the one it gets when its StatefulSet recreates it elsewhere."""
    return f"127.0.0.{(31 if moved else 11) + i}"


def _dns_name(i: int) -> str:
    return f"rl-worker-{i}.{SUBDOMAIN}.{NAMESPACE}.svc.cluster.local"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, redis_server, tiny_model):
    """The API server, a cluster DNS, four worker processes behind four pod IPs, a
    replay buffer. Workers are dialled by DNS name (REFLOW_WORKER_ADDRESS naming the
    test's DNS server as the authority), as the chart's scheduler dials them."""
    logs = tmp_path_factory.mktemp("cluster-logs")
    port = procs.free_port()
    dns = ClusterDns()
    ips = {i: _ip(i) for i in range(NUM_WORKERS)}

    def start_worker(i: int) -> subprocess.Popen:
        """The container of pod i: a `reflow serve worker` behind the pod's IP,
        answering to its DNS name (the chart's REFLOW_ADVERTISE_HOSTS)."""
        # What the chart gives a worker pod: the public keys, no signing key.
        env = {**os.environ, **rpcauth.role_env(None), "REFLOW_POD_IP": ips[i],
               "REFLOW_ADVERTISE_HOSTS": _dns_name(i), "REFLOW_PIN_CPUS": "0"}
        dns.set(_dns_name(i), ips[i])
        return subprocess.Popen(
            [sys.executable, "-m", "reflow.cli", "serve", "worker", "--host", ips[i],
             "--port", str(port)], cwd=REPO, env=env, stdin=subprocess.DEVNULL,
            stdout=open(logs / f"worker-{i}.log", "ab"), stderr=subprocess.STDOUT,
            start_new_session=True)

    workers = [start_worker(i) for i in range(NUM_WORKERS)]

    def kill_worker(i: int) -> None:
        """What a node losing the pod does to its container: SIGKILL, vLLM's engine
        process with it (it dies with its parent)."""
        os.killpg(workers[i].pid, signal.SIGKILL)
        workers[i].wait(30)

    def restart_worker(i: int, ip: str | None = None) -> None:
        """Pod i's container started again, at `ip` when the pod moved."""
        ips[i] = ip or ips[i]
        workers[i] = start_worker(i)
    replay_server, replay_port = serve_replay(ReplayStore.from_url(redis_server.url),
                                              "127.0.0.1:0")
    try:
        for i in range(NUM_WORKERS):
            rpc.wait_healthy(f"{ips[i]}:{port}", 120)
        with KubeApiServer() as api:
            api.create(namespace(NAMESPACE))
            yield {"api": api, "port": port, "replay": f"127.0.0.1:{replay_port}",
                   "logs": logs, "model": tiny_model, "redis": redis_server.url,
                   "kill_worker": kill_worker, "restart_worker": restart_worker,
                   "dns": dns, "ips": ips,
                   "worker_address": f"dns://127.0.0.1:{dns.port}/"
                                     "{hostname}.{subdomain}.{namespace}.svc.cluster.local:{port}"}
    finally:
        replay_server.stop(0)
        for proc in workers:
            procs.terminate_tree(proc.pid, timeout_s=30)
        dns.close()


def _pod(cluster, i: int) -> dict:
    """Pod i as its StatefulSet makes it: under the headless Service, at the IP its
    worker runs at now."""
    return worker_pod(f"rl-worker-{i}", ip=cluster["ips"][i], namespace=NAMESPACE,
                      subdomain=SUBDOMAIN)


@pytest.fixture
def pods(cluster):
    api = cluster["api"]
    for i in range(NUM_WORKERS):
        api.create(_pod(cluster, i))
    yield api
    for i in range(NUM_WORKERS):
        try:
            api.delete("pods", NAMESPACE, f"rl-worker-{i}")
        except Exception:  # noqa: BLE001 - a test may have removed it
            pass


def _settings(cluster, **overrides) -> KubeSettings:
    settings = {"max_rollout_workers": 1, "health_timeout_s": 60, "request_timeout_s": 2,
                "resync_s": 5, "worker_address": cluster["worker_address"], **overrides}
    return KubeSettings(namespace=NAMESPACE, worker_selector=SELECTOR,
                        worker_port=cluster["port"], replay_address=cluster["replay"],
                        **settings)


@pytest.fixture
def scheduler(cluster, pods, redis_client, tmp_path):
    backend = KubernetesBackend(_settings(cluster), cluster["api"].client())
    core = Scheduler(JobStore(redis.Redis.from_url(cluster["redis"])), backend,
                     PathRoots(tmp_path, Path(cluster["model"]).parent))
    yield core
    core.shutdown()


def _spec(cluster, name: str, steps: int) -> str:
    return parse_job_spec({
        "name": name, "model": {"path": cluster["model"]},
        "rollout": {"group_size": 4, "max_tokens": 12, "max_inflight_samples": 8,
                    "kv_cache_gb": 0.5},
        "trainer": {"batch_size": 8, "num_steps": steps, "batch_timeout_s": 120},
    }).model_dump_json()


def _wait(predicate, timeout_s: float, what: str):
    return wait_until(predicate, timeout_s, what, poll_s=0.5)


def _pod_labels(api, name: str) -> dict:
    return api.get("pods", NAMESPACE, name)["metadata"].get("labels", {})


def _all_idle(api) -> bool:
    return all(_pod_labels(api, f"rl-worker-{i}").get(ROLE_LABEL) in (None, "idle")
               and JOB_LABEL not in _pod_labels(api, f"rl-worker-{i}")
               for i in range(NUM_WORKERS))
