"""Finding a running job's worker pods again, for a scheduler that replaced the
one that placed it (scheduler/jobcontrol/recovery.py).

The pods are the record: the job's pods carry its id and each one's role as
labels (scheduler/cluster/kube.py), and each worker says over gRPC whether it still
serves the job. A job is adopted only whole: exactly one ready trainer pod whose
trainer runs (or has just finished) the job, and at least one ready rollout pod
whose engine runs it, none of them mid-flip. Anything less is not adopted, and
the job resumes from its checkpoint on workers taken back and placed again.
"""

from __future__ import annotations

import logging

from reflow.scheduler.cluster.kube_pods import (JOB_LABEL, ROLE_LABEL, ROLE_TARGET, KubePlacement,
                                             PodClaim, pod_ready, pod_restarts, rollout_index,
                                             worker_address)
from reflow.scheduler.cluster.worker_calls import job_states

logger = logging.getLogger(__name__)

# The states in which a service still holds the job: a trainer that finished or
# failed it is adopted too, and the watch then ends the job as the trainer says.
TRAINER_ADOPTABLE = ("starting", "running", "succeeded", "failed")
ROLLOUT_ADOPTABLE = ("starting", "running")


def adopt_placement(backend, job_id: str) -> KubePlacement | None:
    """The placement of `job_id` as its pods show it, or None (why is logged)."""
    s = backend.settings
    pods = backend.call(backend.core.list_namespaced_pod, s.namespace,
                        label_selector=f"{s.worker_selector},{JOB_LABEL}={job_id}").items
    placement = KubePlacement(replay_address=s.replay_address, rollout_addresses=[],
                              trainer_address="", job_id=job_id, backend=backend)
    for pod in sorted(pods, key=lambda p: p.metadata.name):
        labels = pod.metadata.labels or {}
        name = pod.metadata.name
        # Filter client-side as well: the selector is the contract, not the server's courtesy.
        if labels.get(JOB_LABEL) != job_id or any(
                labels.get(k) != v for k, v in backend.selector.items()):
            continue
        role = labels.get(ROLE_LABEL)
        if role not in ("trainer", "rollout") or ROLE_TARGET in (
                pod.metadata.annotations or {}) or not pod_ready(pod):
            logger.info("job %s: pod %s (role %s) is not ready or mid-flip: not adopted",
                        job_id, name, role)
            return None
        address = worker_address(pod, s)
        trainer_state, rollout_state = job_states(address, job_id, s.worker_rpc_timeout_s)
        if (trainer_state if role == "trainer" else rollout_state) not in (
                TRAINER_ADOPTABLE if role == "trainer" else ROLLOUT_ADOPTABLE):
            logger.info("job %s: pod %s's %s does not run it (%r): not adopted", job_id, name,
                        role, trainer_state if role == "trainer" else rollout_state)
            return None
        placement.pods[name] = PodClaim(role, pod.metadata.uid, pod_restarts(pod), address,
                                        pod.status.pod_ip)
    trainers = placement.trainer_addresses
    # In engine order (the weight-sync group's ranks), as the pods record it: a job
    # that replaced or took in a pod is not in pod-name order.
    order = {p.metadata.name: (rollout_index(p), p.metadata.name) for p in pods}
    placement.rollout_addresses = [placement.pods[n].address for n in
                                   sorted(placement.pods, key=order.__getitem__)
                                   if placement.pods[n].role == "rollout"]
    if len(trainers) != 1 or not placement.rollout_addresses:
        logger.info("job %s: pods %s hold %d trainer(s) and %d rollout worker(s): not adopted",
                    job_id, sorted(placement.pods), len(trainers),
                    len(placement.rollout_addresses))
        return None
    placement.trainer_address = trainers[0]
    backend.pod_watch.start()
    logger.info("job %s re-adopted on %s", job_id, placement.workers)
    return placement
