"""The cluster backend protocol: what the scheduler and each job's controller
need from where jobs run. `local` (scheduler/cluster/local.py: processes on this
machine) and `kubernetes` (scheduler/cluster/kube.py: worker pods) implement it."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from reflow.scheduler.cluster.local import Placement, ServiceLog


class Backend(Protocol):
    supports_elastic: bool

    def prepare(self, spec) -> None:
        """Make what every service of the job loads (the model preset) exist once."""

    def place(self, job_id: str, run_dir: Path, colocated: bool = False,
              roles: list[str] | None = None) -> Placement:
        """Start (or claim) the job's services; NoCapacity while none are free."""

    def release(self, placement: Placement) -> None:
        """Take the job's services down (or back to the free pool), nothing left behind."""

    def restart(self, placement: Placement, name: str) -> str | None:
        """Start service `name` of a placement again, at the same address, after it
        died; returns once it is healthy. Local: a new process on the same port.
        Kubernetes: waits for the pod to come back under its name (the StatefulSet
        recreates it, the kubelet restarts the container) or, for a rollout pod not
        back in time, claims an idle pod in its place, and returns the pod now there
        (scheduler/cluster/kube_restart.py); its address then replaces the lost one's
        in `placement.rollout_addresses`. Optional: where a backend lacks it, the job
        controller fails the job instead."""

    def adopt(self, job_id: str) -> Placement | None:
        """Optional, where a job's services outlive the scheduler that placed them
        (kubernetes): the placement of the running job `job_id` as found, or None
        when it is not whole. A backend without it (local, whose services die with
        their scheduler) has its running jobs resumed from their checkpoints."""

    def read_logs(self, run_dir: Path, services: list[str], tail_bytes: int,
                  workers: dict[str, list[str]] | None = None) -> list[ServiceLog]: ...

    def reclaim_orphans(self, active_job_ids: set[str]) -> list[str]:
        """Take back workers still assigned to jobs that no longer run."""

    def leader_lease(self, name: str, identity: str): ...

    def close(self) -> None: ...
