"""Rendering: every accelerator kind and option, pure and deterministic."""
from __future__ import annotations

import copy
import re
import subprocess
import sys

import pytest
import yaml

from embedops_operator import render as R
from embedops_operator.spec import parse
from embedops_operator.validate import defaulted, validate
from tests.unit.operator_helpers import (CPU, EXAMPLES, GPU, MIG, REPO, arg, by_kind, container, es, example,
                                         pod_spec)

NO_OPTIONAL = R.Options(capabilities=frozenset())


def render(spec: dict, options: R.Options | None = None, **kw) -> list[dict]:
    return R.render(defaulted(es(spec, **kw)), options)


# ---------------------------------------------------------------------------------------------------- hardware

def test_mig_mixed_strategy():
    out = render(MIG)
    c, pod = container(out), pod_spec(out)
    assert c["resources"]["limits"]["nvidia.com/mig-1g.10gb"] == "1"
    assert "nvidia.com/gpu" not in c["resources"]["limits"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert c["image"] == R.Options().cuda_image
    assert arg(c, "--dtype") == "float16"
    assert "nodeSelector" not in pod  # the extended resource itself places the pod
    # a surge first (the replacement loads before an old replica stops); without a spare slice the reconciler
    # gives one up first instead (tests/unit/test_operator_surge.py)
    assert by_kind(out)["Deployment"]["spec"]["strategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    given_up = by_kind(R.render(defaulted(es(MIG)), pins=R.Pins(R.Pin(give_up_first=True))))["Deployment"]
    assert given_up["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    annotations = given_up["metadata"]["annotations"]
    assert annotations[R.ANNOTATION_SURGE_REFUSED] == annotations[R.ANNOTATION_TEMPLATE_HASH]
    assert any(v["name"] == "dshm" for v in pod["volumes"])


def test_mig_single_strategy_and_count():
    spec = copy.deepcopy(MIG)
    spec["accelerator"] = {"mig": {"product": "H200-141GB", "profile": "3g.71gb", "strategy": "single", "count": 2}}
    out = render(spec)
    c, pod = container(out), pod_spec(out)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert not any(k.startswith("nvidia.com/mig-") for k in c["resources"]["limits"])
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200-MIG-3g.71gb",
                                   "nvidia.com/mig.config": "all-3g.71gb"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"


def test_whole_gpu():
    out = render(GPU)
    c, pod = container(out), pod_spec(out)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-L4"}
    assert arg(c, "--dtype") == "float16"
    assert by_kind(out)["Deployment"]["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 1


def test_cpu_nfd_selectors_threads_and_surge():
    out = render(CPU)
    c, pod = container(out), pod_spec(out)
    assert pod["nodeSelector"] == {"feature.node.kubernetes.io/cpu-cpuid.AMXINT8": "true",
                                   "feature.node.kubernetes.io/cpu-cpuid.AVX512VNNI": "true",
                                   "kubernetes.io/arch": "amd64"}
    assert c["image"] == R.Options().cpu_image
    # ephemeral storage: the download cache (MiniLM's 91 MB of float32 weights + 25% + 1Gi: 2Gi), /tmp (2Gi) and
    # the ONNX cache (1Gi), plus 1Gi of logs in the limit
    assert c["resources"] == {"requests": {"cpu": "6", "memory": "6Gi", "ephemeral-storage": "5Gi"},
                              "limits": {"cpu": "6", "memory": "6Gi", "ephemeral-storage": "6Gi"}}
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == env["ORT_NUM_THREADS"] == "6"
    assert arg(c, "--dtype") == "float32"
    assert arg(c, "--num-threads") == "6"
    assert "--quantize" not in c["args"]
    int8 = copy.deepcopy(CPU)
    int8["model"]["quantize"] = "int8"
    assert arg(container(render(int8)), "--quantize") == "int8"
    assert "tolerations" not in pod
    assert by_kind(out)["Deployment"]["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert not any(v["name"] == "dshm" for v in pod["volumes"])


@pytest.mark.parametrize("isa,label", [("avx2", "AVX2"), ("avx512f", "AVX512F"), ("avx512_bf16", "AVX512BF16"),
                                       ("avx_vnni", "AVXVNNI"), ("amx_tile", "AMXTILE"), ("amx_bf16", "AMXBF16")])
def test_every_instruction_set_maps_to_nfd(isa, label):
    spec = copy.deepcopy(CPU)
    spec["accelerator"]["cpu"]["instructionSets"] = [isa]
    assert pod_spec(render(spec))["nodeSelector"][f"feature.node.kubernetes.io/cpu-cpuid.{label}"] == "true"


# ---------------------------------------------------------------------------------------------------- pod contract

@pytest.mark.parametrize("spec", [MIG, CPU, GPU], ids=["mig", "cpu", "gpu"])
def test_every_pod_is_hardened_probed_and_drains(spec):
    out = render(spec)
    c, pod = container(out), pod_spec(out)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
    # the API, and the metrics on a port of their own (template revision 7): the API's clients cannot read them
    assert c["ports"] == [{"name": "http", "containerPort": 8080, "protocol": "TCP"},
                          {"name": "metrics", "containerPort": R.METRICS_PORT, "protocol": "TCP"}]
    assert c["args"][c["args"].index("--prometheus-port") + 1] == str(R.METRICS_PORT)
    template = by_kind(out)["Deployment"]["spec"]["template"]
    assert template["metadata"]["annotations"] == {R.ANNOTATION_METRICS_PORT: str(R.METRICS_PORT)}
    assert c["lifecycle"]["preStop"] == {"sleep": {"seconds": 15}}
    assert pod["terminationGracePeriodSeconds"] >= 15 + 30
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
    keys = [t["topologyKey"] for t in pod["topologySpreadConstraints"]]
    assert keys == ["kubernetes.io/hostname", "topology.kubernetes.io/zone"]
    assert pod["automountServiceAccountToken"] is False
    assert c["command"] == ["embedops-server"]


def test_server_flags_follow_the_tei_contract():
    spec = copy.deepcopy(MIG)
    spec["model"].update({"revision": "abc123", "pooling": "cls", "servedModelName": "bge-m3",
                          "prompts": {"defaultPromptName": "query"}})
    spec["batching"] = {"maxBatchTokens": 32768, "maxBatchRequests": 64, "maxConcurrentRequests": 256,
                        "maxClientBatchSize": 16, "autoTruncate": False}
    spec["apiKeySecretRef"] = {"name": "key", "key": "token"}
    c = container(render(spec))
    assert arg(c, "--model-id") == "BAAI/bge-m3"
    assert arg(c, "--revision") == "abc123"
    assert arg(c, "--port") == "8080"
    assert arg(c, "--max-batch-tokens") == "32768"
    assert arg(c, "--max-batch-requests") == "64"
    assert arg(c, "--max-concurrent-requests") == "256"
    assert arg(c, "--max-client-batch-size") == "16"
    assert arg(c, "--auto-truncate") == "false"
    assert arg(c, "--pooling") == "cls"
    assert arg(c, "--served-model-name") == "bge-m3"
    assert arg(c, "--default-prompt-name") == "query"
    assert c["args"][-1] == "--json-output"
    assert arg(c, "--graceful-shutdown-timeout") == "25"
    assert "--num-threads" not in c["args"]
    api_key = next(e for e in c["env"] if e["name"] == "API_KEY")
    assert api_key["valueFrom"] == {"secretKeyRef": {"name": "key", "key": "token"}}


def test_defaults_served_name_and_no_optional_flags():
    c = container(render(MIG))
    assert arg(c, "--served-model-name") == "BAAI/bge-m3"
    assert arg(c, "--auto-truncate") == "true"
    for flag in ("--pooling", "--revision", "--max-batch-requests", "--default-prompt"):
        assert flag not in c["args"]
    assert not any(e["name"] == "API_KEY" for e in c["env"])


def test_model_from_pvc_is_read_only_and_offline():
    spec = copy.deepcopy(CPU)
    spec["model"] = {"id": "/models/all-MiniLM-L6-v2", "source": {"pvc": {"claimName": "models", "subPath": "st"}}}
    out = render(spec)
    c, pod = container(out), pod_spec(out)
    assert {"name": "models", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in pod["volumes"]
    assert {"name": "models", "mountPath": "/models", "readOnly": True, "subPath": "st"} in c["volumeMounts"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["HF_HUB_OFFLINE"] == "1" and env["HF_HOME"] == "/models"
    assert [i["name"] for i in pod["initContainers"]] == ["prepare"]  # no download from a PVC
    assert {"name": "models", "mountPath": "/models", "readOnly": True, "subPath": "st"} in \
        pod["initContainers"][0]["volumeMounts"]


def test_model_download_init_container():
    spec = copy.deepcopy(MIG)
    spec["model"] = {"id": "BAAI/bge-m3", "revision": "r1",
                     "source": {"download": {"cacheSize": "30Gi", "hfTokenSecretRef": {"name": "hf"}}}}
    out = render(spec)
    pod = pod_spec(out)
    init = pod["initContainers"][0]
    # a branch or tag, not a commit: the track's pinned commit wins once its first replica resolved one
    assert init["command"][:2] == ["sh", "-c"] and 'rev="${PINNED_REVISION:-}"; [ -n "$rev" ] || rev=r1; ' \
        'hf download BAAI/bge-m3 ${rev:+--revision "$rev"} ' in init["command"][2]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}} in init["env"]
    assert init["securityContext"]["readOnlyRootFilesystem"] is True
    assert {"name": "model-cache", "emptyDir": {"sizeLimit": "30Gi"}} in pod["volumes"]


def test_pod_overrides():
    spec = copy.deepcopy(CPU)
    spec.update({
        "image": "registry.local/embedops-server:dev", "imagePullPolicy": "Always",
        "resources": {"limits": {"memory": "12Gi"}},
        "env": [{"name": "OMP_NUM_THREADS", "value": "3"}, {"name": "LOG_LEVEL", "value": "debug"}],
        "nodeSelector": {"pool": "ingest"},
        "tolerations": [{"key": "batch", "operator": "Exists"}],
        "affinity": {"nodeAffinity": {}}, "priorityClassName": "batch-low",
        "podAnnotations": {"a": "b"}, "serviceAccountName": "emb", "imagePullSecrets": [{"name": "pull"}],
        "drainSeconds": 40,
    })
    out = render(spec)
    c, pod = container(out), pod_spec(out)
    assert c["image"] == "registry.local/embedops-server:dev" and c["imagePullPolicy"] == "Always"
    assert c["resources"]["limits"] == {"cpu": "6", "memory": "12Gi", "ephemeral-storage": "6Gi"}
    env = [(e["name"], e.get("value")) for e in c["env"]]
    assert ("OMP_NUM_THREADS", "3") in env and ("OMP_NUM_THREADS", "6") not in env and ("LOG_LEVEL", "debug") in env
    assert pod["nodeSelector"]["pool"] == "ingest"
    assert pod["tolerations"] == [{"key": "batch", "operator": "Exists"}]
    assert pod["affinity"] == {"nodeAffinity": {}} and pod["priorityClassName"] == "batch-low"
    assert pod["serviceAccountName"] == "emb" and pod["imagePullSecrets"] == [{"name": "pull"}]
    assert by_kind(out)["Deployment"]["spec"]["template"]["metadata"]["annotations"] == {
        "a": "b", R.ANNOTATION_METRICS_PORT: str(R.METRICS_PORT)}
    assert c["lifecycle"]["preStop"]["sleep"]["seconds"] == 40 and pod["terminationGracePeriodSeconds"] == 70


# ---------------------------------------------------------------------------------------------------- children

def test_children_labels_owner_and_service():
    out = render(MIG, uid="u-1")
    kinds = [m["kind"] for m in out]
    assert kinds == ["Deployment", "Service", "ServiceMonitor"]
    for m in out:
        assert m["metadata"]["namespace"] == "ml"
        assert m["metadata"]["ownerReferences"] == [{
            "apiVersion": "embedops.dev/v1alpha1", "kind": "EmbeddingService", "name": "svc", "uid": "u-1",
            "controller": True, "blockOwnerDeletion": True}]
        assert m["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "embedops"
        assert len(m["metadata"]["annotations"][R.ANNOTATION_HASH]) == 16
    svc = by_kind(out)["Service"]
    assert svc["spec"]["ports"] == [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP",
                                     "appProtocol": "http"}]
    assert svc["spec"]["selector"] == by_kind(out)["Deployment"]["spec"]["selector"]["matchLabels"]
    assert by_kind(out)["Deployment"]["spec"]["replicas"] == 1
    assert "ownerReferences" not in render(MIG)[0]["metadata"]  # offline render: no uid


def test_service_monitor_options():
    spec = copy.deepcopy(MIG)
    spec["monitoring"] = {"serviceMonitor": {"interval": "15s", "labels": {"release": "kps"}}}
    sm = by_kind(render(spec))["ServiceMonitor"]
    assert sm["metadata"]["labels"]["release"] == "kps"
    (endpoint,) = sm["spec"]["endpoints"]
    assert {k: endpoint[k] for k in ("port", "path", "interval")} == {"port": "http", "path": "/metrics",
                                                                      "interval": "15s"}
    to_port, service_label = endpoint["relabelings"]
    assert service_label == {"action": "replace", "targetLabel": "service", "replacement": "svc"}
    # Prometheus' replace (an anchored regex over the source labels joined by ";"): a pod that names its metrics
    # port in the annotation is scraped there, IPv6 too; an older pod (no annotation) on the API's port
    assert to_port["sourceLabels"] == ["__address__", "__meta_kubernetes_pod_annotation_embedops_dev_metrics_port"]
    assert to_port["targetLabel"] == "__address__" and to_port["action"] == "replace"

    def scraped(address: str, annotation: str) -> str:
        m = re.fullmatch(to_port["regex"], f"{address};{annotation}")
        return re.sub(r"\$(\d)", lambda g: m.group(int(g.group(1))), to_port["replacement"]) if m else address
    assert scraped("10.1.2.3:8080", "9000") == "10.1.2.3:9000"
    assert scraped("[fd00::12]:8080", "9000") == "[fd00::12]:9000"
    assert scraped("10.1.2.3:8080", "") == "10.1.2.3:8080"
    assert sm["spec"]["namespaceSelector"] == {"matchNames": ["ml"]}
    spec["monitoring"]["serviceMonitor"]["enabled"] = False
    assert "ServiceMonitor" not in by_kind(render(spec))
    assert "ServiceMonitor" not in by_kind(render(MIG, NO_OPTIONAL))


def test_missing_capabilities():
    spec = copy.deepcopy(MIG)
    spec["gateway"] = {"parentRefs": [{"name": "gw"}]}
    spec["autoscaling"] = {"maxReplicas": 3, "provider": "keda"}
    parsed = parse(defaulted(es(spec))).spec
    assert R.missing_capabilities(parsed, NO_OPTIONAL) == {"monitoring": "ServiceMonitor", "routes": "HTTPRoute",
                                                           "autoscaling": "ScaledObject"}
    assert R.missing_capabilities(parsed, R.Options()) == {}


@pytest.mark.parametrize("task,paths", [
    ("embed", ["/v1/embeddings", "/embed", "/v2/embed", "/v1/models"]), ("rerank", ["/rerank", "/v1/rerank"]),
    ("sparse", ["/embed_sparse", "/embed"]), ("classify", ["/predict"])])
def test_http_route_paths_by_task(task, paths):
    spec = copy.deepcopy(MIG)
    spec["model"]["task"] = task
    spec["gateway"] = {"parentRefs": [{"name": "gw", "namespace": "gateway-system", "sectionName": "https"}],
                       "hostnames": ["ai.example.com"]}
    route = by_kind(render(spec))["HTTPRoute"]
    assert route["spec"]["parentRefs"] == [{"name": "gw", "namespace": "gateway-system", "sectionName": "https"}]
    assert route["spec"]["hostnames"] == ["ai.example.com"]
    assert [r["matches"][0]["path"]["value"] for r in route["spec"]["rules"]] == paths
    assert all(r["backendRefs"] == [{"name": "svc", "port": 80}] for r in route["spec"]["rules"])


def test_http_route_prefix_is_rewritten():
    spec = copy.deepcopy(MIG)
    spec["gateway"] = {"parentRefs": [{"name": "gw"}], "pathPrefix": "/bge"}
    rules = by_kind(render(spec))["HTTPRoute"]["spec"]["rules"]
    assert rules[0]["matches"][0]["path"] == {"type": "PathPrefix", "value": "/bge/v1/embeddings"}
    assert rules[0]["filters"][0]["urlRewrite"]["path"] == {"type": "ReplacePrefixMatch",
                                                            "replacePrefixMatch": "/v1/embeddings"}
    assert rules[1]["filters"][0]["urlRewrite"]["path"] == {"type": "ReplaceFullPath", "replaceFullPath": "/embed"}
    assert "HTTPRoute" not in by_kind(render(spec, NO_OPTIONAL))


def test_autoscaling_keda_leaves_replicas_to_the_autoscaler():
    spec = copy.deepcopy(MIG)
    spec["autoscaling"] = {"minReplicas": 0, "maxReplicas": 5, "targetQueueDepth": 24}
    out = by_kind(render(spec, name="bge"))
    assert "replicas" not in out["Deployment"]["spec"]
    so = out["ScaledObject"]
    assert so["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "bge"}
    assert (so["spec"]["minReplicaCount"], so["spec"]["maxReplicaCount"]) == (0, 5)
    trig = so["spec"]["triggers"][0]
    assert trig["type"] == "prometheus" and trig["metadata"]["threshold"] == "24"
    assert trig["metadata"]["query"] == 'sum(te_queue_size{namespace="ml",service="bge"})'
    assert "HorizontalPodAutoscaler" not in out
    assert out["PodDisruptionBudget"]["spec"]["maxUnavailable"] == 1  # up to 5 replicas: drained one at a time
    # cooldownSeconds governs scaling down to the minimum too, not only the step to zero
    assert so["spec"]["cooldownPeriod"] == 300
    assert so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"] == {
        "stabilizationWindowSeconds": 300}


def test_scale_to_zero_puts_the_activator_at_the_services_address():
    spec = copy.deepcopy(CPU)
    spec.pop("replicas", None)
    spec["nodeSelector"] = {"pool": "cpu"}
    spec["autoscaling"] = {"minReplicas": 0, "maxReplicas": 3, "cooldownSeconds": 60, "activationTimeoutSeconds": 120}
    spec["monitoring"] = {"serviceMonitor": {"labels": {"release": "kps"}}}
    spec["gateway"] = {"parentRefs": [{"name": "gw"}]}
    spec["litellm"] = {"configMapName": "litellm"}
    out = render(spec, name="emb", namespace="ml")
    named = {(m["kind"], m["metadata"]["name"]): m for m in out}
    front, backend = named[("Service", "emb")], named[("Service", "emb-backend")]
    model, act = named[("Deployment", "emb")], named[("Deployment", "emb-activator")]
    # the address clients, the HTTPRoute and LiteLLM use is answered by the activator's pod
    assert front["spec"]["selector"] == act["spec"]["selector"]["matchLabels"]
    assert act["spec"]["template"]["metadata"]["labels"] | front["spec"]["selector"] == \
        act["spec"]["template"]["metadata"]["labels"]
    assert front["spec"]["selector"] == {"app.kubernetes.io/name": "embedops-activator",
                                         "app.kubernetes.io/instance": "emb"}
    # the admin port (/demand, /metrics) only on a ClusterIP Service of its own: a LoadBalancer never publishes it
    assert [p["name"] for p in front["spec"]["ports"]] == ["http"]
    admin = named[("Service", "emb-activator")]
    assert admin["spec"]["type"] == "ClusterIP" and [p["name"] for p in admin["spec"]["ports"]] == ["admin"]
    assert admin["spec"]["selector"] == front["spec"]["selector"]
    # two replicas, spread, kept by a PDB, bounded in memory
    assert act["spec"]["replicas"] == 2 and named[("PodDisruptionBudget", "emb-activator")]["spec"][
        "selector"]["matchLabels"] == front["spec"]["selector"]
    assert act["spec"]["template"]["spec"]["topologySpreadConstraints"][0]["topologyKey"] == "kubernetes.io/hostname"
    assert backend["spec"]["selector"] == model["spec"]["selector"]["matchLabels"] == R.selector_labels("emb")
    route = named[("HTTPRoute", "emb")]
    assert {b["name"] for r in route["spec"]["rules"] for b in r["backendRefs"]} == {"emb"}
    assert "http://emb.ml.svc.cluster.local/v1" in named[("ConfigMap", "litellm")]["data"]["embedops-emb.yaml"]
    # the ServiceMonitor selects the model pods' Service only, and keeps service="emb" on the series
    sm = named[("ServiceMonitor", "emb")]
    sel = sm["spec"]["selector"]["matchLabels"]
    assert all(backend["metadata"]["labels"].get(k) == v for k, v in sel.items())
    assert not all(front["metadata"]["labels"].get(k) == v for k, v in sel.items())
    assert sm["spec"]["endpoints"][0]["relabelings"][-1] == {
        "action": "replace", "targetLabel": "service", "replacement": "emb"}
    # the same ServiceMonitor with or without the activator: switching to zero leaves Prometheus' config alone
    spec["autoscaling"]["minReplicas"] = 1
    assert by_kind(render(spec, name="emb", namespace="ml"))["ServiceMonitor"] == sm
    # the activator: the server image's second program, pointed at the backend, the spec's placement
    c = act["spec"]["template"]["spec"]["containers"][0]
    assert c["command"] == ["embedops-activator"] and c["image"] == R.Options().cpu_image
    assert arg(c, "--backend") == "http://emb-backend.ml.svc.cluster.local"
    assert arg(c, "--activation-timeout") == "120"
    assert act["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "cpu"}
    assert "resources" in c and "limits" in c["resources"]
    # KEDA wakes the Deployment on the activator's demand; the queue still scales above one replica
    so = named[("ScaledObject", "emb")]
    assert so["spec"]["minReplicaCount"] == 0 and so["spec"]["pollingInterval"] == R.ZERO_POLLING_SECONDS
    kinds = [t["type"] for t in so["spec"]["triggers"]]
    assert kinds == ["prometheus", "metrics-api"]
    demand = so["spec"]["triggers"][1]["metadata"]
    assert demand["url"] == "http://emb-activator.ml.svc.cluster.local:9091/demand" and demand["valueLocation"] == "demand"
    assert demand["activationTargetValue"] == "0"
    assert arg(c, "--activity-window") == str(2 * so["spec"]["pollingInterval"])
    assert all(m["metadata"]["namespace"] == "ml" for m in out)


def test_scale_to_zero_only_where_keda_wakes_it():
    spec = copy.deepcopy(CPU)
    spec.pop("replicas", None)
    spec["autoscaling"] = {"minReplicas": 1, "maxReplicas": 3}
    names = [(m["kind"], m["metadata"]["name"]) for m in render(spec, name="emb")]
    assert ("Deployment", "emb-activator") not in names and ("Service", "emb") in names
    so = by_kind(render(spec, name="emb"))["ScaledObject"]
    assert [t["type"] for t in so["spec"]["triggers"]] == ["prometheus"] and so["spec"]["pollingInterval"] == 15
    spec["autoscaling"]["minReplicas"] = 0  # without KEDA's CRD: no activator, the status says KEDA is missing
    names = [(m["kind"], m["metadata"]["name"]) for m in render(spec, NO_OPTIONAL, name="emb")]
    assert ("Deployment", "emb-activator") not in names and ("Service", "emb-backend") not in names
    # a GPU service's activator takes no accelerator, no GPU placement and the CPU image
    gpu = copy.deepcopy(MIG)
    gpu["autoscaling"] = {"minReplicas": 0, "maxReplicas": 2}
    act = {(m["kind"], m["metadata"]["name"]): m for m in render(gpu, name="bge")}[("Deployment", "bge-activator")]
    pod = act["spec"]["template"]["spec"]
    assert "nodeSelector" not in pod and "tolerations" not in pod
    assert pod["containers"][0]["image"] == R.Options().cpu_image
    assert "nvidia.com" not in str(pod["containers"][0]["resources"])


def test_autoscaling_falls_back_to_hpa_without_keda():
    spec = copy.deepcopy(MIG)
    spec["autoscaling"] = {"minReplicas": 2, "maxReplicas": 5}
    out = by_kind(render(spec, NO_OPTIONAL))
    assert "replicas" not in out["Deployment"]["spec"] and "ScaledObject" not in out
    hpa = out["HorizontalPodAutoscaler"]
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 5)
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "te_queue_size"
    assert out["PodDisruptionBudget"]["spec"]["maxUnavailable"] == 1  # min 2 → PDB
    spec["autoscaling"]["provider"] = "hpa"
    assert "HorizontalPodAutoscaler" in by_kind(render(spec))  # forced even with KEDA present


@pytest.mark.parametrize("replicas,expected", [(0, False), (1, False), (2, True), (5, True)])
def test_pdb_only_with_more_than_one_replica(replicas, expected):
    spec = copy.deepcopy(CPU)
    spec["replicas"] = replicas
    out = by_kind(render(spec))
    assert ("PodDisruptionBudget" in out) is expected
    assert out["Deployment"]["spec"]["replicas"] == replicas


@pytest.mark.parametrize("low,high,expected", [(1, 1, False), (1, 6, True), (0, 2, True), (2, 4, True)])
def test_pdb_whenever_the_autoscaler_can_run_more_than_one(low, high, expected):
    spec = copy.deepcopy(CPU)
    spec["autoscaling"] = {"minReplicas": low, "maxReplicas": high}
    assert ("PodDisruptionBudget" in by_kind(render(spec))) is expected


def test_litellm_entries():
    spec = copy.deepcopy(MIG)
    spec["litellm"] = {"configMapName": "litellm"}
    spec["apiKeySecretRef"] = {"name": "k"}
    cm = by_kind(render(spec, name="bge-m3", namespace="search"))["ConfigMap"]
    assert cm["metadata"] == {"name": "litellm", "namespace": "search",  # shared: no owner, no hash
                              "labels": {"embedops.dev/litellm": "true"}}  # found by the stale-entry sweep
    cfg = yaml.safe_load(cm["data"]["embedops-bge-m3.yaml"])
    assert cfg["model_list"] == [{"model_name": "BAAI/bge-m3", "litellm_params": {
        "model": "openai/BAAI/bge-m3", "api_base": "http://bge-m3.search.svc.cluster.local/v1",
        "api_key": "os.environ/EMBEDOPS_BGE_M3_API_KEY"}, "model_info": {"mode": "embedding"}}]
    spec["model"]["task"] = "rerank"
    spec["litellm"]["modelName"] = "reranker"
    spec["service"] = {"port": 8080}
    spec.pop("apiKeySecretRef")
    cm = by_kind(render(spec, name="rr", namespace="search"))["ConfigMap"]
    cfg = yaml.safe_load(cm["data"]["embedops-rr.yaml"])["model_list"][0]
    assert cfg == {"model_name": "reranker", "litellm_params": {
        "model": "huggingface/BAAI/bge-m3", "api_base": "http://rr.search.svc.cluster.local:8080",
        "api_key": "none"}, "model_info": {"mode": "rerank"}}


@pytest.mark.parametrize("model_id,task", [("BAAI/bge-m3", "embed"), ("BAAI/bge-reranker-v2-m3", "rerank"),
                                           ("cross-encoder/ms-marco-MiniLM-L-6-v2", "rerank"),
                                           ("naver/splade-cocondenser", "sparse")])
def test_task_detection(model_id, task):
    from embedops_operator import spec as S
    assert R.detect_task(S.ModelSpec(id=model_id)) == task


def test_endpoints():
    spec = copy.deepcopy(MIG)
    spec["gateway"] = {"parentRefs": [{"name": "gw"}], "hostnames": ["ai.example.com"], "pathPrefix": "/m"}
    from embedops_operator import spec as S
    parsed = S.parse(defaulted(es(spec))).spec
    assert R.endpoints("svc", "ml", parsed, R.Options()) == {
        "service": "http://svc.ml.svc.cluster.local", "openai": "http://svc.ml.svc.cluster.local/v1",
        "external": "https://ai.example.com/m"}


def test_render_is_pure_and_deterministic():
    res = defaulted(es(MIG, uid="u"))
    before = copy.deepcopy(res)
    assert R.render(res) == R.render(res)
    assert res == before  # input untouched
    # defaults applied by the API server or by pydantic render identically
    assert R.render(es(MIG, uid="u")) == R.render(res)


# ---------------------------------------------------------------------------------------------------- examples / CLI

EXAMPLE_FILES = ["mig-embedder.yaml", "mig-reranker.yaml", "cpu-ingestion.yaml", "bge-m3-cpu-ingestion.yaml"]


@pytest.mark.parametrize("name", EXAMPLE_FILES)
def test_examples_validate_and_render(name):
    doc = example(name)
    assert validate(doc) == []
    out = R.render(defaulted(doc))
    assert out[0]["kind"] == "Deployment"


def test_example_kinds():
    emb = by_kind(R.render(example("mig-embedder.yaml")))
    assert "ScaledObject" in emb and "HTTPRoute" in emb and "ConfigMap" in emb
    assert arg(emb["Deployment"]["spec"]["template"]["spec"]["containers"][0], "--outputs") == "dense,sparse,colbert"
    assert "/embed_hybrid" in [r["matches"][0]["path"]["value"] for r in emb["HTTPRoute"]["spec"]["rules"]]
    rr = by_kind(R.render(example("mig-reranker.yaml")))
    assert rr["Deployment"]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"][
        "nvidia.com/mig-1g.18gb"] == "1"
    assert "PodDisruptionBudget" in rr
    cpu = by_kind(R.render(example("cpu-ingestion.yaml")))
    c = cpu["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert arg(c, "--model-id") == "/models/all-MiniLM-L6-v2"
    # every example ships with its NetworkPolicy (kube-score's pod-networkpolicy CRITICAL, issue 35)
    for f in ("mig-embedder.yaml", "mig-reranker.yaml", "cpu-ingestion.yaml", "bge-m3-cpu-ingestion.yaml"):
        assert "NetworkPolicy" in by_kind(R.render(example(f))), f


def test_kustomization_and_flux_examples():
    kust = yaml.safe_load((EXAMPLES / "kustomization.yaml").read_text())
    assert sorted(kust["resources"]) == sorted(EXAMPLE_FILES)
    docs = list(yaml.safe_load_all((EXAMPLES / "flux" / "kustomizations.yaml").read_text()))
    services = next(d for d in docs if d["metadata"]["name"] == "embedding-services")
    assert services["spec"]["wait"] is True and services["spec"]["path"] == "./examples"
    assert {h["name"] for h in services["spec"]["healthChecks"]} == {"bge-m3", "bge-reranker", "minilm-ingest", "bge-m3-ingest"}
    assert services["spec"]["dependsOn"] == [{"name": "embedops-operator"}]
    src = yaml.safe_load((EXAMPLES / "flux" / "gitrepository.yaml").read_text())
    assert src["kind"] == "GitRepository"


def _cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "embedops_operator.cli", *args], input=stdin, capture_output=True,
                          text=True, cwd=REPO, env={"PYTHONPATH": str(REPO / "operator")})


def test_cli_render_prints_what_would_be_applied():
    res = _cli("render", "-f", str(EXAMPLES / "cpu-ingestion.yaml"), "-n", "search")
    assert res.returncode == 0, res.stderr
    docs = [d for d in yaml.safe_load_all(res.stdout) if d]
    doc = example("cpu-ingestion.yaml")
    doc["metadata"]["namespace"] = "search"
    assert docs == R.render(doc)
    res = _cli("render", "-f", "-", "--without", "ServiceMonitor", stdin=(EXAMPLES / "cpu-ingestion.yaml").read_text())
    assert [d["kind"] for d in yaml.safe_load_all(res.stdout) if d] == ["Deployment", "NetworkPolicy", "Service"]


def test_cli_render_refuses_invalid_manifest():
    bad = es(MIG)
    bad["spec"]["accelerator"] = {"mig": {"profile": "1g.10gb"}, "cpu": {}}
    res = _cli("render", "-f", "-", stdin=yaml.safe_dump(bad))
    assert res.returncode == 1
    assert "accelerator: set exactly one of mig, gpu or cpu" in res.stderr
    assert res.stdout == ""


@pytest.mark.parametrize("name", EXAMPLE_FILES)
def test_rendered_container_parses_with_the_server_cli(name):
    """The contract with embedops-server: every rendered flag and env value is accepted by its parser."""
    server_cli = pytest.importorskip("embedops_server.cli")
    c = container(R.render(example(name)))
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    env["API_KEY"] = "secret"  # from the Secret at runtime
    settings = server_cli.parse_args(c["args"], environ=env)
    assert settings.port == 8080 and settings.hostname == "0.0.0.0" and settings.json_output is True
    assert settings.model_id == arg(c, "--model-id")
    assert settings.max_batch_tokens == int(arg(c, "--max-batch-tokens"))


FAKE_HF = """#!/usr/bin/env python3
# `hf download REPO [--revision R] --include P ...`: copies the matching files of $FAKE_REPO into the hub cache
import fnmatch, os, shutil, sys
args = sys.argv[2:]
repo, pats, i = args[0], [], 1
while i < len(args):
    if args[i] == "--include":
        pats.append(args[i + 1])
    i += 2
open(os.environ["FAKE_LOG"], "a").write(" ".join(pats) + "\\n")
src = os.environ["FAKE_REPO"]
snap = os.path.join(os.environ["HF_HUB_CACHE"], "models--" + repo.replace("/", "--"), "snapshots", "abc123")
for root, _, files in os.walk(src):
    for f in files:
        rel = os.path.relpath(os.path.join(root, f), src)
        if any(fnmatch.fnmatch(rel, p) for p in pats):
            os.makedirs(os.path.dirname(os.path.join(snap, rel)), exist_ok=True)
            shutil.copy(os.path.join(src, rel), os.path.join(snap, rel))
print("path:", snap)
"""


@pytest.mark.parametrize("accel, repo_files, want, calls", [
    # CPU (ONNX Runtime): the graph and its data, never the torch weights twice
    ({"cpu": {"cores": 2}}, ["onnx/model.onnx", "onnx/model.onnx_data", "model.safetensors", "pytorch_model.bin"],
     {"onnx/model.onnx", "onnx/model.onnx_data"}, 1),
    # CPU, a repository without ONNX: the safetensors the prepare step exports from
    ({"cpu": {"cores": 2}}, ["model.safetensors", "pytorch_model.bin"], {"model.safetensors"}, 2),
    # GPU (torch): safetensors, no ONNX
    ({"mig": {"profile": "1g.10gb"}}, ["onnx/model.onnx", "onnx/model.onnx_data", "model.safetensors"],
     {"model.safetensors"}, 1),
    # GPU, only .bin weights (BAAI/bge-m3 has pytorch_model.bin)
    ({"mig": {"profile": "1g.10gb"}}, ["onnx/model.onnx", "pytorch_model.bin"], {"pytorch_model.bin"}, 2),
], ids=["cpu-onnx", "cpu-export", "gpu-safetensors", "gpu-bin"])
def test_download_fetches_only_what_the_backend_loads(tmp_path, accel, repo_files, want, calls):
    import os

    from embedops_operator.render import download_script
    from embedops_operator.spec import parse

    repo = tmp_path / "repo"
    for f in ["config.json", "tokenizer.json", "modules.json", "1_Pooling/config.json", "sparse_linear.pt",
              "colbert_linear.pt", "README.md", *repo_files]:
        (repo / f).parent.mkdir(parents=True, exist_ok=True)
        (repo / f).write_text(f)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "hf").write_text(FAKE_HF)
    (bin_dir / "hf").chmod(0o755)
    hub, log = tmp_path / "hub", tmp_path / "calls"
    doc = {"apiVersion": "embedops.dev/v1alpha1", "kind": "EmbeddingService", "metadata": {"name": "m3"},
           "spec": {"model": {"id": "BAAI/bge-m3", "source": {"download": {}}}, "accelerator": accel}}
    script = download_script(parse(doc).spec, hub=str(hub))
    r = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "HF_HUB_CACHE": str(hub),
                            "FAKE_REPO": str(repo), "FAKE_LOG": str(log)})
    assert r.returncode == 0, r.stderr
    snap = hub / "models--BAAI--bge-m3" / "snapshots" / "abc123"
    got = {str(p.relative_to(snap)) for p in snap.rglob("*") if p.is_file()}
    weights = {f for f in got if f.endswith((".onnx", ".onnx_data", ".safetensors", ".bin"))}
    assert weights == want
    assert {"config.json", "tokenizer.json", "1_Pooling/config.json", "sparse_linear.pt", "colbert_linear.pt"} <= got
    assert "README.md" not in got
    assert len(log.read_text().splitlines()) == calls


