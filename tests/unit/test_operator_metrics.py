"""The operator's /metrics: what the chart's alerts and the dashboard read."""
from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from embedops_operator import metrics
from embedops_operator.workqueue import WorkQueue


class FakeController:
    def __init__(self):
        self.queue = WorkQueue()

    def services(self):
        return [{"metadata": {"namespace": "ml", "name": "bge"},
                 "spec": {"monitoring": {"p99LatencySeconds": 0.25}},
                 "status": {"replicas": 2, "readyReplicas": 1, "conditions": [
                     {"type": "Ready", "status": "False"}, {"type": "Stalled", "status": "True"}]}},
                {"metadata": {"namespace": "ml", "name": "plain"}, "spec": {}, "status": {}}]

    def pods_of(self, ns, name):
        if name != "bge":
            return []
        return [{"status": {"containerStatuses": [{"restartCount": 3}]}},
                {"status": {"containerStatuses": [{"restartCount": 1}, {"restartCount": 0}]}},
                # a model that cannot load crash-loops in the init container that prepares it
                {"status": {"initContainerStatuses": [{"restartCount": 5}], "containerStatuses": [{"restartCount": 0}]}}]


def samples() -> dict[tuple, float]:
    out = {}
    for fam in text_string_to_metric_families(generate_latest(metrics.REGISTRY).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_services_conditions_replicas_restarts_and_budget_come_from_the_controller():
    c = FakeController()
    c.queue.add(("ml", "bge"))
    metrics.watch(c)
    try:
        got = samples()
    finally:
        metrics.unwatch(c)

    def cond(t, status):
        return got[("embedops_service_condition",
                    (("namespace", "ml"), ("service", "bge"), ("status", status), ("type", t)))]
    assert (cond("Ready", "True"), cond("Ready", "False"), cond("Ready", "Unknown")) == (0, 1, 0)
    assert cond("Stalled", "True") == 1
    assert got[("embedops_service_replicas", (("namespace", "ml"), ("service", "bge"), ("state", "desired")))] == 2
    assert got[("embedops_service_replicas", (("namespace", "ml"), ("service", "bge"), ("state", "ready")))] == 1
    assert got[("embedops_service_pod_restarts", (("namespace", "ml"), ("service", "bge")))] == 9
    assert got[("embedops_service_p99_budget_seconds", (("namespace", "ml"), ("service", "bge")))] == 0.25
    assert ("embedops_service_p99_budget_seconds", (("namespace", "ml"), ("service", "plain"))) not in got
    assert got[("embedops_operator_workqueue_depth", ())] == 1
    assert got[("embedops_operator_leader", ())] == 1
    # every result is there from the start, at 0 or more
    assert all(("embedops_operator_reconciles_total", (("result", r),)) in got for r in ("ok", "retry", "error"))


def test_a_stopped_controller_is_not_reported():
    c = FakeController()
    metrics.watch(c)
    metrics.unwatch(c)
    got = samples()
    assert got[("embedops_operator_leader", ())] == 0
    assert not [k for k in got if k[0] == "embedops_service_condition"]


def test_queue_wait_is_observed_when_a_worker_takes_a_key():
    c = FakeController()
    metrics.watch(c)
    try:
        before = samples().get(("embedops_operator_workqueue_wait_seconds_count", ()), 0)
        c.queue.add(("ml", "x"))
        assert c.queue.get(timeout=1) == (("ml", "x"), True)
        assert samples()[("embedops_operator_workqueue_wait_seconds_count", ())] == before + 1
    finally:
        metrics.unwatch(c)
