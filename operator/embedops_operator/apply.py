"""Server-side apply of rendered children, with no write when nothing changed, and never onto an object the
operator did not create.

One field manager (`embedops`) for everything the operator owns. Before applying, the live object is
read: when it already carries the desired content hash and contains every desired field, nothing is sent.
Otherwise a server-side dry-run apply tells whether the real apply would change anything; only then is the
object written. A resync therefore never bumps a child's resourceVersion.

Ownership: a child is written only when no object of its name exists, or when the one that exists has the
EmbeddingService as its controller (the LiteLLM ConfigMap, shared by design: when it carries the opt-in label
`embedops.dev/litellm=true`). Anything else is a `Conflict`: left byte for byte as it is, reported in the
status, never pruned. The watch caches hold only objects labelled as the operator's, so "absent from the
cache" is confirmed by a read from the API server before anything is created, and the create itself is not
forced, so an object someone else creates in the moment between that read and the write conflicts (409)
instead of being taken over (controller-runtime's `AlreadyOwnedError`, Crossplane's `MustBeControllableBy`).
"""
from __future__ import annotations

import datetime as dt
import json
import logging
import os
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.rest import ApiException

from . import litellm, metrics, render, spec

log = logging.getLogger("embedops.apply")

# Kinds the operator writes: (apiVersion, kind) → plural. Children are pruned from this list only.
PLURALS: dict[tuple[str, str], str] = {
    ("apps/v1", "Deployment"): "deployments",
    ("v1", "Service"): "services",
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "Pod"): "pods",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("autoscaling/v2", "HorizontalPodAutoscaler"): "horizontalpodautoscalers",
    ("batch/v1", "Job"): "jobs",
    render.NETWORKPOLICY: "networkpolicies",
    (spec.API_VERSION, spec.KIND): spec.PLURAL,
    render.SERVICEMONITOR: "servicemonitors",
    render.HTTPROUTE: "httproutes",
    render.SCALEDOBJECT: "scaledobjects",
}
OWNED_KINDS = [("apps/v1", "Deployment"), ("v1", "Service"), ("policy/v1", "PodDisruptionBudget"), ("batch/v1", "Job"),
               ("autoscaling/v2", "HorizontalPodAutoscaler"), render.NETWORKPOLICY,
               render.SERVICEMONITOR, render.HTTPROUTE, render.SCALEDOBJECT]
AGGREGATED_DISCOVERY = "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList,application/json"
VOLATILE_META = ("managedFields", "resourceVersion", "generation", "creationTimestamp", "uid", "selfLink")
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


def is_subset(desired: Any, live: Any) -> bool:
    """Every field of `desired` is present with the same value in `live` (lists: same length, element-wise)."""
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(k in live and is_subset(v, live[k]) for k, v in desired.items())
    if isinstance(desired, list):
        return isinstance(live, list) and len(desired) == len(live) and all(
            is_subset(d, x) for d, x in zip(desired, live))
    if desired == live:
        return True
    return str(desired) == str(live)  # int-or-string fields, canonical quantities


def comparable(obj: dict) -> dict:
    out = {k: v for k, v in obj.items() if k != "status"}
    out["metadata"] = {k: v for k, v in (obj.get("metadata") or {}).items() if k not in VOLATILE_META}
    return out


class LeadershipLost(RuntimeError):
    """A write refused because this operator no longer holds the leader Lease (leader.Elector.holds)."""


