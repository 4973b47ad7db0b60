"""The operator's /metrics: what the chart's alerts and the dashboard read."""
from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from embedops_operator import metrics
from embedops_operator.runtime.workqueue import WorkQueue


class FakeController:
    def __init__(self):
        self.queue = WorkQueue()

    def services(self):
        return [{"metadata": {"namespace": "ml", "name": "bge"},
                 "spec": {"monitoring": {"p99LatencySeconds": 0.25}},
                 "status": {"replicas": 2, "readyReplicas": 1, "conditions": [
                     {"type": "Ready", "status": "False"}, {"type": "Stalled", "status": "True"}]}},
                {"metadata": {"namespace": "ml", "name": "plain"}, "spec": {}, "status": {}}]

    def cached(self):
        return {"EmbeddingService": (2, 3000), "Pod": (3, 4500)}

    versions = {"bge": ("1", ("p1", "p2", "p3")), "plain": ("1", ())}
    loads: list[str] = []

    def service_states(self):
        def load(es):
            self.loads.append(es["metadata"]["name"])
            return es, self.pods_of("ml", es["metadata"]["name"])
        return [(("ml", es["metadata"]["name"]), self.versions[es["metadata"]["name"]], lambda es=es: load(es))
                for es in self.services()]

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


def test_a_scrape_decodes_only_the_services_that_changed_since_the_last():
    """Issue 58: every scrape decoded every cached EmbeddingService and its Pods (about a second of CPU at 5,000
    services); their figures are kept by the resourceVersions they came from."""
    c = FakeController()
    c.loads, c.versions = [], dict(FakeController.versions)
    metrics.watch(c)
    try:
        first = samples()
        assert sorted(c.loads) == ["bge", "plain"]
        # nothing decoded again (the process' own figures, its CPU time and memory, move between two scrapes)
        steady = lambda got: {k: v for k, v in got.items() if not k[0].startswith("process_")}  # noqa: E731
        assert steady(samples()) == steady(first) and sorted(c.loads) == ["bge", "plain"]
        c.versions["bge"] = ("1", ("p1", "p2", "p4"))  # one of its Pods changed
        samples()
        assert sorted(c.loads) == ["bge", "bge", "plain"]
    finally:
        metrics.unwatch(c)


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


def test_an_unreachable_api_server_answers_503_with_a_reason_and_is_asked_again_next_time():
    """/metrics under metrics.auth=kubernetes while the API server cannot be reached: a 503 that says why (not a
    500 with a traceback, not an open door), and nothing remembered, so the next scrape reviews again."""
    import urllib.error
    import urllib.request

    from kubernetes import client

    from embedops_operator.metrics_access import KubernetesAccessReview
    from localcluster.pki import free_port

    cfg = client.Configuration()
    cfg.host = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    cfg.retries = False
    access = KubernetesAccessReview(client.ApiClient(cfg))
    port = free_port()
    server = metrics.serve(f"127.0.0.1:{port}", access)
    try:
        for attempt in (1, 2):
            req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Authorization": "Bearer t"})
            try:
                urllib.request.urlopen(req, timeout=10)
                raise AssertionError("answered without a review")
            except urllib.error.HTTPError as e:
                assert e.code == 503, e.code
                assert "cannot review the token" in e.read().decode()
            assert access.reviews == attempt
        # without a token: 401 at once, no review
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10)
        except urllib.error.HTTPError as e:
            assert e.code == 401 and e.headers["WWW-Authenticate"].startswith("Bearer")
        assert access.reviews == 2
    finally:
        server.shutdown()
        server.server_close()


def test_without_access_control_metrics_are_served_to_anyone():
    import urllib.request

    from localcluster.pki import free_port

    port = free_port()
    server = metrics.serve(f"127.0.0.1:{port}")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            assert r.status == 200 and b"embedops_operator_leader" in r.read()
    finally:
        server.shutdown()
        server.server_close()


def test_the_caches_size_and_the_containers_memory_limit_are_reported(tmp_path):
    """Issue 58: what the operator's memory grows with (its caches' objects, by kind) and the limit it must stay
    under (its container's, from the cgroup: the chart's EmbeddingOperatorNearMemoryLimit divides by it)."""
    c = FakeController()
    metrics.watch(c)
    try:
        got = samples()
    finally:
        metrics.unwatch(c)
    assert got[("embedops_operator_cached_objects", (("kind", "EmbeddingService"),))] == 2
    assert got[("embedops_operator_cached_objects", (("kind", "Pod"),))] == 3
    assert got[("embedops_operator_cached_bytes", (("kind", "Pod"),))] == 4500
    assert ("process_resident_memory_bytes", ()) in got
    v2, v1 = tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes"
    v2.write_text("268435456\n")
    assert metrics.memory_limit((v2, v1)) == 268435456
    v2.write_text("max\n")
    assert metrics.memory_limit((v2, v1)) is None
    v2.unlink()
    v1.write_text("9223372036854771712\n")  # cgroup v1 without a limit
    assert metrics.memory_limit((v2, v1)) is None
    v1.write_text("536870912\n")
    assert metrics.memory_limit((v2, v1)) == 536870912
