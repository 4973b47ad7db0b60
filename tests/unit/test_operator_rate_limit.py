"""The operator's own bound on its request rate to the API server (issue 58: 35,110 requests while a fleet of
5,000 services rolled out, with no bound but the API server's): a token bucket as client-go's, in front of every
request but watches and /readyz probes, set from --kube-api-qps/--kube-api-burst (the chart's kubeApi)."""
from __future__ import annotations

import threading

import pytest
from kubernetes import client as k8s

from embedops_operator.runtime.client import Client, TokenBucket
from embedops_operator.settings import OperatorSettings


class Clock:
    """Time that moves only when the bucket sleeps (or the test says so)."""

    def __init__(self):
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_a_burst_goes_at_once_then_one_request_per_slot():
    clock = Clock()
    bucket = TokenBucket(qps=10, burst=5, clock=clock, sleep=clock.sleep)
    waits = [bucket.take() for _ in range(8)]
    assert waits[:5] == [0, 0, 0, 0, 0]  # the burst
    assert waits[5:] == pytest.approx([0.1, 0.1, 0.1])  # then 10 a second, each after the previous one
    clock.now += 0.35  # idle: tokens come back at qps, up to the burst
    assert [bucket.take() for _ in range(3)] == [0, 0, 0]
    assert bucket.take() == pytest.approx(0.05)


def test_callers_in_parallel_are_spaced_and_none_is_lost():
    clock = Clock()  # time stands still (each caller's sleep recorded, not waited): the slots alone decide
    bucket = TokenBucket(qps=200, burst=2, clock=clock, sleep=clock.slept.append)
    waits: list[float] = []
    lock = threading.Lock()

    def call():
        w = bucket.take()
        with lock:
            waits.append(w)
    threads = [threading.Thread(target=call) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    # two at once, the other ten reserved their own slots 5 ms apart, none twice
    assert sorted(waits) == pytest.approx([0, 0] + [i / 200 for i in range(1, 11)])


def test_qps_must_be_positive():
    with pytest.raises(ValueError):
        TokenBucket(qps=0, burst=10)


class Recorder(Client):
    plurals = {("apps/v1", "Deployment"): "deployments"}


def test_every_request_but_watches_and_probes_waits_its_turn():
    c = Recorder(k8s.ApiClient(k8s.Configuration()))
    taken, throttled = [], []

    class Bucket:
        def take(self):
            taken.append(1)
            return 0.25

    class Answer:
        status, reason = 200, "OK"

        def read(self):
            return b"{}"
    c.limiter, c.on_throttle = Bucket(), throttled.append
    c.api.call_api = lambda *a, **kw: Answer()
    c.request("GET", "/apis/apps/v1/namespaces/ml/deployments/a")
    c.request("PATCH", "/apis/apps/v1/namespaces/ml/deployments/a", body={})
    c.request("GET", "/apis/apps/v1/namespaces/ml/deployments", query=[("watch", "true")])
    c.probe()
    assert len(taken) == 2 and throttled == [0.25, 0.25]
    assert c.requests["WATCH"] == 1 and c.requests["PATCH"] == 1


def test_the_settings_and_the_defaults(monkeypatch):
    from embedops_operator.controller import Controller

    class Kube(Recorder):
        pass
    monkeypatch.delenv("EMBEDOPS_KUBE_API_QPS", raising=False)
    s = OperatorSettings()
    assert (s.kube_api_qps, s.kube_api_burst) == (50.0, 100)  # kube-controller-manager's own
    kube = Kube(k8s.ApiClient(k8s.Configuration()))
    Controller(kube, s)
    assert (kube.limiter.qps, kube.limiter.burst) == (50.0, 100)
    monkeypatch.setenv("EMBEDOPS_KUBE_API_QPS", "0")
    off = Kube(k8s.ApiClient(k8s.Configuration()))
    Controller(off, OperatorSettings())
    assert off.limiter is None
