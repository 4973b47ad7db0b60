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


# `make test` runs two pytest processes side by side (scripts/test-lanes.sh): the tests that share the one local
# cluster (its control plane, real node, images and operator processes), in order, and beside them the tests that
# need no cluster. Most of the cluster tests' time is waiting (pods, scrapes, autoscaler windows), so the other
# core does the CPU-bound server tests meanwhile. The lane is chosen by folder, so a new test lands in one.
CLUSTER_LANE_DIRS = ("tests/e2e/", "tests/integration/", "tests/cluster/")
NO_CLUSTER_FILES = ("tests/cluster/test_build_script.py",)  # runs the built binaries, writes nothing shared


def pytest_collection_modifyitems(config, items):
    for item in items:
        rel = item.path.relative_to(REPO).as_posix()
        if rel.startswith(CLUSTER_LANE_DIRS) and rel not in NO_CLUSTER_FILES:
            item.add_marker(pytest.mark.cluster_lane)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if REQUIRE_ALL and report.skipped and not hasattr(report, "wasxfail") and not item.get_closest_marker("opt_in"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped, and EMBEDOPS_REQUIRE_ALL=1 (CI) allows no skip: {reason}"


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

    cluster, kubeconfig, reason = controlplane.start_cluster(controlplane.default_run_dir() / "pytest")
    try:
        yield Kube(str(kubeconfig), local=True, helm=helm,
                   real_node=node.NODE_NAME if reason is None else None, real_node_reason=reason)
    finally:
        cluster.down(quiet=True)
