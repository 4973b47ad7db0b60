"""The EmbeddingService API: pydantic models are the single source of truth.

`crd()` turns these models into the CustomResourceDefinition (structural openAPIV3Schema with defaults,
enums and CEL `x-kubernetes-validations`), so the schema the API server enforces and the model the
operator parses can never disagree. `crds/` and the Helm chart hold generated copies; a unit test fails
when they drift.
"""
from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, model_validator
from pydantic.alias_generators import to_camel

GROUP = "embedops.dev"
VERSION = "v1alpha1"
KIND = "EmbeddingService"
PLURAL = "embeddingservices"
SINGULAR = "embeddingservice"
SHORT_NAMES = ["embsvc"]
API_VERSION = f"{GROUP}/{VERSION}"

# MIG profiles per GPU product (NVIDIA MIG user guide, "Supported MIG profiles"). The `+me` media-extension
# variants are left out: their names are not valid Kubernetes extended-resource names.
MIG_PROFILES: dict[str, list[str]] = {
    "A30-24GB": ["1g.6gb", "2g.12gb", "4g.24gb"],
    "A100-40GB": ["1g.5gb", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"],
    "A100-80GB": ["1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"],
    "H100-80GB": ["1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"],
    "H100-94GB": ["1g.12gb", "1g.24gb", "2g.24gb", "3g.47gb", "4g.47gb", "7g.94gb"],
    "H200-141GB": ["1g.18gb", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"],
}
ALL_MIG_PROFILES = sorted({p for ps in MIG_PROFILES.values() for p in ps},
                          key=lambda p: (int(p.split("g.")[0]), int(p.split(".")[1][:-2])))
# `nvidia.com/gpu.product` as GPU feature discovery labels these products (single strategy appends -MIG-<profile>).
GFD_PRODUCT = {
    "A30-24GB": "NVIDIA-A30",
    "A100-40GB": "NVIDIA-A100-SXM4-40GB",
    "A100-80GB": "NVIDIA-A100-SXM4-80GB",
    "H100-80GB": "NVIDIA-H100-80GB-HBM3",
    "H100-94GB": "NVIDIA-H100-NVL",
    "H200-141GB": "NVIDIA-H200",
}
# CPU instruction sets → Node Feature Discovery cpuid flags.
NFD_CPUID = {
    "avx2": "AVX2",
    "avx512f": "AVX512F",
    "avx512_vnni": "AVX512VNNI",
    "avx512_bf16": "AVX512BF16",
    "avx_vnni": "AVXVNNI",
    "amx_tile": "AMXTILE",
    "amx_bf16": "AMXBF16",
    "amx_int8": "AMXINT8",
}
InstructionSet = Literal["avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_bf16",
                         "amx_int8"]
Task = Literal["embed", "rerank", "classify", "sparse"]
# bge-m3-layout embedders (sparse_linear.pt / colbert_linear.pt beside the weights): the server's outputs.
Output = Literal["dense", "sparse", "colbert"]
MODEL_ID_PATTERN = r"^(/[A-Za-z0-9._+@=-]+(/[A-Za-z0-9._+@=-]+)*/?|[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?)$"
# Ids that render.detect_task maps to another task than embed (kept in step with it; a unit test checks both).
NON_EMBED_ID_PATTERN = "(?i)(rerank|cross-encoder|ms-marco|splade)"

FreeObject = Annotated[dict[str, Any], WithJsonSchema(
    {"type": "object", "x-kubernetes-preserve-unknown-fields": True})]
FreeList = Annotated[list[dict[str, Any]], WithJsonSchema(
    {"type": "array", "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}})]
Quantity = Annotated[str, Field(pattern=r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti)?$")]


def cel(rule: str, message: str | None = None, message_expression: str | None = None,
        field_path: str | None = None, reason: str | None = None) -> dict:
    out: dict[str, Any] = {"rule": rule}
    if message:
        out["message"] = message
    if message_expression:
        out["messageExpression"] = message_expression
    if field_path:
        out["fieldPath"] = field_path
    if reason:
        out["reason"] = reason
    return out


def validations(*rules: dict) -> ConfigDict:
    return {"json_schema_extra": {"x-kubernetes-validations": list(rules)}}


class Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")


# ---------------------------------------------------------------------------------------------------- model

class SecretKeyRef(Model):
    name: str = Field(min_length=1)
    key: str = Field("token")


class PVCSource(Model):
    """A PersistentVolumeClaim holding a Hugging Face cache or model folders, mounted read-only."""
    claim_name: str = Field(min_length=1, description="Name of the PersistentVolumeClaim.")
    sub_path: str | None = Field(None, description="Sub-path inside the volume to mount.")
    mount_path: str = Field("/models", pattern=r"^/.*", description="Where the volume is mounted.")


class DownloadSource(Model):
    """An init container fills an emptyDir cache before the server starts."""
    cache_size: Quantity | None = Field(None, description=(
        "Size limit of the cache emptyDir (default: the model's float32 weights plus a quarter and 1Gi when the "
        "operator knows its geometry, else 20Gi); the pod requests that much ephemeral storage."))
    image: str | None = Field(None, description="Image for the download step (default: the server image).")
    hf_token_secret_ref: SecretKeyRef | None = Field(None, description="Secret holding a Hugging Face token.")


class ModelSource(Model):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, json_schema_extra={
        "x-kubernetes-validations": [cel("!(has(self.pvc) && has(self.download))",
                                         "model.source: set at most one of pvc or download")]})
    pvc: PVCSource | None = None
    download: DownloadSource | None = None


class Prompts(Model):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, json_schema_extra={
        "x-kubernetes-validations": [cel("!(has(self.defaultPromptName) && has(self.defaultPrompt))",
                                         "model.prompts: defaultPromptName and defaultPrompt are exclusive")]})
    default_prompt_name: str | None = Field(None, description="Key of `prompts` in the model's sentence-transformers config.")
    default_prompt: str | None = Field(None, description="Literal prefix added to every input.")


class ModelGeometry(Model):
    """The model's shape, for the memory estimate (the fields of its config.json). Known models (bge-m3,
    bge-reranker-v2-m3, the bge and e5 families, all-MiniLM-L6-v2, ...) need none."""
    hidden_size: int = Field(ge=1)
    layers: int = Field(ge=1, description="num_hidden_layers")
    heads: int = Field(ge=1, description="num_attention_heads")
    intermediate_size: int | None = Field(None, ge=1, description="Default: 4 x hiddenSize.")
    vocab_size: int = Field(ge=1)
    max_positions: int = Field(512, ge=1, description="Longest input the model accepts, in tokens.")
    parameters: int | None = Field(None, ge=1, description="Default: computed from the fields above (BERT-style).")


class ModelCache(Model):
    """Where the prepared ONNX graph (export, int8 quantization and its quality check) is kept. Default: an
    emptyDir per pod, so every new pod prepares again (minutes and several GB for a 568M model). A claim here
    outlives pods: the first pod's prepare step fills it, later pods load what it made. Use a ReadWriteMany
    claim for replicas on several nodes."""
    claim_name: str = Field(min_length=1, description="PersistentVolumeClaim holding the cache (read-write).")
    sub_path: str | None = Field(None, description="Sub-path inside the volume.")


class ModelSpec(Model):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, json_schema_extra={
        "x-kubernetes-validations": [
            cel("!has(self.pooling) || !has(self.task) || self.task != 'rerank'",
                "model.pooling does not apply to rerank models (they use their classifier head)"),
            cel("!has(self.pooling) || self.pooling != 'splade' || !has(self.task) || self.task == 'sparse'",
                "model.pooling splade requires task sparse"),
            cel("!has(self.outputs) || (has(self.task) ? self.task == 'embed' : "
                f"!self.id.matches('{NON_EMBED_ID_PATTERN}'))",
                "model.outputs apply to task embed only (a bge-m3-layout embedder); rerank, classify and sparse "
                "(SPLADE) models have no dense/sparse/colbert outputs"),
        ]})
    # A Hub id (an optional owner, a name: letters, digits, '-', '_', '.') or an absolute path: it reaches the
    # download step's shell script and the server's arguments, so no character of shell syntax gets through
    id: str = Field(min_length=1, max_length=512, pattern=MODEL_ID_PATTERN,
                    description="Hugging Face model id (e.g. BAAI/bge-m3) or a local path inside the pod.")
    revision: str | None = Field(None, description="Model revision (commit, branch or tag).")
    task: Task | None = Field(None, description="embed, rerank, classify or sparse; detected from the id when omitted.")
    pooling: Literal["cls", "mean", "splade", "last-token"] | None = Field(None, description="Pooling override.")
    dtype: Literal["float16", "float32", "bfloat16"] | None = Field(
        None, description="Weights dtype; default float16 on GPU/MIG, float32 on CPU.")
    quantize: Literal["int8"] | None = Field(
        None, description="CPU only: int8 weights on ONNX Runtime (per-channel dynamic quantization; the server "
                          "refuses to start if its outputs drift below cosine 0.98 of float32). ~1.7-1.9x float32 "
                          "throughput on AVX-512 VNNI cores.")
    served_model_name: str | None = Field(None, description="Model name reported on OpenAI routes.")
    max_input_length: int | None = Field(None, ge=1, description="Longest input (tokens) the service must accept.")
    outputs: list[Output] | None = Field(
        None, min_length=1, json_schema_extra={"x-kubernetes-list-type": "set"},
        description="Task embed, a model in BAAI/bge-m3's layout (sparse_linear.pt / colbert_linear.pt): the outputs "
                    "the gateway exposes. dense: /embed, /embed_all, /v1/embeddings, /v2/embed; sparse: /embed_sparse (lexical "
                    "weights); colbert: /embed_colbert; two or more: also /embed_hybrid (several from one forward). "
                    "Default: dense only.")
    prompts: Prompts | None = None
    source: ModelSource | None = Field(None, description="Where the weights come from (default: downloaded by the server at start).")
    geometry: ModelGeometry | None = Field(None, description="The model's shape, for the memory estimate of a "
                                                             "model the operator does not know.")
    cache: ModelCache | None = Field(None, description="A volume for the prepared ONNX graph that outlives pods.")

    @property
    def detected_task(self) -> str:
        """`task`, else read from the id as NON_EMBED_ID_PATTERN does: rerank, sparse (SPLADE) or embed."""
        if self.task:
            return self.task
        ident = self.id.lower()
        if "rerank" in ident or "cross-encoder" in ident or "ms-marco" in ident:
            return "rerank"
        return "sparse" if "splade" in ident else "embed"


# ---------------------------------------------------------------------------------------------------- hardware

def _mig_rule() -> dict:
    branches = " : ".join(
        f"self.product == '{prod}' ? self.profile in {profiles!r}".replace('"', "'")
        for prod, profiles in MIG_PROFILES.items()) + " : false"
    msg = " : ".join(
        f"self.product == '{prod}' ? 'MIG profile ' + self.profile + ' is not offered by {prod}; valid: "
        f"{', '.join(profiles)}'" for prod, profiles in MIG_PROFILES.items()) + " : 'unknown GPU product'"
    return cel(branches, "MIG profile is not offered by the GPU product", message_expression=msg,
               field_path=".profile", reason="FieldValueInvalid")


class MIG(Model):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True,
                              json_schema_extra={"x-kubernetes-validations": [_mig_rule()]})
    profile: Literal[tuple(ALL_MIG_PROFILES)] = Field(  # type: ignore[valid-type]
        description="MIG profile, e.g. 1g.10gb (H100-80GB) or 1g.18gb (H200).")
    product: Literal[tuple(MIG_PROFILES)] = Field(  # type: ignore[valid-type]
        "H100-80GB", description="GPU product the slices come from; validates the profile.")
    count: int = Field(1, ge=1, le=7, description="Slices per replica.")
    strategy: Literal["mixed", "single"] = Field(
        "mixed", description="GPU operator MIG strategy: mixed → nvidia.com/mig-<profile>; single → nvidia.com/gpu.")

    @model_validator(mode="after")
    def _profile_of_product(self) -> "MIG":  # mirrors the CEL rule for offline parsing
        if self.profile not in MIG_PROFILES[self.product]:
            raise ValueError(f"MIG profile {self.profile} is not offered by {self.product}; valid: "
                             + ", ".join(MIG_PROFILES[self.product]))
        return self


class GPU(Model):
    count: int = Field(1, ge=1, le=16, description="Whole GPUs per replica.")
    product: str | None = Field(None, description="Required nvidia.com/gpu.product label value.")


class CPU(Model):
    cores: int = Field(4, ge=1, le=256, description="CPU cores per replica (request = limit; sets thread counts).")
    memory: Quantity | None = Field(
        None, description="Memory per replica (request = limit). Default: the operator's estimate for the model "
                          "and these settings with 25% headroom (status.memory), or 4Gi for a model it does "
                          "not know (set model.geometry). A value below the estimate is refused.")
    instruction_sets: list[InstructionSet] = Field(
        default_factory=list, description="Required instruction sets, mapped to NFD cpuid labels.",
        json_schema_extra={"x-kubernetes-list-type": "set"})


class Accelerator(Model):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, json_schema_extra={
        "x-kubernetes-validations": [cel(
            "(has(self.mig) ? 1 : 0) + (has(self.gpu) ? 1 : 0) + (has(self.cpu) ? 1 : 0) == 1",
            "accelerator: set exactly one of mig, gpu or cpu")]})
    mig: MIG | None = None
    gpu: GPU | None = None
    cpu: CPU | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> "Accelerator":  # mirrors the CEL rule for offline parsing
        if sum(x is not None for x in (self.mig, self.gpu, self.cpu)) != 1:
            raise ValueError("accelerator: set exactly one of mig, gpu or cpu")
        return self


# ---------------------------------------------------------------------------------------------------- serving

class Batching(Model):
    max_batch_tokens: int = Field(16384, ge=1, description="Token budget per forward batch.")
    max_batch_requests: int | None = Field(None, ge=1, description="Cap on sequences per batch.")
    max_concurrent_requests: int = Field(512, ge=1, description="Inputs admitted concurrently (429 beyond).")
    max_client_batch_size: int = Field(32, ge=1, description="Inputs per request.")
    auto_truncate: bool = Field(True, description="Truncate over-long inputs instead of refusing them.")


class AnswerCache(Model):
    """An exact-match cache of answers in each replica (the server's --answer-cache-bytes): a repeated input (a
    duplicate chunk in a re-index, a hot query) is answered without a forward. Keyed by the input after its prompt
    and its truncation, within the one embedding space a replica serves: a model change starts empty."""
    size: Quantity = Field(description=(
        "Bytes of answers kept per replica (vectors, keys, overhead), least recently used out; added to the "
        "replica's memory (its estimate, request and limit)."))


class Tracing(Model):
    """OpenTelemetry traces of the requests (the server's --otlp-endpoint, TEI's flag): a span per request with its
    stages (parse, tokenize, queue, slot, forward, wake, respond) and the batch it rode in, under the caller's span
    when the caller sends a W3C traceparent (docs/server.md#traces). Changing it rolls the pods in place (the
    embedding space stays)."""
    endpoint: str = Field(max_length=512, pattern=r"^https?://[A-Za-z0-9.\-]+(:[0-9]{1,5})?(/[A-Za-z0-9._~/\-]*)?$",
                          description="The OTLP endpoint of a collector, e.g. http://otel-collector.observability:4317 "
                                      "(gRPC) or :4318 with protocol http/protobuf.")
    protocol: Literal["grpc", "http/protobuf"] = Field("grpc", description="OTLP over gRPC (TEI's) or HTTP.")
    service_name: str | None = Field(None, max_length=253, description=(
        "The spans' service.name. Default: the EmbeddingService's name."))
    sample_ratio: float = Field(1.0, ge=0, le=1, description=(
        "Fraction of the requests that start a trace (a caller's sampled traceparent is always followed)."))


class Autoscaling(Model):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, json_schema_extra={
        "x-kubernetes-validations": [cel("self.minReplicas <= self.maxReplicas",
                                         "autoscaling: minReplicas must not exceed maxReplicas")]})
    min_replicas: int = Field(1, ge=0, description="Lower bound (0 = scale to zero, KEDA only).")
    max_replicas: int = Field(ge=1, description="Upper bound.")
    target_queue_depth: int = Field(16, ge=1, description="Target te_queue_size per replica.")
    cooldown_seconds: int = Field(300, ge=0)
    provider: Literal["auto", "keda", "hpa"] = Field(
        "auto", description="auto: KEDA ScaledObject when KEDA is installed, else an HPA.")
    prometheus_address: str = Field("http://prometheus-operated.monitoring.svc:9090",
                                    description="Prometheus queried by KEDA.")
    activation_timeout_seconds: int = Field(
        300, ge=1, le=3600, description="minReplicas 0: how long the activator holds a request while the "
        "service wakes from zero (cover image pull and model load) before answering 503.")


