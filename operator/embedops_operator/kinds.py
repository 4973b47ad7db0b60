"""Every kind the operator reads or writes, in one table (issue 55: they were listed in five places).

A row says what the operator does with the kind: its plural (the API paths), whether it is a child the operator
controls (`owned`: pruned by controller reference when no longer rendered), whether it is a third-party CRD that may
be absent (`optional`: rendered, watched and pruned only while the cluster serves it; `feature` names the spec
feature whose condition says so), and how it is watched (`watch`: which objects its informer lists; None: read
from the API server when needed). apply (plurals, prune), the controller (informers, resync fingerprints) and render
(the optional kinds and their features) read their views of it below.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from . import spec

KindKey = tuple[str, str]  # (apiVersion, kind)
# what an informer lists: every object; the operator's children (its managed-by label); opt-in LiteLLM ConfigMaps
Watch = Literal["all", "managed", "litellm"]


@dataclass(frozen=True)
class Kind:
    api_version: str
    kind: str
    plural: str
    owned: bool = False
    optional: bool = False
    feature: str | None = None
    watch: Watch | None = None

    @property
    def key(self) -> KindKey:
        return (self.api_version, self.kind)


EMBEDDING_SERVICE = (spec.API_VERSION, spec.KIND)
DEPLOYMENT = ("apps/v1", "Deployment")
SERVICE = ("v1", "Service")
POD = ("v1", "Pod")
CONFIGMAP = ("v1", "ConfigMap")
JOB = ("batch/v1", "Job")
NETWORKPOLICY = ("networking.k8s.io/v1", "NetworkPolicy")
SERVICEMONITOR = ("monitoring.coreos.com/v1", "ServiceMonitor")
HTTPROUTE = ("gateway.networking.k8s.io/v1", "HTTPRoute")
SCALEDOBJECT = ("keda.sh/v1alpha1", "ScaledObject")

# Owned kinds in the order prune visits them.
KINDS: tuple[Kind, ...] = (
    Kind(*EMBEDDING_SERVICE, spec.PLURAL, watch="all"),
    Kind(*DEPLOYMENT, "deployments", owned=True, watch="managed"),
    Kind(*SERVICE, "services", owned=True, watch="managed"),
    Kind("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets", owned=True, watch="managed"),
    Kind(*JOB, "jobs", owned=True, watch="managed"),  # a new embedding space's reindex Job: its end promotes
    Kind("autoscaling/v2", "HorizontalPodAutoscaler", "horizontalpodautoscalers", owned=True, watch="managed"),
    Kind(*NETWORKPOLICY, "networkpolicies", owned=True, watch="managed"),  # spec.networkPolicy: drift is put back
    Kind(*SERVICEMONITOR, "servicemonitors", owned=True, optional=True, feature="monitoring", watch="managed"),
    Kind(*HTTPROUTE, "httproutes", owned=True, optional=True, feature="routes", watch="managed"),
    Kind(*SCALEDOBJECT, "scaledobjects", owned=True, optional=True, feature="autoscaling", watch="managed"),
    Kind(*POD, "pods", watch="managed"),  # the tracks' pods: status, not children (their ReplicaSets own them)
    # the shared LiteLLM ConfigMaps (opt-in label); a track's model-commit ConfigMap is owned by its Deployment
    Kind(*CONFIGMAP, "configmaps", watch="litellm"),
)

PLURALS: dict[KindKey, str] = {k.key: k.plural for k in KINDS}
OWNED: list[KindKey] = [k.key for k in KINDS if k.owned]
OPTIONAL: tuple[KindKey, ...] = tuple(k.key for k in KINDS if k.optional)
FEATURE_OF: dict[KindKey, str] = {k.key: k.feature for k in KINDS if k.feature}


def watched(*, optional: bool) -> dict[KindKey, Watch]:
    """The watched kinds, core (watched from the start) or optional (once their CRD is served): key -> what."""
    return {k.key: k.watch for k in KINDS if k.watch and k.optional == optional}


def children() -> list[KindKey]:
    """The kinds a service's own objects are found by (the operator's label, indexed by service): its children and
    its pods; what a resync's fingerprint of one service reads."""
    return [k.key for k in KINDS if k.watch == "managed"]
