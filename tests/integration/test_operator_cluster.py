"""The operator against a real API server (tests/conftest.py `kube`): kube-apiserver, controller-manager,
scheduler and kwok nodes (a MIG GPU node, an AMX CPU node, a plain CPU node), or any KUBECONFIG.

The operator runs in-process (kopf in a thread) with a 2 s resync and a 3 s stall grace.
Tests share one namespace and run in file order (later tests build on earlier ones).
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
import yaml

from tests.integration.operator_process import delete_cluster_scoped
from tests.waiting import ReplicasWatch, wait_until as wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
NS = "embedops-it"
GROUP, VERSION, PLURAL = "embedops.dev", "v1alpha1", "embeddingservices"
OPTIONAL = ["servicemonitor", "httproute", "scaledobject"]

CPU_SPEC = {
    "model": {"id": "/models/all-MiniLM-L6-v2", "servedModelName": "all-MiniLM-L6-v2", "task": "embed",
              "maxInputLength": 256},
    "accelerator": {"cpu": {"cores": 2, "memory": "2Gi", "instructionSets": ["amx_int8"]}},
    "batching": {"maxBatchTokens": 8192},
    "litellm": {"configMapName": "litellm-models"},
}
MIG_SPEC = {
    "model": {"id": "BAAI/bge-m3", "maxInputLength": 8192},
    "accelerator": {"mig": {"product": "H100-80GB", "profile": "1g.10gb"}},
    "monitoring": {"serviceMonitor": {"enabled": False}},
}


# ---------------------------------------------------------------------------------------------------- helpers

def kubectl_binary() -> str | None:
    if os.environ.get("KUBECTL"):
        return os.environ["KUBECTL"]
    cache = Path(os.environ.get("EMBEDOPS_CACHE", Path.home() / ".cache" / "embedops")) / "bin"
    for cand in sorted(cache.glob("kubectl*/kubectl")) + sorted(cache.glob("kubectl")):
        if os.access(cand, os.X_OK):
            return str(cand)
    return shutil.which("kubectl")


def kstatus_of(obj: dict) -> str | None:
    """The cli-utils kstatus verdict (what Flux health checks use), when localcluster built the tool."""
    cache = Path(os.environ.get("EMBEDOPS_CACHE", Path.home() / ".cache" / "embedops")) / "bin"
    found = [p for p in sorted(cache.glob("kstatus-*/kstatus")) if os.access(p, os.X_OK)]
    if not found:
        return None
    out = subprocess.run([str(found[-1])], input=json.dumps(obj), capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[0])["status"]


class OperatorThread:
    """kopf.operator() in a background thread, against the fixture's kubeconfig."""

    def __init__(self):
        self.stop_flag = threading.Event()
        self.ready_flag = threading.Event()
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def start(self) -> "OperatorThread":
        import kopf

        from embedops_operator import handlers  # noqa: F401 - registers the handlers

        def run():
            try:
                asyncio.run(kopf.operator(standalone=True, clusterwide=True, stop_flag=self.stop_flag,
                                          ready_flag=self.ready_flag))
            except BaseException as exc:  # noqa: BLE001
                self.error = exc

        self.thread = threading.Thread(target=run, name="embedops-operator", daemon=True)
        self.thread.start()
        if not self.ready_flag.wait(60):
            self.stop_flag.set()  # never leave a half-started operator retrying behind the tests
            raise AssertionError(f"operator did not start: {self.error!r}")
        return self

    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive() and self.error is None

    def stop(self) -> None:
        self.stop_flag.set()
        if self.thread:
            self.thread.join(60)
            assert not self.thread.is_alive(), "operator did not stop"


class Ctx:
    def __init__(self, kube):
        from kubernetes import client

        self.kube = kube
        self.api = kube.api_client()
        self.custom = client.CustomObjectsApi(self.api)
        self.apps = client.AppsV1Api(self.api)
        self.core = client.CoreV1Api(self.api)
        self.policy = client.PolicyV1Api(self.api)
        self.autoscaling = client.AutoscalingV2Api(self.api)
        self.operator: OperatorThread | None = None

    # EmbeddingServices
    def apply_es(self, name: str, spec: dict) -> dict:
        body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "EmbeddingService",
                "metadata": {"name": name, "namespace": NS}, "spec": spec}
        self.kube.apply([body], namespace=NS)
        return self.get_es(name)

    def get_es(self, name: str) -> dict:
        return self.custom.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, name)

    def conditions(self, name: str) -> dict[str, dict]:
        return {c["type"]: c for c in (self.get_es(name).get("status") or {}).get("conditions", [])}

    def wait_condition(self, name: str, ctype: str, status: str = "True", reason: str | None = None,
                       timeout: float = 90) -> dict:
        def check():
            es = self.get_es(name)
            st = es.get("status") or {}
            if st.get("observedGeneration") != es["metadata"]["generation"]:
                return None
            c = {x["type"]: x for x in st.get("conditions", [])}.get(ctype)
            if c and c["status"] == status and (reason is None or c["reason"] == reason):
                return es
            return None
        return wait_for(f"{name} {ctype}={status} {reason or ''}", check, timeout)

    def deployment(self, name: str):
        return self.apps.read_namespaced_deployment(name, NS)

    def kubectl(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        binary = kubectl_binary()
        if not binary:
            pytest.skip("kubectl not found (set KUBECTL or put it in ~/.cache/embedops/bin/kubectl*/)")
        env = {**os.environ, "KUBECONFIG": self.kube.kubeconfig}
        res = subprocess.run([binary, *args], capture_output=True, text=True, env=env, timeout=timeout)
        if check:
            assert res.returncode == 0, f"kubectl {' '.join(args)}: {res.stdout}{res.stderr}"
        return res


@pytest.fixture(scope="module")
def ctx(kube):
    saved = {k: os.environ.get(k) for k in ("KUBECONFIG", "EMBEDOPS_RESYNC_SECONDS",
                                            "EMBEDOPS_STALL_AFTER_SECONDS", "EMBEDOPS_NAMESPACES")}
    os.environ.update({"KUBECONFIG": kube.kubeconfig, "EMBEDOPS_RESYNC_SECONDS": "2",
                       "EMBEDOPS_STALL_AFTER_SECONDS": "3", "EMBEDOPS_NAMESPACES": ""})
    c = Ctx(kube)
    kube.apply(REPO / "crds" / "embedops.dev_embeddingservices.yaml")

    def established():
        from kubernetes import client
        crd = client.ApiextensionsV1Api(c.api).read_custom_resource_definition(f"{PLURAL}.{GROUP}")
        return any(x.type == "Established" and x.status == "True" for x in crd.status.conditions or [])
    wait_for("CRD established", established, 60)
    kube.apply([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}])
    yield c
    if c.operator:
        c.operator.stop()
    try:
        c.core.delete_namespace(NS)
    except Exception:  # noqa: BLE001
        pass
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def operator(ctx):
    if ctx.operator is None or not ctx.operator.alive():
        ctx.operator = OperatorThread()
        ctx.operator.start()
    yield ctx.operator
    assert ctx.operator.alive(), f"operator crashed: {ctx.operator.error!r}"


