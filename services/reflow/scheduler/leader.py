"""One active scheduler per release: a coordination.k8s.io Lease.

The scheduler Deployment runs one replica with the Recreate strategy, but a
node partition or a forced rollout can still leave two pods alive for a
while; two schedulers would place jobs on the same workers and mark each
other's jobs failed on start-up (`Scheduler.recover`). The holder renews the
lease every `duration_s / 3`; a scheduler that cannot renew within
`duration_s` stops itself rather than act without it.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from typing import Callable

logger = logging.getLogger(__name__)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


class LeaderLease:
    def __init__(self, coordination_api, namespace: str, name: str, identity: str,
                 duration_s: int = 15) -> None:
        self.api = coordination_api
        self.namespace, self.name, self.identity = namespace, name, identity
        self.duration_s = duration_s
        self._stop = threading.Event()
        self._last_renewal = 0.0

    def try_acquire(self) -> bool:
        """Take the lease if it is free, expired or already ours."""
        from kubernetes.client.exceptions import ApiException

        try:
            lease = self.api.read_namespaced_lease(self.name, self.namespace)
        except ApiException as err:
            if err.status != 404:
                raise
            return self._create()
        spec = lease.spec
        holder = spec.holder_identity if spec else None
        renewed = (spec.renew_time or spec.acquire_time) if spec else None
        duration = (spec.lease_duration_seconds if spec else None) or self.duration_s
        expired = renewed is None or (_now() - renewed).total_seconds() > duration
        if holder not in (None, "", self.identity) and not expired:
            return False
        now = _now().isoformat()
        body = {"metadata": {"resourceVersion": lease.metadata.resource_version},
                "spec": {"holderIdentity": self.identity, "leaseDurationSeconds": self.duration_s,
                         "renewTime": now}}
        if holder != self.identity:
            body["spec"]["acquireTime"] = now
            body["spec"]["leaseTransitions"] = ((spec.lease_transitions or 0) if spec else 0) + 1
        try:
            self.api.patch_namespaced_lease(self.name, self.namespace, body)
        except ApiException as err:
            if err.status == 409:  # someone else renewed or took it first
                return False
            raise
        self._last_renewal = time.monotonic()
        return True

    def _create(self) -> bool:
        from kubernetes.client.exceptions import ApiException

        now = _now().isoformat()
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": {"holderIdentity": self.identity, "leaseDurationSeconds": self.duration_s,
                         "acquireTime": now, "renewTime": now, "leaseTransitions": 0}}
        try:
            self.api.create_namespaced_lease(self.namespace, body)
        except ApiException as err:
            if err.status == 409:
                return False
            raise
        self._last_renewal = time.monotonic()
        return True

    def acquire(self, poll_s: float = 2.0) -> None:
        """Block until this scheduler holds the lease."""
        logged = False
        while not self.try_acquire():
            if not logged:
                logger.info("lease %s/%s held by another scheduler; waiting",
                            self.namespace, self.name)
                logged = True
            time.sleep(poll_s)
        logger.info("lease %s/%s acquired by %s", self.namespace, self.name, self.identity)

    def keep(self, on_lost: Callable[[], None]) -> threading.Thread:
        """Renew on a thread; call `on_lost` once renewals failed for a whole term."""

        def renew() -> None:
            while not self._stop.wait(self.duration_s / 3):
                try:
                    if self.try_acquire():
                        continue
                    reason = "another scheduler holds it"
                except Exception as err:  # noqa: BLE001 - an API hiccup; retried next tick
                    reason = f"{type(err).__name__}: {err}"
                if time.monotonic() - self._last_renewal > self.duration_s:
                    logger.error("lease %s lost (%s); stopping", self.name, reason)
                    on_lost()
                    return

        thread = threading.Thread(target=renew, name="leader-lease", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        self._stop.set()