def test_every_container_requests_the_disk_its_volumes_may_fill():
    """Issue 35: the download cache, the ONNX cache and /tmp are emptyDirs on the node's disk; without a request
    the scheduler never plans for them and nodes meet DiskPressure evictions. Memory-backed /dev/shm is not disk;
    a PVC-backed model needs no download cache; a value from spec.resources stays."""
    spec = copy.deepcopy(MIG)
    spec["model"]["source"] = {"download": {"cacheSize": "30Gi"}}
    pod = pod_spec(render(spec))
    assert R.model_cache_size(R.parse_resource(defaulted(es(MIG))).spec) == "4Gi"  # bge-m3: 2.27 GB float32 x 1.25 + 1Gi
    sizes = {v["name"]: v["emptyDir"]["sizeLimit"] for v in pod["volumes"] if "emptyDir" in v}
    assert sizes["model-cache"] == "30Gi" and sizes["tmp"] == "2Gi" and sizes["dshm"] == "1Gi"
    onnx = int(sizes["onnx-cache"][:-2])
    for c in pod["containers"] + pod["initContainers"]:
        assert c["resources"]["requests"]["ephemeral-storage"] == f"{32 + onnx}Gi", c["name"]
        assert c["resources"]["limits"]["ephemeral-storage"] == f"{33 + onnx}Gi", c["name"]
    pvc = copy.deepcopy(CPU)
    pvc["model"]["source"] = {"pvc": {"claimName": "models"}}
    pvc["resources"] = {"limits": {"ephemeral-storage": "50Gi"}}
    c = container(render(pvc))
    assert c["resources"]["requests"]["ephemeral-storage"] == "3Gi"  # /tmp and the ONNX cache
    assert c["resources"]["limits"]["ephemeral-storage"] == "50Gi"


