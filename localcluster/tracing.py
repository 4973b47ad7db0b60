"""A real OpenTelemetry Collector in the local cluster (issue 54): where the model servers' traces go.

What a platform team runs to receive OTLP, made here since no image can be pulled: the collector's core
components (``otelcol`` component, recipes/otelcol/main.go: the OTLP receiver on 4317 gRPC and 4318 HTTP, the
batch processor, the debug exporter) as a Deployment on the real node, image made like Traefik's (the static
binary on the Debian base), and the Service ``otel-collector.observability``, the endpoint an EmbeddingService's
``spec.tracing`` names. The debug exporter writes every span it receives to the collector's log (verbosity
detailed); ``spans()`` reads them back, so a test asks the collector, not the server, what arrived.

API::

    col = tracing.up(kube)       # idempotent; waits until the collector's pod is ready
    col.endpoint                 # http://otel-collector.observability.svc.cluster.local:4317
    col.spans(kube)              # [{"trace", "id", "parent", "name", "kind", "service", "attributes"}, ...]
"""
from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass

import yaml

from .components import OTELCOL_VERSION, expand, provided
from .workloads import REAL_NODE_TOLERATIONS

NAMESPACE = "observability"
NAME = "otel-collector"
GRPC_PORT, HTTP_PORT, HEALTH_PORT = 4317, 4318, 13133
ENDPOINT = f"http://{NAME}.{NAMESPACE}.svc.cluster.local:{GRPC_PORT}"  # OTLP/gRPC, from pods
LABELS = {"app.kubernetes.io/name": "opentelemetry-collector", "app.kubernetes.io/instance": "embedops-tracing"}
CONFIG = {
    "receivers": {"otlp": {"protocols": {"grpc": {"endpoint": f"0.0.0.0:{GRPC_PORT}"},
                                         "http": {"endpoint": f"0.0.0.0:{HTTP_PORT}"}}}},
    "processors": {"batch": {"timeout": "200ms"}},
    "exporters": {"debug": {"verbosity": "detailed"}},
    "service": {"pipelines": {"traces": {"receivers": ["otlp"], "processors": ["batch"], "exporters": ["debug"]}},
                # its own metrics off: nothing scrapes them here, and their port would be one more to allow
                "telemetry": {"metrics": {"level": "none"}}},
}