# ---------------------------------------------------------------------------------------------------- tests

def _create_raw(ctx, name: str, spec: dict):
    from kubernetes.client.rest import ApiException

    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "EmbeddingService",
            "metadata": {"name": name, "namespace": NS}, "spec": spec}
    with pytest.raises(ApiException) as err:
        ctx.custom.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, body)
    assert err.value.status == 422
    return json.loads(err.value.body)["message"]


def test_invalid_manifests_are_refused_with_the_cel_message(ctx):
    msg = _create_raw(ctx, "bad-acc", {"model": {"id": "x"},
                                       "accelerator": {"mig": {"profile": "1g.10gb"}, "cpu": {}}})
    assert "accelerator: set exactly one of mig, gpu or cpu" in msg
    msg = _create_raw(ctx, "bad-mig", {"model": {"id": "x"},
                                       "accelerator": {"mig": {"product": "H200-141GB", "profile": "1g.10gb"}}})
    assert "MIG profile 1g.10gb is not offered by H200-141GB; valid: 1g.18gb, 1g.35gb" in msg
    msg = _create_raw(ctx, "bad-budget", {"model": {"id": "x", "maxInputLength": 8192},
                                          "accelerator": {"cpu": {}}, "batching": {"maxBatchTokens": 512}})
    assert "batching.maxBatchTokens must be at least model.maxInputLength (the longest accepted input)" in msg
    msg = _create_raw(ctx, "bad-dtype", {"model": {"id": "x", "dtype": "float16"}, "accelerator": {"cpu": {}}})
    assert "float16 is not supported on CPU" in msg
    msg = _create_raw(ctx, "bad-int8", {"model": {"id": "x", "quantize": "int8"},
                                        "accelerator": {"mig": {"profile": "1g.10gb"}}})
    assert "model.quantize int8 runs on CPU (ONNX Runtime)" in msg
    msg = _create_raw(ctx, "bad-batch", {"model": {"id": "x"}, "accelerator": {"cpu": {}},
                                         "batching": {"maxConcurrentRequests": 16}})  # 32 inputs: 429 forever
    assert "batching.maxClientBatchSize must not exceed batching.maxConcurrentRequests" in msg
    msg = _create_raw(ctx, "bad-lane", {"model": {"id": "x"}, "accelerator": {"cpu": {}},
                                        "batching": {"maxConcurrentRequests": 40}})
    assert "must not exceed the batch lane's share of batching.maxConcurrentRequests" in msg
    msg = _create_raw(ctx, "bad-enum", {"model": {"id": "x"}, "accelerator": {"mig": {"profile": "1g.99gb"}}})
    assert "1g.99gb" in msg and "Unsupported value" in msg


def test_new_object_is_in_progress_before_the_operator_sees_it(ctx):
    es = ctx.apply_es("early", {"model": {"id": "x"}, "accelerator": {"cpu": {}}})
    assert es["status"] == {"observedGeneration": 0}  # the CRD's status default
    assert kstatus_of(es) in ("InProgress", None)
    ctx.custom.delete_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "early")


