"""Shared by every child's renderer: labels, kinds, the operator's options, template revisions and pins,
and the facts derived from a spec (task, dtype, addresses, autoscaler)."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from .. import kinds
from ..settings import OperatorSettings
from ..spec import EmbeddingServiceSpec, ModelSpec

MANAGER = "embedops"
SERVER_PORT = 8080
BATCH_PORT = 8081  # the server's --batch-port (spec.lanes.batchService): the same API, batch lane by default
# The server's --prometheus-port (TEI's default port for it; template revision 7): /metrics there and not on the
# API's port, so the service's clients cannot read it. The pod names it in this annotation, which the
# ServiceMonitor's relabelling turns into the scrape address (pods of older revisions serve /metrics on the API's)
METRICS_PORT = 9000
ANNOTATION_METRICS_PORT = "embedops.dev/metrics-port"
GRACE_MARGIN = 30  # seconds of the grace period left for the server to finish after the preStop sleep
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_PART_OF = "app.kubernetes.io/part-of"
LABEL_SERVICE = "embedops.dev/service"
LABEL_SPACE = "embedops.dev/space"  # on a space's own Service: its key
LABEL_LITELLM = "embedops.dev/litellm"  # on ConfigMaps holding LiteLLM entries, so stale ones can be found
ANNOTATION_HASH = "embedops.dev/applied-hash"

# the kinds rendered here, as the operator's table of kinds (kinds.py) names them
SERVICEMONITOR, HTTPROUTE, SCALEDOBJECT = kinds.SERVICEMONITOR, kinds.HTTPROUTE, kinds.SCALEDOBJECT
NETWORKPOLICY = kinds.NETWORKPOLICY
OPTIONAL_KINDS = kinds.OPTIONAL
FEATURE_OF_KIND = kinds.FEATURE_OF  # the spec feature each optional kind serves

# OpenAI clients pointed at <gateway><pathPrefix>/v1 list models before embedding; Cohere/Jina clients rerank
# at /v1/rerank. Without a pathPrefix or hostnames, services sharing a gateway share these paths too.
def _default(option: str) -> Any:
    return OperatorSettings.model_fields[option].default


@dataclass(frozen=True)
class Options:
    """What rendering depends on beyond the spec: the operator's settings (settings.py, read once at start; never
    the environment inside render) and the optional kinds the cluster serves now."""
    cpu_image: str = _default("server_image_cpu")
    cuda_image: str = _default("server_image_cuda")
    cluster_domain: str = _default("cluster_domain")
    # Optional third-party kinds installed in the cluster: ("apiVersion", "Kind") pairs.
    capabilities: frozenset[tuple[str, str]] = field(default_factory=lambda: frozenset(OPTIONAL_KINDS))
    pod_upgrades: str = _default("pod_upgrades")  # OperatorSettings.pod_upgrades
    max_concurrent_upgrades: int = _default("max_concurrent_upgrades")
    gateway_namespaces: tuple[str, ...] = ()  # OperatorSettings.gateway_namespaces and the two below
    prometheus_namespaces: tuple[str, ...] = ()
    keda_namespaces: tuple[str, ...] = ()
    tracing_endpoint: str | None = None  # OperatorSettings.tracing_endpoint: for services without spec.tracing

    @classmethod
    def of(cls, settings: OperatorSettings, capabilities: frozenset[tuple[str, str]] | None = None) -> "Options":
        return cls(cpu_image=settings.server_image_cpu, cuda_image=settings.server_image_cuda,
                   cluster_domain=settings.cluster_domain,
                   capabilities=frozenset(OPTIONAL_KINDS) if capabilities is None else capabilities,
                   pod_upgrades=settings.pod_upgrades, max_concurrent_upgrades=settings.max_concurrent_upgrades,
                   gateway_namespaces=settings.gateway_namespaces, keda_namespaces=settings.keda_namespaces,
                   prometheus_namespaces=settings.prometheus_namespaces, tracing_endpoint=settings.tracing_endpoint)


# ---------------------------------------------------------------------------------------------------- template revisions
# A running service's pods are replaced when its spec asks for it, never because the operator was upgraded. What the
# operator itself puts into a pod template for a given spec (its server image, and how it renders templates) is
# therefore pinned per Deployment: the revision in its annotation `embedops.dev/template-revision` and the image
# of its container. Every change to a template ships behind a new revision (`revision >= N` below), the older
# revisions keep rendering exactly what they did (tests/unit/test_pod_template_revisions.py holds them), and a
# Deployment moves to the latest revision and image only when its spec changes the template anyway, or when the
# operator is told to roll pods to it (reconcile: Options.pod_upgrades, paced). A Deployment written before
# revisions existed has no annotation: revision 0.
TEMPLATE_REVISIONS = {
    0: "the template as rendered until 2026-12-05",
    1: "the prepare step gets no API key; containers request ephemeral storage for their emptyDir volumes; the "
       "download step quotes the model's cache path",
    2: "the server retires keep-alive connections older than spec.service.maxConnectionAgeSeconds",
    3: "spec.lanes: the server's lane flags, and its batch port for lanes.batchService",
    4: "the CPU memory estimate behind requests and limits counts the tokenizers the server holds (workers + 1) "
       "and int8's loading peak (memory.ESTIMATE_REVISION)",
    5: "a hub model without a commit in model.revision: every container that resolves it reads PINNED_REVISION "
       "from the track's `<track>-model-commit` ConfigMap (optional), the commit its first replica resolved",
    6: "the CPU memory estimate counts an embedder's /embed_all answers: the server holds at most two answers of "
       "every token's state at once, of at most 8192 tokens each (memory.TOKEN_ANSWERS_REVISION)",
    7: "the server serves /metrics on METRICS_PORT (--prometheus-port 9000, a container port `metrics`) and not on "
       "the API's port; the pod's annotation embedops.dev/metrics-port says where the ServiceMonitor scrapes it",
}
TEMPLATE_REVISION = max(TEMPLATE_REVISIONS)
ANNOTATION_TEMPLATE_REVISION = "embedops.dev/template-revision"
ANNOTATION_TEMPLATE_HASH = "embedops.dev/template-hash"  # of the template as rendered: did the spec change it?
# On a GPU/MIG Deployment: the template hash whose rollout found no spare accelerator for its surge pod, so that
# rollout gives an old replica's accelerator up first (Pin.give_up_first); a later template surges again
ANNOTATION_SURGE_REFUSED = "embedops.dev/surge-refused"


@dataclass(frozen=True)
class Pin:
    """What one Deployment's pod template is rendered with besides the spec: a template revision and, when the
    spec names no image, the image (None: the operator's current one)."""
    revision: int = TEMPLATE_REVISION
    image: str | None = None
    # a GPU/MIG rollout whose surge pod found no spare accelerator: an old replica stops first (reconcile.py)
    give_up_first: bool = False


@dataclass(frozen=True)
class Pins:
    """The pins of a service's Deployments: the model server's and the activator's."""
    server: Pin = Pin()
    activator: Pin = Pin()

    @classmethod
    def at(cls, revision: int) -> "Pins":
        return cls(Pin(revision), Pin(revision))


def pinned(live: dict | None) -> Pin | None:
    """The pin a live Deployment was rendered with (revision 0 without the annotation), None without one."""
    if live is None:
        return None
    annotations = (live.get("metadata") or {}).get("annotations") or {}
    containers = ((((live.get("spec") or {}).get("template") or {}).get("spec") or {}).get("containers")) or [{}]
    try:
        revision = int(annotations.get(ANNOTATION_TEMPLATE_REVISION, "0"))
    except ValueError:
        revision = 0
    return Pin(min(max(revision, 0), TEMPLATE_REVISION), containers[0].get("image"))


@dataclass(frozen=True)
class Tracks:
    """Which model Deployment the spec renders and which one the service's address serves (spaces.py): both the
    service's own name unless a change of the embedding space is under way."""
    spec: str  # the spec's track: its Deployment's name and its pods' app.kubernetes.io/instance
    serving: str  # the track the service's Service (or, scaled to zero, its backend Service) selects
    replicas: int | None = None  # the spec's track's replicas while it does not serve (None: as the spec says)
    spaces: tuple[tuple[str, str], ...] = ()  # (key, track) of every running track, during a migration
    reindex: tuple[tuple[str, str], ...] | None = None  # the spec's space's reindex Job: its environment

    @classmethod
    def single(cls, name: str) -> "Tracks":
        return cls(name, name)


# ---------------------------------------------------------------------------------------------------- helpers

def detect_task(model: ModelSpec) -> str:
    return model.detected_task


def accelerator_summary(spec: EmbeddingServiceSpec) -> str:
    acc = spec.accelerator
    if acc.mig:
        n = f"{acc.mig.count}x" if acc.mig.count > 1 else ""
        return f"mig-{n}{acc.mig.profile}"
    if acc.gpu:
        return f"gpu-{acc.gpu.count}"
    isa = ",".join(acc.cpu.instruction_sets)
    return f"cpu-{acc.cpu.cores}" + (f"({isa})" if isa else "")


def served_model_name(spec: EmbeddingServiceSpec) -> str:
    return spec.model.served_model_name or spec.model.id


def dtype(spec: EmbeddingServiceSpec) -> str:
    if spec.model.dtype:
        return spec.model.dtype
    return "float32" if spec.accelerator.cpu else "float16"


def selector_labels(name: str) -> dict[str, str]:
    return {LABEL_NAME: "embedops-server", LABEL_INSTANCE: name}


def selector_string(name: str) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(name).items()))


