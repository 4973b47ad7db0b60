"""Pure, deterministic rendering: EmbeddingService → child manifests (plain dicts, built as data).

Nothing here talks to a cluster. The same function serves the reconciler and `embedops-operator render`.
"""
from __future__ import annotations

import hashlib
import json
import shlex
from dataclasses import dataclass, field
from typing import Any

from jinja2 import Environment, StrictUndefined

from embedops_server import sizing

from . import memory
from .settings import OperatorSettings
from .spec import API_VERSION, EmbeddingService, EmbeddingServiceSpec, GFD_PRODUCT, KIND, ModelSpec, NFD_CPUID, parse as parse_resource

MANAGER = "embedops"
SERVER_PORT = 8080
BATCH_PORT = 8081  # the server's --batch-port (spec.lanes.batchService): the same API, batch lane by default
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

SERVICEMONITOR = ("monitoring.coreos.com/v1", "ServiceMonitor")
HTTPROUTE = ("gateway.networking.k8s.io/v1", "HTTPRoute")
SCALEDOBJECT = ("keda.sh/v1alpha1", "ScaledObject")
NETWORKPOLICY = ("networking.k8s.io/v1", "NetworkPolicy")
OPTIONAL_KINDS = (SERVICEMONITOR, HTTPROUTE, SCALEDOBJECT)
FEATURE_OF_KIND = {SERVICEMONITOR: "monitoring", HTTPROUTE: "routes", SCALEDOBJECT: "autoscaling"}  # spec feature

# OpenAI clients pointed at <gateway><pathPrefix>/v1 list models before embedding; Cohere/Jina clients rerank
# at /v1/rerank. Without a pathPrefix or hostnames, services sharing a gateway share these paths too.
ROUTE_PATHS = {
    "embed": [("PathPrefix", "/v1/embeddings"), ("Exact", "/embed"), ("Exact", "/embed_all"),
              ("PathPrefix", "/v1/models")],
    "sparse": [("Exact", "/embed_sparse"), ("Exact", "/embed")],
    "rerank": [("Exact", "/rerank"), ("Exact", "/v1/rerank")],
    "classify": [("Exact", "/predict")],
}
# model.outputs of an embed service (bge-m3 layout): the routes each output adds.
OUTPUT_PATHS = {
    "dense": [("PathPrefix", "/v1/embeddings"), ("Exact", "/embed"), ("Exact", "/embed_all")],
    "sparse": [("Exact", "/embed_sparse")],
    "colbert": [("Exact", "/embed_colbert")],
}


def route_paths(spec: EmbeddingServiceSpec) -> list[tuple[str, str]]:
    """The HTTPRoute's (match type, path) pairs: by task, and for an embed service with model.outputs by output
    (plus /embed_hybrid when it has two or more, and /v1/models for OpenAI clients' discovery)."""
    task = detect_task(spec.model)
    outputs = spec.model.outputs
    if task != "embed" or not outputs:
        return ROUTE_PATHS[task]
    paths = [p for o in ("dense", "sparse", "colbert") if o in outputs for p in OUTPUT_PATHS[o]]
    if len(set(outputs)) > 1:
        paths.append(("Exact", "/embed_hybrid"))
    return paths + [("PathPrefix", "/v1/models")]


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

    @classmethod
    def of(cls, settings: OperatorSettings, capabilities: frozenset[tuple[str, str]] | None = None) -> "Options":
        return cls(cpu_image=settings.server_image_cpu, cuda_image=settings.server_image_cuda,
                   cluster_domain=settings.cluster_domain,
                   capabilities=frozenset(OPTIONAL_KINDS) if capabilities is None else capabilities,
                   pod_upgrades=settings.pod_upgrades, max_concurrent_upgrades=settings.max_concurrent_upgrades,
                   gateway_namespaces=settings.gateway_namespaces, keda_namespaces=settings.keda_namespaces,
                   prometheus_namespaces=settings.prometheus_namespaces)


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
    if model.task:
        return model.task
    ident = model.id.lower()
    if "rerank" in ident or "cross-encoder" in ident or "ms-marco" in ident:
        return "rerank"
    if "splade" in ident:
        return "sparse"
    return "embed"


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


# ---------------------------------------------------------------------------------------------------- pod

ONNX_CACHE = "/var/cache/embedops"  # the prepared ONNX graphs (model.cache, else an emptyDir per pod)
DEFAULT_CACHE_SIZE = "8Gi"  # the ONNX cache emptyDir of a model the operator cannot size


def sizing_of(spec: EmbeddingServiceSpec) -> memory.Sizing | None:
    return memory.estimate(spec, dtype(spec))


def _resources(spec: EmbeddingServiceSpec) -> dict:
    acc = spec.accelerator
    if acc.cpu:
        mem = memory.cpu_memory(spec, sizing_of(spec))
        res = {"requests": {"cpu": str(acc.cpu.cores), "memory": mem},
               "limits": {"cpu": str(acc.cpu.cores), "memory": mem}}
    elif acc.mig:
        key = f"nvidia.com/mig-{acc.mig.profile}" if acc.mig.strategy == "mixed" else "nvidia.com/gpu"
        res = {"requests": {"cpu": "2", "memory": "8Gi"},
               "limits": {"memory": "8Gi", key: str(acc.mig.count)}}
    else:
        res = {"requests": {"cpu": "4", "memory": "16Gi"},
               "limits": {"memory": "16Gi", "nvidia.com/gpu": str(acc.gpu.count)}}
    if spec.resources:  # user overrides win, per section and key
        for section, values in spec.resources.items():
            if isinstance(values, dict):
                res.setdefault(section, {}).update({k: str(v) for k, v in values.items()})
    return res


