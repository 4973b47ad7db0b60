"""Pure-ASGI middleware: payload limit (JSON 413, also for chunked bodies) and bearer-token auth; ``Connection:
close`` on every answer while the server drains, or on a connection older than its age limit; and what a request
holds until its answer is sent."""
from __future__ import annotations

import hmac
import time

from ..asgi import BodyTooLarge, read_body, replay
from .errors import error_body

PUBLIC_PATHS = frozenset({"/health", "/ping", "/metrics", "/docs", "/docs/oauth2-redirect", "/openapi.json",
                          "/redoc"})


async def _send_error(send, path: str, status: int, kind: str, message: str) -> None:
    body = error_body(path, status, kind, message)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class GuardMiddleware:
    def __init__(self, app, payload_limit: int, api_key: str | None):
        self.app = app
        self.limit = payload_limit
        self.key = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        length = None
        auth = b""
        for k, v in scope["headers"]:
            if k == b"content-length":
                length = v
            elif k == b"authorization":
                auth = v
        if self.key is not None and path not in PUBLIC_PATHS and not (path == "/" and scope["method"] == "GET"):
            if not hmac.compare_digest(auth, self.key):
                return await _send_error(send, path, 401, "Unauthorized", "missing or invalid API key")
        if length is not None:
            try:
                too_big = int(length) > self.limit
            except ValueError:
                too_big = True
            if too_big:
                return await _send_error(send, path, 413, "PayloadTooLarge",
                                         f"payload too large: the limit is {self.limit} bytes")
            return await self.app(scope, receive, send)
        if scope["method"] in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        # Chunked body: buffer it up to the limit before the app sees it, then replay.
        try:
            body = await read_body(receive, self.limit)
        except BodyTooLarge:
            return await _send_error(send, path, 413, "PayloadTooLarge",
                                     f"payload too large: the limit is {self.limit} bytes")
        if body is None:
            return
        return await self.app(scope, replay(body, receive), send)


class MetricsPortMiddleware:
    """With --prometheus-port: `/metrics` is answered on that port and nowhere else, and nothing else is answered
    there, so a Service or a NetworkPolicy can expose the API without the metrics, or the metrics without the API.
    Without it, as TEI's HTTP build: `/metrics` on the API's port."""

    def __init__(self, app, metrics_port: int | None):
        self.app = app
        self.port = metrics_port

    async def __call__(self, scope, receive, send):
        if self.port and scope["type"] == "http":
            on_metrics_port = (scope.get("server") or (None, None))[1] == self.port
            if on_metrics_port != (scope["path"] == "/metrics"):
                where = "this port serves only /metrics" if on_metrics_port else (
                    f"/metrics is served on port {self.port} (--prometheus-port)")
                return await _send_error(send, scope["path"], 404, "NotFound", f"not found: {where}")
        return await self.app(scope, receive, send)


class ConnectionCloseMiddleware:
    """``Connection: close`` on an answer: a client's pooled keep-alive connection is retired after the request it
    just sent, and its next request opens a new connection, which the Service may send to another pod. Closing
    idle pooled connections instead races with a request being sent on them (lost: an HTTP client does not
    resend a POST on a connection closed under it). Two cases:

    - while the server drains (after SIGTERM): every answer, so clients move to pods that are not going away;
    - with ``max_age`` > 0, the first answer on a connection older than that: a Service's new choice of pods
      (the embedding space promoted in a migration, replicas an autoscaler added) reaches clients that keep
      connections open within ``max_age`` seconds, instead of never (kube-proxy moves new connections only).

    A connection is known by its client address and port (ASGI has no connection id); its age counts from its
    first request. A port reused by a later connection within the bookkeeping window only closes that one early.
    """

    def __init__(self, app, state, max_age: float = 0.0):
        self.app = app
        self.state = state
        self.max_age = max_age
        self._first_seen: dict[tuple, float] = {}
        self._pruned = time.monotonic()

    def _expired(self, scope) -> bool:
        client = scope.get("client")
        if not self.max_age or not client:
            return False
        now = time.monotonic()
        key = tuple(client)
        first = self._first_seen.setdefault(key, now)
        if now - first < self.max_age:
            if now - self._pruned > self.max_age:  # forget connections not seen for a while (closed ones)
                self._pruned = now
                horizon = now - 2 * self.max_age
                self._first_seen = {k: v for k, v in self._first_seen.items() if v > horizon or k == key}
            return False
        del self._first_seen[key]
        return True

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not (self.state.draining or self._expired(scope)):
            return await self.app(scope, receive, send)

        async def send_closing(message):
            if message["type"] == "http.response.start":
                message = dict(message)
                message["headers"] = [*(h for h in message.get("headers", ()) if h[0].lower() != b"connection"),
                                      (b"connection", b"close")]
            await send(message)

        return await self.app(scope, receive, send_closing)


AFTER_RESPONSE_KEY = "embedops.after_response"  # request.scope: callbacks to run once the answer is sent


class AfterResponseMiddleware:
    """Runs the callbacks a route left in the scope (``AFTER_RESPONSE_KEY``) once its answer is sent, or the app
    failed, or its client went away: what a request holds until then, an answer-of-every-token's-state slot
    (core/lanes.py), is held to the end. "Sent" means handed to the kernel, less a chunk: uvicorn waits for its
    transport's buffer to drain before a body message, not after, so a body sent whole would sit in that buffer
    (17 MB of /embed_all JSON to a client that does not read) and the app would return at once. A large body is
    sent in chunks of ``CHUNK`` bytes instead, so a client that reads slowly holds the slot, not a second copy of
    what the slot counts."""

    CHUNK = 1 << 20

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_in_chunks(message):
            body = message.get("body", b"") if message["type"] == "http.response.body" else b""
            if len(body) <= self.CHUNK:
                return await send(message)
            view, more = memoryview(body), message.get("more_body", False)
            for start in range(0, len(body), self.CHUNK):
                last = start + self.CHUNK >= len(body)
                await send({"type": "http.response.body", "body": view[start:start + self.CHUNK],
                            "more_body": more or not last})

        try:
            return await self.app(scope, receive, send_in_chunks)
        finally:
            for callback in scope.pop(AFTER_RESPONSE_KEY, ()):
                callback()
