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
    # the operator's ClusterRole, the two that extend edit/admin and view to EmbeddingServices, the reviews behind
    # /metrics (bound) and the role a scraper needs to read it (bound only to metrics.readers)
    assert kinds == ["ClusterRole"] * 5 + ["ClusterRoleBinding"] * 2 + [
        "CustomResourceDefinition", "Deployment", "PodDisruptionBudget", "Role", "RoleBinding", "ServiceAccount"]
    roles = {d["metadata"]["name"]: d["rules"] for d in docs if d["kind"] == "ClusterRole"}
    assert roles["rel-embedops-operator-metrics-reader"] == [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]
    assert {r["resources"][0] for r in roles["rel-embedops-operator-metrics-auth"]} == {
        "tokenreviews", "subjectaccessreviews"}
    dep = next(d for d in docs if d["kind"] == "Deployment")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["image"] == "ghcr.io/embedops/embedops-operator:0.1.0"
    assert c["args"][:2] == ["run", "--log-format=text"]
    assert not any(a.startswith("--namespace") for a in c["args"])
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert dep["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    assert "--metrics-auth=kubernetes" in c["args"] and not any(a.startswith("--metrics-cert-dir") for a in c["args"])
    # HA: two replicas, one reconciling through the Lease, handed over on rollouts, kept by a PDB
    assert dep["spec"]["replicas"] == 2
    assert dep["spec"]["strategy"] == {"type": "RollingUpdate",
                                       "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    assert "--leader-elect" in c["args"] and "--leader-election-id=rel-embedops-operator" in c["args"]
    flags = dict(a.split("=", 1) for a in c["args"] if a.startswith("--leader-election-") and "=" in a)
    lease, renew, retry = (float(flags[f"--leader-election-{k}"]) for k in
                           ("lease-duration", "renew-deadline", "retry-period"))
    # client-go's defaults: takeover within 19 s of the leader's death
    assert (lease, renew, retry) == (15, 10, 2) and lease + 2 * retry <= 19
    env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in c["env"]}
    assert env["POD_NAME"] == "metadata.name" and env["POD_NAMESPACE"] == "metadata.namespace"
    pdb = next(d for d in docs if d["kind"] == "PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    anti = dep["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    assert anti["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]["topologyKey"] == \
        "kubernetes.io/hostname"


@needs_helm
def test_helm_template_leader_election_rbac_is_the_release_namespaces_lease_only():
    docs = template()
    role = next(d for d in docs if d["kind"] == "Role")
    assert role["metadata"]["namespace"] == "embedops-system"
    rules = {(tuple(r["resources"]), tuple(r.get("resourceNames", []))): set(r["verbs"]) for r in role["rules"]}
    assert rules == {(("leases",), ()): {"create"},
                     (("leases",), ("rel-embedops-operator",)): {"get", "update"}}
    assert all(r["apiGroups"] == ["coordination.k8s.io"] for r in role["rules"])
    binding = next(d for d in docs if d["kind"] == "RoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"][0]["name"] == "rel-embedops-operator"


@needs_helm
def test_helm_template_single_replica_without_leader_election():
    docs = template("replicaCount=1", "leaderElection.enabled=false")
    kinds = sorted(d["kind"] for d in docs)
    assert "PodDisruptionBudget" not in kinds and "Role" not in kinds
    dep = next(d for d in docs if d["kind"] == "Deployment")
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"] == {"type": "Recreate"}
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert not any(a.startswith("--leader-elect") for a in c["args"])
    assert "affinity" not in dep["spec"]["template"]["spec"]


@needs_helm
def test_helm_template_refuses_replicas_without_leader_election():
    args = [helm_binary(), "template", "rel", str(CHART), "--set", "replicaCount=2",
            "--set", "leaderElection.enabled=false"]
    out = subprocess.run(args, capture_output=True, text=True)
    assert out.returncode != 0 and "needs leaderElection.enabled" in out.stderr


@needs_helm
def test_helm_template_namespaced_values():
    docs = template("watchNamespaces={search,ingest}", "logFormat=json", "image.tag=dev", "verbose=true",
                    "resources.limits.memory=512Mi")
    bindings = [d for d in docs if d["kind"] == "RoleBinding" and d["roleRef"]["kind"] == "ClusterRole"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["ingest", "search"]
    # the only cluster-wide grant: the token and access reviews behind /metrics (cluster-scoped APIs)
    assert [d["roleRef"]["name"] for d in docs if d["kind"] == "ClusterRoleBinding"] == [
        "rel-embedops-operator-metrics-auth"]
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
    write = {"get", "list", "watch", "create", "patch", "delete"}  # watch: the operator's caches
    for api_version, kind in A.OWNED_KINDS:
        group = api_version.split("/")[0] if "/" in api_version else ""
        plural = A.PLURALS[(api_version, kind)]
        assert write <= rules[(group, plural)], kind
    assert rules[("embedops.dev", "embeddingservices")] == {"get", "list", "watch"}
    assert rules[("embedops.dev", "embeddingservices/status")] == {"get", "patch"}
    assert rules[("", "pods")] == {"get", "list", "watch"}
    assert rules[("", "configmaps")] == {"get", "list", "watch", "create", "patch"}  # LiteLLM entries, sweep
    assert rules[("apps", "deployments")] == write
    assert rules[("", "services")] == write
    assert ("", "secrets") not in rules  # the API key is only referenced, never read
    assert not any("*" in verbs or res == "*" for (_, res), verbs in rules.items())


@needs_helm
def test_metrics_tls_and_readers_reach_the_pod_and_the_service_monitor():
    docs = template("metrics.serviceMonitor.enabled=true", "metrics.tls.secretName=operator-metrics-tls",
                    "metrics.readers[0].namespace=monitoring", "metrics.readers[0].name=prometheus")
    dep = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    c = dep["containers"][0]
    assert "--metrics-cert-dir=/etc/embedops/metrics-tls" in c["args"]
    assert {"name": "metrics-tls", "mountPath": "/etc/embedops/metrics-tls", "readOnly": True} in c["volumeMounts"]
    assert {"name": "metrics-tls", "secret": {"secretName": "operator-metrics-tls"}} in dep["volumes"]
    endpoint = next(d for d in docs if d["kind"] == "ServiceMonitor")["spec"]["endpoints"][0]
    assert endpoint["scheme"] == "https" and endpoint["bearerTokenFile"].endswith("serviceaccount/token")
    assert endpoint["tlsConfig"] == {"serverName": "rel-embedops-operator-metrics.embedops-system.svc",
                                     "ca": {"secret": {"name": "operator-metrics-tls", "key": "ca.crt"}}}
    reader = next(d for d in docs if d["kind"] == "ClusterRoleBinding"
                  and d["metadata"]["name"] == "rel-embedops-operator-metrics-reader")
    assert reader["subjects"] == [{"kind": "ServiceAccount", "name": "prometheus", "namespace": "monitoring"}]
    # metrics.auth=none: no reviews, no token in the ServiceMonitor
    docs = template("metrics.serviceMonitor.enabled=true", "metrics.auth=none")
    assert not [d for d in docs if d["metadata"]["name"].endswith("-metrics-auth")]
    endpoint = next(d for d in docs if d["kind"] == "ServiceMonitor")["spec"]["endpoints"][0]
    assert "bearerTokenFile" not in endpoint and "scheme" not in endpoint
