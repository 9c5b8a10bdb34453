"""The `kubernetes` cluster backend: a job runs on the AsyncHybrid worker pods
of this release (a StatefulSet, each pod serving both the rollout and the
trainer API on one port) and on the release's shared replay-buffer service.

Placing a job picks ready, unassigned worker pods, gives one the trainer role
and the others the rollout role, and records that on the pods as labels
(`reflow.io/role`, `reflow.io/job`) so Services, dashboards and `kubectl get
pods -L reflow.io/role` follow it (DESIGN, elastic pool). Each label patch
carries the pod's resourceVersion, so two schedulers can never claim one pod.
Releasing puts the pods back to `idle`. Pod failures show up in `exited()`.

It deliberately knows nothing of how roles switch inside a worker (the worker
does that) and never creates or deletes pods: the StatefulSet owns them.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from reflow import rpc
from reflow.core.errors import NoCapacity
from reflow.scheduler.local import Placement, ServiceLog

logger = logging.getLogger(__name__)

_LABEL_KEY = re.compile(r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")
ROLE_LABEL = "reflow.io/role"
JOB_LABEL = "reflow.io/job"


class KubeSettings(BaseModel):
    """Read from the scheduler pod's environment (the chart sets every one)."""

    model_config = ConfigDict(extra="forbid")

    namespace: str = Field(min_length=1, description="REFLOW_NAMESPACE: the release namespace.")
    worker_selector: str = Field(min_length=3, description="REFLOW_WORKER_SELECTOR: equality "
                                 "label selector of the worker pods, e.g. 'a=b,c=d'.")
    worker_port: int = Field(default=50060, ge=1, le=65535,
                             description="REFLOW_WORKER_PORT: the workers' gRPC port.")
    replay_address: str = Field(min_length=3, description="REFLOW_REPLAY_ADDRESS: host:port "
                                "of the replay-buffer service.")
    max_rollout_workers: int = Field(default=0, ge=0, description="REFLOW_MAX_ROLLOUT_WORKERS: "
                                     "rollout workers per job; 0 takes every free worker.")
    health_timeout_s: float = Field(default=600.0, gt=0)

    @classmethod
    def from_env(cls) -> "KubeSettings":
        env = os.environ
        values = {
            "namespace": env.get("REFLOW_NAMESPACE", ""),
            "worker_selector": env.get("REFLOW_WORKER_SELECTOR", ""),
            "replay_address": env.get("REFLOW_REPLAY_ADDRESS", ""),
        }
        for key, name in (("worker_port", "REFLOW_WORKER_PORT"),
                          ("max_rollout_workers", "REFLOW_MAX_ROLLOUT_WORKERS")):
            if name in env:
                values[key] = int(env[name])
        return cls(**values)


def parse_selector(selector: str) -> dict[str, str]:
    """Equality-based selectors only (`k=v,k2=v2`): all the chart uses."""
    out = {}
    for term in filter(None, (t.strip() for t in selector.split(","))):
        key, sep, value = (part.strip() for part in term.partition("="))
        if not sep or not _LABEL_KEY.fullmatch(key) or not _LABEL_VALUE.fullmatch(value):
            raise ValueError(f"worker_selector: {term!r} is not 'key=value' with a valid label "
                             "key and value (only equality selectors are supported)")
        out[key] = value
    return out


def _ready(pod) -> bool:
    if pod.metadata.deletion_timestamp or (pod.status and pod.status.phase) != "Running":
        return False
    conditions = (pod.status.conditions or []) if pod.status else []
    return any(c.type == "Ready" and c.status == "True" for c in conditions) and bool(pod.status.pod_ip)


def _restarts(pod) -> int:
    return sum(s.restart_count or 0 for s in (pod.status.container_statuses or []))


