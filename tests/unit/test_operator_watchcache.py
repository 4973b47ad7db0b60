"""Watch caches against a fake transport: listing, watch events, 410 Gone re-listing without a lost event,
a kind that is not served yet, our own writes not coming back as events; the work queue; CachedKube."""
from __future__ import annotations

import json
import threading
import time

from kubernetes.client.rest import ApiException

from embedops_operator.runtime import watchcache as W
from embedops_operator.runtime.cachedkube import CachedKube
from embedops_operator.runtime.workqueue import WorkQueue


def obj(name, rv, ns="ml", **labels):
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": ns, "resourceVersion": str(rv), "labels": labels,
                         "managedFields": [{"manager": "x"}]}}


class FakeServer:
    """Objects by name; a list answers them all; a watch replays scripted event batches, then blocks."""

    def __init__(self):
        self.objects: dict[str, dict] = {}
        self.rv = 0
        self.scripts: list = []  # per watch: list of events, or an exception to raise
        self.lists = 0
        self.watch_rvs: list = []
        self.list_error: Exception | None = None
        self.idle = threading.Event()

    def put(self, name, **labels):
        self.rv += 1
        self.objects[name] = obj(name, self.rv, **labels)
        return self.objects[name]

    def list_page(self, limit, cont):
        if self.list_error:
            raise self.list_error
        self.lists += 1
        return list(self.objects.values()), str(self.rv), None

    def watch_stream(self, rv, timeout, opened):
        self.watch_rvs.append(rv)
        stop = threading.Event()
        opened(stop.set)
        if self.scripts:
            step = self.scripts.pop(0)
            if isinstance(step, Exception):
                raise step
            yield from step
            return
        self.idle.set()
        stop.wait(5)


def wait(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def informer(server, events):
    return W.Informer("svc", server.list_page, server.watch_stream,
                      on_event=lambda t, obj: events.append((t, obj["metadata"]["name"])),
                      max_backoff=0.05)


def test_list_then_watch_events_and_bookmarks():
    server, events = FakeServer(), []
    server.put("a")
    server.scripts = [[{"type": "ADDED", "object": obj("b", 2)},
                       {"type": "MODIFIED", "object": obj("a", 3)},
                       {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "9"}}},
                       {"type": "DELETED", "object": obj("b", 10)}]]
    inf = informer(server, events).start()
    try:
        assert inf.wait_synced(2)
        wait(server.idle.is_set)
        assert events == [("ADDED", "a"), ("ADDED", "b"), ("MODIFIED", "a"), ("DELETED", "b")]
        assert [o["metadata"]["name"] for o in inf.items()] == ["a"]
        assert "managedFields" not in inf.get("ml", "a")["metadata"]
        # the second watch resumes from the last resourceVersion seen (the DELETED event's), no new listing
        assert server.watch_rvs == ["1", "10"] and server.lists == 1
    finally:
        inf.stop()


def test_410_gone_relists_and_delivers_what_happened_in_the_gap():
    server, events = FakeServer(), []
    server.put("a")
    server.put("b")
    server.scripts = [[{"type": "ERROR", "object": {"code": 410, "message": "too old resource version"}}]]
    inf = informer(server, events)

    # while the watch was away: b deleted, a changed, c created
    def gap(limit, cont, real=server.list_page):
        if server.lists == 1:
            del server.objects["b"]
            server.put("a")
            server.put("c")
        return real(limit, cont)
    inf._list_page = gap
    inf.start()
    try:
        wait(server.idle.is_set)
        assert server.lists == 2
        assert events[:2] == [("ADDED", "a"), ("ADDED", "b")]
        assert sorted(events[2:]) == [("ADDED", "c"), ("DELETED", "b"), ("MODIFIED", "a")]
        assert sorted(k[1] for k in inf.keys()) == ["a", "c"]
    finally:
        inf.stop()


