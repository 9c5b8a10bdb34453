"""ASGI middleware of the REST API: the bearer token, a request-body size cap,
a JSON-body check and request metrics. Plain ASGI so that each sees every request, including the
ones the routes reject."""

from __future__ import annotations

import hmac
import json
import math
import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.routing import Match


class BearerAuth:
    """The API token on every request under `prefix`, checked before anything of
    the request is read: a caller without it gets 401, never a validation error
    that tells it about the body it sent. (The routes' own dependency documents
    the scheme in the OpenAPI schema and checks again.)"""

    CHALLENGE = b'Bearer realm="reflow"'

    def __init__(self, app, token: str, prefix: str = "/v1") -> None:
        self.app = app
        self.token = token.encode()
        self.prefix = prefix

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not self.token or not scope["path"].startswith(self.prefix):
            return await self.app(scope, receive, send)
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, presented = header.partition(b" ")
        if scheme.lower() != b"bearer" or not presented.strip():
            return await _reject(send, 401, "missing bearer token; send 'Authorization: "
                                            "Bearer <token>'", [(b"www-authenticate",
                                                                 self.CHALLENGE)])
        if not hmac.compare_digest(presented.strip(), self.token):
            return await _reject(send, 401, "invalid bearer token", [
                (b"www-authenticate", self.CHALLENGE + b', error="invalid_token"')])
        return await self.app(scope, receive, send)


class _TooLarge(Exception):
    pass


async def _read_body(receive, max_bytes: int | None = None) -> bytes | None:
    """The whole request body (None if the client went away); _TooLarge past
    `max_bytes`."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if max_bytes is not None and size > max_bytes:
            raise _TooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replaying(body: bytes, receive):
    """A `receive` that hands the app `body` (already read) first, then the
    connection's own messages (a disconnect)."""
    sent = False

    async def replay():
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


async def _reject(send, status: int, detail: str, headers: list | None = None,
                  errors: list[dict] | None = None) -> None:
    payload = json.dumps({"detail": detail, **({"errors": errors} if errors else {})}).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
        *(headers or []),
    ]})
    await send({"type": "http.response.body", "body": payload})


class BodySizeLimit:
    """Answer 413 to any body over `max_body_bytes`, whether the client declared
    its length or streams it chunked; the app never sees such a body."""

    def __init__(self, app, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            try:
                too_big = int(declared) > self.max_body_bytes
            except ValueError:
                return await _reject(send, 400, "content-length: not an integer")
            if too_big:
                return await self._too_large(send)
        # Read the body up front (it is at most max_body_bytes) and replay it.
        try:
            body = await _read_body(receive, self.max_body_bytes)
        except _TooLarge:
            return await self._too_large(send)
        if body is not None:
            await self.app(scope, _replaying(body, receive), send)

    async def _too_large(self, send) -> None:
        await _reject(send, 413, f"request body exceeds {self.max_body_bytes} bytes; "
                                 "a JobSpec is a few KiB")


class _NonFinite:
    """A NaN or ±Infinity found while parsing: JSON has neither, but Python's
    parser takes them (and turns 1e999 into inf); kept as a marker so the check
    can name the field it sits in."""

    def __init__(self, text: str) -> None:
        self.text = text


def _parse_float(text: str):
    value = float(text)
    return value if math.isfinite(value) else _NonFinite(text)


def _non_finite_path(value, path: tuple[str, ...] = ()) -> tuple[tuple[str, ...], str] | None:
    """The dotted path and text of the first non-finite number in `value`."""
    if isinstance(value, _NonFinite):
        return path, value.text
    items = (value.items() if isinstance(value, dict) else
             enumerate(value) if isinstance(value, list) else ())
    for key, item in items:
        found = _non_finite_path(item, (*path, str(key)))
        if found is not None:
            return found
    return None


class JsonBody:
    """A request body under `prefix` is JSON or is refused here, naming what is
    wrong: a Content-Type that is not JSON (415), or a non-finite number (422,
    naming the field it sits in). Malformed JSON, an empty body and fields the
    model refuses are the routes' validation errors (app.py names those)."""

    def __init__(self, app, prefix: str = "/v1") -> None:
        self.app = app
        self.prefix = prefix

    async def __call__(self, scope, receive, send) -> None:
        if (scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH")
                or not scope["path"].startswith(self.prefix)):
            return await self.app(scope, receive, send)
        # Bounded: BodySizeLimit, before this, refused a body over the cap.
        body = await _read_body(receive)
        if body is None:
            return
        if body.strip():
            ctype = dict(scope["headers"]).get(b"content-type", b"").decode("latin-1")
            media = ctype.partition(";")[0].strip().lower()
            if media != "application/json" and not media.endswith("+json"):
                return await _reject(send, 415, f"Content-Type: {media or '(none)'!r} is not "
                                                "JSON; send the body as application/json")
            try:
                parsed = json.loads(body, parse_constant=_NonFinite, parse_float=_parse_float)
            except ValueError:
                parsed = None  # malformed: the route's validation says where
            found = _non_finite_path(parsed)
            if found is not None:
                path, text = found
                field = ".".join(path) or "(body)"
                return await _reject(send, 422, f"invalid request: {field}: {text} is not a "
                                                "JSON number; send a finite number", errors=[
                    {"field": field, "message": f"{text} is not a JSON number; send a finite "
                                                "number"}])
        await self.app(scope, _replaying(body, receive), send)


class RequestMetrics:
    """`reflow_api_requests_total{route,method,status}` and request latency. The
    route label is the matched path template (`/v1/jobs/{job_id}`), never the raw
    path, so job ids do not become label values. A request answered before
    routing (401 from the token check, 413 from the size cap) is labelled by the
    template it would have matched in `router`, so refused calls are counted
    per route too."""

    def __init__(self, app, registry: CollectorRegistry, router=None) -> None:
        self.app = app
        self.router = router
        self.requests = Counter("reflow_api_requests_total", "API requests answered.",
                                ["route", "method", "status"], registry=registry)
        self.latency = Histogram("reflow_api_request_duration_seconds", "API request latency.",
                                 ["route", "method"], registry=registry,
                                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10))

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500
        start = time.perf_counter()

        async def record_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, record_status)
        finally:
            route = getattr(scope.get("route"), "path", None) or self._template(scope)
            method = scope.get("method", "")
            self.requests.labels(route, method, str(status)).inc()
            self.latency.labels(route, method).observe(time.perf_counter() - start)

    def _template(self, scope) -> str:
        """The path template of the route `scope` would reach (a method mismatch
        still names the path), or "unmatched"."""
        partial = None
        for route in getattr(self.router, "routes", ()):
            match, _ = route.matches(scope)
            if match == Match.FULL:
                return getattr(route, "path", "unmatched")
            if match == Match.PARTIAL and partial is None:
                partial = getattr(route, "path", None)
        return partial or "unmatched"
