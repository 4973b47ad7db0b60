"""Monitoring on the real controllers (issue 18): Prometheus Operator reads the ServiceMonitor the operator
renders, the Prometheus it runs on the real node scrapes the server pod, and what the ScaledObject asks of
Prometheus answers.

The stack is localcluster/monitoring.py (Prometheus Operator v0.93.0 and Prometheus 3.x built from their Go
modules, Prometheus as a pod of its own image). Bounded local load only.
"""
from __future__ import annotations

import contextlib
import json
import time

import pytest
from kubernetes.client.rest import ApiException

from embedops_operator import render as R
from localcluster import monitoring
from localcluster.workloads import prerequisites
from tests.e2e.conftest import REPO, wait_for
from tests.e2e.real_pods import LOAD_CLIENT, client_pod, exec_in, pod_log, wait_pod_phase
from tests.e2e.test_real_pods import _kubeconfig, example, ns, on_real_node, real, service_url, svc, wait_ready  # noqa: F401
from tests.waiting import ReplicasWatch

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

NAME = "monitored"


@pytest.fixture(scope="module")
def stack(kube, real):  # noqa: F811 - the fixture imported above
    from localcluster import controlplane
    from tests.conftest import session_run_dir

    if real.local_node is None:
        pytest.skip("the monitoring stack is built into the local cluster only")
    cluster = controlplane.Cluster(run_dir=session_run_dir(), real_node=None)
    return monitoring.up(kube, cluster)


@pytest.fixture(scope="module")
def monitored(request, kube, real, ns, svc, stack, operator):  # noqa: F811
    """A CPU service whose ServiceMonitor carries the labels this Prometheus selects, scraped every 5 s, with
    autoscaling by KEDA (its CRD only until the KEDA test starts KEDA), and the operator's own ServiceMonitor.
    Both ServiceMonitors go in together (one config change; the reloader before Prometheus Operator v0.91 saw
    a second change ten seconds later only on its 3-minute poll, docs/cluster.md). The chart's metrics-reader
    ClusterRole and binding are removed afterwards (the chart's own install in test_real_pods.py must not find
    them)."""
    reader_rbac = _scrape_the_operator(kube, ns, operator.metrics_port)
    request.addfinalizer(lambda: _delete_cluster_scoped(kube, reader_rbac))
    doc = on_real_node(example(), real)
    doc["metadata"]["name"] = NAME
    doc["spec"]["monitoring"] = {"serviceMonitor": {"labels": dict(monitoring.SELECTOR), "interval": "5s"}}
    doc["spec"]["autoscaling"] = {"minReplicas": 1, "maxReplicas": 2}
    doc["spec"].pop("replicas", None)
    # the service's NetworkPolicy: Prometheus (every test here reads its scrapes) and KEDA (the scale-from-zero
    # activator's demand) are admitted from their namespaces, as the chart names them; the test below refuses others
    doc["spec"]["networkPolicy"] = {}
    prerequisites(kube, ns, [doc], host_path=real.models_hostpath)
    svc.create(doc)
    wait_ready(svc, NAME, real)
    return doc


def _delete_cluster_scoped(kube, docs: list[dict]) -> None:
    from tests.integration.operator_process import delete_cluster_scoped

    with kube.api_client() as api:
        delete_cluster_scoped(api, docs)


def _scrape_the_operator(kube, ns: str, port: int) -> list[dict]:
    """The chart's metrics ServiceMonitor endpoint (honorLabels and all) for the operator, which runs on this
    machine here: a Service without selector and its Endpoints at the node's bridge address stand in for the
    chart's metrics Service."""
    from localcluster.node import HOST_IP

    chart = _chart(kube, ns)
    endpoint = {**chart["ServiceMonitor"]["spec"]["endpoints"][0], "interval": "5s"}
    assert endpoint.get("bearerTokenFile") and len(chart["metrics-reader"]) == 2, (endpoint, chart["metrics-reader"])
    labels = {"app.kubernetes.io/name": "embedops-operator", "app.kubernetes.io/component": "metrics"}
    kube.apply([
        *chart["metrics-reader"],  # Prometheus' ServiceAccount may get /metrics; the operator asks the API server
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "embedops-operator-metrics", "namespace": ns,
                                                             "labels": labels},
         "spec": {"ports": [{"name": "metrics", "port": port, "targetPort": port}]}},
        {"apiVersion": "v1", "kind": "Endpoints", "metadata": {"name": "embedops-operator-metrics", "namespace": ns,
                                                               "labels": labels},
         "subsets": [{"addresses": [{"ip": HOST_IP}], "ports": [{"name": "metrics", "port": port}]}]},
        {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
         "metadata": {"name": "embedops-operator", "namespace": ns, "labels": dict(monitoring.SELECTOR)},
         "spec": {"selector": {"matchLabels": labels}, "namespaceSelector": {"matchNames": [ns]},
                  "endpoints": [endpoint]}}])
    return chart["metrics-reader"]