def _node_selector(spec: EmbeddingServiceSpec) -> dict[str, str]:
    acc = spec.accelerator
    sel: dict[str, str] = {}
    if acc.cpu:
        if acc.cpu.instruction_sets:  # x86 instruction sets imply amd64 nodes
            sel["kubernetes.io/arch"] = "amd64"
        for isa in acc.cpu.instruction_sets:
            sel[f"feature.node.kubernetes.io/cpu-cpuid.{NFD_CPUID[isa]}"] = "true"
    elif acc.mig and acc.mig.strategy == "single":
        sel["nvidia.com/gpu.product"] = f"{GFD_PRODUCT[acc.mig.product]}-MIG-{acc.mig.profile}"
        sel["nvidia.com/mig.config"] = f"all-{acc.mig.profile}"
    elif acc.gpu and acc.gpu.product:
        sel["nvidia.com/gpu.product"] = acc.gpu.product
    sel.update(spec.node_selector or {})
    return dict(sorted(sel.items()))


def has_batch_service(spec: EmbeddingServiceSpec) -> bool:
    """Does the spec ask for the batch lane's own address, `<name>-batch` (spec.lanes.batchService)?"""
    return spec.lanes is not None and spec.lanes.batch_service


def batch_port(spec: EmbeddingServiceSpec, revision: int = TEMPLATE_REVISION) -> bool:
    """Does the server listen on BATCH_PORT (the <name>-batch Service's target)?"""
    return revision >= 3 and has_batch_service(spec)


def _args(spec: EmbeddingServiceSpec, revision: int = TEMPLATE_REVISION) -> list[str]:
    m, b = spec.model, spec.batching
    args = ["--model-id", m.id]
    if m.revision:
        args += ["--revision", m.revision]
    args += ["--hostname", "0.0.0.0", "--port", str(SERVER_PORT),
             "--dtype", dtype(spec),
             "--served-model-name", served_model_name(spec),
             "--max-batch-tokens", str(b.max_batch_tokens),
             "--max-concurrent-requests", str(b.max_concurrent_requests),
             "--max-client-batch-size", str(b.max_client_batch_size),
             "--auto-truncate", "true" if b.auto_truncate else "false"]
    if b.max_batch_requests:
        args += ["--max-batch-requests", str(b.max_batch_requests)]
    if m.max_input_length:  # bounds the longest input, the warm-up and the attention memory
        args += ["--max-input-length", str(m.max_input_length)]
    if m.quantize:
        args += ["--quantize", m.quantize]
    if spec.accelerator.cpu:  # intra-op threads match the CPU limit
        args += ["--num-threads", str(spec.accelerator.cpu.cores)]
    # SIGTERM arrives after the preStop sleep; in-flight requests get the rest of the grace period
    args += ["--graceful-shutdown-timeout", str(GRACE_MARGIN - 5)]
    if revision >= 2 and spec.service.max_connection_age_seconds:
        # clients that keep connections open follow the Service's selector (a promoted space, new replicas)
        args += ["--max-connection-age", str(spec.service.max_connection_age_seconds)]
    lanes = spec.lanes
    if revision >= 3 and lanes is not None:  # unset: the server's defaults (lanes on, auto)
        if not lanes.enabled:
            args += ["--lanes", "false"]
        if lanes.default != "auto":
            args += ["--default-lane", lanes.default]
        if batch_port(spec, revision):
            args += ["--batch-port", str(BATCH_PORT)]
    if m.pooling:
        args += ["--pooling", m.pooling]
    if m.prompts and m.prompts.default_prompt_name:
        args += ["--default-prompt-name", m.prompts.default_prompt_name]
    if m.prompts and m.prompts.default_prompt:
        args += ["--default-prompt", m.prompts.default_prompt]
    if m.outputs:  # a folder without the heads fails at start (a crash-looping pod), not per request (424)
        args += ["--outputs", ",".join(o for o in ("dense", "sparse", "colbert") if o in m.outputs)]
    args.append("--json-output")
    return args


