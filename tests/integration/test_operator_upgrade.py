"""Operator upgrades restart nothing (issue 36): services created by the previous release's operator and CRD keep
their pods when HEAD's CRD is applied over it and HEAD's operator replaces the old one; a fleet-wide server-image
change then rolls at most N services at a time, each Ready before the next.

The previous release is the commit PREVIOUS (the last one before template revisions existed), taken from this
clone's history with `git archive` and run as a real operator process against the real API server (kwok nodes run
the pods). HEAD's CRD is server-side applied over the old one with a forced conflict, as Flux's `CreateReplace`
does.
"""
from __future__ import annotations

import subprocess
import tarfile
import threading
import time

import pytest
import yaml
from embedops_operator.render import TEMPLATE_REVISION

from tests.integration.operator_process import (GROUP, PLURAL, REPO, VERSION, OperatorProcess, es_body, install_crd,
                                                operator_env, wait_for)

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

PREVIOUS = "4ee3ee7"  # main on 2026-12-04, before template revisions: its operator wrote revision-0 templates
NEW_IMAGE = "registry.example/embedops-server:9.9.9-cpu"
MAX_CONCURRENT = 1
CPU = {"model": {"id": "/models/all-MiniLM-L6-v2", "maxInputLength": 256},
       "accelerator": {"cpu": {"cores": 1, "memory": "1Gi"}}, "batching": {"maxBatchTokens": 4096},
       "monitoring": {"serviceMonitor": {"enabled": False}}}
SERVICES = {
    "up-plain": CPU,
    "up-key": {**CPU, "apiKeySecretRef": {"name": "up-key"}, "replicas": 2},  # revision 1 changes its prepare step
    "up-download": {**CPU, "model": {"id": "sentence-transformers/all-MiniLM-L6-v2", "source": {"download": {}}}},
    "up-mig": {"model": {"id": "BAAI/bge-m3", "maxInputLength": 8192},
               "accelerator": {"mig": {"product": "H100-80GB", "profile": "1g.10gb"}},
               "monitoring": {"serviceMonitor": {"enabled": False}}},
}


def previous_release(dest) -> str:
    """The previous release's operator/, server/ and crds/ under `dest`, from this clone's history."""
    archive = dest / "previous.tar"
    res = subprocess.run(["git", "-C", str(REPO), "archive", "-o", str(archive), PREVIOUS, "operator", "server",
                          "crds"], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.fail(f"the previous release {PREVIOUS} is not in this clone's history (a shallow clone?): "
                    f"{res.stderr.strip()}; fetch it (git fetch --unshallow) to run the upgrade test")
    with tarfile.open(archive) as tar:
        tar.extractall(dest / "previous", filter="data")
    return str(dest / "previous")


@pytest.fixture(scope="module")
def env(kube, tmp_path_factory):
    with operator_env(kube, tmp_path_factory.mktemp("upgrade"), "upgrade") as e:
        try:
            yield e
        finally:
            install_crd(kube, e.api)  # HEAD's CRD for the tests after this one, whatever happened here


def operator(env, name: str, root: str | None = None, extra_env: dict | None = None) -> OperatorProcess:
    run_env = {"EMBEDOPS_SERVER_IMAGE_CPU": "registry.example/embedops-server:0.1.0-cpu", **(extra_env or {})}
    if root:
        run_env["PYTHONPATH"] = f"{root}/operator:{root}/server"
    p = OperatorProcess(name, env.kube.kubeconfig, env.tmp, ["-n", env.ns, "--resync-seconds=3"], env=run_env)
    env.procs.append(p)
    return p.start()


def deployments(env) -> dict[str, dict]:
    out = {}
    for d in env.apps.list_namespaced_deployment(env.ns).items:
        d = env.api.sanitize_for_serialization(d)
        out[d["metadata"]["name"]] = d
    return out


def pods(env) -> dict[str, tuple]:
    out = {}
    for p in env.core.list_namespaced_pod(env.ns).items:
        restarts = sum(c.restart_count for c in p.status.container_statuses or [])
        out[p.metadata.name] = (p.metadata.uid, restarts)
    return out


def replica_sets(env) -> dict[str, str]:
    return {rs.metadata.name: rs.metadata.uid for rs in env.apps.list_namespaced_replica_set(env.ns).items}


def ready(env, name: str) -> bool:
    es = env.custom.get_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL, name)
    st = es.get("status") or {}
    return st.get("observedGeneration") == es["metadata"]["generation"] and any(
        c["type"] == "Ready" and c["status"] == "True" for c in st.get("conditions") or [])


def rolling(d: dict) -> bool:
    """A Deployment whose pods are being replaced (or whose new template the controller has not acted on)."""
    st, want = d.get("status") or {}, (d.get("spec") or {}).get("replicas", 1)
    return (st.get("observedGeneration", 0) < d["metadata"]["generation"] or st.get("updatedReplicas", 0) < want
            or st.get("availableReplicas", 0) < want or st.get("replicas", 0) > want)


LATEST = str(TEMPLATE_REVISION)