def test_the_prepare_step_gets_no_api_key():
    spec = copy.deepcopy(CPU)
    spec["apiKeySecretRef"] = {"name": "key"}
    pod = pod_spec(render(spec))
    names = lambda c: [e["name"] for e in c["env"]]  # noqa: E731
    assert "API_KEY" in names(pod["containers"][0])
    assert "API_KEY" not in names(next(c for c in pod["initContainers"] if c["name"] == "prepare"))


def test_the_download_script_quotes_what_comes_from_the_manifest():
    spec = R.parse_resource(defaulted(es({**CPU, "model": {"id": "acme/enc.v2", "revision": "main",
                                                            "source": {"download": {}}}})))
    script = R.download_script(spec.spec)
    assert "/models/hub/models--acme--enc.v2/snapshots/*/onnx/model.onnx" in script
    odd = spec.spec.model_copy(update={"model": spec.spec.model.model_copy(update={"id": "/odd path/m"})})
    assert "'/models/hub/models----odd path--m'/snapshots/*/" in R.download_script(odd)


def test_each_space_has_its_own_routes_on_the_gateway_during_a_migration():
    """Issue 36: besides its Service and LiteLLM alias, each running space answers on the service's gateway under
    <pathPrefix>/spaces/<key>, routed to its own Service; the service's own routes are unchanged."""
    spec = copy.deepcopy(CPU)
    spec["gateway"] = {"parentRefs": [{"name": "gw", "namespace": "edge"}], "hostnames": ["emb.example.com"],
                       "pathPrefix": "/emb", "allowUnauthenticated": True}
    tracks = R.Tracks(spec="svc-bbbbbbbb", serving="svc", spaces=(("aaaaaaaa", "svc"), ("bbbbbbbb", "svc-bbbbbbbb")))
    out = R.render(defaulted(es(spec, uid="u")), R.Options(), tracks=tracks)
    routes = {m["metadata"]["name"]: m for m in out if m["kind"] == "HTTPRoute"}
    assert sorted(routes) == ["svc", "svc-aaaaaaaa", "svc-bbbbbbbb"]
    own = routes["svc"]["spec"]
    assert {r["backendRefs"][0]["name"] for r in own["rules"]} == {"svc"}
    space = routes["svc-bbbbbbbb"]
    assert space["metadata"]["labels"][R.LABEL_SPACE] == "bbbbbbbb"
    assert space["metadata"]["ownerReferences"][0]["uid"] == "u"  # pruned with the migration's end
    assert space["spec"]["parentRefs"] == own["parentRefs"] and space["spec"]["hostnames"] == ["emb.example.com"]
    embed = next(r for r in space["spec"]["rules"] if r["matches"][0]["path"]["value"].endswith("/embed"))
    assert embed["matches"][0]["path"] == {"type": "Exact", "value": "/emb/spaces/bbbbbbbb/embed"}
    assert embed["filters"] == [{"type": "URLRewrite", "urlRewrite": {"path": {"type": "ReplaceFullPath",
                                                                               "replaceFullPath": "/embed"}}}]
    assert {r["backendRefs"][0]["name"] for r in space["spec"]["rules"]} == {"svc-bbbbbbbb"}
    assert R.space_gateway_path(R.parse_resource(defaulted(es(spec))).spec, "bbbbbbbb") == "/emb/spaces/bbbbbbbb"
    # no migration: no space routes
    assert [m["metadata"]["name"] for m in R.render(defaulted(es(spec)), R.Options()) if m["kind"] == "HTTPRoute"] == ["svc"]


