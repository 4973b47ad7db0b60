"""What a workload on the local cluster needs beyond the manifest a user writes.

* ``prerequisites``: what the examples reference and a platform team provides (the model PVC bound to a
  hostPath PersistentVolume, the API-key Secret).
* ``for_real_node``: an example placed on the real node (``localcluster/node.py``) and sized for a 2-core
  machine.
* ``controller_access``: the namespace, ServiceAccount and cluster-wide RBAC a controller of the local cluster
  (Prometheus, Traefik) runs with. The real node is tainted so that pods of other tests (images no registry holds) stay on the kwok
  nodes; what is meant for it tolerates the taint.
"""
from __future__ import annotations

import copy

from localcluster.models import DEFAULT_MODELS_HOSTPATH

REAL_NODE_TOLERATIONS = [{"key": "embedops.dev/real-node", "operator": "Exists", "effect": "NoSchedule"}]


def prerequisites(kube, namespace: str, docs: list[dict], host_path: str = DEFAULT_MODELS_HOSTPATH) -> None:
    """What the examples reference and a platform team provides: the model PVC (bound to a hostPath
    PV at ``host_path`` on the node), the API-key Secret."""
    objs: list[dict] = []
    for d in docs:
        spec = d["spec"]
        pvc = (((spec.get("model") or {}).get("source") or {}).get("pvc") or {}).get("claimName")
        if pvc:
            pv = f"{namespace}-{pvc}"
            objs.append({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv},
                         "spec": {"capacity": {"storage": "10Gi"}, "accessModes": ["ReadOnlyMany"],
                                  "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
                                  "hostPath": {"path": host_path},
                                  "claimRef": {"namespace": namespace, "name": pvc}}})
            objs.append({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                         "metadata": {"name": pvc, "namespace": namespace},
                         "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "", "volumeName": pv,
                                  "resources": {"requests": {"storage": "10Gi"}}}})
        ref = spec.get("apiKeySecretRef")
        if ref:
            objs.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": ref["name"], "namespace": namespace},
                         "stringData": {ref.get("key", "api-key"): "e2e-secret-key"}})
    seen = set()
    unique = []
    for o in objs:
        k = (o["kind"], o["metadata"]["name"])
        if k not in seen:
            seen.add(k)
            unique.append(o)
    if unique:
        kube.apply(unique, namespace=namespace)


def for_real_node(doc: dict, image: str | None, node_selector: dict) -> dict:
    """An EmbeddingService manifest placed on a node that runs containers and sized for a 2-core machine:
    ``image`` (None: the operator's default server image), 1 core with a 100m request (several server pods
    share the cores), no instruction-set constraint (placement is by node), a 5 s preStop drain."""
    d = copy.deepcopy(doc)
    spec = d["spec"]
    if image is not None:
        spec["image"] = image
    spec["nodeSelector"] = {**(spec.get("nodeSelector") or {}), **node_selector}
    spec["tolerations"] = list(spec.get("tolerations") or []) + REAL_NODE_TOLERATIONS
    cpu = spec["accelerator"]["cpu"]
    cpu["cores"] = 1
    cpu.pop("instructionSets", None)
    spec["resources"] = {"requests": {"cpu": "100m"}}
    spec["drainSeconds"] = 5
    return d


def controller_access(namespace: str, account: str, rules: list[dict]) -> list[dict]:
    """A controller's namespace, its ServiceAccount, and the ClusterRole ``embedops:<account>`` granting it
    ``rules`` everywhere, bound to that account."""
    role = f"embedops:{account}"
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": account, "namespace": namespace}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": role},
         "rules": rules},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": role},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
         "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": namespace}]},
    ]
