"""The ingress NetworkPolicy of a service's pods (spec.networkPolicy)."""
from __future__ import annotations

from ..spec import EmbeddingServiceSpec
from .activator import ACTIVATOR_ADMIN_PORT, activator_selector
from .base import (
    BATCH_PORT, LABEL_COMPONENT, LABEL_SERVICE, LABEL_SPACE, METRICS_PORT, NETWORKPOLICY, SERVER_PORT, Options,
    common_labels, detect_task, has_batch_service, object_meta)

NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # set on every namespace by the API server (1.22+)


def _from_namespaces(names) -> dict:
    return {"namespaceSelector": {"matchExpressions": [
        {"key": NAMESPACE_NAME_LABEL, "operator": "In", "values": sorted(set(names))}]}}


def reindex_peer() -> dict:
    """The reindex Jobs' pods of the namespace, as the chart's reserved-labels policy names them."""
    return {"podSelector": {"matchLabels": {LABEL_COMPONENT: "reindex"},
                            "matchExpressions": [{"key": LABEL_SPACE, "operator": "Exists"}]}}


def network_policy(name: str, ns: str, spec: EmbeddingServiceSpec, owner: dict | None, options: Options) -> dict:
    """Ingress to the service's pods (every track's model pods and the activator: the service label) from what
    calls them, on the port each listens on; egress is left alone (the download step reaches the Hub). Peers:
    the service's own namespace (or, with allowSameNamespace false, only its activator and the reindex Jobs there),
    the namespaces the manifest lists, the gateway's namespaces when the service has a route and Prometheus'
    when it has a ServiceMonitor (both from the chart), and KEDA's on the activator's admin port when it
    scales to zero. Implementations admit the node's own traffic (kubelet probes) whatever the policy says."""
    npol = spec.network_policy
    assert npol is not None
    peers: list[dict] = []
    if npol.allow_same_namespace:
        peers.append({"podSelector": {}})
    else:
        peers.append({"podSelector": {"matchLabels": activator_selector(name)}})
        # reindex Jobs' pods carry the component and the space, not the service (a Job's template cannot change);
        # both, so that the chart's admission policy can reserve the pair without refusing a team's own pods
        # labelled component=reindex (labels any pod could copy: issue 53, docs/security.md)
        peers.append(reindex_peer())
    names = set(npol.from_namespaces)
    if spec.gateway:
        names |= set(options.gateway_namespaces)
    if spec.monitoring.service_monitor.enabled:
        names |= set(options.prometheus_namespaces)
    if npol.allow_same_namespace:
        names.discard(ns)  # already admitted, every pod of it
    if names:
        peers.append(_from_namespaces(names))
    # the model server and the activator both serve the API on SERVER_PORT (== ACTIVATOR_PORT); servers of template
    # revisions before 7 and the activator /metrics there too
    ports = [{"protocol": "TCP", "port": SERVER_PORT}]
    if has_batch_service(spec):  # the batch lane's address (lanes.batchService)
        ports.append({"protocol": "TCP", "port": BATCH_PORT})
    rules: list[dict] = [{"from": peers, "ports": ports}]
    a = spec.autoscaling
    if a is not None and a.min_replicas == 0 and options.keda_namespaces:
        rules.append({"from": [_from_namespaces(options.keda_namespaces)],
                      "ports": [{"protocol": "TCP", "port": ACTIVATOR_ADMIN_PORT}]})
    # /metrics on its own port (template revision 7): Prometheus' namespaces only when the operator knows them
    # (the chart's networkPolicy.prometheusNamespaces), else whoever reaches the API (as on the API's port before)
    prometheus = sorted(options.prometheus_namespaces) if spec.monitoring.service_monitor.enabled else []
    rules.append({"from": [_from_namespaces(prometheus)] if prometheus else peers,
                  "ports": [{"protocol": "TCP", "port": METRICS_PORT}]})
    return {"apiVersion": NETWORKPOLICY[0], "kind": NETWORKPOLICY[1],
            "metadata": object_meta(name, ns, common_labels(name, detect_task(spec.model)), owner),


            "spec": {"podSelector": {"matchLabels": {LABEL_SERVICE: name}}, "policyTypes": ["Ingress"],
                     "ingress": rules}}




def gateway_blocked(ns: str, spec: EmbeddingServiceSpec, options: Options) -> str | None:
    """Why the service's own NetworkPolicy keeps its gateway out, or None: the chart names no gateway namespace
    (networkPolicy.gatewayNamespaces) and none of the Gateways' namespaces is admitted otherwise (the manifest's
    fromNamespaces, or the service's own namespace while every pod of it is admitted). A route the gateway accepted
    would still time out at the pods; the status says so instead (issue 53)."""
    npol = spec.network_policy
    if spec.gateway is None or npol is None or not npol.enabled or options.gateway_namespaces:
        return None
    admitted = set(npol.from_namespaces) | ({ns} if npol.allow_same_namespace else set())
    gateways = {ref.namespace or ns for ref in spec.gateway.parent_refs}
    if gateways & admitted:
        return None
    return (f"the service's NetworkPolicy admits no gateway: the operator's networkPolicy.gatewayNamespaces is "
            f"empty and the Gateways' namespace{'s' if len(gateways) > 1 else ''} ({', '.join(sorted(gateways))}) "
            "not admitted, so the gateway's requests would time out at the pods; set the chart's "
            "networkPolicy.gatewayNamespaces, or list the gateway's namespace in spec.networkPolicy.fromNamespaces")