def test_apply_creates_owned_children_and_becomes_ready(ctx, operator):
    es = ctx.apply_es("minilm", CPU_SPEC)
    uid = es["metadata"]["uid"]
    es = ctx.wait_condition("minilm", "Ready", "True", timeout=120)
    st = es["status"]
    assert st["observedGeneration"] == es["metadata"]["generation"]
    assert st["replicasSummary"] == "1/1" and st["readyReplicas"] == 1
    assert st["selector"] == "app.kubernetes.io/instance=minilm,app.kubernetes.io/name=embedops-server"
    assert st["endpoints"]["openai"] == f"http://minilm.{NS}.svc.cluster.local/v1"
    conds = {c["type"]: c["status"] for c in st["conditions"]}
    assert conds["Reconciling"] == "False" and conds["Stalled"] == "False"
    assert kstatus_of(es) in ("Current", None)
    for obj in (ctx.deployment("minilm"), ctx.core.read_namespaced_service("minilm", NS)):
        refs = obj.metadata.owner_references
        assert len(refs) == 1 and refs[0].uid == uid and refs[0].controller is True and refs[0].kind == \
            "EmbeddingService"
        assert "embedops" in [m.manager for m in obj.metadata.managed_fields]
    # CPU placement: the NFD-labelled AMX node
    pods = ctx.core.list_namespaced_pod(NS, label_selector=st["selector"]).items
    assert len(pods) == 1
    if ctx.kube.local:
        assert pods[0].spec.node_name == "cpu-amx-0"
    # LiteLLM entry in the shared ConfigMap
    cm = ctx.core.read_namespaced_config_map("litellm-models", NS)
    assert '"openai/all-MiniLM-L6-v2"' in cm.data["embedops-minilm.yaml"]


def test_kubectl_wait_and_get(ctx, operator):
    ctx.kubectl("wait", "--for=condition=Ready", "embsvc/minilm", "-n", NS, "--timeout=60s")
    out = ctx.kubectl("get", "embsvc", "-n", NS).stdout
    header = out.splitlines()[0].split()
    assert header[:7] == ["NAME", "MODEL", "TASK", "ACCELERATOR", "REPLICAS", "URL", "READY"]
    row = next(line for line in out.splitlines() if line.startswith("minilm"))
    assert "cpu-2(amx_int8)" in row and "1/1" in row and "True" in row


def test_spec_change_rolls_out(ctx, operator):
    before = ctx.deployment("minilm")
    spec = json.loads(json.dumps(CPU_SPEC))
    spec["batching"]["maxBatchTokens"] = 4096
    es = ctx.apply_es("minilm", spec)
    assert es["metadata"]["generation"] == 2
    ctx.wait_condition("minilm", "Ready", "True")

    def rolled():
        d = ctx.deployment("minilm")
        args = d.spec.template.spec.containers[0].args
        return d.metadata.generation > before.metadata.generation and \
            args[args.index("--max-batch-tokens") + 1] == "4096" and d.status.updated_replicas == 1 and \
            d.status.ready_replicas == 1 and (d.status.replicas or 0) == 1
    wait_for("rollout of the new template", rolled, 90)
    es = ctx.wait_condition("minilm", "Ready", "True")
    assert es["status"]["observedGeneration"] == 2


def test_kubectl_scale(ctx, operator):
    ctx.kubectl("scale", "embsvc/minilm", "-n", NS, "--replicas=3")
    wait_for("deployment scaled", lambda: ctx.deployment("minilm").spec.replicas == 3, 30)
    es = wait_for("3/3 ready", lambda: (lambda e: e if (e.get("status") or {}).get("replicasSummary") == "3/3"
                                        and e["status"]["observedGeneration"] == e["metadata"]["generation"]
                                        else None)(ctx.get_es("minilm")), 120)
    assert es["spec"]["replicas"] == 3 and es["status"]["replicas"] == 3
    ctx.wait_condition("minilm", "Ready", "True")
    pdb = ctx.policy.read_namespaced_pod_disruption_budget("minilm", NS)
    assert pdb.spec.max_unavailable == 1
    # the scale subresource reads back through the selector
    scale = ctx.custom.get_namespaced_custom_object_scale(GROUP, VERSION, NS, PLURAL, "minilm")
    assert scale["status"]["replicas"] == 3 and "app.kubernetes.io/instance=minilm" in scale["status"]["selector"]
    ctx.kubectl("scale", "embsvc/minilm", "-n", NS, "--replicas=1")
    wait_for("PDB pruned", lambda: not ctx.policy.list_namespaced_pod_disruption_budget(NS).items, 60)
    ctx.wait_condition("minilm", "Ready", "True", timeout=120)
    wait_for("1/1", lambda: ctx.get_es("minilm")["status"]["replicasSummary"] == "1/1", 60)


def test_turning_autoscaling_on_and_off_never_drops_running_replicas(ctx, operator):
    """A running service with 3 replicas switched to autoscaling (min 3) and back: the operator stops sending
    `replicas`, which the API server would default to 1 were the operator its only owner. It hands the live
    count to a temporary field manager first (apply.hand_over_replicas). Here no autoscaler controller runs
    (only KEDA's CRD), so the count must hold with nobody else writing it."""
    from embedops_operator.apply import HANDOVER_MANAGER

    fixed = {**CPU_SPEC, "replicas": 3}
    ctx.apply_es("minilm", fixed)
    wait_for("3/3", lambda: ctx.get_es("minilm")["status"].get("replicasSummary") == "3/3", 120)
    watch = ReplicasWatch(ctx.apps, NS, "minilm", timeout_seconds=300)
    try:
        ctx.apply_es("minilm", {**CPU_SPEC, "autoscaling": {"minReplicas": 3, "maxReplicas": 6}})
        es = ctx.wait_condition("minilm", "AutoscalingReady", "True", timeout=60)
        by = {c["type"]: c for c in es["status"]["conditions"]}["AutoscalingReady"]["reason"]
        time.sleep(7)  # three resyncs
        d = ctx.deployment("minilm")
        owners = [m.manager for m in d.metadata.managed_fields if '"f:replicas"' in json.dumps(m.fields_v1)]
        # the operator let go; the hand-over manager holds the count until an autoscaler writes another one (the
        # HPA controller, when by == "HPA", writes the scale subresource with the same count: co-owned)
        assert d.spec.replicas == 3 and HANDOVER_MANAGER in owners and "embedops" not in owners, (by, owners)
        ctx.apply_es("minilm", fixed)

        def autoscaler_pruned():
            if by == "KEDA":
                return not ctx.custom.list_namespaced_custom_object("keda.sh", "v1alpha1", NS, "scaledobjects")[
                    "items"]
            return not ctx.autoscaling.list_namespaced_horizontal_pod_autoscaler(NS).items
        wait_for(f"{by} autoscaler pruned", autoscaler_pruned, 60)
        ctx.wait_condition("minilm", "Ready", "True", timeout=60)
        time.sleep(4)
    finally:
        seen = watch.stop()
    assert seen and min(seen) == 3, f"spec.replicas took the values {seen}"
    ctx.apply_es("minilm", {**CPU_SPEC, "replicas": 1})
    wait_for("1/1", lambda: ctx.get_es("minilm")["status"].get("replicasSummary") == "1/1", 90)


