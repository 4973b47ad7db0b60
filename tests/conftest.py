"""Shared fixtures. `kube`: a real Kubernetes API server for integration and e2e tests.

Which cluster:
* ``EMBEDOPS_E2E_KUBECONFIG`` or ``KUBECONFIG`` set explicitly -> that cluster (kind, a real one); it is
  left running afterwards.
* otherwise the local upstream control plane of ``localcluster/controlplane.py`` (etcd, kube-apiserver,
  kube-controller-manager, kube-scheduler, kwok with a MIG GPU node, an AMX CPU node and a plain CPU
  node), started once per session in ``.run/pytest`` and stopped at the end. Its binaries
  come from ``make cluster-binaries``; when they are missing the cluster tests are skipped
  (or fail, with ``EMBEDOPS_REQUIRE_CLUSTER=1``).

The cluster's client is ``localcluster.kube.Kube`` (its API is listed there).

The local cluster starts its real node (``localcluster/node.py``: kubelet, kube-proxy, containerd, CNI
bridge, CoreDNS) by default; ``EMBEDOPS_REAL_NODE=0`` turns it off. When the machine refuses (a package,
the kernel, privileges, another cluster holding it) the cluster runs without it and ``real_node_reason``
says why.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from localcluster.kube import Kube

REPO = Path(__file__).resolve().parent.parent

# CI (.ci/run) sets EMBEDOPS_REQUIRE_ALL=1: there a test that skips because this machine lacks something (the
# cluster binaries, the real node, podman, helm, a built controller) fails instead, so CI cannot pass with the
# tests that matter most skipped. A developer's `make test` keeps the skip and prints its reason (-ra). Tests
# marked `opt_in` (switched on by an environment variable: the 6 GB CUDA image) may still skip.
REQUIRE_ALL = os.environ.get("EMBEDOPS_REQUIRE_ALL") == "1"


# `make test` runs two pytest processes side by side (scripts/test-lanes.sh). The cluster lane: the tests that share
# the one local cluster with its real node (its images, pods, Prometheus, KEDA, gateway), in order; most of their
# time is waiting (pods, scrapes, autoscaler windows). Beside it, the other core runs the CPU-bound tests that need
# no cluster, then the operator's integration tests (tests/integration): those need an API server but no real node,
# and some stop theirs (faults, HA), so that lane starts a control plane of its own (`EMBEDOPS_TEST_CLUSTER`, no
# real node) instead of waiting its turn in the cluster lane. The lane is chosen by folder, so a new test lands in one.
CLUSTER_LANE_DIRS = ("tests/e2e/", "tests/cluster/")
NO_CLUSTER_FILES = ("tests/cluster/test_build_script.py",)  # runs the built binaries, writes nothing shared
# e2e modules that need an API server with kwok's nodes but no real node, no image and no monitoring or gateway pod
# (placement, MIG capacity, Flux's controllers as processes, the rendered server command as a process): they run
# on the local lane's control plane, after its CPU-bound tests, which takes about 2 minutes off the cluster lane,
# the longer of the two (issue 40's budget).
SIDE_E2E_FILES = tuple(f"tests/e2e/{m}.py" for m in (
    "test_examples", "test_mig_capacity", "test_flux", "test_serving_path"))


# the local lane's control plane starts once its CPU-bound tests are done
LAST_DIRS = ("tests/integration/", *SIDE_E2E_FILES)
# The modules that need the components `make test` builds beside the tests (scripts/test-lanes.sh): Traefik;
# Prometheus, its operator, KEDA, prometheus-adapter; promtool; actionlint; Flux's controllers. Last in their lane,
# so that on a new machine the other tests run while those build.
LATE_FILES = ("tests/e2e/test_gateway_and_litellm.py", "tests/e2e/test_monitoring.py", "tests/unit/test_alerts.py",
              "tests/unit/test_workflows.py", "tests/e2e/test_flux.py")
# The developer's fast loop (`make test-fast`: tests/unit, tests/server, tests/bench without `slow`) leaves out these
# server modules, the ones of 10 s or more (measured 2026-12-05: slow clients 81 s, contract 36, load 36, the CPU cost
# model 22, activator 21, architectures 17, prepared cache 16, lanes 16, bge-m3 14, space 12); `make test` runs them.
SLOW_MODULES = tuple(f"tests/server/{m}.py" for m in (
    "test_slow_clients", "test_contract", "test_load", "test_cpu_cost_model", "test_activator", "test_architectures",
    "test_prepared_cache", "test_lanes", "test_m3", "test_space"))


def pytest_collection_modifyitems(config, items):
    for item in items:
        rel = item.path.relative_to(REPO).as_posix()
        if rel.startswith(CLUSTER_LANE_DIRS) and rel not in (*NO_CLUSTER_FILES, *SIDE_E2E_FILES):
            item.add_marker(pytest.mark.cluster_lane)
        if rel in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
    # a stable sort: each module's tests stay together and in order
    def rank(item) -> int:
        rel = item.path.relative_to(REPO).as_posix()
        return 2 if rel in LATE_FILES else 1 if rel.startswith(LAST_DIRS) else 0
    items.sort(key=rank)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if REQUIRE_ALL and report.skipped and not hasattr(report, "wasxfail") and not item.get_closest_marker("opt_in"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped, and EMBEDOPS_REQUIRE_ALL=1 (CI) allows no skip: {reason}"
    if report.failed and item.get_closest_marker("cluster_lane"):
        line = disk_pressure_line()
        if line:
            report.sections.append(("real node", line))


# the session's cluster, for the failure report above (None until the `kube` fixture has started one)
SESSION_KUBE: Kube | None = None


def disk_pressure_line() -> str | None:
    """One line when the real node is under DiskPressure: the kubelet then evicts pods and deletes unused images,
    and a test fails minutes later with a message about something else (an APIService without endpoints, a pod
    in ContainerCreating)."""
    import shutil

    kube = SESSION_KUBE
    if kube is None or not kube.real_node:
        return None
    try:
        from kubernetes import client

        with kube.api_client() as api:
            node = client.CoreV1Api(api).read_node(kube.real_node, _request_timeout=5)
    except Exception:  # noqa: BLE001 - a report aid: the test's own failure says the rest
        return None
    cond = next((c for c in node.status.conditions or [] if c.type == "DiskPressure"), None)
    if not cond or cond.status != "True":
        return None
    from localcluster.controlplane import default_run_dir

    free = shutil.disk_usage(default_run_dir()).free / 2**30
    return (f"the real node {kube.real_node} is under DiskPressure since {cond.last_transition_time} "
            f"({free:.1f} GiB free where it keeps its data): the kubelet evicts pods and deletes unused images, "
            "which no registry gives back here; free disk space and run again")


@pytest.fixture(scope="session", autouse=True)
def _onnx_cache(tmp_path_factory):
    """ONNX exports made by the tests go to the session's temp dir (pytest keeps the last three), not the
    user's ~/.cache/embedops: test models live in temp folders, so their exports would only pile up there."""
    saved = os.environ.get("ONNX_CACHE")
    if saved is None:
        os.environ["ONNX_CACHE"] = str(tmp_path_factory.mktemp("onnx-cache"))
    yield
    if saved is None:
        os.environ.pop("ONNX_CACHE", None)


