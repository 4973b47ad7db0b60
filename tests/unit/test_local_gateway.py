"""The local cluster's Traefik install (localcluster/gateway.py), checked without a cluster: what Traefik
needs to serve the Gateway is consistent before a pod ever starts (its failures there are slow to read)."""
from __future__ import annotations

from localcluster import gateway
from localcluster.components import GATEWAY_CRDS


def _by_kind(docs):
    return {d["kind"]: d for d in docs}


def test_the_gateways_listener_is_one_of_traefiks_entry_points():
    docs = _by_kind(gateway.manifests("localhost/embedops-traefik:x", {"kubernetes.io/hostname": "n"}))
    (listener,) = docs["Gateway"]["spec"]["listeners"]
    args = docs["Deployment"]["spec"]["template"]["spec"]["containers"][0]["args"]
    # Traefik maps a listener to the entry point with the same port; without one it refuses the listener
    assert f"--entryPoints.web.address=:{listener['port']}" in args
    assert docs["GatewayClass"]["spec"]["controllerName"] == gateway.CONTROLLER
    assert docs["Gateway"]["spec"]["gatewayClassName"] == docs["GatewayClass"]["metadata"]["name"]
    assert {"name": docs["Gateway"]["metadata"]["name"], "namespace": docs["Gateway"]["metadata"]["namespace"]} \
        == gateway.PARENT_REF
    service = docs["Service"]["spec"]["ports"][0]
    assert service["port"] == listener["port"] and gateway.IN_CLUSTER_HOST.startswith(docs["Service"]["metadata"]["name"])


def test_traefik_may_read_every_kind_it_watches_and_write_their_status():
    docs = _by_kind(gateway.manifests("img", {}))
    rules = docs["ClusterRole"]["rules"]
    allowed = {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    kinds = [f.removeprefix("gateway.networking.k8s.io_").removesuffix(".yaml") for f in GATEWAY_CRDS]
    for kind in kinds:  # the standard channel CRDs the harness installs: Traefik's informers list and watch each
        assert {("gateway.networking.k8s.io", kind, v) for v in ("list", "watch")} <= allowed, kind
    for kind in ("gatewayclasses", "gateways", "httproutes"):
        assert ("gateway.networking.k8s.io", f"{kind}/status", "update") in allowed
    for core in ("services", "namespaces", "secrets", "configmaps"):
        assert ("", core, "watch") in allowed
    assert ("discovery.k8s.io", "endpointslices", "watch") in allowed
    binding = docs["ClusterRoleBinding"]
    assert binding["subjects"][0]["name"] == docs["Deployment"]["spec"]["template"]["spec"]["serviceAccountName"]
