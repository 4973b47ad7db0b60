"""spec.networkPolicy: the ingress NetworkPolicy the operator renders (opt-in), and that it is owned and pruned
like every other child. Enforcement is tested on the real node with kube-router (tests/e2e/test_monitoring.py)."""
from __future__ import annotations

import copy
from pathlib import Path

from embedops_operator import apply as A
from embedops_operator import controller as C
from embedops_operator import render as R
from embedops_operator.settings import OperatorSettings
from embedops_operator.validate import defaulted, validate
from tests.unit.operator_helpers import CPU, es

REPO = Path(__file__).resolve().parents[2]

PLATFORM = R.Options(gateway_namespaces=("gateway",), prometheus_namespaces=("monitoring",),
                     keda_namespaces=("keda",))


def policy(spec: dict, options: R.Options = PLATFORM, **kw) -> dict | None:
    out = R.render(defaulted(es(spec, **kw)), options)
    found = [m for m in out if m["kind"] == "NetworkPolicy"]
    assert len(found) <= 1
    return found[0] if found else None


def with_policy(**npol) -> dict:
    spec = copy.deepcopy(CPU)
    spec["networkPolicy"] = npol
    return spec


def namespaces(peer: dict) -> list[str]:
    (expr,) = peer["namespaceSelector"]["matchExpressions"]
    assert expr["key"] == "kubernetes.io/metadata.name" and expr["operator"] == "In"
    return expr["values"]


def test_no_policy_unless_the_manifest_asks():
    assert policy(CPU) is None
    assert policy(with_policy(enabled=False)) is None


def test_own_namespace_prometheus_and_listed_namespaces_on_the_server_port():
    p = policy(with_policy(fromNamespaces=["rag-jobs", "litellm", "rag-jobs"]), uid="u-1")
    assert p["apiVersion"] == "networking.k8s.io/v1" and p["metadata"]["name"] == "svc"
    assert p["metadata"]["namespace"] == "ml"
    assert p["metadata"]["ownerReferences"][0]["uid"] == "u-1"  # owned, so pruned and garbage-collected
    assert p["spec"]["policyTypes"] == ["Ingress"]  # egress untouched: the download step reaches the Hub
    # every track's model pods and the activator carry the service label; nothing else of the operator's does
    assert p["spec"]["podSelector"] == {"matchLabels": {R.LABEL_SERVICE: "svc"}}
    rule, metrics = p["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": R.SERVER_PORT}]
    same, others = rule["from"]
    assert same == {"podSelector": {}}
    # the ServiceMonitor is on by default: Prometheus' namespace; no gateway route: not the gateway's
    assert namespaces(others) == ["litellm", "monitoring", "rag-jobs"]
    # the metrics' own port (template revision 7): Prometheus' namespace only, not the API's clients
    assert metrics["ports"] == [{"protocol": "TCP", "port": R.METRICS_PORT}]
    (prometheus,) = metrics["from"]
    assert namespaces(prometheus) == ["monitoring"]


def test_gateway_namespaces_only_with_a_route_and_prometheus_only_with_a_service_monitor():
    spec = with_policy()
    spec["gateway"] = {"parentRefs": [{"name": "public", "namespace": "edge"}], "allowUnauthenticated": True}
    spec["monitoring"] = {"serviceMonitor": {"enabled": False}}
    rule, metrics = policy(spec)["spec"]["ingress"]
    assert namespaces(rule["from"][1]) == ["gateway"]
    assert metrics["from"] == rule["from"]  # no ServiceMonitor: whoever reaches the API, as on its port before
    spec.pop("gateway")
    rule, _ = policy(spec)["spec"]["ingress"]
    assert rule["from"] == [{"podSelector": {}}]  # nothing from outside the namespace
    # an operator that knows no Prometheus namespace: the metrics port as the API's
    rule, metrics = policy(with_policy(), R.Options())["spec"]["ingress"]
    assert metrics == {"from": rule["from"], "ports": [{"protocol": "TCP", "port": R.METRICS_PORT}]}


def test_the_own_namespace_is_not_listed_twice():
    rule, _ = policy(with_policy(fromNamespaces=["ml"]))["spec"]["ingress"]
    assert namespaces(rule["from"][1]) == ["monitoring"]


def test_without_the_same_namespace_only_the_activator_and_reindex_jobs_from_it():
    rule, _ = policy(with_policy(allowSameNamespace=False, fromNamespaces=["ml"]))["spec"]["ingress"]
    activator, reindex, outside = rule["from"]
    assert activator == {"podSelector": {"matchLabels": R.activator_selector("svc")}}
    assert reindex == {"podSelector": {"matchLabels": {R.LABEL_COMPONENT: "reindex"},
                                       "matchExpressions": [{"key": "embedops.dev/space", "operator": "Exists"}]}}
    # what a reindex Job's pods carry (its template cannot change, so not the service label)
    spec = with_policy(allowSameNamespace=False)
    spec["migration"] = {"reindex": {"template": {"spec": {"containers": [{"name": "c", "image": "i"}]}}}}
    job = R.reindex_job("svc", "ml", R.parse_resource(defaulted(es(spec))).spec, None,
                        {"EMBEDOPS_SPACE": "aaaaaaaa"})
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert labels.items() >= reindex["podSelector"]["matchLabels"].items() and "embedops.dev/space" in labels
    assert namespaces(outside) == ["ml", "monitoring"]  # listed explicitly: the whole namespace again