IntOrPercent = Annotated[int | str, WithJsonSchema(
    {"x-kubernetes-int-or-string": True})]


class Rollout(Model):
    """The Deployment's rolling update. Default: a surge (maxSurge 1, maxUnavailable 0: the replacement loads
    before an old replica stops); on GPU and MIG, as soon as a rollout's surge pod cannot be scheduled (no spare
    slice or GPU), the operator switches that rollout to giving an old replica's accelerator up first (maxSurge
    0, maxUnavailable 1), so a full node never deadlocks it. Setting either field here fixes the strategy as
    given, whatever the cluster has free."""
    max_surge: IntOrPercent | None = None
    max_unavailable: IntOrPercent | None = None


# What the reindex Job's pod may ask for (issue 53): what an ingestion job needs, nothing that widens its reach.
# The operator refuses the rest (InvalidSpec) whether or not the platform's admission policy is on.
REINDEX_POD_FIELDS = frozenset({"containers", "volumes", "restartPolicy", "serviceAccountName",
                                "automountServiceAccountToken", "nodeSelector", "tolerations", "imagePullSecrets",
                                "securityContext", "activeDeadlineSeconds", "terminationGracePeriodSeconds"})
REINDEX_CONTAINER_FIELDS = frozenset({"name", "image", "imagePullPolicy", "command", "args", "workingDir", "env",
                                      "envFrom", "resources", "volumeMounts", "securityContext"})
