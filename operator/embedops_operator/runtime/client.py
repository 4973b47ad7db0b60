"""The API client the runtime is built on: requests over the official kubernetes client's ApiClient, every
one counted and judged for the API server's availability (`ApiHealth`), writes refused once leadership is lost
(`fence`), and the list pages and watch streams the watch caches read. It knows no kind of its own: a controller
subclasses `Client` to name the kinds it addresses, its field manager and its metrics hook."""
from __future__ import annotations

import datetime as dt
import json
import logging
import os
import re
import threading
import time
from collections import Counter
from typing import Any, Callable, Iterator

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.rest import ApiException

from .watchcache import iter_lines

log = logging.getLogger("embedops.api")

AGGREGATED_DISCOVERY = "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList,application/json"
# HTTP statuses that mean the API server (or etcd behind it) is unavailable, not that a request was wrong
UNAVAILABLE_STATUSES = (502, 503, 504)


def unavailable_reason(exc: BaseException) -> str | None:
    """A short reason when `exc` means the API server cannot be reached or is unavailable (connection refused
    or reset, a timeout, 502/503/504), else None: such failures are expected during an outage, get a one-line
    log message and no traceback; anything else may be a bug and keeps its traceback."""
    import urllib3

    if isinstance(exc, ApiException):
        if exc.status in UNAVAILABLE_STATUSES:
            return f"HTTP {exc.status} {exc.reason or ''}".strip()
        if exc.status == 500 and "etcdserver" in str(exc.body or ""):  # etcd away behind the API server
            return "HTTP 500 etcdserver unavailable"
        if exc.status == 0 and "SSL" in str(exc.reason or ""):
            return "SSLError"
        return None
    if isinstance(exc, (urllib3.exceptions.HTTPError, ConnectionError, TimeoutError)):
        root = exc
        while True:  # MaxRetryError(reason=NewConnectionError(... ConnectionRefusedError))
            nxt = getattr(root, "reason", None)
            if not isinstance(nxt, BaseException) or nxt is root:
                break
            root = nxt
        text = str(root).splitlines()[0] if str(root) else ""
        m = re.search(r"\[Errno \d+\] [^'\")]+|timed out|Connection aborted|Connection reset|Connection refused",
                      text)
        return f"{type(root).__name__}: {m.group(0) if m else text[:120]}".rstrip(": ")
    return None


class ApiHealth:
    """Whether the API server answers, judged from the outcome of every request the operator sends.

    `failed(exc)` marks it unavailable (for the failures `unavailable_reason` recognizes) and logs
    "API server unreachable: <reason>, retrying" at most once per `log_every` seconds per reason;
    `ok()` (any HTTP answer that is not 502/503/504) after such failures marks it reachable again, logs once
    and calls the `on_recovered(outage_seconds)` callbacks (the controller re-queues failed services and wakes
    the watches then, instead of waiting for their back-off)."""

    def __init__(self, log_every: float = 30.0):
        self._lock = threading.Lock()
        self.down_since: float | None = None
        self.failures = 0
        self.log_every = log_every
        self._logged: dict[str, float] = {}
        self.on_recovered: list[Callable[[float], None]] = []
        self.outages = 0

    @property
    def available(self) -> bool:
        return self.down_since is None

    def failed(self, exc: BaseException) -> bool:
        """Record `exc`; True when it is an availability failure (logged here, rate-limited)."""
        reason = unavailable_reason(exc)
        if reason is None:
            return False
        now = time.monotonic()
        with self._lock:
            if self.down_since is None:
                self.down_since = now
                self.outages += 1
            self.failures += 1
            kind = reason.split(":")[0]
            last = self._logged.get(kind)
            say = last is None or now - last >= self.log_every
            if say:
                self._logged[kind] = now
        if say:
            log.warning("API server unreachable: %s; retrying", reason)
        return True

    def ok(self) -> None:
        if self.down_since is None:  # the common case, without the lock
            return
        with self._lock:
            if self.down_since is None:
                return
            now = time.monotonic()
            outage, self.down_since = now - self.down_since, None
            failures, self.failures = self.failures, 0
            # the "unreachable" messages keep their rate limit across recoveries: a flapping API server (etcd
            # away: some requests answered from its cache, others time out) logs a line per `log_every`
            # a blip (the last in-flight request answered while the API server shuts down) is not news
            say = outage >= 1.0 and now - self._logged.get("reachable", -1e9) >= self.log_every
            if say:
                self._logged["reachable"] = now
        done = []
        for fn in list(self.on_recovered):
            try:
                what = fn(outage)
            except Exception:  # noqa: BLE001 - a callback bug must not break requests
                log.exception("recovery callback failed")
                continue
            if what:
                done.append(what)
        (log.info if say else log.debug)("API server reachable again after %.1f s (%d failed requests)%s",
                                         outage, failures, "".join(f"; {d}" for d in done))


