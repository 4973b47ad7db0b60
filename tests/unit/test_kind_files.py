"""The files `make e2e-kind` reads (issue 40; docs/kind.md), checked without building or starting anything:
the pod network manifest the node image ships, kind-config.yaml's shared folder and what kind.sh puts there,
and the node image's containerd setting this machine needs. `make e2e-kind` itself runs them for real."""
from __future__ import annotations

import re
from pathlib import Path

import yaml

from localcluster import components, kindnode

REPO = Path(__file__).resolve().parents[2]


def test_the_pod_network_is_kube_routers_manifest_on_the_image_built_here():
    docs = [d for d in yaml.safe_load_all((REPO / "localcluster/kind/default-cni.yaml").read_text()) if d]
    kinds = {d["kind"] for d in docs}
    assert {"DaemonSet", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ConfigMap"} <= kinds
    ds = next(d for d in docs if d["kind"] == "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True and pod["serviceAccountName"] == "kube-router"
    containers = pod["containers"] + pod["initContainers"]
    # kindnode.build_node_image replaces the placeholder with the image it preloads; nothing is pulled
    assert {c["image"] for c in containers} == {"KUBE_ROUTER_IMAGE"}
    assert {c["imagePullPolicy"] for c in containers} == {"Never"}
    main = next(c for c in pod["containers"] if c["name"] == "kube-router")
    # the image is shared with CoreDNS, whose entry point it has: kube-router must be named
    assert main["command"] == ["/usr/local/bin/kube-router"]
    assert "--run-router=true" in main["args"] and "--run-firewall=true" in main["args"]
    assert not any("kubeconfig" in v["name"] for v in pod["volumes"])  # in-cluster configuration


def test_every_worker_sees_the_models_folder_kind_sh_fills_at_the_same_path():
    cfg = yaml.safe_load((REPO / "kind-config.yaml").read_text())
    workers = [n for n in cfg["nodes"] if n["role"] == "worker"]
    assert workers
    for n in workers:
        assert {"hostPath": "/var/lib/embedops-kind", "containerPath": "/var/lib/embedops-kind"} in n["extraMounts"]
    script = (REPO / "tests/e2e/kind.sh").read_text()
    models = re.search(r"EMBEDOPS_MODELS_HOSTPATH=(\S+)", script).group(1)
    # under the mounted folder, never the mount itself: prepare_models replaces its folder by a rename
    assert models.startswith("/var/lib/embedops-kind/") and models != "/var/lib/embedops-kind/"
    assert f"EMBEDOPS_E2E_MODELS_HOSTPATH={models}" in script


def test_kind_sh_picks_an_engine_that_answers():
    script = (REPO / "tests/e2e/kind.sh").read_text()
    assert "docker info" in script  # a docker client without an engine (this machine has one) is not docker
    assert "KIND_EXPERIMENTAL_PROVIDER=podman" in script and "kind load image-archive" in script


def test_the_node_image_clamps_oom_scores_and_names_what_it_runs():
    # root here lacks CAP_SYS_RESOURCE: a sandbox's oom_score_adj of -998 made runc fail every pod
    assert "restrict_oom_score_adj = true" in kindnode.NODE_CONTAINERFILE
    for binary, (component, file) in kindnode.SYSTEM_TOOLS.items():
        assert file in components.BY_NAME[component].provides, binary
    assert components.BY_NAME["kind-tools"].version == components.KUBERNETES_VERSION
    assert set(components.SETS["kind"]) <= set(components.BY_NAME)
    assert components.BY_NAME["kind"].version == kindnode.KIND_VERSION