def test_http_410_on_resume_also_relists():
    server, events = FakeServer(), []
    server.put("a")
    server.scripts = [[], ApiException(status=410, reason="Gone")]
    inf = informer(server, events).start()
    try:
        wait(server.idle.is_set)
        assert server.lists == 2 and events == [("ADDED", "a")]  # nothing changed: no event
    finally:
        inf.stop()


def test_not_served_kind_waits_quietly_then_lists(caplog):
    server, events = FakeServer(), []
    server.list_error = ApiException(status=404, reason="Not Found")
    inf = informer(server, events).start()
    try:
        wait(lambda: inf.waiting_reason is not None)
        time.sleep(0.2)  # several quiet retries
        assert not inf.synced and not [r for r in caplog.records if r.levelname in ("WARNING", "ERROR")]
        server.list_error = None
        server.put("late")
        assert inf.wait_synced(2)
        wait(lambda: events == [("ADDED", "late")])
    finally:
        inf.stop()


def test_own_writes_do_not_come_back_as_events():
    """resourceVersions are opaque (compared for equality only): what is newer comes from the watch's order."""
    server, events = FakeServer(), []
    inf = informer(server, events)
    inf._replace([obj("a", 1)])
    inf.put(obj("a", 5))  # the API server's answer to our apply, stored before its watch event arrives
    inf._apply_event("MODIFIED", obj("a", 3))  # someone's change made before our write, delivered after its answer
    assert inf.get("ml", "a")["metadata"]["resourceVersion"] == "5"  # not regressed
    inf._apply_event("MODIFIED", obj("a", 5))  # our write's own event
    assert events == [("ADDED", "a")]
    inf._apply_event("MODIFIED", obj("a", 6))  # someone else's change
    assert events == [("ADDED", "a"), ("MODIFIED", "a")]
    assert inf.get("ml", "a")["metadata"]["resourceVersion"] == "6"
    inf.put(obj("a", 5))  # an answer the watch delivered already (and something newer since): stale
    assert inf.get("ml", "a")["metadata"]["resourceVersion"] == "6"
    # versions need not be numbers, nor grow
    inf._apply_event("MODIFIED", obj("a", "zz"))
    inf.put(obj("a", "aa"))
    inf._apply_event("MODIFIED", obj("a", "aa"))
    assert inf.get("ml", "a")["metadata"]["resourceVersion"] == "aa"
    assert events == [("ADDED", "a"), ("MODIFIED", "a"), ("MODIFIED", "a")]


def with_uid(o, uid):
    o["metadata"]["uid"] = uid
    return o


def test_a_write_answered_after_the_objects_deletion_does_not_bring_it_back():
    """The race of CI's 2026-12-05 failure: the operator writes a status (rv 5), the user deletes the object (rv 6),
    the watch delivers the deletion, then the write's answer reaches the cache. The object stays gone (it used to
    come back for good: its service was reconciled forever, its children recreated after each collection)."""
    server, events = FakeServer(), []
    inf = informer(server, events)
    inf._replace([with_uid(obj("a", 4), "uid-a"), with_uid(obj("b", 4), "uid-b")])
    inf._apply_event("MODIFIED", with_uid(obj("a", 5), "uid-a"))
    inf._apply_event("DELETED", with_uid(obj("a", 6), "uid-a"))
    inf.put(with_uid(obj("a", 5), "uid-a"))
    assert inf.get("ml", "a") is None
    # the same when the deletion is seen by a listing (after a 410): b was deleted in the gap
    inf._replace([with_uid(obj("a", 8), "uid-a2")])
    inf.put(with_uid(obj("b", 7), "uid-b"))
    assert inf.get("ml", "b") is None
    # an object created anew under a deleted one's name is stored (a new uid), and so is our own delete's
    # object when it is created again
    inf.put(with_uid(obj("b", 11), "uid-b2"))
    assert inf.get("ml", "b")["metadata"]["resourceVersion"] == "11"
    inf.drop("ml", "b")
    inf.put(with_uid(obj("b", 10), "uid-b2"))  # a late answer to a write before our delete
    assert inf.get("ml", "b") is None


