"""Vectors are state under faults (issue 52): a migration between embedding spaces on the real control plane
(localcluster: kube-apiserver, etcd, controller-manager, scheduler, kwok nodes), with the operator as a real process,
and ordinary faults during it. The invariants, checked on every version of the service's Service and Deployments the
API server sent (a watch per kind, `History`):

* the address (the Service's selector) never names a space that was not promoted;
* nothing that served is deleted, except `keepPreviousSeconds` after it stopped serving;
* the service converges (the address on the promoted space, the status saying so).

The faults: the Service deleted, and edited to select the candidate, while a new space awaits its promotion; a new
space that gets 2 of its 3 replicas (Stalled within the stall time, with the scheduler's reason); the operator
SIGKILLed after each write of a promotion and of a rollback, in turn (`crashing_operator.py`); and the operator killed
at random moments during repeated migrations and restarted at once, as a kubelet would. Figures are printed (`-s`).
"""
from __future__ import annotations

import copy
import datetime as dt
import random
import threading
import time

import pytest

from tests.integration.operator_process import (CPU_SPEC, GROUP, PLURAL, VERSION, OperatorProcess, es_body,
                                                operator_env, wait_for)

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]

INSTANCE = "app.kubernetes.io/instance"
STALL = 5  # --stall-after-seconds
SPEC = {**copy.deepcopy(CPU_SPEC), "replicas": 2, "migration": {"keepPreviousSeconds": 86400}}


@pytest.fixture(scope="module")
def env(kube, tmp_path_factory):
    with operator_env(kube, tmp_path_factory.mktemp("space-faults"), "space-faults") as e:
        yield e


def operator(env, name: str = "operator", kill_after: int | None = None) -> OperatorProcess:
    """The operator as a process (resync 60 s: what converges here converges through watch events); with
    `kill_after`, one that SIGKILLs itself right after its N-th write."""
    args = ["-n", env.ns, "--resync-seconds=60", f"--stall-after-seconds={STALL}"]
    if kill_after is None:
        p = OperatorProcess(name, env.kubeconfig, env.tmp, args)
    else:
        p = OperatorProcess(name, env.kubeconfig, env.tmp, args, module="tests.integration.crashing_operator",
                            env={"EMBEDOPS_TEST_KILL_AFTER_WRITES": str(kill_after)})
    env.procs.append(p)
    return p.start()