def test_every_replica_of_a_hub_model_reads_the_commit_its_first_replica_resolved(tmp_path):
    """Issue 52: with model.revision unset (or a branch), each new pod resolved the branch when it started, so after
    an upstream commit one address answered from two spaces. From template revision 5 the download step, the
    prepare step and the server read PINNED_REVISION from the track's ConfigMap (optional: absent until the first
    replica resolved one). The download script is run here with a stand-in `hf` that records its arguments."""
    import subprocess

    spec = copy.deepcopy(CPU)
    spec["model"] = {"id": "BAAI/bge-m3", "source": {"download": {}}}
    pod = pod_spec(render(spec))
    ref = {"name": "PINNED_REVISION", "valueFrom": {"configMapKeyRef": {"name": "svc-model-commit", "key": "commit",
                                                                         "optional": True}}}
    for c in pod["initContainers"] + pod["containers"]:
        assert ref in c["env"], c["name"]
    script = pod["initContainers"][0]["command"][2]
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "hf").write_text('#!/bin/sh\necho "$@" >> "$CALLS"\n')
    (fake / "hf").chmod(0o755)

    def run(env):
        calls = tmp_path / "calls"
        calls.unlink(missing_ok=True)
        subprocess.run(["sh", "-c", script], check=True, env={"PATH": f"{fake}:/usr/bin:/bin", "CALLS": str(calls),
                                                               **env})
        return calls.read_text().splitlines()[0]
    assert run({}).startswith("download BAAI/bge-m3 --include")  # nothing pinned yet: what the hub's main names
    assert run({"PINNED_REVISION": "a" * 40}).startswith(f"download BAAI/bge-m3 --revision {'a' * 40} --include")
    # a commit in the spec, or a local folder: nothing to pin
    for model in ({"id": "BAAI/bge-m3", "revision": "b" * 40, "source": {"download": {}}}, {"id": "/models/m"}):
        spec["model"] = model
        pod = pod_spec(render(spec))
        assert not [e for c in pod.get("initContainers", []) + pod["containers"] for e in c["env"]
                    if e["name"] == "PINNED_REVISION"], model


