"""Scale from zero: the activator's Deployment, Services and budget, and the backend Service it forwards to."""
from __future__ import annotations

from typing import Any

from ..spec import EmbeddingServiceSpec
from .base import (
    LABEL_COMPONENT, LABEL_INSTANCE, LABEL_NAME, SCALEDOBJECT, Options, Pin, autoscaler_kind, common_labels,
    object_meta, service_url)
from .pod import container_security
from .workload import pin_annotations, service

# With minReplicas 0 the service's own address (Service <name>) is the activator's (embedops_server/activator.py):
# it holds a request while no replica is ready and reports demand to KEDA, which wakes the Deployment. The model
# pods sit behind <name>-backend, the Service the ServiceMonitor scrapes.
ACTIVATOR_PORT = 8080
ACTIVATOR_ADMIN_PORT = 9091
ZERO_POLLING_SECONDS = 5  # KEDA's polling interval when a request may be waiting on it


def scales_to_zero(spec: EmbeddingServiceSpec, options: Options) -> bool:
    return bool(spec.autoscaling and spec.autoscaling.min_replicas == 0
                and autoscaler_kind(spec, options) == "keda" and SCALEDOBJECT in options.capabilities)


def backend_name(name: str) -> str:
    return f"{name}-backend"


def activator_name(name: str) -> str:
    return f"{name}-activator"


def activator_selector(name: str) -> dict[str, str]:
    return {LABEL_NAME: "embedops-activator", LABEL_INSTANCE: name}


def activator_labels(name: str) -> dict[str, str]:
    # not the server's name label: neither the ServiceMonitor, the PDB nor the status' pod count select these
    return {**common_labels(name, "embed"), **activator_selector(name), LABEL_COMPONENT: "activator"}


def backend_service(name: str, ns: str, spec: EmbeddingServiceSpec, owner: dict | None,
                    serving: str | None = None) -> dict:
    """The model pods' Service behind the activator: what the activator forwards to and the ServiceMonitor
    selects (ClusterIP whatever spec.service.type says: only the activator calls it)."""
    svc = service(name, ns, spec, owner, serving)
    svc["metadata"]["name"] = backend_name(name)
    svc["spec"]["type"] = "ClusterIP"
    return svc


def activator_service(name: str, ns: str, spec: EmbeddingServiceSpec, owner: dict | None) -> dict:
    """The service's address, answered by the activator: clients, the HTTPRoute and LiteLLM keep the same
    URL whether replicas run or not. Only the proxied port: a LoadBalancer must not publish the admin port."""
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": object_meta(name, ns, activator_labels(name), owner),
            "spec": {"type": spec.service.type, "selector": activator_selector(name),
                     "ports": [{"name": "http", "port": spec.service.port, "targetPort": "http",
                                "protocol": "TCP", "appProtocol": "http"}]}}


def activator_admin_service(name: str, ns: str, owner: dict | None) -> dict:
    """The activator's admin port (/demand for KEDA, /metrics, /healthz) on a ClusterIP Service of its own."""
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": object_meta(activator_name(name), ns, activator_labels(name), owner),
            "spec": {"type": "ClusterIP", "selector": activator_selector(name),
                     "ports": [{"name": "admin", "port": ACTIVATOR_ADMIN_PORT, "targetPort": "admin",
                                "protocol": "TCP", "appProtocol": "http"}]}}


def activator_pdb(name: str, ns: str, owner: dict | None) -> dict:
    """The activator answers the service's address at every replica count: one of its two pods stays."""
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": object_meta(activator_name(name), ns, activator_labels(name), owner),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": activator_selector(name)}}}


def activator_demand_url(name: str, ns: str, options: Options) -> str:
    return f"http://{activator_name(name)}.{ns}.svc.{options.cluster_domain}:{ACTIVATOR_ADMIN_PORT}/demand"


ACTIVATOR_REPLICAS = 2


def activator_deployment(name: str, ns: str, spec: EmbeddingServiceSpec, options: Options,
                         owner: dict | None, pin: Pin = Pin()) -> dict:
    """One small proxy pod (no accelerator, ~40 MB) from the CPU server image, which carries it. A CPU service
    keeps its placement (nodeSelector, tolerations); a GPU service's activator runs on any node that takes it."""
    a = spec.autoscaling
    assert a is not None
    cpu = bool(spec.accelerator.cpu)
    image = spec.image if (spec.image and cpu) else (pin.image or options.cpu_image)
    backend = service_url(backend_name(name), ns, spec, options)
    probe = {"httpGet": {"path": "/healthz", "port": "admin"}, "periodSeconds": 5, "timeoutSeconds": 2}
    container: dict[str, Any] = {
        "name": "activator", "image": image, "command": ["embedops-activator"],
        "args": ["--backend", backend, "--port", str(ACTIVATOR_PORT), "--admin-port", str(ACTIVATOR_ADMIN_PORT),
                 "--activation-timeout", str(a.activation_timeout_seconds),
                 # a request between two of KEDA's polls must still count at the next one
                 "--activity-window", str(2 * ZERO_POLLING_SECONDS)],
        "ports": [{"name": "http", "containerPort": ACTIVATOR_PORT, "protocol": "TCP"},
                  {"name": "admin", "containerPort": ACTIVATOR_ADMIN_PORT, "protocol": "TCP"}],
        "readinessProbe": probe, "livenessProbe": {**probe, "periodSeconds": 10, "failureThreshold": 3},
        "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}},
        "securityContext": container_security(),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    if pin.revision >= 1:
        # bounded (docs/operator.md "Scale from zero"): 128 requests of at most 2 MB each, plus ~40 MB of its own
        container["resources"]["limits"]["memory"] = "384Mi"
        container["resources"]["requests"]["ephemeral-storage"] = "64Mi"
        container["resources"]["limits"]["ephemeral-storage"] = "128Mi"
        if spec.api_key_secret_ref:  # the service's key: a request without it never counts as demand
            container["env"] = [{"name": "API_KEY", "valueFrom": {"secretKeyRef": {
                "name": spec.api_key_secret_ref.name, "key": spec.api_key_secret_ref.key}}}]
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False, "enableServiceLinks": False,
        "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
    }
    if cpu and spec.node_selector:
        pod_spec["nodeSelector"] = dict(sorted(spec.node_selector.items()))
    if cpu and spec.tolerations:
        pod_spec["tolerations"] = list(spec.tolerations)
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s.name} for s in spec.image_pull_secrets]
    if pin.revision >= 1:  # its two replicas on different nodes where there are several
        pod_spec["topologySpreadConstraints"] = [
            {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway",
             "labelSelector": {"matchLabels": activator_selector(name)}, "matchLabelKeys": ["pod-template-hash"]}]
    template = {"metadata": {"labels": activator_labels(name)}, "spec": pod_spec}
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": pin_annotations(object_meta(activator_name(name), ns, activator_labels(name), owner), pin, template),
            "spec": {"replicas": ACTIVATOR_REPLICAS, "revisionHistoryLimit": 3,
                     "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
                     "selector": {"matchLabels": activator_selector(name)}, "template": template}}

