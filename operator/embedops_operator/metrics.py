"""The operator's own Prometheus metrics, served on ``--metrics-address`` (the chart's port ``metrics``).

What a platform team alerts on and looks at when services do not converge:

* ``embedops_operator_reconciles_total{result}``: ``ok`` (children and status current), ``retry`` (an apply
  failed: the status says why, retried with a back-off), ``error`` (an exception, logged with its traceback);
  ``embedops_operator_reconcile_duration_seconds``;
* ``embedops_operator_workqueue_depth``, ``embedops_operator_workqueue_retrying`` (services waiting out a
  back-off), ``embedops_operator_workqueue_wait_seconds`` (from an event to a worker taking the service);
* ``embedops_operator_api_requests_total{verb,code}``: every request to the API server (``code="error"``:
  no answer);
* ``embedops_operator_leader``: 1 in the replica that reconciles (holds the Lease, or runs without election);
* ``embedops_service_condition{namespace,service,type,status}``: 1 for each EmbeddingService's current
  status of each condition (Ready, Reconciling, Stalled, ...), 0 for the other two statuses (the
  kube-state-metrics convention, so ``== 0`` and ``for:`` work in alerts), and
  ``embedops_service_replicas{namespace,service,state="desired|ready"}``, read from the watch cache at scrape
  time (no request to the API server);
* ``embedops_operator_cached_objects{kind}``, ``embedops_operator_cached_bytes{kind}`` (the watch caches' objects
  and their encoded bytes: the operator's memory grows with them) and ``embedops_operator_memory_limit_bytes``
  (its container's limit, read from the cgroup).

Only the leader has a controller: the service families come from it alone.
"""
from __future__ import annotations

import logging
import os
import socketserver
import ssl
import threading
from pathlib import Path
from typing import Iterator
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import GaugeMetricFamily, Metric

log = logging.getLogger("embedops.metrics")
REGISTRY = CollectorRegistry(auto_describe=True)
RECONCILES = Counter("embedops_operator_reconciles", "Reconciles of EmbeddingServices by result (ok, retry, error)",
                     ["result"], registry=REGISTRY)
RECONCILE_SECONDS = Histogram("embedops_operator_reconcile_duration_seconds", "Duration of one reconcile",
                              buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=REGISTRY)
QUEUE_WAIT = Histogram("embedops_operator_workqueue_wait_seconds",
                       "Seconds a service waited in the work queue before a worker took it",
                       buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60), registry=REGISTRY)
API_REQUESTS = Counter("embedops_operator_api_requests", "Requests to the Kubernetes API server by verb and status "
                       "code ('error': no answer)", ["verb", "code"], registry=REGISTRY)
API_THROTTLED = Histogram("embedops_operator_api_throttled_seconds", "Seconds a request to the API server waited "
                          "for the operator's own rate bound (--kube-api-qps, --kube-api-burst), when it waited",
                          buckets=(0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30), registry=REGISTRY)
LEADER = Gauge("embedops_operator_leader", "1 while this replica reconciles (holds the leader Lease)",
               registry=REGISTRY)
for result in ("ok", "retry", "error"):
    RECONCILES.labels(result)  # present at 0 from the start: rate() and increase() see the first failure
# process_resident_memory_bytes and the rest: with the limit below, what the chart's alert reads
ProcessCollector(registry=REGISTRY)
# cgroup v2, then v1: the container's memory limit ("max", or v1's page-rounded 2^63, mean none)
CGROUP_MEMORY_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))
NO_LIMIT_ABOVE = 1 << 60


def memory_limit(paths=CGROUP_MEMORY_LIMITS) -> int | None:
    """The memory limit of the container the operator runs in, in bytes, or None (none, or not readable)."""
    for path in paths:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < NO_LIMIT_ABOVE:
            return int(text)
        return None
    return None