def _env(spec: EmbeddingServiceSpec, cache_dir: str | None, api_key: bool = True) -> list[dict]:
    env: list[dict] = [
        {"name": "HOME", "value": "/tmp"},
        {"name": "TMPDIR", "value": "/tmp"},
        {"name": "XDG_CACHE_HOME", "value": "/tmp/.cache"},
    ]
    if cache_dir:
        env += [{"name": "HF_HOME", "value": cache_dir},
                {"name": "HUGGINGFACE_HUB_CACHE", "value": f"{cache_dir}/hub"}]
    src = spec.model.source
    if src and (src.pvc or src.download):
        env.append({"name": "HF_HUB_OFFLINE", "value": "1"})
    env.append({"name": "ONNX_CACHE", "value": ONNX_CACHE})
    if spec.accelerator.cpu:
        threads = str(spec.accelerator.cpu.cores)
        est = sizing_of(spec)
        # A large model's forwards take seconds: one tokenizer thread keeps up, and each tokenizer instance
        # holds its vocabulary (~110 MB for XLM-R's 250k pieces)
        big = est is not None and est.replica.weights > memory.PARALLEL_MAX_WEIGHTS
        workers = 1 if big else max(1, min(4, spec.accelerator.cpu.cores // 2))
        env += [{"name": "OMP_NUM_THREADS", "value": threads},
                {"name": "MKL_NUM_THREADS", "value": threads},
                {"name": "ORT_NUM_THREADS", "value": threads},
                {"name": "TOKENIZATION_WORKERS", "value": str(workers)}]
    if spec.api_key_secret_ref and api_key:
        env.append({"name": "API_KEY", "valueFrom": {"secretKeyRef": {
            "name": spec.api_key_secret_ref.name, "key": spec.api_key_secret_ref.key}}})
    user = {e.get("name") for e in spec.env or []}
    return [e for e in env if e["name"] not in user] + list(spec.env or [])


def _probe(period: int, failures: int, timeout: int = 3) -> dict:
    return {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": period,
            "failureThreshold": failures, "timeoutSeconds": timeout}


DEFAULT_MODEL_CACHE = "20Gi"  # the download cache of a model the operator cannot size (and of revision 0)


def model_cache_size(spec: EmbeddingServiceSpec, revision: int = TEMPLATE_REVISION) -> str:
    """The download cache's size limit: model.source.download.cacheSize, else (revision 1) what the download
    holds: the weights as the hub stores them (float32: 4 bytes a parameter) plus a quarter and 1Gi for the
    tokenizer, configs and heads; 20Gi for a model the operator cannot size. Every pod requests it as ephemeral
    storage, so 20Gi for a 90 MB model would keep pods off nodes with disk to spare."""
    src = spec.model.source
    if src and src.download and src.download.cache_size:
        return src.download.cache_size
    est = sizing_of(spec)
    if revision < 1 or est is None:
        return DEFAULT_MODEL_CACHE
    return sizing.quantity(sizing.round_up(int(est.geometry.parameters * 4 * 1.25) + (1 << 30), 1 << 30))


LOG_STORAGE = 1 << 30  # a container's logs and its (read-only) root filesystem's writable layer, beside its volumes


def ephemeral_storage(volumes: list[dict]) -> dict[str, str]:
    """What a pod's node disk holds for it: every disk-backed emptyDir at its size limit (the model download
    cache, the prepared ONNX graph, /tmp), which the scheduler otherwise never plans for (nodes meet
    DiskPressure evictions instead). Requested by each container (the scheduler takes the largest init
    container's or the sum of the app containers': one app container here), limited to that plus the logs."""
    total = sum(sizing.parse_quantity(v["emptyDir"].get("sizeLimit", "0")) for v in volumes
                if "emptyDir" in v and v["emptyDir"].get("medium") != "Memory")
    return {"requests": sizing.quantity(total), "limits": sizing.quantity(total + LOG_STORAGE)}


def pod_template(name: str, spec: EmbeddingServiceSpec, options: Options, pin: Pin = Pin(),
                 service_name: str | None = None) -> dict:
    """The model server's pods of track `name` (the service `service_name`, by default the same)."""
    task = detect_task(spec.model)
    gpu = not spec.accelerator.cpu
    image = spec.image or pin.image or (options.cuda_image if gpu else options.cpu_image)
    revision = pin.revision
    volumes: list[dict] = [{"name": "tmp", "emptyDir": {"sizeLimit": "2Gi"}}]
    mounts: list[dict] = [{"name": "tmp", "mountPath": "/tmp"}]
    init: list[dict] = []
    src = spec.model.source
    cache_dir: str | None
    if src and src.pvc:
        pvc: dict[str, Any] = {"name": "models", "mountPath": src.pvc.mount_path, "readOnly": True}
        if src.pvc.sub_path:
            pvc["subPath"] = src.pvc.sub_path
        volumes.append({"name": "models", "persistentVolumeClaim": {"claimName": src.pvc.claim_name,
                                                                    "readOnly": True}})
        mounts.append(pvc)
        cache_dir = src.pvc.mount_path
    else:
        size = model_cache_size(spec, revision)
        volumes.append({"name": "model-cache", "emptyDir": {"sizeLimit": size}})
        mounts.append({"name": "model-cache", "mountPath": "/models"})
        cache_dir = "/models"
        if src and src.download:
            dl_env = [{"name": "HOME", "value": "/tmp"},
                      {"name": "HF_HOME", "value": "/models"},
                      {"name": "HUGGINGFACE_HUB_CACHE", "value": "/models/hub"}]
            if src.download.hf_token_secret_ref:
                ref = src.download.hf_token_secret_ref
                dl_env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
            init.append({
                "name": "download-model",
                "image": src.download.image or image,
                "command": ["sh", "-c", download_script(spec, quote_cache=revision >= 1)],
                "env": dl_env,
                "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, {"name": "model-cache", "mountPath": "/models"}],
                "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
                "securityContext": _container_security(),
            })
    est = sizing_of(spec)
    cache = spec.model.cache
    if cache:  # outlives the pod: the first pod's prepare step fills it, later pods load what it made
        volumes.append({"name": "onnx-cache", "persistentVolumeClaim": {"claimName": cache.claim_name}})
    else:
        size = sizing.quantity(sizing.round_up(est.cache, 1 << 30)) if est and est.cache else DEFAULT_CACHE_SIZE
        volumes.append({"name": "onnx-cache", "emptyDir": {"sizeLimit": size}})
    cache_mount: dict[str, Any] = {"name": "onnx-cache", "mountPath": ONNX_CACHE}
    if cache and cache.sub_path:
        cache_mount["subPath"] = cache.sub_path
    # the server only reads what the prepare step made: a server that would write there is a bug, not a fallback
    server_mounts = mounts + [{**cache_mount, "readOnly": True}]
    # the prepare step answers no request: it has no use for the API key (revision 1)
    init.append(_prepare_container(spec, image, _args(spec, revision), _env(spec, cache_dir, api_key=revision < 1),
                                   [dict(m) for m in mounts] + [cache_mount], est))
    if gpu:
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}})
        server_mounts.append({"name": "dshm", "mountPath": "/dev/shm"})

    container: dict[str, Any] = {
        "name": "server",
        "image": image,
        "command": ["embedops-server"],
        "args": _args(spec, revision),
        "env": _env(spec, cache_dir),
        "ports": [{"name": "http", "containerPort": SERVER_PORT, "protocol": "TCP"}] + (
            [{"name": "batch", "containerPort": BATCH_PORT, "protocol": "TCP"}] if batch_port(spec, revision) else []),
        "resources": _resources(spec),
        "startupProbe": _probe(period=5, failures=120),  # up to 10 minutes to load weights
        "readinessProbe": _probe(period=5, failures=2),
        "livenessProbe": _probe(period=10, failures=3, timeout=5),
        "lifecycle": {"preStop": {"sleep": {"seconds": spec.drain_seconds}}} if spec.drain_seconds else None,
        "volumeMounts": server_mounts,
        "securityContext": _container_security(),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    container = {k: v for k, v in container.items() if v is not None}
    if revision >= 1:
        storage = ephemeral_storage(volumes)
        for c in [container, *init]:
            for section in ("requests", "limits"):  # a value from spec.resources stays
                c["resources"].setdefault(section, {}).setdefault("ephemeral-storage", storage[section])

    tolerations: list[dict] = []
    if gpu:
        tolerations.append({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"})
    tolerations += list(spec.tolerations or [])

    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": spec.drain_seconds + GRACE_MARGIN,
        "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
        "volumes": volumes,
        "topologySpreadConstraints": [
            {"maxSkew": 1, "topologyKey": key, "whenUnsatisfiable": "ScheduleAnyway",
             "labelSelector": {"matchLabels": selector_labels(name)}, "matchLabelKeys": ["pod-template-hash"]}
            for key in ("kubernetes.io/hostname", "topology.kubernetes.io/zone")],
    }
    if init:
        pod_spec["initContainers"] = init
    node_selector = _node_selector(spec)
    if node_selector:
        pod_spec["nodeSelector"] = node_selector
    if tolerations:
        pod_spec["tolerations"] = tolerations
    if spec.affinity:
        pod_spec["affinity"] = spec.affinity
    if spec.priority_class_name:
        pod_spec["priorityClassName"] = spec.priority_class_name
    if spec.service_account_name:
        pod_spec["serviceAccountName"] = spec.service_account_name
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s.name} for s in spec.image_pull_secrets]
    metadata: dict[str, Any] = {"labels": track_labels(service_name or name, name, task)}
    if spec.pod_annotations:
        metadata["annotations"] = dict(sorted(spec.pod_annotations.items()))
    return {"metadata": metadata, "spec": pod_spec}


