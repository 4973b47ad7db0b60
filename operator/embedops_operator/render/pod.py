"""The model server's pod template: container, arguments, environment, probes, volumes, the prepare step."""
from __future__ import annotations

import re
import shlex
from typing import Any

from embedops_server import sizing

from .. import memory
from ..spec import GFD_PRODUCT, NFD_CPUID, EmbeddingServiceSpec, Tracing
from .base import (
    ANNOTATION_METRICS_PORT, BATCH_PORT, GRACE_MARGIN, METRICS_PORT, SERVER_PORT, TEMPLATE_REVISION, Options, Pin,
    detect_task, dtype, has_batch_service, selector_labels, served_model_name, track_labels)


ONNX_CACHE = "/var/cache/embedops"  # the prepared ONNX graphs (model.cache, else an emptyDir per pod)
DEFAULT_CACHE_SIZE = "8Gi"  # the ONNX cache emptyDir of a model the operator cannot size


def sizing_of(spec: EmbeddingServiceSpec, revision: int | None = None) -> memory.Sizing | None:
    """The memory estimate a pod template of ``revision`` (None: the latest) is sized by."""
    return memory.estimate(spec, dtype(spec), revision)


def _resources(spec: EmbeddingServiceSpec, est: memory.Sizing | None) -> dict:
    acc = spec.accelerator
    if acc.cpu:
        mem = memory.cpu_memory(spec, est)
        res = {"requests": {"cpu": str(acc.cpu.cores), "memory": mem},
               "limits": {"cpu": str(acc.cpu.cores), "memory": mem}}
    elif acc.mig:
        key = f"nvidia.com/mig-{acc.mig.profile}" if acc.mig.strategy == "mixed" else "nvidia.com/gpu"
        mem = _host_memory(8 << 30, spec)
        res = {"requests": {"cpu": "2", "memory": mem},
               "limits": {"memory": mem, key: str(acc.mig.count)}}
    else:
        mem = _host_memory(16 << 30, spec)
        res = {"requests": {"cpu": "4", "memory": mem},
               "limits": {"memory": mem, "nvidia.com/gpu": str(acc.gpu.count)}}
    if spec.resources:  # user overrides win, per section and key
        for section, values in spec.resources.items():
            if isinstance(values, dict):
                res.setdefault(section, {}).update({k: str(v) for k, v in values.items()})
    return res


def _host_memory(base: int, spec: EmbeddingServiceSpec) -> str:
    """A GPU replica's host memory: the fixed size, and the answer cache (host memory) when it is on."""
    return sizing.quantity(sizing.round_up(base + memory.answer_cache_bytes(spec)))


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


def batch_port(spec: EmbeddingServiceSpec, revision: int = TEMPLATE_REVISION) -> bool:
    """Does the server listen on BATCH_PORT (the <name>-batch Service's target)?"""
    return revision >= 3 and has_batch_service(spec)


def metrics_port(revision: int = TEMPLATE_REVISION) -> bool:
    """Does the server answer /metrics on METRICS_PORT alone (the API's clients cannot read them)?"""
    return revision >= 7


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
    if metrics_port(revision):
        args += ["--prometheus-port", str(METRICS_PORT)]
    if spec.answer_cache:  # a new field: no pod of an older template has it, so no revision
        args += ["--answer-cache-bytes", str(memory.answer_cache_bytes(spec))]
    args.append("--json-output")
    return args


def tracing_of(spec: EmbeddingServiceSpec, options: Options) -> Tracing | None:
    """The service's tracing: its own, else the operator's default endpoint, else none."""
    if spec.tracing is not None:
        return spec.tracing
    return Tracing(endpoint=options.tracing_endpoint) if options.tracing_endpoint else None


def tracing_args(service: str, spec: EmbeddingServiceSpec, options: Options) -> list[str]:
    """The server's --otlp-* flags (new flags: rendered only when tracing is on, so no other pod changes)."""
    t = tracing_of(spec, options)
    return ["--otlp-endpoint", t.endpoint, "--otlp-service-name", t.service_name or service] if t else []


def tracing_env(spec: EmbeddingServiceSpec) -> list[dict]:
    """The OpenTelemetry SDK's own variables for what the flags do not say: the protocol and the sampler."""
    t = spec.tracing
    env = []
    if t is not None and t.protocol != "grpc":
        env.append({"name": "OTEL_EXPORTER_OTLP_PROTOCOL", "value": t.protocol})
    if t is not None and t.sample_ratio < 1:
        env += [{"name": "OTEL_TRACES_SAMPLER", "value": "parentbased_traceidratio"},
                {"name": "OTEL_TRACES_SAMPLER_ARG", "value": f"{t.sample_ratio:g}"}]
    return env


COMMIT = re.compile(r"^[0-9a-f]{40}$")
PINNED_REVISION = "PINNED_REVISION"  # the server's variable for the commit to load (overrides --revision)


def pins_commit(spec: EmbeddingServiceSpec) -> bool:
    """Whether the pods resolve the model's commit when they start (a hub model whose model.revision names no
    commit): then each reads the commit its track's first replica resolved, so one space loads one set of weights
    (issue 52). A local folder is what its volume holds; a commit is pinned by the spec itself."""
    m = spec.model
    return not m.id.startswith(("/", ".")) and not (m.revision and COMMIT.match(m.revision))