def _series(stack, promql: str, timeout: float = 60) -> list[dict]:
    return wait_for(lambda: stack.query(promql), timeout=timeout, what=f"Prometheus answers {promql}")


def _firing(alert: str, ns: str, service: str) -> str:
    return f'ALERTS{{alertname="{alert}",alertstate="firing",namespace="{ns}",service="{service}"}}'


@contextlib.contextmanager
def _load(kube, real, svc, ns: str, name: str, threads: int, seconds: int, texts: list[str]):
    """A client pod on the real node posting `texts` to the service's /embed from `threads` threads (bounded by
    `seconds`), started before the body runs and stopped after it; the dict it yields receives the client's
    summary (ok, failed, latencies) once the pod has stopped."""
    pod = client_pod(name, real.server_image, LOAD_CLIENT, real.node_selector, {
        "URL": service_url(NAME, ns) + "/embed", "THREADS": threads, "MAX_SECONDS": seconds,
        "BODY": json.dumps({"inputs": texts})})
    svc.core.create_namespaced_pod(ns, pod)
    summary: dict = {}
    try:
        wait_for(lambda: "started" in pod_log(svc.core, ns, name), timeout=120, what=f"{name} started")
        yield summary
    finally:
        exec_in(kube, ns, name, ["python3", "-c", "open('/tmp/stop', 'w').close()"])
        wait_pod_phase(svc.core, ns, name, ("Succeeded",), timeout=90)
        lines = [x for x in svc.core.read_namespaced_pod_log(name, ns).splitlines() if x.startswith("{")]
        summary.update(json.loads(lines[-1]) if lines else {"failed": "no summary"})
        svc.core.delete_namespaced_pod(name, ns, grace_period_seconds=0)


def test_prometheus_selects_the_service_monitor_by_its_labels_and_scrapes_the_pod(kube, ns, svc, stack, monitored):
    # a ServiceMonitor for the same Service without the selected labels: Prometheus must not pick it up
    sm = svc.co.get_namespaced_custom_object("monitoring.coreos.com", "v1", ns, "servicemonitors", NAME)
    assert sm["metadata"]["labels"]["release"] == monitoring.SELECTOR["release"]
    unselected = {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
                  "metadata": {"name": f"{NAME}-unselected", "namespace": ns}, "spec": sm["spec"]}
    kube.apply([unselected])

    # From the ServiceMonitor to the first successful scrape: Prometheus Operator regenerates the config, the
    # reloader sees the Secret's volume update (the kubelet syncs it within its sync period, 10 s here; the
    # reloader watches its folder since v0.91), Prometheus reloads and scrapes: seconds. Up to v0.90 a missed
    # file event left it to the reloader's 3-minute poll (170 s in one warm CI run).
    started = time.monotonic()
    try:
        up = _series(stack, f'up{{namespace="{ns}",service="{NAME}"}} == 1', timeout=120)
    except AssertionError as e:
        seen = [(t["scrapePool"], t["health"], t.get("lastError")) for t in stack.targets()]
        raise AssertionError(f"{e}\nPrometheus' active targets: {seen}\n"
                             f"operator log: {stack.operator_log.read_text()[-3000:]}") from None
    print(f"first scrape of the ServiceMonitor's target {time.monotonic() - started:.0f}s after the test began")
    pods = {p.metadata.name for p in svc.pods(NAME)}
    assert {s["metric"]["pod"] for s in up} == pods, up
    assert {s["metric"]["endpoint"] for s in up} == {"http"}
    pools = {t["scrapePool"] for t in stack.targets()}
    print(f"scrape pools: {sorted(pools)}")
    assert f"serviceMonitor/{ns}/{NAME}/0" in pools
    assert not any(f"{NAME}-unselected" in p for p in pools), pools