def _resource_versions(ctx, name: str) -> dict[str, str]:
    out = {"EmbeddingService": ctx.get_es(name)["metadata"]["resourceVersion"],
           "Deployment": ctx.deployment(name).metadata.resource_version,
           "Service": ctx.core.read_namespaced_service(name, NS).metadata.resource_version,
           "ConfigMap": ctx.core.read_namespaced_config_map("litellm-models", NS).metadata.resource_version}
    for item in ctx.core.list_namespaced_pod(NS, label_selector=f"app.kubernetes.io/instance={name}").items:
        out[f"Pod/{item.metadata.name}"] = item.metadata.resource_version
    return out


def _assert_no_writes(ctx, name: str, action, attempts: int = 3) -> None:
    """Nothing may be written while `action` runs. The operator never writes pods, so a pod that changed in the
    window (kwok or the node controller on a loaded machine) means the window was not quiet: measure again."""
    for _ in range(attempts):
        before = _resource_versions(ctx, name)
        action()
        after = _resource_versions(ctx, name)
        pods_before = {k: v for k, v in before.items() if k.startswith("Pod/")}
        if pods_before == {k: v for k, v in after.items() if k.startswith("Pod/")}:
            assert after == before
            return
        time.sleep(3)
    pytest.fail(f"pods kept changing for {attempts} windows; could not check that the operator writes nothing")


# managers of the controllers that run in the test cluster beside the operator and write to its children
CLUSTER_CONTROLLERS = frozenset({"keda-operator", "kube-controller-manager"})


def _written_only_by_cluster_controllers(before: dict, after: dict) -> bool:
    """Whether every managedFields entry that differs between two reads of an object belongs to one of the
    cluster's own controllers. A change that shows in no entry is not explained, so it counts as the operator's."""
    def entries(obj: dict) -> set[tuple[str, str]]:
        return {(e["manager"], json.dumps(e, sort_keys=True)) for e in obj["metadata"].get("managedFields") or []}
    differing = entries(before) ^ entries(after)
    return bool(differing) and all(manager in CLUSTER_CONTROLLERS for manager, _ in differing)


def test_operator_restart_and_resync_cause_no_writes(ctx, operator):
    ctx.wait_condition("minilm", "Ready", "True")
    time.sleep(3)  # let the last status write and pod updates settle
    _assert_no_writes(ctx, "minilm", lambda: time.sleep(5))  # two resyncs with the running operator

    def restart():
        ctx.operator.stop()
        ctx.operator = OperatorThread()
        ctx.operator.start()
        time.sleep(8)  # initial listing + several resyncs
        assert ctx.operator.alive()

    _assert_no_writes(ctx, "minilm", restart)


def test_mig_service_lands_on_a_slice(ctx, operator):
    ctx.apply_es("bge", MIG_SPEC)
    ctx.wait_condition("bge", "Ready", "True", timeout=120)
    d = ctx.deployment("bge")
    c = d.spec.template.spec.containers[0]
    assert c.resources.limits["nvidia.com/mig-1g.10gb"] == "1"
    # a surge while a slice may be free; the switch to giving one up: tests/e2e/test_mig_capacity.py
    assert (d.spec.strategy.rolling_update.max_surge, d.spec.strategy.rolling_update.max_unavailable) == (1, 0)
    pods = ctx.core.list_namespaced_pod(NS, label_selector="app.kubernetes.io/instance=bge").items
    if ctx.kube.local:
        assert [p.spec.node_name for p in pods] == ["gpu-h100-0"]
    ctx.custom.delete_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "bge")
    wait_for("bge pods gone", lambda: not ctx.core.list_namespaced_pod(
        NS, label_selector="app.kubernetes.io/instance=bge").items, 90)