REINDEX_VOLUME_SOURCES = frozenset({"configMap", "secret", "emptyDir", "persistentVolumeClaim"})
# what a restricted container's securityContext may say (Pod Security "restricted"): no privilege, no added
# capability but NET_BIND_SERVICE, no escalation
REINDEX_SECURITY_FIELDS = frozenset({"runAsNonRoot", "runAsUser", "runAsGroup", "readOnlyRootFilesystem",
                                     "allowPrivilegeEscalation", "capabilities", "seccompProfile"})
# variables that make an allowed image run other code (an interpreter's or loader's search path into a volume the
# author fills): refused in every env the manifest shapes
LOADER_VARIABLE = re.compile(r"^(PYTHON\w*|LD_\w+|DYLD_\w+|PERL5?LIB|PERL5OPT|RUBYLIB|RUBYOPT|NODE_OPTIONS|NODE_PATH|"
                             r"JAVA_TOOL_OPTIONS|_JAVA_OPTIONS|JDK_JAVA_OPTIONS|CLASSPATH|BASH_ENV|ENV|GCONV_PATH)$")


def refuse_loader_variables(env: list[dict] | None, where: str) -> None:
    bad = sorted({e.get("name", "") for e in env or [] if LOADER_VARIABLE.match(e.get("name") or "")})
    if bad:
        raise ValueError(f"{where}: {', '.join(bad)} would make the image load code of the manifest's choosing "
                         "(an interpreter's or loader's search path); not allowed")