def test_keda_reaches_the_activators_admin_port_when_the_service_scales_to_zero():
    spec = with_policy()
    spec["autoscaling"] = {"minReplicas": 0, "maxReplicas": 2}
    out = R.render(defaulted(es(spec)), PLATFORM)
    assert any(m["kind"] == "Deployment" and m["metadata"]["name"] == "svc-activator" for m in out)
    rules = next(m for m in out if m["kind"] == "NetworkPolicy")["spec"]["ingress"]
    assert rules[1] == {"from": [{"namespaceSelector": {"matchExpressions": [
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["keda"]}]}}],
        "ports": [{"protocol": "TCP", "port": R.ACTIVATOR_ADMIN_PORT}]}
    # the activator's pods carry the policy's selector: its proxied port is admitted by the first rule
    activator = next(m for m in out if m["metadata"]["name"] == "svc-activator" and m["kind"] == "Deployment")
    assert activator["spec"]["template"]["metadata"]["labels"][R.LABEL_SERVICE] == "svc"
    assert R.ACTIVATOR_PORT == R.SERVER_PORT
    spec["autoscaling"]["minReplicas"] = 1
    assert [r["ports"][0]["port"] for r in policy(spec)["spec"]["ingress"]] == [R.SERVER_PORT, R.METRICS_PORT]


def test_the_policy_goes_in_before_any_service_publishes_the_pods():
    kinds = [m["kind"] for m in R.render(defaulted(es(with_policy())), PLATFORM)]
    assert kinds.index("NetworkPolicy") < kinds.index("Service")


def test_platform_namespaces_from_the_environment(monkeypatch):
    monkeypatch.setenv("EMBEDOPS_GATEWAY_NAMESPACES", "traefik, gateway")
    monkeypatch.setenv("EMBEDOPS_PROMETHEUS_NAMESPACES", "monitoring")
    monkeypatch.delenv("EMBEDOPS_KEDA_NAMESPACES", raising=False)
    o = R.Options.of(OperatorSettings())
    assert (o.gateway_namespaces, o.prometheus_namespaces, o.keda_namespaces) == (
        ("gateway", "traefik"), ("monitoring",), ())


def test_namespace_names_are_validated():
    assert validate(es(with_policy(fromNamespaces=["Not_A_Namespace"])))
    assert not validate(es(with_policy(fromNamespaces=["rag-jobs"])))


def test_owned_watched_and_pruned_like_the_other_children():
    assert R.NETWORKPOLICY in A.OWNED_KINDS and A.PLURALS[R.NETWORKPOLICY] == "networkpolicies"
    assert C.CORE_KINDS[R.NETWORKPOLICY] == C.MANAGED


def test_a_gateway_the_services_own_policy_keeps_out_is_said_in_routes_ready():
    """Issue 53: with the chart's networkPolicy.gatewayNamespaces empty, a service with a gateway route and a
    NetworkPolicy admitted no gateway: the route was Accepted and every request through it timed out."""
    from embedops_operator import status as ST
    from embedops_operator.validate import defaulted

    spec = copy.deepcopy(CPU)
    spec.update({"gateway": {"parentRefs": [{"name": "public", "namespace": "gateway"}], "allowUnauthenticated": True},
                 "networkPolicy": {"allowSameNamespace": False}})
    res = defaulted(es(spec))

    def routes(options):
        st = ST.compute(res, ST.Observed(), options)
        return next(c for c in st["conditions"] if c["type"] == "RoutesReady")
    blocked = routes(R.Options())
    assert (blocked["status"], blocked["reason"]) == ("False", "BlockedByNetworkPolicy")
    assert "networkPolicy.gatewayNamespaces is empty" in blocked["message"] and "(gateway)" in blocked["message"]
    assert routes(R.Options(gateway_namespaces=("gateway",)))["reason"] != "BlockedByNetworkPolicy"
    spec["networkPolicy"]["fromNamespaces"] = ["gateway"]
    res = defaulted(es(spec))
    assert routes(R.Options())["reason"] != "BlockedByNetworkPolicy"


def test_the_charts_reserved_labels_are_the_ones_the_policy_admits():
    """The chart's admission policy reserves exactly the labels that admit a pod beside the service's own (issue 53):
    if the NetworkPolicy's peers change, the reserved pair must change with them."""
    chart = (REPO / "charts" / "embedops-operator" / "templates" / "admission-policy.yaml").read_text()
    rule, _ = policy(with_policy(allowSameNamespace=False))["spec"]["ingress"]
    activator, reindex = rule["from"][:2]
    (name_key, name), = [(k, v) for k, v in activator["podSelector"]["matchLabels"].items()
                         if k == "app.kubernetes.io/name"]
    assert f"variables.labels['{name_key}'] == '{name}'" in chart
    (comp_key, comp), = reindex["podSelector"]["matchLabels"].items()
    assert f"variables.labels['{comp_key}'] == '{comp}'" in chart
    (exists,) = reindex["podSelector"]["matchExpressions"]
    assert f"'{exists['key']}' in variables.labels" in chart