def test_mig_request_without_a_free_slice_is_stalled(ctx, operator):
    spec = json.loads(json.dumps(MIG_SPEC))
    spec["accelerator"]["mig"]["count"] = 7  # one replica takes the whole node's seven slices
    spec["replicas"] = 2
    ctx.apply_es("greedy", spec)
    # Waits for the reason, not the first Stalled: on a loaded machine kwok's node lease can lapse and the
    # scheduler's message then names the node's not-ready taint (reported, rightly, as Unschedulable) until
    # the node is back and the next resync reads the accelerator shortage.
    try:
        es = ctx.wait_condition("greedy", "Stalled", "True", "InsufficientAccelerator", timeout=150)
    except Exception as e:
        conds = (ctx.get_es("greedy").get("status") or {}).get("conditions", [])
        raise AssertionError(f"{e}; conditions now: {conds}") from e  # the scheduler's words
    stalled = {c["type"]: c for c in es["status"]["conditions"]}["Stalled"]
    assert "nvidia.com/mig-1g.10gb" in stalled["message"]
    assert kstatus_of(es) in ("Failed", None)
    ready = {c["type"]: c for c in es["status"]["conditions"]}["Ready"]
    assert ready["status"] == "False" and ready["reason"] == "InsufficientAccelerator"
    ctx.kubectl("wait", "--for=condition=Stalled", "embsvc/greedy", "-n", NS, "--timeout=30s")
    ctx.custom.delete_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "greedy")
    wait_for("greedy pods gone", lambda: not ctx.core.list_namespaced_pod(
        NS, label_selector="app.kubernetes.io/instance=greedy").items, 90)


def test_missing_optional_crds_give_conditions_then_are_picked_up(ctx, operator):
    ctx.kube.uninstall_crds(OPTIONAL)
    spec = json.loads(json.dumps(CPU_SPEC))
    spec.pop("litellm")
    spec["gateway"] = {"parentRefs": [{"name": "ai-gateway"}], "hostnames": ["ai.example.com"],
                       "allowUnauthenticated": True}
    spec["autoscaling"] = {"minReplicas": 1, "maxReplicas": 3}
    try:
        ctx.apply_es("opt", spec)

        # the API server's discovery can list a kind for a moment after its CRD is gone, so the conditions
        # are read once all three agree (each alone was seen stale in one reconcile)
        def all_missing():
            conds = ctx.conditions("opt")
            # (a reconcile may say AutoscalingReady CRDNotInstalled for KEDA's CRD before the next says HPA)
            if [conds.get(t, {}).get("reason") for t in ("MonitoringReady", "RoutesReady", "AutoscalingReady")] \
                    == ["CRDNotInstalled", "CRDNotInstalled", "HPA"]:
                return conds
        conds = wait_for("opt: ServiceMonitor and HTTPRoute CRDNotInstalled, autoscaling by HPA", all_missing, 90)
        assert conds["MonitoringReady"]["status"] == conds["RoutesReady"]["status"] == "False"
        assert "HTTPRoute CRD is not installed" in conds["RoutesReady"]["message"]
        assert conds["AutoscalingReady"]["reason"] == "HPA"
        wait_for("opt HPA", lambda: ctx.autoscaling.read_namespaced_horizontal_pod_autoscaler("opt", NS), 30)
        assert ctx.deployment("opt").spec.replicas == 1  # left to the autoscaler (defaulted on create)
        ctx.wait_condition("opt", "Ready", "True", timeout=90)
        assert ctx.operator.alive()
    finally:
        ctx.kube.install_crds(OPTIONAL)  # the later tests need them, whatever happened here
    ctx.wait_condition("opt", "MonitoringReady", "True", timeout=90)
    # the route is written; no gateway controller runs in this cluster to accept it
    # (tests/e2e/test_gateway_and_litellm.py has Traefik accept one)
    es = ctx.wait_condition("opt", "RoutesReady", "Unknown", "WaitingForGateway", timeout=60)
    es = ctx.wait_condition("opt", "AutoscalingReady", "True", "KEDA", timeout=60)
    uid = es["metadata"]["uid"]
    sm = ctx.custom.get_namespaced_custom_object("monitoring.coreos.com", "v1", NS, "servicemonitors", "opt")
    route = ctx.custom.get_namespaced_custom_object("gateway.networking.k8s.io", "v1", NS, "httproutes", "opt")
    so = ctx.custom.get_namespaced_custom_object("keda.sh", "v1alpha1", NS, "scaledobjects", "opt")
    for obj in (sm, route, so):
        assert obj["metadata"]["ownerReferences"][0]["uid"] == uid
    # /embed_all only with gateway.embedAll (its answers are tokens x width floats: issue 53)
    assert [r["matches"][0]["path"]["value"] for r in route["spec"]["rules"]] == \
        ["/v1/embeddings", "/embed", "/v2/embed", "/v1/models"]
    wait_for("HPA pruned", lambda: not [h for h in ctx.autoscaling.list_namespaced_horizontal_pod_autoscaler(
        NS).items if h.metadata.name == "opt"], 60)

    # resyncs write nothing to the third-party children either (their CRDs default fields)
    kinds = {"servicemonitors": ("monitoring.coreos.com", "v1"), "httproutes": ("gateway.networking.k8s.io", "v1"),
             "scaledobjects": ("keda.sh", "v1alpha1")}

    def snapshot() -> dict[str, dict]:
        out = {"es": ctx.get_es("opt"),
               "deploy": ctx.apps.api_client.sanitize_for_serialization(ctx.deployment("opt"))}
        for plural, (group, version) in kinds.items():
            out[plural] = ctx.custom.get_namespaced_custom_object(group, version, NS, plural, "opt")
        return out

    ctx.wait_condition("opt", "Ready", "True")
    time.sleep(3)
    for attempt in range(3):
        before = snapshot()
        time.sleep(7)  # three resyncs
        after = snapshot()
        changed = [k for k in before if before[k]["metadata"]["resourceVersion"] != after[k]["metadata"]["resourceVersion"]]
        if not changed:
            break
        for k in changed:  # who wrote what (managedFields, uid), so a rare failure is explained by its log alone
            print(f"{k} changed in window {attempt + 1}:\n before: {json.dumps(before[k]['metadata'], sort_keys=True)}"
                  f"\n after: {json.dumps(after[k]['metadata'], sort_keys=True)}")
        # the window was not quiet, as in _assert_no_writes, when a child was deleted by someone else and created
        # again by the operator (a new uid), or when only the cluster's own controllers wrote (KEDA adds its
        # finalizer and label to a new ScaledObject seconds after the operator creates it: seen on a slow machine);
        # any other write to a child the operator already has is the failure
        rewritten = [k for k in changed if before[k]["metadata"]["uid"] == after[k]["metadata"]["uid"]
                     and not _written_only_by_cluster_controllers(before[k], after[k])]
        assert not rewritten, f"written on a resync: {rewritten}"
    else:
        pytest.fail("children kept being recreated or written by the cluster's controllers for 3 windows: could not "
                    "check that resyncs write nothing")


