"""The object store behind the strict Kubernetes API test server
(`kube_apiserver.py`): the served resources, one resourceVersion counter, the
verbs with the API server's preconditions and answers (a namespaced object is
created only in a namespace that exists, as the NamespaceLifecycle admission
plugin enforces), a bounded event history and the open watches, all behind
one lock. Cluster-scoped objects (namespaces) are stored under namespace ""."""

from __future__ import annotations

import collections
import copy
import random
import threading
import time
import uuid
from dataclasses import dataclass, field

from tests.integration.kube_apimachinery import (ApiError, fields_match, json_patch,
                                                 labels_match, merge_patch, status_object,
                                                 strategic_merge_patch, validate)

OPTIMISTIC_LOCK = ("the object has been modified; please apply your changes to the latest "
                   "version and try again")
_PATCHES = {"application/merge-patch+json": merge_patch,
            "application/strategic-merge-patch+json": strategic_merge_patch,
            "application/json-patch+json": json_patch}


@dataclass(frozen=True)
class Resource:
    plural: str
    kind: str
    group: str
    status: bool              # a /status subresource; other writes keep status
    unconditional_update: bool  # a PUT may omit metadata.resourceVersion
    create_on_update: bool    # a PUT of a missing object creates it
    fields: tuple[str, ...]   # field selector labels
    version: str = "v1"
    namespaced: bool = True

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def qualified(self) -> str:
        return f"{self.plural}.{self.group}" if self.group else self.plural

    def details(self, name: str, **extra) -> dict:
        return {"name": name, **({"group": self.group} if self.group else {}),
                "kind": self.plural, **extra}

    def not_found(self, name: str) -> ApiError:
        return ApiError(404, f'{self.qualified} "{name}" not found', details=self.details(name))

    def conflict(self, name: str, why: str = OPTIMISTIC_LOCK) -> ApiError:
        return ApiError(409, f'Operation cannot be fulfilled on {self.qualified} "{name}": {why}',
                        details=self.details(name))


_META = ("metadata.name", "metadata.namespace")
RESOURCES = {
    "pods": Resource("pods", "Pod", "", True, True, False,
                     _META + ("spec.nodeName", "spec.restartPolicy", "status.phase",
                              "status.podIP")),
    "leases": Resource("leases", "Lease", "coordination.k8s.io", False, False, True, _META),
    "namespaces": Resource("namespaces", "Namespace", "", False, True, False,
                           ("metadata.name", "status.phase"), namespaced=False),
}
NAMESPACES = RESOURCES["namespaces"]
# What every cluster starts with.
SYSTEM_NAMESPACES = ("default", "kube-node-lease", "kube-public", "kube-system")


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass
class _Event:
    rv: int
    type: str
    plural: str
    namespace: str
    old: dict | None   # the object before the change (None for a create)
    new: dict          # the object after it (for a delete: as deleted, with the new rv)


@dataclass(eq=False)
class _Watcher:
    plural: str
    namespace: str | None
    labels: list
    fields: list
    cursor: int                # every event up to this resourceVersion has been seen
    dropped: bool = field(default=False)

    def matches(self, obj: dict | None) -> bool:
        return obj is not None and labels_match(self.labels, obj["metadata"].get("labels")) \
            and fields_match(self.fields, obj)

    def translate(self, ev: _Event) -> tuple[str, dict] | None:
        """The event as this watcher sees it through its selectors."""
        if ev.plural != self.plural or self.namespace not in (None, ev.namespace):
            return None
        was, now = self.matches(ev.old), ev.type != "DELETED" and self.matches(ev.new)
        if now:
            return ("MODIFIED" if was else "ADDED"), ev.new
        return ("DELETED", ev.new) if was else None