class LiveKube:
    def __init__(self):
        self.calls = []
        self.writes = 0

    def get(self, *a):
        self.calls.append(("get",) + a)
        return None

    def list(self, *a):
        self.calls.append(("list",) + a)
        return []

    def apply(self, o, manager="embedops", dry_run=False):
        self.calls.append(("apply", o["metadata"]["name"], dry_run))
        out = dict(o, metadata=dict(o["metadata"], resourceVersion="7"))
        return out


def test_cached_kube_reads_the_cache_once_synced_and_writes_through():
    server, events = FakeServer(), []
    server.put("a", app="x")
    server.put("b", app="y")
    inf = informer(server, events)
    inf.namespace, inf.label_filter = None, {}
    live = LiveKube()
    ck = CachedKube(live)
    ck.informers[("v1", "Service")] = [inf]
    assert ck.get("v1", "Service", "ml", "a") is None and live.calls  # not synced yet: the API answers
    live.calls.clear()
    inf.start()
    try:
        assert inf.wait_synced(2)
        assert ck.get("v1", "Service", "ml", "a")["metadata"]["name"] == "a"
        assert [o["metadata"]["name"] for o in ck.list("v1", "Service", "ml", "app=y")] == ["b"]
        assert ck.list("v1", "Service", "other") == []
        assert live.calls == []
        ck.apply(obj("c", 0))
        assert ck.get("v1", "Service", "ml", "c")["metadata"]["resourceVersion"] == "7"
        ck.apply(obj("d", 0), dry_run=True)
        assert ck.get("v1", "Service", "ml", "d") is None
    finally:
        inf.stop()


def test_work_queue_merges_and_never_runs_a_key_twice_at_once():
    q = WorkQueue()
    q.add(("ml", "a"), full=False)
    q.add(("ml", "a"), full=True)
    q.add(("ml", "b"), full=False)
    assert q.get(0) == (("ml", "a"), True)
    q.add(("ml", "a"), full=False)  # while a is worked on: runs again after, not in parallel
    assert q.get(0) == (("ml", "b"), False)
    assert q.get(0) is None
    q.done(("ml", "a"))
    assert q.get(0) == (("ml", "a"), False)
    q.done(("ml", "a"), ok=False)  # failed: back after a backoff
    assert q.get(0) is None
    assert q.get(2) == (("ml", "a"), True)
    q.close()
    assert q.get() is None


def test_iter_lines_and_selectors():
    assert list(W.iter_lines([b'{"a"', b':1}\n{"b":2}\n', b'{"c":3}'])) == [b'{"a":1}', b'{"b":2}', b'{"c":3}']
    assert W.parse_selector("a=b,c=d") == {"a": "b", "c": "d"}
    assert W.matches(obj("x", 1, a="b"), {"a": "b"}) and not W.matches(obj("x", 1), {"a": "b"})


def test_label_index_follows_changes_and_serves_selector_lists():
    server, events = FakeServer(), []
    inf = informer(server, events)
    inf.index_label, inf.namespace, inf.label_filter = "svc", None, {}
    inf._replace([obj("a-dep", 1, svc="a"), obj("b-dep", 2, svc="b"), obj("plain", 3)])
    assert [o["metadata"]["name"] for o in inf.indexed("ml", "a")] == ["a-dep"]
    inf._apply_event("MODIFIED", obj("b-dep", 4, svc="a"))  # relabelled: moves in the index
    assert sorted(o["metadata"]["name"] for o in inf.indexed("ml", "a")) == ["a-dep", "b-dep"]
    assert inf.indexed("ml", "b") == []
    inf._apply_event("DELETED", obj("a-dep", 5, svc="a"))
    inf.put(obj("c-dep", 6, svc="a"))
    assert sorted(o["metadata"]["name"] for o in inf.indexed("ml", "a")) == ["b-dep", "c-dep"]
    assert inf.indexed("other", "a") == []
    inf._synced.set()
    ck = CachedKube(LiveKube())
    ck.informers[("v1", "Service")] = [inf]
    assert [o["metadata"]["name"] for o in ck.list("v1", "Service", "ml", "svc=a")] == ["b-dep", "c-dep"]
    assert [o["metadata"]["name"] for o in ck.list("v1", "Service", None, "svc=a")] == ["b-dep", "c-dep"]
    inf._replace([obj("plain", 7)])
    assert inf.indexed("ml", "a") == [] and inf._index == {}


