"""HA: two real operator processes (`embedops-operator run --leader-elect`, the chart's ServiceAccount and RBAC)
against the real control plane. One holds the Lease and reconciles; the other only waits (and answers its
liveness probe). SIGKILL the leader: the follower holds the Lease and has reconciled a service created right
after the kill within 20 s. SIGTERM hands the Lease over at once; a leader whose Lease is taken exits 1.
"""
from __future__ import annotations

import json
import signal
import threading
import time
import urllib.request

import pytest

from localcluster.pki import free_port
from tests.integration.operator_process import (CPU_SPEC, GROUP, PLURAL, VERSION, OperatorProcess, converged,
                                                es_body, operator_env, settle_after_outage, wait_for)

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

LEASE = "ha-embedops-operator"  # the chart's --leader-election-id for release "ha"
TAKEOVER_LIMIT = 20.0  # at most leaseDuration + 2 x retryPeriod = 19 s with the defaults 15/10/2


@pytest.fixture(scope="module")
def env(kube, tmp_path_factory):
    if not kube.helm:
        pytest.skip("helm not available (make cluster-binaries): the test runs with the chart's RBAC")
    with operator_env(kube, tmp_path_factory.mktemp("ha"), "ha", chart_rbac=True) as e:
        yield e


def operator(env, name: str) -> tuple[OperatorProcess, int]:
    port = free_port()
    p = OperatorProcess(name, env.kubeconfig, env.tmp, [
        "-n", env.ns, "--leader-elect", f"--leader-election-id={LEASE}", f"--leader-election-namespace={env.ns}",
        f"--liveness=http://127.0.0.1:{port}/healthz", "--resync-seconds=30"])
    env.procs.append(p)
    return p.start(), port


def holder(env) -> str:
    try:
        return env.coord.read_namespaced_lease(LEASE, env.ns).spec.holder_identity or ""
    except Exception:  # noqa: BLE001
        return ""


def healthz(port: int):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
        return r.status, r.read()


def create(env, name: str) -> None:
    env.custom.create_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL, es_body(env.ns, name, CPU_SPEC))


def test_one_leader_reconciles_and_the_follower_takes_over_within_20s(env):
    a, _ = operator(env, "op-a")
    wait_for("op-a holds the Lease", lambda: holder(env).startswith("op-a_"), 60)
    b, b_port = operator(env, "op-b")
    # the follower answers its liveness probe (kopf, which normally serves it, is not running there)
    status, body = wait_for("op-b /healthz", lambda: healthz(b_port), 30)
    assert status == 200 and json.loads(body) == {"leader": False}
    wait_for("op-b follows op-a", lambda: "following op-a_" in b.log(), 30)

    create(env, "before")
    wait_for("'before' reconciled by the leader",
             lambda: converged(env.custom, env.apps, env.core, env.ns, "before"), 60)
    assert holder(env).startswith("op-a_")
    assert "applied" in a.log()
    assert "applied" not in b.log() and "kopf" not in b.log(), b.log()[-3000:]  # the follower wrote nothing
    transitions = env.coord.read_namespaced_lease(LEASE, env.ns).spec.lease_transitions or 0

    # SIGKILL the leader; a new service right after
    t0 = time.monotonic()
    a.signal(signal.SIGKILL)
    create(env, "after-kill")
    wait_for("op-b holds the Lease", lambda: holder(env).startswith("op-b_"), TAKEOVER_LIMIT + 10, 0.1)
    t_lease = time.monotonic() - t0
    wait_for("'after-kill' reconciled by op-b",
             lambda: converged(env.custom, env.apps, env.core, env.ns, "after-kill"), TAKEOVER_LIMIT + 10, 0.1)
    t_reconciled = time.monotonic() - t0
    print(f"\ntakeover after SIGKILL of the leader: Lease held after {t_lease:.1f} s, "
          f"new service reconciled after {t_reconciled:.1f} s")
    assert a.wait(5) == -signal.SIGKILL
    assert t_reconciled < TAKEOVER_LIMIT, (t_lease, t_reconciled)
    assert (env.coord.read_namespaced_lease(LEASE, env.ns).spec.lease_transitions or 0) == transitions + 1
    assert "applied" in b.log()

    # graceful stop (rollout, drain): the leader releases the Lease, the follower takes over on its next poll
    c, _ = operator(env, "op-c")
    wait_for("op-c follows op-b", lambda: "following op-b_" in c.log(), 30)
    t0 = time.monotonic()
    assert b.stop() == 0
    assert "released lease" in b.log()
    wait_for("op-c holds the Lease", lambda: holder(env).startswith("op-c_"), 10, 0.1)
    t_handover = time.monotonic() - t0
    create(env, "after-handover")
    wait_for("'after-handover' reconciled by op-c",
             lambda: converged(env.custom, env.apps, env.core, env.ns, "after-handover"), 30)
    print(f"hand-over on SIGTERM: {t_handover:.1f} s (including the old leader's shutdown)")
    assert t_handover < 8

    # a leader that finds its Lease taken (here: overwritten by hand) exits 1 at once, writing nothing more
    lease = env.coord.read_namespaced_lease(LEASE, env.ns)
    lease.spec.holder_identity = "intruder"
    env.coord.replace_namespaced_lease(LEASE, env.ns, lease)
    rc = c.wait(15)
    assert rc == 1, (rc, c.log()[-2000:])
    assert "leader election lost" in c.log()


