"""The test cluster itself: what the operator's tests rely on, checked against the real API server.

Runs against the `kube` fixture (the local control plane, or any KUBECONFIG). The kwok-specific
checks (simulated nodes, their names) are skipped on other clusters.
"""
from __future__ import annotations


import pytest
from tests.waiting import wait_for

pytestmark = pytest.mark.cluster


@pytest.fixture
def core(kube):
    from kubernetes import client

    with kube.api_client() as api:
        yield client.CoreV1Api(api)


@pytest.fixture
def namespace(kube):
    with kube.namespace("t") as name:
        yield name


def _pod(name, *, mig=0, tolerate_gpu=False, node_selector=None):
    limits = {"cpu": "100m", "memory": "64Mi"}
    if mig:
        limits["nvidia.com/mig-1g.10gb"] = str(mig)
    spec = {"containers": [{"name": "c", "image": "registry.invalid/none:0", "resources": {"limits": limits}}]}
    if tolerate_gpu:
        spec["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    if node_selector:
        spec["nodeSelector"] = node_selector
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def test_nodes_advertise_mig_nfd_and_taint(kube, core):
    if not kube.local:
        pytest.skip("kwok nodes exist only on the local control plane")
    nodes = {n.metadata.name: n for n in core.list_node().items}
    assert {"gpu-h100-0", "cpu-amx-0", "cpu-plain-0"} <= set(nodes)
    gpu = nodes["gpu-h100-0"]
    assert gpu.status.allocatable["nvidia.com/mig-1g.10gb"] == "7"
    assert gpu.metadata.labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    assert gpu.metadata.labels["nvidia.com/mig.strategy"] == "mixed"
    assert gpu.metadata.labels["nvidia.com/gpu.present"] == "true"
    assert [(t.key, t.value, t.effect) for t in gpu.spec.taints] == [("nvidia.com/gpu", "present", "NoSchedule")]
    amx = nodes["cpu-amx-0"].metadata.labels
    for f in ("AMXINT8", "AMXBF16", "AVX512VNNI", "AVX512F"):
        assert amx[f"feature.node.kubernetes.io/cpu-cpuid.{f}"] == "true"
    assert not any(k.startswith("feature.node.kubernetes.io/cpu-cpuid.AMX")
                   for k in nodes["cpu-plain-0"].metadata.labels)
    for n in nodes.values():
        ready = [c.status for c in n.status.conditions if c.type == "Ready"]
        assert ready == ["True"], n.metadata.name


def test_mig_pods_schedule_until_slices_run_out(kube, core, namespace):
    """The scheduler counts the extended resource: 7 one-slice pods run on the GPU node, the 8th is
    Unschedulable; pods on kwok nodes become Running and Ready."""
    if not kube.local:
        pytest.skip("counts the 7 simulated slices of the local GPU node")
    for i in range(7):
        core.create_namespaced_pod(namespace, _pod(f"mig-{i}", mig=1, tolerate_gpu=True))

    def all_ready():
        pods = core.list_namespaced_pod(namespace).items
        ok = [p for p in pods if p.status.phase == "Running"
              and any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])]
        return len(ok) == 7 and pods
    pods = wait_for(all_ready, what="7 MIG pods Running and Ready")
    assert {p.spec.node_name for p in pods} == {"gpu-h100-0"}

    core.create_namespaced_pod(namespace, _pod("mig-7", mig=1, tolerate_gpu=True))

    def unschedulable():
        p = core.read_namespaced_pod("mig-7", namespace)
        return [c for c in p.status.conditions or []
                if c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable"]
    cond = wait_for(unschedulable, what="8th MIG pod Unschedulable")
    assert "nvidia.com/mig-1g.10gb" in cond[0].message


def test_gpu_taint_keeps_plain_pods_off_the_gpu_node(kube, core, namespace):
    if not kube.local:
        pytest.skip("kwok nodes exist only on the local control plane")
    core.create_namespaced_pod(namespace, _pod("amx", node_selector={
        "feature.node.kubernetes.io/cpu-cpuid.AMXINT8": "true"}))
    core.create_namespaced_pod(namespace, _pod("gpu-only", node_selector={"nvidia.com/gpu.present": "true"}))
    p = wait_for(lambda: core.read_namespaced_pod("amx", namespace).spec.node_name, what="amx pod bound")
    assert p == "cpu-amx-0"

    def untolerated():
        p = core.read_namespaced_pod("gpu-only", namespace)
        return [c for c in p.status.conditions or [] if c.reason == "Unschedulable"]
    assert "untolerated taint" in wait_for(untolerated, what="taint refusal")[0].message


def test_deployment_controller_gc_and_service_account_tokens(kube, core, namespace):
    """controller-manager runs the deployment/replicaset controllers and owner-reference garbage
    collection; the API server issues service-account tokens (TokenRequest) that authenticate."""
    from kubernetes import client

    with kube.api_client() as api:
        apps = client.AppsV1Api(api)
        dep = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d"},
               "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "d"}},
                        "template": {"metadata": {"labels": {"app": "d"}},
                                     "spec": {"containers": [{"name": "c", "image": "registry.invalid/none:0"}]}}}}
        apps.create_namespaced_deployment(namespace, dep)
        if kube.local:
            wait_for(lambda: (apps.read_namespaced_deployment("d", namespace).status.ready_replicas or 0) == 2,
                     what="Deployment 2/2 ready (kwok)")
        else:
            wait_for(lambda: core.list_namespaced_pod(namespace, label_selector="app=d").items, what="pods")
        apps.delete_namespaced_deployment("d", namespace)  # background propagation: GC removes RS and pods
        wait_for(lambda: not apps.list_namespaced_replica_set(namespace).items
                 and not core.list_namespaced_pod(namespace, label_selector="app=d").items,
                 what="garbage collection of ReplicaSet and pods")

        core.create_namespaced_service_account(namespace, {"metadata": {"name": "probe"}})
        tok = core.create_namespaced_service_account_token(
            "probe", namespace, {"spec": {"expirationSeconds": 600}}).status.token
        base = api.configuration
        cfg = client.Configuration(host=base.host)
        cfg.ssl_ca_cert, cfg.verify_ssl = base.ssl_ca_cert, base.verify_ssl
        cfg.api_key = {"authorization": "Bearer " + tok}
        with client.ApiClient(cfg) as sa_api:
            review = client.AuthenticationV1Api(sa_api).create_self_subject_review({})
            assert review.status.user_info.username == f"system:serviceaccount:{namespace}:probe"
            # RBAC is on: a fresh service account may not list nodes
            from kubernetes.client.rest import ApiException
            with pytest.raises(ApiException) as e:
                client.CoreV1Api(sa_api).list_node()
            assert e.value.status == 403


