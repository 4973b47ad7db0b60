"""Watch caches: one list+watch per kind (and namespace), kept in memory and read instead of the API server.

An `Informer` lists a kind once, then watches from the list's resourceVersion with bookmarks, so at rest it
sends one request per watch renewal (the server ends a watch after `timeoutSeconds`, 5-10 minutes here) and
nothing else. Each change of the cache calls `on_event(type, obj)` from the informer's thread: the object as it
is now, or as the cache last held it for DELETED (the version before a change is not decoded: nothing reads it).

- A watch that ends (timeout, dropped connection) resumes from the last resourceVersion seen (bookmarks keep
  it fresh).
- A resourceVersion the server no longer has (410 Gone, as an HTTP status or an ERROR event) means events
  were missed: the kind is listed again and the listing is compared with the cache, so an object deleted in
  the gap produces its DELETED event and one changed in the gap its MODIFIED event. Nothing is lost.
- A kind the server does not serve (404: its CRD is not installed yet) or may not be read (403) is retried
  quietly with a backoff up to `max_backoff`; the cache stays unsynced (readers fall back to the API) until
  a listing succeeds, and then delivers every object as ADDED.
- Writes of our own are stored with `put()` (the object the API server returned), so the watch event that
  follows carries the same resourceVersion and changes nothing: our writes do not come back as events.
- resourceVersions are opaque (the API conventions: compare them for equality only), so what is newer is told
  by the watch's order alone. The watch delivers each object's changes in order, so a write's answer is newer
  than the cache exactly when the watch has not delivered its version yet: `put()` stores it then, and until its
  event arrives the events for that object are older ones and change nothing. An answer whose version the watch
  already delivered is stale (the watch may have delivered newer ones since), and one for an object deleted
  since (its uid seen deleted: a status written just before a user deleted the EmbeddingService) is dropped:
  storing it kept a deleted object in the cache for good, its service reconciled forever and its children
  created again after each garbage collection (a CI failure of 2026-12-05, tests/integration/test_bad_manifests.py).

Objects are held as pickle bytes beside the few fields read without them (resourceVersion, uid, labels), and every
read returns a new dict (issue 58: a Deployment of 5.6 KB of JSON took 33 KB as Python dicts and 4.9 KB pickled; the
operator's memory grew by 75 KB per service on the way up and 140 KB after a restart, 783 MB at 5,000 services).
Decoding is also cheaper than the deep copy every reader made before (90 us against 550 us for a Deployment). A
listing is transformed and encoded page by page (LIST_PAGE objects), and with a `list_gate` shared by a process's
informers one kind lists at a time, so a restart holds one page of whole objects, never the fleet's.

The transport is two callables (see `Client.lister` / `Client.watcher` in client.py), so tests can fake it.
"""
from __future__ import annotations

import contextlib
import logging
import pickle
import random
import sys
import threading
import time
from collections import OrderedDict
from typing import Callable, Iterable, Iterator

log = logging.getLogger("embedops.watchcache")

Key = tuple[str, str]  # (namespace, name)
EventFn = Callable[[str, dict], None]


class Gone(Exception):
    """The resourceVersion a watch started from is too old (HTTP 410 or a 410 ERROR event)."""


def key_of(obj: dict) -> Key:
    meta = obj.get("metadata") or {}
    return meta.get("namespace") or "", meta.get("name") or ""


RECENT_VERSIONS = 8  # versions per object the watch delivered, remembered to recognize a stale write answer
GONE_UIDS = 4096  # uids of deleted objects, remembered to drop late write answers for them
PENDING_SECONDS = 30.0  # how long a stored write answer waits for its watch event before events apply again
# Objects per page of a listing: a listing holds one page of whole objects at a time. With 1,000 services present
# (informers listing side by side) a restarted operator peaked at 201 MB with pages of 500, 119 MB with 100, 110 MB
# with 50 (95 MB through the ramp; 2026-12-07, bench/operator_bench.py's cluster); 100 keeps most of the gain for
# half the requests of 50 (a restart at 5,000 services: 50 pages per kind).
LIST_PAGE = 100


class Entry:
    """One cached object: what the cache reads without decoding it, and the object as pickle bytes (objects come
    from JSON and from the operator itself: only dicts, lists, strings, numbers, booleans and None)."""
    __slots__ = ("rv", "uid", "labels", "blob")

    def __init__(self, obj: dict):
        meta = obj.get("metadata") or {}
        self.rv: str | None = meta.get("resourceVersion") or None  # opaque: compared for equality only
        self.uid: str | None = meta.get("uid") or None
        # interned: the same few label keys and a service's name repeat across every object of a fleet
        self.labels: dict[str, str] = {sys.intern(str(k)): sys.intern(str(v))
                                       for k, v in (meta.get("labels") or {}).items()}
        self.blob = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)

    def object(self) -> dict:
        """A new dict each time: callers may edit what they get."""
        return pickle.loads(self.blob)

    def matches(self, want: dict[str, str] | None) -> bool:
        return not want or all(self.labels.get(k) == v for k, v in want.items())


