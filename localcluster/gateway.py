"""A real Gateway API implementation in the local cluster: Traefik v3, built from its Go module (issue 19).

What a platform team installs to route the operator's HTTPRoutes, made here since no image can be pulled:

* the Gateway API standard channel CRDs (components.py ``gateway-api``; Traefik's informers also wait for
  GRPCRoute, ReferenceGrant and BackendTLSPolicy, so those are installed with HTTPRoute);
* Traefik v3.6.12 (``traefik`` component) as a Deployment on the real node, image made like the server's
  (the static binary on the Debian base), with the Kubernetes Gateway provider on and Traefik's own
  documented read-only RBAC plus status updates;
* the ``GatewayClass`` ``traefik`` (controller ``traefik.io/gateway-controller``) and one ``Gateway``,
  ``gateway/embedops``, with an HTTP listener on port 8000 (Traefik's ``web`` entry point: a Gateway's
  listener port must be one of Traefik's entry points) that admits routes from every namespace;
* the Service ``traefik.gateway`` (port 8000), the address in-cluster clients (LiteLLM, a RAG job) call and
  the one the Gateway reports in its status.

API::

    gw = gateway.up(kube)        # idempotent; waits until the Gateway is Programmed and Traefik answers
    gw.url                       # http://<Traefik pod IP>:8000, reachable from this machine (the bridge)
    gw.in_cluster_url            # http://traefik.gateway.svc.cluster.local:8000
    gateway.PARENT_REF           # what an EmbeddingService's spec.gateway.parentRefs names
"""
from __future__ import annotations

import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from .components import TRAEFIK_VERSION, expand, provided
from .workloads import REAL_NODE_TOLERATIONS, controller_access

NAMESPACE = "gateway"
GATEWAY = "embedops"
GATEWAY_CLASS = "traefik"
CONTROLLER = "traefik.io/gateway-controller"
PORT = 8000          # the Gateway's HTTP listener and Traefik's "web" entry point
PING_PORT = 8080     # Traefik's own entry point: /ping for the probes, /api for diagnostics
PARENT_REF = {"name": GATEWAY, "namespace": NAMESPACE}
IN_CLUSTER_HOST = f"traefik.{NAMESPACE}.svc.cluster.local"


def _log(msg: str) -> None:
    print(f"[gateway {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def manifests(image: str, node_selector: dict) -> list[dict]:
    """Namespace, RBAC, Traefik's Deployment and Service, the GatewayClass and the Gateway."""
    labels = {"app.kubernetes.io/name": "traefik", "app.kubernetes.io/instance": "embedops-gateway"}
    group = "gateway.networking.k8s.io"
    kinds = ["gatewayclasses", "gateways", "httproutes", "grpcroutes", "referencegrants", "backendtlspolicies",
             "tcproutes", "tlsroutes"]
    rules = [
        {"apiGroups": [""], "resources": ["namespaces", "services", "secrets", "configmaps", "nodes"],
         "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": [group], "resources": kinds, "verbs": ["get", "list", "watch"]},
        {"apiGroups": [group], "resources": [f"{k}/status" for k in kinds], "verbs": ["update", "patch"]},
    ]
    args = [f"--entryPoints.web.address=:{PORT}", f"--entryPoints.traefik.address=:{PING_PORT}", "--ping=true",
            "--providers.kubernetesgateway=true",
            # the address the Gateway reports in status.addresses: what in-cluster clients resolve
            f"--providers.kubernetesgateway.statusAddress.hostname={IN_CLUSTER_HOST}",
            # Traefik v3.6.12 drops EndpointSlice updates in which only an endpoint's conditions change
            # (k8s/event_handler.go compares addresses and ports): a server pod that turns Ready after its model
            # loads, at an address already listed as not ready, never gets traffic until some unrelated object
            # changes (seen here: 503 "no available server" minutes after the pod was Ready). Fixed upstream
            # after v3.6 (traefik/traefik#13405); v3.7 does not build from this machine's module proxy. Sending
            # to the Service's cluster IP leaves readiness to kube-proxy, which reads every condition change.
            "--providers.kubernetesgateway.nativeLBByDefault=true",
            # no internet here; a platform team would keep these off in a cluster without egress too
            "--global.checkNewVersion=false", "--global.sendAnonymousUsage=false", "--log.level=INFO",
            # Traefik's read-only API on its own entry point (not the Gateway's listener): the routers and
            # services it built from the HTTPRoutes, which the tests print when a request goes wrong
            "--api=true", "--api.insecure=true"]
    probe = {"httpGet": {"path": "/ping", "port": PING_PORT}, "periodSeconds": 2, "failureThreshold": 3}
    container = {
        "name": "traefik", "image": image, "imagePullPolicy": "IfNotPresent", "args": args,
        "ports": [{"name": "web", "containerPort": PORT}, {"name": "traefik", "containerPort": PING_PORT}],
        "readinessProbe": probe, "livenessProbe": {**probe, "periodSeconds": 10, "initialDelaySeconds": 10},
        "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "512Mi"}},
        "securityContext": {"runAsNonRoot": True, "runAsUser": 65532, "allowPrivilegeEscalation": False,
                            "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}}
    return [
        *controller_access(NAMESPACE, "traefik", rules),
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "traefik", "namespace": NAMESPACE,
                                                                     "labels": labels},
         "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                  "template": {"metadata": {"labels": labels},
                               "spec": {"serviceAccountName": "traefik", "nodeSelector": node_selector,
                                        "tolerations": REAL_NODE_TOLERATIONS, "containers": [container],
                                        "terminationGracePeriodSeconds": 10}}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "traefik", "namespace": NAMESPACE,
                                                             "labels": labels},
         "spec": {"selector": labels, "ports": [{"name": "web", "port": PORT, "targetPort": "web"}]}},
        {"apiVersion": f"{group}/v1", "kind": "GatewayClass", "metadata": {"name": GATEWAY_CLASS},
         "spec": {"controllerName": CONTROLLER}},
        {"apiVersion": f"{group}/v1", "kind": "Gateway", "metadata": {"name": GATEWAY, "namespace": NAMESPACE},
         "spec": {"gatewayClassName": GATEWAY_CLASS,
                  "listeners": [{"name": "http", "protocol": "HTTP", "port": PORT,
                                 "allowedRoutes": {"namespaces": {"from": "All"}}}]}},
    ]