# Calls $URL once a second until the answer is $EXPECT ("reached" or "refused") or $SECONDS pass, and prints
# {"result", "attempts", "error"}: kube-router applies a policy change within seconds, not at once.
PROBE = r"""
import json, os, time, urllib.request
deadline, attempts = time.monotonic() + float(os.environ["SECONDS"]), 0
while True:
    attempts += 1
    try:
        with urllib.request.urlopen(os.environ["URL"], timeout=3) as r:
            result, error = ("reached" if r.status == 200 else f"status {r.status}"), None
    except Exception as e:
        result, error = "refused", repr(e)
    if result == os.environ["EXPECT"] or time.monotonic() > deadline:
        break
    time.sleep(1)
print(json.dumps({"result": result, "attempts": attempts, "error": error}))
"""


def _probe(svc, real, ns: str, name: str, url: str, expect: str, seconds: int = 30) -> dict:
    pod = client_pod(name, real.server_image, PROBE, real.node_selector,
                     {"URL": url, "EXPECT": expect, "SECONDS": seconds}, wait_reachable=False)
    svc.core.create_namespaced_pod(ns, pod)
    try:
        wait_pod_phase(svc.core, ns, name, ("Succeeded",), timeout=120)
        lines = [x for x in svc.core.read_namespaced_pod_log(name, ns).splitlines() if x.startswith("{")]
        return json.loads(lines[-1])
    finally:
        svc.core.delete_namespaced_pod(name, ns, grace_period_seconds=0)


def test_network_policy_admits_its_namespace_prometheus_and_listed_namespaces_only(kube, real, ns, svc, stack,
                                                                                    monitored):
    """spec.networkPolicy enforced by kube-router on the real node: a pod of an unlisted namespace is refused at
    once, one of the service's own namespace gets through, another namespace once the manifest lists it;
    Prometheus keeps scraping through it (its namespace comes from the operator's settings, as KEDA's does for
    the scale-from-zero test below); switched off, the operator removes its policy and everyone gets through."""
    from kubernetes import client

    policy = wait_for(lambda: _network_policy(svc, ns), timeout=60, what="the operator's NetworkPolicy")
    assert policy.metadata.owner_references[0].kind == "EmbeddingService"
    listed, other = f"{ns}-listed", f"{ns}-other"
    for name in (listed, other):
        svc.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    url = service_url(NAME, ns) + "/health"
    try:
        for name in (listed, other):  # the namespaces' default ServiceAccount, which a pod needs
            wait_for(lambda n=name: svc.core.list_namespaced_service_account(n).items, timeout=90,
                     what=f"namespace {name}'s default ServiceAccount")
        refused = _probe(svc, real, other, "probe-other", url, "refused")
        same = _probe(svc, real, ns, "probe-same", url, "reached")
        not_yet = _probe(svc, real, listed, "probe-listed-0", url, "refused")
        print(f"before listing: other {refused}, same namespace {same}, to-be-listed {not_yet}")
        assert refused["result"] == "refused" and refused["attempts"] == 1, refused
        assert same["result"] == "reached", same
        assert not_yet["result"] == "refused", not_yet

        svc.co.patch_namespaced_custom_object("embedops.dev", "v1alpha1", ns, "embeddingservices", NAME, {
            "spec": {"networkPolicy": {"fromNamespaces": [listed]}}})
        wait_for(lambda: listed in str(_network_policy(svc, ns).spec.ingress), timeout=60,
                 what="the listed namespace in the NetworkPolicy")
        admitted = _probe(svc, real, listed, "probe-listed-1", url, "reached")
        still_refused = _probe(svc, real, other, "probe-other-1", url, "refused")
        print(f"listed: {admitted}; unlisted: {still_refused}")
        assert admitted["result"] == "reached", admitted
        assert still_refused["result"] == "refused", still_refused
        # the metrics' own port (template revision 7): a namespace admitted to the API never gets through to it
        # in 8 s of attempts (a new pod's first refusals are the policy learning its address: not enough)
        pod_ip = svc.pods(NAME)[0].status.pod_ip
        metrics = _probe(svc, real, listed, "probe-listed-metrics", f"http://{pod_ip}:{R.METRICS_PORT}/metrics",
                         "reached", seconds=8)
        print(f"listed namespace to the metrics port: {metrics}")
        assert metrics["result"] == "refused" and metrics["attempts"] >= 5, metrics
        # Prometheus, in its own namespace, scrapes through the policy (a scrape after the change), on the
        # pods' metrics port, where the ServiceMonitor's relabelling sends it
        since = time.time()
        _series(stack, f'timestamp(up{{namespace="{ns}",service="{NAME}",instance=~".+:{R.METRICS_PORT}"}} == 1) '
                       f'> {since}', timeout=60)

        svc.co.patch_namespaced_custom_object("embedops.dev", "v1alpha1", ns, "embeddingservices", NAME, {
            "spec": {"networkPolicy": {"enabled": False}}})
        wait_for(lambda: _network_policy(svc, ns) is None, timeout=60, what="the NetworkPolicy removed")
        opened = _probe(svc, real, other, "probe-other-2", url, "reached")
        print(f"policy switched off: unlisted {opened}")
        assert opened["result"] == "reached", opened
    finally:
        svc.co.patch_namespaced_custom_object("embedops.dev", "v1alpha1", ns, "embeddingservices", NAME, {
            "spec": {"networkPolicy": {"enabled": True, "fromNamespaces": []}}})
        for name in (listed, other):
            with contextlib.suppress(ApiException):
                svc.core.delete_namespace(name)


