"""One active scheduler per release: a coordination.k8s.io Lease, held the way
client-go's leader election holds one.

The scheduler Deployment runs one replica with the Recreate strategy, but a
node partition or a forced rollout can still leave two pods alive for a
while; two schedulers would place jobs on the same workers and mark each
other's jobs failed on start-up (`Scheduler.recover`).

- **Expiry is judged by the observer's own clock.** A candidate never compares
  its wall clock with the holder's `renewTime` (clock skew would allow two
  leaders): it records, on its monotonic clock, when it last saw the lease
  record change, and takes the lease only after `duration_s` without change.
- **The leader stops acting before anyone may take over.** It renews every
  `retry_s`; when it has not renewed for `renew_deadline_s` (shorter than
  `duration_s`) it stops writing at once (`held()` turns false, which the
  Kubernetes backend checks before every label write) and calls `on_lost`.
- Every write is an update carrying the read resourceVersion: of two candidates
  racing for an expired lease, one gets 409 and stays a candidate.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from typing import Callable

logger = logging.getLogger(__name__)


def _micro_time(when: dt.datetime) -> str:
    """A Lease MicroTime: always six fractional digits (the API server refuses a time
    without them, which `isoformat()` produces whenever the microseconds are 0)."""
    return when.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _now() -> str:
    return _micro_time(dt.datetime.now(dt.timezone.utc))


class LeaderLease:
    def __init__(self, coordination_api, namespace: str, name: str, identity: str,
                 duration_s: float = 15.0, renew_deadline_s: float = 10.0,
                 retry_s: float = 2.0, call=None) -> None:
        if not 0 < retry_s < renew_deadline_s < duration_s:
            raise ValueError(f"lease timing: need 0 < retry ({retry_s}) < renew deadline "
                             f"({renew_deadline_s}) < duration ({duration_s})")
        self.api = coordination_api
        self.namespace, self.name, self.identity = namespace, name, identity
        self.duration_s = duration_s
        self.renew_deadline_s = renew_deadline_s
        self.retry_s = retry_s
        # Timeouts and retries on each API call (kubeapi.KubeCaller), if given.
        self.call = call or (lambda fn, *a, **kw: fn(*a, **kw))
        self._stop = threading.Event()
        self._last_renewal: float | None = None  # monotonic, this scheduler's own
        self._observed: tuple | None = None
        self._observed_at = 0.0

    @classmethod
    def from_env(cls, coordination_api, namespace: str, name: str, identity: str,
                 call=None) -> LeaderLease:
        import os

        timing = {key: float(os.environ[env]) for key, env in (
            ("duration_s", "REFLOW_LEASE_DURATION_S"),
            ("renew_deadline_s", "REFLOW_LEASE_RENEW_DEADLINE_S"),
            ("retry_s", "REFLOW_LEASE_RETRY_S")) if os.environ.get(env)}
        return cls(coordination_api, namespace, name, identity, call=call, **timing)

    def held(self) -> bool:
        """True while this scheduler renewed within the renew deadline."""
        return (self._last_renewal is not None and not self._stop.is_set()
                and time.monotonic() - self._last_renewal < self.renew_deadline_s)

    def _observe(self, lease) -> None:
        spec = lease.spec
        record = (spec.holder_identity, str(spec.renew_time), str(spec.acquire_time),
                  spec.lease_transitions) if spec else None
        if record != self._observed:
            self._observed, self._observed_at = record, time.monotonic()

    def try_acquire(self) -> bool:
        """Take the lease if it is free, ours, or unchanged for a whole lease
        duration as seen from here; renew it if ours."""
        from kubernetes.client.exceptions import ApiException

        try:
            lease = self.call(self.api.read_namespaced_lease, self.name, self.namespace)
        except ApiException as err:
            if err.status != 404:
                raise
            return self._create()
        self._observe(lease)
        spec = lease.spec
        holder = spec.holder_identity if spec else None
        ours = holder == self.identity
        expired = time.monotonic() - self._observed_at > self.duration_s
        if holder and not ours and not expired:
            return False
        now = _now()
        lease.spec.holder_identity = self.identity
        lease.spec.lease_duration_seconds = int(round(self.duration_s))
        lease.spec.renew_time = now
        if not ours:
            lease.spec.acquire_time = now
            lease.spec.lease_transitions = (spec.lease_transitions or 0) + (1 if holder else 0)
        elif isinstance(spec.acquire_time, dt.datetime):
            lease.spec.acquire_time = _micro_time(spec.acquire_time)
        try:
            updated = self.call(self.api.replace_namespaced_lease, self.name, self.namespace,
                                lease)
        except ApiException as err:
            if err.status in (404, 409):  # someone else renewed, took or removed it first
                return False
            raise
        self._observe(updated)
        self._last_renewal = time.monotonic()
        if not ours:
            logger.info("lease %s/%s acquired by %s", self.namespace, self.name, self.identity)
        return True

    def _create(self) -> bool:
        from kubernetes.client.exceptions import ApiException

        now = _now()
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": {"holderIdentity": self.identity,
                         "leaseDurationSeconds": int(round(self.duration_s)),
                         "acquireTime": now, "renewTime": now, "leaseTransitions": 0}}
        try:
            created = self.call(self.api.create_namespaced_lease, self.namespace, body)
        except ApiException as err:
            if err.status == 409:
                return False
            raise
        self._observe(created)
        self._last_renewal = time.monotonic()
        return True

    def acquire(self) -> None:
        """Block until this scheduler holds the lease."""
        logged = False
        while True:
            try:
                if self.try_acquire():
                    return
            except Exception as err:  # noqa: BLE001 - keep trying through API trouble
                logger.warning("lease %s: %s: %s", self.name, type(err).__name__, err)
            if not logged:
                logger.info("lease %s/%s held by another scheduler; waiting",
                            self.namespace, self.name)
                logged = True
            time.sleep(self.retry_s)

    def keep(self, on_lost: Callable[[], None]) -> threading.Thread:
        """Renew every `retry_s` on a thread; once renewals have failed for
        `renew_deadline_s`, stop acting (`held()` is false) and call `on_lost` once."""

        def renew() -> None:
            while not self._stop.wait(self.retry_s):
                reason = "another scheduler holds it"
                try:
                    if self.try_acquire():
                        continue
                except Exception as err:  # noqa: BLE001 - an API hiccup; retried next tick
                    reason = f"{type(err).__name__}: {err}"
                if not self.held():
                    logger.error("lease %s lost (%s); this scheduler stops acting", self.name,
                                 reason)
                    self._stop.set()
                    on_lost()
                    return

        thread = threading.Thread(target=renew, name="leader-lease", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        self._stop.set()

    def release(self) -> bool:
        """Give the lease up now (a graceful shutdown, once this scheduler stopped
        acting): the holder is cleared, so a standby takes over at its next try
        instead of after a whole lease duration. False when this scheduler did not
        hold it, or another one moved it first."""
        from kubernetes.client.exceptions import ApiException

        held = self.held()
        self._stop.set()
        if not held:
            return False
        try:
            lease = self.call(self.api.read_namespaced_lease, self.name, self.namespace)
            if lease.spec is None or lease.spec.holder_identity != self.identity:
                return False
            lease.spec.holder_identity = ""
            lease.spec.renew_time = _now()
            if isinstance(lease.spec.acquire_time, dt.datetime):
                lease.spec.acquire_time = _micro_time(lease.spec.acquire_time)
            self.call(self.api.replace_namespaced_lease, self.name, self.namespace, lease)
        except (ApiException, Exception) as err:  # noqa: BLE001 - it then expires instead
            logger.warning("lease %s: not released (%s: %s); it expires instead", self.name,
                           type(err).__name__, err)
            return False
        logger.info("lease %s/%s released by %s", self.namespace, self.name, self.identity)
        return True


# The label the acting scheduler carries on its own pod: the scheduler Service
# selects it, so callers reach the leader alone while a standby waits, warm, on
# the Lease (charts/reflow/templates/scheduler.yaml).
LEADER_LABEL = "reflow.io/scheduler-leader"


def mark_leader_pod(core_api, namespace: str, pod_name: str, leading: bool, call=None,
                    scheduler_selector: str = "") -> None:
    """Put LEADER_LABEL on this scheduler's pod (`leading`) or take it off. Leading,
    it is also taken off any other pod that still carries it (a leader killed
    without a goodbye, whose restarted container kept its pod's labels), so the
    Service has one endpoint. Best effort, logged: the Lease, not the label,
    decides who acts, and a standby refuses calls that reach it."""
    call = call or (lambda fn, *a, **kw: fn(*a, **kw))
    try:
        if leading:
            selector = ",".join(filter(None, [scheduler_selector, f"{LEADER_LABEL}=true"]))
            for pod in call(core_api.list_namespaced_pod, namespace,
                            label_selector=selector).items:
                if pod.metadata.name != pod_name:
                    call(core_api.patch_namespaced_pod, pod.metadata.name, namespace,
                         {"metadata": {"labels": {LEADER_LABEL: None}}})
        call(core_api.patch_namespaced_pod, pod_name, namespace,
             {"metadata": {"labels": {LEADER_LABEL: "true" if leading else None}}})
    except Exception as err:  # noqa: BLE001 - best effort, see above
        logger.warning("pod %s: leader label not %s (%s: %s)", pod_name,
                       "set" if leading else "removed", type(err).__name__, err)