@dataclass
class Gateway:
    url: str              # from this machine: Traefik's pod IP on the node's bridge
    in_cluster_url: str   # from pods: the Service's DNS name
    pod: str
    api_url: str          # Traefik's API (/api/http/routers, /api/http/services), from this machine


def _conditions(obj: dict) -> dict[str, str]:
    return {c["type"]: c["status"] for c in (obj.get("status") or {}).get("conditions") or []}


def up(kube, timeout: float = 300) -> Gateway:
    """Build what is missing, install the CRDs, Traefik, the GatewayClass and the Gateway; wait until the
    Gateway is Accepted and Programmed by Traefik and Traefik answers on the listener's port."""
    from kubernetes import client

    from . import images
    from .build import Builder

    if not kube.real_node:
        raise RuntimeError(f"the gateway needs the real node to run Traefik: {kube.real_node_reason}")
    t = time.monotonic()
    Builder().build_all(expand(["gateway"]))
    image = images.build_binary_image("traefik", [provided("traefik")])
    kube.import_images([image])
    kube.install_crds(["httproute"])
    kube.apply(manifests(image.ref, {"kubernetes.io/hostname": kube.real_node}))
    deadline = time.monotonic() + timeout
    last = ""
    with kube.api_client() as api:
        core = client.CoreV1Api(api)
        co = client.CustomObjectsApi(api)
        while True:
            gw = co.get_namespaced_custom_object("gateway.networking.k8s.io", "v1", NAMESPACE, "gateways", GATEWAY)
            conds = _conditions(gw)
            pods = [p for p in core.list_namespaced_pod(NAMESPACE, label_selector="app.kubernetes.io/name=traefik")
                    .items if p.metadata.deletion_timestamp is None and p.status.pod_ip
                    and all(c.ready for c in p.status.container_statuses or [False])]
            if conds.get("Programmed") == "True" and conds.get("Accepted") == "True" and len(pods) == 1:
                url = f"http://{pods[0].status.pod_ip}:{PORT}"
                try:  # no route matches "/": Traefik's own 404 means the listener serves
                    urllib.request.urlopen(url + "/", timeout=5)
                except urllib.error.HTTPError as e:
                    if e.code == 404:
                        break
                    last = f"GET / answered {e.code}"
                except OSError as e:
                    last = f"GET / failed: {e}"
            if time.monotonic() > deadline:
                logs = "\n".join(core.read_namespaced_pod_log(p.metadata.name, NAMESPACE, tail_lines=40)
                                 for p in pods) if pods else "(no ready Traefik pod)"
                raise TimeoutError(f"Gateway {NAMESPACE}/{GATEWAY} not served after {timeout:.0f}s: conditions "
                                   f"{conds}; {last}; Traefik log:\n{logs}")
            time.sleep(1)
    _log(f"Traefik {TRAEFIK_VERSION} serving Gateway {NAMESPACE}/{GATEWAY} at {url} in {time.monotonic() - t:.0f}s")
    return Gateway(url, f"http://{IN_CLUSTER_HOST}:{PORT}", pods[0].metadata.name,
                   f"http://{pods[0].status.pod_ip}:{PING_PORT}/api")
