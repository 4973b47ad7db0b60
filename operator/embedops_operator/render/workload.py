"""The model Deployment, its Services (the service's address, the batch lane's, a space's) and its
PodDisruptionBudget."""
from __future__ import annotations

from typing import Any

from ..spec import EmbeddingServiceSpec
from .base import (
    ANNOTATION_SURGE_REFUSED, ANNOTATION_TEMPLATE_HASH, ANNOTATION_TEMPLATE_REVISION, LABEL_INSTANCE, LABEL_SPACE,
    Options, Pin, batch_service_name, common_labels, content_hash, detect_task, object_meta, selector_labels,
    track_labels)
from .pod import pod_template


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
    meta = pin_annotations(object_meta(name, ns, labels, owner), pin, dspec["template"])
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
    return {"apiVersion": "v1", "kind": "Service", "metadata": object_meta(svc_name, ns, labels, owner),
            "spec": {"type": kind, "selector": selector_labels(track),
                     "ports": [{"name": "http", "port": port, "targetPort": target_port,
                                "protocol": "TCP", "appProtocol": "http"}]}}


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
    from ..spaces import space_service_name

    svc_name = space_service_name(name, key)
    labels = {**common_labels(name, detect_task(spec.model)), LABEL_INSTANCE: svc_name, LABEL_SPACE: key}
    return _service_object(svc_name, ns, labels, owner, "ClusterIP", track, spec.service.port, "http")


def pdb(name: str, ns: str, spec: EmbeddingServiceSpec, owner: dict | None, serving: str | None = None) -> dict | None:
    """maxUnavailable 1 whenever the service can run more than one replica (fixed replicas > 1, or an autoscaler's
    maximum > 1): a service autoscaled to 6 is drained one pod at a time too. At one replica it blocks nothing."""
    most = spec.autoscaling.max_replicas if spec.autoscaling else spec.replicas
    if most <= 1:
        return None
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": object_meta(name, ns, common_labels(name, detect_task(spec.model)), owner),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(serving or name)}}}