def refuse_unrestricted_pod(template: dict) -> None:
    """The reindex Job's pod template within REINDEX_*: raises ValueError naming the first field outside it."""
    where = "migration.reindex.template"
    if not isinstance(template, dict) or set(template) - {"metadata", "spec"}:
        raise ValueError(f"{where}: a pod template has metadata and spec only")
    meta = template.get("metadata") or {}
    if set(meta) - {"labels", "annotations"}:
        raise ValueError(f"{where}.metadata: labels and annotations only")
    pod = template.get("spec") or {}
    extra = sorted(set(pod) - REINDEX_POD_FIELDS)
    if extra:  # serviceAccount (the deprecated alias), initContainers, hostNetwork, priorityClassName, ...
        raise ValueError(f"{where}.spec: {', '.join(extra)} not allowed (allowed: "
                         f"{', '.join(sorted(REINDEX_POD_FIELDS))})")
    ctx = pod.get("securityContext") or {}
    if set(ctx) - {"runAsNonRoot", "runAsUser", "runAsGroup", "fsGroup", "seccompProfile"}:
        raise ValueError(f"{where}.spec.securityContext: runAsNonRoot, runAsUser, runAsGroup, fsGroup and "
                         "seccompProfile only")
    for i, c in enumerate(pod.get("containers") or []):
        at = f"{where}.spec.containers[{i}]"
        extra = sorted(set(c) - REINDEX_CONTAINER_FIELDS)
        if extra:
            raise ValueError(f"{at}: {', '.join(extra)} not allowed")
        refuse_loader_variables(c.get("env"), f"{at}.env")
        sc = c.get("securityContext") or {}
        if set(sc) - REINDEX_SECURITY_FIELDS or sc.get("allowPrivilegeEscalation") is True or \
                set((sc.get("capabilities") or {}).get("add") or []) - {"NET_BIND_SERVICE"}:
            raise ValueError(f"{at}.securityContext: privileged, added capabilities and privilege escalation are "
                             "not allowed")
    for i, v in enumerate(pod.get("volumes") or []):
        sources = set(v) - {"name"}
        if not sources or sources - REINDEX_VOLUME_SOURCES:
            raise ValueError(f"{where}.spec.volumes[{i}]: configMap, secret, emptyDir or persistentVolumeClaim only")


