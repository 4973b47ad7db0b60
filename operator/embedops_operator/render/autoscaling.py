"""Autoscaling: KEDA's ScaledObject or an HPA on the queue metric."""
from __future__ import annotations

from ..spec import EmbeddingServiceSpec
from .activator import ZERO_POLLING_SECONDS, activator_demand_url, scales_to_zero
from .base import SCALEDOBJECT, Options, common_labels, detect_task, object_meta


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
            "metadata": object_meta(name, ns, common_labels(name, detect_task(spec.model)), owner),
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
            "metadata": object_meta(name, ns, common_labels(name, detect_task(spec.model)), owner),
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": target or name},
                     "minReplicas": max(a.min_replicas, 1), "maxReplicas": a.max_replicas,
                     "metrics": [{"type": "Pods", "pods": {
                         "metric": {"name": "te_queue_size"},
                         "target": {"type": "AverageValue", "averageValue": str(a.target_queue_depth)}}}],


                     "behavior": {"scaleDown": {"stabilizationWindowSeconds": a.cooldown_seconds}}}}


