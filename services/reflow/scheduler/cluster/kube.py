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
  a pod counts as lost only when it is really gone, restarted or replaced, and
  the job then waits for it to come back under its name (scheduler/cluster/kube_restart.py);
- releasing a job stops it on every worker and waits for the workers to report
  idle before the labels go back to `idle`; a worker is checked idle again before
  it is offered to another job;
- while a leader lease is attached, no label is written without holding it;
- a job's pod changes role (elastic pool) in two preconditioned patches: the
  target as an annotation, then the role label and the end of the target in one
  patch, so the label is replaced, never removed; `recover_flips` rolls back a
  flip cut off between the two.

It deliberately knows nothing of how roles switch inside a worker (the worker
does that) and never creates or deletes pods: the StatefulSet owns them.
"""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path

from reflow import rpc
from reflow.core.errors import NoCapacity
from reflow.scheduler.cluster.kube_settings import KubeSettings, parse_selector  # noqa: F401
from reflow.scheduler.cluster.kubeapi import ApiUnavailable, KubeCaller, PodWatch
from reflow.scheduler.cluster.kube_adopt import adopt_placement
from reflow.scheduler.cluster.kube_pods import (JOB_LABEL, ROLE_LABEL, ROLE_TARGET, ROLES,  # noqa: F401
                                             ROLLOUT_INDEX,
                                             KubePlacement, NotLeader, PodClaim, PodNotInJob,
                                             is_conflict, pod_ready, pod_restarts,
                                             worker_address)
from reflow.scheduler.cluster import kube_restart
from reflow.scheduler.cluster.kube_restart import wait_and_reclaim
from reflow.scheduler.cluster.local import ServiceLog
from reflow.scheduler.cluster.worker_calls import is_busy, stop_and_wait_idle, worker_status

logger = logging.getLogger(__name__)

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

        from reflow.scheduler.cluster.leader import LeaderLease

        self._lease = LeaderLease.from_env(client.CoordinationV1Api(self.api_client),
                                           self.settings.namespace, name, identity,
                                           call=self.call)
        return self._lease

    def mark_leader(self, pod_name: str, leading: bool) -> None:
        """The scheduler pod `pod_name` acts (or no longer does): its leader label,
        which the scheduler Service selects (cluster/leader.py)."""
        from kubernetes import client

        from reflow.scheduler.cluster.leader import mark_leader_pod

        mark_leader_pod(client.CoreV1Api(self.api_client), self.settings.namespace, pod_name,
                        leading, call=self.call,
                        scheduler_selector=self.settings.scheduler_selector)

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
             and (p.metadata.labels or {}).get(JOB_LABEL) in (None, "", job_id) and pod_ready(p)),
            key=lambda p: p.metadata.name,
        )

    supports_elastic = True

    def place(self, job_id: str, run_dir: Path, colocated: bool = False,
              roles: list[str] | None = None,
              rollout_range: tuple[int, int] | None = None) -> KubePlacement:
        """Claim free, idle workers for `job_id`: one trainer and the rest rollout
        (`rollout_range`: at least its min, at most its max of them), or
        for an elastic job (`roles`: worker i's initial role, worker 0 the trainer
        leader) exactly len(roles) pods labelled with those roles, whose roles then
        move with `flip_role`. `colocated` (sync mode) is not honoured here: every
        role gets its own pod. A claim that loses a race (409) is undone and the
        choice made again from a fresh list; after `claim_attempts` lost races, or
        with too few free workers, NoCapacity: the job waits PENDING."""
        s = self.settings
        self.pod_watch.start()
        try:
            placement = self._choose_and_claim(job_id, roles, rollout_range)
        except ApiUnavailable as err:
            raise NoCapacity(f"job {job_id}: the Kubernetes API is unavailable ({err}); "
                             "trying again", short_of_workers=False) from None
        try:
            for address in [placement.trainer_address, *placement.rollout_addresses]:
                rpc.wait_healthy(address, s.health_timeout_s, role="worker")
        except Exception:
            self.release(placement)
            raise
        logger.info("job %s placed on %s", job_id, placement.workers)
        return placement

    def _choose_and_claim(self, job_id: str, roles: list[str] | None = None,
                          rollout_range: tuple[int, int] | None = None) -> KubePlacement:
        s = self.settings
        low, high = rollout_range or (1, s.max_rollout_workers)  # 0: every free worker
        if rollout_range and s.max_rollout_workers:
            high = max(low, min(high, s.max_rollout_workers))
        need = len(roles) if roles else 1 + low
        for attempt in range(s.claim_attempts):
            free = [p for p in self.free_workers(job_id) if self._worker_idle(p)]
            if len(free) < need:
                raise NoCapacity(
                    f"job {job_id} needs {need} ready, idle, unassigned worker pods "
                    f"({s.worker_selector}) and {len(free)} are free; scale the workers "
                    "(worker.replicas) or wait for a job to end")
            trainer, rollouts = free[0], free[1:need] if roles else free[1:]
            if high and not roles:
                rollouts = rollouts[:high]
            placement = self._claim_all(job_id, trainer, rollouts, roles)
            if placement is not None:
                return placement
            # Someone else took one of these pods first: look again, a little later.
            time.sleep(0.1 * (attempt + 1) * (1 + random.random()))  # nosec B311 # jitter
        raise NoCapacity(f"job {job_id}: other placements took the free workers "
                         f"{s.claim_attempts} times in a row; trying again",
                         short_of_workers=False)

    def _claim_all(self, job_id: str, trainer, rollouts: list,
                   roles: list[str] | None = None) -> KubePlacement | None:
        """Label the pods for the job. An elastic job's pods (`roles`) are its workers
        in order: every pod but the leader holds a rollout engine, whatever its role."""
        s = self.settings
        address = lambda pod: worker_address(pod, s)  # noqa: E731
        placement = KubePlacement(
            replay_address=s.replay_address,
            rollout_addresses=[address(p) for p in rollouts],
            trainer_address=address(trainer), job_id=job_id, backend=self,
            worker_addresses=[address(p) for p in [trainer, *rollouts]] if roles else [],
            worker_names=[p.metadata.name for p in [trainer, *rollouts]] if roles else [],
        )
        labelled = [(trainer, "trainer")] + [
            (p, roles[i] if roles else "rollout") for i, p in enumerate(rollouts, start=1)]
        for i, (pod, role) in enumerate(labelled):
            try:
                self._patch_labels(pod.metadata.name, role, job_id, pod.metadata.resource_version,
                                   rollout_index=None if roles or not i else i - 1)
            except Exception as err:
                self._unlabel_all(placement)
                if is_conflict(err):
                    logger.info("job %s: pod %s changed since listed (409); choosing again",
                                job_id, pod.metadata.name)
                    return None
                raise
            placement.pods[pod.metadata.name] = PodClaim(role, pod.metadata.uid, pod_restarts(pod),
                                                         address(pod), pod.status.pod_ip)
        return placement

    def _patch(self, pod_name: str, resource_version: str, **metadata):
        """A metadata patch that carries resourceVersion: the server refuses it (409) if
        the pod changed since it was read. Returns the pod as written."""
        if self._lease is not None and not self._lease.held():
            raise NotLeader("this scheduler lost its leader lease; it writes nothing more")
        body = {"metadata": {"resourceVersion": resource_version, **metadata}}
        return self.call(self.core.patch_namespaced_pod, pod_name, self.settings.namespace, body)

    def _patch_labels(self, pod_name: str, role: str, job_id: str | None,
                      resource_version: str, rollout_index: int | None = None):
        """Role and job in one preconditioned patch, so two placements can never claim
        one pod. It also ends any role flip in flight: a target belongs to one flip.
        `rollout_index`: a fixed-role job's rollout pod's engine index (its rank
        order, which an adopting scheduler reads back); None removes it."""
        return self._patch(pod_name, resource_version,
                           labels={ROLE_LABEL: role, JOB_LABEL: job_id},
                           annotations={ROLE_TARGET: None, ROLLOUT_INDEX: (
                               None if rollout_index is None else str(rollout_index))})

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

    # --- role flips (elastic pool) -------------------------------------------------------

    def flip_role(self, placement: KubePlacement, pod_name: str, role: str) -> str:
        """Move one of the job's pods to `role` ("trainer" or "rollout"); returns the role
        it had. Two patches, each preconditioned on the resourceVersion just read: the
        target annotation, then the role label and the end of the target in one patch.
        On 409 the pod is read again, checked to be still this job's (job label and UID,
        else PodNotInJob) and the flip goes on from where the pod stands. The placement
        follows once the label has landed. Only the Kubernetes record changes: moving
        the worker itself to the new role, and running one job's flips one at a time,
        are the caller's."""
        from kubernetes.client.exceptions import ApiException

        job_id, claim = placement.job_id, _flip_claim(placement, pod_name, role)
        pod = self._read_claimed(pod_name, job_id, claim.uid)
        # From any read two writes finish the flip; `steps` also ends the loop should a
        # server accept a patch without applying it.
        limit, conflicts, steps = self.settings.claim_attempts * 2, 0, 0
        while True:
            target = (pod.metadata.annotations or {}).get(ROLE_TARGET)
            if (pod.metadata.labels or {}).get(ROLE_LABEL) == role and target is None:
                break
            steps += 1
            if conflicts > limit or steps > 3 * (limit + 1):
                raise RuntimeError(f"pod {pod_name}: could not flip it to {role} for job "
                                   f"{job_id} ({conflicts} conflicts); recover_flips rolls "
                                   "back what is left")
            try:
                if target == role:  # phase two: the label is replaced, never removed
                    pod = self._patch_labels(pod_name, role, job_id, pod.metadata.resource_version)
                else:  # phase one: from here on a crash leaves a target for recover_flips
                    pod = self._patch(pod_name, pod.metadata.resource_version,
                                      annotations={ROLE_TARGET: role})
            except ApiException as err:
                if err.status == 404:
                    raise PodNotInJob(f"pod {pod_name} of job {job_id} is gone") from None
                if err.status != 409:
                    raise
                conflicts += 1
                logger.info("job %s: pod %s changed during its flip to %s (409); reading it "
                            "again", job_id, pod_name, role)
                time.sleep(0.02 * conflicts * (1 + random.random()))  # nosec B311 # jitter
                pod = self._read_claimed(pod_name, job_id, claim.uid)
        placement._set_role(pod_name, role)
        logger.info("job %s: pod %s flipped from %s to %s; workers %s", job_id, pod_name,
                    claim.role, role, placement.workers)
        return claim.role

    def _read_pod(self, name: str):
        """The pod of that name, or None if there is none."""
        from kubernetes.client.exceptions import ApiException

        try:
            return self.call(self.core.read_namespaced_pod, name, self.settings.namespace)
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    def _read_claimed(self, pod_name: str, job_id: str, uid: str):
        """The pod, if it still carries `job_id` and is the pod that was claimed."""
        pod = self._read_pod(pod_name)
        if pod is None:
            raise PodNotInJob(f"pod {pod_name} of job {job_id} is gone")
        job = (pod.metadata.labels or {}).get(JOB_LABEL)
        if job != job_id:
            raise PodNotInJob(f"pod {pod_name} is no longer job {job_id}'s: it carries "
                              + (f"job {job}" if job else "no job"))
        if pod.metadata.uid != uid:
            raise PodNotInJob(f"pod {pod_name} is no longer job {job_id}'s: it was replaced by "
                              "a new pod of the same name (new UID)")
        return pod

    def recover_flips(self, job_id: str | None = None) -> list[str]:
        """Roll back every role flip cut off between its two patches (its scheduler died,
        or the API failed it): the target goes, the role label stays as it was. Pods of
        `job_id`, or of any job with None; returns the pods rolled back.

        Back, not forward, because the label patch is a flip's commit point: until it
        lands no reader of the role has seen the new one (Services, dashboards, the
        placement, the planner, which counts a move only once carried out) and
        flip_role has told its caller the flip failed. Rolling back restores a state
        all of them agree on, and the planner decides again on its next window;
        completing it would carry out the decision of a scheduler that may be gone.
        Pods given back (release, reclaim_orphans) need none of this: that patch clears
        the target with the labels."""
        s = self.settings
        rolled_back = []
        for pod in self.call(self.core.list_namespaced_pod, s.namespace,
                             label_selector=s.worker_selector).items:
            labels = pod.metadata.labels or {}
            if ROLE_TARGET not in (pod.metadata.annotations or {}) \
                    or job_id not in (None, labels.get(JOB_LABEL)) \
                    or any(labels.get(k) != v for k, v in self.selector.items()):
                continue
            try:
                if self._clear_target(pod):
                    rolled_back.append(pod.metadata.name)
            except ApiUnavailable as err:  # it keeps its role; the next recovery or flip sees it
                logger.warning("could not roll back the role flip of pod %s: %s",
                               pod.metadata.name, err)
        return rolled_back

    def _clear_target(self, pod) -> bool:
        """Drop the pending target of `pod`, preconditioned; on 409 read it again."""
        from kubernetes.client.exceptions import ApiException

        name, uid = pod.metadata.name, pod.metadata.uid
        job_id = (pod.metadata.labels or {}).get(JOB_LABEL)
        for _ in range(self.settings.claim_attempts * 2):
            target = pod and (pod.metadata.annotations or {}).get(ROLE_TARGET)
            if target is None or pod.metadata.uid != uid \
                    or (pod.metadata.labels or {}).get(JOB_LABEL) != job_id:
                return False  # gone, replaced, another job's, or its flip ended meanwhile
            try:
                self._patch(name, pod.metadata.resource_version, annotations={ROLE_TARGET: None})
                logger.info("pod %s (job %s): role flip to %s rolled back; its role stays %s",
                            name, job_id, target, (pod.metadata.labels or {}).get(ROLE_LABEL))
                return True
            except ApiException as err:
                if err.status not in (404, 409):
                    raise
            pod = self._read_pod(name)
        logger.warning("pod %s: repeated conflicts while rolling back its role flip", name)
        return False

    # --- workers ----------------------------------------------------------------------

    def _worker_idle(self, pod) -> bool:
        """A worker is offered to a job only if both of its services answer idle."""
        address = worker_address(pod, self.settings)
        try:
            trainer_state, rollout_state, _ = worker_status(
                address, self.settings.worker_rpc_timeout_s)
        except Exception as err:  # noqa: BLE001 - not answering: not offered
            logger.info("worker %s not offered: %s", pod.metadata.name, err)
            return False
        idle = not is_busy(trainer_state, rollout_state)
        if not idle:
            logger.warning("worker %s carries no job label but is busy (trainer %s, rollout %s); "
                           "not offered", pod.metadata.name, trainer_state, rollout_state)
        return idle

    def _stop_and_wait_idle(self, name: str, address: str, job_id: str) -> bool:
        return stop_and_wait_idle(name, address, job_id, self.settings.worker_rpc_timeout_s,
                                  self.settings.stop_timeout_s)

    def restart(self, placement: KubePlacement, name: str) -> str:
        """Take pod `name` of the job back once it is there again under its name
        (the StatefulSet recreates a deleted pod, the kubelet restarts a container),
        ready, with an idle worker at the address the job knows: labelled with the
        job and its role again, and claimed anew (its UID and restart count); or a
        rollout pod's place taken by an idle pod after `replace_with_idle_s`. Its
        services are then started by the job's controller. Returns the pod now in
        `name`'s place. TimeoutError after `replace_timeout_s`; PodAddressChanged
        when it came back elsewhere."""
        return wait_and_reclaim(self, placement, name)

    def claim_rollout(self, placement: KubePlacement) -> str | None:
        """A free pod joins the job as its next rollout worker; its address, or None."""
        return kube_restart.claim_rollout(self, placement)

    def detach_rollout(self, placement: KubePlacement, address: str):
        """Rollout worker `address` leaves the placement; `release_detached` frees it."""
        return kube_restart.detach_rollout(placement, address)

    def release_detached(self, placement: KubePlacement, detached) -> None:
        kube_restart.release_detached(self, placement, detached)

    def adopt(self, job_id: str) -> KubePlacement | None:
        """The running job's placement from its pods, for a new scheduler
        (scheduler/cluster/kube_adopt.py); None when it is not whole."""

        return adopt_placement(self, job_id)

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
                self._stop_and_wait_idle(pod.metadata.name, worker_address(pod, s), job_id)
            try:
                if self._unlabel(pod.metadata.name, job_id, pod.metadata.uid):
                    reclaimed.append(pod.metadata.name)
            except Exception as err:  # noqa: BLE001 - never crash-loop the scheduler on it
                logger.warning("could not reclaim pod %s: %s", pod.metadata.name, err)
        if reclaimed:
            logger.info("reclaimed worker pods of jobs no longer running: %s", reclaimed)
        return reclaimed

    def retire(self, placement: KubePlacement, name: str) -> None:
        """Pod `name` of an elastic job was lost and the job goes on without it: it
        leaves the placement (no longer watched or released with the job) and, if
        it still carries the job's label (its container restarted), is labelled
        idle for the next job."""
        claim = placement.pods.pop(name, None)
        if claim is None:
            return
        try:
            self._unlabel(name, placement.job_id, claim.uid)
        except Exception as err:  # noqa: BLE001 - reclaim_orphans picks it up later
            logger.warning("could not release lost pod %s from job %s: %s", name,
                           placement.job_id, err)

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
            elif pod_restarts(pod) > claim.restarts:
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


def _flip_claim(placement: KubePlacement, pod_name: str, role: str) -> PodClaim:
    """The claim of a pod the job may flip to `role`; refusals need no API call."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    claim = placement.pods.get(pod_name)
    if claim is None:
        raise PodNotInJob(f"pod {pod_name} is not one of job {placement.job_id}'s pods "
                          f"({', '.join(sorted(placement.pods))}); its role is not ours to flip")
    if claim.role != role and placement.workers.get(claim.role) == [pod_name]:
        raise ValueError(f"pod {pod_name} is job {placement.job_id}'s last {claim.role} worker "
                         f"and a job keeps at least one of each role; flip another pod to "
                         f"{claim.role} first")
    return claim


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