def test_litellm_entry_follows_its_config_map_and_is_swept_after_operator_downtime(ctx, operator):
    """No owner reference on the shared ConfigMap, so the operator removes entries itself: when
    litellm.configMapName changes, and for a service deleted while the operator was down (startup sweep).
    A key the user wrote into the same ConfigMap (labelled to opt in) is never touched."""
    # the platform team's own ConfigMap, opted in to embedops' entries by its label
    ctx.kube.apply([{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {
        "name": "litellm-a", "namespace": NS, "labels": {"embedops.dev/litellm": "true"}},
        "data": {"user.yaml": "model_list: []\n"}}], namespace=NS)
    data = lambda cm: ctx.core.read_namespaced_config_map(cm, NS).data or {}  # noqa: E731
    spec = json.loads(json.dumps(CPU_SPEC))
    spec["replicas"] = 0
    spec["litellm"] = {"configMapName": "litellm-a"}
    ctx.apply_es("ll", spec)
    wait_for("entry in litellm-a", lambda: "embedops-ll.yaml" in data("litellm-a"), 30)
    # the index LiteLLM's config includes lists the entry files (LiteLLM's `include` cannot glob)
    wait_for("index lists the entry", lambda: included(data("litellm-a")) == ["embedops-ll.yaml"], 30)

    spec["litellm"] = {"configMapName": "litellm-b"}
    ctx.apply_es("ll", spec)
    wait_for("entry moved to litellm-b", lambda: "embedops-ll.yaml" in data("litellm-b")
             and "embedops-ll.yaml" not in data("litellm-a"), 30)
    wait_for("indexes follow", lambda: included(data("litellm-b")) == ["embedops-ll.yaml"]
             and included(data("litellm-a")) == [], 30)
    # the user's key untouched; the index stays with an empty list, so a config including it still loads
    assert set(data("litellm-a")) == {"user.yaml", "embedops.yaml"}
    assert data("litellm-a")["user.yaml"] == "model_list: []\n"

    ctx.operator.stop()
    ctx.custom.delete_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "ll")
    wait_for("ll deleted", lambda: "ll" not in [o["metadata"]["name"] for o in ctx.custom.list_namespaced_custom_object(
        GROUP, VERSION, NS, PLURAL)["items"]], 30)
    assert "embedops-ll.yaml" in data("litellm-b")  # nobody removed it while the operator was down
    ctx.operator = OperatorThread().start()
    wait_for("entry swept on start-up", lambda: "embedops-ll.yaml" not in data("litellm-b"), 30)
    wait_for("swept entry leaves the index", lambda: included(data("litellm-b")) == [], 30)
    assert "embedops-minilm.yaml" in data("litellm-models")  # a live service's entry stays
    assert "embedops-minilm.yaml" in included(data("litellm-models"))
    assert data("litellm-a")["user.yaml"] == "model_list: []\n" and included(data("litellm-a")) == []


def included(data: dict) -> list | None:
    """The entry files the ConfigMap's LiteLLM index includes (None: no index)."""
    return yaml.safe_load(data["embedops.yaml"])["include"] if "embedops.yaml" in data else None


# ---------------------------------------------------------------------------------------------------- ownership

def _foreign_objects() -> list[dict]:
    """Objects a team created itself, under the names the operator's children of `own`, `own-hpa` and `own-zero`
    would take: one of every kind the operator writes (the scaled-to-zero service's activator Deployment and
    backend Service among them)."""
    labels = {"app": "theirs"}
    meta = lambda name: {"name": name, "namespace": NS, "labels": labels}  # noqa: E731
    template = {"metadata": {"labels": labels}, "spec": {"containers": [{"name": "web", "image": "web:1"}]}}
    return [
        {"apiVersion": "v1", "kind": "Service", "metadata": meta("own"),
         "spec": {"selector": labels, "ports": [{"port": 80, "targetPort": 8080}]}},
        {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": meta("own"),
         "spec": {"minAvailable": 1, "selector": {"matchLabels": labels}}},
        {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor", "metadata": meta("own"),
         "spec": {"selector": {"matchLabels": labels}, "endpoints": [{"port": "web"}]}},
        {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute", "metadata": meta("own"),
         "spec": {"parentRefs": [{"name": "their-gateway"}], "rules": [{"backendRefs": [{"name": "web", "port": 80}]}]}},
        {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": meta("own"),
         "spec": {"scaleTargetRef": {"name": "web"}, "triggers": [{"type": "cpu", "metadata": {"value": "50"}}]}},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta("their-litellm"),
         "data": {"config.yaml": "model_list: []\n"}},
        {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": meta("own-hpa"),
         "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "web"},
                  "minReplicas": 1, "maxReplicas": 2}},
        {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": meta("own-hpa"),
         "spec": {"podSelector": {"matchLabels": labels}, "policyTypes": ["Ingress"], "ingress": [{}]}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta("own-zero-activator"),
         "spec": {"replicas": 0, "selector": {"matchLabels": labels}, "template": template}},
        {"apiVersion": "v1", "kind": "Service", "metadata": meta("own-zero-backend"),
         "spec": {"selector": labels, "ports": [{"port": 80, "targetPort": 8080}]}},
    ]


