"""The reconciler's view of the cluster: reads from watch caches, writes to the API server.

`CachedKube` has the interface of `client.Client` (get, list, apply, delete, patch_status, capabilities), so the
reconciler does not know whether it reads a cache. A kind whose informer has synced is read from memory; a
kind without one, or whose informer has not listed yet (CRD not installed, no watch permission), is read
from the API server as before. What the API server returns for our own writes is stored in the cache at
once, so the next reconcile sees it even before the watch event arrives, and the event then changes nothing.
"""
from __future__ import annotations

from typing import Callable

from . import watchcache

KindKey = tuple[str, str]  # (apiVersion, kind)


class CachedKube:
    def __init__(self, kube, on_capabilities: Callable[[frozenset], None] | None = None):
        self.kube = kube
        self.informers: dict[KindKey, list[watchcache.Informer]] = {}  # one per watched namespace, or one cluster-wide
        self.on_capabilities = on_capabilities

    # ------------------------------------------------------------------ which informer
    def _synced(self, api_version: str, kind: str, namespace: str | None) -> list[watchcache.Informer] | None:
        """The synced informers covering `namespace` (None: all), or None when the cache cannot answer."""
        informers = self.informers.get((api_version, kind))
        if not informers or not all(i.synced for i in informers):
            return None
        return informers

    def informer_for(self, api_version: str, kind: str, namespace: str | None) -> watchcache.Informer | None:
        for inf in self.informers.get((api_version, kind), []):
            if inf.namespace in (None, "", namespace):
                return inf
        return None

    # ------------------------------------------------------------------ reads
    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        informers = self._synced(api_version, kind, namespace)
        if informers is None:
            return self.kube.get(api_version, kind, namespace, name)
        for inf in informers:
            obj = inf.get(namespace, name)  # a new dict: callers may edit what they get
            if obj is not None and watchcache.matches(obj, inf.label_filter):
                return obj
        return None

    def get_from_server(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        return self.kube.get(api_version, kind, namespace, name)

    def get_any(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        """The object of that name whatever its labels. The informers hold only objects labelled as the
        operator's, so a miss in a synced cache is asked of the API server: an object someone else created
        under that name has no such labels, and must be seen before the operator creates its own."""
        if self._synced(api_version, kind, namespace) is None:
            return self.kube.get(api_version, kind, namespace, name)
        obj = self.get(api_version, kind, namespace, name)
        return obj if obj is not None else self.kube.get(api_version, kind, namespace, name)

    def list(self, api_version: str, kind: str, namespace: str | None, selector: str | None = None) -> list[dict]:
        informers = self._synced(api_version, kind, namespace)
        if informers is None:
            return self.kube.list(api_version, kind, namespace, selector)
        want = watchcache.parse_selector(selector)
        out = []
        for inf in informers:
            value = want.get(inf.index_label) if inf.index_label and namespace else None
            out += inf.indexed(namespace, value, want) if value is not None else inf.items(namespace, want)
        return sorted(out, key=lambda o: watchcache.key_of(o))

    # ------------------------------------------------------------------ writes (through to the cache)
    def apply(self, obj: dict, manager: str | None = None, dry_run: bool = False, force: bool = True) -> dict:
        kwargs = {"dry_run": dry_run} | ({"manager": manager} if manager else {}) | ({} if force else {"force": False})
        out = self.kube.apply(obj, **kwargs)
        if not dry_run and out:
            self._put(out)
        return out

    def patch_status(self, resource: dict, status: dict) -> dict:
        out = self.kube.patch_status(resource, status)
        if out:
            self._put(out)
        return out

    def event(self, obj: dict, kind: str, reason: str, message: str) -> None:
        self.kube.event(obj, kind, reason, message)

    def delete(self, api_version: str, kind: str, namespace: str, name: str, uid: str | None = None) -> None:
        self.kube.delete(api_version, kind, namespace, name, uid=uid)
        inf = self.informer_for(api_version, kind, namespace)
        if inf is not None:
            inf.drop(namespace, name)

    def _put(self, obj: dict) -> None:
        meta = obj.get("metadata") or {}
        inf = self.informer_for(obj.get("apiVersion", ""), obj.get("kind", ""), meta.get("namespace"))
        if inf is not None and watchcache.matches(obj, inf.label_filter):
            inf.put(obj)

    # ------------------------------------------------------------------ discovery and counters
    def capabilities(self) -> frozenset:
        caps = self.kube.capabilities()
        if self.on_capabilities is not None:
            self.on_capabilities(caps)
        return caps

    def forget_capabilities(self) -> None:
        self.kube.forget_capabilities()

    @property
    def writes(self) -> int:
        return self.kube.writes