def test_objects_are_held_encoded_read_as_new_dicts_and_listed_page_by_page():
    """Issue 58: the cache holds bytes, not the fleet's dicts: every read is a new dict (editing it changes nothing
    cached), versions are read without decoding, and a listing's pages are transformed as they arrive (a restart
    never holds every object whole)."""
    transformed_before_page: list[int] = []
    seen = {"transformed": 0}

    def transform(o):
        seen["transformed"] += 1
        return W.strip_managed_fields(o)

    pages = [[obj("a", 1, svc="a"), obj("b", 2, svc="b")], [obj("c", 3, svc="a")], [obj("d", 4)]]

    def list_page(limit, cont):
        i = int(cont or 0)
        transformed_before_page.append(seen["transformed"])
        return pages[i], "4", str(i + 1) if i + 1 < len(pages) else None

    inf = W.Informer("svc", list_page, lambda *a: iter(()), transform=transform, index_label="svc")
    inf._list()
    assert transformed_before_page == [0, 2, 3]  # page 1's objects were encoded before page 2 was asked for
    assert inf.size() == 4 and inf.stored_bytes() > 0
    got = inf.get("ml", "a")
    got["metadata"]["labels"]["svc"] = "edited"
    got["spec"] = {"edited": True}
    assert inf.get("ml", "a") == {k: v for k, v in obj("a", 1, svc="a").items()} | {
        "metadata": {k: v for k, v in obj("a", 1, svc="a")["metadata"].items() if k != "managedFields"}}
    assert inf.get("ml", "a") is not inf.get("ml", "a")
    assert inf.indexed_versions("ml", "a") == [("a", "1"), ("c", "3")]
    assert inf.version("ml", "d") == "4" and inf.version("ml", "zz") is None
    assert [o["metadata"]["name"] for o in inf.items("ml", {"svc": "b"})] == ["b"]
    assert sorted(o["metadata"]["name"] for o in inf.indexed("ml", "a", {"svc": "a"})) == ["a", "c"]
    # a relabel moves the object in the index without a decode of the old one
    inf._apply_event("MODIFIED", obj("c", 5, svc="b"))
    assert inf.indexed_versions("ml", "b") == [("b", "2"), ("c", "5")]


def test_listed_items_carry_their_apiversion_and_kind():
    """The items of a list response have no apiVersion and kind (the list carries them); a watch event's object
    has both. A cached child without them never equals its rendered manifest: a restarted operator (its caches
    filled by a listing, not by watch events) applied every Deployment and Service again (issue 58's benchmark,
    2,914 Deployment applies at 1,000 services)."""
    from kubernetes import client as k8s

    from embedops_operator.runtime.client import Client

    class Deployments(Client):
        plurals = {("apps/v1", "Deployment"): "deployments"}

    c = Deployments(k8s.ApiClient(k8s.Configuration()))
    answer = {"apiVersion": "apps/v1", "kind": "DeploymentList", "metadata": {"resourceVersion": "9"},
              "items": [{"metadata": {"name": "a", "namespace": "ml"}, "spec": {}}]}
    c.request = lambda *a, **kw: json.loads(json.dumps(answer))
    items, rv, cont = c.lister("apps/v1", "Deployment", "ml")(500, None)
    assert (rv, cont) == ("9", None)
    assert items[0]["apiVersion"] == "apps/v1" and items[0]["kind"] == "Deployment"
    assert c.list("apps/v1", "Deployment", "ml")[0]["kind"] == "Deployment"
