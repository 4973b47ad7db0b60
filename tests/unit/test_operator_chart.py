"""The Helm chart: lint/template clean (when helm is available), RBAC matches what the operator does."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from embedops_operator import apply as A
from tests.unit.operator_helpers import REPO

CHART = REPO / "charts" / "embedops-operator"


def helm_binary() -> str | None:
    if os.environ.get("HELM"):
        return os.environ["HELM"]
    cache = Path(os.environ.get("EMBEDOPS_CACHE", Path.home() / ".cache" / "embedops")) / "bin"
    for cand in [cache / "helm", *sorted(cache.glob("helm-*/helm"))]:
        if os.access(cand, os.X_OK):
            return str(cand)
    return shutil.which("helm")


needs_helm = pytest.mark.skipif(helm_binary() is None, reason="helm not found (~/.cache/embedops/bin/helm-*/helm)")


def template(*sets: str) -> list[dict]:
    args = [helm_binary(), "template", "rel", str(CHART), "--namespace", "embedops-system", "--include-crds"]
    for s in sets:
        args += ["--set", s]
    out = subprocess.run(args, capture_output=True, text=True, check=True)
    assert out.stderr.strip() == "", out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@needs_helm
def test_helm_lint_is_clean():
    out = subprocess.run([helm_binary(), "lint", str(CHART), "--strict"], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "[WARNING]" not in out.stdout and "[ERROR]" not in out.stdout


@needs_helm
def test_helm_template_cluster_wide():
    docs = template()
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "Deployment",
                     "ServiceAccount"]
    dep = next(d for d in docs if d["kind"] == "Deployment")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["image"] == "ghcr.io/embedops/embedops-operator:0.1.0"
    assert c["args"][:2] == ["run", "--log-format=text"]
    assert not any(a.startswith("--namespace") for a in c["args"])
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert dep["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    assert dep["spec"]["strategy"] == {"type": "Recreate"}


@needs_helm
def test_helm_template_namespaced_values():
    docs = template("watchNamespaces={search,ingest}", "logFormat=json", "image.tag=dev", "verbose=true",
                    "resources.limits.memory=512Mi")
    bindings = [d for d in docs if d["kind"] == "RoleBinding"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["ingest", "search"]
    assert not [d for d in docs if d["kind"] == "ClusterRoleBinding"]
    c = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert "--namespace=search" in c["args"] and "--namespace=ingest" in c["args"]
    assert "--log-format=json" in c["args"] and "--verbose" in c["args"]
    assert c["image"].endswith(":dev") and c["resources"]["limits"]["memory"] == "512Mi"


def _rules() -> dict[tuple[str, str], set[str]]:
    text = (CHART / "templates" / "rbac.yaml").read_text()
    body = text.split("rules:", 1)[1].split("{{-", 1)[0]
    out: dict[tuple[str, str], set[str]] = {}
    for rule in yaml.safe_load(body):
        for group in rule["apiGroups"]:
            for res in rule["resources"]:
                out[(group, res)] = set(rule["verbs"])
    return out


def test_rbac_is_exactly_what_the_operator_uses():
    rules = _rules()
    write = {"get", "list", "create", "patch", "delete"}
    for api_version, kind in A.OWNED_KINDS:
        group = api_version.split("/")[0] if "/" in api_version else ""
        plural = A.PLURALS[(api_version, kind)]
        assert write <= rules[(group, plural)], kind
    assert rules[("embedops.dev", "embeddingservices")] == {"get", "list", "watch"}
    assert rules[("embedops.dev", "embeddingservices/status")] == {"get", "patch"}
    assert rules[("", "pods")] == {"get", "list", "watch"}
    assert rules[("", "configmaps")] == {"get", "list", "create", "patch"}  # LiteLLM entries and their sweep
    assert rules[("apps", "deployments")] == write | {"watch"}
    assert rules[("", "services")] == write | {"watch"}
    assert ("", "secrets") not in rules  # the API key is only referenced, never read
    assert not any("*" in verbs or res == "*" for (_, res), verbs in rules.items())
