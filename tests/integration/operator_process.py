"""Helpers for the HA and fault tests: the operator as a real process (`embedops-operator run`, so it can be
SIGKILLed), a kubeconfig with the chart's ServiceAccount token, and small waits/counters."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from tests.waiting import wait_until as wait_for  # re-exported: the HA, fault and watch-cache tests import it here

REPO = Path(__file__).resolve().parents[2]
GROUP, VERSION, PLURAL = "embedops.dev", "v1alpha1", "embeddingservices"
CRD = REPO / "crds" / "embedops.dev_embeddingservices.yaml"

# A CPU service on the kwok nodes: a Deployment, a Service, no optional children (no LiteLLM ConfigMap).
CPU_SPEC = {"model": {"id": "/models/all-MiniLM-L6-v2", "maxInputLength": 256},
            "accelerator": {"cpu": {"cores": 1, "memory": "1Gi"}},
            "batching": {"maxBatchTokens": 4096},
            "monitoring": {"serviceMonitor": {"enabled": False}}}


class OperatorProcess:
    """`python -m embedops_operator.cli run ...` with its own log file; killed by PID (its own session)."""

    def __init__(self, name: str, kubeconfig: str, log_dir: Path, args: list[str], env: dict | None = None,
                 module: str = "embedops_operator.cli"):
        # the operator's defaults bind 0.0.0.0:8080 (liveness) and :8081 (metrics); `make test` runs these tests
        # beside the cluster lane's, so a test that does not ask for them gets no liveness and a free metrics port
        given = {a.split("=", 1)[0] for a in args}
        if "--liveness" not in given:
            args = [*args, "--liveness="]
        if "--metrics-address" not in given:
            from localcluster.pki import free_port

            args = [*args, f"--metrics-address=127.0.0.1:{free_port()}"]
        self.name, self.kubeconfig, self.args = name, kubeconfig, args
        self.log_path = log_dir / f"{name}.log"
        self.env = env or {}
        self.module = module  # tests.integration.crashing_operator: one that kills itself after a chosen write
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.preexec = None  # run in the child before the interpreter starts (joining a memory cgroup)

    def start(self) -> "OperatorProcess":
        env = {**os.environ, "KUBECONFIG": self.kubeconfig, "POD_NAME": self.name,
               "PYTHONPATH": os.pathsep.join([str(REPO / "operator"), str(REPO)]), "PYTHONUNBUFFERED": "1",
               **self.env}
        with open(self.log_path, "ab") as log:
            log.write(f"---- start {self.starts + 1} at {time.time():.3f}\n".encode())
            log.flush()
            self.proc = subprocess.Popen([sys.executable, "-m", self.module, "run", *self.args],
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         cwd=REPO, start_new_session=True, preexec_fn=self.preexec)
        self.starts += 1
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.wait(10)

    def wait(self, timeout: float) -> int | None:
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> int | None:
        """SIGTERM (kopf's graceful stop), SIGKILL after 20 s."""
        if not self.alive():
            return self.proc.returncode if self.proc else None
        self.signal(signal.SIGTERM)
        rc = self.wait(20)
        if rc is None:
            self.kill()
            rc = self.proc.returncode
        return rc

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""


def install_crd(kube, api) -> None:
    from kubernetes import client

    kube.apply(CRD)

    def established():
        crd = client.ApiextensionsV1Api(api).read_custom_resource_definition(f"{PLURAL}.{GROUP}")
        return any(x.type == "Established" and x.status == "True" for x in crd.status.conditions or [])
    wait_for("CRD established", established, 60)


def chart_rbac_kubeconfig(kube, api, ns: str, release: str, out: Path) -> tuple[Path, list[dict]]:
    """Render the chart (watching `ns`, installed in `ns`), apply its ServiceAccount and RBAC (incl. the
    leader-election Role), and write a kubeconfig with that account's token. Returns (path, applied docs)."""
    from kubernetes import client

    chart = REPO / "charts" / "embedops-operator"
    rendered = subprocess.run([kube.helm, "template", release, str(chart), "--namespace", ns,
                               "--set", f"watchNamespaces={{{ns}}}", "--set", "rbac.aggregateToDefaultRoles=false"],
                              capture_output=True, text=True,
                              check=True).stdout
    docs = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] in (
        "ServiceAccount", "ClusterRole", "Role", "RoleBinding")]
    kube.apply(docs, namespace=ns)
    sa = next(d for d in docs if d["kind"] == "ServiceAccount")["metadata"]["name"]
    token = client.CoreV1Api(api).create_namespaced_service_account_token(
        sa, ns, client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(
            audiences=[], expiration_seconds=3600))).status.token
    admin = yaml.safe_load(Path(kube.kubeconfig).read_text())
    cluster = admin["clusters"][0]
    out.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "clusters": [cluster],
        "users": [{"name": "operator", "user": {"token": token}}],
        "contexts": [{"name": "operator", "context": {"cluster": cluster["name"], "user": "operator"}}],
        "current-context": "operator"}))
    return out, docs


