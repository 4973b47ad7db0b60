"""leader.py's Lease election against an in-memory Lease store with the API server's optimistic concurrency
(resourceVersion checked on replace, 409 on a stale one or on a second create). The real-cluster takeover is
tests/integration/test_operator_ha.py."""
from __future__ import annotations

import copy

import pytest
from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from embedops_operator.runtime.leader import ElectionConfig, Elector


class FakeLeases:
    def __init__(self):
        self.lease: k8s.V1Lease | None = None
        self.rv = 0
        self.calls: list[str] = []
        self.down = False

    def _check(self, verb):
        self.calls.append(verb)
        if self.down:
            raise ConnectionRefusedError("connection refused")

    def read_namespaced_lease(self, name, namespace, **_):
        self._check("get")
        if self.lease is None:
            raise ApiException(status=404, reason="Not Found")
        return copy.deepcopy(self.lease)

    def _store(self, body):
        self.rv += 1
        body = copy.deepcopy(body)
        body.metadata.resource_version = str(self.rv)
        self.lease = body
        return copy.deepcopy(body)

    def create_namespaced_lease(self, namespace, body, **_):
        self._check("create")
        if self.lease is not None:
            raise ApiException(status=409, reason="AlreadyExists")
        return self._store(body)

    def replace_namespaced_lease(self, name, namespace, body, **_):
        self._check("put")
        if self.lease is None:
            raise ApiException(status=404, reason="Not Found")
        if body.metadata.resource_version != self.lease.metadata.resource_version:
            raise ApiException(status=409, reason="Conflict")
        return self._store(body)


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def elector(store, clock, identity, **kw) -> Elector:
    for key, value in (("lease_duration", 10), ("renew_deadline", 7), ("retry_period", 2)):  # the tests' arithmetic
        kw.setdefault(key, value)
    e = Elector(k8s.ApiClient(), ElectionConfig(name="op", namespace="ns", identity=identity, **kw), clock=clock)
    e.api = store
    return e


def test_first_candidate_creates_and_second_follows_until_expiry():
    store, clock = FakeLeases(), Clock()
    a, b = elector(store, clock, "a"), elector(store, clock, "b")
    assert a.try_acquire_or_renew() and a.is_leader
    assert store.lease.spec.holder_identity == "a" and store.lease.spec.lease_duration_seconds == 10
    assert not b.try_acquire_or_renew() and b.holder == "a"
    # a renews: one PUT from its own last write, no GET
    store.calls.clear()
    clock.t += 2
    assert a.try_acquire_or_renew()
    assert store.calls == ["put"]
    # b sees the renewal, so its wait restarts from then (its own clock, not the Lease's timestamps)
    assert not b.try_acquire_or_renew()
    clock.t += 9.9
    assert not b.try_acquire_or_renew()
    clock.t += 0.2  # 10 s since b last saw the Lease change: expired
    assert b.try_acquire_or_renew() and b.is_leader
    assert store.lease.spec.holder_identity == "b" and store.lease.spec.lease_transitions == 1
    # the old leader's renewal from its stale resourceVersion conflicts; it re-reads and sees b
    assert not a.try_acquire_or_renew() and not a.is_leader and a.holder == "b"


def test_two_candidates_racing_for_an_expired_lease_one_wins():
    store, clock = FakeLeases(), Clock()
    old, a, b = elector(store, clock, "old"), elector(store, clock, "a"), elector(store, clock, "b")
    assert old.try_acquire_or_renew()
    assert not a.try_acquire_or_renew() and not b.try_acquire_or_renew()
    clock.t += 11
    # both read the same expired Lease; the first replace wins, the second is refused on resourceVersion
    lease = store.read_namespaced_lease("op", "ns")
    real_read = store.read_namespaced_lease
    store.read_namespaced_lease = lambda *a_, **k: copy.deepcopy(lease)
    assert a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew()
    store.read_namespaced_lease = real_read
    assert store.lease.spec.holder_identity == "a" and a.is_leader and not b.is_leader


