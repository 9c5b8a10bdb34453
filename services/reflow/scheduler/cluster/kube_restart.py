"""Taking a lost worker pod back into its job (KubernetesBackend.restart).

A job's pod is lost when it is deleted, replaced under its name or restarted
(KubernetesBackend.lost_pods). The StatefulSet owns the pods, so the backend
does not make a new one: it waits for the pod to be there again under its
name, ready, with a worker that answers idle (a fresh process serves nothing),
and claims it for the job again with the same preconditioned label patch as a
placement. What runs on it is then started again by the job's controller
(scheduler/jobcontrol/controller.py): a trainer resumes from the run's newest committed
checkpoint, a rollout worker's groups go out again.

A rollout pod that is not back within REFLOW_KUBE_REPLACE_WITH_IDLE_S is
replaced by an idle worker pod, if one is free (`claim_replacement`): the new
pod takes the lost one's place in the placement, and its engine the lost
engine's rank in the weight-sync group (the group keeps its shape), so the
trainer and the dispatcher swap one address for another. A trainer pod is
always waited for: its pod holds the job's trainer address. A job with a range
of rollout workers takes free pods in and gives them back the same way
(`claim_rollout`, `detach_rollout`, `release_detached`; jobcontrol/resize.py).

Workers are addressed by their DNS names under the StatefulSet's headless
Service (kube_pods.worker_address), so a pod recreated at a new IP is the same
worker: its callers' channels resolve the name again. Only a worker dialled at
its IP (a pod without hostname and subdomain, or REFLOW_WORKER_ADDRESS naming
{pod_ip}) that comes back at another one is not taken back (PodAddressChanged):
the job fails, saying so.
"""

from __future__ import annotations

import logging
import time

from reflow import rpc
from reflow.scheduler.cluster.kube_pods import (JOB_LABEL, ROLE_LABEL, KubePlacement, PodClaim,
                                             is_conflict, pod_ready, pod_restarts,
                                             worker_address)

logger = logging.getLogger(__name__)

POLL_S = 1.0


class PodAddressChanged(RuntimeError):
    """The pod came back under its name at an address the job does not know."""


def wait_and_reclaim(backend, placement: KubePlacement, name: str) -> str:
    """Returns the pod now serving in `name`'s place: `name` itself, or (a rollout
    pod not back within replace_with_idle_s) an idle pod claimed instead."""
    s = backend.settings
    claim = placement.pods[name]
    started = time.monotonic()
    deadline = started + s.replace_timeout_s
    last = "not there"
    while True:
        if (claim.role == "rollout" and s.replace_with_idle_s
                and time.monotonic() - started > s.replace_with_idle_s):
            replacement = claim_replacement(backend, placement, name)
            if replacement is not None:
                return replacement
        # The watch's view, which lost_pods reads too: once it shows the pod back,
        # the next check of the job finds nothing lost.
        pod = backend.pod_watch.get(name)
        if pod is None:
            last = "not there"
        elif pod.metadata.uid == claim.uid and pod_restarts(pod) == claim.restarts:
            last = "the lost pod itself, not yet gone"
        elif not pod_ready(pod):
            last = "not ready"
        elif not backend._worker_idle(pod):
            last = "its worker does not answer idle"
        else:
            address = worker_address(pod, s)
            if address != claim.address:
                raise PodAddressChanged(
                    f"pod {name} came back at {address}, not at {claim.address} where job "
                    f"{placement.job_id} knew it; dial workers by name (a StatefulSet "
                    "with a headless Service, REFLOW_WORKER_ADDRESS) to keep them")
            if _reclaim(backend, placement, name, claim, pod, address):
                rpc.wait_healthy(address, s.health_timeout_s, role="worker")
                logger.info("job %s: pod %s is back (%s, %s)", placement.job_id, name,
                            claim.role, address)
                return name
            last = "its labels changed under the claim (409)"
        if time.monotonic() > deadline:
            raise TimeoutError(f"pod {name} did not come back within {s.replace_timeout_s:.0f}s "
                               f"(REFLOW_KUBE_REPLACE_TIMEOUT_S): {last}")
        time.sleep(POLL_S)