class ResourceStore:
    """The objects, the resourceVersion counter, the event history and the open
    watches, behind one lock. Every verb raises ApiError as the API server answers."""

    def __init__(self, history: int) -> None:
        self.cond = threading.Condition()
        # As in etcd, an empty store is at version 1, so no list ever answers "0" (which
        # a watch reads as "any version"). floor: the newest version dropped from history.
        self.rv, self.floor = 1, 0
        self.objects: dict[tuple[str, str, str], dict] = {}
        self.events: collections.deque[_Event] = collections.deque(maxlen=history)
        self.logs: dict[tuple[str, str], str] = {}
        self.watchers: set[_Watcher] = set()
        self.closing = False

    def _commit(self, res: Resource, kind: str, old: dict | None, new: dict) -> dict:
        self.rv += 1
        new["metadata"]["resourceVersion"] = str(self.rv)
        ns, name = new["metadata"].get("namespace", ""), new["metadata"]["name"]
        if kind == "DELETED":
            del self.objects[(res.plural, ns, name)]
            self.logs.pop((ns, name), None)
        else:
            self.objects[(res.plural, ns, name)] = new
        if len(self.events) == self.events.maxlen:
            self.floor = self.events[0].rv
        self.events.append(_Event(self.rv, kind, res.plural, ns, old, copy.deepcopy(new)))
        self.cond.notify_all()
        return copy.deepcopy(new)

    def _existing(self, res: Resource, ns: str, name: str) -> dict:
        obj = self.objects.get((res.plural, ns, name))
        if obj is None:
            raise res.not_found(name)
        return obj

    def get(self, res: Resource, ns: str, name: str) -> dict:
        with self.cond:
            return copy.deepcopy(self._existing(res, ns, name))

    def list(self, res: Resource, ns: str | None, labels: list, fields: list) -> dict:
        with self.cond:
            items = [copy.deepcopy(obj) for (plural, obj_ns, _), obj
                     in sorted(self.objects.items())
                     if plural == res.plural and ns in (None, obj_ns)
                     and labels_match(labels, obj["metadata"].get("labels"))
                     and fields_match(fields, obj)]
            rv = str(self.rv)
        for item in items:  # list items carry no kind/apiVersion
            item.pop("kind", None)
            item.pop("apiVersion", None)
        return {"kind": f"{res.kind}List", "apiVersion": res.api_version,
                "metadata": {"resourceVersion": rv}, "items": items}

    @staticmethod
    def _check_body(res: Resource, ns: str, body, name: str | None = None) -> dict:
        if not isinstance(body, dict) or not isinstance(body.get("metadata", {}), dict):
            raise ApiError(400, f"the body is not a {res.kind} object")
        if body.get("kind") not in (None, "", res.kind) or \
                body.get("apiVersion") not in (None, "", res.api_version):
            raise ApiError(400, f"the API version/kind in the data ({body.get('apiVersion')}, "
                           f"{body.get('kind')}) does not match the expected "
                           f"({res.api_version}, {res.kind})")
        meta = body.setdefault("metadata", {})
        if not res.namespaced:
            meta.pop("namespace", None)  # as the API server clears it on cluster-scoped kinds
        elif meta.get("namespace") not in (None, "", ns):
            raise ApiError(400, "the namespace of the provided object does not match the "
                           "namespace sent on the request")
        if name is not None and meta.get("name") not in (None, "", name):
            raise ApiError(400, f"the name of the object ({meta.get('name')}) does not match "
                           f"the name on the URL ({name})")
        return meta

    def create(self, res: Resource, ns: str, body) -> dict:
        meta = self._check_body(res, ns, body)
        if meta.get("resourceVersion"):
            raise ApiError(500, "resourceVersion should not be set on objects to be created",
                           reason="Unknown")
        with self.cond:
            return self._create(res, ns, copy.deepcopy(body))

    def _create(self, res: Resource, ns: str, obj: dict) -> dict:
        meta = obj["metadata"]
        if res.namespaced and (NAMESPACES.plural, "", ns) not in self.objects:
            # NamespaceLifecycle admission, before anything else is looked at.
            raise NAMESPACES.not_found(ns)
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise ApiError(422, f"{res.kind}.{res.version} is invalid: metadata.name: "
                               "Required value: name or generateName is required")
            meta["name"] = meta["generateName"] + "".join(
                random.choices("bcdfghjklmnpqrstvwxz2456789", k=5))  # nosec B311
        if (res.plural, ns, meta["name"]) in self.objects:
            raise ApiError(409, f'{res.qualified} "{meta["name"]}" already exists',
                           reason="AlreadyExists", details=res.details(meta["name"]))
        obj.update(kind=res.kind, apiVersion=res.api_version)
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now())
        if res.namespaced:
            meta["namespace"] = ns
        meta.pop("resourceVersion", None)
        if res is NAMESPACES:  # what the API server and the namespace controller set
            meta.setdefault("labels", {})["kubernetes.io/metadata.name"] = meta["name"]
            obj["spec"] = {"finalizers": ["kubernetes"]}
            obj["status"] = {"phase": "Active"}
        validate(res.kind, obj)
        return self._commit(res, "ADDED", None, obj)

    def replace(self, res: Resource, ns: str, name: str, body,
                status: bool = False) -> tuple[dict, bool]:
        """A PUT: the stored object and whether it was created."""
        self._check_body(res, ns, body, name)
        with self.cond:
            if (res.plural, ns, name) not in self.objects and res.create_on_update and not status:
                body["metadata"]["name"] = name
                return self._create(res, ns, copy.deepcopy(body)), True
            existing = self._existing(res, ns, name)
            return self._update(res, existing, copy.deepcopy(body), status), False

    def patch(self, res: Resource, ns: str, name: str, content_type: str, patch,
              status: bool = False) -> dict:
        apply = _PATCHES.get(content_type)
        if apply is None:
            raise ApiError(415, f"the body of the request was in an unknown format - accepted "
                           f"media types include: {', '.join(_PATCHES)}")
        if apply is not json_patch and not isinstance(patch, dict):
            raise ApiError(400, "a merge patch must be a JSON object")
        with self.cond:
            existing = self._existing(res, ns, name)
            patched = apply(copy.deepcopy(existing), patch)
            self._check_body(res, ns, patched, name)
            return self._update(res, existing, patched, status)

    def _update(self, res: Resource, existing: dict, new: dict, status: bool) -> dict:
        """A write of `new` over `existing`: the resourceVersion precondition, immutable
        uid, status kept by main-resource writes, validation, and no-op detection."""
        meta, old_meta = new["metadata"], existing["metadata"]
        name, given = old_meta["name"], meta.get("resourceVersion") or ""
        if not given and not res.unconditional_update:
            raise ApiError(422, f'{res.kind} "{name}" is invalid: metadata.resourceVersion: '
                           "Invalid value: 0x0: must be specified for an update")
        if given and not given.isdigit():
            raise ApiError(400, f"invalid resourceVersion {given!r}")
        if given and given != old_meta["resourceVersion"]:
            raise res.conflict(name)
        if meta.get("uid") not in (None, "", old_meta["uid"]):
            raise ApiError(422, f'{res.kind} "{name}" is invalid: metadata.uid: Invalid value: '
                           f'"{meta["uid"]}": field is immutable')
        if status:
            result = copy.deepcopy(existing)
            result.pop("status", None)
            if new.get("status") is not None:
                result["status"] = new["status"]
        else:
            result = new
            result.update(kind=res.kind, apiVersion=res.api_version)
            for key in ("name", "namespace", "uid", "creationTimestamp", "resourceVersion"):
                if key in old_meta:
                    meta[key] = old_meta[key]
            if res.status:
                result.pop("status", None)
                if "status" in existing:
                    result["status"] = copy.deepcopy(existing["status"])
        validate(res.kind, result)
        if result == existing:
            return copy.deepcopy(existing)
        return self._commit(res, "MODIFIED", existing, result)

    def delete(self, res: Resource, ns: str, name: str, options: dict | None) -> dict:
        pre = (options if isinstance(options, dict) else {}).get("preconditions") or {}
        with self.cond:
            existing = self._existing(res, ns, name)
            for key, label in (("uid", "UID"), ("resourceVersion", "ResourceVersion")):
                if pre.get(key) and pre[key] != existing["metadata"][key]:
                    raise res.conflict(name, f"Precondition failed: {label} in precondition: "
                                       f"{pre[key]}, {label} in object meta: "
                                       f"{existing['metadata'][key]}")
            if res is NAMESPACES:
                return self._delete_namespace(existing)
            return self._commit(res, "DELETED", existing, copy.deepcopy(existing))

    def _delete_namespace(self, existing: dict) -> dict:
        """Simplified: the namespace and everything in it go at once (each with a
        DELETED event), where a cluster marks it Terminating and its namespace
        controller deletes the contents first. Answers the namespace as the API
        server does, Terminating."""
        name = existing["metadata"]["name"]
        for (plural, ns, obj_name), obj in sorted(self.objects.items()):
            if ns == name:
                self._commit(RESOURCES[plural], "DELETED", obj, copy.deepcopy(obj))
        gone = self._commit(NAMESPACES, "DELETED", existing, copy.deepcopy(existing))
        gone["metadata"]["deletionTimestamp"] = _now()
        gone["status"] = {"phase": "Terminating"}
        return gone

    def read_log(self, ns: str, name: str, query: dict) -> str:
        with self.cond:
            pod = self._existing(RESOURCES["pods"], ns, name)
            text = self.logs.get((ns, name), "")
        names = [c.get("name") for c in pod.get("spec", {}).get("containers", [])]
        container = query.get("container")
        if container and container not in names:
            raise ApiError(400, f"container {container} is not valid for pod {name}")
        if not container and len(names) > 1:
            raise ApiError(400, f"a container name must be specified for pod {name}, "
                           f"choose one of: [{' '.join(names)}]")
        if query.get("tailLines") is not None:
            tail = int_param(query, "tailLines")
            text = "".join(text.splitlines(keepends=True)[-tail:]) if tail > 0 else ""
        if query.get("limitBytes") is not None:
            text = text.encode()[:int_param(query, "limitBytes")].decode(errors="ignore")
        return text

    # --- watches ---

    def open_watch(self, res: Resource, ns: str | None, labels: list, fields: list,
                   version: str | None) -> tuple[_Watcher | None, list, dict | None]:
        """A registered watcher and its first events, or the 410 Status of a too old version."""
        with self.cond:
            if version in (None, "", "0"):
                watcher = _Watcher(res.plural, ns, labels, fields, self.rv)
                first = [("ADDED", copy.deepcopy(obj)) for (plural, obj_ns, _), obj
                         in sorted(self.objects.items())
                         if plural == res.plural and ns in (None, obj_ns) and watcher.matches(obj)]
            else:
                if not version.isdigit():
                    raise ApiError(400, f"invalid resourceVersion {version!r}")
                if int(version) < self.floor:
                    return None, [], self.expired(int(version))
                watcher, first = _Watcher(res.plural, ns, labels, fields, int(version)), []
            self.watchers.add(watcher)
            return watcher, first, None

    def expired(self, version: int) -> dict:
        return status_object(410, f"too old resource version: {version} ({self.floor + 1})",
                             "Expired")

    def next_events(self, watcher: _Watcher, wait_s: float) -> list | str:
        """Events after the watcher's cursor, waiting up to `wait_s` for one; or
        "dropped", "closing" or "expired"."""
        with self.cond:
            for _ in range(2):
                if watcher.dropped or self.closing:
                    return "dropped" if watcher.dropped else "closing"
                if watcher.cursor < self.floor:
                    return "expired"
                if self.events and self.events[-1].rv > watcher.cursor:
                    out = [t for ev in self.events if ev.rv > watcher.cursor
                           if (t := watcher.translate(ev))]
                    watcher.cursor = self.events[-1].rv
                    return out
                self.cond.wait(wait_s)
            return []

    def close_watch(self, watcher: _Watcher) -> None:
        with self.cond:
            self.watchers.discard(watcher)


def int_param(query: dict, key: str) -> int:
    try:
        return int(query[key])
    except ValueError:
        raise ApiError(400, f"{key}: invalid integer {query[key]!r}") from None