# What every server reads besides the weights: configs, tokenizer files, sentence-transformers modules, and
# bge-m3's heads (sparse_linear.pt, colbert_linear.pt: a few MB)
MODEL_FILES = ("*.json", "*.txt", "*.model", "1_Pooling/*", "sparse_linear.pt", "colbert_linear.pt")
ONNX_FILES = ("onnx/model.onnx", "onnx/model.onnx_data", "model.onnx", "model.onnx_data")


def download_script(spec: EmbeddingServiceSpec, hub: str = "/models/hub", quote_cache: bool = True) -> str:
    """The download init container's `sh -c`: `hf download` of only the files the server will load, not the
    whole repository (BAAI/bge-m3 ships its weights twice, as torch weights and as onnx/model.onnx + data: 4.5
    GB where 2.3 GB serve). ONNX Runtime (CPU, float32 or int8): the ONNX graph, else, for a repository
    without one, the safetensors the prepare step exports. torch (GPU, float16): the safetensors, else the
    .bin weights. `model.revision` pins the commit. What arrived is read from the hub cache's snapshot folder
    (HF_HUB_CACHE=/models/hub), not from hf's output, whose format changes between versions."""
    m = spec.model
    base = "hf download " + shlex.quote(m.id) + (f" --revision {shlex.quote(m.revision)}" if m.revision else "")
    include = lambda patterns: " ".join("--include " + shlex.quote(p) for p in patterns)  # noqa: E731
    snapshots = f"{hub}/models--{m.id.replace('/', '--')}/snapshots/*"
    if memory.runs_onnx(spec):
        first, fallback, have = ONNX_FILES, ("*.safetensors",), ("onnx/model.onnx", "model.onnx")
    else:
        first, fallback, have = ("*.safetensors",), ("*.bin",), ("*.safetensors",)
    if quote_cache:  # the id inside quotes, the globs outside: the shell expands only the snapshot wildcards
        cache = shlex.quote(f"{hub}/models--{m.id.replace('/', '--')}")
        found = " ".join(f"{cache}/snapshots/*/{h}" for h in have)
    else:  # revision 0 (the model id's pattern in the CRD keeps shell syntax out of it since)
        found = " ".join(f"{snapshots}/{h}" for h in have)
    return (f"set -eu; {base} {include(MODEL_FILES + first)}; have=0; "
            f"for f in {found}; do if [ -e \"$f\" ]; then have=1; fi; done; "
            f"if [ $have = 0 ]; then {base} {include(fallback)}; fi")


def _prepare_container(spec: EmbeddingServiceSpec, image: str, args: list[str], env: list[dict],
                       mounts: list[dict], est: memory.Sizing | None) -> dict:
    """`embedops-server prepare` with the server's own flags: the ONNX export, int8 quantization and its
    quality check made once into the ONNX cache (a second run finds them and exits in about a second), so the
    server loads only the prepared graph. Its termination message (what it made, the model commit) is read
    into the EmbeddingService's status. It requests what the server requests (scheduling and the pod's
    effective request are unchanged) and may burst to the preparation's estimated peak: bge-m3 int8 needs
    ~9 GB once, then 1.5-2 GB to serve."""
    server = _resources(spec)
    if spec.accelerator.cpu:
        requests = dict(server["requests"])
        limit = server["limits"]["memory"]
        if est is not None and est.prepare:
            need = sizing.round_up(int(est.prepare * memory.HEADROOM))
            if need > sizing.parse_quantity(limit):
                limit = sizing.quantity(need)
        limits = {"cpu": server["limits"]["cpu"], "memory": limit}
    else:  # torch on a GPU: nothing to prepare; it resolves the model and reports its commit
        requests, limits = {"cpu": "250m", "memory": "512Mi"}, {"memory": "2Gi"}
    return {
        "name": "prepare",
        "image": image,
        "command": ["embedops-server", "prepare"],
        "args": [a for a in args if a != "--json-output"] + ["--json-output"],
        "env": env,
        "volumeMounts": mounts,
        "resources": {"requests": requests, "limits": limits},
        "securityContext": _container_security(),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def _container_security() -> dict:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}


# ---------------------------------------------------------------------------------------------------- children

def _meta(name: str, namespace: str, labels: dict, owner: dict | None) -> dict:
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": labels}
    if owner:
        meta["ownerReferences"] = [owner]
    return meta


def pin_annotations(meta: dict, pin: Pin, template: dict) -> dict:
    """A Deployment's record of its pin: the template revision and the hash of the template as rendered (the
    reconciler compares it with what the spec renders at that pin now, to tell a spec change from an upgrade)."""
    meta.setdefault("annotations", {}).update({ANNOTATION_TEMPLATE_REVISION: str(pin.revision),
                                               ANNOTATION_TEMPLATE_HASH: content_hash(template)})
    return meta


