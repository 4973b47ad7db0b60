"""`embedops-activator`: the address of a service that scales to zero.

With `autoscaling.minReplicas: 0` the operator points the service's Service at this small proxy and the model
pods sit behind `<name>-backend`. A request that finds a ready replica is forwarded at once. A request that
finds none (the backend Service refuses the connection: no endpoints) is *held*, retried every
`--retry-interval` seconds, and forwarded as soon as a replica is Ready; after `--activation-timeout` it gets
503 with Retry-After. Held requests are never dropped for lack of a pod, so the first request after a scale to
zero is answered, not refused.

KEDA wakes the Deployment from the activator's `/demand` (admin port, KEDA's metrics-api trigger): requests
held, in flight, or started within the last `--activity-window` seconds. The window is what keeps a lightly
used service awake: a request that finished between two of KEDA's polls still counts as activity.

It sits at a public address, so it is bounded like the server: the server's body limit (413), at most
`--max-in-flight` requests at once and `--max-held` waiting for a replica (429 with Retry-After beyond, so a
flood costs neither its memory nor the held requests' place), and with API_KEY set (the service's key) a request
without it gets the server's 401 before it is counted as demand: nobody without the key can keep GPUs awake.

Why not KEDA's HTTP add-on: its Go module cannot be fetched here (docs/operator.md), and a per-service
activator keeps the service's own address stable for every client (LiteLLM, the HTTPRoute, in-cluster callers).

Only transport lives here: no tensors, no engine. Both ports are served by one uvicorn server; a connection is
told apart by the port it arrived on.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import logging
import time
from typing import Any, Awaitable, Callable

import httpx
import orjson
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .asgi import BodyTooLarge, listening_socket, read_body
from .router.http_limits import HttpLimits, LimitedHttpToolsProtocol
from .cli import load_settings, settings_parser
from .settings import ActivatorSettings

log = logging.getLogger("embedops.activator")

# Connection-level headers a proxy must not forward (RFC 9110 section 7.6.1). A request's Host and length are
# set anew for the backend; a response's length is kept (its bytes are passed on unchanged).
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                        "trailer", "trailers", "transfer-encoding", "upgrade"})
REQUEST_SKIP = HOP_BY_HOP | {"host", "content-length"}
# Failures that mean the request never reached a server: no endpoint behind the backend Service (refused), no
# connection in time. Only these are held and sent again. A connection closed without an answer after the request
# was sent (RemoteProtocolError) may be a replica that died of this very request (out of memory): sent again, it
# would kill each replica in turn, so it is answered 502 (issue 53).
NOT_DELIVERED = (httpx.ConnectError, httpx.ConnectTimeout)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


class Activator:
    """Holds requests until the backend answers; counts what KEDA reads as demand."""

    def __init__(self, backend: str, activation_timeout: float = 300.0, activity_window: float = 10.0,
                 retry_interval: float = 0.25, max_body: int = 2_000_000, request_timeout: float = 600.0,
                 max_in_flight: int = 128, max_held: int = 64, api_key: str | None = None):
        self.backend = backend.rstrip("/")
        self.max_in_flight = max_in_flight
        self.max_held = max_held
        self.key = f"Bearer {api_key}".encode() if api_key else None
        self.activation_timeout = activation_timeout
        self.activity_window = activity_window
        self.retry_interval = retry_interval
        self.max_body = max_body
        self.request_timeout = request_timeout
        self.held = 0       # waiting for a replica
        self.in_flight = 0  # received and not yet answered (held ones included)
        self._started: collections.deque[float] = collections.deque()  # start times within the window
        self.client: httpx.AsyncClient | None = None
        self.registry = CollectorRegistry()
        self.requests = Counter("embedops_activator_requests", "Requests by outcome: forwarded (answered by a "
                                "replica, any status), timeout (no replica in time), too_large, client_gone (left "
                                "while held or waiting), backend_error (502/504), broken (answer cut off), "
                                "unauthorized (no valid API key), overloaded (429: over --max-in-flight or "
                                "--max-held)", ["outcome"],
                                registry=self.registry)
        self.held_seconds = Histogram("embedops_activator_held_seconds", "Time a request waited for a ready "
                                      "replica (held requests only)", registry=self.registry,
                                      buckets=(0.1, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600))
        Gauge("embedops_activator_held", "Requests waiting for a ready replica", registry=self.registry
              ).set_function(lambda: self.held)
        Gauge("embedops_activator_in_flight", "Requests received and not yet answered", registry=self.registry
              ).set_function(lambda: self.in_flight)

    # ------------------------------------------------------------------ demand
    def _recent(self, now: float) -> int:
        while self._started and self._started[0] < now - self.activity_window:
            self._started.popleft()
        return len(self._started)

    def demand(self) -> dict[str, int]:
        recent = self._recent(time.monotonic())
        # in_flight includes held; recent includes the ones in flight that started inside the window
        return {"demand": max(self.in_flight, recent), "held": self.held, "in_flight": self.in_flight,
                "recent": recent}

    # ------------------------------------------------------------------ forwarding
    async def start(self) -> None:
        self.client = httpx.AsyncClient(
            base_url=self.backend, follow_redirects=False,
            timeout=httpx.Timeout(self.request_timeout, connect=2.0),
            limits=httpx.Limits(max_connections=512, max_keepalive_connections=64))

    async def stop(self) -> None:
        if self.client is not None:
            await self.client.aclose()

    async def forward(self, method: str, target: str, headers: list[tuple[bytes, bytes]],
                      body: bytes, send: Send) -> None:
        """Send one request on, holding it while no replica answers, and stream the answer back to ``send``."""
        assert self.client is not None, "start() first"
        now = time.monotonic()
        self._started.append(now)
        self._recent(now)
        response = await self._open(method, target, headers, body)
        if isinstance(response, tuple):
            await _respond(send, *response)
            return
        try:
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": [(k.encode("latin-1"), v.encode("latin-1"))
                                    for k, v in response.headers.multi_items() if k.lower() not in HOP_BY_HOP]})
            # raw bytes, streamed: the body is passed on as the replica encoded it, never held whole (an
            # /embed_hybrid answer runs to tens of MB)
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            self.requests.labels("forwarded").inc()
        except httpx.HTTPError as exc:  # the replica went away mid-answer: the client sees a cut response
            self.requests.labels("broken").inc()
            log.warning("answer from %s broken off: %s: %s", self.backend, type(exc).__name__, exc)
        finally:
            await response.aclose()

    async def _open(self, method: str, target: str, headers: list[tuple[bytes, bytes]], body: bytes):
        """The backend's streaming response, or (status, headers, body) of the activator's own error."""
        assert self.client is not None
        fwd = [(k, v) for k, v in headers if k.decode("latin-1").lower() not in REQUEST_SKIP]
        held_since: float | None = None
        try:
            while True:
                try:
                    request = self.client.build_request(method, target, headers=fwd, content=body)
                    response = await self.client.send(request, stream=True)
                    # a held request that meets a server still loading its model (503 before its readiness
                    # probe passes, or outside Kubernetes) waits on; a 503 on the first try is passed on at once
                    if not (held_since is not None and response.status_code == 503
                            and time.monotonic() - held_since < self.activation_timeout):
                        return response
                    await response.aclose()
                except NOT_DELIVERED as exc:
                    if held_since is None:
                        if self.held >= self.max_held:
                            self.requests.labels("overloaded").inc()
                            return _error(429, "Overloaded", f"{self.held} requests already wait for a replica of "
                                          "this service (scaled to zero and waking up); retry later",
                                          retry_after=5)
                        held_since = time.monotonic()
                        self.held += 1
                        log.info("no ready replica behind %s (%s): holding %s %s", self.backend,
                                 type(exc).__name__, method, target)
                except httpx.RemoteProtocolError as exc:  # sent, then the connection closed without an answer
                    self.requests.labels("backend_error").inc()
                    log.warning("request to %s: the connection closed without an answer: %s", self.backend, exc)
                    return _error(502, "BadGateway", "the replica closed the connection without answering (it "
                                  "may have failed on this request, so it is not sent again)")
                except httpx.TimeoutException as exc:  # sent, and no answer within --request-timeout
                    self.requests.labels("backend_error").inc()
                    return _error(504, "GatewayTimeout", f"the replica did not answer within "
                                  f"{self.request_timeout:.0f} s ({type(exc).__name__})")
                except httpx.HTTPError as exc:
                    self.requests.labels("backend_error").inc()
                    log.warning("request to %s failed: %s: %s", self.backend, type(exc).__name__, exc)
                    return _error(502, "BadGateway", f"the replica's answer could not be read: "
                                  f"{type(exc).__name__}")
                if held_since is not None and time.monotonic() - held_since >= self.activation_timeout:
                    self.requests.labels("timeout").inc()
                    return _error(503, "Unhealthy", f"no replica of this service became ready within "
                                  f"{self.activation_timeout:.0f} s of the request (scaled to zero and waking "
                                  f"up, or failing to start); retry later", retry_after=10)
                await asyncio.sleep(self.retry_interval)
        finally:
            if held_since is not None:
                self.held -= 1
                self.held_seconds.observe(time.monotonic() - held_since)


def _error(status: int, kind: str, message: str, retry_after: int | None = None):
    headers = [(b"content-type", b"application/json")]
    if retry_after:
        headers.append((b"retry-after", str(retry_after).encode()))
    return status, headers, orjson.dumps({"error": message, "error_type": kind})


class App:
    """One ASGI app for both ports: the admin port answers /healthz, /demand and /metrics; every request on the
    proxy port, whatever its path, is forwarded (so /health reaches the model's server, and /metrics too where the
    server answers it on its API's port: not with --prometheus-port, which the operator renders)."""

    def __init__(self, activator: Activator, admin_port: int):
        self.activator = activator
        self.admin_port = admin_port

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":  # websockets: nothing here speaks them
            return
        server = scope.get("server") or (None, None)
        if server[1] == self.admin_port:
            await self._admin(scope, send)
            return
        act = self.activator
        if act.key is not None:  # before anything is read or counted: a request without the key is not demand
            auth = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(auth, act.key):
                act.requests.labels("unauthorized").inc()
                await _respond(send, *_error(401, "Unauthorized", "missing or invalid API key"))
                return
        if act.in_flight >= act.max_in_flight:
            act.requests.labels("overloaded").inc()
            await _respond(send, *_error(429, "Overloaded", f"the activator holds {act.in_flight} requests, its "
                                         "limit; retry later", retry_after=2))
            return
        # counted from here, before its body is read: a request still uploading holds a place too (issue 53)
        act.in_flight += 1
        try:
            await self._proxy(scope, receive, send)
        finally:
            act.in_flight -= 1

    async def _proxy(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            body = await read_body(receive, self.activator.max_body)
        except BodyTooLarge:
            self.activator.requests.labels("too_large").inc()
            await _respond(send, *_error(413, "PayloadTooLarge", f"request body over the activator's limit of "
                                         f"{self.activator.max_body} bytes"))
            return
        if body is None:  # the client left before its body ended: nothing to forward
            self.activator.requests.labels("client_gone").inc()
            return
        target = scope.get("raw_path") or scope["path"].encode()
        if scope.get("query_string"):
            target += b"?" + scope["query_string"]
        forward = asyncio.ensure_future(self.activator.forward(scope["method"], target.decode("latin-1"),
                                                                scope["headers"], body, send))
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait((forward, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not forward.done():  # the client left: a held request stops counting as demand
            forward.cancel()
            self.activator.requests.labels("client_gone").inc()
            with contextlib.suppress(asyncio.CancelledError):
                await forward
            return
        forward.result()

    async def _admin(self, scope: Scope, send: Send) -> None:
        path = scope["path"]
        if path == "/healthz":
            await _respond(send, 200, [(b"content-type", b"text/plain")], b"ok")
        elif path == "/demand":
            await _respond(send, 200, [(b"content-type", b"application/json")], orjson.dumps(self.activator.demand()))
        elif path == "/metrics":
            await _respond(send, 200, [(b"content-type", CONTENT_TYPE_LATEST.encode())],
                           generate_latest(self.activator.registry))
        else:
            await _respond(send, *_error(404, "NotFound", f"the activator's admin port serves /healthz, /demand "
                                         f"and /metrics, not {path}"))

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self.activator.start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.activator.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _respond(send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [*headers, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def parse_args(argv: list[str] | None = None, environ: dict | None = None) -> ActivatorSettings:
    """The flags and variables of settings.ActivatorSettings (a bad value: exit 2 naming it)."""
    parser = settings_parser(ActivatorSettings, "embedops-activator", __doc__.split("\n\n")[0])
    return load_settings(ActivatorSettings, parser, argv, environ, required=("backend",))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    activator = Activator(args.backend, activation_timeout=args.activation_timeout,
                          activity_window=args.activity_window, retry_interval=args.retry_interval,
                          max_body=args.max_body_bytes, request_timeout=args.request_timeout,
                          max_in_flight=args.max_in_flight, max_held=args.max_held, api_key=args.api_key or None)
    sockets = [listening_socket(args.hostname, args.port), listening_socket(args.hostname, args.admin_port)]
    config = uvicorn.Config(App(activator, args.admin_port), lifespan="on", access_log=False, log_level="warning",
                            timeout_graceful_shutdown=30, http=LimitedHttpToolsProtocol, limit_concurrency=2048)
    config.http_limits = HttpLimits()  # the server's defaults: 431, 408 at 30 s
    log.info("forwarding :%d to %s, admin on :%d", args.port, args.backend, args.admin_port)
    uvicorn.Server(config).run(sockets=sockets)


if __name__ == "__main__":
    main()
