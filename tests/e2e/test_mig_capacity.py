"""With every MIG slice in use, the next EmbeddingService asking for one ends Stalled (kstatus Failed)."""
from __future__ import annotations

import pytest

from tests.e2e.conftest import condition, is_true, operator_log, wait_for
from tests.e2e.kstatus import kstatus

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

RESOURCE = "nvidia.com/mig-1g.10gb"


def mig_service(name: str, replicas: int) -> dict:
    return {
        "apiVersion": "embedops.dev/v1alpha1", "kind": "EmbeddingService", "metadata": {"name": name},
        "spec": {"model": {"id": "BAAI/bge-small-en-v1.5", "task": "embed"},
                 "accelerator": {"mig": {"product": "H100-80GB", "profile": "1g.10gb"}},
                 "replicas": replicas},
    }


def free_slices(core) -> int:
    nodes = [n for n in core.list_node().items if int((n.status.allocatable or {}).get(RESOURCE, "0")) > 0]
    assert nodes, f"no node advertises {RESOURCE}"
    total = sum(int(n.status.allocatable[RESOURCE]) for n in nodes)
    names = {n.metadata.name for n in nodes}
    used = 0
    for p in core.list_pod_for_all_namespaces().items:
        if p.spec.node_name in names and p.status.phase not in ("Succeeded", "Failed"):
            for c in p.spec.containers:
                used += int(((c.resources and c.resources.limits) or {}).get(RESOURCE, "0"))
    return total - used


def settled(core) -> bool:
    """No pod holding a slice is on its way out (deleted, or in a namespace being deleted): slice
    accounting is stable."""
    terminating = {n.metadata.name for n in core.list_namespace().items if n.status.phase == "Terminating"}
    for p in core.list_pod_for_all_namespaces().items:
        holds = any(int(((c.resources and c.resources.limits) or {}).get(RESOURCE, "0")) for c in p.spec.containers)
        if holds and (p.metadata.deletion_timestamp or p.metadata.namespace in terminating):
            return False
    return True


def pod_summary(pods) -> list[str]:
    """Where each pod is and what its conditions say (for failure messages: scheduler vs kwok vs operator)."""
    out = []
    for p in pods:
        conds = ", ".join(f"{c.type}={c.status}{'/' + c.reason if c.reason else ''}"
                          f"{': ' + c.message[:160] if c.message else ''}" for c in (p.status.conditions or []))
        out.append(f"{p.metadata.name} node={p.spec.node_name} phase={p.status.phase} "
                   f"deleting={bool(p.metadata.deletion_timestamp)} [{conds}]")
    return out


def _t(msg, t0=[None]):
    import time
    t0[0] = t0[0] or time.monotonic()
    print(f"[{time.monotonic() - t0[0]:6.1f}s] {msg}")


def test_no_free_slice_ends_stalled(embsvc, operator):
    _t("start")
    wait_for(lambda: settled(embsvc.core), timeout=120, what="earlier tests' namespaces to be deleted")
    free = free_slices(embsvc.core)
    _t(f"settled, {free} free slices")
    assert free >= 1
    filler = mig_service("mig-filler", free)
    embsvc.create(filler)
    try:
        obj = embsvc.wait_condition("mig-filler", "Ready", timeout=240)
    except AssertionError:
        pytest.fail(f"filler never Ready: {embsvc.get('mig-filler').get('status')}\n"
                    f"pods: {pod_summary(embsvc.pods('mig-filler'))}\n{operator_log(operator)}")
    assert kstatus(obj)["status"] == "Current"
    assert free_slices(embsvc.core) == 0
    _t("filler Ready")

    embsvc.create(mig_service("one-too-many", 1))

    def stalled():
        o = embsvc.get("one-too-many")
        return o if is_true(o, "Stalled") else None
    try:
        obj = wait_for(stalled, timeout=120, what="one-too-many Stalled")
    except AssertionError:
        pytest.fail(f"not Stalled: {embsvc.get('one-too-many').get('status')}\n{operator_log(operator)}")
    _t("one-too-many Stalled")
    st = condition(obj, "Stalled")
    assert st["reason"], st
    assert "mig" in (st.get("message") or "").lower() or "slice" in (st.get("message") or "").lower() \
        or "insufficient" in (st.get("message") or "").lower(), st
    assert condition(obj, "Ready")["status"] == "False"
    assert kstatus(obj)["status"] == "Failed"
    # the pod is really unschedulable, not merely slow
    pods = embsvc.pods("one-too-many")
    assert pods and all(p.spec.node_name is None for p in pods)

    # freeing slices lets it through: the Stalled condition clears and it becomes Ready
    embsvc.delete("mig-filler")
    wait_for(lambda: not embsvc.pods("mig-filler"), timeout=240, what="filler pods gone")
    _t("filler pods gone")
    wait_for(lambda: any(p.spec.node_name for p in embsvc.pods("one-too-many")), timeout=240,
             what="one-too-many scheduled")
    _t("one-too-many pod scheduled")
    obj = embsvc.wait_condition("one-too-many", "Ready", timeout=240)
    _t("one-too-many Ready after the filler went")
    assert not is_true(obj, "Stalled")
    assert kstatus(obj)["status"] == "Current"
