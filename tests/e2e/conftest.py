"""e2e fixtures: the EmbeddingService CRD, the operator, namespaces, waiting helpers.

Cluster-agnostic: everything goes through the `kube` fixture (tests/conftest.py), i.e. the local
upstream control plane or whatever EMBEDOPS_E2E_KUBECONFIG / KUBECONFIG points at (kind in CI).

The operator runs as a local process (`embedops-operator run`, the same entry point as the chart's
container) against that cluster, unless EMBEDOPS_E2E_OPERATOR=external says one is already running
in the cluster (e.g. the Helm chart on kind).
"""
from __future__ import annotations

import os
import subprocess
import sys
import functools
import time
import uuid
from pathlib import Path

import pytest

from tests import waiting

REPO = Path(__file__).resolve().parents[2]
GROUP, VERSION, PLURAL = "embedops.dev", "v1alpha1", "embeddingservices"
# Operator round trips on a loaded 2-core machine: a longer default than the cluster tests.
wait_for = functools.partial(waiting.wait_for, timeout=90.0, interval=0.5)


def condition(obj: dict, type_: str) -> dict | None:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("type") == type_:
            return c
    return None


def is_true(obj: dict, type_: str) -> bool:
    c = condition(obj, type_)
    return bool(c and c.get("status") == "True")


def skip_unless_simulated_nodes(kube) -> None:
    """For tests whose services must become Ready at the sizes they ask (examples/ at production size: 4 cores,
    8 GiB, MIG slices; a model id to download) on kwok's simulated nodes, which run no container. On another
    cluster the nodes are real: on kind (docs/kind.md) the pods of those services stay Pending ("Insufficient
    cpu") or run with no GPU and no model, and never become Ready. The real-pod tests (test_real_pods.py, the
    migrations) are the ones that run there."""
    if not kube.local:
        pytest.skip("needs kwok's simulated nodes (the local control plane): the services ask sizes, GPUs or "
                    "downloads no real worker here has")


@pytest.fixture(scope="session")
def api(kube):
    with kube.api_client() as a:
        yield a


@pytest.fixture(scope="session")
def embsvc_crd(kube, api):
    """The project's EmbeddingService CRD (crds/), applied and Established."""
    from kubernetes import client

    crd_file = REPO / "crds" / "embedops.dev_embeddingservices.yaml"
    if not crd_file.exists():  # the project's own file: its absence is a defect, never a reason to skip
        pytest.fail(f"{crd_file} is missing")
    kube.apply(crd_file)
    ext = client.ApiextensionsV1Api(api)
    wait_for(lambda: any(c.type == "Established" and c.status == "True" for c in
                         ext.read_custom_resource_definition(f"{PLURAL}.{GROUP}").status.conditions or []),
             what="EmbeddingService CRD Established")
    return crd_file


@pytest.fixture(scope="session")
def third_party_crds(kube):
    """ServiceMonitor, HTTPRoute (+Gateway, GatewayClass) and ScaledObject: the upstream CRDs."""
    names = ["servicemonitor", "httproute", "scaledobject"]
    kube.install_crds(names)
    return names


_SESSION = uuid.uuid4().hex[:6]
_POOL = [f"e2e-{_SESSION}-{i}" for i in range(16)]  # namespaces the e2e operator watches
_WATCHED = list(_POOL)