def common_labels(name: str, task: str) -> dict[str, str]:
    return {
        **selector_labels(name),
        LABEL_COMPONENT: "reranker" if task == "rerank" else "embedder",
        LABEL_PART_OF: "embedops",
        LABEL_MANAGED_BY: MANAGER,
        LABEL_SERVICE: name,
    }


def track_labels(service_name: str, track: str, task: str) -> dict[str, str]:
    """A track's labels: the service's, with the track as the instance (its own selector)."""
    return {**common_labels(service_name, task), LABEL_INSTANCE: track}


def service_url(name: str, namespace: str, spec: EmbeddingServiceSpec, options: Options) -> str:
    port = "" if spec.service.port == 80 else f":{spec.service.port}"
    return f"http://{name}.{namespace}.svc.{options.cluster_domain}{port}"


def endpoints(name: str, namespace: str, spec: EmbeddingServiceSpec, options: Options) -> dict[str, str]:
    base = service_url(name, namespace, spec, options)
    task = detect_task(spec.model)
    out = {"service": base}
    if task in ("embed", "sparse"):
        out["openai"] = base + "/v1"
    if task == "rerank":
        out["rerank"] = base + "/rerank"
    if has_batch_service(spec):
        out["batch"] = service_url(batch_service_name(name), namespace, spec, options)


    if spec.gateway and spec.gateway.hostnames:
        out["external"] = f"https://{spec.gateway.hostnames[0]}{spec.gateway.path_prefix}"
    return out


def autoscaler_kind(spec: EmbeddingServiceSpec, options: Options) -> str | None:
    if not spec.autoscaling:
        return None
    provider = spec.autoscaling.provider
    if provider == "auto":
        return "keda" if SCALEDOBJECT in options.capabilities else "hpa"
    return provider


def content_hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def has_batch_service(spec: EmbeddingServiceSpec) -> bool:
    """Does the spec ask for the batch lane's own address, `<name>-batch` (spec.lanes.batchService)?"""
    return spec.lanes is not None and spec.lanes.batch_service


def object_meta(name: str, namespace: str, labels: dict, owner: dict | None) -> dict:
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": labels}
    if owner:
        meta["ownerReferences"] = [owner]
    return meta


def batch_service_name(name: str) -> str:
    return f"{name}-batch"