class TokenBucket:
    """A client-side bound on the request rate, as client-go's (--kube-api-qps and --kube-api-burst of the
    controller manager): `qps` requests a second on average, up to `burst` at once. `take()` reserves the next
    slot and sleeps until it comes (the callers are worker threads), returning the seconds waited; a fleet's
    roll-out then queues here instead of crowding everyone else's calls at the API server."""

    def __init__(self, qps: float, burst: int, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        if qps <= 0:
            raise ValueError(f"qps must be above 0, not {qps}")
        self.qps, self.burst = float(qps), max(1, int(burst))
        self.clock, self.sleep = clock, sleep
        self._tokens = float(self.burst)
        self._at = clock()
        self._lock = threading.Lock()

    def take(self) -> float:
        with self._lock:
            now = self.clock()
            self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.qps)
            self._at = now
            self._tokens -= 1.0  # reserved even when none is left: the debt is this caller's wait, in order
            wait = -self._tokens / self.qps if self._tokens < 0 else 0.0
        if wait > 0:
            self.sleep(wait)
        return wait


class LeadershipLost(RuntimeError):
    """A write refused because this operator no longer holds the leader Lease (leader.Elector.holds)."""


class Client:
    """A thin REST client over the official kubernetes client's ApiClient: the requests the runtime needs (get,
    list, server-side apply, delete, a status patch, events, list pages and watch streams for the caches,
    discovery), each counted and fed to `health`. A controller subclasses it to name its kinds and itself."""

    # the kinds this client can address: (apiVersion, kind) -> plural
    plurals: dict[tuple[str, str], str] = {}
    # the optional kinds (CRDs that may or may not be installed) `capabilities()` reports as served
    optional_kinds: tuple[tuple[str, str], ...] = ()
    field_manager = "embedops-runtime"  # server-side apply's field manager when a call names none
    component = "embedops-runtime"  # Events' source and reporting instance
    reporting_controller = "embedops.dev/runtime"  # Events' reportingComponent
    # called with (verb, HTTP status or "error") for every request sent: the controller's metrics
    on_request: Callable[[str, str], None] | None = None
    # With leader election: whether this process may write (leader.Elector.holds); None: it runs alone.
    fence: Callable[[], bool] | None = None
    # the client-side rate bound (None: none); watches and /readyz probes are not counted against it
    limiter: TokenBucket | None = None
    # called with the seconds a request waited for the limiter (only when it waited)
    on_throttle: Callable[[float], None] | None = None

    def __init__(self, api_client: k8s.ApiClient | None = None, capability_ttl: float = 10.0):
        if api_client is None:
            api_client = self._default_client()
        self.api = api_client
        self.capability_ttl = capability_ttl
        self._caps: tuple[float, frozenset] | None = None
        self._lock = threading.Lock()
        self.writes = 0  # counted for tests and logs
        self.requests: Counter = Counter()  # every request sent, by verb (GET, LIST, WATCH, PATCH, ...)
        self.health = ApiHealth()  # fed by every request below

    @staticmethod
    def configuration() -> k8s.Configuration:
        """In-cluster credentials, else $KUBECONFIG (read now, not at import) or ~/.kube/config."""
        cfg = k8s.Configuration()
        try:
            k8s_config.load_incluster_config(client_configuration=cfg)
        except k8s_config.ConfigException:
            path = os.environ.get("KUBECONFIG", "").split(os.pathsep)[0] or os.path.expanduser("~/.kube/config")
            k8s_config.load_kube_config(config_file=path, client_configuration=cfg)
        return cfg

    @classmethod
    def _default_client(cls, pool_size: int = 16) -> k8s.ApiClient:
        cfg = cls.configuration()
        cfg.connection_pool_maxsize = pool_size  # workers and watches in parallel, connections reused
        return k8s.ApiClient(cfg)

    # ------------------------------------------------------------------ raw
    def _send(self, method: str, path: str, query: list | None, body: Any, content_type: str,
              timeout: Any = 30, accept: str = "application/json") -> Any:
        headers = {"Accept": accept}
        if body is not None:
            headers["Content-Type"] = content_type
        method, url, headers, body, post = self.api.param_serialize(
            method=method, resource_path=path, query_params=query or [], header_params=headers, body=body,
            auth_settings=["BearerToken"])
        verb = method
        if method == "GET":
            verb = "WATCH" if any(k == "watch" for k, _ in query or []) else read_verb(path)
        if self.limiter is not None and verb != "WATCH" and path != "/readyz":
            waited = self.limiter.take()  # before the fence: leadership may be lost while waiting
            if waited and self.on_throttle is not None:
                self.on_throttle(waited)
        if method != "GET" and self.fence is not None and not self.fence() and \
                not any(k == "dryRun" for k, _ in query or []):
            raise LeadershipLost(f"not sent: {method} {path}: this operator no longer holds the leader Lease")
        with self._lock:
            self.requests[verb] += 1
        try:
            resp = self.api.call_api(method, url, header_params=headers, body=body, post_params=post,
                                     _request_timeout=timeout)
        except Exception as exc:
            self._observe(verb, "error")
            self.health.failed(exc)
            raise
        self._observe(verb, str(resp.status))
        if resp.status in UNAVAILABLE_STATUSES:
            self.health.failed(ApiException(status=resp.status, reason=resp.reason))
        elif resp.status < 500:  # an answer; a 500 says nothing either way (etcd down, or one bad object)
            self.health.ok()
        return resp

    def _observe(self, verb: str, status: str) -> None:
        if self.on_request is not None:
            self.on_request(verb, status)

    def probe(self) -> bool:
        """GET /readyz (allowed to every client): True when the API server says it is ready. Feeds `health`,
        so a probe that succeeds after failures marks the API server reachable again."""
        try:
            resp = self._send("GET", "/readyz", None, None, "application/json", timeout=5, accept="*/*")
            resp.read()
        except Exception:  # noqa: BLE001 - recorded by _send
            return False
        return resp.status == 200

    def request(self, method: str, path: str, query: list | None = None, body: Any = None,
                content_type: str = "application/json", accept: str = "application/json") -> Any:
        resp = self._send(method, path, query, body, content_type, accept=accept)
        data = resp.read()
        if not 200 <= resp.status < 300:
            raise ApiException(status=resp.status, reason=resp.reason,
                               body=data.decode("utf-8", "replace") if data else "")
        return json.loads(data) if data else {}

    @classmethod
    def path(cls, api_version: str, kind: str, namespace: str | None, name: str | None = None) -> str:
        plural = cls.plurals[(api_version, kind)]
        base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
        if namespace:
            base += f"/namespaces/{namespace}"
        base += f"/{plural}"
        return base + (f"/{name}" if name else "")

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        try:
            return self.request("GET", self.path(api_version, kind, namespace, name))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def get_from_server(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        """The object as the API server has it (the same as `get` here; `CachedKube` bypasses its caches)."""
        return self.get(api_version, kind, namespace, name)

    def get_any(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        """The object of that name whatever its labels (the same as `get` here; `CachedKube` asks the API
        server when its label-filtered cache has none)."""
        return self.get(api_version, kind, namespace, name)

    def list(self, api_version: str, kind: str, namespace: str | None, selector: str | None = None) -> list[dict]:
        query = [("labelSelector", selector)] if selector else []
        return with_kind(self.request("GET", self.path(api_version, kind, namespace), query=query).get("items", []),
                         api_version, kind)

    # ------------------------------------------------------------------ watch-cache transport
    def lister(self, api_version: str, kind: str, namespace: str | None, selector: str | None = None) -> Callable:
        """(limit, continue) -> (items, resourceVersion, continue): one page of a listing, for watchcache."""
        path = self.path(api_version, kind, namespace)

        def list_page(limit: int, cont: str | None) -> tuple[list[dict], str, str | None]:
            query = [("limit", str(limit))] + ([("labelSelector", selector)] if selector else [])
            if cont:
                query.append(("continue", cont))
            out = self.request("GET", path, query=query)
            meta = out.get("metadata") or {}
            return (with_kind(out.get("items") or [], api_version, kind), meta.get("resourceVersion", ""),
                    meta.get("continue") or None)
        return list_page

    def watcher(self, api_version: str, kind: str, namespace: str | None, selector: str | None = None) -> Callable:
        """(resourceVersion, timeout_s, opened) -> the watch's events, for watchcache; `opened` receives a
        function that closes the stream (to stop at once)."""
        path = self.path(api_version, kind, namespace)

        def watch_stream(rv: str | None, timeout: float, opened: Callable) -> Iterator[dict]:
            query = [("watch", "true"), ("allowWatchBookmarks", "true"), ("timeoutSeconds", str(int(timeout)))]
            if selector:
                query.append(("labelSelector", selector))
            if rv:
                query.append(("resourceVersion", rv))
            # read timeout: the server sends a bookmark about once a minute, and ends the watch at `timeout`
            resp = self._send("GET", path, query, None, "application/json", timeout=(10, timeout + 90))
            raw = resp.response
            if not 200 <= resp.status < 300:
                data = raw.read()
                raise ApiException(status=resp.status, reason=resp.reason,
                                   body=data.decode("utf-8", "replace") if data else "")
            opened(raw.shutdown if hasattr(raw, "shutdown") else raw.close)
            try:
                for line in iter_lines(raw.stream(65536, decode_content=True)):
                    yield json.loads(line)
            finally:
                raw.release_conn()
        return watch_stream

    def apply(self, obj: dict, manager: str | None = None, dry_run: bool = False, force: bool = True) -> dict:
        meta = obj["metadata"]
        query = [("fieldManager", manager or self.field_manager), ("force", "true" if force else "false")]
        if dry_run:
            query.append(("dryRun", "All"))
        else:
            self.writes += 1
        return self.request("PATCH", self.path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"]),
                            query=query, body=obj, content_type="application/apply-patch+yaml")

    def delete(self, api_version: str, kind: str, namespace: str, name: str, uid: str | None = None) -> None:
        body = {"propagationPolicy": "Background"}
        if uid:
            body["preconditions"] = {"uid": uid}
        self.writes += 1
        try:
            self.request("DELETE", self.path(api_version, kind, namespace, name), body=body)
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise

    def event(self, obj: dict, kind: str, reason: str, message: str) -> None:
        """A core/v1 Event about `obj` (what `kubectl describe` and `kubectl events` show). Best effort: a
        refused or failed event is logged, never raised (it is a record, not the change it records)."""
        meta = obj["metadata"]
        now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {"apiVersion": "v1", "kind": "Event",
                "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
                "involvedObject": {"apiVersion": obj.get("apiVersion"), "kind": obj.get("kind"), "name": meta["name"],
                                   "namespace": meta["namespace"], "uid": meta.get("uid")},
                "reason": reason, "message": message[:1024], "type": kind, "count": 1,
                "firstTimestamp": now, "lastTimestamp": now, "source": {"component": self.component},
                "reportingComponent": self.reporting_controller,
                "reportingInstance": os.environ.get("POD_NAME", self.component)}
        try:
            self.request("POST", f"/api/v1/namespaces/{meta['namespace']}/events", body=body)
        except Exception as exc:  # noqa: BLE001 - see above
            log.warning("event %s on %s/%s not recorded: %s", reason, meta["namespace"], meta["name"], exc)

    def patch_status(self, resource: dict, status: dict) -> dict:
        """Replace `resource`'s status (its status subresource; the object names its apiVersion and kind)."""
        meta = resource["metadata"]
        self.writes += 1
        ops = [{"op": "add", "path": "/status", "value": status}]
        path = self.path(resource["apiVersion"], resource["kind"], meta["namespace"], meta["name"])
        return self.request("PATCH", path + "/status",
                            body=ops, content_type="application/json-patch+json")

    # ------------------------------------------------------------------ discovery
    def capabilities(self) -> frozenset[tuple[str, str]]:
        """Which optional third-party kinds the API server serves (cached briefly; picks up later installs)."""
        with self._lock:
            if self._caps and time.monotonic() - self._caps[0] < self.capability_ttl:
                return self._caps[1]
        caps = self._aggregated_discovery()
        if caps is None:
            caps = self._discovery_per_group()
        with self._lock:
            self._caps = (time.monotonic(), caps)
        return caps

    def _aggregated_discovery(self) -> frozenset | None:
        """One request for every group's resources (aggregated discovery, Kubernetes 1.30+); None when the
        server answers with the plain group list instead."""
        res = self.request("GET", "/apis", accept=AGGREGATED_DISCOVERY)
        if res.get("kind") != "APIGroupDiscoveryList":
            return None
        served = set()
        for group in res.get("items") or []:
            name = (group.get("metadata") or {}).get("name", "")
            for version in group.get("versions") or []:
                for r in version.get("resources") or []:
                    kind = (r.get("responseKind") or {}).get("kind")
                    served.add((f"{name}/{version.get('version')}", kind))
        return frozenset(k for k in self.optional_kinds if k in served)

    def _discovery_per_group(self) -> frozenset:
        found = set()
        for api_version, kind in self.optional_kinds:
            try:
                res = self.request("GET", f"/apis/{api_version}")
            except ApiException as exc:
                if exc.status in (404, 503):
                    continue
                raise
            if any(r.get("kind") == kind for r in res.get("resources", [])):
                found.add((api_version, kind))
        return frozenset(found)

    def capabilities_cached(self) -> frozenset | None:
        """The last discovery result (no request), or None when it was forgotten."""
        with self._lock:
            return self._caps[1] if self._caps else None

    def forget_capabilities(self) -> None:
        with self._lock:
            self._caps = None


def read_verb(path: str) -> str:
    """GET (one object), LIST (a collection) or DISCOVERY (/api/v1, /apis/<group>/<version>) for a GET path."""
    parts = path.strip("/").split("/")
    rest = parts[2:] if parts[0] == "api" else parts[3:]  # drop api/v1 or apis/<group>/<version>
    if not rest:
        return "DISCOVERY"
    if rest[0] == "namespaces" and len(rest) > 2:
        rest = rest[2:]
    return "GET" if len(rest) >= 2 else "LIST"


def with_kind(items: list[dict], api_version: str, kind: str) -> list[dict]:
    """A list's items carry no apiVersion and kind (the list has them); a watch event's object does. Without them a
    listed child never equals its rendered manifest: a restarted operator applied every one again (issue 58)."""
    for item in items:
        item.setdefault("apiVersion", api_version)
        item.setdefault("kind", kind)
    return items
