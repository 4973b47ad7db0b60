"""Wiring: watch caches → a work queue of EmbeddingService keys → worker threads running the reconciler.

- One informer (watchcache.py) per watched kind (and per namespace when the operator is limited to some):
  EmbeddingServices; the Deployments, Services, Pods, PodDisruptionBudgets, HPAs, Jobs and NetworkPolicies labelled
  `app.kubernetes.io/managed-by=embedops`; ConfigMaps labelled `embedops.dev/litellm=true`; and the optional
  kinds (ServiceMonitor, HTTPRoute, ScaledObject), each started when discovery finds its CRD and stopped when
  it goes.
- Events map to keys: an EmbeddingService's own events, and those of its children (drift, or a Deployment's
  status moving) reconcile it fully; its Pods' events recompute its status only. A DELETED EmbeddingService
  removes its LiteLLM entry (the reconciler's `forget`).
- The reconciler reads through `CachedKube`, so a reconcile of an unchanged service sends nothing.
- Every `resyncSeconds` discovery is refreshed (optional CRDs installed or removed since) and every cached
  EmbeddingService is queued again (drift the events did not show), then LiteLLM entries are swept.
"""
from __future__ import annotations

import logging
import threading
import time
from functools import partial
from typing import Callable

from . import apply, kinds, metrics, render, spec
from .runtime import client, watchcache
from .runtime.cachedkube import CachedKube
from .reconcile import Reconciler
from .settings import OperatorSettings
from .runtime.workqueue import WorkQueue

log = logging.getLogger("embedops.controller")

MANAGED = f"{render.LABEL_MANAGED_BY}={render.MANAGER}"
COALESCE_SECONDS = 1.0
# every FULL_RESYNC_EVERY-th resync (the first included) queues every service; the others only those whose
# objects changed since their last successful reconcile (the watch events normally did that already)
FULL_RESYNC_EVERY = 10
PROBE_SECONDS = 1.0  # /readyz while the API server is unavailable
RECOVERY_MIN_INTERVAL = 5.0  # re-queue failed services at most this often (a flapping API server)
ES = kinds.EMBEDDING_SERVICE
# what an informer lists (kinds.py's `watch`) -> its label selector (None: every object)
SELECTORS = {"all": None, "managed": MANAGED, "litellm": f"{render.LABEL_LITELLM}=true"}
# kind -> the label selector of its informer; the optional kinds are added when their CRD is served
CORE_KINDS: dict[tuple[str, str], str | None] = {key: SELECTORS[w] for key, w in kinds.watched(optional=False).items()}


def _pod_view(pod: dict) -> dict:
    """What status computation reads of a Pod: metadata (without managedFields) and status."""
    meta = {k: v for k, v in (pod.get("metadata") or {}).items() if k != "managedFields"}
    return {"apiVersion": pod.get("apiVersion", "v1"), "kind": "Pod", "metadata": meta,
            "status": pod.get("status") or {}}


def _keep_all(obj: dict) -> dict:
    return obj  # ConfigMaps: LiteLLM entry owners are read from managedFields


def _deployment_view(obj: dict) -> dict:
    """A Deployment without its managedFields, except which managers own `spec.replicas` (read when the
    replicas are handed to an autoscaler: apply.hand_over_replicas)."""
    meta = obj.get("metadata") or {}
    owners = [{"manager": e.get("manager"), "operation": e.get("operation"),
               "fieldsV1": {"f:spec": {"f:replicas": {}}}}
              for e in meta.get("managedFields") or []
              if "f:replicas" in ((e.get("fieldsV1") or {}).get("f:spec") or {})]
    obj["metadata"] = {k: v for k, v in meta.items() if k != "managedFields"}
    if owners:
        obj["metadata"]["managedFields"] = owners
    return obj


TRANSFORMS = {"Pod": _pod_view, "ConfigMap": _keep_all, "Deployment": _deployment_view}
# the label a service's children are looked up by (its prune and Pod selectors name it), so a reconcile reads
# its own few objects, not all N of a kind (Pods too: every track's pods carry it, the instance label is the track's)
INDEX_LABELS = {spec.KIND: None, "ConfigMap": None}


