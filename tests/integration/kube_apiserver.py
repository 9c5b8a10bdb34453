"""A strict Kubernetes API test server: a real HTTP server on a loopback port,
in a daemon thread, that the official `kubernetes` client talks to.

Tests against it exercise our HTTP calls against the Kubernetes API conventions,
not a real cluster: no controllers, kubelet, admission (but namespace
lifecycle), authentication or server-side apply run here. For core/v1 pods
(with /status and /log), core/v1 namespaces and coordination.k8s.io/v1 leases
it keeps the conventions our code relies on:

- one global resourceVersion, bumped by every write; a write that changes
  nothing is a no-op and bumps nothing, as in etcd;
- optimistic concurrency: a PUT, or a merge, strategic-merge or JSON patch whose
  result carries a resourceVersion other than the stored one, is 409 Conflict;
  a PUT of a lease without one is 422 (leases allow no unconditional update);
  a PUT of a missing lease creates it, of a missing pod is 404;
- create: uid, creationTimestamp, namespace, generateName; 409 AlreadyExists;
  a resourceVersion in the body is refused as the API server refuses it (500);
- namespaces: cluster-scoped, served at /api/v1/namespaces[/name]; the server
  starts with default, kube-node-lease, kube-public and kube-system, as a
  cluster does; a namespaced object created (or PUT into being) in a namespace
  that does not exist is 404 NotFound `namespaces "x" not found`, as the
  NamespaceLifecycle admission plugin answers;
- status: writes to a pod leave its status alone, writes to /status change only status;
- delete at once (no finalizers, no grace period), with uid/resourceVersion
  preconditions (409), and a DELETED event;
- label selectors (every operator, parsed strictly: 400), field selectors;
- watches: newline-delimited JSON events over chunked HTTP, from a
  resourceVersion within a bounded history (older: one ERROR event, 410
  Expired), synthetic ADDED events without one, and per-watcher selector
  filtering in which an object that stops matching arrives as DELETED;
- errors are `Status` objects with the reason and code the API server uses.

Simplified: a pod created over HTTP keeps the status it was sent (the API server
resets it to Pending); objects are stored as sent, without defaulting,
re-encoding, managedFields or generation; pod spec immutability is not enforced;
reads and lists always answer the latest state (resourceVersion, limit and
continue are ignored); watch bookmarks and `follow` on logs are not modelled;
a deleted namespace goes at once with everything in it (no Terminating phase
to wait through), and namespaces have no /status or /finalize;
a watch from a resourceVersion newer than the current one waits for it rather
than failing. Selector and patch details are in `kube_apimachinery.py`; the
store, verbs and watch history in `kube_store.py`.

Faults for tests: `fail()` answers matching requests with an error Status,
`stall()` delays them, `drop_watches()` cuts open watch streams.
"""

from __future__ import annotations

import copy
import json
import re
import select
import socket
import socketserver
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from tests.integration.kube_apimachinery import (REASONS, ApiError, parse_field_selector,
                                                 parse_label_selector, status_object)
from tests.integration.kube_store import (RESOURCES, SYSTEM_NAMESPACES, Resource, ResourceStore,
                                          int_param)

__all__ = ["ApiError", "KubeApiServer", "namespace", "worker_pod"]

_TRUE = {"1", "t", "T", "true", "True", "TRUE"}
_PATH = re.compile(r"/(?:api/(?P<core>v1)|apis/(?P<group>[^/]+)/(?P<version>[^/]+))"
                   r"(?:/namespaces/(?P<ns>[^/]+))?/(?P<plural>[^/]+)(?:/(?P<name>[^/]+))?"
                   r"(?:/(?P<sub>[^/]+))?/?")


def _discovery() -> dict[str, dict]:
    def resources(group: str) -> dict:
        listed = []
        for res in RESOURCES.values():
            if res.group == group:
                listed.append({"name": res.plural, "singularName": res.kind.lower(),
                               "namespaced": res.namespaced, "kind": res.kind,
                               "verbs": ["create", "delete", "get", "list", "patch", "update",
                                         "watch"]})
                listed += [{"name": f"{res.plural}/{sub}", "singularName": "",
                            "namespaced": res.namespaced, "kind": res.kind,
                            "verbs": verbs} for sub, verbs in
                           ((("status", ["get", "patch", "update"]), ("log", ["get"]))
                            if res.status else ())]
        return {"kind": "APIResourceList", "apiVersion": "v1",
                "groupVersion": f"{group}/v1" if group else "v1", "resources": listed}

    coordination = {"groupVersion": "coordination.k8s.io/v1", "version": "v1"}
    return {
        "/version": {"major": "1", "minor": "33", "gitVersion": "v1.33.0",
                     "platform": "linux/amd64"},
        "/api": {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []},
        "/apis": {"kind": "APIGroupList", "apiVersion": "v1", "groups": [
            {"name": "coordination.k8s.io", "versions": [coordination],
             "preferredVersion": coordination}]},
        "/api/v1": resources(""),
        "/apis/coordination.k8s.io/v1": resources("coordination.k8s.io"),
    }