def _explicit_kubeconfig() -> str | None:
    return os.environ.get("EMBEDOPS_E2E_KUBECONFIG") or os.environ.get("KUBECONFIG") or None


def session_run_dir():
    """The folder of this session's local control plane: the side lane's own has its own (scripts/test-lanes.sh,
    `EMBEDOPS_TEST_CLUSTER`); tests that start parts of it (the monitoring stack) find it here."""
    from localcluster import controlplane

    return controlplane.default_run_dir() / os.environ.get("EMBEDOPS_TEST_CLUSTER", "pytest")


@pytest.fixture(scope="session")
def kube():
    from localcluster import controlplane
    from localcluster.components import provided

    h = provided("helm")
    helm = str(h) if os.access(h, os.X_OK) else None

    explicit = _explicit_kubeconfig()
    if explicit:
        yield Kube(explicit, local=False, helm=helm, real_node_reason="an explicit kubeconfig is in use")
        return

    try:
        controlplane.Binaries.from_cache()
    except RuntimeError as e:
        if os.environ.get("EMBEDOPS_REQUIRE_CLUSTER") == "1":
            pytest.fail(str(e))
        pytest.skip(str(e))
    from localcluster import node

    cluster, kubeconfig, reason = controlplane.start_cluster(session_run_dir())
    global SESSION_KUBE
    try:
        SESSION_KUBE = Kube(str(kubeconfig), local=True, helm=helm,
                             real_node=node.NODE_NAME if reason is None else None, real_node_reason=reason)
        yield SESSION_KUBE
    finally:
        SESSION_KUBE = None
        cluster.down(quiet=True)