@contextlib.contextmanager
def operator_env(kube, tmp: Path, prefix: str, chart_rbac: bool = False):
    """A namespace `<prefix>-<random>` with the CRD installed, API clients (api, custom, apps, core, coord), a
    scratch folder and `procs`, the operator processes to stop at the end. With `chart_rbac`: the chart's
    ServiceAccount and RBAC for that namespace and a kubeconfig with its token (`kubeconfig`), removed at the end;
    else `kubeconfig` is the admin's."""
    from kubernetes import client

    api = kube.api_client()
    install_crd(kube, api)
    docs: list[dict] = []
    with kube.namespace(prefix) as ns:
        e = type("Env", (), {})()
        e.kube, e.ns, e.tmp, e.api, e.procs, e.kubeconfig = kube, ns, tmp, api, [], kube.kubeconfig
        if chart_rbac:
            path, docs = chart_rbac_kubeconfig(kube, api, ns, prefix, tmp / "operator.kubeconfig")
            e.kubeconfig = str(path)
        e.custom, e.apps, e.core = client.CustomObjectsApi(api), client.AppsV1Api(api), client.CoreV1Api(api)
        e.coord = client.CoordinationV1Api(api)
        try:
            yield e
        finally:
            for p in e.procs:
                p.stop()
            delete_cluster_scoped(api, docs)
    api.close()


def settle_after_outage(kube, timeout: float = 180.0) -> float:
    """After a test stopped the API server: wait until the controller-manager acts on new objects again (a new
    namespace gets its default ServiceAccount), so the next test starts on a whole cluster. Its informers come back
    on client-go's reflector back-off, which after a 20 s outage can wait ~50 s more (30 s cap, jitter up to 2x):
    the test after the HA test once waited over 60 s for a namespace's ServiceAccount. Returns the seconds taken."""
    t0 = time.monotonic()
    while True:
        try:
            with kube.namespace("settle"):
                return time.monotonic() - t0
        except TimeoutError:
            if time.monotonic() - t0 > timeout:
                raise


def delete_cluster_scoped(api, docs: list[dict]) -> None:
    from kubernetes import client

    rbac = client.RbacAuthorizationV1Api(api)
    for d in docs:
        try:
            if d["kind"] == "ClusterRole":
                rbac.delete_cluster_role(d["metadata"]["name"])
            elif d["kind"] == "ClusterRoleBinding":
                rbac.delete_cluster_role_binding(d["metadata"]["name"])
        except Exception:  # noqa: BLE001 - best effort
            pass


def es_body(ns: str, name: str, spec: dict) -> dict:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "EmbeddingService",
            "metadata": {"name": name, "namespace": ns}, "spec": spec}


def converged(custom, apps, core, ns: str, name: str) -> bool:
    """The operator has seen the current generation and its Deployment and Service exist."""
    from kubernetes.client.rest import ApiException

    es = custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)
    if (es.get("status") or {}).get("observedGeneration") != es["metadata"]["generation"]:
        return False
    try:
        apps.read_namespaced_deployment(name, ns)
        core.read_namespaced_service(name, ns)
    except ApiException as e:
        if e.status == 404:
            return False
        raise
    return True


def children_report(custom, apps, core, ns: str) -> dict:
    """Every EmbeddingService's children by kind, and the children no live service owns (orphans)."""
    services = {o["metadata"]["uid"]: o["metadata"]["name"]
                for o in custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL)["items"]}
    out: dict = {"deployments": {}, "services": {}, "orphans": [], "duplicates": []}
    selector = "app.kubernetes.io/managed-by=embedops"
    for kind, items in (("deployments", apps.list_namespaced_deployment(ns, label_selector=selector).items),
                        ("services", core.list_namespaced_service(ns, label_selector=selector).items)):
        for it in items:
            owners = [r.uid for r in (it.metadata.owner_references or []) if r.controller]
            if len(owners) != 1 or owners[0] not in services:
                out["orphans"].append(f"{kind}/{it.metadata.name}")
                continue
            owner = services[owners[0]]
            if owner in out[kind]:
                out["duplicates"].append(f"{kind}/{it.metadata.name}")
            out[kind][owner] = it.metadata.name
    return out


def dump(obj) -> str:
    return json.dumps(obj, indent=1, default=str)[:4000]