@pytest.fixture(scope="package")
def operator(kube, embsvc_crd, third_party_crds, tmp_path_factory):
    """`embedops-operator run` against the test cluster (stopped at the end of the session)."""
    if os.environ.get("EMBEDOPS_E2E_OPERATOR") == "external":
        yield None
        return
    try:
        import embedops_operator.cli  # noqa: F401
        import embedops_operator.handlers  # noqa: F401
    except ImportError as e:  # the project's own code: failing to import it is a defect, never a skip
        pytest.fail(f"the operator does not import: {e}")
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    from localcluster import gateway, monitoring

    env = {**os.environ, "KUBECONFIG": kube.kubeconfig,
           "PYTHONPATH": os.pathsep.join([str(REPO / "operator"), str(REPO / "server"), str(REPO)]),
           # where the local cluster runs the platform's callers, as the chart's networkPolicy.* say them
           "EMBEDOPS_GATEWAY_NAMESPACES": gateway.NAMESPACE, "EMBEDOPS_PROMETHEUS_NAMESPACES": monitoring.NAMESPACE,
           "EMBEDOPS_KEDA_NAMESPACES": monitoring.KEDA_NAMESPACE}
    # Watches the e2e namespaces by name, as the chart installed with watched namespaces does
    # (EMBEDOPS_E2E_WATCH=all: cluster-wide).
    watch = [] if os.environ.get("EMBEDOPS_E2E_WATCH") == "all" else ["--namespace", ",".join(_WATCHED)]
    from localcluster.pki import free_port

    # /metrics on every address: the Prometheus pod of tests/e2e/test_monitoring.py scrapes it over the bridge
    metrics_port = free_port()
    argv = [sys.executable, "-m", "embedops_operator.cli", "run", "--liveness", "", *watch,
            "--metrics-address", f"0.0.0.0:{metrics_port}",
            "--stall-after-seconds", os.environ.get("EMBEDOPS_E2E_STALL_AFTER", "10"),
            # Stalled for an unschedulable pod is decided on a reconcile after stall-after; with no
            # further events that reconcile is the resync timer, so keep it short here.
            "--resync-seconds", os.environ.get("EMBEDOPS_E2E_RESYNC", "5")]
    with open(log, "wb") as f:
        proc = subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=REPO)
    time.sleep(1.0)
    if proc.poll() is not None:
        pytest.fail(f"operator exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
    proc.log_path = log  # type: ignore[attr-defined]
    proc.metrics_port = metrics_port  # type: ignore[attr-defined]
    yield proc
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if os.environ.get("EMBEDOPS_E2E_SHOW_OPERATOR_LOG"):
        sys.stderr.write(log.read_text()[-20000:])


@pytest.fixture
def namespace(api):
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    core = client.CoreV1Api(api)
    if not _POOL:
        pytest.fail("more e2e tests than watched namespaces: grow _POOL in tests/e2e/conftest.py")
    name = _POOL.pop(0)
    core.create_namespace({"metadata": {"name": name, "labels": {"embedops.dev/e2e": "true"}}})

    def sa():
        try:
            return core.read_namespaced_service_account("default", name)
        except ApiException:
            return None
    wait_for(sa, what="default ServiceAccount")
    yield name
    core.delete_namespace(name)


class EmbSvc:
    """Helpers around EmbeddingService objects in one namespace."""

    def __init__(self, api, namespace, operator=None):
        from kubernetes import client

        self.operator = operator
        self.ns = namespace
        self.co = client.CustomObjectsApi(api)
        self.core = client.CoreV1Api(api)
        self.apps = client.AppsV1Api(api)

    def check_operator(self):
        if self.operator is not None and self.operator.poll() is not None:
            pytest.fail(f"the operator exited with {self.operator.returncode}:\n{operator_log(self.operator)}")

    def get(self, name):
        self.check_operator()
        return self.co.get_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, name)

    def create(self, body):
        body = {**body, "metadata": {**body["metadata"], "namespace": self.ns}}
        return self.co.create_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, body)

    def delete(self, name):
        self.co.delete_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, name)

    def wait_condition(self, name, type_, timeout=90.0):
        def ok():
            o = self.get(name)
            gen = o["metadata"].get("generation")
            st = o.get("status") or {}
            return o if is_true(o, type_) and st.get("observedGeneration") == gen else None
        return wait_for(ok, timeout=timeout, what=f"{name} {type_}=True (observedGeneration current)")

    def pods(self, name):
        sel = f"app.kubernetes.io/name=embedops-server,app.kubernetes.io/instance={name}"
        return self.core.list_namespaced_pod(self.ns, label_selector=sel).items

    def deployment(self, name):
        for d in self.apps.list_namespaced_deployment(self.ns).items:
            for ref in d.metadata.owner_references or []:
                if ref.kind == "EmbeddingService" and ref.name == name:
                    return d
        return None


@pytest.fixture
def embsvc(api, namespace, operator):
    return EmbSvc(api, namespace, operator)


def operator_log(operator) -> str:
    path = getattr(operator, "log_path", None)
    return Path(path).read_text()[-6000:] if path else ""