def test_release_lets_a_follower_take_over_at_once():
    store, clock = FakeLeases(), Clock()
    a, b = elector(store, clock, "a"), elector(store, clock, "b")
    assert a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew()
    assert a.release() and not a.is_leader
    assert store.lease.spec.holder_identity is None
    assert b.try_acquire_or_renew()  # no wait for the duration


def test_api_errors_are_a_failed_attempt_not_an_exception():
    store, clock = FakeLeases(), Clock()
    a = elector(store, clock, "a")
    assert a.try_acquire_or_renew()
    store.down = True
    assert not a.try_acquire_or_renew()
    store.down = False
    assert a.try_acquire_or_renew() and store.lease.spec.holder_identity == "a"


async def test_keep_returns_after_the_renew_deadline_without_a_renewal():
    store = FakeLeases()
    import time

    a = Elector(k8s.ApiClient(), ElectionConfig(name="op", namespace="ns", identity="a", lease_duration=0.6,
                                                renew_deadline=0.4, retry_period=0.1), clock=time.monotonic)
    a.api = store
    assert a.try_acquire_or_renew()
    store.down = True
    t0 = time.monotonic()
    await a.keep()
    assert 0.35 < time.monotonic() - t0 < 0.6  # gave up before a follower could take the Lease


async def test_keep_returns_at_once_when_someone_else_holds_the_lease():
    store = FakeLeases()
    import time

    a = Elector(k8s.ApiClient(), ElectionConfig(name="op", namespace="ns", identity="a", lease_duration=3,
                                                renew_deadline=2, retry_period=0.1), clock=time.monotonic)
    a.api = store
    assert a.try_acquire_or_renew()
    store.lease.spec.holder_identity = "intruder"
    store.rv += 1
    store.lease.metadata.resource_version = str(store.rv)
    t0 = time.monotonic()
    await a.keep()
    assert time.monotonic() - t0 < 1


def test_settings_are_checked():
    with pytest.raises(ValueError):
        ElectionConfig(lease_duration=5, renew_deadline=5, retry_period=2).validate()
    with pytest.raises(ValueError):
        ElectionConfig(lease_duration=10, renew_deadline=2, retry_period=2).validate()


def test_release_after_a_renewal_it_did_not_see_retries_from_a_fresh_read():
    store, clock = FakeLeases(), Clock()
    a = elector(store, clock, "a")
    assert a.try_acquire_or_renew()
    stale = copy.deepcopy(a._lease)
    assert a.try_acquire_or_renew()      # a renewal the releasing code path has not seen
    a._lease = stale
    assert a.release()
    assert store.lease.spec.holder_identity is None


def test_a_write_past_the_renew_deadline_is_refused_before_it_is_sent():
    """Fencing: the elector's holds() is asked before every write the operator's client sends; reads and dry-runs
    go on (they change nothing)."""
    from embedops_operator import apply as A
    from embedops_operator.runtime.client import LeadershipLost

    sent = []

    class Api:
        def param_serialize(self, method, resource_path, query_params, header_params, body, auth_settings):
            return method, resource_path, header_params, body, None

        def call_api(self, method, url, **kw):
            sent.append((method, url))
            raise RuntimeError("stop here")  # what happens after sending is not this test's business

    clock = [100.0]
    elector = type("E", (), {})()
    cfg = ElectionConfig(lease_duration=15, renew_deadline=10, retry_period=2)
    elector.is_leader, elector.renewed_at, elector.config, elector.clock = True, 95.0, cfg, lambda: clock[0]
    holds = Elector.holds.__get__(elector)
    kube = A.Kube(Api())
    kube.fence = holds
    obj = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s", "namespace": "ml"}}
    with pytest.raises(RuntimeError, match="stop here"):  # within the deadline: sent
        kube.apply(obj)
    clock[0] = 105.5  # 10.5 s since the last renewal
    with pytest.raises(LeadershipLost):
        kube.apply(obj)
    with pytest.raises(LeadershipLost):
        kube.delete("v1", "Service", "ml", "s")
    with pytest.raises(RuntimeError, match="stop here"):
        kube.get("v1", "Service", "ml", "s")
    with pytest.raises(RuntimeError, match="stop here"):
        kube.apply(obj, dry_run=True)
    assert [m for m, _ in sent] == ["PATCH", "GET", "PATCH"]