class Reindex(Model):
    """A Job the operator runs against a new embedding space before it serves: the user's own ingestion image,
    re-embedding the corpus into the new space's table or column through the space's own address. It gets
    EMBEDOPS_SPACE (the space's key), EMBEDOPS_SPACE_URL (its Service), EMBEDOPS_SPACE_FINGERPRINT (what its
    responses' embedding-space header says) and EMBEDOPS_PREVIOUS_SPACE (the key that serves meanwhile)."""
    template: FreeObject = Field(description=(
        "The Job's pod template (a PodTemplateSpec: metadata and spec), within what an ingestion job needs: "
        "containers (image, command, args, env, envFrom, resources, volumeMounts, a restricted securityContext), "
        "volumes from ConfigMaps, Secrets, emptyDir and PVCs, serviceAccountName, nodeSelector, tolerations, "
        "imagePullSecrets. Anything else (init containers, host namespaces, privileges, the serviceAccount alias) "
        "is refused; its pods get no service-account token unless it names an account."))
    backoff_limit: int = Field(2, ge=0, le=100, description="Retries before the Job (and the migration) fails.")
    active_deadline_seconds: int | None = Field(None, ge=1, description="The Job's time limit.")

    @model_validator(mode="after")
    def _restricted(self) -> "Reindex":
        refuse_unrestricted_pod(self.template)
        return self


class Migration(Model):
    """What a change of the embedding space does (model.id, revision, pooling, prompts, quantize,
    maxInputLength, source): the new space comes up beside the old one, at an address of its own, and the
    service's address keeps answering from the old space until the new one is promoted."""
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, json_schema_extra={
        "x-kubernetes-validations": [
            cel("!has(self.promotion) || self.promotion != 'AfterReindex' || has(self.reindex)",
                "migration.promotion AfterReindex needs migration.reindex (the Job whose success promotes)"),
        ]})
    promotion: Literal["Manual", "AfterReindex", "Immediate"] = Field("Manual", description=(
        "Manual: the new space serves the service's address once migration.promote names it. AfterReindex: once "
        "the reindex Job succeeded. Immediate: once it is ready (no reindex: for indexes rebuilt elsewhere)."))
    promote: str | None = Field(None, pattern=r"^[0-9a-f]{8}$", description=(
        "The key of the space (status.spaces) that serves the service's address: promotes a new space, or rolls "
        "back to the previous one while it is kept."))
    keep_previous_seconds: int = Field(86400, ge=0, description=(
        "How long the previous space keeps running after a promotion (rollback is switching back meanwhile)."))
    scale_down_previous_after_seconds: int = Field(600, ge=0, description=(
        "How long the previous space keeps every replica after a promotion (a rollback meanwhile is instant, at the "
        "size that served); then it runs none until keepPreviousSeconds removes it, and a rollback to it first "
        "scales it back to the serving size, and moves the address once all those replicas are available."))
    reindex: Reindex | None = None


class ServiceSpec(Model):
    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    port: int = Field(80, ge=1, le=65535)
    max_connection_age_seconds: int = Field(30, ge=0, le=86400, description=(
        "A client's keep-alive connection is closed after its first answer past this age (Connection: close), so "
        "clients that keep connections open follow the Service to the pods it selects now: a promoted embedding "
        "space within this many seconds, replicas an autoscaler added. 0: never (such clients stay on the pods "
        "they first reached, across a promotion too)."))


class ParentRef(Model):
    name: str = Field(min_length=1)
    namespace: str | None = None
    section_name: str | None = None


class Gateway(Model):
    parent_refs: list[ParentRef] = Field(min_length=1)
    hostnames: list[str] = Field(default_factory=list)
    path_prefix: str = Field("", pattern=r"^(/[A-Za-z0-9._~-]+)*$",
                             description="Optional prefix (e.g. /bge-m3), stripped before the service.")
    allow_unauthenticated: bool = Field(False, description=(
        "Publish the routes on the gateway although the service has no apiKeySecretRef: anyone who reaches the "
        "gateway can use the model. Without a key the operator refuses the gateway unless this says so."))
    embed_all: bool = Field(False, description=(
        "Route /embed_all (every token's hidden state: tokens x width floats per answer, a large answer for a "
        "small request) on the gateway too. Off: the service's own address answers it, the gateway does not."))


class LiteLLM(Model):
    config_map_name: str = Field(min_length=1, description="ConfigMap to which this model's entries are added.")
    model_name: str | None = Field(None, description="LiteLLM model_name (default: served model name).")


class ServiceMonitor(Model):
    enabled: bool = True
    interval: str = Field("30s", pattern=r"^[0-9]+(ms|s|m|h)$")
    labels: dict[str, str] = Field(default_factory=dict)


class Monitoring(Model):
    service_monitor: ServiceMonitor = Field(default_factory=ServiceMonitor, json_schema_extra={"default": {}})
    p99_latency_seconds: float | None = Field(
        None, gt=0, description="The p99 request latency this service should stay under; the chart's "
        "EmbeddingServiceLatencyOverBudget alert fires when it does not for 10 minutes (the operator exports it "
        "as embedops_service_p99_budget_seconds). Unset: the chart's alerts.defaultP99LatencySeconds.")