def test_an_operator_upgrade_restarts_nothing_and_a_fleet_image_change_is_paced(env):
    # 1. the previous release: its CRD, its operator, four services Ready on the kwok nodes
    root = previous_release(env.tmp)
    env.kube.apply(yaml.safe_load_all(open(f"{root}/crds/embedops.dev_embeddingservices.yaml")))
    old = operator(env, "previous", root=root)
    env.kube.apply([{"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "up-key", "namespace": env.ns},
                     "stringData": {"token": "k"}}], namespace=env.ns)
    for name, spec in SERVICES.items():
        env.custom.create_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL, es_body(env.ns, name, spec))
    for name in SERVICES:
        wait_for(f"{name} Ready under the previous operator", lambda n=name: ready(env, n), 180)
    old.stop()
    before, pods_before, rs_before = deployments(env), pods(env), replica_sets(env)
    assert len(pods_before) == 5 and all(r == 0 for _, r in pods_before.values())
    assert all("embedops.dev/template-revision" not in (d["metadata"].get("annotations") or {})
               for d in before.values())

    # 2. HEAD's CRD over the old one (server-side, forced, as Flux's CreateReplace), every stored object still
    # valid for it (a server-side dry-run update of each, as stored), then HEAD's operator
    install_crd(env.kube, env.api)
    for item in env.custom.list_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL)["items"]:
        env.custom.replace_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL, item["metadata"]["name"], item,
                                                    dry_run="All")
    new = operator(env, "head")
    for name in SERVICES:  # HEAD has reconciled each: its status lists the pinned template
        wait_for(f"{name} reconciled by HEAD", lambda n=name: (env.custom.get_namespaced_custom_object(
            GROUP, VERSION, env.ns, PLURAL, n).get("status") or {}).get("podTemplates"), 60)
    time.sleep(6)  # two resyncs
    after, pods_after = deployments(env), pods(env)
    assert sorted(after) == sorted(before), "Deployments created or removed by the upgrade"
    for name, d in before.items():
        assert after[name]["spec"]["template"] == d["spec"]["template"], f"{name}: pod template changed"
        # (its generation moves: the API server counts a Deployment's annotations as spec, since they are copied
        # to its ReplicaSets; the new annotations record the pin, and replace no ReplicaSet)
        assert after[name]["metadata"]["annotations"]["embedops.dev/template-revision"] == "0"
    assert replica_sets(env) == rs_before, "ReplicaSets replaced by the upgrade"
    assert pods_after == pods_before, "pods replaced or restarted by the upgrade"
    assert "previous" not in [p.name for p in env.procs if p.alive()]
    new.stop()

    # 3. a fleet-wide image change with pod upgrades Roll: every service moves, at most MAX_CONCURRENT at a time
    seen: list[tuple[float, list[str]]] = []
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            busy = [n for n, d in deployments(env).items() if rolling(d)]
            seen.append((time.monotonic(), busy))
            time.sleep(0.2)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.monotonic()
    roll = operator(env, "head-roll", extra_env={"EMBEDOPS_SERVER_IMAGE_CPU": NEW_IMAGE, "EMBEDOPS_POD_UPGRADES": "Roll",
                                                 "EMBEDOPS_MAX_CONCURRENT_UPGRADES": str(MAX_CONCURRENT)})
    cpu = [n for n in SERVICES if "cpu" in SERVICES[n]["accelerator"]]

    def moved():  # every service on the latest template revision, the CPU ones on the new image, none rolling
        ds = deployments(env)
        return all(ds[n]["metadata"]["annotations"]["embedops.dev/template-revision"] == LATEST and not rolling(ds[n])
                   and (n not in cpu or ds[n]["spec"]["template"]["spec"]["containers"][0]["image"] == NEW_IMAGE)
                   for n in SERVICES)
    try:
        wait_for("every service rolled to the latest revision, the CPU ones to the new image", moved, 300)
        for name in SERVICES:
            wait_for(f"{name} Ready", lambda n=name: ready(env, n), 60)
    finally:
        stop.set()
        sampler.join(5)
    took = time.monotonic() - started
    most = max(len(busy) for _, busy in seen)
    order = []
    for _, busy in seen:
        for n in busy:
            if n not in order:
                order.append(n)
    print(f"fleet image change: {len(SERVICES)} services in {took:.0f} s, at most {most} rolling at once; "
          f"order {order}")
    assert most <= MAX_CONCURRENT, [b for _, b in seen if len(b) > MAX_CONCURRENT][:5]
    # the operator's own account: each upgrade it starts ends (the service Ready again) before the next starts
    # (kwok finishes a rollout between two samples above at times; the log sees every one)
    running, started, done = 0, [], []
    for line in roll.log().splitlines():
        if ": rolling the server's pods to " in line:
            running += 1
            started.append(line.split(": rolling")[0].rsplit("/", 1)[1])
            assert running <= MAX_CONCURRENT, line
        elif line.endswith(": pod upgrade done"):
            running -= 1
            done.append(line.split(": pod upgrade done")[0].rsplit("/", 1)[1])
    assert sorted(started) == sorted(done) == sorted(SERVICES), (started, done)
    mig = deployments(env)["up-mig"]["spec"]["template"]["spec"]["containers"][0]["image"]
    assert mig == before["up-mig"]["spec"]["template"]["spec"]["containers"][0]["image"]  # the CUDA image, unchanged