def _log(msg: str) -> None:
    print(f"[tracing {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def manifests(image: str, node_selector: dict) -> list[dict]:
    """Namespace, the collector's configuration, Deployment and Service."""
    container = {
        "name": "otelcol", "image": image, "imagePullPolicy": "IfNotPresent",
        "args": ["--config=/etc/otelcol/config.yaml"],
        "ports": [{"name": "otlp-grpc", "containerPort": GRPC_PORT}, {"name": "otlp-http", "containerPort": HTTP_PORT}],
        # ready once the receiver listens (no health extension in this build: a TCP check on its port)
        "readinessProbe": {"tcpSocket": {"port": GRPC_PORT}, "periodSeconds": 2},
        "volumeMounts": [{"name": "config", "mountPath": "/etc/otelcol", "readOnly": True}],
        "resources": {"requests": {"cpu": "20m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}},
        "securityContext": {"runAsNonRoot": True, "runAsUser": 65532, "allowPrivilegeEscalation": False,
                            "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}}
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": NAME, "namespace": NAMESPACE},
         "data": {"config.yaml": yaml.safe_dump(CONFIG, sort_keys=False)}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": NAME, "namespace": NAMESPACE,
                                                                     "labels": LABELS},
         "spec": {"replicas": 1, "selector": {"matchLabels": LABELS},
                  "template": {"metadata": {"labels": LABELS},
                               "spec": {"nodeSelector": node_selector, "tolerations": REAL_NODE_TOLERATIONS,
                                        "automountServiceAccountToken": False, "containers": [container],
                                        "volumes": [{"name": "config", "configMap": {"name": NAME}}],
                                        "terminationGracePeriodSeconds": 5}}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": NAME, "namespace": NAMESPACE, "labels": LABELS},
         "spec": {"selector": LABELS, "ports": [
             {"name": "otlp-grpc", "port": GRPC_PORT, "targetPort": "otlp-grpc", "appProtocol": "grpc"},
             {"name": "otlp-http", "port": HTTP_PORT, "targetPort": "otlp-http", "appProtocol": "http"}]}},
    ]


# the debug exporter's detailed output: "ResourceSpans #0" ... "-> service.name: Str(x)" ... "Span #0",
# "    Trace ID       : <hex>", "    Parent ID      : <hex or empty>", "    ID             : <hex>",
# "    Name           : POST /embed", "    Kind           : Server", "Attributes:", "     -> key: Int(2)"
_FIELD = re.compile(r"^\s+(Trace ID|Parent ID|ID|Name|Kind)\s+: ?(.*)$")
_ATTRIBUTE = re.compile(r"^\s+-> ([\w.]+): (\w+)\((.*)\)$")


def parse_debug_log(text: str) -> list[dict]:
    """The spans in the debug exporter's detailed log, with the service.name of their resource."""
    spans: list[dict] = []
    service = ""
    span: dict | None = None
    for line in text.splitlines():
        if line.startswith("ResourceSpans #"):
            span, service = None, ""
            continue
        if line.startswith("Span #"):
            span = {"service": service, "attributes": {}}
            spans.append(span)
            continue
        field = _FIELD.match(line)
        if field and span is not None:
            key = {"Trace ID": "trace", "Parent ID": "parent", "ID": "id", "Name": "name", "Kind": "kind"}[field[1]]
            span[key] = field[2].strip()
            continue
        attribute = _ATTRIBUTE.match(line)
        if attribute:
            key, kind, value = attribute.groups()
            typed = int(value) if kind == "Int" else value == "true" if kind == "Bool" else value
            if span is None:
                if key == "service.name":
                    service = value
            else:
                span["attributes"][key] = typed
    return spans


@dataclass
class Collector:
    endpoint: str       # from pods: OTLP/gRPC at the Service's DNS name
    http_endpoint: str  # OTLP/HTTP, the same
    pod: str

    def spans(self, kube) -> list[dict]:
        from kubernetes import client

        with kube.api_client() as api:
            log = client.CoreV1Api(api).read_namespaced_pod_log(self.pod, NAMESPACE)
        return parse_debug_log(log)


def up(kube, timeout: float = 180) -> Collector:
    """Build what is missing, run the collector on the real node; wait until its pod is ready."""
    from kubernetes import client

    from . import images
    from .build import Builder

    if not kube.real_node:
        raise RuntimeError(f"the collector needs the real node: {kube.real_node_reason}")
    t = time.monotonic()
    Builder().build_all(expand(["tracing"]))
    image = images.build_binary_image("otelcol", [provided("otelcol")])
    kube.import_images([image])
    kube.apply(manifests(image.ref, {"kubernetes.io/hostname": kube.real_node}))
    deadline = time.monotonic() + timeout
    with kube.api_client() as api:
        core = client.CoreV1Api(api)
        while True:
            pods = [p for p in core.list_namespaced_pod(NAMESPACE, label_selector=",".join(
                f"{k}={v}" for k, v in LABELS.items())).items
                if p.metadata.deletion_timestamp is None and p.status.pod_ip
                and all(c.ready for c in p.status.container_statuses or [False])]
            if len(pods) == 1:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"the OpenTelemetry Collector in {NAMESPACE} not ready after {timeout:.0f}s")
            time.sleep(1)
    _log(f"OpenTelemetry Collector {OTELCOL_VERSION} ready in {time.monotonic() - t:.0f}s")
    return Collector(ENDPOINT, f"http://{NAME}.{NAMESPACE}.svc.cluster.local:{HTTP_PORT}", pods[0].metadata.name)