class History:
    """Every version of the service's Services and Deployments the API server sends (one watch per kind, its own
    thread and API client), with the time it arrived: what the invariants are checked on."""

    def __init__(self, env, service: str):
        self.env, self.service = env, service
        self.seen: list[tuple[float, str, str, str, dict]] = []  # (time, kind, event type, name, object)
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.listed = {kind: threading.Event() for kind in ("Service", "Deployment")}
        self.threads = [threading.Thread(target=self._watch, args=(kind,), daemon=True) for kind in self.listed]
        for t in self.threads:
            t.start()
        wait_for("the watches started", lambda: all(e.is_set() for e in self.listed.values()), 30)

    def _watch(self, kind: str) -> None:
        from kubernetes import client, watch
        from kubernetes.client.rest import ApiException

        api = self.env.kube.api_client()
        fn = client.CoreV1Api(api).list_namespaced_service if kind == "Service" else \
            client.AppsV1Api(api).list_namespaced_deployment
        selector = f"embedops.dev/service={self.service}"
        rv = None
        while not self.stopping.is_set():
            try:
                if rv is None:
                    listed = fn(self.env.ns, label_selector=selector)
                    rv = listed.metadata.resource_version
                    for item in listed.items:
                        self._record(kind, "LISTED", api.sanitize_for_serialization(item))
                    self.listed[kind].set()
                for ev in watch.Watch().stream(fn, self.env.ns, label_selector=selector, resource_version=rv,
                                               timeout_seconds=5, allow_watch_bookmarks=False):
                    obj = api.sanitize_for_serialization(ev["object"])
                    rv = obj["metadata"]["resourceVersion"]
                    self._record(kind, ev["type"], obj)
                    if self.stopping.is_set():
                        break
            except ApiException as exc:
                if exc.status == 410:
                    rv = None
                time.sleep(0.2)
            except Exception:  # noqa: BLE001 - a dropped stream: resume from the last version
                time.sleep(0.2)
        api.close()

    def _record(self, kind: str, typ: str, obj: dict) -> None:
        with self.lock:
            self.seen.append((time.monotonic(), kind, typ, obj["metadata"]["name"], obj))

    def stop(self) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join(10)

    def address(self) -> list[tuple[float, str | None]]:
        """The instance the service's own Service selected, in order (None: deleted); repeats dropped."""
        out: list[tuple[float, str | None]] = []
        with self.lock:
            for t, kind, typ, name, obj in self.seen:
                if kind != "Service" or name != self.service:
                    continue
                sel = None if typ == "DELETED" else ((obj.get("spec") or {}).get("selector") or {}).get(INSTANCE)
                if not out or out[-1][1] != sel:
                    out.append((t, sel))
        return out

    def deleted(self) -> list[tuple[float, str, dict]]:
        """Deployments deleted: (time, name, its last version seen)."""
        with self.lock:
            return [(t, name, obj) for t, kind, typ, name, obj in self.seen
                    if kind == "Deployment" and typ == "DELETED"]

    def first_available(self, deployment: str) -> float | None:
        """When `deployment` was first seen with every replica of its current template available."""
        with self.lock:
            for t, kind, typ, name, obj in self.seen:
                if kind != "Deployment" or name != deployment or typ == "DELETED":
                    continue
                st, want = obj.get("status") or {}, (obj.get("spec") or {}).get("replicas", 1)
                if want and st.get("availableReplicas", 0) >= want and st.get("updatedReplicas", 0) >= want and \
                        st.get("observedGeneration", 0) >= obj["metadata"].get("generation", 0):
                    return t
        return None


def delete(env, name: str) -> None:
    env.custom.delete_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL, name)


def get(env, name: str) -> dict:
    return env.custom.get_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL, name)


def patch(env, name: str, spec: dict) -> None:
    env.custom.patch_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL, name, {"spec": spec})


def conditions(es: dict) -> dict[str, dict]:
    return {c["type"]: c for c in (es.get("status") or {}).get("conditions") or []}


def by_role(es: dict) -> dict[str, dict]:
    return {x["role"]: x for x in (es.get("status") or {}).get("spaces") or []}


def current(env, name: str, **want) -> dict | None:
    """The service once its status is of its generation and each condition type given has the (status, reason)."""
    es = get(env, name)
    if (es.get("status") or {}).get("observedGeneration") != es["metadata"]["generation"]:
        return None
    conds = conditions(es)
    for ctype, (st, reason) in want.items():
        c = conds.get(ctype) or {}
        if c.get("status") != st or (reason is not None and c.get("reason") != reason):
            return None
    return es


def selects(env, name: str) -> str | None:
    from kubernetes.client.rest import ApiException

    try:
        svc = env.core.read_namespaced_service(name, env.ns)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return (svc.spec.selector or {}).get(INSTANCE)


def events(env, name: str, reason: str) -> list:
    return [e for e in env.core.list_namespaced_event(env.ns, field_selector=f"involvedObject.name={name}").items
            if e.reason == reason]


def awaiting_promotion(env, name: str, spec: dict) -> tuple[dict, dict]:
    """A service Ready on its first space, then `model.pooling: cls`: (the serving space, the candidate) once the
    candidate's replicas are all available and it waits for its promotion."""
    env.custom.create_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL, es_body(env.ns, name, spec))
    wait_for(f"{name} Ready", lambda: current(env, name, Ready=("True", None)), 120)
    patch(env, name, {"model": {"pooling": "cls"}})
    es = wait_for(f"{name}'s new space awaiting promotion",
                  lambda: current(env, name, Promoted=("False", "AwaitingPromotion")), 120)
    return by_role(es)["serving"], by_role(es)["candidate"]


