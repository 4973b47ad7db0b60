"""API server outages and the resync at rest, without a cluster: which failures count as "unavailable",
one rate-limited log line for them, failed keys re-queued when the API server answers again, informers woken
from their back-off, and the resync skipping services whose cached objects did not change."""
from __future__ import annotations

import logging
import threading
import time

import urllib3
from kubernetes.client.rest import ApiException

from embedops_operator import controller as C
from embedops_operator import render as R
from embedops_operator.runtime import client as K
from embedops_operator.runtime import watchcache as W
from embedops_operator.runtime.workqueue import WorkQueue


def refused() -> Exception:
    conn = urllib3.exceptions.NewConnectionError(
        None, "Failed to establish a new connection: [Errno 111] Connection refused")
    return urllib3.exceptions.MaxRetryError(None, "/apis", conn)


def wait(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_unavailable_reason_tells_an_outage_from_a_bug():
    assert "Connection refused" in K.unavailable_reason(refused())
    assert K.unavailable_reason(ConnectionResetError(104, "Connection reset by peer"))
    assert K.unavailable_reason(urllib3.exceptions.ProtocolError("Connection aborted."))
    assert K.unavailable_reason(ApiException(status=503, reason="Service Unavailable")) == \
        "HTTP 503 Service Unavailable"
    assert K.unavailable_reason(ApiException(status=504)) == "HTTP 504"
    etcd = ApiException(status=500)
    etcd.body = '{"kind":"Status","message":"etcdserver: request timed out","code":500}'
    assert K.unavailable_reason(etcd) == "HTTP 500 etcdserver unavailable"
    for exc in (ApiException(status=500), ApiException(status=422), ApiException(status=404), KeyError("x"),
                ValueError("bad")):
        assert K.unavailable_reason(exc) is None, exc


def test_api_health_logs_once_per_kind_and_reports_the_recovery(caplog):
    health = K.ApiHealth(log_every=60)
    seen = []
    health.on_recovered.append(lambda outage: seen.append(outage) or "re-queued 3 services")
    health.ok()  # available: nothing happens
    assert seen == [] and health.available
    with caplog.at_level(logging.INFO, logger="embedops.api"):
        for _ in range(200):
            assert health.failed(refused())
        assert health.failed(ApiException(status=503, reason="Service Unavailable"))
        assert not health.failed(ValueError("a bug"))  # not counted, not logged here
        assert not health.available
        health.down_since -= 2  # an outage of 2 s (shorter blips are logged at debug only)
        health.ok()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    assert lines[0].startswith("API server unreachable: NewConnectionError") and "retrying" in lines[0]
    assert lines[1].startswith("API server unreachable: HTTP 503")
    assert lines[2].startswith("API server reachable again after") and "re-queued 3 services" in lines[2]
    assert health.available and len(seen) == 1


def test_retry_failed_now_requeues_failed_keys_and_resets_their_backoff():
    q = WorkQueue(max_backoff=60)
    key = ("ml", "a")
    for _ in range(7):  # back-off now 32 s
        q.add(key)
        assert q.get(0) == (key, True)
        q.done(key, ok=False)  # its retry replaces the previous round's, which has not come yet (0.5 s)
    assert 30 < q.backoff(key) <= 32 and q.failing() == 1 and q.get(0.2) is None
    assert q.retry_failed_now() == 1
    assert q.get(0) == (key, True)
    assert q.failing() == 0 and q.backoff(key) is None
    q.done(key, ok=False)  # fails once more: back-off starts again at 0.5 s
    assert q.get(2) == (key, True)
    q.close()


def test_informer_reports_outages_to_health_and_wakes_from_its_backoff(caplog):
    health = K.ApiHealth()
    calls = []

    def list_page(limit, cont):
        calls.append(time.monotonic())
        if len(calls) <= 3:
            raise refused()
        return [], "5", None

    def watch_stream(rv, timeout, opened):
        stop = threading.Event()
        opened(stop.set)
        stop.wait(5)
        return
        yield

    inf = W.Informer("svc", list_page, watch_stream, max_backoff=30, health=health)
    with caplog.at_level(logging.INFO):
        inf.start()
        try:
            wait(lambda: len(calls) >= 3, 10)
            time.sleep(0.1)  # now in a back-off of 2-6 s
            assert not inf.synced
            inf.wake()
            assert inf.wait_synced(1.0)  # retried at once, not after the back-off
        finally:
            inf.stop()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("API server unreachable"), warnings


class FakeKube:
    capability_ttl = 0

    def __init__(self):
        self.health = K.ApiHealth()

    def capabilities(self):
        return frozenset()

    def capabilities_cached(self):
        return frozenset()

    def forget_capabilities(self):
        pass


class FakeReconciler:
    def __init__(self):
        self.calls: list[tuple[str, bool]] = []
        self.fail: set[str] = set()
        self.unfinished: set[tuple[str, str]] = set()

    def reconcile(self, ns, name, apply_children=True):
        self.calls.append((name, apply_children))
        if name in self.fail:
            raise refused()

    def forget(self, *a):
        pass

    def list_all(self):
        raise AssertionError("the resync reads the cache")

    def sweep_litellm(self):
        pass


def cached(kind, *objs, index_label=R.LABEL_SERVICE):
    inf = W.Informer(kind, None, None, index_label=index_label)
    inf._replace(list(objs))
    inf._synced.set()
    return [inf]


def child(kind, name, rv, **labels):
    return {"apiVersion": "v1", "kind": kind,
            "metadata": {"name": name, "namespace": "ml", "resourceVersion": str(rv), "labels": labels}}


def controller():
    c = C.Controller(FakeKube())
    c.reconciler = FakeReconciler()
    es = [dict(child("EmbeddingService", n, rv), spec={}) for n, rv in (("a", 1), ("b", 2))]
    for e in es:
        e["metadata"]["generation"] = 1
    c.cache.informers = {
        C.ES: cached("es", *es, index_label=None),
        ("apps/v1", "Deployment"): cached("dep", child("Deployment", "a", 3, **{R.LABEL_SERVICE: "a"}),
                                          child("Deployment", "b", 4, **{R.LABEL_SERVICE: "b"})),
        ("v1", "Service"): cached("svc"),
        ("policy/v1", "PodDisruptionBudget"): cached("pdb"),
        ("autoscaling/v2", "HorizontalPodAutoscaler"): cached("hpa"),
        ("batch/v1", "Job"): cached("job"),
        R.NETWORKPOLICY: cached("netpol"),
        ("v1", "Pod"): cached("pod", child("Pod", "a-1", 5, **{R.LABEL_INSTANCE: "a", R.LABEL_SERVICE: "a"})),
    }
    return c


def resync_and_drain(c) -> list[str]:
    c.reconciler.calls.clear()
    c.resync()
    t = threading.Thread(target=c._work, daemon=True)
    t.start()
    deadline = time.monotonic() + 5
    while (len(c.queue) or c.queue._active) and time.monotonic() < deadline:
        time.sleep(0.01)
    c.queue.add(("", "__stop__"))  # a sentinel key: the worker is idle once it has taken it
    wait(lambda: any(n == "__stop__" for n, _ in c.reconciler.calls))
    wait(lambda: not c.queue._active)
    c.queue.close()
    t.join(2)
    c.queue = WorkQueue(coalesce=0)
    return sorted(n for n, _ in c.reconciler.calls if n != "__stop__")


def test_resync_skips_unchanged_services_but_not_changed_ones_nor_every_nth_pass():
    c = controller()
    assert resync_and_drain(c) == ["a", "b"]  # the first resync is a full pass
    assert resync_and_drain(c) == []  # nothing changed since their last successful reconcile
    assert c.skipped == 2
    # a's Deployment changed (its event already queued it; the resync is the safety net), b's Pod appeared
    c.cache.informers[("apps/v1", "Deployment")][0]._apply_event(
        "MODIFIED", child("Deployment", "a", 9, **{R.LABEL_SERVICE: "a"}))
    assert resync_and_drain(c) == ["a"]
    c.cache.informers[("v1", "Pod")][0]._apply_event("ADDED", child("Pod", "b-1", 10, **{R.LABEL_INSTANCE: "b",
                                                                                       R.LABEL_SERVICE: "b"}))
    assert resync_and_drain(c) == ["b"]
    assert resync_and_drain(c) == []
    # a spec change (new resourceVersion and generation) and a failed reconcile are never skipped
    es_b = dict(child("EmbeddingService", "b", 11), spec={"x": 1})
    es_b["metadata"]["generation"] = 2
    c.cache.informers[C.ES][0]._apply_event("MODIFIED", es_b)
    c.reconciler.fail = {"b"}
    assert resync_and_drain(c) == ["b"]
    c.reconciler.fail = set()
    assert resync_and_drain(c) == ["b"]
    assert resync_and_drain(c) == []
    # every FULL_RESYNC_EVERY-th resync reconciles everything (drift no event showed)
    c._resyncs = C.FULL_RESYNC_EVERY * 3
    assert resync_and_drain(c) == ["a", "b"]


def test_recovery_requeues_failed_services_and_wakes_informers():
    c = controller()
    woken = []
    for group in c.cache.informers.values():
        for inf in group:
            inf.wake = lambda inf=inf: woken.append(inf.name)
    key = ("ml", "a")
    c.queue.add(key)
    assert c.queue.get(0) == (key, True)
    c.queue.done(key, ok=False)
    c.queue._failures[key] = 8  # as if it had failed for a while: its next try would be 60 s away
    c.kube.health.failed(refused())
    c.kube.health.ok()
    assert c.queue.get(0) == (key, True)
    assert len(woken) == len(c.cache.informers) == 8
    c.queue.close()