# A namespace's name (RFC 1123 label), matched through the kubernetes.io/metadata.name label the API server sets
NamespaceName = Annotated[str, Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")]


class NetworkPolicy(Model):
    enabled: bool = Field(True, description="Render the NetworkPolicy (false: none, and the operator's is removed).")
    from_namespaces: list[NamespaceName] = Field(default_factory=list, max_length=64, description=(
        "Namespaces whose pods may call the service (its LiteLLM proxy's, an ingestion job's, ...). Always "
        "admitted besides: the gateway's and Prometheus' namespaces as the operator's chart names them (when the "
        "service has a gateway route and a ServiceMonitor), and the node's own traffic (kubelet probes)."))
    allow_same_namespace: bool = Field(True, description=(
        "Admit every pod of the service's own namespace. false: only the service's activator and its reindex "
        "Jobs there."))


class Lanes(Model):
    """The server's interactive and batch lanes (docs/server.md#lanes): a query's inputs do not wait behind an
    ingestion job's. A client names its lane with the `embedops-lane` header; this sets the rest."""
    enabled: bool = Field(True, description="false: one FIFO queue for every request (TEI's behaviour).")
    default: Literal["auto", "interactive", "batch"] = Field("auto", description=(
        "The lane of a request without the header. auto: interactive for a request of at most 4 inputs and for "
        "every rerank, batch for larger requests."))
    batch_service: bool = Field(False, description=(
        "A second Service, <name>-batch, on the same pods and embedding space (it follows a promotion as the "
        "service's own does): its requests default to the batch lane. The address for ingestion jobs; queries "
        "keep the service's. Not with autoscaling.minReplicas 0 (the activator holds the service's own address "
        "only)."))
    scale_on: Literal["interactive", "all"] = Field("interactive", description=(
        "KEDA's queue metric: the interactive lane's queue (a backlog of ingestion does not add replicas), or "
        "every queued input (all). The HPA provider keeps te_queue_size (all)."))


class LocalObjectReference(Model):
    name: str


class EmbeddingServiceSpec(Model):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, json_schema_extra={
        "x-kubernetes-validations": [
            cel("!has(self.model.maxInputLength) || self.batching.maxBatchTokens >= self.model.maxInputLength",
                # a static message: the API server's cost estimator refuses string(int) concatenation here
                "batching.maxBatchTokens must be at least model.maxInputLength (the longest accepted input)",
                reason="FieldValueInvalid"),
            # a request larger than the server can ever admit would be answered 429 forever (issue 53)
            cel("self.batching.maxClientBatchSize <= self.batching.maxConcurrentRequests",
                "batching.maxClientBatchSize must not exceed batching.maxConcurrentRequests: a larger request could "
                "never be admitted (it would be answered 429 forever)", reason="FieldValueInvalid"),
            cel("(has(self.lanes) && has(self.lanes.enabled) && !self.lanes.enabled) || "
                "self.batching.maxClientBatchSize * 4 <= self.batching.maxConcurrentRequests * 3",
                "batching.maxClientBatchSize must not exceed the batch lane's share of batching.maxConcurrentRequests "
                "(three quarters) while the lanes are on: a larger batch request could never be admitted (it would "
                "be answered 429 forever); raise maxConcurrentRequests, lower maxClientBatchSize, or set "
                "lanes.enabled: false", reason="FieldValueInvalid"),
            cel("!has(self.accelerator.cpu) || !has(self.model.dtype) || self.model.dtype != 'float16'",
                "model.dtype float16 is not supported on CPU; use float32 or bfloat16"),
            cel("!has(self.model.quantize) || has(self.accelerator.cpu)",
                "model.quantize int8 runs on CPU (ONNX Runtime); GPU and MIG serve float16 or bfloat16"),
            cel("!has(self.model.quantize) || !has(self.model.dtype) || self.model.dtype == 'float32'",
                "model.quantize int8 needs model.dtype float32 (or unset)"),
            cel("!has(self.autoscaling) || self.autoscaling.minReplicas > 0 || self.autoscaling.provider != 'hpa'",
                "autoscaling.minReplicas 0 (scale to zero) needs provider keda or auto"),
            cel("!has(self.lanes) || !has(self.lanes.batchService) || !self.lanes.batchService || "
                "!has(self.autoscaling) || self.autoscaling.minReplicas > 0",
                "lanes.batchService needs autoscaling.minReplicas of at least 1: scaled to zero, only the "
                "service's own address (the activator) wakes it", reason="FieldValueForbidden"),
            cel("!has(self.gateway) || has(self.apiKeySecretRef) || "
                "(has(self.gateway.allowUnauthenticated) && self.gateway.allowUnauthenticated)",
                "gateway publishes the model without an API key: set apiKeySecretRef, or "
                "gateway.allowUnauthenticated: true to publish it to anyone who reaches the gateway",
                reason="FieldValueForbidden"),
        ]})
    model: ModelSpec
    accelerator: Accelerator
    batching: Batching = Field(default_factory=Batching, json_schema_extra={"default": {}})
    replicas: int = Field(1, ge=0, le=1000, description="Replicas (ignored while autoscaling is set).")
    autoscaling: Autoscaling | None = None
    service: ServiceSpec = Field(default_factory=ServiceSpec, json_schema_extra={"default": {}})
    gateway: Gateway | None = None
    litellm: LiteLLM | None = None
    monitoring: Monitoring = Field(default_factory=Monitoring, json_schema_extra={"default": {}})
    api_key_secret_ref: SecretKeyRef | None = Field(None, description="Secret key holding the API key (env API_KEY).")
    network_policy: NetworkPolicy | None = Field(None, description=(
        "An ingress NetworkPolicy for the service's pods (opt-in): only the namespaces it admits reach them."))
    lanes: Lanes | None = Field(None, description=(
        "The server's interactive and batch lanes (on by default in the server; set this to change them or to "
        "give the batch lane its own address)."))
    answer_cache: AnswerCache | None = Field(None, description=(
        "Off unless set: an exact-match cache of answers per replica (docs/server.md#answer-cache)."))
    tracing: Tracing | None = Field(None, description=(
        "OpenTelemetry traces of the requests. Default: the operator's (the chart's tracing.endpoint), else off."))
    drain_seconds: int = Field(15, ge=0, le=600, description="preStop delay that lets in-flight requests finish.")
    rollout: Rollout | None = None
    migration: Migration = Field(default_factory=Migration, json_schema_extra={"default": {}}, description=(
        "Embedders (embed, sparse): how a change of the embedding space is rolled out. Rerankers and classifiers "
        "store nothing and roll in place."))
    # pod-level overrides
    image: str | None = None
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    resources: FreeObject | None = None
    env: FreeList | None = None
    node_selector: dict[str, str] | None = None
    tolerations: FreeList | None = None
    affinity: FreeObject | None = None
    priority_class_name: str | None = None
    pod_annotations: dict[str, str] | None = None
    service_account_name: str | None = None
    image_pull_secrets: list[LocalObjectReference] | None = None

    @model_validator(mode="after")
    def _no_loader_variables(self) -> "EmbeddingServiceSpec":
        refuse_loader_variables(self.env, "env")
        return self

    @model_validator(mode="after")
    def _admissible_batch(self) -> "EmbeddingServiceSpec":
        """Mirrors the two CEL rules on maxClientBatchSize for objects stored before them: their pods would refuse
        to start (the server checks the same), so the operator reports InvalidSpec and renders nothing new."""
        b = self.batching
        if b.max_client_batch_size > b.max_concurrent_requests:
            raise ValueError("batching.maxClientBatchSize must not exceed batching.maxConcurrentRequests: a larger "
                             "request could never be admitted (it would be answered 429 forever)")
        if (self.lanes is None or self.lanes.enabled) and b.max_client_batch_size * 4 > b.max_concurrent_requests * 3:
            raise ValueError("batching.maxClientBatchSize must not exceed the batch lane's share of "
                             "batching.maxConcurrentRequests (three quarters) while the lanes are on")
        return self