def test_a_deleted_or_edited_service_never_moves_the_address_to_an_unpromoted_space(env):
    """Issue 52's fault: `kubectl delete svc` while a new space waits for its promotion made the operator recreate
    the Service selecting that space (517 of 566 answers from it) and delete the Deployment that served. Now the
    address comes back on the serving space, both spaces keep running, and an Event says what was repaired."""
    op = operator(env, "op-deleted")
    name = "deleted"
    hist = History(env, name)
    try:
        old, cand = awaiting_promotion(env, name, SPEC)
        assert selects(env, name) == old["deployment"] == name
        ip = env.core.read_namespaced_service(name, env.ns).spec.cluster_ip
        wait_for("the cluster IP in the status", lambda: (env.custom.get_namespaced_custom_object(
            GROUP, VERSION, env.ns, PLURAL, name).get("status") or {}).get("clusterIP") == ip, 30)
        t0 = time.monotonic()
        env.core.delete_namespaced_service(name, env.ns)
        wait_for("the Service recreated", lambda: selects(env, name), 60)
        recreated = time.monotonic() - t0
        assert selects(env, name) == old["deployment"]
        # at the address it had: clients that resolved the name before reach it again
        assert env.core.read_namespaced_service(name, env.ns).spec.cluster_ip == ip
        # someone else's edit: the selector names the candidate
        t0 = time.monotonic()
        env.core.patch_namespaced_service(name, env.ns, {"spec": {"selector": {INSTANCE: cand["deployment"]}}})
        wait_for("the selector written back", lambda: selects(env, name) == old["deployment"], 60)
        restored = time.monotonic() - t0
        time.sleep(2)  # a late reconcile would show here
        es = wait_for("status current", lambda: current(env, name, Promoted=("False", "AwaitingPromotion"),
                                                        Ready=("True", None)), 60)
        roles = by_role(es)
        assert roles["serving"]["key"] == old["key"] and roles["candidate"]["key"] == cand["key"], roles
        repaired = events(env, name, "AddressRepaired")
        print(f"Service deleted: recreated on the serving space, at its cluster IP {ip}, in {recreated:.2f} s; "
              f"selector edited to the "
              f"candidate: written back in {restored:.2f} s; AddressRepaired events: {len(repaired)}")
        assert len(repaired) >= 2 and any("was missing" in e.message for e in repaired), \
            [e.message for e in repaired]
        deps = {d.metadata.name for d in env.apps.list_namespaced_deployment(env.ns).items}
        assert {old["deployment"], cand["deployment"]} <= deps
    finally:
        hist.stop()
        op.stop()
    assert hist.deleted() == [], [n for _, n, _ in hist.deleted()]
    # every selector the Service had: the serving space's, or gone, or the one edit this test made
    seen = [sel for _, sel in hist.address()]
    assert seen.count(cand["deployment"]) == 1 and set(seen) <= {old["deployment"], cand["deployment"], None}, seen
    assert seen[-1] == old["deployment"] and "never served" not in op.log(), op.log()[-3000:]
    delete(env, name)


