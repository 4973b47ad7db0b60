"""GitOps for real: Flux's source-controller and kustomize-controller (built from their Go modules) pull
a Git repository served from loopback holding examples/, apply it with a Kustomization that health-checks
the EmbeddingServices (kstatus), and report Ready once the operator has made them Ready."""
from __future__ import annotations

import pytest
import yaml

from tests.e2e import flux
from tests.e2e.conftest import REPO, condition, skip_unless_simulated_nodes, wait_for
from tests.e2e.test_examples import example_docs
from localcluster.workloads import prerequisites

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


HEALTH_EXPR = {
    "apiVersion": "embedops.dev/v1alpha1", "kind": "EmbeddingService",
    "inProgress": "!has(status.observedGeneration) || status.observedGeneration != metadata.generation",
    "failed": "has(status.conditions) && status.conditions.exists(c, c.type == 'Stalled' && c.status == 'True')",
    "current": "has(status.observedGeneration) && status.observedGeneration == metadata.generation"
               " && has(status.conditions) && status.conditions.exists(c, c.type == 'Ready' && c.status == 'True')",
}


def _fits(doc, kube) -> bool:
    acc = doc["spec"]["accelerator"]
    if "mig" in acc and kube.local:
        return acc["mig"].get("profile") == "1g.10gb"
    return True


@pytest.mark.parametrize("health", ["kstatus", "cel"])
def test_flux_kustomization_applies_examples_and_reports_ready(kube, embsvc, namespace, operator, tmp_path, health):
    """health=kstatus: the plain healthChecks of examples/flux (cli-utils kstatus; correct because the CRD
    defaults status.observedGeneration to 0, so a new object is InProgress until the operator reports);
    health=cel: Flux's healthCheckExprs on top (Ready=True current, Stalled=True failed)."""
    if flux.binaries() is None:
        pytest.skip("Flux controllers not built (python -m localcluster.build source-controller kustomize-controller)")
    if not flux.have_git_http_backend():
        pytest.skip("git http-backend not available")
    skip_unless_simulated_nodes(kube)  # its health checks wait for examples/ to be Ready
    from kubernetes import client

    for f in flux.crd_files():
        kube.apply(f)
    ext = client.ApiextensionsV1Api(embsvc.co.api_client)
    for name in ("gitrepositories.source.toolkit.fluxcd.io", "kustomizations.kustomize.toolkit.fluxcd.io"):
        wait_for(lambda: any(c.type == "Established" and c.status == "True"
                             for c in ext.read_custom_resource_definition(name).status.conditions or []),
                 what=f"{name} Established")

    # The repository: this checkout's examples/ (the EmbeddingServices and their kustomization.yaml).
    files = {f"examples/{p.name}": p.read_text() for p in (REPO / "examples").glob("*.yaml")}
    docs = example_docs()
    prerequisites(kube, namespace, docs)  # the model PVC and API-key Secret the platform provides
    flux.make_repo(tmp_path / "git", files)
    healthy = [d["metadata"]["name"] for d in docs if _fits(d, kube)]

    with flux.GitHTTPServer(tmp_path / "git") as gitd, \
            flux.Controllers(kube.kubeconfig, tmp_path / "flux", namespace) as ctl:
        repo = {"apiVersion": "source.toolkit.fluxcd.io/v1", "kind": "GitRepository",
                "metadata": {"name": "embedops", "namespace": namespace},
                "spec": {"interval": "1m", "url": gitd.url("embedops.git"), "ref": {"branch": "main"}}}
        # examples/flux/kustomizations.yaml's `embedding-services`, pointed at this namespace and at the
        # services this cluster can host (the local GPU node has no 1g.18gb slices).
        ks_doc = [d for d in yaml.safe_load_all((REPO / "examples" / "flux" / "kustomizations.yaml").read_text())
                  if d and d["metadata"]["name"] == "embedding-services"][0]
        spec = dict(ks_doc["spec"])
        spec.pop("dependsOn", None)
        spec.update({"interval": "1m", "retryInterval": "10s", "timeout": "5m", "wait": False,
                     "targetNamespace": namespace, "path": "./examples",
                     "healthChecks": [{"apiVersion": "embedops.dev/v1alpha1", "kind": "EmbeddingService",
                                       "name": n, "namespace": namespace} for n in healthy]})
        if health == "cel":
            spec["healthCheckExprs"] = [HEALTH_EXPR]
        ks = {"apiVersion": "kustomize.toolkit.fluxcd.io/v1", "kind": "Kustomization",
              "metadata": {"name": "embedding-services", "namespace": namespace}, "spec": spec}
        kube.apply([repo, ks], namespace=namespace)
        co = client.CustomObjectsApi(embsvc.co.api_client)

        def ready(group, plural, name):
            assert ctl.alive(), ctl.logs()
            o = co.get_namespaced_custom_object(group, "v1", namespace, plural, name)
            c = condition(o, "Ready")
            return o if c and c["status"] == "True" else None
        try:
            wait_for(lambda: ready("source.toolkit.fluxcd.io", "gitrepositories", "embedops"), timeout=120,
                     what="GitRepository Ready")
            obj = wait_for(lambda: ready("kustomize.toolkit.fluxcd.io", "kustomizations", "embedding-services"),
                           timeout=360, what="Kustomization Ready (health checks passed)")
        except AssertionError as e:
            ks_now = co.get_namespaced_custom_object("kustomize.toolkit.fluxcd.io", "v1", namespace,
                                                     "kustomizations", "embedding-services").get("status")
            svcs = {n: (embsvc.get(n).get("status") or {}).get("conditions") for n in healthy}
            pytest.fail(f"{e}\nKustomization status: {ks_now}\nEmbeddingServices: {svcs}\n{ctl.logs()}")
    assert "Applied revision" in condition(obj, "Ready")["message"] or condition(obj, "Ready")["reason"]
    for n in healthy:
        o = embsvc.get(n)
        assert condition(o, "Ready")["status"] == "True", (n, o.get("status"), obj.get("status"))
        labels = o["metadata"].get("labels") or {}
        assert labels.get("kustomize.toolkit.fluxcd.io/name") == "embedding-services"