def _read(ctx, obj: dict) -> dict | None:
    """The object as the API server has it, whole (metadata.managedFields and resourceVersion included)."""
    from embedops_operator.apply import Kube

    return Kube(ctx.api).get(obj["apiVersion"], obj["kind"], NS, obj["metadata"]["name"])


def test_objects_the_operator_did_not_create_are_never_taken_over_or_deleted(ctx, operator):
    """Issue 35's first point, on the real API server and garbage collector: a team's own objects of every kind
    the operator writes, under the names its children would take. The operator writes none of them (each reads
    back byte for byte as before, resourceVersion and managedFields included), says Stalled/OwnershipConflict
    naming each, and deleting the EmbeddingServices leaves them all in place while the garbage collector removes
    what the operator did create."""
    ctx.kube.install_crds(OPTIONAL)
    foreign = _foreign_objects()
    ctx.kube.apply(foreign, namespace=NS)
    before = {(o["kind"], o["metadata"]["name"]): _read(ctx, o) for o in foreign}
    assert all(before.values())
    base = json.loads(json.dumps(CPU_SPEC))
    base["model"].pop("maxInputLength")
    own = {**base, "replicas": 2, "gateway": {"parentRefs": [{"name": "ai-gateway"}], "allowUnauthenticated": True},
           "autoscaling": {"minReplicas": 2, "maxReplicas": 3, "provider": "keda"},
           "litellm": {"configMapName": "their-litellm"}}
    own_hpa = {**base, "autoscaling": {"minReplicas": 1, "maxReplicas": 2, "provider": "hpa"}, "networkPolicy": {}}
    own_hpa.pop("litellm")
    own_zero = {**base, "autoscaling": {"minReplicas": 0, "maxReplicas": 1, "provider": "keda"}}
    own_zero.pop("litellm")
    expected = {"own": ["Service own", "PodDisruptionBudget own", "ServiceMonitor own", "HTTPRoute own",
                        "ScaledObject own", "ConfigMap their-litellm"],
                "own-hpa": ["NetworkPolicy own-hpa", "HorizontalPodAutoscaler own-hpa"],
                "own-zero": ["Deployment own-zero-activator", "Service own-zero-backend"]}
    try:
        for name, spec in (("own", own), ("own-hpa", own_hpa), ("own-zero", own_zero)):
            ctx.apply_es(name, spec)
        for name, conflicts in expected.items():
            es = ctx.wait_condition(name, "Stalled", "True", "OwnershipConflict", timeout=60)
            msg = {c["type"]: c for c in es["status"]["conditions"]}["Stalled"]["message"]
            parts = msg.split("; ")
            assert [p.split(" exists")[0].split(" is controlled")[0] for p in parts[:-1]] == conflicts, msg
            assert parts[-1].startswith("the operator never takes over or deletes an object it did not create")
            assert kstatus_of(es) in ("Failed", None)
        # what does not conflict is created and owned as usual
        for name in expected:
            wait_for(f"Deployment {name}", lambda n=name: ctx.apps.list_namespaced_deployment(
                NS, field_selector=f"metadata.name={n}").items, 30)
        time.sleep(5)  # retries with their back-off, resyncs: still nothing written
        after = {key: _read(ctx, o) for key, o in zip(before, foreign)}
        changed = [k for k in before if after[k] != before[k]]
        assert not changed, {k: (before[k]["metadata"], after[k]["metadata"]) for k in changed}
    finally:
        for name in expected:
            ctx.custom.delete_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, name)
    wait_for("the operator's own Deployments garbage-collected", lambda: not [
        d for d in ctx.apps.list_namespaced_deployment(NS).items if d.metadata.name in expected], 90)
    after = {key: _read(ctx, o) for key, o in zip(before, foreign)}
    assert after == before, [k for k in before if after[k] != before[k]]
    assert ctx.operator.alive()


def test_a_conflict_clears_once_the_foreign_object_is_gone(ctx, operator):
    """No event reaches the operator when a team deletes its own object (the caches hold only the operator's): the
    service is retried with its back-off and takes the name once it is free."""
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "late", "namespace": NS},
           "spec": {"selector": {"app": "theirs"}, "ports": [{"port": 80}]}}
    ctx.kube.apply([svc], namespace=NS)
    spec = json.loads(json.dumps(CPU_SPEC))
    spec.pop("litellm")
    ctx.apply_es("late", spec)
    ctx.wait_condition("late", "Stalled", "True", "OwnershipConflict", timeout=60)
    time.sleep(4)  # a few retries have passed; the back-off grows
    ctx.core.delete_namespaced_service("late", NS)
    started = time.monotonic()
    es = ctx.wait_condition("late", "Ready", "True", timeout=90)
    print(f"conflict cleared {time.monotonic() - started:.1f} s after the foreign Service was deleted")
    refs = ctx.core.read_namespaced_service("late", NS).metadata.owner_references
    assert refs[0].uid == es["metadata"]["uid"] and refs[0].controller
    ctx.custom.delete_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "late")


