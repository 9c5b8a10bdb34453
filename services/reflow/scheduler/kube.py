"""The `kubernetes` cluster backend: a job runs on the AsyncHybrid worker pods
of this release (a StatefulSet, each pod serving both the rollout and the
trainer API on one port) and on the release's shared replay-buffer service.

Placing a job picks ready, unassigned worker pods whose worker answers idle,
gives one the trainer role and the others the rollout role, and records that on
the pods as labels (`reflow.io/role`, `reflow.io/job`) so Services, dashboards
and `kubectl get pods -L reflow.io/role` follow it (DESIGN, elastic pool).

Correct under concurrency and faults:
- every label patch carries the pod's resourceVersion (a precondition); on 409
  the backend re-reads and decides again: placement picks again, release checks
  the pod still carries its job. Losing a race never fails a job;
- every API call has a timeout and bounded retries (kubeapi.KubeCaller);
  transient errors are counted, not fatal;
- pods are tracked by UID from a watch with periodic resync (kubeapi.PodWatch):
  a job fails only when one of its pods is really gone, restarted or replaced;
- releasing a job stops it on every worker and waits for the workers to report
  idle before the labels go back to `idle`; a worker is checked idle again before
  it is offered to another job;
- while a leader lease is attached, no label is written without holding it.

It deliberately knows nothing of how roles switch inside a worker (the worker
does that) and never creates or deletes pods: the StatefulSet owns them.
"""

from __future__ import annotations

import logging
import os
import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from reflow import rpc
from reflow.core.errors import NoCapacity
from reflow.scheduler.kubeapi import ApiUnavailable, KubeCaller, PodWatch
from reflow.scheduler.local import Placement, ServiceLog

logger = logging.getLogger(__name__)

