"""examples/ applied to a real cluster with the operator running: placement, status, kstatus, children.

On the local control plane the nodes are kwok's: `gpu-h100-0` (7 x nvidia.com/mig-1g.10gb, the GPU
taint), `cpu-amx-0` (NFD AMX/VNNI labels) and `cpu-plain-0`. On kind, kind-config.yaml's pools carry the
same labels, taint and extended resource.
"""
from __future__ import annotations

import pytest
import yaml

from localcluster.workloads import prerequisites
from tests.e2e.conftest import REPO, condition, is_true, operator_log, skip_unless_simulated_nodes, wait_for
from tests.e2e.kstatus import kstatus

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

EXAMPLES = REPO / "examples"


def example_docs() -> list[dict]:
    kust = EXAMPLES / "kustomization.yaml"
    files = yaml.safe_load(kust.read_text())["resources"] if kust.exists() else \
        sorted(p.name for p in EXAMPLES.glob("*.yaml"))
    docs = []
    for f in files:
        p = EXAMPLES / f
        if p.is_file():
            docs += [d for d in yaml.safe_load_all(p.read_text()) if d and d.get("kind") == "EmbeddingService"]
    return docs


def _accel(doc):
    acc = doc["spec"]["accelerator"]
    return "mig" if "mig" in acc else "gpu" if "gpu" in acc else "cpu"


def _fits_local_gpu(doc) -> bool:
    """The local GPU node offers 1g.10gb slices (mixed strategy) only."""
    mig = doc["spec"]["accelerator"].get("mig") or {}
    return mig.get("profile") == "1g.10gb" and mig.get("strategy", "mixed") == "mixed"


def test_examples_place_report_ready_and_kstatus_current(kube, embsvc, namespace, operator):
    docs = example_docs()
    if not docs:
        pytest.skip("examples/ has no EmbeddingService yet")
    skip_unless_simulated_nodes(kube)
    prerequisites(kube, namespace, docs)
    for d in docs:
        embsvc.create(d)

    mig_docs = [d for d in docs if _accel(d) == "mig" and (_fits_local_gpu(d) or not kube.local)]
    cpu_docs = [d for d in docs if _accel(d) == "cpu"]
    assert mig_docs and cpu_docs, "examples need a MIG and a CPU EmbeddingService"

    for d in mig_docs + cpu_docs:
        name = d["metadata"]["name"]
        try:
            obj = embsvc.wait_condition(name, "Ready", timeout=120)
        except AssertionError:
            pytest.fail(f"{name} never Ready: {embsvc.get(name).get('status')}\n--- operator log ---\n"
                        f"{operator_log(operator)}")
        # Flux's readiness rules (cli-utils kstatus): Current
        ks = kstatus(obj)
        assert ks["status"] == "Current", (name, ks)
        assert obj["status"]["observedGeneration"] == obj["metadata"]["generation"]

        pods = [p for p in embsvc.pods(name) if p.metadata.deletion_timestamp is None]
        assert pods, f"no pods for {name}"
        for p in pods:
            labels = kube_node_labels(embsvc, p.spec.node_name)
            if _accel(d) == "mig":
                profile = d["spec"]["accelerator"]["mig"]["profile"]
                assert p.spec.containers[0].resources.limits.get(f"nvidia.com/mig-{profile}")
                assert labels.get("nvidia.com/gpu.present") == "true", (name, p.spec.node_name)
                if kube.local:
                    assert p.spec.node_name == "gpu-h100-0"
            else:
                for isa in d["spec"]["accelerator"]["cpu"].get("instructionSets") or []:
                    nfd = {"amx_int8": "AMXINT8", "amx_bf16": "AMXBF16", "avx512_vnni": "AVX512VNNI",
                           "avx512f": "AVX512F"}.get(isa)
                    if nfd:
                        assert labels.get(f"feature.node.kubernetes.io/cpu-cpuid.{nfd}") == "true", (name, isa)
                if kube.local:
                    assert p.spec.node_name == "cpu-amx-0"
                assert "nvidia.com/gpu.present" not in labels

        # owned children: Deployment (and Service) carry an owner reference to the EmbeddingService
        dep = embsvc.deployment(name)
        assert dep is not None, f"no Deployment owned by {name}"

    # Examples the local GPU cannot host (another MIG profile) must say so: Stalled, kstatus Failed.
    for d in docs:
        if _accel(d) == "mig" and kube.local and not _fits_local_gpu(d):
            name = d["metadata"]["name"]
            try:
                obj = wait_for(lambda: (o := embsvc.get(name)) and is_true(o, "Stalled") and o,
                               timeout=120, what=f"{name} Stalled (no {d['spec']['accelerator']['mig']['profile']} slices)")
            except AssertionError as e:
                pods = [(p.metadata.name, p.spec.node_name, [(c.type, c.reason, c.message) for c in p.status.conditions or []])
                        for p in embsvc.pods(name)]
                pytest.fail(f"{e}\nstatus: {embsvc.get(name).get('status')}\npods: {pods}\n{operator_log(operator)}")
            assert kstatus(obj)["status"] == "Failed"


def kube_node_labels(embsvc, node_name):
    return embsvc.core.read_node(node_name).metadata.labels or {}


def test_optional_children_with_upstream_crds(kube, embsvc, namespace, operator, third_party_crds):
    """With the real ServiceMonitor/HTTPRoute/ScaledObject CRDs installed, a MIG service asking for
    monitoring, routes and autoscaling gets all three, owned by it and accepted by the upstream schemas."""
    from kubernetes import client

    docs = [d for d in example_docs() if _accel(d) == "mig" and d["spec"].get("autoscaling")
            and d["spec"].get("gateway") and (d["spec"].get("monitoring") or {}).get("serviceMonitor")]
    if not docs:
        pytest.skip("no example with autoscaling, gateway and monitoring")
    d = docs[0]
    prerequisites(kube, namespace, [d])
    embsvc.create(d)
    name = d["metadata"]["name"]
    co = client.CustomObjectsApi(embsvc.co.api_client)

    def owned(group, version, plural):
        items = co.list_namespaced_custom_object(group, version, namespace, plural)["items"]
        return [i for i in items if any(r.get("kind") == "EmbeddingService" and r.get("name") == name
                                        for r in i["metadata"].get("ownerReferences") or [])]
    for gvp in (("monitoring.coreos.com", "v1", "servicemonitors"),
                ("gateway.networking.k8s.io", "v1", "httproutes"),
                ("keda.sh", "v1alpha1", "scaledobjects")):
        wait_for(lambda: owned(*gvp), timeout=60, what=f"{gvp[2]} owned by {name}")
    # With KEDA owning replicas, the Deployment's replicas are left to the autoscaler.
    so = owned("keda.sh", "v1alpha1", "scaledobjects")[0]
    assert so["spec"]["scaleTargetRef"]["name"] == embsvc.deployment(name).metadata.name
    obj = embsvc.get(name)
    assert condition(obj, "Ready") is not None