def _network_policy(svc, ns: str):
    from kubernetes import client

    try:
        return client.NetworkingV1Api(svc.core.api_client).read_namespaced_network_policy(NAME, ns)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


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
    texts = [f"passage {i} about autoscaling embeddings servers on their queue depth " * 6 for i in range(8)]
    with _load(kube, real, svc, ns, "load-monitoring", 24, 60, texts) as summary:
        seen = []

        def risen():
            v = float(stack.query(query)[0]["value"][1])
            seen.append(v)
            return v > 0
        wait_for(risen, timeout=50, what="te_queue_size above 0 under load")
    print(f"te_queue_size max over 30 s: {before} at rest, then {seen} under load; load: {summary}")
    assert before == 0
    assert summary["failed"] == 0


def _chart_values() -> dict:
    import yaml

    return yaml.safe_load((REPO / "charts" / "embedops-operator" / "values.yaml").read_text())


def _chart(kube, ns_for_rule: str, *sets: str) -> dict[str, dict]:
    """The chart's PrometheusRule and ServiceMonitor, by kind."""
    import subprocess

    import yaml

    args = [kube.helm, "template", "embedops", str(REPO / "charts" / "embedops-operator"), "--namespace",
            ns_for_rule, "--set", "alerts.enabled=true", "--set", "metrics.serviceMonitor.enabled=true",
            "--set", f"alerts.labels.release={monitoring.SELECTOR['release']}",
            "--set", f"metrics.readers[0].namespace={monitoring.NAMESPACE}", "--set", "metrics.readers[0].name=prometheus"]
    for s in sets:
        args += ["--set", s]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    chosen = {d["kind"]: d for d in docs if d["kind"] in ("PrometheusRule", "ServiceMonitor")}
    # what lets this Prometheus read the operator's /metrics (metrics.auth: kubernetes, the chart's default)
    chosen["metrics-reader"] = [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")
                                and d["metadata"]["name"].endswith("-metrics-reader")]
    return chosen


@pytest.fixture(scope="module")
def operator_scraped(kube, ns, stack, operator, monitored):
    """The operator's /metrics scraped as the chart's ServiceMonitor scrapes it (set up by `monitored`)."""
    # the operator's series, with the labels the alerts and the dashboard aggregate by
    ready = f'embedops_service_condition{{namespace="{ns}",service="{NAME}",type="Ready",status="True"}} == 1'
    try:
        _series(stack, ready, timeout=180)
    except AssertionError as e:
        import urllib.request

        pools = [(t["scrapePool"], t["health"], t.get("lastError"), t["scrapeUrl"]) for t in stack.targets()
                 if "embedops-operator" in t["scrapePool"]]
        seen = [s["metric"] for s in stack.query("embedops_service_condition")][:6]
        with urllib.request.urlopen(f"{stack.url}/api/v1/status/config", timeout=10) as r:
            jobs = [ln.strip() for ln in json.loads(r.read())["data"]["yaml"].splitlines() if "job_name" in ln]
        with urllib.request.urlopen(f"{stack.url}/api/v1/targets?state=dropped", timeout=10) as r:
            dropped = len(json.loads(r.read())["data"]["droppedTargets"])
        raise AssertionError(f"{e}; operator targets: {pools}; embedops_service_condition: {seen}; "
                             f"jobs: {jobs}; dropped targets: {dropped}") from None
    assert _series(stack, "embedops_operator_leader == 1")
    # Prometheus got in with its ServiceAccount's token; without one the same port says no
    import urllib.error
    import urllib.request

    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"http://127.0.0.1:{operator.metrics_port}/metrics", timeout=10)
    assert refused.value.code == 401