class Controller:
    def __init__(self, kube: apply.Kube, settings: OperatorSettings | None = None, workers: int = 4):
        self.kube = kube
        self.settings = settings or OperatorSettings()
        # discovery is refreshed by the resync loop; reconciles in between reuse it
        kube.capability_ttl = max(kube.capability_ttl, self.settings.resync_seconds)
        if self.settings.kube_api_qps > 0:  # the operator's own bound on its request rate (settings.py)
            kube.limiter = client.TokenBucket(self.settings.kube_api_qps, self.settings.kube_api_burst)
        self.cache = CachedKube(kube, on_capabilities=self._optional_kinds)
        self.reconciler = Reconciler(self.cache, self.settings)
        # changes that arrive while a service is reconciled are merged for COALESCE_SECONDS: a burst of spec
        # edits writes its Deployment a few times, not once per edit
        self.queue = WorkQueue(coalesce=COALESCE_SECONDS)
        self.reconciler.requeue = lambda key: self.queue.add(key, True)  # services waiting for an upgrade slot
        self.reconciler.requeue_status = lambda key: self.queue.add(key, False)  # a stall deadline passed
        self.workers = workers
        self.tombstones: dict[tuple[str, str], dict] = {}  # deleted EmbeddingServices not yet forgotten
        # the API server's availability, from every request (client.ApiHealth); when it answers again after
        # failures, services that failed meanwhile are queued at once and the watches resume
        self.health: client.ApiHealth = getattr(kube, "health", None) or client.ApiHealth()
        self.health.on_recovered.append(self._recovered)
        self._last_recovery = -1e9
        # what each service's last successful full reconcile saw (see _fingerprint); a resync skips services
        # whose fingerprint is unchanged, except every FULL_RESYNC_EVERY-th resync
        self._seen: dict[tuple[str, str], tuple] = {}
        self._resyncs = 0
        self.skipped = 0  # resync skips, for tests and the benchmark
        self._lock = threading.Lock()
        self._list_gate = threading.Semaphore(1)  # the informers list one kind at a time (watchcache.Informer)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------ informers
    def _start_kind(self, api_version: str, kind: str, selector: str | None) -> None:
        with self._lock:
            if (api_version, kind) in self.cache.informers or self._stop.is_set():
                return
            infs = []
            for ns in self.settings.namespaces or [None]:
                infs.append(watchcache.Informer(
                    f"{kind} in {ns or 'all namespaces'}",
                    self.kube.lister(api_version, kind, ns, selector),
                    self.kube.watcher(api_version, kind, ns, selector),
                    on_event=partial(self._on_event, kind),
                    transform=TRANSFORMS.get(kind, watchcache.strip_managed_fields),
                    namespace=ns, selector=selector, index_label=INDEX_LABELS.get(kind, render.LABEL_SERVICE),
                    health=self.health, list_gate=self._list_gate))
            self.cache.informers[(api_version, kind)] = infs
        for inf in infs:
            inf.start()

    def _stop_kind(self, api_version: str, kind: str) -> None:
        with self._lock:
            infs = self.cache.informers.pop((api_version, kind), [])
        for inf in infs:
            inf.stop(join=0)

    def _optional_kinds(self, capabilities: frozenset) -> None:
        for (api_version, kind), watch in kinds.watched(optional=True).items():
            if (api_version, kind) in capabilities:
                self._start_kind(api_version, kind, SELECTORS[watch])
            elif (api_version, kind) in self.cache.informers:
                self._stop_kind(api_version, kind)

    # ------------------------------------------------------------------ events → keys
    def _on_event(self, kind: str, etype: str, obj: dict) -> None:
        meta = obj.get("metadata") or {}
        ns = meta.get("namespace") or ""
        if kind == spec.KIND:
            key = (ns, meta.get("name", ""))
            if etype == "DELETED":
                self.tombstones[key] = obj
            else:
                self.tombstones.pop(key, None)
            self.queue.add(key, True)
            return
        if kind == "ConfigMap":
            return  # read by the sweeps; entries are re-applied by their services' reconciles
        owner = (meta.get("labels") or {}).get(render.LABEL_SERVICE)
        if owner:
            self.queue.add((ns, owner), kind != "Pod")

    # ------------------------------------------------------------------ workers
    def _work(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            key, full = item
            ok = True
            result = "ok"
            started = time.monotonic()
            body = self.tombstones.pop(key, None)
            seen = None
            try:
                if body is not None and self.cache.get(*ES, *key) is None:
                    self._seen.pop(key, None)
                    self.reconciler.forget(*key, body)
                    self.queue.forget(key)
                else:
                    # taken before: a change during the reconcile makes the next resync look again
                    seen = self._fingerprint(key) if full else None
                    self._seen.pop(key, None)
                    self.reconciler.reconcile(*key, apply_children=full)
                    if key in self.reconciler.unfinished:
                        ok, result = False, "retry"  # its status says why; retried with the key's back-off
                    elif seen is not None:
                        self._seen[key] = seen
            except Exception as exc:  # noqa: BLE001 - retried with a backoff
                self._seen.pop(key, None)
                # the API server being away is reported once (rate-limited) by self.health, and the key is
                # retried as soon as it answers; anything else may be a bug: keep the traceback
                if isinstance(exc, client.LeadershipLost):  # the process exits in a moment (leader._lost)
                    log.debug("reconcile of %s/%s stopped: %s", *key, exc)
                elif self.health.failed(exc):
                    log.debug("reconcile of %s/%s failed: %s", *key, client.unavailable_reason(exc))
                else:
                    log.exception("reconcile of %s/%s failed", *key)
                if body is not None:
                    self.tombstones.setdefault(key, body)
                ok, result = False, "error"
            finally:
                self.queue.done(key, ok)
                metrics.RECONCILES.labels(result).inc()
                metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)

    # ------------------------------------------------------------------ API server outages
    def _recovered(self, outage: float) -> str | None:
        """The API server answers again: services whose reconcile failed meanwhile go now (their back-off,
        up to 60 s, reset), and the informers waiting out a retry back-off (up to 30 s) retry now."""
        now = time.monotonic()
        if now - self._last_recovery < RECOVERY_MIN_INTERVAL:  # a flapping API server: back-offs apply
            return None
        self._last_recovery = now
        n = self.queue.retry_failed_now()
        with self._lock:
            infs = [i for group in self.cache.informers.values() for i in group]
        for inf in infs:
            inf.wake()
        return f"re-queued {n} services that failed meanwhile"

    def _probe_loop(self) -> None:
        """While requests fail because the API server is away, ask its /readyz every PROBE_SECONDS: the
        moment it is ready the failed services are re-queued, whatever their back-offs and the informers'."""
        while not self._stop.wait(PROBE_SECONDS):
            if not self.health.available and hasattr(self.kube, "probe"):
                self.kube.probe()

    # ------------------------------------------------------------------ resync
    def _fingerprint(self, key: tuple[str, str]) -> tuple | None:
        """What a full reconcile of `key` reads, as resourceVersions from the caches: the EmbeddingService,
        its children (by their service label), its Pods, the LiteLLM ConfigMap it names, and discovery.
        None when a kind is not cached (read from the API server): such a service is never skipped."""
        ns, name = key
        parts: list = [self.cache.kube.capabilities_cached()] if hasattr(self.cache.kube, "capabilities_cached") \
            else [None]
        es_inf = self.cache.informer_for(*ES, ns)
        if es_inf is None or not es_inf.synced:
            return None
        es = es_inf.get(ns, name)
        if es is None:
            return None
        meta = es.get("metadata") or {}
        parts.append((meta.get("resourceVersion"), meta.get("generation")))
        for api_version, kind in [k for k in kinds.children() if k not in kinds.OPTIONAL or k in self.cache.informers]:
            inf = self.cache.informer_for(api_version, kind, ns)
            if inf is None or not inf.synced:
                return None
            parts.append(tuple(inf.indexed_versions(ns, name)))
        config_map = (((es.get("spec") or {}).get("litellm") or {}).get("configMapName"))
        if config_map:
            inf = self.cache.informer_for("v1", "ConfigMap", ns)
            if inf is None or not inf.synced:
                return None
            parts.append(inf.version(ns, config_map))
        return tuple(parts)

    def service_states(self) -> list[tuple[tuple[str, str], tuple, Callable[[], tuple[dict | None, list[dict]]]]]:
        """For the metrics, each EmbeddingService in the watch cache (none until it has synced): its key, the
        resourceVersions its figures come from (its own and its Pods', read without decoding them), and a call
        that decodes it and its Pods, so a scrape decodes only the services that changed since the last one
        (issue 58: 9% of a scrape at 1,000 services, docs/operator.md "The operator's request rate")."""
        out = []
        for inf in self.cache.informers.get(ES) or []:
            if not inf.synced:
                continue
            for ns, name in inf.keys():
                pods = self.cache.informer_for("v1", "Pod", ns)
                versions = (inf.version(ns, name),
                            tuple(pods.indexed_versions(ns, name)) if pods is not None and pods.synced else None)
                out.append(((ns, name), versions, partial(self._service_and_pods, inf, ns, name)))
        return out

    def _service_and_pods(self, inf, ns: str, name: str) -> tuple[dict | None, list[dict]]:
        return inf.get(ns, name), self.pods_of(ns, name)

    def cached(self) -> dict[str, tuple[int, int]]:
        """Objects in the watch caches by kind, and their encoded bytes (the operator's memory grows with them)."""
        with self._lock:
            groups = list(self.cache.informers.items())
        return {kind: (sum(inf.size() for inf in informers), sum(inf.stored_bytes() for inf in informers))
                for (_, kind), informers in groups}

    def pods_of(self, namespace: str, name: str) -> list[dict]:
        """A service's Pods from the watch cache (none when it is not synced), for the metrics."""
        inf = self.cache.informer_for("v1", "Pod", namespace)
        return inf.indexed(namespace, name) if inf is not None and inf.synced else []

    def _service_keys(self) -> list[tuple[str, str]]:
        infs = self.cache.informers.get(ES) or []
        if infs and all(i.synced for i in infs):
            return sorted({k for i in infs for k in i.keys()})
        return self.reconciler.list_all()

    def resync(self) -> None:
        """Refresh discovery, queue the services whose fingerprint changed since their last successful full
        reconcile (every service on every FULL_RESYNC_EVERY-th resync), sweep LiteLLM entries."""
        self.cache.forget_capabilities()
        try:
            self.cache.capabilities()  # starts or stops the optional kinds' informers
        except Exception as exc:  # noqa: BLE001 - the API server may be away; next resync
            if not self.health.failed(exc):
                log.warning("discovery failed: %s", watchcache.short_error(exc))
        full_pass = self._resyncs % FULL_RESYNC_EVERY == 0
        self._resyncs += 1
        skipped = 0
        for key in self._service_keys():
            seen = self._seen.get(key)
            if not full_pass and seen is not None and seen == self._fingerprint(key):
                skipped += 1
                continue
            self.queue.add(key, True)
        self.skipped += skipped
        log.debug("resync: %s pass, %d unchanged services skipped", "full" if full_pass else "changed-only",
                  skipped)
        self.reconciler.sweep_litellm()

    def _resync_loop(self) -> None:
        self.reconciler.sweep_litellm()  # services deleted while the operator was down; no event will come
        while not self._stop.wait(self.settings.resync_seconds):
            try:
                self.resync()
            except Exception as exc:  # noqa: BLE001
                if client.unavailable_reason(exc) is None:
                    log.exception("resync failed")

    # ------------------------------------------------------------------ lifecycle
    def start(self, sync_timeout: float = 60.0) -> "Controller":
        try:
            self.cache.capabilities()
        except Exception as exc:  # noqa: BLE001 - retried by the resync loop
            log.warning("discovery failed: %s", watchcache.short_error(exc))
        for (api_version, kind), selector in CORE_KINDS.items():
            self._start_kind(api_version, kind, selector)
        # Reconciles wait for the caches (a half-filled cache would look like missing children). Kinds that
        # cannot be listed (CRD not installed, no permission) do not hold the others up: they read the API.
        with self._lock:
            infs = [i for group in self.cache.informers.values() for i in group]
        deadline = time.monotonic() + sync_timeout
        for inf in infs:
            while not inf.wait_synced(0.2) and not inf.waiting_reason and not self._stop.is_set() \
                    and time.monotonic() < deadline:
                pass
        metrics.watch(self)
        for n in range(self.workers):
            self._spawn(self._work, f"embedops-worker-{n}")
        self._spawn(self._resync_loop, "embedops-resync")
        self._spawn(self._probe_loop, "embedops-probe")
        log.info("watch caches synced: %s", ", ".join(
            f"{kind} {sum(len(i.keys()) for i in group)}" for (_, kind), group in self.cache.informers.items()))
        return self

    def _spawn(self, target, name: str) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        self._threads.append(t)
        t.start()

    def stop(self) -> None:
        self._stop.set()
        metrics.unwatch(self)
        self.queue.close()
        self.reconciler.rechecks.close()
        with self._lock:
            infs = [i for group in self.cache.informers.values() for i in group]
        for inf in infs:
            inf.stop(join=0)
        for t in self._threads:
            t.join(10)
        for inf in infs:
            inf.stop(join=5)

    def requests(self) -> dict[str, int]:
        """Requests this operator sent, by verb (the client's count)."""
        return dict(self.kube.requests)
