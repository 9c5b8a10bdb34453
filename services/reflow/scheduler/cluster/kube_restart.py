"""Taking a lost worker pod back into its job (KubernetesBackend.restart).

A job's pod is lost when it is deleted, replaced under its name or restarted
(KubernetesBackend.lost_pods). The StatefulSet owns the pods, so the backend
does not make a new one: it waits for the pod to be there again under its
name, ready, with a worker that answers idle (a fresh process serves nothing),
and claims it for the job again with the same preconditioned label patch as a
placement. What runs on it is then started again by the job's controller
(scheduler/jobcontrol/controller.py): a trainer resumes from the run's newest committed
checkpoint, a rollout worker's groups go out again.

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


def wait_and_reclaim(backend, placement: KubePlacement, name: str) -> None:
    s = backend.settings
    claim = placement.pods[name]
    deadline = time.monotonic() + s.replace_timeout_s
    last = "not there"
    while True:
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
                return
            last = "its labels changed under the claim (409)"
        if time.monotonic() > deadline:
            raise TimeoutError(f"pod {name} did not come back within {s.replace_timeout_s:.0f}s "
                               f"(REFLOW_KUBE_REPLACE_TIMEOUT_S): {last}")
        time.sleep(POLL_S)


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
        try:
            backend._patch_labels(name, claim.role, placement.job_id,
                                  pod.metadata.resource_version)
        except Exception as err:
            if is_conflict(err):
                return False
            raise
    placement.pods[name] = PodClaim(claim.role, pod.metadata.uid, pod_restarts(pod), address,
                                    pod.status.pod_ip)
    return True