def test_every_dashboard_query_returns_data_under_load(kube, real, ns, svc, stack, monitored, operator_scraped):
    """Each panel of the chart's dashboard (scripts/dashboard.py) as Grafana would send it for this
    service, on the live Prometheus after 30 s of load. The answer cache's row is empty for this service (no
    spec.answerCache: its series are exported only while the cache is on, and its repeated texts would keep the
    queue the KEDA tests need empty); Prometheus still parses those queries (an error answer raises), and the
    series they read are tested on the server (tests/server/test_answer_cache.py)."""
    from scripts.dashboard import PANELS

    texts = [f"passage {i} for the dashboard's panels " * 6 for i in range(8)]
    with _load(kube, real, svc, ns, "load-dashboard", 16, 40, texts):
        time.sleep(30)
        empty, values = [], {}
        for row, title, _, queries, _ in PANELS:
            for expr, legend in queries:
                q = expr.replace("$namespace", ns).replace("$service", NAME).replace("$__rate_interval", "1m")
                result = stack.query(q)
                values[f"{title} / {legend}"] = [round(float(r["value"][1]), 4) for r in result]
                if not result and row != "Answer cache":
                    empty.append(f"{title} / {legend}: {q}")
    print("dashboard under load:\n" + "\n".join(f"  {k}: {v}" for k, v in values.items()))
    assert not empty, empty


def test_alerts_load_and_stalled_fires_then_resolves_on_live_data(kube, real, ns, svc, stack, operator, monitored,
                                                                  operator_scraped):
    """The chart's PrometheusRule on the live Prometheus, and one alert taken through a real fault: a service
    whose pod can never be scheduled is Stalled (the e2e operator decides that after 10 s), the alert fires,
    and resolves once the service is gone. `for` is 0 s here; the promtool tests check the real ones."""
    # every `for` at 0 s, once: each rule change is a reload (the reloader watches the rules' folders)
    kube.apply([_chart(kube, ns, *(f"alerts.for.{k}=0s" for k in _chart_values()["alerts"]["for"]))
                ["PrometheusRule"]])

    def loaded():
        groups = {g["name"]: g for g in stack.rule_groups()}
        if {"embedops.services", "embedops.operator"} <= set(groups):
            return groups
    groups = wait_for(loaded, timeout=120, what="the chart's rule groups loaded by Prometheus")
    rules = [r for g in groups.values() for r in g["rules"]]
    assert len(rules) == 11

    stuck = on_real_node(example(), real)
    stuck["metadata"]["name"] = "stuck"
    stuck["spec"]["nodeSelector"] = {"embedops.dev/no-such-pool": "anywhere"}
    stuck["spec"]["monitoring"] = {"serviceMonitor": {"enabled": False}}
    svc.create(stuck)
    firing = _firing("EmbeddingServiceStalled", ns, "stuck")
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


def test_alerts_fire_on_overload_and_on_a_model_that_cannot_load(kube, real, ns, svc, stack, operator, monitored,
                                                                 operator_scraped):
    """Two more faults through the chart's rules (loaded with every `for` at 0 s by the test above):
    - a model that cannot load (a path the model volume lacks): the init container that prepares it
      crash-loops (Init:CrashLoopBackOff; the operator counted only app containers' restarts until this test);
      EmbeddingServiceNoReadyReplica and EmbeddingServicePodsRestarting fire, and resolve once it is deleted;
    - overload: 24 clients of 32 inputs each keep ~768 inputs in flight against the server's 512; the server
      refuses with 429 and EmbeddingServiceOverloaded fires; with the manifest's p99 budget lowered to 0.25 s
      EmbeddingServiceLatencyOverBudget fires for this service (the rule joins on the operator's budget
      series)."""
    broken = on_real_node(example(), real)
    broken["metadata"]["name"] = "broken"
    broken["spec"]["model"]["id"] = "/models/no-such-model"
    broken["spec"]["monitoring"] = {"serviceMonitor": {"enabled": False}}
    svc.create(broken)
    t = time.monotonic()
    try:
        svc.co.patch_namespaced_custom_object("embedops.dev", "v1alpha1", ns, "embeddingservices", NAME, {
            "spec": {"monitoring": {"p99LatencySeconds": 0.25}}})
        texts = [f"passage {i} sent to a server past its in-flight limit " * 4 for i in range(32)]
        with _load(kube, real, svc, ns, "load-overload", 24, 120, texts) as summary:
            overloaded = _series(stack, _firing("EmbeddingServiceOverloaded", ns, NAME), timeout=90)
            over_budget = _series(stack, _firing("EmbeddingServiceLatencyOverBudget", ns, NAME), timeout=90)
        no_ready = _series(stack, _firing("EmbeddingServiceNoReadyReplica", ns, "broken"), timeout=120)
        restarting = _series(stack, _firing("EmbeddingServicePodsRestarting", ns, "broken"), timeout=300)
        restarting_after = time.monotonic() - t
        condition = svc.get("broken")["status"]["conditions"]
    finally:
        svc.delete("broken")
        svc.co.patch_namespaced_custom_object("embedops.dev", "v1alpha1", ns, "embeddingservices", NAME, {
            "spec": {"monitoring": {"p99LatencySeconds": None}}})
    wait_for(lambda: not stack.query(_firing("EmbeddingServicePodsRestarting", ns, "broken")), timeout=120,
             what="EmbeddingServicePodsRestarting resolved")
    assert not stack.query(_firing("EmbeddingServiceNoReadyReplica", ns, "broken"))
    refused = (summary.get("failures") or {})
    print(f"overload: {summary}; broken model: NoReadyReplica and PodsRestarting firing "
          f"({restarting_after:.0f} s after it was created); its conditions: "
          f"{[(c['type'], c['status'], c.get('reason')) for c in condition]}")
    assert overloaded and over_budget and no_ready and restarting
    assert any("429" in str(k) for k in refused), refused


