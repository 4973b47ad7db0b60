"""Monitoring on the real controllers (issue 18): Prometheus Operator reads the ServiceMonitor the operator
renders, the Prometheus it runs on the real node scrapes the server pod, and what the ScaledObject asks of
Prometheus answers.

The stack is localcluster/monitoring.py (Prometheus Operator v0.85.0 and Prometheus 3.x built from their Go
modules, Prometheus as a pod of its own image). Bounded local load only.
"""
from __future__ import annotations

import json
import time

import pytest

from localcluster import monitoring
from localcluster.workloads import prerequisites
from tests.e2e.conftest import REPO, wait_for
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


def _chart(kube, ns_for_rule: str, *sets: str) -> dict[str, dict]:
    """The chart's PrometheusRule and ServiceMonitor, by kind."""
    import subprocess

    import yaml

    args = [kube.helm, "template", "embedops", str(REPO / "charts" / "embedops-operator"), "--namespace",
            ns_for_rule, "--set", "alerts.enabled=true", "--set", "metrics.serviceMonitor.enabled=true",
            "--set", f"alerts.labels.release={monitoring.SELECTOR['release']}"]
    for s in sets:
        args += ["--set", s]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    return {d["kind"]: d for d in yaml.safe_load_all(out) if d and d["kind"] in ("PrometheusRule", "ServiceMonitor")}


def test_alerts_load_and_stalled_fires_then_resolves_on_live_data(kube, real, ns, svc, stack, operator, monitored):
    """The chart's PrometheusRule on the live Prometheus, the operator's /metrics scraped through a ServiceMonitor
    (the operator runs on this machine here: a Service without selector and its Endpoints at the node's bridge
    address stand in for the chart's metrics Service), and one alert taken through a real fault: a service
    whose pod can never be scheduled is Stalled (the e2e operator decides that after 10 s), the alert fires,
    and resolves once the service is gone. `for` is 0 s here; the promtool tests check the real ones."""
    from localcluster.node import HOST_IP

    port = operator.metrics_port
    chart = _chart(kube, ns, "alerts.for.stalled=0s")
    endpoint = {**chart["ServiceMonitor"]["spec"]["endpoints"][0], "interval": "5s"}  # as the chart scrapes it
    labels = {"app.kubernetes.io/name": "embedops-operator", "app.kubernetes.io/component": "metrics"}
    kube.apply([
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "embedops-operator-metrics", "namespace": ns,
                                                             "labels": labels},
         "spec": {"ports": [{"name": "metrics", "port": port, "targetPort": port}]}},
        {"apiVersion": "v1", "kind": "Endpoints", "metadata": {"name": "embedops-operator-metrics", "namespace": ns,
                                                               "labels": labels},
         "subsets": [{"addresses": [{"ip": HOST_IP}], "ports": [{"name": "metrics", "port": port}]}]},
        {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
         "metadata": {"name": "embedops-operator", "namespace": ns, "labels": dict(monitoring.SELECTOR)},
         "spec": {"selector": {"matchLabels": labels}, "namespaceSelector": {"matchNames": [ns]},
                  "endpoints": [endpoint]}},
        chart["PrometheusRule"]])

    def loaded():
        groups = {g["name"]: g for g in stack.rule_groups()}
        if {"embedops.services", "embedops.operator"} <= set(groups):
            return groups
    groups = wait_for(loaded, timeout=90, what="the chart's rule groups loaded by Prometheus")
    rules = [r for g in groups.values() for r in g["rules"]]
    assert len(rules) == 10

    # the operator's series, with the labels the alerts aggregate by
    ready = _series(stack, f'embedops_service_condition{{namespace="{ns}",service="{NAME}",type="Ready",'
                           f'status="True"}} == 1', timeout=90)
    assert ready
    assert _series(stack, "embedops_operator_leader == 1")

    stuck = on_real_node(example(), real)
    stuck["metadata"]["name"] = "stuck"
    stuck["spec"]["nodeSelector"] = {"embedops.dev/no-such-pool": "anywhere"}
    stuck["spec"]["monitoring"] = {"serviceMonitor": {"enabled": False}}
    svc.create(stuck)
    firing = f'ALERTS{{alertname="EmbeddingServiceStalled",alertstate="firing",namespace="{ns}",service="stuck"}}'
    t = time.monotonic()
    try:
        _series(stack, firing, timeout=120)
        fired_after = time.monotonic() - t
    finally:
        svc.delete("stuck")
    wait_for(lambda: not stack.query(firing), timeout=120, what="EmbeddingServiceStalled resolved")
    resolved_after = time.monotonic() - t - fired_after
    print(f"EmbeddingServiceStalled fired {fired_after:.0f} s after the service was created, resolved "
          f"{resolved_after:.0f} s after it was deleted")
    health = {r["name"]: (r["health"], r.get("lastError", "")) for g in stack.rule_groups() for r in g["rules"]}
    assert all(h == "ok" for h, _ in health.values()), health