def test_a_new_space_that_gets_two_of_its_three_replicas_is_stalled_with_the_schedulers_reason(env):
    """Issue 52: a candidate with one replica Pending (Insufficient memory) said `Promoted=False Starting` and
    `Stalled=False` for minutes; kstatus and Flux would wait for it forever. The kwok nodes have 256 and 64 GiB:
    three replicas of 120 GiB get two nodes' worth of room for two."""
    op = operator(env, "op-stalled")
    name = "partial"
    try:
        spec = {**copy.deepcopy(SPEC), "replicas": 3}
        env.custom.create_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL, es_body(env.ns, name, spec))
        wait_for(f"{name} Ready", lambda: current(env, name, Ready=("True", None)), 120)
        t0 = time.monotonic()
        patch(env, name, {"model": {"pooling": "cls"}, "accelerator": {"cpu": {"cores": 1, "memory": "120Gi"}}})
        es = wait_for("Stalled", lambda: current(env, name, Stalled=("True", "Unschedulable")), STALL + 60)
        took = time.monotonic() - t0
        conds = conditions(es)
        print(f"a new space with 2 of 3 replicas schedulable: Stalled after {took:.1f} s (stall time {STALL} s): "
              f"{conds['Promoted']['message']}")
        assert conds["Ready"]["status"] == "True" and conds["Reconciling"]["status"] == "False"
        assert conds["Promoted"]["reason"] == "Unschedulable"
        assert "Insufficient memory" in conds["Promoted"]["message"] and "(2/3 replicas available)" in \
            conds["Promoted"]["message"], conds["Promoted"]["message"]
        assert took < STALL + 30
        assert selects(env, name) == name
        # room made (the spec's memory back): the same space's track rolls, and the stall clears
        patch(env, name, {"accelerator": {"cpu": {"cores": 1, "memory": "1Gi"}}})
        wait_for("the stall cleared", lambda: current(env, name, Stalled=("False", None),
                                                       Promoted=("False", "AwaitingPromotion")), 120)
        delete(env, name)
    finally:
        op.stop()


def serves(env, name: str, target: dict) -> bool:
    """The address selects `target`'s track and the status of the current generation says it serves (a rollback
    leaves Promoted False: the spec's own space then waits for a promotion again)."""
    es = current(env, name)
    return selects(env, name) == target["deployment"] and es is not None and \
        by_role(es).get("serving", {}).get("key") == target["key"]


def promotion_crashes(env, name: str, target: dict, k: int) -> tuple[bool, str]:
    """`migration.promote: <target>` with the operator killed right after its k-th write; a normal operator then
    takes over. Returns (whether the kill happened, the write it died after)."""
    patch(env, name, {"migration": {"promote": target["key"]}})
    crashing = operator(env, f"op-crash-{name}-{k}", kill_after=k)
    done = wait_for("killed, or the promotion done",
                    lambda: not crashing.alive() or serves(env, name, target), 90)
    killed = not crashing.alive()
    if not killed:
        crashing.stop()
    last = [line for line in crashing.log().splitlines() if line.startswith("crashpoint:")]
    assert done
    return killed, (last[-1] if last else "")


def test_a_promotion_survives_the_operator_killed_after_each_of_its_writes(env):
    """Crash safety, deterministically: for k = 1, 2, ...: promote with an operator that dies right after its k-th
    write (the API server answered it), start a new one, check; the same for the rollback; until an operator
    finishes without reaching its k-th write. After each: the address on the named space, Promoted=True, both
    spaces running (keepPreviousSeconds is a day), and over the whole run no Deployment deleted and no selector
    other than the two promoted spaces'."""
    name = "crash"
    normal = operator(env, "op-crash-setup")
    hist = History(env, name)
    points: list[str] = []
    try:
        old, cand = awaiting_promotion(env, name, SPEC)
        normal.stop()
        k, finished = 0, False
        while not finished:
            k += 1
            assert k <= 40, "a promotion takes more than 40 writes?"
            finished = True
            for target in (cand, old):  # promote, then roll back
                killed, last = promotion_crashes(env, name, target, k)
                if killed:
                    finished = False
                    points.append(f"{'promote' if target is cand else 'rollback'} killed after {last}")
                    recovering = operator(env, f"op-recover-{k}-{target['key']}")
                    wait_for(f"converged after the kill at write {k}", lambda t=target: serves(env, name, t), 90)
                    recovering.stop()
                es = get(env, name)
                roles = by_role(es)
                assert roles["serving"]["key"] == target["key"], (k, roles)
                assert {x["key"] for x in es["status"]["spaces"]} == {old["key"], cand["key"]}, es["status"]["spaces"]
        print(f"promotion and rollback, the operator killed after each write: {k - 1} kill points each way, "
              "0 invariant violations:\n  " + "\n  ".join(points))
    finally:
        hist.stop()
    assert hist.deleted() == [], [n for _, n, _ in hist.deleted()]
    assert {sel for _, sel in hist.address()} <= {old["deployment"], cand["deployment"]}, hist.address()
    first_new = next(t for t, sel in hist.address() if sel == cand["deployment"])
    assert hist.first_available(cand["deployment"]) <= first_new
    delete(env, name)