def claim_replacement(backend, placement: KubePlacement, lost: str) -> str | None:
    """An idle, ready, unassigned worker pod takes lost rollout pod `lost`'s place
    in the job: labelled with the job and the role (the same preconditioned patch
    as a placement), its address put where the lost one's was, so that its engine
    takes the lost engine's rank in the weight-sync group. None when no pod is
    free (the wait for the lost one goes on) or every free one was taken first."""
    claim = placement.pods[lost]
    taken = _claim_free(backend, placement, claim.role,
                        placement.rollout_addresses.index(claim.address))
    if taken is None:
        return None
    name, new_claim = taken
    # Replaced, never mutated: other threads read these.
    placement.rollout_addresses = [new_claim.address if a == claim.address else a
                                   for a in placement.rollout_addresses]
    pods = dict(placement.pods)
    del pods[lost]
    pods[name] = new_claim
    placement.pods = pods
    logger.warning("job %s: pod %s did not come back within %.0f s; idle pod %s takes "
                   "its place (%s)", placement.job_id, lost,
                   backend.settings.replace_with_idle_s, name, new_claim.address)
    return name


def claim_rollout(backend, placement: KubePlacement) -> str | None:
    """A free worker pod joins the job as its next rollout worker (after the
    last; jobcontrol/resize.py): its address, or None when no pod is free."""
    taken = _claim_free(backend, placement, "rollout", len(placement.rollout_addresses))
    if taken is None:
        return None
    name, claim = taken
    placement.rollout_addresses = [*placement.rollout_addresses, claim.address]
    placement.pods = {**placement.pods, name: claim}
    logger.info("job %s: pod %s joins as rollout worker %d (%s)", placement.job_id, name,
                len(placement.rollout_addresses) - 1, claim.address)
    return claim.address


def detach_rollout(placement: KubePlacement, address: str) -> tuple[str, PodClaim]:
    """Rollout worker `address` leaves the job's placement (it is given back): no
    longer watched nor restarted. Returns what `release_detached` releases."""
    name = next(n for n, c in placement.pods.items()
                if c.address == address and c.role == "rollout")
    claim = placement.pods[name]
    placement.pods = {n: c for n, c in placement.pods.items() if n != name}
    placement.rollout_addresses = [a for a in placement.rollout_addresses if a != address]
    return name, claim


def release_detached(backend, placement: KubePlacement, detached: tuple[str, PodClaim]) -> None:
    """Stop the job on a detached pod's worker, wait for it to report idle, and
    label the pod idle again (only if it still carries the job)."""
    name, claim = detached
    if not backend._stop_and_wait_idle(name, claim.address, placement.job_id):
        logger.warning("worker %s did not report idle after leaving job %s; it is checked "
                       "again before any other job gets it", name, placement.job_id)
    backend._unlabel(name, placement.job_id, claim.uid)


def _claim_free(backend, placement: KubePlacement, role: str,
                index: int) -> tuple[str, PodClaim] | None:
    """Label the first free, idle worker pod with the job, `role` and its engine
    `index` (preconditioned: a pod another placement took first is skipped) once
    its worker is healthy."""
    for pod in backend.free_workers():
        if not backend._worker_idle(pod):
            continue
        try:
            backend._patch_labels(pod.metadata.name, role, placement.job_id,
                                  pod.metadata.resource_version, rollout_index=index)
        except Exception as err:
            if is_conflict(err):
                continue  # another placement took it: the next one
            raise
        address = worker_address(pod, backend.settings)
        claim = PodClaim(role, pod.metadata.uid, pod_restarts(pod), address, pod.status.pod_ip)
        try:
            rpc.wait_healthy(address, backend.settings.health_timeout_s, role="worker")
        except Exception:
            backend._unlabel(pod.metadata.name, placement.job_id, claim.uid)
            raise
        return pod.metadata.name, claim
    return None


def _reclaim(backend, placement: KubePlacement, name: str, claim: PodClaim, pod,
             address: str) -> bool:
    """Label the pod with the job and its role (unless it carries them: a container
    restarted in place keeps its labels) and record the new claim; False on a
    conflict (read again and retried by the caller)."""
    labels = pod.metadata.labels or {}
    job = labels.get(JOB_LABEL)
    if job not in (None, "", placement.job_id):
        raise RuntimeError(f"pod {name} came back carrying job {job}")
    if job != placement.job_id or labels.get(ROLE_LABEL) != claim.role:
        index = (placement.rollout_addresses.index(claim.address)
                 if claim.address in placement.rollout_addresses and not placement.worker_names
                 else None)
        try:
            backend._patch_labels(name, claim.role, placement.job_id,
                                  pod.metadata.resource_version, rollout_index=index)
        except Exception as err:
            if is_conflict(err):
                return False
            raise
    placement.pods[name] = PodClaim(claim.role, pod.metadata.uid, pod_restarts(pod), address,
                                    pod.status.pod_ip)
    return True
