"""With every MIG slice in use, the next EmbeddingService asking for one ends Stalled (kstatus Failed)."""
from __future__ import annotations

import pytest

from tests.e2e.conftest import condition, is_true, operator_log, skip_unless_simulated_nodes, wait_for
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


def test_no_free_slice_ends_stalled(kube, embsvc, operator):
    skip_unless_simulated_nodes(kube)
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


def _ready_pods(embsvc, name: str) -> int:
    return sum(1 for p in embsvc.pods(name) if not p.metadata.deletion_timestamp and any(
        c.type == "Ready" and c.status == "True" for c in p.status.conditions or []))


def _rolled_out(embsvc, name: str, replicas: int):
    d = embsvc.deployment(name)
    st = d.status
    done = (st.observed_generation or 0) >= d.metadata.generation and (st.updated_replicas or 0) == replicas \
        and (st.available_replicas or 0) == replicas and (st.replicas or 0) == replicas
    return d if done else None


def _change_and_watch(embsvc, name: str, tokens: int, replicas: int) -> tuple[object, int, float]:
    """Change the service's pod template and wait for the rollout's end, sampling its Ready pods meanwhile:
    (the Deployment, the fewest Ready pods seen, seconds)."""
    import time

    before = embsvc.deployment(name).metadata.annotations["embedops.dev/template-hash"]
    embsvc.co.patch_namespaced_custom_object("embedops.dev", "v1alpha1", embsvc.ns, "embeddingservices", name,
                                             {"spec": {"batching": {"maxBatchTokens": tokens}}})
    t0, fewest = time.monotonic(), replicas
    while time.monotonic() - t0 < 180:
        d = _rolled_out(embsvc, name, replicas)
        if d is not None and d.metadata.annotations["embedops.dev/template-hash"] != before:
            return d, fewest, time.monotonic() - t0
        fewest = min(fewest, _ready_pods(embsvc, name))
        time.sleep(0.2)
    pytest.fail(f"{name}'s rollout did not end: {embsvc.deployment(name).status}\n"
                f"pods: {pod_summary(embsvc.pods(name))}")


def test_a_rollout_surges_where_a_slice_is_free_and_gives_one_up_on_a_full_node(kube, embsvc, operator):
    """Issue 36: a single MIG replica rolls without going down while a slice is free (a surge); on a full node
    the surge pod cannot be scheduled and the operator switches that rollout to giving an old replica's slice up
    first, so it ends instead of deadlocking; the next rollout tries a surge again."""
    skip_unless_simulated_nodes(kube)
    wait_for(lambda: settled(embsvc.core), timeout=120, what="earlier tests' namespaces to be deleted")
    free = free_slices(embsvc.core)
    assert free >= 2, free
    embsvc.create(mig_service("surging", 1))
    embsvc.wait_condition("surging", "Ready", timeout=240)

    d, fewest, took = _change_and_watch(embsvc, "surging", 8192, 1)
    print(f"with {free - 1} slices free: rolled in {took:.1f} s, fewest Ready pods {fewest}, "
          f"strategy {d.spec.strategy.rolling_update}")
    assert (d.spec.strategy.rolling_update.max_surge, d.spec.strategy.rolling_update.max_unavailable) == (1, 0)
    assert "embedops.dev/surge-refused" not in d.metadata.annotations
    assert fewest == 1  # never down for a model load

    embsvc.create(mig_service("mig-filler-2", free - 1))
    try:
        embsvc.wait_condition("mig-filler-2", "Ready", timeout=240)
        assert free_slices(embsvc.core) == 0
        d, fewest, took = _change_and_watch(embsvc, "surging", 4096, 1)
        annotations = d.metadata.annotations
        print(f"on a full node: rolled in {took:.1f} s, fewest Ready pods {fewest}, "
              f"strategy {d.spec.strategy.rolling_update}")
        assert (d.spec.strategy.rolling_update.max_surge, d.spec.strategy.rolling_update.max_unavailable) == (0, 1)
        assert annotations["embedops.dev/surge-refused"] == annotations["embedops.dev/template-hash"]
        assert not is_true(embsvc.get("surging"), "Stalled")
    finally:
        embsvc.delete("mig-filler-2")
    wait_for(lambda: not embsvc.pods("mig-filler-2"), timeout=240, what="filler pods gone")
    d, fewest, took = _change_and_watch(embsvc, "surging", 2048, 1)
    print(f"slices free again: rolled in {took:.1f} s, fewest Ready pods {fewest}")
    assert (d.spec.strategy.rolling_update.max_surge, d.spec.strategy.rolling_update.max_unavailable) == (1, 0)
    embsvc.delete("surging")