@dataclass
class KubePlacement(Placement):
    """A placement on worker pods: pod name -> (role, restart count when placed)."""

    pods: dict[str, tuple[str, int]] = field(default_factory=dict)
    backend: "KubernetesBackend | None" = None

    def exited(self) -> list[tuple[str, int]]:
        if self.backend is None:
            raise RuntimeError("KubePlacement has no backend; KubernetesBackend.place sets it")
        return self.backend.lost_pods(self)

    @property
    def workers(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for name, (role, _) in sorted(self.pods.items()):
            out.setdefault(role, []).append(name)
        return out


class KubernetesBackend:
    def __init__(self, settings: KubeSettings, api_client=None) -> None:
        from kubernetes import client

        self.settings = settings
        self.selector = parse_selector(settings.worker_selector)
        self.api_client = api_client or _default_api_client()
        self.core = client.CoreV1Api(self.api_client)

    def leader_lease(self, name: str, identity: str):
        from kubernetes import client

        from reflow.scheduler.leader import LeaderLease

        return LeaderLease(client.CoordinationV1Api(self.api_client), self.settings.namespace,
                           name, identity)

    @classmethod
    def from_env(cls) -> "KubernetesBackend":
        return cls(KubeSettings.from_env())

    # --- placement ---------------------------------------------------------------------

    def prepare(self, spec) -> None:
        """Workers build a model preset on their own volume when a job starts."""

    def free_workers(self) -> list:
        s = self.settings
        pods = self.core.list_namespaced_pod(s.namespace, label_selector=s.worker_selector).items
        # Filter client-side as well: the selector is the contract, not the server's courtesy.
        return sorted(
            (p for p in pods
             if all((p.metadata.labels or {}).get(k) == v for k, v in self.selector.items())
             and not (p.metadata.labels or {}).get(JOB_LABEL) and _ready(p)),
            key=lambda p: p.metadata.name,
        )

    def place(self, job_id: str, run_dir: Path) -> KubePlacement:
        s = self.settings
        free = self.free_workers()
        if len(free) < 2:
            raise NoCapacity(
                f"job {job_id} needs 2 ready, unassigned worker pods ({s.worker_selector}) and "
                f"{len(free)} are free; scale the workers (worker.replicas) or wait for a job to end")
        trainer, rollouts = free[0], free[1:]
        if s.max_rollout_workers:
            rollouts = rollouts[: s.max_rollout_workers]
        placement = KubePlacement(
            replay_address=s.replay_address,
            rollout_addresses=[f"{p.status.pod_ip}:{s.worker_port}" for p in rollouts],
            trainer_address=f"{trainer.status.pod_ip}:{s.worker_port}",
            backend=self,
        )
        try:
            for pod, role in [(trainer, "trainer")] + [(p, "rollout") for p in rollouts]:
                self._label(pod.metadata.name, role, job_id, pod.metadata.resource_version)
                placement.pods[pod.metadata.name] = (role, _restarts(pod))
            for address in [placement.trainer_address, *placement.rollout_addresses]:
                rpc.wait_healthy(address, s.health_timeout_s)
        except Exception:
            self.release(placement)
            raise
        logger.info("job %s placed on %s", job_id, placement.workers)
        return placement

    def _label(self, pod_name: str, role: str, job_id: str | None,
               resource_version: str | None = None) -> None:
        body: dict = {"metadata": {"labels": {ROLE_LABEL: role, JOB_LABEL: job_id}}}
        if resource_version:
            # A merge patch with resourceVersion is a compare-and-swap: 409 if the
            # pod changed (another scheduler claimed it) since we listed it.
            body["metadata"]["resourceVersion"] = resource_version
        self.core.patch_namespaced_pod(pod_name, self.settings.namespace, body)

    def release(self, placement: KubePlacement) -> None:
        from kubernetes.client.exceptions import ApiException

        for name in placement.pods:
            try:
                self._label(name, "idle", None)
            except ApiException as err:
                if err.status != 404:  # a deleted pod needs no label
                    logger.warning("could not release pod %s: %s", name, err.reason)

    def reclaim_orphans(self, active_job_ids: set[str]) -> list[str]:
        """Worker pods still labelled with a job that is not running (its scheduler
        died): stop that job on them, best effort, and label them idle again, or
        they would never be free. Returns the pods reclaimed."""
        from reflow.rollout.client import GrpcRolloutClient
        from reflow.trainer.client import GrpcTrainerClient

        s = self.settings
        reclaimed = []
        for pod in self.core.list_namespaced_pod(s.namespace, label_selector=s.worker_selector).items:
            labels = pod.metadata.labels or {}
            job_id = labels.get(JOB_LABEL)
            if not job_id or job_id in active_job_ids or \
                    any(labels.get(k) != v for k, v in self.selector.items()):
                continue
            client_cls = GrpcTrainerClient if labels.get(ROLE_LABEL) == "trainer" else GrpcRolloutClient
            if pod.status and pod.status.pod_ip:
                client = client_cls(f"{pod.status.pod_ip}:{s.worker_port}", deadline_s=10)
                try:
                    client.stop_job(job_id, deadline_s=30)
                except Exception as err:  # noqa: BLE001 - the pod may not run it any more
                    logger.warning("pod %s: could not stop orphaned job %s: %s",
                                   pod.metadata.name, job_id, err)
                finally:
                    client.close()
            self._label(pod.metadata.name, "idle", None)
            reclaimed.append(pod.metadata.name)
        if reclaimed:
            logger.info("reclaimed worker pods of jobs no longer running: %s", reclaimed)
        return reclaimed

    def lost_pods(self, placement: KubePlacement) -> list[tuple[str, int]]:
        """Pods of the placement that are gone, not running, or restarted since."""
        from kubernetes.client.exceptions import ApiException

        lost = []
        for name, (_, restarts) in placement.pods.items():
            try:
                pod = self.core.read_namespaced_pod(name, self.settings.namespace)
            except ApiException as err:
                if err.status == 404:
                    lost.append((name, -1))
                    continue
                raise
            if pod.metadata.deletion_timestamp or (pod.status and pod.status.phase) != "Running" \
                    or _restarts(pod) > restarts:
                lost.append((name, _last_exit_code(pod)))
        return lost

    # --- logs ---------------------------------------------------------------------------

    def read_logs(self, run_dir: Path, services: list[str], tail_bytes: int,
                  workers: dict[str, list[str]] | None = None) -> list[ServiceLog]:
        """Pod logs of the job's workers by role. The replay buffer is shared by every
        job of the release, so its log is not one job's and is not returned here."""
        from kubernetes.client.exceptions import ApiException

        out = []
        for service in services:
            texts, truncated = [], False
            for name in (workers or {}).get(service, []):
                try:
                    text = self.core.read_namespaced_pod_log(
                        name, self.settings.namespace, tail_lines=max(10, tail_bytes // 40))
                except ApiException as err:
                    text = f"(log of pod {name} unavailable: {err.reason})\n"
                text = text if isinstance(text, str) else str(text)
                truncated |= len(text.encode()) > tail_bytes
                texts.append(f"--- pod {name} ---\n" + text.encode()[-tail_bytes:].decode(errors="replace"))
            out.append(ServiceLog(service, "".join(texts), truncated))
        return out


def _last_exit_code(pod) -> int:
    for status in (pod.status.container_statuses or []) if pod.status else []:
        state = status.last_state.terminated if status.last_state else None
        if state is None and status.state is not None:
            state = status.state.terminated
        if state is not None:
            return int(state.exit_code)
    return -1


def _default_api_client():
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()
