"""The operator reads from its watch caches: at rest it sends next to nothing, counted by the API server itself.

The operator runs as a process with the chart's ServiceAccount (watching one namespace, so the chart's RBAC
including the watch verbs is what it has), and a FlowSchema of its own matches only that account, so
`apiserver_flowcontrol_dispatched_requests_total{flow_schema=...}` counts exactly the operator's requests.
It is started before the EmbeddingService CRD exists (the CRD is deleted first and put back at the end): it
must wait quietly, with no traceback, and pick up a service created once the CRD is installed.
"""
from __future__ import annotations

import re
import time

import pytest

from tests.integration.operator_process import (CPU_SPEC, GROUP, PLURAL, VERSION, OperatorProcess,
                                                chart_rbac_kubeconfig, delete_cluster_scoped, es_body,
                                                install_crd, wait_for)

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(400)]
NS = "embedops-cache-it"
FLOW_SCHEMA = "embedops-cache-it-operator"
RESYNC = 5.0
N = 10


def metric(api, name: str, labels: dict[str, str]) -> float:
    resp = api.call_api("GET", api.configuration.host + "/metrics", header_params={"Accept": "*/*"},
                        _request_timeout=30)
    text = resp.read().decode()
    total = 0.0
    for lab, val in re.findall(r"^" + re.escape(name) + r"(\{[^}]*\})?\s+([0-9.eE+-]+)", text, re.M):
        if all(f'{k}="{v}"' in lab for k, v in labels.items()):
            total += float(val)
    return total


def operator_requests(api) -> float:
    return metric(api, "apiserver_flowcontrol_dispatched_requests_total", {"flow_schema": FLOW_SCHEMA})


def is_ready(es: dict) -> bool:
    st = es.get("status") or {}
    return st.get("observedGeneration") == es["metadata"]["generation"] and any(
        c["type"] == "Ready" and c["status"] == "True" for c in st.get("conditions") or [])


@pytest.fixture(scope="module")
def env(kube, tmp_path_factory):
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    if not kube.helm:
        pytest.skip("helm not available (the chart's RBAC is rendered with it)")
    api = kube.api_client()
    ext = client.ApiextensionsV1Api(api)
    try:
        ext.delete_custom_resource_definition(f"{PLURAL}.{GROUP}")
    except ApiException as e:
        if e.status != 404:
            raise
    wait_for("EmbeddingService CRD gone", lambda: f"{PLURAL}.{GROUP}" not in [
        c.metadata.name for c in ext.list_custom_resource_definition().items], 120)
    core = client.CoreV1Api(api)
    kube.apply([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}])
    tmp = tmp_path_factory.mktemp("cache-it")
    kubeconfig, docs = chart_rbac_kubeconfig(kube, api, NS, "cache-it", tmp / "operator.kubeconfig")
    sa = next(d for d in docs if d["kind"] == "ServiceAccount")["metadata"]["name"]
    flow = client.FlowcontrolApiserverV1Api(api)
    flow.create_flow_schema({
        "metadata": {"name": FLOW_SCHEMA},
        "spec": {"matchingPrecedence": 500, "priorityLevelConfiguration": {"name": "workload-high"},
                 "distinguisherMethod": {"type": "ByUser"},
                 "rules": [{"subjects": [{"kind": "ServiceAccount", "serviceAccount": {"name": sa, "namespace": NS}}],
                            "resourceRules": [{"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"],
                                               "clusterScope": True, "namespaces": ["*"]}],
                            "nonResourceRules": [{"verbs": ["*"], "nonResourceURLs": ["*"]}]}]}})
    op = OperatorProcess("cache-it", str(kubeconfig), tmp,
                         ["-n", NS, "--resync-seconds", str(RESYNC), "--liveness", ""]).start()
    out = {"api": api, "core": core, "custom": client.CustomObjectsApi(api), "op": op}
    try:
        yield out
    finally:
        op.stop()
        install_crd(kube, api)  # as the other tests found it
        for fn in (lambda: flow.delete_flow_schema(FLOW_SCHEMA), lambda: core.delete_namespace(NS),
                   lambda: delete_cluster_scoped(api, docs)):
            try:
                fn()
            except Exception:  # noqa: BLE001 - best-effort clean-up
                pass