def deployment(name: str, ns: str, spec: EmbeddingServiceSpec, options: Options, owner: dict | None,
               pin: Pin = Pin(), track: str | None = None, replicas: int | None = None) -> dict:
    """The model server's Deployment of the service `name`: the track `track` (its name and its pods' instance
    label; the service's own name but during a change of the embedding space), with `replicas` when given."""
    service_name, name = name, track or name
    labels = track_labels(service_name, name, detect_task(spec.model))
    gpu = not spec.accelerator.cpu
    if gpu and pin.give_up_first:  # no spare accelerator for a surge pod: the old pod gives its slice/GPU up first
        rolling: dict[str, Any] = {"maxSurge": 0, "maxUnavailable": 1}
    else:
        # CPU, and GPU/MIG while a spare accelerator may exist: the replacement loads before an old replica stops
        # (one replica is never down for a model load); the reconciler switches a GPU rollout to the above as soon
        # as its surge pod cannot be scheduled, so a full node never deadlocks it
        rolling = {"maxSurge": 1, "maxUnavailable": 0}
    if spec.rollout:  # e.g. one GPU replica with a spare slice: surge instead of an outage for a model load
        if spec.rollout.max_surge is not None:
            rolling["maxSurge"] = spec.rollout.max_surge
        if spec.rollout.max_unavailable is not None:
            rolling["maxUnavailable"] = spec.rollout.max_unavailable
    strategy = {"type": "RollingUpdate", "rollingUpdate": rolling}
    dspec: dict[str, Any] = {}
    if replicas is not None:
        dspec["replicas"] = replicas
    elif not spec.autoscaling:
        dspec["replicas"] = spec.replicas
    dspec.update({
        "revisionHistoryLimit": 3,
        "progressDeadlineSeconds": 600,
        "selector": {"matchLabels": selector_labels(name)},
        "strategy": strategy,
        "template": pod_template(name, spec, options, pin, service_name),
    })
    meta = pin_annotations(_meta(name, ns, labels, owner), pin, dspec["template"])
    if gpu and pin.give_up_first:
        meta["annotations"][ANNOTATION_SURGE_REFUSED] = meta["annotations"][ANNOTATION_TEMPLATE_HASH]
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta, "spec": dspec}


def service(name: str, ns: str, spec: EmbeddingServiceSpec, owner: dict | None, serving: str | None = None) -> dict:
    """The service's address: selects the pods of the track that serves (`serving`, by default its own name)."""
    return _service_object(name, ns, common_labels(name, detect_task(spec.model)), owner, spec.service.type,
                           serving or name, spec.service.port, "http")


def _service_object(svc_name: str, ns: str, labels: dict, owner: dict | None, kind: str, track: str, port: int,
                    target_port: str) -> dict:
    """A Service selecting one track's pods: the service's address, a space's or the batch lane's."""
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(svc_name, ns, labels, owner),
            "spec": {"type": kind, "selector": selector_labels(track),
                     "ports": [{"name": "http", "port": port, "targetPort": target_port,
                                "protocol": "TCP", "appProtocol": "http"}]}}


def batch_service_name(name: str) -> str:
    return f"{name}-batch"


def batch_service(name: str, ns: str, spec: EmbeddingServiceSpec, owner: dict | None,
                  serving: str | None = None) -> dict:
    """The batch lane's address `<name>-batch` (spec.lanes.batchService): the serving track's pods, as the
    service's own Service selects them (one embedding space behind both addresses, through a promotion too), on
    their batch port, where requests default to the batch lane. Its instance label is its own, so the
    ServiceMonitor (which selects the service's Service) does not scrape a pod twice."""
    svc_name = batch_service_name(name)
    labels = {**common_labels(name, detect_task(spec.model)), LABEL_INSTANCE: svc_name}
    return _service_object(svc_name, ns, labels, owner, "ClusterIP", serving or name, spec.service.port, "batch")


def space_service(name: str, ns: str, spec: EmbeddingServiceSpec, owner: dict | None, key: str,
                  track: str) -> dict:
    """A space's own address during a migration, `<name>-<key>` (ClusterIP): its reindex Job and clients that
    must reach that space whichever one serves the service's address. Its instance label is its own, so the
    ServiceMonitor (which selects the service's Service) does not scrape a pod twice."""
    from .spaces import space_service_name

    svc_name = space_service_name(name, key)
    labels = {**common_labels(name, detect_task(spec.model)), LABEL_INSTANCE: svc_name, LABEL_SPACE: key}
    return _service_object(svc_name, ns, labels, owner, "ClusterIP", track, spec.service.port, "http")


# ------------------------------------------------------------------------------------ scale from zero
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


def reindex_job(name: str, ns: str, spec: EmbeddingServiceSpec, owner: dict | None, env: dict[str, str]) -> dict:
    """The user's reindex Job for a new embedding space (spec.migration.reindex): its pod template as given, each
    container with the space's environment (EMBEDOPS_SPACE, _URL, _FINGERPRINT, EMBEDOPS_PREVIOUS_SPACE, _URL). A
    Job's template cannot change: its name carries the space and a hash of the template, so an edit runs a new Job
    (the old one is pruned)."""
    reindex = spec.migration.reindex
    assert reindex is not None
    template = json.loads(json.dumps(reindex.template))
    pod = template.setdefault("spec", {})
    pod.setdefault("restartPolicy", "Never")
    extra = [{"name": k, "value": v} for k, v in sorted(env.items())]
    for c in pod.get("containers") or []:
        c["env"] = [e for e in c.get("env") or [] if e.get("name") not in env] + extra
    digest = reindex_digest(spec)
    job_spec: dict[str, Any] = {"backoffLimit": reindex.backoff_limit, "template": template}
    if reindex.active_deadline_seconds:
        job_spec["activeDeadlineSeconds"] = reindex.active_deadline_seconds
    labels = {**common_labels(name, detect_task(spec.model)), LABEL_COMPONENT: "reindex", LABEL_SPACE: env["EMBEDOPS_SPACE"]}
    template.setdefault("metadata", {}).setdefault("labels", {}).update(
        {LABEL_COMPONENT: "reindex", LABEL_SPACE: env["EMBEDOPS_SPACE"]})
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": _meta(reindex_job_name(name, env["EMBEDOPS_SPACE"], digest), ns, labels, owner),
            "spec": job_spec}