class Kube:
    """A thin REST client over the official kubernetes client's ApiClient."""

    # With leader election: whether this process may write (leader.Elector.holds); None: it runs alone.
    fence: Callable[[], bool] | None = None

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
            verb = "WATCH" if any(k == "watch" for k, _ in query or []) else _read_verb(path)
        elif self.fence is not None and not self.fence() and not any(k == "dryRun" for k, _ in query or []):
            raise LeadershipLost(f"not sent: {method} {path}: this operator no longer holds the leader Lease")
        with self._lock:
            self.requests[verb] += 1
        try:
            resp = self.api.call_api(method, url, header_params=headers, body=body, post_params=post,
                                     _request_timeout=timeout)
        except Exception as exc:
            metrics.API_REQUESTS.labels(verb, "error").inc()
            self.health.failed(exc)
            raise
        metrics.API_REQUESTS.labels(verb, str(resp.status)).inc()
        if resp.status in UNAVAILABLE_STATUSES:
            self.health.failed(ApiException(status=resp.status, reason=resp.reason))
        elif resp.status < 500:  # an answer; a 500 says nothing either way (etcd down, or one bad object)
            self.health.ok()
        return resp

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

    @staticmethod
    def path(api_version: str, kind: str, namespace: str | None, name: str | None = None) -> str:
        plural = PLURALS[(api_version, kind)]
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
        return self.request("GET", self.path(api_version, kind, namespace), query=query).get("items", [])

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
            return out.get("items") or [], meta.get("resourceVersion", ""), meta.get("continue") or None
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
                from .watchcache import iter_lines
                for line in iter_lines(raw.stream(65536, decode_content=True)):
                    yield json.loads(line)
            finally:
                raw.release_conn()
        return watch_stream

    def apply(self, obj: dict, manager: str = render.MANAGER, dry_run: bool = False, force: bool = True) -> dict:
        meta = obj["metadata"]
        query = [("fieldManager", manager), ("force", "true" if force else "false")]
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
                "firstTimestamp": now, "lastTimestamp": now, "source": {"component": "embedops-operator"},
                "reportingComponent": "embedops.dev/operator",
                "reportingInstance": os.environ.get("POD_NAME", "embedops-operator")}
        try:
            self.request("POST", f"/api/v1/namespaces/{meta['namespace']}/events", body=body)
        except Exception as exc:  # noqa: BLE001 - see above
            log.warning("event %s on %s/%s not recorded: %s", reason, meta["namespace"], meta["name"], exc)

    def patch_status(self, resource: dict, status: dict) -> dict:
        meta = resource["metadata"]
        self.writes += 1
        ops = [{"op": "add", "path": "/status", "value": status}]
        return self.request("PATCH", self.path(spec.API_VERSION, spec.KIND, meta["namespace"], meta["name"]) + "/status",
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
        return frozenset(k for k in render.OPTIONAL_KINDS if k in served)

    def _discovery_per_group(self) -> frozenset:
        found = set()
        for api_version, kind in render.OPTIONAL_KINDS:
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


def _read_verb(path: str) -> str:
    """GET (one object), LIST (a collection) or DISCOVERY (/api/v1, /apis/<group>/<version>) for a GET path."""
    parts = path.strip("/").split("/")
    rest = parts[2:] if parts[0] == "api" else parts[3:]  # drop api/v1 or apis/<group>/<version>
    if not rest:
        return "DISCOVERY"
    if rest[0] == "namespaces" and len(rest) > 2:
        rest = rest[2:]
    return "GET" if len(rest) >= 2 else "LIST"


def needs_write(kube: Kube, desired: dict, manager: str = render.MANAGER, live: dict | None = None) -> bool:
    if live is None:
        meta = desired["metadata"]
        live = kube.get(desired["apiVersion"], desired["kind"], meta["namespace"], meta["name"])
    if live is None:
        return True
    want_hash = (desired["metadata"].get("annotations") or {}).get(render.ANNOTATION_HASH)
    live_hash = ((live.get("metadata") or {}).get("annotations") or {}).get(render.ANNOTATION_HASH)
    if want_hash == live_hash and is_subset(desired, live):
        return False
    preview = kube.apply(desired, manager=manager, dry_run=True)
    return comparable(preview) != comparable(live)


# The field manager that holds a Deployment's `spec.replicas` between the operator letting go of it (autoscaling
# turned on) and the autoscaler (HPA or KEDA's HPA) first writing it.
HANDOVER_MANAGER = "embedops-replicas-handover"


def owns_replicas(live: dict, manager: str) -> bool:
    """Whether ``manager`` owns ``spec.replicas`` of a live object by server-side apply."""
    for entry in (live.get("metadata") or {}).get("managedFields") or []:
        if entry.get("manager") == manager and entry.get("operation") == "Apply":
            if "f:replicas" in ((entry.get("fieldsV1") or {}).get("f:spec") or {}):
                return True
    return False


def hand_over_replicas(kube: Kube, desired: dict, live: dict | None, floor: int | None = None) -> bool:
    """Hand a Deployment's ``replicas`` to its autoscaler without the dip to 1.

    When autoscaling is turned on, the rendered Deployment stops carrying ``replicas``. Had the operator's
    manager been the field's only owner, that apply would remove the field and the API server would default
    it to 1: two of three running pods killed until the autoscaler acts (on GPUs, each back only after a model
    load). Kubernetes' documented way out (Server-Side Apply, "Transferring ownership"): first apply the live
    value under a temporary manager, then drop the field. The temporary manager keeps the value until the
    autoscaler first writes a different one, which takes the field from it; a conflict means the autoscaler
    already owns it, and nothing is needed. True when the hand-over was written.

    ``floor``: the HPA's minReplicas when an HPA is what scales the Deployment. An HPA never scales a target at
    zero replicas (its ScalingActive condition says "ScalingDisabled"), so a Deployment left at zero (by KEDA
    when the service scaled to zero, or by ``replicas: 0``) is raised to the floor under the same temporary
    manager, forced: whoever set the zero (KEDA) no longer scales it.
    """
    if desired["kind"] != "Deployment" or live is None or "replicas" in desired.get("spec", {}):
        return False
    running = (live.get("spec") or {}).get("replicas", 1)
    if floor and not running:
        replicas, force = floor, True
    elif owns_replicas(live, render.MANAGER):
        replicas, force = running, False
    else:
        return False
    meta = desired["metadata"]
    patch = {"apiVersion": desired["apiVersion"], "kind": desired["kind"],
             "metadata": {"name": meta["name"], "namespace": meta["namespace"]}, "spec": {"replicas": replicas}}
    try:
        kube.apply(patch, manager=HANDOVER_MANAGER, force=force)
    except ApiException as exc:
        if exc.status == 409:
            return False
        raise
    return True


@dataclass(frozen=True)
class Conflict:
    """A child the operator would write whose name is taken by an object it did not create."""
    kind: str
    name: str
    why: str

    def message(self) -> str:
        return f"{self.kind} {self.name} {self.why}"


@dataclass
class Applied:
    written: list[str] = field(default_factory=list)  # 'Kind/name' of what was written
    conflicts: list[Conflict] = field(default_factory=list)  # children left alone: not the operator's


def controller_of(obj: dict) -> dict | None:
    """The ownerReference marked `controller: true` (at most one, by the API's validation)."""
    return next((r for r in (obj.get("metadata") or {}).get("ownerReferences") or [] if r.get("controller")), None)


def ownership_conflict(desired: dict, live: dict | None) -> Conflict | None:
    """Why the operator may not write `desired` over `live`, or None when it may: nothing of that name exists,
    or what exists has the controller the operator renders (this EmbeddingService, by uid). The LiteLLM
    ConfigMap has no controller (it is shared, maybe the platform team's): it may be written when it carries
    the label `embedops.dev/litellm=true`, which the operator sets on the ConfigMaps it creates and a team sets
    on its own to opt it in."""
    if live is None:
        return None
    kind, name = desired["kind"], desired["metadata"]["name"]
    if kind == "ConfigMap":
        if ((live.get("metadata") or {}).get("labels") or {}).get(render.LABEL_LITELLM) == "true":
            return None
        return Conflict(kind, name, f"exists without the label {render.LABEL_LITELLM}=true (label it to let "
                                    "embedops write LiteLLM entries into it)")
    want, have = controller_of(desired), controller_of(live)
    if want is not None and have is not None and have.get("uid") == want.get("uid"):
        return None
    if have is None:
        return Conflict(kind, name, "exists and was not created by this EmbeddingService (it has no controller "
                                    "reference)")
    same = want is not None and have.get("kind") == want.get("kind") and have.get("name") == want.get("name")
    owner = f"{have.get('kind')} {have.get('name')}" + (f" (uid {have.get('uid')}, a deleted one of the same "
                                                       "name: the garbage collector removes it)" if same else "")
    return Conflict(kind, name, f"is controlled by {owner}, not by this EmbeddingService")


def read_for_write(kube: Kube, desired: dict) -> dict | None:
    """The live object of `desired`'s name, whoever created it. The watch caches hold only the operator's
    labelled objects, so a miss there is asked again of the API server: a foreign object of the same name
    (no labels) must be seen before anything is created."""
    meta = desired["metadata"]
    return kube.get_any(desired["apiVersion"], desired["kind"], meta["namespace"], meta["name"])


def create(kube: Kube, desired: dict, manager: str) -> tuple[dict | None, Conflict | None]:
    """Server-side apply of an object the API server just said was absent, not forced: an object of that name
    created by someone else since then makes the apply conflict (409) on the fields both set, and is then
    judged like any other live object instead of being taken over."""
    try:
        return kube.apply(desired, manager=manager, force=False), None
    except ApiException as exc:
        if exc.status != 409:
            raise
    live = kube.get_from_server(desired["apiVersion"], desired["kind"], desired["metadata"]["namespace"],
                                desired["metadata"]["name"])
    conflict = ownership_conflict(desired, live)
    if conflict is None:  # ours after all (our own earlier write): a plain apply settles it
        return kube.apply(desired, manager=manager), None
    return None, conflict


def apply_all(kube: Kube, manifests: Iterable[dict], service_name: str) -> Applied:
    """Apply each manifest that differs from the cluster and belongs to the operator; the others are returned
    as conflicts, untouched."""
    out = Applied()
    manifests = list(manifests)
    hpa_floor = next((m["spec"].get("minReplicas", 1) for m in manifests if m["kind"] == "HorizontalPodAutoscaler"),
                     None)
    for obj in manifests:
        # The shared LiteLLM ConfigMap gets one field manager per service, so services never remove
        # each other's keys.
        manager = litellm.manager(service_name) if obj["kind"] == "ConfigMap" else render.MANAGER
        meta = obj["metadata"]
        try:
            live = read_for_write(kube, obj)
            conflict = ownership_conflict(obj, live)
            if conflict is not None:
                out.conflicts.append(conflict)
                continue
            if hand_over_replicas(kube, obj, live, floor=hpa_floor):
                out.written.append(f"{obj['kind']}/{meta['name']} (replicas handed to the autoscaler)")
            wrote = live is None or needs_write(kube, obj, manager=manager, live=live)
            if wrote:
                if live is None:
                    live, conflict = create(kube, obj, manager)
                    if conflict is not None:
                        out.conflicts.append(conflict)
                        continue
                else:
                    live = kube.apply(obj, manager=manager)
                out.written.append(f"{obj['kind']}/{meta['name']}")
        except ApiException as exc:
            exc.failed_object = obj  # the reconciler names what failed (a CRD removed since discovery)
            raise
        if obj["kind"] == "ConfigMap":  # a LiteLLM entry: the ConfigMap's index, then its proxies' restart
            indexed = litellm.sync_index(kube, live)
            if indexed is not None:
                out.written.append(f"ConfigMap/{meta['name']} (LiteLLM index)")
            if wrote or indexed is not None:
                out.written += litellm.restart_consumers(kube, indexed or live)
    return out


def prune(kube: Kube, resource: dict, desired: list[dict], capabilities: frozenset,
          keep: set[tuple[str, str]] = frozenset()) -> list[str]:
    """Delete children this EmbeddingService controls that are no longer rendered (e.g. HPA → ScaledObject).
    Only objects whose controller reference is this EmbeddingService (by uid) are candidates, whatever their
    labels say; the delete carries the object's uid as a precondition."""
    meta = resource["metadata"]
    uid, ns, name = meta.get("uid"), meta["namespace"], meta["name"]
    keep = {(o["kind"], o["metadata"]["name"]) for o in desired} | set(keep)
    selector = f"{render.LABEL_MANAGED_BY}={render.MANAGER},{render.LABEL_SERVICE}={name}"
    deleted = []
    for api_version, kind in OWNED_KINDS:
        if (api_version, kind) in render.OPTIONAL_KINDS and (api_version, kind) not in capabilities:
            continue
        try:
            items = kube.list(api_version, kind, ns, selector)
        except ApiException as exc:
            if exc.status == 404:  # the CRD went away since discovery: nothing of that kind to prune
                continue
            raise
        for item in items:
            im = item["metadata"]
            owned = (controller_of(item) or {}).get("uid") == uid
            if uid and owned and (kind, im["name"]) not in keep:
                kube.delete(api_version, kind, ns, im["name"], uid=im.get("uid"))
                deleted.append(f"{kind}/{im['name']}")
    return deleted