def test_keda_scales_the_service_up_under_load_and_back_down(kube, real, ns, svc, stack, monitored):
    """KEDA's operator and metrics adapter (pods on the real node, served through the API server's aggregation
    layer) read the ScaledObject the operator renders, query this Prometheus with it and scale the Deployment
    1 -> 2 under load and back to 1 after the cooldown. Every value spec.replicas takes is watched: it moves
    1 -> 2 -> 1 with no fight between writers, and the operator never takes the field."""
    monitoring.keda_up(kube)
    svc.co.patch_namespaced_custom_object("embedops.dev", "v1alpha1", ns, "embeddingservices", NAME, {
        "spec": {"autoscaling": {"minReplicas": 1, "maxReplicas": 2, "targetQueueDepth": 4, "cooldownSeconds": 20}}})

    def scaled_object_ready():
        so = svc.co.get_namespaced_custom_object("keda.sh", "v1alpha1", ns, "scaledobjects", NAME)
        conds = {c["type"]: c["status"] for c in (so.get("status") or {}).get("conditions") or []}
        return so if conds.get("Ready") == "True" and so["spec"]["advanced"] else None
    so = wait_for(scaled_object_ready, timeout=120, what="ScaledObject Ready (KEDA made its HPA)")
    print(f"ScaledObject status: {so['status'].get('hpaName')}, {so['status'].get('externalMetricNames')}")

    up_after, down_after, steps, owners, summary = _one_to_two_and_back(kube, real, svc, ns, "load-keda", "KEDA")
    print(f"KEDA: 1 -> 2 {up_after:.0f} s after the load started, 2 -> 1 {down_after:.0f} s after it stopped "
          f"(cooldown 20 s); spec.replicas took {steps}; owners of replicas {owners}; load: {summary}")


def _one_to_two_and_back(kube, real, svc, ns: str, load_name: str, scaler: str):
    """24 client threads until the autoscaler has 2 replicas ready, then none until it is back at 1. Asserts
    spec.replicas took exactly 1, 2, 1 (every value watched), the operator never owned it, no request failed;
    returns (seconds to 2, seconds back to 1, steps, owners of replicas, the load's summary)."""
    replicas = ReplicasWatch(svc.apps, ns, NAME)
    texts = [f"passage {i} about autoscaling embeddings servers on their queue depth " * 6 for i in range(8)]
    with _load(kube, real, svc, ns, load_name, 24, 300, texts) as summary:
        t0 = time.monotonic()
        wait_for(lambda: svc.deployment(NAME).spec.replicas == 2, timeout=180, what=f"{scaler} scales to 2 under load")
        up_after = time.monotonic() - t0
        wait_for(lambda: svc.get(NAME)["status"].get("replicasSummary") == "2/2", timeout=180, what="2/2 ready")
        row = next(r for r in _get_embsvc(svc, ns) if r["Name"] == NAME)
        print(f"kubectl get embsvc: {row}")
        assert row["Replicas"] == "2/2"
    t1 = time.monotonic()
    wait_for(lambda: svc.deployment(NAME).spec.replicas == 1, timeout=240, what=f"{scaler} scales back to 1")
    down_after = time.monotonic() - t1
    time.sleep(3)
    replicas.stop()
    d = svc.deployment(NAME)
    owners = [m.manager for m in d.metadata.managed_fields if '"f:replicas"' in json.dumps(m.fields_v1)]
    steps = replicas.steps()
    assert steps == [1, 2, 1], replicas.seen
    assert "embedops" not in owners, owners
    assert summary["failed"] == 0, summary
    return up_after, down_after, steps, owners, summary