def test_operator_started_before_its_crd_waits_quietly_then_reconciles(kube, env):
    op = env["op"]
    wait_for("operator started", lambda: "startup' succeeded" in op.log(), 60)
    time.sleep(RESYNC + 3)  # at least one resync without the CRD
    assert op.alive(), op.log()[-3000:]
    assert "Traceback" not in op.log() and " ERROR " not in op.log(), op.log()[-3000:]
    install_crd(kube, env["api"])
    env["custom"].create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, es_body(NS, "late", CPU_SPEC))
    wait_for("the service created after the CRD appeared is Ready", lambda: is_ready(
        env["custom"].get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "late")), 90)
    assert "Traceback" not in op.log(), op.log()[-3000:]


def test_at_rest_the_operator_sends_next_to_nothing(env):
    custom, core, api = env["custom"], env["core"], env["api"]
    for i in range(N):
        custom.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, es_body(NS, f"svc-{i}", CPU_SPEC))
    wait_for(f"{N} services Ready", lambda: sum(is_ready(e) for e in custom.list_namespaced_custom_object(
        GROUP, VERSION, NS, PLURAL)["items"]) == N + 1, 120, interval=1.0)
    time.sleep(RESYNC + 1)  # the last status writes and pod updates settle
    window = 4 * RESYNC
    before = operator_requests(api)
    time.sleep(window)
    sent = operator_requests(api) - before
    # Four resyncs of 11 services from the caches: discovery of the optional CRDs (one request per resync)
    # and perhaps a watch renewal. Reading from the API server it was ~6 requests per service per resync.
    assert sent <= window / RESYNC + 3, f"{sent} requests at rest in {window:.0f} s\n{env['op'].log()[-3000:]}"
    assert before > 0  # the FlowSchema did count the operator's requests during the rollout

    # drift still comes back through the watch: a Service deleted by hand is restored
    core.delete_namespaced_service("svc-3", NS)
    wait_for("Service restored", lambda: core.read_namespaced_service("svc-3", NS), 30)


def test_expired_watch_relists_without_losing_a_deletion(kube, env):
    """A watch resumed from a resourceVersion the API server no longer has gets 410 Gone; the informer lists
    again and delivers what happened meanwhile, here a deletion no watch saw. (On a cluster younger than the
    API server's 5-minute etcd compaction the old revision is still there and the watch itself replays the
    deletion; either way the deletion arrives. The 410 path is also unit-tested, deterministically.)"""
    from kubernetes.client.rest import ApiException

    from embedops_operator import apply as A
    from embedops_operator.runtime import watchcache as W

    core, sel = env["core"], "embedops-it/rv-test=1"
    for name in ("rv-keep", "rv-gone"):
        core.create_namespaced_config_map(NS, {"metadata": {"name": name, "labels": {"embedops-it/rv-test": "1"}}})
    k = A.Kube(kube.api_client())
    events: list = []
    inf = W.Informer("cm", k.lister("v1", "ConfigMap", NS, sel), k.watcher("v1", "ConfigMap", NS, sel),
                     on_event=lambda t, obj: events.append((t, obj["metadata"]["name"])),
                     watch_timeout=3)
    inf._list()
    assert sorted(events) == [("ADDED", "rv-gone"), ("ADDED", "rv-keep")]
    core.delete_namespaced_config_map("rv-gone", NS)  # while no watch is open
    inf._rv = "2"  # compacted away on a cluster older than the API server's 5-minute compaction
    relisted = False
    try:
        inf._watch()  # a younger cluster's etcd still has it: the watch replays the history, deletion included
    except W.Gone:  # a 410 ERROR event in the stream
        relisted = True
    except ApiException as exc:  # or the watch request itself answered 410
        assert exc.status == 410, exc
        relisted = True
    if relisted:
        inf._list()
    assert ("DELETED", "rv-gone") in events, (relisted, events)
    assert [key[1] for key in inf.keys()] == ["rv-keep"]
    assert k.requests["WATCH"] == 1 and k.requests["LIST"] == (2 if relisted else 1)