# ---------------------------------------------------------------------------------------------------- status

class Condition(Model):
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str = ""
    message: str = ""
    last_transition_time: str | None = None
    observed_generation: int | None = None


class Endpoints(Model):
    service: str | None = Field(None, description="In-cluster base URL.")
    openai: str | None = Field(None, description="OpenAI-compatible base URL (…/v1).")
    rerank: str | None = None
    batch: str | None = Field(None, description="The batch lane's address (lanes.batchService).")
    external: str | None = None


class MemoryStatus(Model):
    estimate: str | None = Field(None, description="The operator's estimate of a replica's peak memory.")
    limit: str | None = Field(None, description="What a replica gets: its memory limit, or its MIG slices.")
    prepare: str | None = Field(None, description="The prepare step's estimated one-time peak (its limit).")
    detail: str | None = Field(None, description="How the estimate is made up, and where the geometry came from.")


class ServedModel(Model):
    commit: str | None = Field(None, description="The model commit the newest ready pod serves (its prepare step's report).")
    prepared: str | None = Field(None, description="What that pod's prepare step made, and its cost.")
    space: str | None = Field(None, description=(
        "The embedding space of the ready replicas' vectors: the fingerprint of the model's content, pooling, "
        "prompt, quantization and input limit that every embedding response carries as its embedding-space header. "
        "Several, comma-separated, when ready replicas disagree (the spec did not pin model.revision and the model "
        "changed under it)."))


class PodTemplateStatus(Model):
    deployment: str = Field(description="server (the model pods) or activator.")
    revision: int | None = Field(None, description="The operator's template revision the pods run.")
    image: str | None = Field(None, description="The image the pods run.")
    pending: str | None = Field(None, description="What a newer operator would change, and when it will.")


class SpaceStatus(Model):
    key: str = Field(description="The space's key (what migration.promote names).")
    model: str | None = Field(None, description="What the space is: the model and the settings that shape its vectors.")
    deployment: str | None = None
    url: str | None = Field(None, description="The space's own address (during a migration).")
    gateway_path: str | None = Field(None, description=(
        "The space's own routes on the service's gateway (during a migration, with spec.gateway): "
        "<pathPrefix>/spaces/<key> followed by the service's paths."))
    fingerprint: str | None = Field(None, description="Its replicas' embedding-space header.")
    ready: str | None = Field(None, description="ready/desired replicas.")
    serving: bool = Field(False, description="Whether it answers at the service's address.")
    role: str | None = Field(None, description="serving, candidate (the spec's, not yet promoted) or previous (kept "
                                               "for rollback).")
    since: str | None = Field(None, description="serving: when it was promoted; previous: when it stopped serving.")
    reindex: str | None = Field(None, description="The reindex Job and its state.")
    commit: str | None = Field(None, description=(
        "The model commit every replica of this space loads: the one its first replica resolved, pinned for the "
        "later ones (when model.revision names no commit)."))


