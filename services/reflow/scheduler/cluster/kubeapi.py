"""Talking to the Kubernetes API so that an API blip never takes a job down.

- `KubeCaller`: every call with a request timeout, and bounded retries with
  exponential backoff on transient failures (HTTP 429 and 5xx, timeouts, refused
  connections), each counted by reason for `reflow_scheduler_kube_api_errors_total`.
  Other errors (404, 409, 422, ...) are answers, not blips: they raise at once.
- `PodWatch`: the release's worker pods, listed once and then kept current by a
  watch from the list's resourceVersion; the watch is restarted from a fresh list
  every `resync_s` (periodic resync), on 410 Gone and on any error. Pods are
  keyed by name but carry their UID, so a pod the StatefulSet recreated under
  the same name is a different pod. While the API is unreachable the cache keeps
  its last state: a silent API is not evidence that a pod is gone.

Knows nothing of jobs or roles.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import Counter

logger = logging.getLogger(__name__)

TRANSIENT_STATUSES = frozenset({429, 500, 502, 503, 504})


class ApiUnavailable(RuntimeError):
    """The API server did not answer usefully within the retries."""


class KubeCaller:
    def __init__(self, timeout_s: float = 10.0, retries: int = 4, backoff_s: float = 0.2,
                 max_backoff_s: float = 5.0) -> None:
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.errors: Counter[str] = Counter()
        self._lock = threading.Lock()

    def count(self, reason: str) -> None:
        with self._lock:
            self.errors[reason] += 1

    def __call__(self, fn, *args, **kwargs):
        """`fn(*args, **kwargs)` with `_request_timeout` set, retried on transient errors."""
        import urllib3
        from kubernetes.client.exceptions import ApiException

        kwargs.setdefault("_request_timeout", self.timeout_s)
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                return fn(*args, **kwargs)
            except ApiException as err:
                if err.status not in TRANSIENT_STATUSES:
                    raise
                reason, last = f"http_{err.status}", err
            except (urllib3.exceptions.HTTPError, OSError) as err:
                reason, last = type(err).__name__, err
            self.count(reason)
            if attempt == self.retries:
                break
            logger.warning("kubernetes API %s (%s); retry %d/%d in %.1fs",
                           getattr(fn, "__name__", "call"), reason, attempt + 1, self.retries,
                           delay)
            time.sleep(delay * (1 + random.random() / 2))  # nosec B311 # jitter, not security
            delay = min(delay * 2, self.max_backoff_s)
        raise ApiUnavailable(f"kubernetes API {getattr(fn, '__name__', 'call')} failed "
                             f"{self.retries + 1} times: {last}") from last


class PodWatch:
    """A cache of the pods matching `label_selector` in `namespace`, fed by a watch."""

    def __init__(self, core, namespace: str, label_selector: str, call: KubeCaller,
                 resync_s: float = 30.0) -> None:
        self.core = core
        self.namespace = namespace
        self.label_selector = label_selector
        self.call = call
        self.resync_s = resync_s
        self.synced = threading.Event()
        self._pods: dict[str, object] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watch = None

    def start(self) -> PodWatch:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pod-watch", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()

    def get(self, name: str):
        with self._lock:
            return self._pods.get(name)

    def pods(self) -> list:
        with self._lock:
            return list(self._pods.values())

    def _relist(self) -> str:
        listing = self.call(self.core.list_namespaced_pod, self.namespace,
                            label_selector=self.label_selector)
        with self._lock:
            self._pods = {p.metadata.name: p for p in listing.items}
        self.synced.set()
        return listing.metadata.resource_version

    def _run(self) -> None:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        delay = 0.5
        while not self._stop.is_set():
            try:
                version = self._relist()
                self._watch = watch.Watch()
                # The server ends the watch after resync_s; the loop then relists.
                for event in self._watch.stream(
                        self.core.list_namespaced_pod, self.namespace,
                        label_selector=self.label_selector, resource_version=version,
                        timeout_seconds=max(1, int(self.resync_s)),
                        _request_timeout=self.resync_s + self.call.timeout_s):
                    self._apply(event["type"], event["object"])
                    if self._stop.is_set():
                        return
                delay = 0.5
            except ApiException as err:
                reason = "watch_expired" if err.status == 410 else f"watch_http_{err.status}"
                self.call.count(reason)
                if err.status != 410:
                    self._stop.wait(delay)
                    delay = min(delay * 2, 10.0)
            except Exception as err:  # noqa: BLE001 - the watch outlives any API trouble
                self.call.count(f"watch_{type(err).__name__}")
                logger.warning("pod watch interrupted (%s: %s); relisting", type(err).__name__,
                               err)
                self._stop.wait(delay)
                delay = min(delay * 2, 10.0)

    def _apply(self, kind: str, pod) -> None:
        name = pod.metadata.name
        with self._lock:
            if kind == "DELETED":
                current = self._pods.get(name)
                if current is not None and current.metadata.uid == pod.metadata.uid:
                    del self._pods[name]
            elif kind in ("ADDED", "MODIFIED"):
                self._pods[name] = pod