def reindex_digest(spec: EmbeddingServiceSpec) -> str:
    r = spec.migration.reindex
    assert r is not None
    return content_hash([r.template, r.backoff_limit, r.active_deadline_seconds])[:4]


def reindex_job_name(name: str, key: str, digest: str) -> str:
    return f"{name[:36]}-reindex-{key}-{digest}"


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
            "metadata": _meta(name, ns, activator_labels(name), owner),
            "spec": {"type": spec.service.type, "selector": activator_selector(name),
                     "ports": [{"name": "http", "port": spec.service.port, "targetPort": "http",
                                "protocol": "TCP", "appProtocol": "http"}]}}


def activator_admin_service(name: str, ns: str, owner: dict | None) -> dict:
    """The activator's admin port (/demand for KEDA, /metrics, /healthz) on a ClusterIP Service of its own."""
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _meta(activator_name(name), ns, activator_labels(name), owner),
            "spec": {"type": "ClusterIP", "selector": activator_selector(name),
                     "ports": [{"name": "admin", "port": ACTIVATOR_ADMIN_PORT, "targetPort": "admin",
                                "protocol": "TCP", "appProtocol": "http"}]}}


def activator_pdb(name: str, ns: str, owner: dict | None) -> dict:
    """The activator answers the service's address at every replica count: one of its two pods stays."""
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": _meta(activator_name(name), ns, activator_labels(name), owner),
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
        "securityContext": _container_security(),
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
            "metadata": pin_annotations(_meta(activator_name(name), ns, activator_labels(name), owner), pin, template),
            "spec": {"replicas": ACTIVATOR_REPLICAS, "revisionHistoryLimit": 3,
                     "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
                     "selector": {"matchLabels": activator_selector(name)}, "template": template}}


# ------------------------------------------------------------------------------------ network policy
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # set on every namespace by the API server (1.22+)


def _from_namespaces(names) -> dict:
    return {"namespaceSelector": {"matchExpressions": [
        {"key": NAMESPACE_NAME_LABEL, "operator": "In", "values": sorted(set(names))}]}}


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
        # reindex Jobs' pods carry the component and the space, not the service (a Job's template cannot change)
        peers.append({"podSelector": {"matchLabels": {LABEL_COMPONENT: "reindex"}}})
    names = set(npol.from_namespaces)
    if spec.gateway:
        names |= set(options.gateway_namespaces)
    if spec.monitoring.service_monitor.enabled:
        names |= set(options.prometheus_namespaces)
    if npol.allow_same_namespace:
        names.discard(ns)  # already admitted, every pod of it
    if names:
        peers.append(_from_namespaces(names))
    # the model server and the activator both serve the API on SERVER_PORT (== ACTIVATOR_PORT), and /metrics there
    ports = [{"protocol": "TCP", "port": SERVER_PORT}]
    if has_batch_service(spec):  # the batch lane's address (lanes.batchService)
        ports.append({"protocol": "TCP", "port": BATCH_PORT})
    rules: list[dict] = [{"from": peers, "ports": ports}]
    a = spec.autoscaling
    if a is not None and a.min_replicas == 0 and options.keda_namespaces:
        rules.append({"from": [_from_namespaces(options.keda_namespaces)],
                      "ports": [{"protocol": "TCP", "port": ACTIVATOR_ADMIN_PORT}]})
    return {"apiVersion": NETWORKPOLICY[0], "kind": NETWORKPOLICY[1],
            "metadata": _meta(name, ns, common_labels(name, detect_task(spec.model)), owner),
            "spec": {"podSelector": {"matchLabels": {LABEL_SERVICE: name}}, "policyTypes": ["Ingress"],
                     "ingress": rules}}


def service_monitor(name: str, ns: str, spec: EmbeddingServiceSpec, owner: dict | None) -> dict:
    sm = spec.monitoring.service_monitor
    labels = {**common_labels(name, detect_task(spec.model)), **sm.labels}
    # service="<name>" on every series, what the ScaledObject's query, the dashboard and the alerts filter on.
    # Scaled to zero it scrapes <name>-backend; set always, so that switching to minReplicas 0 leaves the
    # ServiceMonitor (and Prometheus' config) as it is: seen live, a Prometheus that had not yet reloaded a
    # changed ServiceMonitor scraped the woken pod as service="<name>-backend" for minutes.
    endpoint: dict[str, Any] = {"port": "http", "path": "/metrics", "interval": sm.interval,
                                "relabelings": [{"action": "replace", "targetLabel": "service", "replacement": name}]}
    return {"apiVersion": SERVICEMONITOR[0], "kind": SERVICEMONITOR[1],
            "metadata": _meta(name, ns, labels, owner),
            "spec": {"selector": {"matchLabels": selector_labels(name)},
                     "namespaceSelector": {"matchNames": [ns]},
                     "endpoints": [endpoint]}}


def space_gateway_path(spec: EmbeddingServiceSpec, key: str) -> str:
    """Where one embedding space answers on the service's gateway during a migration: its own routes under
    `<pathPrefix>/spaces/<key>`, whichever space the service's own routes reach."""
    assert spec.gateway is not None
    return f"{spec.gateway.path_prefix}/spaces/{key}"