def strip_managed_fields(obj: dict) -> dict:
    meta = obj.get("metadata")
    if meta and "managedFields" in meta:
        obj["metadata"] = {k: v for k, v in meta.items() if k != "managedFields"}
    return obj


class Informer:
    """The cache of one kind in one namespace ('' or None: all), optionally filtered by a label selector."""

    def __init__(self, name: str, list_page: Callable, watch_stream: Callable, *, on_event: EventFn | None = None,
                 transform: Callable[[dict], dict] = strip_managed_fields, page_size: int = LIST_PAGE,
                 watch_timeout: float = 300.0, max_backoff: float = 30.0, namespace: str | None = None,
                 selector: str | None = None, index_label: str | None = None, health=None,
                 list_gate: threading.Semaphore | None = None):
        self.name = name
        # shared by the informers of one process: one listing at a time, so a restart holds one page of whole
        # objects, not one per kind (the listings are short; the watches run side by side)
        self.list_gate = list_gate
        # objects by (namespace, value of this label): a service's children without scanning them all
        self.index_label = index_label
        self._index: dict[tuple[str, str], set[Key]] = {}
        self.namespace = namespace  # what the transport covers (None: all namespaces), for readers
        self.label_filter = parse_selector(selector)  # the transport's label selector, for readers
        self._list_page = list_page  # (limit, continue) -> (items, resourceVersion, continue)
        self._watch_stream = watch_stream  # (resourceVersion, timeout_s, on_open) -> iterator of raw events
        self.on_event = on_event
        self.transform = transform
        self.page_size = page_size
        self.watch_timeout = watch_timeout
        self.max_backoff = max_backoff
        self._items: dict[Key, Entry] = {}
        self._lock = threading.Lock()
        self._rv: str | None = None
        # what tells a write's answer from the watch's order (see put): the versions the watch delivered per
        # object, the uids of objects deleted, and the answers stored before their event (key -> version, when)
        self._recent: dict[Key, tuple[str, ...]] = {}
        self._gone: OrderedDict[str, None] = OrderedDict()
        self._pending: dict[Key, tuple[str, float]] = {}
        self._stop = threading.Event()
        self._wake = threading.Event()  # ends a retry back-off early (the API server is reachable again)
        # client.ApiHealth or None: failures that mean "API server unavailable" are reported there (one
        # rate-limited line for the whole operator) instead of a warning per informer per retry
        self.health = health
        self._synced = threading.Event()
        self._closer: Callable[[], None] | None = None
        self._thread: threading.Thread | None = None
        self.lists = 0  # listings done (the first, and one per 410 or failed resume)
        self.watches = 0  # watch requests opened
        self.waiting_reason: str | None = None  # why it is not synced (404/403), for logs and tests

    # ------------------------------------------------------------------ reading
    @property
    def synced(self) -> bool:
        return self._synced.is_set()

    def wait_synced(self, timeout: float | None = None) -> bool:
        return self._synced.wait(timeout)

    def get(self, namespace: str, name: str) -> dict | None:
        with self._lock:
            entry = self._items.get((namespace or "", name))
        return entry.object() if entry is not None else None

    def version(self, namespace: str, name: str) -> str | None:
        """The cached object's resourceVersion (None: not cached), without decoding it."""
        with self._lock:
            entry = self._items.get((namespace or "", name))
        return entry.rv if entry is not None else None

    def items(self, namespace: str | None = None, labels: dict[str, str] | None = None) -> list[dict]:
        """The objects in `namespace` (None or '': all) that carry `labels`; only those are decoded."""
        with self._lock:
            entries = [e for (ns, _), e in self._items.items() if namespace in (None, "", ns) and e.matches(labels)]
        return [e.object() for e in entries]

    def keys(self) -> list[Key]:
        with self._lock:
            return list(self._items)

    def size(self) -> int:
        with self._lock:
            return len(self._items)

    def stored_bytes(self) -> int:
        """The bytes of the encoded objects (their labels and bookkeeping aside), for the operator's metrics."""
        with self._lock:
            return sum(len(e.blob) for e in self._items.values())

    def _indexed_entries(self, namespace: str, value: str) -> list[tuple[Key, Entry]]:
        return [(k, self._items[k]) for k in self._index.get((namespace or "", value), ()) if k in self._items]

    def indexed(self, namespace: str, value: str, labels: dict[str, str] | None = None) -> list[dict]:
        """Objects in `namespace` whose `index_label` is `value` (and that carry `labels`)."""
        with self._lock:
            entries = [e for _, e in self._indexed_entries(namespace, value) if e.matches(labels)]
        return [e.object() for e in entries]

    def indexed_versions(self, namespace: str, value: str) -> list[tuple[str, str | None]]:
        """(name, resourceVersion) of the objects `indexed` returns, without decoding them (resync fingerprints)."""
        with self._lock:
            return sorted((k[1], e.rv) for k, e in self._indexed_entries(namespace, value))

    # the index follows every change of _items (callers hold the lock)
    def _label(self, entry: Entry | None) -> str | None:
        if entry is None or not self.index_label:
            return None
        return entry.labels.get(self.index_label)

    def _set(self, k: Key, obj: Entry | None) -> None:
        old = self._items.get(k)
        before, after = self._label(old), self._label(obj)
        if before is not None and before != after:
            keys = self._index.get((k[0], before))
            if keys is not None:
                keys.discard(k)
                if not keys:
                    del self._index[(k[0], before)]
        if obj is None:
            self._items.pop(k, None)
        else:
            self._items[k] = obj
        if after is not None:
            self._index.setdefault((k[0], after), set()).add(k)

    # ------------------------------------------------------------------ our own writes
    def put(self, obj: dict) -> None:
        """Store an object the API server returned for our write, unless the watch delivered that version
        already (the cache holds it, or something newer) or the object was deleted since. Storing nothing is
        always safe: the watch delivers the object's newest version anyway; storing a stale one is not."""
        obj = self.transform(obj)
        k = key_of(obj)
        entry = Entry(obj)
        rv = entry.rv
        with self._lock:
            if entry.uid in self._gone or (rv is not None and rv in self._recent.get(k, ())):
                return
            self._set(k, entry)
            if rv is not None:
                self._pending[k] = (rv, time.monotonic())

    def drop(self, namespace: str, name: str) -> None:
        """Our own delete: the object leaves the cache, and a late answer to an earlier write cannot bring it back."""
        k = (namespace or "", name)
        with self._lock:
            old = self._items.get(k)
            self._forget(k, old.uid if old is not None else None)
            self._set(k, None)

    # the bookkeeping of put (callers hold the lock)
    def _delivered(self, k: Key, rv: str | None) -> None:
        if rv is not None:  # a tuple: a deque of 8 took 624 bytes per object
            self._recent[k] = (self._recent.get(k, ()) + (rv,))[-RECENT_VERSIONS:]

    def _forget(self, k: Key, uid: str | None) -> None:
        self._recent.pop(k, None)
        self._pending.pop(k, None)
        if uid is not None:
            self._gone[uid] = None
            while len(self._gone) > GONE_UIDS:
                self._gone.popitem(last=False)

    # ------------------------------------------------------------------ applying changes
    def _emit(self, etype: str, obj: dict) -> None:
        if self.on_event is None:
            return
        try:
            self.on_event(etype, obj)
        except Exception:  # noqa: BLE001 - a handler bug must not stop the cache
            log.exception("%s: event handler failed", self.name)

    def _apply_event(self, etype: str, obj: dict) -> None:
        obj = self.transform(obj)
        k = key_of(obj)
        entry = Entry(obj)
        with self._lock:
            old = self._items.get(k)
            if etype == "DELETED":
                self._forget(k, (old or entry).uid)
                self._set(k, None)
            else:
                rv = entry.rv
                self._delivered(k, rv)
                pending = self._pending.get(k)
                if pending is not None and time.monotonic() - pending[1] < PENDING_SECONDS:
                    if rv == pending[0]:
                        del self._pending[k]  # our own write's event: the cache holds it already
                    return  # or a change older than our write, whose answer the cache holds
                self._pending.pop(k, None)
                if old is not None and rv is not None and rv == old.rv:
                    return  # the version the cache holds
                self._set(k, entry)
        if self.on_event is None:
            return
        if etype == "DELETED":
            self._emit("DELETED", old.object() if old is not None else obj)
        else:
            self._emit("ADDED" if old is None else "MODIFIED", obj)

    def _replace(self, listed: Iterable[dict]) -> None:
        """A fresh listing: the cache becomes exactly it; the differences are delivered as events. `listed` is
        consumed one object at a time (a listing's pages: each is transformed and encoded before the next)."""
        fresh: dict[Key, Entry] = {}
        for raw in listed:
            obj = self.transform(raw)
            fresh[key_of(obj)] = Entry(obj)
        with self._lock:
            old_items, self._items, self._index = self._items, {}, {}
            self._pending.clear()  # the listing is the truth now (a write after it arrives by the watch)
            for k, old in old_items.items():
                if k not in fresh or fresh[k].uid != old.uid:
                    self._forget(k, old.uid)  # deleted in the gap (or deleted and created again)
            for k, entry in fresh.items():
                self._set(k, entry)
                self._delivered(k, entry.rv)
        if self.on_event is None:
            return
        for k, old in old_items.items():
            if k not in fresh:
                self._emit("DELETED", old.object())
        for k, entry in fresh.items():
            old = old_items.get(k)
            if old is None:
                self._emit("ADDED", entry.object())
            elif old.rv is None or entry.rv != old.rv:
                self._emit("MODIFIED", entry.object())

    # ------------------------------------------------------------------ the loop
    def start(self) -> "Informer":
        self._thread = threading.Thread(target=self._run, name=f"informer {self.name}", daemon=True)
        self._thread.start()
        return self

    def wake(self) -> None:
        """Retry now if waiting out a back-off (a no-op while watching)."""
        self._wake.set()

    def stop(self, join: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        closer = self._closer
        if closer:
            try:
                closer()
            except Exception:  # noqa: BLE001 - best effort: the watch times out anyway
                pass
        if self._thread and self._thread is not threading.current_thread():
            self._thread.join(join)

    def _list(self) -> None:
        listed: dict[str, str] = {}

        def pages() -> Iterator[dict]:
            cont = None
            while True:
                page, listed["rv"], cont = self._list_page(self.page_size, cont)
                yield from page
                if not cont:
                    return
        with self.list_gate or contextlib.nullcontext():
            self._replace(pages())
        self.lists += 1
        self._rv = listed["rv"]
        if self.waiting_reason:
            log.info("%s: listed after waiting (%s)", self.name, self.waiting_reason)
            self.waiting_reason = None
        self._synced.set()

    def _watch(self) -> None:
        """One watch request from the last resourceVersion until the server ends it."""
        self.watches += 1
        timeout = self.watch_timeout * (1 + random.random())  # spread the renewals of many informers

        def opened(closer: Callable[[], None]) -> None:
            self._closer = closer
        try:
            for event in self._watch_stream(self._rv, timeout, opened):
                if self._stop.is_set():
                    return
                etype, obj = event.get("type"), event.get("object") or {}
                if etype == "ERROR":
                    if obj.get("code") == 410:
                        raise Gone(obj.get("message", "resourceVersion too old"))
                    raise RuntimeError(f"watch error: {obj}")
                rv = (obj.get("metadata") or {}).get("resourceVersion")
                if etype in ("ADDED", "MODIFIED", "DELETED"):
                    self._apply_event(etype, obj)
                if rv:
                    self._rv = rv  # BOOKMARK events only move this
        finally:
            self._closer = None

    def _run(self) -> None:
        backoff = 0.5
        need_list = True
        while not self._stop.is_set():
            try:
                if need_list:
                    self._list()
                    need_list = False
                self._watch()
                backoff = 0.5
            except Gone:
                log.debug("%s: resourceVersion expired, listing again", self.name)
                need_list = True
            except Exception as exc:  # noqa: BLE001 - retried with a backoff
                if self._stop.is_set():
                    return
                status = getattr(exc, "status", None)
                if status == 410:
                    need_list = True
                    continue
                if status in (403, 404):
                    reason = "not served (CRD not installed?)" if status == 404 else "forbidden"
                    if self.waiting_reason != reason:
                        log.info("%s: %s; retrying quietly", self.name, reason)
                    self.waiting_reason = reason
                    if self._synced.is_set():  # the kind went away: so did its objects
                        self._synced.clear()
                        self._replace([])
                    need_list = True
                else:
                    if self.health is not None and self.health.failed(exc):
                        log.debug("%s: %s; retrying in %.0f s", self.name, short_error(exc), backoff)
                    else:
                        log.warning("%s: %s; retrying in %.0f s", self.name, short_error(exc), backoff)
                    # resume from the last resourceVersion; a 410 then makes it list again
                    need_list = need_list or self._rv is None
                self._wake.wait(backoff * (0.5 + random.random()))
                self._wake.clear()
                backoff = min(backoff * 2, self.max_backoff)


def short_error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def parse_selector(selector: str | None) -> dict[str, str]:
    """Equality-based label selector 'a=b,c=d' (the only form the operator uses)."""
    return dict(p.split("=", 1) for p in selector.split(",") if p) if selector else {}


def matches(obj: dict, want: dict[str, str]) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in want.items())


def iter_lines(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """Newline-delimited frames from a byte stream (a watch response)."""
    buf = b""
    for chunk in chunks:
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            if line.strip():
                yield line
    if buf.strip():
        yield buf