@pytest.mark.parametrize("name,kind,api_version", [
    ("servicemonitor", "ServiceMonitor", "monitoring.coreos.com/v1"),
    ("httproute", "HTTPRoute", "gateway.networking.k8s.io/v1"),
    ("scaledobject", "ScaledObject", "keda.sh/v1alpha1"),
])
def test_upstream_crds_install_and_validate(kube, namespace, name, kind, api_version):
    """The real third-party CRDs (pinned upstream files) install, serve, validate and uninstall."""
    from kubernetes import dynamic
    from kubernetes.client.rest import ApiException

    kube.install_crds([name])
    try:
        with kube.api_client() as api:
            dyn = dynamic.DynamicClient(api)
            res = dyn.resources.get(api_version=api_version, kind=kind)
            body = {
                "servicemonitor": {"spec": {"selector": {"matchLabels": {"app": "x"}},
                                            "endpoints": [{"port": "http", "interval": "15s"}]}},
                "httproute": {"spec": {"parentRefs": [{"name": "gw"}],
                                       "rules": [{"matches": [{"path": {"type": "PathPrefix", "value": "/v1"}}],
                                                  "backendRefs": [{"name": "svc", "port": 80}]}]}},
                "scaledobject": {"spec": {"scaleTargetRef": {"name": "d"}, "minReplicaCount": 1,
                                          "maxReplicaCount": 3,
                                          "triggers": [{"type": "cpu", "metricType": "Utilization",
                                                        "metadata": {"value": "60"}}]}},
            }[name]
            obj = {"apiVersion": res.group_version, "kind": kind, "metadata": {"name": "x", "namespace": namespace},
                   **body}
            res.create(body=obj, namespace=namespace)
            # the structural schema rejects an unknown type for a typed field
            bad = {**obj, "metadata": {"name": "bad", "namespace": namespace},
                   "spec": {**body["spec"], {"servicemonitor": "endpoints", "httproute": "rules",
                                             "scaledobject": "triggers"}[name]: "not-a-list"}}
            with pytest.raises(ApiException) as e:
                res.create(body=bad, namespace=namespace)
            assert e.value.status == 422
    finally:
        kube.uninstall_crds([name])


def test_kstatus_cli_reads_conditions():
    """localcluster/recipes/kstatus (cli-utils status.Compute, what Flux health checks use)."""
    from tests.e2e.kstatus import kstatus

    base = {"apiVersion": "embedops.dev/v1alpha1", "kind": "EmbeddingService",
            "metadata": {"name": "x", "generation": 3}}
    ready = {**base, "status": {"observedGeneration": 3, "conditions": [{"type": "Ready", "status": "True"}]}}
    stale = {**base, "status": {"observedGeneration": 2, "conditions": [{"type": "Ready", "status": "True"}]}}
    stalled = {**base, "status": {"observedGeneration": 3, "conditions": [
        {"type": "Ready", "status": "False"}, {"type": "Stalled", "status": "True", "reason": "R", "message": "m"}]}}
    assert kstatus(ready)["status"] == "Current"
    assert kstatus(stale)["status"] == "InProgress"
    assert kstatus(stalled)["status"] == "Failed"
