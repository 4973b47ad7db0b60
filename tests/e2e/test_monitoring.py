"""Monitoring on the real controllers (issue 18): Prometheus Operator reads the ServiceMonitor the operator
renders, the Prometheus it runs on the real node scrapes the server pod, and what the ScaledObject asks of
Prometheus answers.

The stack is localcluster/monitoring.py (Prometheus Operator v0.85.0 and Prometheus 3.x built from their Go
modules, Prometheus as a pod of its own image). Bounded local load only.
"""
from __future__ import annotations

import json

import pytest

from localcluster import monitoring
from localcluster.workloads import prerequisites
from tests.e2e.conftest import wait_for
from tests.e2e.real_pods import LOAD_CLIENT, client_pod, exec_in, pod_log, wait_pod_phase
from tests.e2e.test_real_pods import _kubeconfig, example, ns, on_real_node, real, service_url, svc, wait_ready  # noqa: F401

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

NAME = "monitored"


@pytest.fixture(scope="module")
def stack(kube, real):  # noqa: F811 - the fixture imported above
    from localcluster import controlplane

    if real.local_node is None:
        pytest.skip("the monitoring stack is built into the local cluster only")
    cluster = controlplane.Cluster(run_dir=controlplane.default_run_dir() / "pytest", real_node=None)
    return monitoring.up(kube, cluster)


@pytest.fixture(scope="module")
def monitored(kube, real, ns, svc, stack):  # noqa: F811
    """A CPU service whose ServiceMonitor carries the labels this Prometheus selects, scraped every 5 s, with
    autoscaling by KEDA (its CRD only: no controller acts, the ScaledObject's query is what is checked)."""
    doc = on_real_node(example(), real)
    doc["metadata"]["name"] = NAME
    doc["spec"]["monitoring"] = {"serviceMonitor": {"labels": dict(monitoring.SELECTOR), "interval": "5s"}}
    doc["spec"]["autoscaling"] = {"minReplicas": 1, "maxReplicas": 2}
    doc["spec"].pop("replicas", None)
    prerequisites(kube, ns, [doc], host_path=real.models_hostpath)
    svc.create(doc)
    wait_ready(svc, NAME, real)
    return doc


def _series(stack, promql: str, timeout: float = 60) -> list[dict]:
    return wait_for(lambda: stack.query(promql), timeout=timeout, what=f"Prometheus answers {promql}")


def test_prometheus_selects_the_service_monitor_by_its_labels_and_scrapes_the_pod(kube, ns, svc, stack, monitored):
    # a ServiceMonitor for the same Service without the selected labels: Prometheus must not pick it up
    sm = svc.co.get_namespaced_custom_object("monitoring.coreos.com", "v1", ns, "servicemonitors", NAME)
    assert sm["metadata"]["labels"]["release"] == monitoring.SELECTOR["release"]
    unselected = {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
                  "metadata": {"name": f"{NAME}-unselected", "namespace": ns}, "spec": sm["spec"]}
    kube.apply([unselected])

    up = _series(stack, f'up{{namespace="{ns}",service="{NAME}"}} == 1', timeout=120)
    pods = {p.metadata.name for p in svc.pods(NAME)}
    assert {s["metric"]["pod"] for s in up} == pods, up
    assert {s["metric"]["endpoint"] for s in up} == {"http"}
    pools = {t["scrapePool"] for t in stack.targets()}
    print(f"scrape pools: {sorted(pools)}")
    assert f"serviceMonitor/{ns}/{NAME}/0" in pools
    assert not any(f"{NAME}-unselected" in p for p in pools), pools


def test_the_scaled_objects_query_finds_the_servers_series(ns, svc, stack, monitored):
    so = svc.co.get_namespaced_custom_object("keda.sh", "v1alpha1", ns, "scaledobjects", NAME)
    trigger = so["spec"]["triggers"][0]["metadata"]
    assert trigger["serverAddress"] == f"http://prometheus-operated.{monitoring.NAMESPACE}.svc:9090"
    result = _series(stack, trigger["query"])
    assert len(result) == 1 and float(result[0]["value"][1]) >= 0, result
    # every te_* series of the pod carries the labels that query filters on
    names = {s["metric"]["__name__"] for s in stack.query(f'{{__name__=~"te_.*",namespace="{ns}",service="{NAME}"}}')}
    print(f"te_* series scraped: {sorted(names)}")
    assert {"te_queue_size", "te_request_count", "te_request_duration_bucket", "te_batch_next_size_bucket"} <= names


def test_queue_size_rises_under_load(kube, real, ns, svc, stack, monitored):
    """TEI's own te_queue_size is reported to stay at 0 under load (TEI issue #880); ours must rise, or the
    ScaledObject never scales anything."""
    query = f'max(max_over_time(te_queue_size{{namespace="{ns}",service="{NAME}"}}[30s]))'
    before = float(_series(stack, query)[0]["value"][1])
    name = "load-monitoring"
    texts = [f"passage {i} about autoscaling embeddings servers on their queue depth " * 6 for i in range(8)]
    pod = client_pod(name, real.server_image, LOAD_CLIENT, real.node_selector, {
        "URL": service_url(NAME, ns) + "/embed", "THREADS": 24, "MAX_SECONDS": 60,
        "BODY": json.dumps({"inputs": texts})})
    svc.core.create_namespaced_pod(ns, pod)
    try:
        wait_for(lambda: "started" in pod_log(svc.core, ns, name), timeout=120, what="load started")
        seen = []

        def risen():
            v = float(stack.query(query)[0]["value"][1])
            seen.append(v)
            return v > 0
        wait_for(risen, timeout=50, what="te_queue_size above 0 under load")
    finally:
        exec_in(kube, ns, name, ["python3", "-c", "open('/tmp/stop', 'w').close()"])
        wait_pod_phase(svc.core, ns, name, ("Succeeded",), timeout=90)
        summary = [x for x in svc.core.read_namespaced_pod_log(name, ns).splitlines() if x.startswith("{")][-1]
        svc.core.delete_namespaced_pod(name, ns, grace_period_seconds=0)
    print(f"te_queue_size max over 30 s: {before} at rest, then {seen} under load; load: {summary}")
    assert before == 0
    assert json.loads(summary)["failed"] == 0