_LABEL_KEY = re.compile(r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")
ROLE_LABEL = "reflow.io/role"
JOB_LABEL = "reflow.io/job"
# Worker states in which a job still holds the worker.
BUSY_STATES = ("starting", "running")


class NotLeader(RuntimeError):
    """This scheduler no longer holds the leader lease; it must not write."""


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
    request_timeout_s: float = Field(default=10.0, gt=0, le=300,
                                     description="REFLOW_KUBE_TIMEOUT_S: per API request.")
    resync_s: float = Field(default=30.0, ge=1, le=3600,
                            description="REFLOW_KUBE_RESYNC_S: the pod watch relists this often.")
    worker_rpc_timeout_s: float = Field(default=10.0, gt=0,
                                        description="Deadline of a worker status call.")
    stop_timeout_s: float = Field(default=90.0, gt=0,
                                  description="How long a released worker may take to go idle.")
    claim_attempts: int = Field(default=5, ge=1, le=100,
                                description="Placements retried after a lost race, then the "
                                "job waits PENDING and tries again.")

    @classmethod
    def from_env(cls) -> "KubeSettings":
        env = os.environ
        values: dict = {
            "namespace": env.get("REFLOW_NAMESPACE", ""),
            "worker_selector": env.get("REFLOW_WORKER_SELECTOR", ""),
            "replay_address": env.get("REFLOW_REPLAY_ADDRESS", ""),
        }
        for key, name in (("worker_port", "REFLOW_WORKER_PORT"),
                          ("max_rollout_workers", "REFLOW_MAX_ROLLOUT_WORKERS"),
                          ("request_timeout_s", "REFLOW_KUBE_TIMEOUT_S"),
                          ("resync_s", "REFLOW_KUBE_RESYNC_S")):
            if name in env:
                values[key] = env[name]
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


def _conflict(err: Exception) -> bool:
    return getattr(err, "status", None) == 409


@dataclass(frozen=True)
class PodClaim:
    """One pod of a placement as it was when claimed."""

    role: str
    uid: str
    restarts: int
    address: str


@dataclass
class KubePlacement(Placement):
    """A placement on worker pods, by pod name."""

    job_id: str = ""
    pods: dict[str, PodClaim] = field(default_factory=dict)
    backend: "KubernetesBackend | None" = None

    def exited(self) -> list[tuple[str, int, str]]:
        if self.backend is None:
            raise RuntimeError("KubePlacement has no backend; KubernetesBackend.place sets it")
        return self.backend.lost_pods(self)

    @property
    def workers(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for name, claim in sorted(self.pods.items()):
            out.setdefault(claim.role, []).append(name)
        return out


class KubernetesBackend:
    def __init__(self, settings: KubeSettings, api_client=None) -> None:
        from kubernetes import client

        self.settings = settings
        self.selector = parse_selector(settings.worker_selector)
        self.api_client = api_client or _default_api_client()
        self.core = client.CoreV1Api(self.api_client)
        self.call = KubeCaller(timeout_s=settings.request_timeout_s)
        self.pod_watch = PodWatch(self.core, settings.namespace, settings.worker_selector,
                                  self.call, settings.resync_s)
        self._lease = None

    def leader_lease(self, name: str, identity: str):
        from kubernetes import client

        from reflow.scheduler.leader import LeaderLease

        self._lease = LeaderLease.from_env(client.CoordinationV1Api(self.api_client),
                                           self.settings.namespace, name, identity,
                                           call=self.call)
        return self._lease

    @classmethod
    def from_env(cls) -> "KubernetesBackend":
        return cls(KubeSettings.from_env())

    def close(self) -> None:
        self.pod_watch.stop()

    @property
    def api_errors(self) -> dict[str, int]:
        """Transient API errors by reason, for reflow_scheduler_kube_api_errors_total."""
        return dict(self.call.errors)

    # --- placement ---------------------------------------------------------------------

    def prepare(self, spec) -> None:
        """Workers build a model preset on their own volume when a job starts."""

    def free_workers(self, job_id: str | None = None) -> list:
        """Ready worker pods of this release that carry no job, by name (a fresh list).
        With `job_id`, pods already labelled with that job count as free for it: what
        a claim cut short (by an API outage) left behind goes to the job's next try."""
        s = self.settings
        pods = self.call(self.core.list_namespaced_pod, s.namespace,
                         label_selector=s.worker_selector).items
        # Filter client-side as well: the selector is the contract, not the server's courtesy.
        return sorted(
            (p for p in pods
             if all((p.metadata.labels or {}).get(k) == v for k, v in self.selector.items())
             and (p.metadata.labels or {}).get(JOB_LABEL) in (None, "", job_id) and _ready(p)),
            key=lambda p: p.metadata.name,
        )

    def place(self, job_id: str, run_dir: Path, colocated: bool = False) -> KubePlacement:
        """Claim free, idle workers for `job_id`. `colocated` (sync mode) is not honoured
        here yet: every role gets its own pod until workers switch roles in place. A claim that loses a race (409) is
        undone and the choice made again from a fresh list; after `claim_attempts`
        lost races, or with too few free workers, NoCapacity: the job waits PENDING."""
        s = self.settings
        self.pod_watch.start()
        try:
            placement = self._choose_and_claim(job_id)
        except ApiUnavailable as err:
            raise NoCapacity(f"job {job_id}: the Kubernetes API is unavailable ({err}); "
                             "trying again") from None
        try:
            for address in [placement.trainer_address, *placement.rollout_addresses]:
                rpc.wait_healthy(address, s.health_timeout_s)
        except Exception:
            self.release(placement)
            raise
        logger.info("job %s placed on %s", job_id, placement.workers)
        return placement

    def _choose_and_claim(self, job_id: str) -> KubePlacement:
        s = self.settings
        for attempt in range(s.claim_attempts):
            free = [p for p in self.free_workers(job_id) if self._worker_idle(p)]
            if len(free) < 2:
                raise NoCapacity(
                    f"job {job_id} needs 2 ready, idle, unassigned worker pods "
                    f"({s.worker_selector}) and {len(free)} are free; scale the workers "
                    "(worker.replicas) or wait for a job to end")
            trainer, rollouts = free[0], free[1:]
            if s.max_rollout_workers:
                rollouts = rollouts[: s.max_rollout_workers]
            placement = self._claim_all(job_id, trainer, rollouts)
            if placement is not None:
                return placement
            # Someone else took one of these pods first: look again, a little later.
            time.sleep(0.1 * (attempt + 1) * (1 + random.random()))  # nosec B311 # jitter
        raise NoCapacity(f"job {job_id}: other placements took the free workers "
                         f"{s.claim_attempts} times in a row; trying again")

    def _claim_all(self, job_id: str, trainer, rollouts: list) -> KubePlacement | None:
        s = self.settings
        address = lambda pod: f"{pod.status.pod_ip}:{s.worker_port}"  # noqa: E731
        placement = KubePlacement(
            replay_address=s.replay_address,
            rollout_addresses=[address(p) for p in rollouts],
            trainer_address=address(trainer), job_id=job_id, backend=self,
        )
        for pod, role in [(trainer, "trainer")] + [(p, "rollout") for p in rollouts]:
            try:
                self._patch_labels(pod.metadata.name, role, job_id, pod.metadata.resource_version)
            except Exception as err:
                self._unlabel_all(placement)
                if _conflict(err):
                    logger.info("job %s: pod %s changed since listed (409); choosing again",
                                job_id, pod.metadata.name)
                    return None
                raise
            placement.pods[pod.metadata.name] = PodClaim(role, pod.metadata.uid, _restarts(pod),
                                                         address(pod))
        return placement

    def _patch_labels(self, pod_name: str, role: str, job_id: str | None,
                      resource_version: str) -> None:
        """A label patch that carries resourceVersion: the server refuses it (409) if the
        pod changed since it was read, so two placements can never claim one pod."""
        if self._lease is not None and not self._lease.held():
            raise NotLeader("this scheduler lost its leader lease; it writes nothing more")
        body = {"metadata": {"resourceVersion": resource_version,
                             "labels": {ROLE_LABEL: role, JOB_LABEL: job_id}}}
        self.call(self.core.patch_namespaced_pod, pod_name, self.settings.namespace, body)

    def _unlabel(self, pod_name: str, job_id: str, uid: str | None = None) -> bool:
        """Label the pod idle again, if it still carries `job_id` (and is the same pod):
        read, check, patch with the read resourceVersion; on 409 read again."""
        from kubernetes.client.exceptions import ApiException

        for _ in range(self.settings.claim_attempts * 2):
            try:
                pod = self.call(self.core.read_namespaced_pod, pod_name, self.settings.namespace)
            except ApiException as err:
                if err.status == 404:
                    return False  # gone: nothing to give back
                raise
            labels = pod.metadata.labels or {}
            if labels.get(JOB_LABEL) != job_id or (uid and pod.metadata.uid != uid):
                return False  # another job's now, or another pod under this name
            try:
                self._patch_labels(pod_name, "idle", None, pod.metadata.resource_version)
                return True
            except ApiException as err:
                if err.status == 404:
                    return False
                if err.status != 409:
                    raise
        raise RuntimeError(f"pod {pod_name}: could not release it from job {job_id} after "
                           "repeated conflicts")

    def _unlabel_all(self, placement: KubePlacement) -> None:
        for name, claim in placement.pods.items():
            try:
                self._unlabel(name, placement.job_id, claim.uid)
            except Exception as err:  # noqa: BLE001 - reclaim_orphans picks it up later
                logger.warning("could not release pod %s from job %s: %s", name,
                               placement.job_id, err)

    # --- workers ----------------------------------------------------------------------

    def _worker_status(self, address: str) -> tuple[str, str, str]:
        """(trainer state, rollout state, trainer job) of the worker at `address`."""
        from reflow.rollout.client import GrpcRolloutClient
        from reflow.trainer.client import GrpcTrainerClient

        trainer = GrpcTrainerClient(address, deadline_s=self.settings.worker_rpc_timeout_s)
        rollout = GrpcRolloutClient(address, deadline_s=self.settings.worker_rpc_timeout_s)
        try:
            status = trainer.status("")
            return status.state, rollout.stats("").state, status.job_id
        finally:
            trainer.close()
            rollout.close()

    def _worker_idle(self, pod) -> bool:
        """A worker is offered to a job only if both of its services answer idle."""
        address = f"{pod.status.pod_ip}:{self.settings.worker_port}"
        try:
            trainer_state, rollout_state, _ = self._worker_status(address)
        except Exception as err:  # noqa: BLE001 - not answering: not offered
            logger.info("worker %s not offered: %s", pod.metadata.name, err)
            return False
        idle = trainer_state not in BUSY_STATES and rollout_state not in BUSY_STATES
        if not idle:
            logger.warning("worker %s carries no job label but is busy (trainer %s, rollout %s); "
                           "not offered", pod.metadata.name, trainer_state, rollout_state)
        return idle

    def _stop_on_worker(self, address: str, job_id: str) -> None:
        """Stop `job_id` on both services of a worker; a service not running it is fine."""
        import grpc

        from reflow.rollout.client import GrpcRolloutClient
        from reflow.trainer.client import GrpcTrainerClient

        for client_cls in (GrpcTrainerClient, GrpcRolloutClient):
            client = client_cls(address, deadline_s=self.settings.worker_rpc_timeout_s)
            try:
                client.stop_job(job_id, deadline_s=self.settings.stop_timeout_s)
            except grpc.RpcError as err:
                if err.code() not in (grpc.StatusCode.NOT_FOUND,
                                      grpc.StatusCode.FAILED_PRECONDITION):
                    raise
            finally:
                client.close()

    def _stop_and_wait_idle(self, name: str, address: str, job_id: str) -> bool:
        deadline = time.monotonic() + self.settings.stop_timeout_s
        try:
            self._stop_on_worker(address, job_id)
            while time.monotonic() < deadline:
                trainer_state, rollout_state, _ = self._worker_status(address)
                if trainer_state not in BUSY_STATES and rollout_state not in BUSY_STATES:
                    return True
                time.sleep(0.5)
        except Exception as err:  # noqa: BLE001 - an unreachable worker is checked at placement
            logger.warning("worker %s: could not stop job %s: %s", name, job_id, err)
        return False

    def release(self, placement: KubePlacement) -> None:
        """Stop the job on every worker, wait until they report idle, then give the
        pods back (labels `idle`, only where they still carry this job)."""
        for name, claim in placement.pods.items():
            if not self._stop_and_wait_idle(name, claim.address, placement.job_id):
                logger.warning("worker %s did not report idle after job %s; it is checked "
                               "again before any other job gets it", name, placement.job_id)
        self._unlabel_all(placement)

    def reclaim_orphans(self, active_job_ids: set[str]) -> list[str]:
        """Worker pods still labelled with a job that is not running (its scheduler
        died): stop that job on them, best effort, and label them idle again, or
        they would never be free. Returns the pods reclaimed."""
        s = self.settings
        reclaimed = []
        pods = self.call(self.core.list_namespaced_pod, s.namespace,
                         label_selector=s.worker_selector).items
        for pod in pods:
            labels = pod.metadata.labels or {}
            job_id = labels.get(JOB_LABEL)
            if not job_id or job_id in active_job_ids or \
                    any(labels.get(k) != v for k, v in self.selector.items()):
                continue
            if pod.status and pod.status.pod_ip:
                self._stop_and_wait_idle(pod.metadata.name,
                                         f"{pod.status.pod_ip}:{s.worker_port}", job_id)
            try:
                if self._unlabel(pod.metadata.name, job_id, pod.metadata.uid):
                    reclaimed.append(pod.metadata.name)
            except Exception as err:  # noqa: BLE001 - never crash-loop the scheduler on it
                logger.warning("could not reclaim pod %s: %s", pod.metadata.name, err)
        if reclaimed:
            logger.info("reclaimed worker pods of jobs no longer running: %s", reclaimed)
        return reclaimed

    def lost_pods(self, placement: KubePlacement) -> list[tuple[str, int, str]]:
        """Pods of the placement that are gone, replaced (new UID under the same
        name), not running, or restarted since they were claimed, from the watch
        cache; (name, exit code or -1, what happened)."""
        if not self.pod_watch.synced.is_set():
            return []  # nothing known yet: no evidence of loss
        lost = []
        for name, claim in placement.pods.items():
            pod = self.pod_watch.get(name)
            if pod is None:
                lost.append((name, -1, "was deleted"))
            elif pod.metadata.uid != claim.uid:
                lost.append((name, -1, "was replaced by a new pod of the same name (new UID)"))
            elif pod.metadata.deletion_timestamp or (pod.status and pod.status.phase) != "Running":
                lost.append((name, _last_exit_code(pod), "stopped running"))
            elif _restarts(pod) > claim.restarts:
                lost.append((name, _last_exit_code(pod), "restarted"))
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
                    text = self.call(self.core.read_namespaced_pod_log, name,
                                     self.settings.namespace, tail_lines=max(10, tail_bytes // 40))
                except (ApiException, ApiUnavailable) as err:
                    text = f"(log of pod {name} unavailable: {getattr(err, 'reason', err)})\n"
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
