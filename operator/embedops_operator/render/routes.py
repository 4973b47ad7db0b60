"""Gateway API HTTPRoutes: the service's paths by task and output, and a route per embedding space."""
from __future__ import annotations

from typing import Any

from ..spec import EmbeddingServiceSpec
from .base import HTTPROUTE, LABEL_INSTANCE, LABEL_SPACE, common_labels, detect_task, object_meta

ROUTE_PATHS = {
    "embed": [("PathPrefix", "/v1/embeddings"), ("Exact", "/embed"), ("Exact", "/embed_all"),
              ("Exact", "/v2/embed"), ("PathPrefix", "/v1/models")],
    "sparse": [("Exact", "/embed_sparse"), ("Exact", "/embed")],
    "rerank": [("Exact", "/rerank"), ("Exact", "/v1/rerank")],
    "classify": [("Exact", "/predict")],
}
# model.outputs of an embed service (bge-m3 layout): the routes each output adds.
OUTPUT_PATHS = {
    "dense": [("PathPrefix", "/v1/embeddings"), ("Exact", "/embed"), ("Exact", "/embed_all"), ("Exact", "/v2/embed")],
    "sparse": [("Exact", "/embed_sparse")],
    "colbert": [("Exact", "/embed_colbert")],
}


def route_paths(spec: EmbeddingServiceSpec) -> list[tuple[str, str]]:
    """The HTTPRoute's (match type, path) pairs: by task, and for an embed service with model.outputs by output
    (plus /embed_hybrid when it has two or more, and /v1/models for OpenAI clients' discovery). /embed_all only
    with gateway.embedAll (issue 53: its answers are tokens x width floats)."""
    task = detect_task(spec.model)
    outputs = spec.model.outputs
    if task != "embed" or not outputs:
        paths = list(ROUTE_PATHS[task])
    else:
        paths = [p for o in ("dense", "sparse", "colbert") if o in outputs for p in OUTPUT_PATHS[o]]
        if len(set(outputs)) > 1:
            paths.append(("Exact", "/embed_hybrid"))
        paths += [("PathPrefix", "/v1/models")]
    if spec.gateway is None or not spec.gateway.embed_all:
        paths = [p for p in paths if p != ("Exact", "/embed_all")]
    return paths


def space_gateway_path(spec: EmbeddingServiceSpec, key: str) -> str:
    """Where one embedding space answers on the service's gateway during a migration: its own routes under
    `<pathPrefix>/spaces/<key>`, whichever space the service's own routes reach."""
    assert spec.gateway is not None
    return f"{spec.gateway.path_prefix}/spaces/{key}"


def http_route(name: str, ns: str, spec: EmbeddingServiceSpec, owner: dict | None, space: str | None = None) -> dict:
    """The service's routes on its gateway(s); with `space` (a key), that space's own during a migration: the same
    paths under space_gateway_path, to the space's own Service `<name>-<key>`."""
    from ..spaces import space_service_name

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
    return {"apiVersion": HTTPROUTE[0], "kind": HTTPROUTE[1], "metadata": object_meta(backend, ns, labels, owner),


            "spec": route_spec}