STATUSES = ("True", "False", "Unknown")
_lock = threading.Lock()
_controller = None
# (namespace, name) -> (the resourceVersions they came from, the samples): a scrape decodes only the services that
# changed since the one before (Controller.service_states)
_samples: dict[tuple[str, str], tuple[tuple, list]] = {}
_samples_lock = threading.Lock()


def watch(controller) -> None:
    """Report ``controller``'s queue and services (None: it stopped)."""
    global _controller, _samples
    with _lock:
        _controller = controller
    with _samples_lock:
        _samples = {}  # what another controller's caches gave
    LEADER.set(0 if controller is None else 1)
    if controller is not None:
        controller.queue.observe_wait = QUEUE_WAIT.observe


def unwatch(controller) -> None:
    """Stop reporting ``controller`` (if it is the one reported)."""
    global _controller
    with _lock:
        if _controller is controller:
            _controller = None
            LEADER.set(0)


def _restarts(pod: dict) -> int:
    """Restarts of all of a pod's containers, init containers included: a model that cannot load fails in the
    init container that prepares it (Init:CrashLoopBackOff), found on a real node reading 0 restarts here."""
    st = pod.get("status") or {}
    return sum(cs.get("restartCount") or 0
               for cs in (st.get("initContainerStatuses") or []) + (st.get("containerStatuses") or []))


def _samples_of(es: dict, pods: list[dict]) -> list[tuple[str, list[str], float]]:
    meta, st = es.get("metadata") or {}, es.get("status") or {}
    ns, name = meta.get("namespace", ""), meta.get("name", "")
    out = [("cond", [ns, name, x.get("type", ""), s], 1.0 if x.get("status") == s else 0.0)
           for x in st.get("conditions") or [] for s in STATUSES]
    out += [("replicas", [ns, name, "desired"], float(st.get("replicas") or 0)),
            ("replicas", [ns, name, "ready"], float(st.get("readyReplicas") or 0)),
            ("restarts", [ns, name], float(sum(_restarts(p) for p in pods)))]
    p99 = ((es.get("spec") or {}).get("monitoring") or {}).get("p99LatencySeconds")
    if p99:
        out.append(("budget", [ns, name], float(p99)))
    return out


def _service_samples(c) -> Iterator[tuple[str, list[str], float]]:
    global _samples
    kept: dict[tuple[str, str], tuple[tuple, list]] = {}
    with _samples_lock:
        for key, versions, load in c.service_states():
            memo = _samples.get(key)
            if memo is None or memo[0] != versions or versions[1] is None:  # Pods not cached: read them again
                es, pods = load()
                if es is None:
                    continue
                memo = (versions, _samples_of(es, pods))
            kept[key] = memo
        _samples = kept  # deleted services are forgotten
    for _, rows in kept.values():
        yield from rows