def http_route(name: str, ns: str, spec: EmbeddingServiceSpec, owner: dict | None, space: str | None = None) -> dict:
    """The service's routes on its gateway(s); with `space` (a key), that space's own during a migration: the same
    paths under space_gateway_path, to the space's own Service `<name>-<key>`."""
    from .spaces import space_service_name

    gw = spec.gateway
    assert gw is not None
    prefix = gw.path_prefix if space is None else space_gateway_path(spec, space)
    backend = name if space is None else space_service_name(name, space)
    rules = []
    for kind, path in route_paths(spec):
        rule: dict[str, Any] = {"matches": [{"path": {"type": kind, "value": prefix + path}}]}
        if prefix:
            rule["filters"] = [{"type": "URLRewrite", "urlRewrite": {"path": (
                {"type": "ReplacePrefixMatch", "replacePrefixMatch": path} if kind == "PathPrefix"
                else {"type": "ReplaceFullPath", "replaceFullPath": path})}}]
        rule["backendRefs"] = [{"name": backend, "port": spec.service.port}]
        rules.append(rule)
    parents = []
    for p in gw.parent_refs:
        ref: dict[str, Any] = {"name": p.name}
        if p.namespace:
            ref["namespace"] = p.namespace
        if p.section_name:
            ref["sectionName"] = p.section_name
        parents.append(ref)
    route_spec: dict[str, Any] = {"parentRefs": parents}
    if gw.hostnames:
        route_spec["hostnames"] = list(gw.hostnames)
    route_spec["rules"] = rules
    labels = common_labels(name, detect_task(spec.model))
    if space is not None:  # its own instance label, as the space's Service has
        labels.update({LABEL_INSTANCE: backend, LABEL_SPACE: space})
    return {"apiVersion": HTTPROUTE[0], "kind": HTTPROUTE[1], "metadata": _meta(backend, ns, labels, owner),
            "spec": route_spec}


def scaled_object(name: str, ns: str, spec: EmbeddingServiceSpec, owner: dict | None, options: Options,
                  target: str | None = None) -> dict:
    a = spec.autoscaling
    assert a is not None
    to_zero = scales_to_zero(spec, options)
    query = f'sum(te_queue_size{{namespace="{ns}",service="{name}"}})'
    if spec.lanes is not None and spec.lanes.enabled and spec.lanes.scale_on == "interactive":
        # a backlog of ingestion is the batch lane's own business: replicas follow the queries' queue
        query = f'sum(embedops_lane_queue_size{{namespace="{ns}",service="{name}",lane="interactive"}})'
    triggers: list[dict] = [{"type": "prometheus", "metadata": {
        "serverAddress": a.prometheus_address, "query": query,
        "threshold": str(a.target_queue_depth), "ignoreNullValues": "true"}}]
    if to_zero:
        # the signal that exists while no pod does: the activator's held, in-flight and recent requests.
        # Activation only (any demand wakes 0 -> 1); above one replica the queue trigger decides, so this
        # trigger's per-replica target is out of reach.
        triggers.append({"type": "metrics-api", "metadata": {
            "url": activator_demand_url(name, ns, options), "valueLocation": "demand", "format": "json",
            "targetValue": "1000000", "activationTargetValue": "0"}})
    return {"apiVersion": SCALEDOBJECT[0], "kind": SCALEDOBJECT[1],
            "metadata": _meta(name, ns, common_labels(name, detect_task(spec.model)), owner),
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": target or name},
                     "minReplicaCount": a.min_replicas, "maxReplicaCount": a.max_replicas,
                     "pollingInterval": ZERO_POLLING_SECONDS if to_zero else 15, "cooldownPeriod": a.cooldown_seconds,
                     # KEDA's cooldownPeriod only delays the last step to zero; scaling down from N to the
                     # minimum is its HPA's, with Kubernetes' default 300 s window unless this sets it
                     "advanced": {"horizontalPodAutoscalerConfig": {"behavior": {"scaleDown": {
                         "stabilizationWindowSeconds": a.cooldown_seconds}}}},
                     "fallback": {"failureThreshold": 3, "replicas": max(a.min_replicas, 1)},
                     "triggers": triggers}}


def hpa(name: str, ns: str, spec: EmbeddingServiceSpec, owner: dict | None, target: str | None = None) -> dict:
    a = spec.autoscaling
    assert a is not None
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": _meta(name, ns, common_labels(name, detect_task(spec.model)), owner),
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": target or name},
                     "minReplicas": max(a.min_replicas, 1), "maxReplicas": a.max_replicas,
                     "metrics": [{"type": "Pods", "pods": {
                         "metric": {"name": "te_queue_size"},
                         "target": {"type": "AverageValue", "averageValue": str(a.target_queue_depth)}}}],
                     "behavior": {"scaleDown": {"stabilizationWindowSeconds": a.cooldown_seconds}}}}


def pdb(name: str, ns: str, spec: EmbeddingServiceSpec, owner: dict | None, serving: str | None = None) -> dict | None:
    """maxUnavailable 1 whenever the service can run more than one replica (fixed replicas > 1, or an autoscaler's
    maximum > 1): a service autoscaled to 6 is drained one pod at a time too. At one replica it blocks nothing."""
    most = spec.autoscaling.max_replicas if spec.autoscaling else spec.replicas
    if most <= 1:
        return None
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": _meta(name, ns, common_labels(name, detect_task(spec.model)), owner),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(serving or name)}}}


_LITELLM = Environment(undefined=StrictUndefined, keep_trailing_newline=True, autoescape=False).from_string(
    """# Managed by embedops for EmbeddingService {{ namespace }}/{{ name }}; merge into LiteLLM's model_list.
model_list:
{%- for entry_name, base in entries %}
- model_name: {{ entry_name | tojson }}
  litellm_params:
{%- if task == "rerank" %}
    model: {{ ("huggingface/" ~ served) | tojson }}
    api_base: {{ base | tojson }}
{%- else %}
    model: {{ ("openai/" ~ served) | tojson }}
    api_base: {{ (base ~ "/v1") | tojson }}
{%- endif %}
    api_key: {{ api_key | tojson }}
  model_info:
    mode: {{ "rerank" if task == "rerank" else "embedding" }}
{%- endfor %}
""")


def litellm_key(name: str) -> str:
    return f"embedops-{name}.yaml"


