"""Faults on the real control plane (localcluster: etcd, kube-apiserver, controller-manager, scheduler, kwok),
with the operator as a real process (`embedops-operator run`, standalone, watching one namespace, resync
60 s, so that what converges here converges through watch events, not the safety-net resync). Each test
counts what was lost; every count must be 0.

* kube-apiserver stopped for 20 s in the middle of a rollout of 50 services, then started;
* etcd restarted in the middle of a spec change of those 50 services;
* the operator SIGKILLed while applying 50 new services, then started again;
* a child edited or deleted by hand, and a field of another manager (an HPA-like one) on a child;
* 100 spec changes to one service within 10 s (coalesced writes, the last one wins).

The figures (times, write counts) are printed with `-s`.
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from tests.integration.operator_process import (CPU_SPEC, GROUP, PLURAL, VERSION, OperatorProcess, children_report,
                                                converged, dump, es_body, install_crd, wait_for)

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(420)]

N = 50
RESYNC = 60


class Env:
    pass


@pytest.fixture(scope="module")
def env(kube, tmp_path_factory):
    from kubernetes import client

    if not kube.local:
        pytest.skip("needs the local control plane (stops and starts its kube-apiserver and etcd)")
    from localcluster.controlplane import Cluster

    e = Env()
    e.kube = kube
    e.cluster = Cluster(run_dir=Path(kube.kubeconfig).parent)
    e.api = kube.api_client()
    install_crd(kube, e.api)
    e.tmp = tmp_path_factory.mktemp("faults")
    with kube.namespace("faults") as ns:
        e.ns = ns
        e.custom, e.apps, e.core = (client.CustomObjectsApi(e.api), client.AppsV1Api(e.api),
                                    client.CoreV1Api(e.api))
        e.op = OperatorProcess("operator", kube.kubeconfig, e.tmp, [
            "-n", ns, f"--resync-seconds={RESYNC}", "--liveness=", "--stall-after-seconds=600"]).start()
        try:
            yield e
        finally:
            e.op.stop()
            for name in ("etcd", "kube-apiserver"):  # never leave the session's cluster half-stopped
                try:
                    e.cluster.start_component(name)
                except Exception as exc:  # noqa: BLE001
                    print(f"could not restart {name}: {exc}")
    e.api.close()


def names(prefix: str) -> list[str]:
    return [f"{prefix}-{i:03d}" for i in range(N)]


def create_all(env, prefix: str, spec: dict) -> None:
    for n in names(prefix):
        env.custom.create_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL, es_body(env.ns, n, spec))


def deployments_of(env, prefix: str) -> int:
    return sum(1 for d in env.apps.list_namespaced_deployment(env.ns).items if d.metadata.name.startswith(prefix))


def ready(env, name: str) -> bool:
    es = env.custom.get_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL, name)
    st = es.get("status") or {}
    conds = {c["type"]: c["status"] for c in st.get("conditions", [])}
    return st.get("observedGeneration") == es["metadata"]["generation"] and conds.get("Ready") == "True"


def not_converged(env, prefix: str, check=ready) -> list[str]:
    out = []
    for n in names(prefix):
        try:
            if not check(env, n):
                out.append(n)
        except Exception:  # noqa: BLE001 - API server still coming back
            out.append(n)
    return out


def assert_nothing_lost(env, prefix: str, timeout: float) -> float:
    """Every service of `prefix` Ready at its generation; exactly one Deployment and one Service each, owned
    by it; no orphaned child in the namespace; one ReplicaSet per Deployment revision; the operator alive
    (never restarted). Returns the seconds until all converged."""
    t0 = time.monotonic()
    left: list[str] = []

    def done():
        nonlocal left
        left = not_converged(env, prefix)
        return not left
    try:
        wait_for(f"all {prefix}-* Ready", done, timeout, 1.0)
    except AssertionError:
        raise AssertionError(f"{len(left)} of {N} not converged: {left[:10]}\n"
                             f"operator log tail:\n{env.op.log()[-4000:]}") from None
    took = time.monotonic() - t0
    rep = children_report(env.custom, env.apps, env.core, env.ns)
    mine = set(names(prefix))
    assert mine <= set(rep["deployments"]) and mine <= set(rep["services"]), dump(rep)
    assert rep["orphans"] == [] and rep["duplicates"] == [], dump(rep)
    assert env.op.alive() and env.op.starts == env.starts, f"operator restarted or died:\n{env.op.log()[-4000:]}"
    return took


# ------------------------------------------------------------------------------------------------------ tests

def test_apiserver_stopped_20s_during_a_rollout_of_50_services(env):
    env.starts = env.op.starts
    time.sleep(3)  # kopf's start-up and initial listing
    assert env.op.alive(), env.op.log()
    t0 = time.monotonic()
    create_all(env, "a", CPU_SPEC)
    # stop the API server in the middle: some Deployments written, most not
    wait_for("a few Deployments", lambda: deployments_of(env, "a-") >= 5, 120, 0.1)
    before = deployments_of(env, "a-")
    log0 = len(env.op.log().splitlines())
    env.cluster.stop_component("kube-apiserver")
    t_stop = time.monotonic()
    time.sleep(20)
    assert env.op.alive(), f"operator died while the API server was down:\n{env.op.log()[-4000:]}"
    took_start = env.cluster.start_component("kube-apiserver")
    t_back = time.monotonic()
    outage_log = env.op.log().splitlines()[log0:]
    # the operator often notices the API server before the harness's /readyz poll does: the outage, for the
    # log count, ends at its "reachable again" line
    back = next((i for i, line in enumerate(outage_log) if "API server reachable again" in line), None)
    if back is not None:
        outage_log = outage_log[:back]
    left = set(names("a"))

    def all_reconciled():  # polls only those not reconciled yet, so the poll itself adds little
        for n in sorted(left):
            try:
                if converged(env.custom, env.apps, env.core, env.ns, n):
                    left.discard(n)
            except Exception:  # noqa: BLE001 - API server still settling
                pass
        return not left
    wait_for("every service reconciled", all_reconciled, 240, 0.25)
    t_reconciled = time.monotonic() - t_back
    recovery_log = env.op.log().splitlines()[log0 + len(outage_log):]
    env.cluster.restart_controllers()  # as leader election would have (else a minute of client-go back-off)

    def available(e, n):
        return (e.apps.read_namespaced_deployment(n, e.ns).status.available_replicas or 0) >= 1
    wait_for("every Deployment available", lambda: not not_converged(env, "a", available), 240, 1.0)
    t_available = time.monotonic() - t_back
    took = assert_nothing_lost(env, "a", 240) + t_available
    print(f"\napiserver down 20 s with {before}/{N} Deployments written (stopped {t_stop - t0:.1f} s after the "
          f"first create); API server ready again after {took_start:.1f} s; then all {N} reconciled after "
          f"{t_reconciled:.1f} s, their Deployments available (controller-manager, scheduler, kwok) after "
          f"{t_available:.1f} s, all Ready after {took:.1f} s; operator restarts: {env.op.starts - env.starts}")
    print(f"operator log during the outage (stop until the API server was reachable): {len(outage_log)} lines; "
          f"then until all reconciled: {len(recovery_log)} lines:\n  " + "\n  ".join(outage_log[:30]))
    # Before the fix services that failed during the outage waited out their back-off (up to 60 s each):
    # the last ones were reconciled 8-23 s after the API server was back; now they are re-queued the moment
    # it answers (2-3 s here). Generous for a loaded 2-core machine; catches a return of the back-off wait.
    assert t_reconciled < 15, f"all reconciled only {t_reconciled:.1f} s after the API server was ready"
    # Before: ~23,000 lines (a traceback per failed reconcile, urllib3 retry warnings, every informer's
    # retries); now one rate-limited line per kind of failure.
    assert len(outage_log) <= 20, "\n".join(outage_log[:60])
    noisy = [line for line in outage_log + recovery_log if "Traceback" in line or "urllib3" in line]
    assert not noisy, "\n".join(noisy[:20])
    assert any("API server reachable again" in line for line in outage_log + recovery_log), \
        "\n".join(recovery_log[:40])


def test_etcd_restarted_during_a_spec_change_of_50_services(env):
    env.starts = env.op.starts
    patch = {"spec": {"batching": {"maxBatchTokens": 2048}}}
    for n in names("a"):
        env.custom.patch_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL, n, patch)
    env.cluster.stop_component("etcd")
    time.sleep(3)
    took_start = env.cluster.start_component("etcd")
    took = assert_nothing_lost(env, "a", 240)

    def rolled(env, name):
        args = env.apps.read_namespaced_deployment(name, env.ns).spec.template.spec.containers[0].args
        return args[args.index("--max-batch-tokens") + 1] == "2048"
    assert not_converged(env, "a", rolled) == []
    print(f"\netcd restarted (3 s down, API server ready {took_start:.1f} s after etcd's start); all {N} "
          f"rolled out and Ready {took:.1f} s later; operator restarts: {env.op.starts - env.starts}")


def test_operator_sigkilled_while_applying_50_services(env):
    # the first batch goes first (its children by garbage collection): nothing may be left behind
    for n in names("a"):
        env.custom.delete_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL, n)
    wait_for("batch a collected", lambda: deployments_of(env, "a-") == 0 and not [
        s for s in env.core.list_namespaced_service(env.ns).items if s.metadata.name.startswith("a-")], 120, 1)
    env.starts = env.op.starts
    create_all(env, "b", CPU_SPEC)
    # kill at the first Deployment written: at 10 the operator once had all 50 written before the list that
    # saw the 10th returned (a loaded machine), and the test then killed an operator that was not applying
    wait_for("the operator applying", lambda: deployments_of(env, "b-") >= 1, 120, 0.02)
    env.op.kill()
    before = deployments_of(env, "b-")
    env.op.start()  # before any assertion: the tests after this one need a running operator
    env.starts = env.op.starts
    assert before < N, "every Deployment was written before the SIGKILL landed: nothing was interrupted"
    took = assert_nothing_lost(env, "b", 240)
    print(f"\noperator SIGKILLed with {before}/{N} Deployments written; after its restart all {N} Ready in "
          f"{took:.1f} s; no orphan, no duplicate")


def test_hand_edits_are_restored_and_other_managers_fields_left_alone(env):
    from kubernetes.client.rest import ApiException

    env.starts = env.op.starts
    name = "b-000"
    dep = env.apps.read_namespaced_deployment(name, env.ns)
    image = dep.spec.template.spec.containers[0].image

    # `kubectl edit deployment`: a field the operator manages
    t0 = time.monotonic()
    env.apps.patch_namespaced_deployment(name, env.ns, {"spec": {"template": {"spec": {"containers": [
        {"name": dep.spec.template.spec.containers[0].name, "image": "example.com/hand-edited:1"}]}}}},
        field_manager="kubectl-edit")
    wait_for("image restored", lambda: env.apps.read_namespaced_deployment(name, env.ns).spec.template.spec
             .containers[0].image == image, 15, 0.1)
    t_edit = time.monotonic() - t0

    # `kubectl delete service`
    t0 = time.monotonic()
    env.core.delete_namespaced_service(name, env.ns)

    def recreated():
        try:
            svc = env.core.read_namespaced_service(name, env.ns)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        return svc.metadata.deletion_timestamp is None and svc
    svc = wait_for("Service recreated", recreated, 15, 0.1)
    t_delete = time.monotonic() - t0
    assert svc.metadata.owner_references[0].name == name

    # a service whose replicas belong to an autoscaler: another manager's replicas stay
    spec = json.loads(json.dumps(CPU_SPEC))
    spec["autoscaling"] = {"minReplicas": 1, "maxReplicas": 5}
    env.custom.create_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL, es_body(env.ns, "scaled", spec))
    wait_for("scaled Ready", lambda: ready(env, "scaled"), 90, 0.5)
    body = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "scaled", "namespace": env.ns},
            "spec": {"replicas": 3}}
    env.apps.patch_namespaced_deployment("scaled", env.ns, body, field_manager="hpa-like-autoscaler",
                                         force=True, _content_type="application/apply-patch+yaml")
    # provoke reconciles: a hand edit of a managed field (restored) and a spec change
    c0 = env.apps.read_namespaced_deployment("scaled", env.ns).spec.template.spec.containers[0]
    env.apps.patch_namespaced_deployment("scaled", env.ns, {"spec": {"template": {"spec": {"containers": [
        {"name": c0.name, "image": "example.com/hand-edited:2"}]}}}}, field_manager="kubectl-edit")
    wait_for("scaled image restored", lambda: env.apps.read_namespaced_deployment(
        "scaled", env.ns).spec.template.spec.containers[0].image == c0.image, 15, 0.1)
    env.custom.patch_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL, "scaled",
                                              {"spec": {"batching": {"maxBatchTokens": 2048}}})
    wait_for("scaled at its new generation", lambda: ready(env, "scaled"), 90, 0.5)
    d = env.apps.read_namespaced_deployment("scaled", env.ns)
    owners = {m.manager: json.dumps(m.fields_v1) for m in d.metadata.managed_fields}
    assert d.spec.replicas == 3, owners
    assert '"f:replicas"' in owners["hpa-like-autoscaler"] and '"f:replicas"' not in owners.get("embedops", "")
    print(f"\nhand edit of a managed field restored in {t_edit:.2f} s, deleted Service recreated in "
          f"{t_delete:.2f} s (resync is {RESYNC} s: both by the child's own watch event); another manager's "
          "spec.replicas=3 kept through a restore and a spec change")
    assert t_edit < 10 and t_delete < 10
    assert env.op.alive() and env.op.starts == env.starts


def test_100_spec_changes_in_10s_are_coalesced_and_the_last_wins(env):
    env.starts = env.op.starts
    name = "b-001"
    wait_for("b-001 Ready", lambda: ready(env, name), 60)
    gen0 = env.apps.read_namespaced_deployment(name, env.ns).metadata.generation
    rv_changes = []
    stop = threading.Event()

    def watch():
        from kubernetes import client, watch as kwatch

        api = env.kube.api_client()
        w = kwatch.Watch()
        try:
            for ev in w.stream(client.AppsV1Api(api).list_namespaced_deployment, env.ns,
                               field_selector=f"metadata.name={name}", timeout_seconds=120):
                meta = ev["object"].metadata
                rv_changes.append((ev["type"], meta.resource_version, meta.generation))
                if stop.is_set():
                    break
        except Exception:  # noqa: BLE001 - the stream ending at the test's end
            pass
        finally:
            w.stop()
            api.close()
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    time.sleep(1)
    t0 = time.monotonic()
    for i in range(100):
        env.custom.patch_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL, name,
                                                  {"spec": {"batching": {"maxBatchTokens": 1000 + i}}})
        time.sleep(max(0.0, t0 + (i + 1) * 0.1 - time.monotonic()))
    t_changes = time.monotonic() - t0
    final_gen = env.custom.get_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL, name)["metadata"]["generation"]

    def last_wins():
        d = env.apps.read_namespaced_deployment(name, env.ns)
        args = d.spec.template.spec.containers[0].args
        return args[args.index("--max-batch-tokens") + 1] == "1099" and ready(env, name)
    wait_for("the last change applied and Ready", last_wins, 90, 0.5)
    stop.set()
    time.sleep(1)
    gen1 = env.apps.read_namespaced_deployment(name, env.ns).metadata.generation
    spec_writes = gen1 - gen0
    gens = sorted({g for _, _, g in rv_changes})
    print(f"\n100 spec changes in {t_changes:.1f} s (EmbeddingService generation {final_gen}): the Deployment's "
          f"spec was written {spec_writes} times (generation {gen0} -> {gen1}); {len(rv_changes)} watch events "
          f"(resourceVersion changes incl. the Deployment controller's status) over generations {gens[:3]}...")
    assert spec_writes <= 15, spec_writes  # 28 before the work queue's coalescing window
    assert env.op.alive() and env.op.starts == env.starts