def test_two_replicas_ride_out_an_apiserver_outage_of_20s(env, kube):
    """The chart's shape (two replicas, leader election) under the API server stopped for 20 s, with a
    supervisor that restarts an exited process like the kubelet. The leader cannot renew for renewDeadline
    and exits 1 (by design: it must stop before anyone else could lead); that is its one restart, no crash
    loop. When the API server is back, a replica leads again and the services converge."""
    from pathlib import Path

    from localcluster.controlplane import Cluster

    if not kube.local:
        pytest.skip("needs the local control plane (stops and starts its kube-apiserver)")
    cluster = Cluster(run_dir=Path(kube.kubeconfig).parent)
    for p in env.procs:
        p.stop()
    procs = [operator(env, f"op-{x}")[0] for x in ("d", "e")]
    exits: list[tuple[str, int]] = []
    stop = threading.Event()

    def supervise():  # the kubelet's restartPolicy: Always (1 s back-off)
        while not stop.wait(0.5):
            for p in procs:
                if not p.alive() and not stop.is_set():
                    exits.append((p.name, p.proc.returncode))
                    time.sleep(1)
                    p.start()
    sup = threading.Thread(target=supervise, daemon=True)
    sup.start()
    try:
        wait_for("a leader", lambda: holder(env).startswith(("op-d_", "op-e_")), 60)
        for i in range(5):
            create(env, f"outage-{i}")
        for i in range(5):
            wait_for(f"outage-{i} reconciled",
                     lambda: converged(env.custom, env.apps, env.core, env.ns, f"outage-{i}"), 60)
        cluster.stop_component("kube-apiserver")
        try:
            time.sleep(20)
        finally:
            cluster.start_component("kube-apiserver")
        t_back = time.monotonic()
        create(env, "after-outage")
        wait_for("'after-outage' reconciled",
                 lambda: converged(env.custom, env.apps, env.core, env.ns, "after-outage"), 60)
        t_reconciled = time.monotonic() - t_back
        for i in range(5):
            assert converged(env.custom, env.apps, env.core, env.ns, f"outage-{i}")
        time.sleep(5)  # a crash loop would show up as more exits now
        print(f"\nAPI server down 20 s with two replicas: exits {exits}; a new service reconciled "
              f"{t_reconciled:.1f} s after the API server was ready again")
        assert len(exits) <= 2 and all(rc == 1 for _, rc in exits), exits
        assert len({name for name, _ in exits}) == len(exits), f"a replica restarted twice: {exits}"
        assert t_reconciled < 30
    finally:
        stop.set()
        sup.join(5)
    cluster.restart_controllers()  # as leader election would have (else up to a minute of client-go back-off)
    settled = settle_after_outage(kube)
    print(f"the controller-manager acted on a new namespace {settled:.0f} s after the test")