_DISCOVERY = _discovery()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def setup(self) -> None:
        super().setup()
        with self.server.api._lock:
            self.server.api._connections.add(self.connection)

    def finish(self) -> None:
        try:
            super().finish()
        except OSError:
            pass
        with self.server.api._lock:
            self.server.api._connections.discard(self.connection)


for _method in ("GET", "POST", "PUT", "PATCH", "DELETE"):
    setattr(_Handler, f"do_{_method}", lambda self, m=_method: self.server.api._handle(self, m))


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64

    def server_bind(self) -> None:  # no reverse DNS lookup of the address
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]


class KubeApiServer:
    """`with KubeApiServer() as api:` serves on `api.url` until the block ends."""

    def __init__(self, history: int = 1000) -> None:
        self.store = ResourceStore(history)
        for name in SYSTEM_NAMESPACES:
            self.create(namespace(name))
        self.requests: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._faults: list[list] = []   # [method, path regex, status, count left]
        self._stalls: list[list] = []   # [seconds, method, path regex, count left or None]
        self._release = threading.Event()
        self._connections: set[socket.socket] = set()
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.url = ""

    # --- lifecycle ---

    def start(self) -> "KubeApiServer":
        self._httpd = _HTTPServer(("127.0.0.1", 0), _Handler)
        self._httpd.api = self
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.05,),
                                        name="kube-apiserver", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self.store.cond:
            self.store.closing = True
            self.store.cond.notify_all()
        self.unstall()
        if self._httpd is not None:
            self._httpd.shutdown()
            with self._lock:
                connections = list(self._connections)
            for conn in connections:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self._httpd.server_close()
            self._thread.join(5)
            self._httpd = None

    def __enter__(self) -> "KubeApiServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def client(self):
        """A `kubernetes.client.ApiClient` for this server."""
        from kubernetes import client

        config = client.Configuration()
        config.host = self.url
        return client.ApiClient(config)

    def write_kubeconfig(self, path, namespace: str = "ml") -> None:
        """A kubeconfig (JSON, which is YAML) whose current context reaches this server."""
        config = {"apiVersion": "v1", "kind": "Config", "current-context": "reflow-test",
                  "clusters": [{"name": "reflow-test", "cluster": {
                      "server": self.url, "insecure-skip-tls-verify": True}}],
                  "users": [{"name": "reflow-test", "user": {"token": "reflow-test-token"}}],
                  "contexts": [{"name": "reflow-test", "context": {
                      "cluster": "reflow-test", "user": "reflow-test", "namespace": namespace}}]}
        with open(path, "w") as f:
            json.dump(config, f, indent=2)

    # --- direct store access (as the kubelet or a controller would write) ---

    def create(self, obj: dict) -> dict:
        """Store `obj` (a Pod, Lease or Namespace, status included) as a create would;
        a resourceVersion it carries is dropped. Like any create, it needs the
        object's namespace to exist (ApiError 404)."""
        res = next((r for r in RESOURCES.values() if r.kind == obj.get("kind")), None)
        if res is None:
            raise ValueError(f"kind {obj.get('kind')!r} is not served")
        body = copy.deepcopy(obj)
        body.setdefault("metadata", {}).pop("resourceVersion", None)
        ns = (body["metadata"].get("namespace") or "default") if res.namespaced else ""
        return self.store.create(res, ns, body)

    def get(self, resource: str, namespace: str, name: str) -> dict:
        """The stored object (namespace "" for a namespace); ApiError 404 when there
        is none."""
        return self.store.get(RESOURCES[resource], namespace, name)

    def update_status(self, namespace: str, pod_name: str, status_patch: dict) -> dict:
        """Merge `status_patch` into the pod's status (RFC 7386), as the kubelet does."""
        return self.store.patch(RESOURCES["pods"], namespace, pod_name,
                                "application/merge-patch+json", {"status": status_patch}, True)

    def delete(self, resource: str, namespace: str, name: str) -> dict:
        """Delete at once (namespace "" for a namespace, which takes its objects along)."""
        return self.store.delete(RESOURCES[resource], namespace, name, None)

    def set_log(self, namespace: str, pod_name: str, text: str) -> None:
        with self.store.cond:
            self.store.logs[(namespace, pod_name)] = text

    @property
    def resource_version(self) -> str:
        with self.store.cond:
            return str(self.store.rv)

    @property
    def open_watches(self) -> int:
        with self.store.cond:
            return len(self.store.watchers)

    # --- faults ---

    def fail(self, method: str | None = None, path: str = ".*", status: int = 500,
             count: int = 1) -> None:
        """Answer the next `count` requests whose method matches (None: any) and whose
        URL path matches the regex `path` with a `status` Status, without carrying them
        out. A later call for the same method and path replaces the rule; count=0 ends it."""
        method = method.upper() if method else None
        with self._lock:
            self._faults = [f for f in self._faults if (f[0], f[1].pattern) != (method, path)]
            if count > 0:
                self._faults.append([method, re.compile(path), status, count])

    def stall(self, seconds: float, method: str | None = None, path: str = ".*",
              count: int | None = None) -> None:
        """Delay matching requests by `seconds` before handling them (then they are
        carried out, as a slow server would); count None: until `unstall()`."""
        with self._lock:
            self._stalls.append([seconds, method.upper() if method else None, re.compile(path),
                                 count])

    def unstall(self) -> None:
        """Stop stalling, and let every stalled request go on at once."""
        with self._lock:
            self._stalls.clear()
            release, self._release = self._release, threading.Event()
        release.set()

    def drop_watches(self) -> None:
        """Cut every open watch: its connection closes without a final chunk."""
        with self.store.cond:
            for watcher in self.store.watchers:
                watcher.dropped = True
            self.store.cond.notify_all()

    def clear_requests(self) -> None:
        with self._lock:
            self.requests.clear()

    def _stall(self, method: str, path: str) -> None:
        with self._lock:
            stall = next((s for s in self._stalls if s[1] in (None, method) and s[2].search(path)),
                         None)
            if stall is None:
                return
            if stall[3] is not None:
                stall[3] -= 1
                if stall[3] <= 0:
                    self._stalls.remove(stall)
            release = self._release
        release.wait(stall[0])

    def _fault(self, method: str, path: str) -> ApiError | None:
        with self._lock:
            fault = next((f for f in self._faults if f[0] in (None, method) and f[1].search(path)),
                         None)
            if fault is None:
                return None
            fault[3] -= 1
            if fault[3] <= 0:
                self._faults.remove(fault)
        status = fault[2]
        retry = {"Retry-After": "1"} if status == 429 else {}
        return ApiError(status, f"injected fault: {REASONS.get(status, status)}",
                        details={"retryAfterSeconds": 1} if retry else None, headers=retry)

    # --- HTTP ---

    def _handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        parts = urlsplit(h.path)
        query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        raw = h.rfile.read(int(h.headers.get("Content-Length") or 0))
        with self._lock:
            self.requests.append((method, h.path))
        try:
            try:
                self._stall(method, parts.path)  # a stalled request may then fail as well
                fault = self._fault(method, parts.path)
                if fault is not None:
                    raise fault
                self._route(h, method, parts.path, query, raw)
            except ApiError as err:
                self._send(h, err.code, err.status(), err.headers)
            except Exception as err:  # noqa: BLE001 - answered as the API server would
                if isinstance(err, OSError):
                    raise
                self._send(h, 500, status_object(500, f"{type(err).__name__}: {err}",
                                                 "InternalError"))
        except OSError:  # the client went away
            h.close_connection = True

    @staticmethod
    def _send(h: BaseHTTPRequestHandler, code: int, payload, headers: dict | None = None,
              content_type: str = "application/json") -> None:
        data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
        h.send_response(code)
        h.send_header("Content-Type", content_type)
        h.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            h.send_header(key, value)
        h.end_headers()
        h.wfile.write(data)

    def _route(self, h, method: str, path: str, query: dict, raw: bytes) -> None:
        if method == "GET" and path.rstrip("/") in _DISCOVERY:
            return self._send(h, 200, _DISCOVERY[path.rstrip("/")])
        match = _PATH.fullmatch(path)
        res = RESOURCES.get(match["plural"]) if match else None
        if res is None or (match["core"] and res.group) or (match["group"] and (
                match["group"], match["version"]) != (res.group, res.version)) \
                or (match["name"] and not match["ns"] and res.namespaced) \
                or (match["ns"] and not res.namespaced) \
                or match["sub"] not in (None, *(("status", "log") if res.status else ())):
            raise ApiError(404, "the server could not find the requested resource")
        ns, name, sub = match["ns"], match["name"], match["sub"]
        if not res.namespaced:
            ns = ""
        try:
            body = json.loads(raw) if raw else None
        except ValueError as err:
            raise ApiError(400, f"the request body is not JSON: {err}") from None
        verbs = {(None, "GET"), (None, "POST")} if name is None else \
            {(None, "GET"), (None, "PUT"), (None, "PATCH"), (None, "DELETE"), ("status", "GET"),
             ("status", "PUT"), ("status", "PATCH"), ("log", "GET")}
        if (sub, method) not in verbs or (method == "POST" and not ns and res.namespaced):
            raise ApiError(405, "the server does not allow this method on the requested resource")
        if name is None and method == "GET":
            labels = parse_label_selector(query.get("labelSelector", ""))
            fields = parse_field_selector(query.get("fieldSelector", ""), res.fields)
            scope = ns if res.namespaced else None
            if query.get("watch") in _TRUE:
                return self._watch(h, res, scope, labels, fields, query)
            return self._send(h, 200, self.store.list(res, scope, labels, fields))
        if method == "POST":
            return self._send(h, 201, self.store.create(res, ns, body))
        if sub == "log":
            return self._send(h, 200, self.store.read_log(ns, name, query),
                              content_type="text/plain")
        if method == "GET":
            return self._send(h, 200, self.store.get(res, ns, name))
        if method == "PUT":
            obj, created = self.store.replace(res, ns, name, body, status=sub == "status")
            return self._send(h, 201 if created else 200, obj)
        if method == "PATCH":
            content_type = (h.headers.get("Content-Type") or "").split(";")[0].strip()
            return self._send(h, 200, self.store.patch(res, ns, name, content_type, body,
                                                       status=sub == "status"))
        deleted = self.store.delete(res, ns, name, body)
        if res.plural in ("pods", "namespaces"):
            return self._send(h, 200, deleted)
        self._send(h, 200, {"kind": "Status", "apiVersion": "v1", "metadata": {},
                            "status": "Success", "details": res.details(
                                name, uid=deleted["metadata"]["uid"])})

    def _watch(self, h, res: Resource, ns: str | None, labels: list, fields: list,
               query: dict) -> None:
        timeout = int_param(query, "timeoutSeconds") if query.get("timeoutSeconds") else None
        deadline = time.monotonic() + timeout if timeout else None
        watcher, first, error = self.store.open_watch(res, ns, labels, fields,
                                                      query.get("resourceVersion"))
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()

        def send(kind: str, obj: dict) -> None:
            line = json.dumps({"type": kind, "object": obj}).encode() + b"\n"
            h.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))

        try:
            if error is not None:
                send("ERROR", error)
            else:
                for kind, obj in first:
                    send(kind, obj)
                while deadline is None or time.monotonic() < deadline:
                    left = 0.2 if deadline is None else deadline - time.monotonic()
                    wait = max(0.0, min(0.2, left))
                    got = self.store.next_events(watcher, wait)
                    if got == "dropped":
                        h.close_connection = True
                        h.connection.shutdown(socket.SHUT_RDWR)
                        return
                    if got == "closing":
                        break
                    if got == "expired":
                        send("ERROR", self.store.expired(watcher.cursor))
                        break
                    for kind, obj in got:
                        send(kind, obj)
                    if self._client_gone(h.connection):
                        h.close_connection = True
                        return
            h.wfile.write(b"0\r\n\r\n")
        finally:
            if watcher is not None:
                self.store.close_watch(watcher)

    @staticmethod
    def _client_gone(conn: socket.socket) -> bool:
        try:
            readable, _, _ = select.select([conn], [], [], 0)
            return bool(readable) and conn.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True


def namespace(name: str) -> dict:
    """A Namespace to create (`api.create(namespace("ml"))`) before its objects."""
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}


def worker_pod(name: str, ip: str = "127.0.0.1", ready: bool = True,
               labels: dict[str, str] | None = None, restarts: int = 0,
               namespace: str = "ml", subdomain: str | None = None) -> dict:
    """A Running worker pod of release `rl`, as the StatefulSet and kubelet leave it.
    `subdomain`: the StatefulSet's headless Service, which gives the pod a DNS name
    (hostname = its name)."""
    spec: dict = {"containers": [{"name": "worker", "image": "reflow"}]}
    if subdomain:
        spec.update(hostname=name, subdomain=subdomain)
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace,
                     "labels": labels if labels is not None else
                     {"app.kubernetes.io/instance": "rl", "app.kubernetes.io/component": "worker"}},
        "spec": spec,
        "status": {"phase": "Running", "podIP": ip,
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                   "containerStatuses": [{"name": "worker", "ready": ready,
                                          "restartCount": restarts, "image": "reflow",
                                          "imageID": "", "state": {}}]},
    }