def _get_embsvc(svc, ns: str) -> list[dict[str, str]]:
    """What `kubectl get embsvc` prints: the API server's Table rendering of the CRD's printer columns."""
    api = svc.co.api_client
    method, url, headers, _, _ = api.param_serialize(
        "GET", f"/apis/embedops.dev/v1alpha1/namespaces/{ns}/embeddingservices",
        header_params={"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"}, auth_settings=["BearerToken"])
    r = api.call_api(method, url, header_params=headers)
    r.read()
    table = json.loads(r.data)
    names = [c["name"] for c in table["columnDefinitions"]]
    return [dict(zip(names, (str(c) for c in row["cells"]))) for row in table["rows"]]


# $CONCURRENCY requests at once to $URL, each timed; prints one JSON list (status, seconds, vector length).
WAKE_CLIENT = r"""
import json, os, threading, time, urllib.request
url, k = os.environ["URL"], int(os.environ["CONCURRENCY"])
out = [None] * k
def call(j):
    t = time.monotonic()
    body = json.dumps({"inputs": [f"wake up request {j}"]}).encode()
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            out[j] = {"status": r.status, "seconds": round(time.monotonic() - t, 2), "dims": len(json.loads(r.read())[0])}
    except Exception as e:
        out[j] = {"status": getattr(e, "code", None), "seconds": round(time.monotonic() - t, 2),
                  "error": f"{type(e).__name__}: {e}"[:300]}
threads = [threading.Thread(target=call, args=(j,)) for j in range(k)]
[t.start() for t in threads]; [t.join() for t in threads]
print(json.dumps(out), flush=True)
"""


def test_scale_from_zero_answers_the_first_request(kube, real, ns, svc, stack, monitored):
    """minReplicas 0 on the real KEDA: the operator puts the activator at the service's address; at rest KEDA
    takes the Deployment to zero pods; requests sent then are held by the activator, KEDA wakes the Deployment
    on the activator's demand, and every request is answered (failures counted: 0); Prometheus scrapes the
    woken pod through <name>-backend with the series still labelled service=<name>; back at zero after the
    cooldown."""
    monitoring.keda_up(kube)
    svc.co.patch_namespaced_custom_object("embedops.dev", "v1alpha1", ns, "embeddingservices", NAME, {
        "spec": {"autoscaling": {"minReplicas": 0, "maxReplicas": 2, "targetQueueDepth": 4, "cooldownSeconds": 15,
                                 "activationTimeoutSeconds": 240}}})

    def activator_serves():
        try:
            d = svc.apps.read_namespaced_deployment(f"{NAME}-activator", ns)
        except ApiException as exc:
            if exc.status == 404:  # the operator has not written it yet
                return False
            raise
        selector = svc.core.read_namespaced_service(NAME, ns).spec.selector
        return (d.status.ready_replicas or 0) >= 1 and selector.get("app.kubernetes.io/name") == "embedops-activator"
    wait_for(activator_serves, timeout=180, what="the activator Ready behind the service's address")

    t0 = time.monotonic()
    wait_for(lambda: svc.deployment(NAME).spec.replicas == 0 and not svc.pods(NAME), timeout=240,
             what="KEDA scales the idle service to zero pods")
    to_zero = time.monotonic() - t0
    row = next(r for r in _get_embsvc(svc, ns) if r["Name"] == NAME)
    print(f"at rest: zero pods {to_zero:.0f} s after minReplicas 0 (cooldown 15 s); kubectl get embsvc: {row}")
    conds = {c["type"]: c for c in svc.get(NAME)["status"]["conditions"]}
    assert conds["Ready"]["status"] == "True" and conds["Ready"].get("reason") == "ScaledToZero", conds["Ready"]

    replicas = ReplicasWatch(svc.apps, ns, NAME)
    pod = client_pod("wake", real.server_image, WAKE_CLIENT, real.node_selector,
                     {"URL": service_url(NAME, ns) + "/embed", "CONCURRENCY": 4})
    svc.core.create_namespaced_pod(ns, pod)
    try:
        wait_pod_phase(svc.core, ns, "wake", ("Succeeded",), timeout=420)
        lines = [x for x in svc.core.read_namespaced_pod_log("wake", ns).splitlines() if x.startswith("[")]
        answers = json.loads(lines[-1])
    finally:
        svc.core.delete_namespaced_pod("wake", ns, grace_period_seconds=0)
    print(f"cold start through the activator: {answers}")
    assert [a["status"] for a in answers] == [200] * 4, answers
    assert all(a["dims"] == 384 for a in answers)

    # the woken pod is scraped through <name>-backend, its series keep service=<name> (what KEDA's query and
    # the alerts filter on); a light load keeps it awake while Prometheus picks the changed ServiceMonitor up
    woken = svc.pods(NAME)[0].metadata.name
    texts = ["keeping the woken replica busy while Prometheus scrapes it"]
    with _load(kube, real, svc, ns, "load-zero", 2, 240, texts) as summary:
        t1 = time.monotonic()
        series = _series(stack, f'te_queue_size{{namespace="{ns}",service="{NAME}",pod="{woken}"}}', timeout=220)
        scraped_after = time.monotonic() - t1
    # the ServiceMonitor is the same with or without the activator: no series ever says "<name>-backend"
    assert not stack.query(f'te_queue_size{{namespace="{ns}",service="{NAME}-backend"}}')
    print(f"woken pod {woken} scraped as {series[0]['metric']} {scraped_after:.0f} s into the load; load: {summary}")
    assert summary["failed"] == 0

    t2 = time.monotonic()
    wait_for(lambda: svc.deployment(NAME).spec.replicas == 0, timeout=240, what="back to zero after the cooldown")
    back_after = time.monotonic() - t2
    replicas.stop()
    print(f"back at zero {back_after:.0f} s after the load stopped; spec.replicas took {replicas.steps()}")
    assert replicas.steps()[0] == 0 and replicas.steps()[-1] == 0 and max(replicas.steps()) >= 1