def test_delete_cascades(ctx, operator):
    assert ctx.deployment("minilm").metadata.owner_references[0].kind == "EmbeddingService"
    assert ctx.core.read_namespaced_service("minilm", NS)
    ctx.custom.delete_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "minilm")

    def gone():
        deps = [d.metadata.name for d in ctx.apps.list_namespaced_deployment(NS).items]
        svcs = [s.metadata.name for s in ctx.core.list_namespaced_service(NS).items]
        return "minilm" not in deps and "minilm" not in svcs
    wait_for("children garbage-collected", gone, 90)
    cm = ctx.core.read_namespaced_config_map("litellm-models", NS)
    wait_for("LiteLLM entry removed", lambda: "embedops-minilm.yaml" not in (
        ctx.core.read_namespaced_config_map("litellm-models", NS).data or {}), 30)
    assert cm is not None
    assert ctx.operator.alive()


def test_operator_works_with_only_the_charts_rbac(ctx, operator, tmp_path):
    """Install the chart's ServiceAccount + RBAC, run the operator with that account's token: every feature
    reconciles without a Forbidden error (least privilege is enough)."""

    helm = ctx.kube.helm
    if not helm:
        pytest.skip("helm not available")
    chart = REPO / "charts" / "embedops-operator"
    out = subprocess.run([helm, "template", "rbac-it", str(chart), "--namespace", NS,
                          "--set", "rbac.aggregateToDefaultRoles=false"], capture_output=True,
                         text=True, check=True).stdout
    docs = [d for d in yaml.safe_load_all(out) if d and d["kind"] in (
        "ServiceAccount", "ClusterRole", "ClusterRoleBinding")]
    # the operator's role and binding, the reviews behind /metrics and their binding, the scrapers' role
    assert sorted(d["kind"] for d in docs) == ["ClusterRole"] * 3 + ["ClusterRoleBinding"] * 2 + ["ServiceAccount"]
    ctx.kube.install_crds(OPTIONAL)  # routes, monitors and scaled objects are part of what it must reconcile
    ctx.kube.apply(docs, namespace=NS)
    sa = next(d for d in docs if d["kind"] == "ServiceAccount")["metadata"]["name"]
    from kubernetes import client
    token = ctx.core.create_namespaced_service_account_token(
        sa, NS, client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(
            audiences=[], expiration_seconds=3600))).status.token
    admin = yaml.safe_load(Path(ctx.kube.kubeconfig).read_text())
    cluster = admin["clusters"][0]
    kubeconfig = tmp_path / "operator.kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "clusters": [cluster],
        "users": [{"name": "operator", "user": {"token": token}}],
        "contexts": [{"name": "operator", "context": {"cluster": cluster["name"], "user": "operator"}}],
        "current-context": "operator"}))

    ctx.operator.stop()
    admin_kubeconfig = os.environ["KUBECONFIG"]
    os.environ["KUBECONFIG"] = str(kubeconfig)
    records: list[str] = []

    import logging

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())
    handler = Collect(level=logging.WARNING)
    logging.getLogger().addHandler(handler)
    try:
        ctx.operator = OperatorThread()
        ctx.operator.start()
        spec = json.loads(json.dumps(CPU_SPEC))
        spec["replicas"] = 2
        spec["gateway"] = {"parentRefs": [{"name": "ai-gateway"}]}
        spec["autoscaling"] = {"minReplicas": 2, "maxReplicas": 4}
        spec["apiKeySecretRef"] = {"name": "does-not-need-to-be-read"}
        ctx.apply_es("rbac", spec)
        ctx.wait_condition("rbac", "RoutesReady", "Unknown", "WaitingForGateway", timeout=90)
        ctx.wait_condition("rbac", "MonitoringReady", "True", timeout=30)
        ctx.policy.read_namespaced_pod_disruption_budget("rbac", NS)
        ctx.custom.get_namespaced_custom_object("keda.sh", "v1alpha1", NS, "scaledobjects", "rbac")
        # pruning (delete) and the LiteLLM ConfigMap under the same account
        spec.pop("autoscaling")
        spec["replicas"] = 1
        ctx.apply_es("rbac", spec)
        wait_for("PDB pruned", lambda: not [p for p in ctx.policy.list_namespaced_pod_disruption_budget(NS).items
                                            if p.metadata.name == "rbac"], 60)
        ctx.custom.delete_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "rbac")
        wait_for("LiteLLM entry removed", lambda: "embedops-rbac.yaml" not in (
            ctx.core.read_namespaced_config_map("litellm-models", NS).data or {}), 60)
        assert ctx.operator.alive()
    finally:
        logging.getLogger().removeHandler(handler)
        os.environ["KUBECONFIG"] = admin_kubeconfig
        delete_cluster_scoped(ctx.api, docs)
    forbidden = [r for r in records if "forbidden" in r.lower() or " 403" in r]
    assert not forbidden, forbidden