class EmbeddingServiceStatus(Model):
    observed_generation: int | None = None
    conditions: list[Condition] = Field(default_factory=list, json_schema_extra={
        "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]})
    replicas: int | None = None
    ready_replicas: int | None = None
    updated_replicas: int | None = None
    available_replicas: int | None = None
    selector: str | None = None
    task: str | None = None
    accelerator: str | None = None
    replicas_summary: str | None = Field(None, description="ready/desired, for kubectl get.")
    url: str | None = None
    cluster_ip: str | None = Field(None, alias="clusterIP", description=(
        "The Service's cluster IP: a Service deleted by mistake is created again with it while it is free, so "
        "clients that resolved the name before reach it again."))
    endpoints: Endpoints | None = None
    memory: MemoryStatus | None = None
    model: ServedModel | None = None
    spaces: list[SpaceStatus] | None = Field(None, description=(
        "The embedding spaces this service runs: the one serving its address and, during a migration, the "
        "spec's new one and the previous one kept for rollback."))
    last_failure: str | None = Field(None, description=(
        "The latest failure of a container that runs again (an OOM kill, a crash): what ended, when, how many "
        "restarts. Reported here and as an Event; only a failure that lasts makes the service Stalled."))
    pod_templates: list[PodTemplateStatus] | None = Field(None, description=(
        "Deployments whose pods keep an older template revision or image of the operator's across its upgrades "
        "(absent when all run the latest)."))


class EmbeddingService(Model):
    api_version: str = API_VERSION
    kind: str = KIND
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: EmbeddingServiceSpec
    status: EmbeddingServiceStatus | None = None


# ---------------------------------------------------------------------------------------------------- CRD

_KEEP = {"type", "description", "default", "enum", "minimum", "maximum", "minLength", "maxLength", "pattern",
         "minItems", "maxItems", "items", "properties", "required", "additionalProperties", "format"}


def _structural(node: Any, defs: dict) -> Any:
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = defs[node["$ref"].split("/")[-1]]
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        if "x-kubernetes-validations" in target and "x-kubernetes-validations" in node:
            merged["x-kubernetes-validations"] = target["x-kubernetes-validations"] + node["x-kubernetes-validations"]
        return _structural(merged, defs)
    if "allOf" in node and len(node["allOf"]) == 1:
        rest = {k: v for k, v in node.items() if k != "allOf"}
        return _structural({**node["allOf"][0], **rest}, defs)
    if "anyOf" in node:
        options = [o for o in node["anyOf"] if o.get("type") != "null"]
        rest = {k: v for k, v in node.items() if k != "anyOf"}
        if node.get("default", "x") is None:
            rest.pop("default")
        if len(options) != 1:
            raise ValueError(f"non-structural union: {node}")
        return _structural({**options[0], **rest}, defs)
    if "const" in node:
        node = {**node, "enum": [node["const"]]}
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-"):
            out[key] = value
        elif key not in _KEEP:
            continue
        elif key == "properties":
            out[key] = {k: _structural(v, defs) for k, v in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = _structural(value, defs)
        elif key == "default" and value is None:
            continue
        else:
            out[key] = value
    if "enum" in out and "type" not in out:
        out["type"] = "string"
    if out.get("type") == "object" and "properties" not in out and "additionalProperties" not in out:
        out["x-kubernetes-preserve-unknown-fields"] = True
    return out


def openapi_schema(model: type[BaseModel]) -> dict:
    raw = model.model_json_schema(by_alias=True, mode="validation", ref_template="#/$defs/{model}")
    defs = raw.pop("$defs", {})
    return _structural(raw, defs)


PRINTER_COLUMNS = [
    {"name": "Model", "type": "string", "jsonPath": ".spec.model.id"},
    {"name": "Task", "type": "string", "jsonPath": ".status.task"},
    {"name": "Accelerator", "type": "string", "jsonPath": ".status.accelerator"},
    {"name": "Replicas", "type": "string", "jsonPath": ".status.replicasSummary",
     "description": "ready/desired replicas"},
    {"name": "URL", "type": "string", "jsonPath": ".status.url"},
    {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
    {"name": "Reason", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].reason', "priority": 1},
    {"name": "Memory", "type": "string", "jsonPath": ".status.memory.estimate", "priority": 1,
     "description": "estimated peak memory per replica"},
    {"name": "Commit", "type": "string", "jsonPath": ".status.model.commit", "priority": 1},
    {"name": "Space", "type": "string", "jsonPath": ".status.model.space", "priority": 1,
     "description": "the embedding space the ready replicas' vectors belong to (their embedding-space header)"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def crd() -> dict:
    spec_schema = openapi_schema(EmbeddingServiceSpec)
    status_schema = openapi_schema(EmbeddingServiceStatus)
    spec_schema["description"] = "Desired state of an embeddings/reranker service."
    status_schema["description"] = "Observed state, kstatus-compatible (observedGeneration, Ready/Reconciling/Stalled)."
    # Until the operator first writes status, a new object would look "Current" to kstatus (no conditions,
    # no observedGeneration) and Flux health checks would pass at once. The API server defaults this on read,
    # so a fresh object reads as "generation 1, observed 0": InProgress.
    status_schema["default"] = {"observedGeneration": 0}
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}",
                     "labels": {"app.kubernetes.io/name": "embedops-operator", "app.kubernetes.io/part-of": "embedops"}},
        "spec": {
            "group": GROUP,
            "names": {"kind": KIND, "listKind": f"{KIND}List", "plural": PLURAL, "singular": SINGULAR,
                      "shortNames": SHORT_NAMES, "categories": ["embedops", "ai"]},
            "scope": "Namespaced",
            "versions": [{
                "name": VERSION,
                "served": True,
                "storage": True,
                "subresources": {"status": {}, "scale": {"specReplicasPath": ".spec.replicas",
                                                         "statusReplicasPath": ".status.replicas",
                                                         "labelSelectorPath": ".status.selector"}},
                "additionalPrinterColumns": PRINTER_COLUMNS,
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "description": "EmbeddingService runs a TEI-compatible embeddings or reranker service.",
                    "required": ["spec"],
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "metadata": {"type": "object"},
                        "spec": spec_schema,
                        "status": status_schema,
                    },
                }},
            }],
        },
    }


def parse(resource: dict) -> EmbeddingService:
    """Parse a manifest dict (defaults are applied as the API server would)."""
    return EmbeddingService.model_validate(resource)