def test_without_keda_the_hpa_scales_through_prometheus_adapter(kube, real, ns, svc, stack, monitored):
    """The HPA fallback (`provider: hpa`, what `auto` renders without KEDA's CRD) on the real HPA controller:
    prometheus-adapter serves te_queue_size as the custom metrics API's pods metric, and the HPA scales the
    service 1 -> 2 under load and back to 1 after its scale-down window. A Deployment KEDA left at zero (the
    test before this one) is raised to the HPA's minimum by the operator first: an HPA never scales a target
    at zero."""
    from kubernetes import client

    monitoring.adapter_up(kube)
    svc.co.patch_namespaced_custom_object("embedops.dev", "v1alpha1", ns, "embeddingservices", NAME, {
        "spec": {"autoscaling": {"provider": "hpa", "minReplicas": 1, "maxReplicas": 2, "targetQueueDepth": 4,
                                 "cooldownSeconds": 20}}})
    hpas = client.AutoscalingV2Api(svc.apps.api_client)

    def hpa_active():
        try:
            h = hpas.read_namespaced_horizontal_pod_autoscaler(NAME, ns)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        conds = {c.type: (c.status, c.reason) for c in h.status.conditions or []}
        return h if conds.get("ScalingActive", ("",))[0] == "True" else None
    wait_for(lambda: svc.deployment(NAME).spec.replicas >= 1 and svc.get(NAME)["status"].get("replicasSummary") == "1/1",
             timeout=240, what="the service at one ready replica under the HPA")
    h = wait_for(hpa_active, timeout=240, what="the HPA reads te_queue_size through prometheus-adapter")
    print(f"HPA active: metrics {[m.pods.current.average_value for m in h.status.current_metrics or []]}")
    names = [o["metadata"]["name"] for o in svc.co.list_namespaced_custom_object(
        "keda.sh", "v1alpha1", ns, "scaledobjects")["items"]]
    assert NAME not in names  # the ScaledObject is pruned: one autoscaler at a time
    assert svc.core.read_namespaced_service(NAME, ns).spec.selector["app.kubernetes.io/name"] == "embedops-server"

    up_after, down_after, steps, owners, summary = _one_to_two_and_back(kube, real, svc, ns, "load-hpa", "the HPA")
    print(f"HPA via prometheus-adapter: 1 -> 2 {up_after:.0f} s after the load started, 2 -> 1 {down_after:.0f} s "
          f"after it stopped (window 20 s); spec.replicas took {steps}; owners {owners}; load: {summary}")