class _ControllerCollector:
    def collect(self) -> Iterator[Metric]:
        with _lock:
            c = _controller
        depth = GaugeMetricFamily("embedops_operator_workqueue_depth", "Services waiting for a worker")
        retrying = GaugeMetricFamily("embedops_operator_workqueue_retrying",
                                     "Services waiting out a back-off after a failed reconcile")
        cond = GaugeMetricFamily("embedops_service_condition", "EmbeddingService conditions (1: the current status)",
                                 labels=["namespace", "service", "type", "status"])
        replicas = GaugeMetricFamily("embedops_service_replicas", "EmbeddingService replicas from its status",
                                     labels=["namespace", "service", "state"])
        restarts = GaugeMetricFamily("embedops_service_pod_restarts",
                                     "Container restarts summed over the service's current pods (a crash loop, a "
                                     "model that cannot load, OOM kills)", labels=["namespace", "service"])
        cached = GaugeMetricFamily("embedops_operator_cached_objects",
                                   "Objects in the operator's watch caches by kind: its memory grows with them "
                                   "(docs/operator.md \"Sizing the operator's memory\")", labels=["kind"])
        cached_bytes = GaugeMetricFamily("embedops_operator_cached_bytes",
                                         "Bytes of the encoded objects in the operator's watch caches by kind "
                                         "(labels and bookkeeping aside)", labels=["kind"])
        limit = GaugeMetricFamily("embedops_operator_memory_limit_bytes",
                                  "The memory limit of the operator's container (absent without one): "
                                  "process_resident_memory_bytes near it alerts before an OOM kill")
        bytes_ = memory_limit()
        if bytes_ is not None:
            limit.add_metric([], float(bytes_))
        budget = GaugeMetricFamily("embedops_service_p99_budget_seconds",
                                   "spec.monitoring.p99LatencySeconds (only for services that set it)",
                                   labels=["namespace", "service"])
        if c is not None:
            for kind, (n, size) in c.cached().items():
                cached.add_metric([kind], float(n))
                cached_bytes.add_metric([kind], float(size))
            depth.add_metric([], len(c.queue))
            retrying.add_metric([], c.queue.failing())
            families = {"cond": cond, "replicas": replicas, "restarts": restarts, "budget": budget}
            for family, labels, value in _service_samples(c):
                families[family].add_metric(labels, value)
        yield from (depth, retrying, cond, replicas, restarts, budget, cached, cached_bytes, limit)

    def describe(self) -> list:
        return []


REGISTRY.register(_ControllerCollector())


class _ThreadingWSGIServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a slow scraper never holds the operator's exit


class _QuietHandler(WSGIRequestHandler):
    timeout = 10  # seconds a connection may stay silent (a client that opens and never sends holds a thread)

    def log_message(self, format, *args):  # one line per scrape would drown the operator's log
        pass


def app(access=None):
    """The WSGI app behind /metrics: with ``access`` (metrics_access.KubernetesAccessReview) every request is
    reviewed first and answered 401, 403 or 503 with a one-line reason when it may not read."""
    from prometheus_client import make_wsgi_app

    metrics_app = make_wsgi_app(REGISTRY)
    if access is None:
        return metrics_app

    def guarded(environ, start_response):
        decision = access.decide(environ.get("HTTP_AUTHORIZATION"), environ.get("PATH_INFO") or "/")
        if decision.status == 200:
            return metrics_app(environ, start_response)
        reason = {401: "Unauthorized", 403: "Forbidden", 503: "Service Unavailable"}[decision.status]
        headers = [("Content-Type", "text/plain; charset=utf-8")]
        if decision.status == 401:
            headers.append(("WWW-Authenticate", 'Bearer realm="embedops-operator metrics"'))
        start_response(f"{decision.status} {reason}", headers)
        return [(decision.message + "\n").encode()]

    return guarded


def serve(address: str, access=None, cert_dir: str | None = None):
    """Serve ``/metrics`` on ``host:port`` in a daemon thread ('' or a port of 0: not at all). ``access``: who
    may read (None: anyone); ``cert_dir``: a folder with tls.crt and tls.key (a cert-manager Secret) to serve
    HTTPS. Returns the server (None when not serving)."""
    if not address:
        return None
    host, _, port = address.rpartition(":")
    if int(port) == 0:
        return None
    try:
        server = make_server(host or "0.0.0.0", int(port), app(access), _ThreadingWSGIServer,
                             handler_class=_QuietHandler)
    except OSError as exc:  # another operator process on this machine (tests, a laptop): reconciling matters more
        log.error("cannot serve /metrics on %s: %s; running without it", address, exc)
        return None
    if cert_dir:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(os.path.join(cert_dir, "tls.crt"), os.path.join(cert_dir, "tls.key"))
        # the handshake in the connection's own thread, not in accept(): a client that stalls mid-handshake
        # would otherwise stop every other scrape
        server.socket = ctx.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    log.info("serving /metrics on %s (%s, %s)", address, "HTTPS" if cert_dir else "HTTP",
             "Kubernetes authentication and authorization" if access else "open to anyone who reaches it")
    return server
