"""Pure, deterministic rendering: EmbeddingService -> child manifests (plain dicts, built as data).

Nothing here talks to a cluster. The same function serves the reconciler and `embedops-operator render`. One
module per child: `base` (labels, kinds, options, template revisions and pins, what a spec implies), `pod` (the
model server's pod template), `workload` (its Deployment, Services and budget), `activator` (scale from zero),
`autoscaling`, `network_policy`, `monitoring`, `routes`, `reindex`, `litellm_entries`; `render()` below puts
them together in apply order. This package's namespace is their public names, as the rest of the operator and
the tests read them (`render.Options`, `render.pod_template`, ...).
"""
from __future__ import annotations

from ..spec import API_VERSION, KIND, EmbeddingService, EmbeddingServiceSpec
from ..spec import parse as parse_resource
from .activator import (
    ACTIVATOR_ADMIN_PORT, ACTIVATOR_PORT, ACTIVATOR_REPLICAS, ZERO_POLLING_SECONDS, activator_admin_service,
    activator_demand_url, activator_deployment, activator_labels, activator_name, activator_pdb, activator_selector,
    activator_service, backend_name, backend_service, scales_to_zero)
from .autoscaling import hpa, scaled_object
from .base import (
    ANNOTATION_HASH, ANNOTATION_METRICS_PORT, ANNOTATION_SURGE_REFUSED, ANNOTATION_TEMPLATE_HASH,
    ANNOTATION_TEMPLATE_REVISION, BATCH_PORT, FEATURE_OF_KIND, GRACE_MARGIN, HTTPROUTE, LABEL_COMPONENT, LABEL_INSTANCE,
    LABEL_LITELLM, LABEL_MANAGED_BY, LABEL_NAME, LABEL_PART_OF, LABEL_SERVICE, LABEL_SPACE, MANAGER, METRICS_PORT,
    NETWORKPOLICY, OPTIONAL_KINDS, SCALEDOBJECT, SERVER_PORT, SERVICEMONITOR, TEMPLATE_REVISION, TEMPLATE_REVISIONS,
    Options, Pin, Pins, Tracks, accelerator_summary, autoscaler_kind, batch_service_name, common_labels, content_hash,
    detect_task, dtype, endpoints, has_batch_service, object_meta, pinned, selector_labels, selector_string,
    served_model_name, service_url, track_labels)
from .litellm_entries import litellm_config_map, litellm_key
from .monitoring import service_monitor
from .network_policy import NAMESPACE_NAME_LABEL, gateway_blocked, network_policy
from .pod import (
    DEFAULT_CACHE_SIZE, DEFAULT_MODEL_CACHE, LOG_STORAGE, MODEL_FILES, ONNX_CACHE, ONNX_FILES, PINNED_REVISION,
    batch_port, commit_config_map, container_security, download_script, ephemeral_storage, model_cache_size,
    pins_commit, pod_template, sizing_of)
from .reindex import reindex_digest, reindex_job, reindex_job_name
from .routes import OUTPUT_PATHS, ROUTE_PATHS, http_route, route_paths, space_gateway_path
from .workload import batch_service, deployment, pdb, pin_annotations, service, space_service


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