def commit_config_map(track: str) -> str:
    """The ConfigMap holding the commit a track's first replica resolved (key `commit`), read by its pods."""
    return f"{track[:49]}-model-commit"


def _pinned_env(track: str) -> dict:
    return {"name": PINNED_REVISION, "valueFrom": {"configMapKeyRef": {
        "name": commit_config_map(track), "key": "commit", "optional": True}}}


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
        workers = memory.tokenization_workers(spec.accelerator.cpu.cores, est.replica.weights if est else 0)
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
    # every container that resolves the model reads the track's commit (unless the manifest sets the variable itself)
    pinned = revision >= 5 and pins_commit(spec) and PINNED_REVISION not in {e.get("name") for e in spec.env or []}
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
            if pinned:
                dl_env.append(_pinned_env(name))
            init.append({
                "name": "download-model",
                "image": src.download.image or image,
                "command": ["sh", "-c", download_script(spec, quote_cache=revision >= 1, pinned=pinned)],
                "env": dl_env,
                "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, {"name": "model-cache", "mountPath": "/models"}],
                "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
                "securityContext": container_security(),
            })
    est = sizing_of(spec, revision)
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
    server_env = _env(spec, cache_dir) + ([_pinned_env(name)] if pinned else [])
    prepare_env = _env(spec, cache_dir, api_key=revision < 1) + ([_pinned_env(name)] if pinned else [])
    init.append(_prepare_container(spec, image, _args(spec, revision), prepare_env,
                                   [dict(m) for m in mounts] + [cache_mount], est))
    if gpu:
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}})
        server_mounts.append({"name": "dshm", "mountPath": "/dev/shm"})

    container: dict[str, Any] = {
        "name": "server",
        "image": image,
        "command": ["embedops-server"],
        "args": _args(spec, revision) + tracing_args(service_name or name, spec, options),
        "env": server_env + tracing_env(spec),
        "ports": [{"name": "http", "containerPort": SERVER_PORT, "protocol": "TCP"}] + (
            [{"name": "batch", "containerPort": BATCH_PORT, "protocol": "TCP"}] if batch_port(spec, revision) else []) + (
            [{"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"}] if metrics_port(revision)
            else []),
        "resources": _resources(spec, est),
        "startupProbe": _probe(period=5, failures=120),  # up to 10 minutes to load weights
        "readinessProbe": _probe(period=5, failures=2),
        "livenessProbe": _probe(period=10, failures=3, timeout=5),
        "lifecycle": {"preStop": {"sleep": {"seconds": spec.drain_seconds}}} if spec.drain_seconds else None,
        "volumeMounts": server_mounts,
        "securityContext": container_security(),
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
    annotations = dict(spec.pod_annotations or {})
    if metrics_port(revision):  # where the ServiceMonitor scrapes this pod (render/monitoring.py)
        annotations[ANNOTATION_METRICS_PORT] = str(METRICS_PORT)
    if annotations:
        metadata["annotations"] = dict(sorted(annotations.items()))
    return {"metadata": metadata, "spec": pod_spec}


# What every server reads besides the weights: configs, tokenizer files, sentence-transformers modules, and
# bge-m3's heads (sparse_linear.pt, colbert_linear.pt: a few MB)
MODEL_FILES = ("*.json", "*.txt", "*.model", "1_Pooling/*", "sparse_linear.pt", "colbert_linear.pt")
ONNX_FILES = ("onnx/model.onnx", "onnx/model.onnx_data", "model.onnx", "model.onnx_data")


def download_script(spec: EmbeddingServiceSpec, hub: str = "/models/hub", quote_cache: bool = True,
                    pinned: bool = False) -> str:
    """The download init container's `sh -c`: `hf download` of only the files the server will load, not the
    whole repository (BAAI/bge-m3 ships its weights twice, as torch weights and as onnx/model.onnx + data: 4.5
    GB where 2.3 GB serve). ONNX Runtime (CPU, float32 or int8): the ONNX graph, else, for a repository
    without one, the safetensors the prepare step exports. torch (GPU, float16): the safetensors, else the
    .bin weights. `model.revision` pins the commit; `pinned` (template revision 5): $PINNED_REVISION, the commit the
    track's first replica resolved, wins over it when set. What arrived is read from the hub cache's snapshot folder
    (HF_HUB_CACHE=/models/hub), not from hf's output, whose format changes between versions."""
    m = spec.model
    base = "hf download " + shlex.quote(m.id) + (f" --revision {shlex.quote(m.revision)}" if m.revision else "")
    first_line = ""
    if pinned:
        first_line = f'rev="${{{PINNED_REVISION}:-}}"; ' + (f'[ -n "$rev" ] || rev={shlex.quote(m.revision)}; '
                                                              if m.revision else "")
        base = "hf download " + shlex.quote(m.id) + ' ${rev:+--revision "$rev"}'
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
    return (f"set -eu; {first_line}{base} {include(MODEL_FILES + first)}; have=0; "
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
    server = _resources(spec, est)
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
        "securityContext": container_security(),


        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def container_security() -> dict:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}