def test_embed_all_reaches_the_gateway_only_when_the_manifest_asks():
    """Issue 53: /embed_all answers tokens x width floats (a 32 x 8192-token bge-m3 request: ~1 GiB of float32
    before JSON); published on the gateway by default, a small request from outside could hold that much of a
    replica's memory. It stays on the service's own address; gateway.embedAll routes it."""
    spec = copy.deepcopy(MIG)
    spec["gateway"] = {"parentRefs": [{"name": "gw"}], "embedAll": True}
    route = by_kind(render(spec))["HTTPRoute"]
    assert "/embed_all" in [r["matches"][0]["path"]["value"] for r in route["spec"]["rules"]]


def test_tracing_renders_tei_flags_and_the_sdks_variables_and_keeps_the_space():
    """spec.tracing (issue 54): the server's --otlp-endpoint and --otlp-service-name (the service's name unless
    set), the protocol and the sampler as the OpenTelemetry SDK's variables; the operator's default endpoint for
    services without one; nothing rendered without tracing, so no other pod changes; the space stays."""
    from embedops_operator import spaces
    from embedops_server.cli import parse_args

    deployment = lambda out: by_kind(out)["Deployment"]  # noqa: E731
    plain = container(render(CPU))
    assert not [a for a in plain["args"] if a.startswith("--otlp")]
    traced = copy.deepcopy(CPU)
    traced["tracing"] = {"endpoint": "http://otel-collector.observability:4318", "protocol": "http/protobuf",
                         "sampleRatio": 0.25}
    c = container(render(traced))
    assert arg(c, "--otlp-endpoint") == "http://otel-collector.observability:4318"
    assert arg(c, "--otlp-service-name") == "svc"
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "http/protobuf"
    assert env["OTEL_TRACES_SAMPLER"] == "parentbased_traceidratio" and env["OTEL_TRACES_SAMPLER_ARG"] == "0.25"
    parse_args(c["args"][c["args"].index("--otlp-endpoint"):] + ["--model-id", "x"], environ={})  # the server's
    assert spaces.key_of(spaces.declaration(deployment(render(CPU)))) == \
        spaces.key_of(spaces.declaration(deployment(render(traced))))
    by_default = container(render(CPU, R.Options(tracing_endpoint="http://otel:4317")))
    assert arg(by_default, "--otlp-endpoint") == "http://otel:4317" and arg(by_default, "--otlp-service-name") == "svc"
    assert "OTEL_EXPORTER_OTLP_PROTOCOL" not in {e["name"] for e in by_default["env"]}
    own = copy.deepcopy(traced)
    own["tracing"] = {"endpoint": "http://mine:4317", "serviceName": "rag-embedder"}
    c = container(render(own, R.Options(tracing_endpoint="http://otel:4317")))
    assert arg(c, "--otlp-endpoint") == "http://mine:4317" and arg(c, "--otlp-service-name") == "rag-embedder"
    for bad in ("otel:4317", "http://otel:4317; rm -rf /", "ftp://otel"):
        with pytest.raises(Exception):
            parse({**CPU, "tracing": {"endpoint": bad}})