def litellm_config_map(name: str, ns: str, spec: EmbeddingServiceSpec, options: Options,
                       spaces: tuple[tuple[str, str], ...] = ()) -> dict:
    """This service's entries in the shared LiteLLM ConfigMap (one data key per service, own field manager): its
    model name at the service's address, `<model name>-batch` at the batch lane's (lanes.batchService), and during
    a change of the embedding space (`spaces`: (key, track) of
    each running one) one alias per space, `<model name>@<key>`, at that space's own address, so a query path or
    a reindex job can ask for one space by name whichever serves the service's address.

    No owner reference: the ConfigMap is shared and may be the user's; litellm.py removes stale keys.
    """
    from .spaces import space_service_name

    ll = spec.litellm
    assert ll is not None
    served = served_model_name(spec)
    model_name = ll.model_name or served
    entries = [(model_name, service_url(name, ns, spec, options))] + [
        (f"{model_name}@{key}", service_url(space_service_name(name, key), ns, spec, options)) for key, _ in spaces]
    if has_batch_service(spec):  # ingestion through the gateway, in the batch lane
        entries.append((f"{model_name}-batch", service_url(batch_service_name(name), ns, spec, options)))
    env_name = "EMBEDOPS_" + "".join(c if c.isalnum() else "_" for c in name.upper()) + "_API_KEY"
    text = _LITELLM.render(namespace=ns, name=name, entries=entries, served=served, task=detect_task(spec.model),
                           api_key=f"os.environ/{env_name}" if spec.api_key_secret_ref else "none")
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": ll.config_map_name, "namespace": ns, "labels": {LABEL_LITELLM: "true"}},
            "data": {litellm_key(name): text}}


def owner_reference(resource: dict) -> dict | None:
    meta = resource.get("metadata") or {}
    if not meta.get("uid"):
        return None
    return {"apiVersion": API_VERSION, "kind": KIND, "name": meta["name"], "uid": meta["uid"],
            "controller": True, "blockOwnerDeletion": True}


def render(resource: dict, options: Options | None = None, pins: Pins | None = None,
           tracks: Tracks | None = None, parsed: EmbeddingService | None = None) -> list[dict]:
    """All manifests the operator applies for this EmbeddingService, in apply order.

    Optional kinds absent from `options.capabilities` are left out (status reports them).
    Each manifest carries an `embedops.dev/applied-hash` annotation of its own content.
    `pins`: what the Deployments' pod templates are rendered with besides the spec (default: the latest
    revision and the operator's images; the reconciler passes what running Deployments are pinned to).
    `tracks`: which model Deployment the spec renders and which one the service's address serves (default: one,
    the service's own name; the reconciler passes spaces.plan's during a change of the embedding space). Only
    the spec's track is rendered: another one that still runs (the previous space) is left as it is.
    `parsed`: `resource` already parsed (the reconciler's Intent), else it is parsed here.
    """
    options = options or Options()
    pins = pins or Pins()
    es = parsed or parse_resource(resource)
    name = es.metadata["name"]
    ns = es.metadata.get("namespace") or "default"
    spec = es.spec
    tracks = tracks or Tracks.single(name)
    owner = owner_reference(resource)
    to_zero = scales_to_zero(spec, options)
    out: list[dict] = [deployment(name, ns, spec, options, owner, pins.server, tracks.spec, tracks.replicas)]
    if to_zero:  # the activator first, so its pod is starting when the Service's selector moves to it
        out += [activator_deployment(name, ns, spec, options, owner, pins.activator),
                activator_pdb(name, ns, owner), activator_admin_service(name, ns, owner),
                backend_service(name, ns, spec, owner, tracks.serving),
                activator_service(name, ns, spec, owner)]
    else:
        out.append(service(name, ns, spec, owner, tracks.serving))
    if has_batch_service(spec) and not to_zero:  # (CEL refuses it with to_zero)
        out.append(batch_service(name, ns, spec, owner, tracks.serving))
    out += [space_service(name, ns, spec, owner, key, track) for key, track in tracks.spaces]
    if tracks.reindex is not None and spec.migration.reindex is not None:
        out.append(reindex_job(name, ns, spec, owner, dict(tracks.reindex)))
    budget = pdb(name, ns, spec, owner, tracks.serving)
    if budget:
        out.append(budget)
    if spec.monitoring.service_monitor.enabled and SERVICEMONITOR in options.capabilities:
        out.append(service_monitor(name, ns, spec, owner))
    if spec.gateway and HTTPROUTE in options.capabilities:
        out.append(http_route(name, ns, spec, owner))
        out += [http_route(name, ns, spec, owner, key) for key, _ in tracks.spaces]
    scaler = autoscaler_kind(spec, options)
    if scaler == "keda" and SCALEDOBJECT in options.capabilities:
        out.append(scaled_object(name, ns, spec, owner, options, tracks.serving))
    elif scaler == "hpa":
        out.append(hpa(name, ns, spec, owner, tracks.serving))
    if spec.network_policy and spec.network_policy.enabled:
        # right after the Deployment, before any Service publishes its pods
        out.insert(1, network_policy(name, ns, spec, owner, options))
    if spec.litellm:
        out.append(litellm_config_map(name, ns, spec, options, tracks.spaces))
    for obj in out:
        if obj["kind"] == "ConfigMap":  # shared with other services: no per-object annotation
            continue
        obj["metadata"].setdefault("annotations", {})[ANNOTATION_HASH] = content_hash(obj)
    return out


def missing_capabilities(spec: EmbeddingServiceSpec, options: Options) -> dict[str, str]:
    """Requested optional features whose CRD is not installed: {feature: kind}."""
    missing: dict[str, str] = {}
    if spec.monitoring.service_monitor.enabled and SERVICEMONITOR not in options.capabilities:
        missing["monitoring"] = SERVICEMONITOR[1]
    if spec.gateway and HTTPROUTE not in options.capabilities:
        missing["routes"] = HTTPROUTE[1]
    if spec.autoscaling and spec.autoscaling.provider == "keda" and SCALEDOBJECT not in options.capabilities:
        missing["autoscaling"] = SCALEDOBJECT[1]
    return missing
