"""What the Kubernetes backend records on a worker pod and reads back from it:
the role/job labels, a pod's readiness and restart count, and a placement by
pod name (`KubePlacement`). Shared by the backend (cluster/kube.py), adoption
after a scheduler takeover (cluster/kube_adopt.py) and the wait for a lost pod
(cluster/kube_restart.py); the last two need nothing else of the backend.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

from reflow.scheduler.cluster.local import Placement


class PodTracker(Protocol):
    """What a placement asks of its backend (cluster/kube.py's KubernetesBackend)."""

    def lost_pods(self, placement: "KubePlacement") -> list[tuple[str, int, str]]: ...


ROLE_LABEL = "reflow.io/role"
JOB_LABEL = "reflow.io/job"
# A role flip in flight: the role a pod is being moved to (phase one of flip_role).
ROLE_TARGET = "reflow.io/role-target"
ROLES = ("trainer", "rollout")
# A fixed-role job's rollout pod: its engine's index in the job, which orders the
# weight-sync group's ranks; a scheduler that adopts the job reads the order here.
ROLLOUT_INDEX = "reflow.io/rollout-index"


def rollout_index(pod) -> int:
    """The pod's engine index in its job (ROLLOUT_INDEX); pods without one after
    every pod with one."""
    raw = (pod.metadata.annotations or {}).get(ROLLOUT_INDEX, "")
    return int(raw) if raw.isdigit() and len(raw) < 6 else 1 << 20


class NotLeader(RuntimeError):
    """This scheduler no longer holds the leader lease; it must not write."""


class PodNotInJob(RuntimeError):
    """The pod is not (or no longer) one of the job's: another job's, replaced, or gone."""


def pod_ready(pod) -> bool:
    if pod.metadata.deletion_timestamp or (pod.status and pod.status.phase) != "Running":
        return False
    conditions = (pod.status.conditions or []) if pod.status else []
    return any(c.type == "Ready" and c.status == "True" for c in conditions) and bool(pod.status.pod_ip)


def worker_address(pod, settings) -> str:
    """Where the worker of `pod` is dialled (settings.worker_address): by default
    its DNS name under the StatefulSet's headless Service, the same whatever IP a
    recreated pod gets; a pod with no hostname or subdomain, at its IP."""
    spec = pod.spec
    hostname = getattr(spec, "hostname", None) if spec else None
    subdomain = getattr(spec, "subdomain", None) if spec else None
    template = settings.worker_address
    if not (hostname and subdomain) and ("{hostname}" in template or "{subdomain}" in template):
        template = "{pod_ip}:{port}"
    return template.format(hostname=hostname, subdomain=subdomain,
                           namespace=settings.namespace, pod_ip=pod.status.pod_ip,
                           port=settings.worker_port)


def pod_restarts(pod) -> int:
    return sum(s.restart_count or 0 for s in (pod.status.container_statuses or []))


def is_conflict(err: Exception) -> bool:
    return getattr(err, "status", None) == 409


@dataclass(frozen=True)
class PodClaim:
    """One pod of a placement as it was when claimed."""

    role: str
    uid: str
    restarts: int
    address: str
    # The pod's IP when claimed: where its trainer sets a weight-sync group up
    # (REFLOW_POD_IP), which the address, a DNS name, does not say.
    ip: str = ""


@dataclass
class KubePlacement(Placement):
    """A placement on worker pods, by pod name."""

    job_id: str = ""
    pods: dict[str, PodClaim] = field(default_factory=dict)
    backend: PodTracker | None = None

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

    @property
    def trainer_host(self) -> str:
        """The trainer pod's IP, its weight-sync host (rank 0's TCPStore)."""
        for claim in self.pods.values():
            if claim.address == self.trainer_address and claim.ip:
                return claim.ip
        return Placement.trainer_host.fget(self)

    @property
    def trainer_addresses(self) -> list[str]:
        """Every trainer pod's address, by pod name (one until rollout pods flip)."""
        return [c.address for _, c in sorted(self.pods.items()) if c.role == "trainer"]

    def _set_role(self, pod_name: str, role: str) -> None:
        """Record a flip that landed. `trainer_address` stays on its pod while that pod
        trains; the lists are replaced, not mutated, for readers on other threads."""
        self.pods[pod_name] = replace(self.pods[pod_name], role=role)
        self.rollout_addresses = [c.address for _, c in sorted(self.pods.items())
                                  if c.role == "rollout"]
        if self.trainer_address not in self.trainer_addresses:
            self.trainer_address = self.trainer_addresses[0]