def test_repeated_migrations_with_the_operator_killed_at_random(env):
    """Knative-style chaos: `promotion: Immediate`, `keepPreviousSeconds: 3`, eight changes of the space in a row, the
    operator SIGKILLed every 1.5-5 s (seeded; it takes about 1.5 s to start) and started again at once. Invariants
    over every version seen: the address only ever names a space once all its replicas were available (what
    Immediate promotes); no Deployment is deleted while the address names it, nor a space that served before 3 s
    after its retirement; at the end the address is on the spec's space and only that space runs."""
    keep = 3
    name = "chaos"
    seed = int(time.time()) % 10000
    rnd = random.Random(seed)
    spec = {**copy.deepcopy(SPEC), "migration": {"promotion": "Immediate", "keepPreviousSeconds": keep}}
    setup = operator(env, "op-chaos-setup")
    env.custom.create_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL, es_body(env.ns, name, spec))
    wait_for(f"{name} Ready", lambda: current(env, name, Ready=("True", None)), 120)
    setup.stop()
    hist = History(env, name)
    stop = threading.Event()
    kills: list[float] = []
    procs: list[OperatorProcess] = [operator(env, "op-chaos-0")]

    def chaos():
        while not stop.wait(rnd.uniform(1.5, 5)):
            procs[-1].kill()
            kills.append(time.monotonic())
            procs.append(operator(env, f"op-chaos-{len(procs)}"))
    killer = threading.Thread(target=chaos, daemon=True)
    killer.start()
    poolings = ["cls", "mean", "last-token", "cls", "mean", "last-token", "cls", "mean"]
    t0 = time.monotonic()
    try:
        try:
            for pooling in poolings:
                patch(env, name, {"model": {"pooling": pooling}})
                wait_for(f"pooling {pooling} serving", lambda: current(env, name, Promoted=("True", "Serving")), 240,
                         0.5)
        finally:
            stop.set()
            killer.join(15)
        es = wait_for("one space left", lambda: (lambda e: e if e and len(e["status"].get("spaces") or []) == 1
                                                 else None)(current(env, name, Ready=("True", None))), keep + 120)
    finally:
        procs[-1].stop()
        hist.stop()
    took = time.monotonic() - t0
    serving = es["status"]["spaces"][0]
    assert "pooling mean" in serving["model"] and selects(env, name) == serving["deployment"]
    violations = []
    address = hist.address()
    for t, sel in address:
        if sel is None:
            continue
        up = hist.first_available(sel)
        if up is None or up > t + 1.0:
            violations.append(f"the address selected {sel} before all its replicas were available")
    for t, dep, last in hist.deleted():
        selected = [s for at, s in address if at <= t]
        if selected and selected[-1] == dep:
            violations.append(f"{dep} deleted while the address selected it")
        annotations = last["metadata"].get("annotations") or {}
        retired = annotations.get("embedops.dev/retired-at")
        if dep in {s for _, s in address} or annotations.get("embedops.dev/serving-epoch"):
            if not retired:
                violations.append(f"{dep} served and was deleted without a retirement")
            else:
                age = (dt.datetime.now(dt.timezone.utc) - dt.datetime.fromisoformat(retired.replace("Z", "+00:00"))
                       ).total_seconds() - (time.monotonic() - t)
                if age < keep - 1:  # the annotation has one-second resolution
                    violations.append(f"{dep} deleted {age:.1f} s after its retirement")
    print(f"chaos: kills at {[round(k - t0, 1) for k in kills]} s, {len(procs)} operator starts")
    print(f"chaos (seed {seed}): {len(poolings)} migrations, {len(kills)} operator kills, {took:.0f} s, "
          f"{len(address)} address changes, {len(hist.deleted())} Deployments removed, "
          f"{len(violations)} invariant violations")
    assert kills, "the operator was never killed"
    assert not violations, violations
    delete(env, name)
