"""The one-command demo (`make demo` -> scripts/demo.sh up): local cluster, operator, a CPU
EmbeddingService serving all-MiniLM-L6-v2, and the curl that embeds through it.

  up    start the local control plane (localcluster/controlplane.py, run dir .run/demo) with its
        real node cpu-real-0 (kubelet, containerd, kube-proxy, CoreDNS) when this machine allows one,
        install the EmbeddingService CRD and the upstream ServiceMonitor/HTTPRoute/ScaledObject CRDs, run
        `embedops-operator run` in the background and apply examples/cpu-ingestion.yaml (with the model PVC
        it mounts). With the real node: the CPU server image is built (localcluster/images.py, cached), the
        service is placed on cpu-real-0, and the printed curl goes to its Service's ClusterIP, i.e. through
        kube-proxy to a real container. Without one (the reason is printed in one line): the reconciled
        Deployment's server container command runs as a local process (kwok pods run no containers) on
        127.0.0.1:$EMBEDOPS_DEMO_PORT (default 8080)
  down  stop the server, the operator and the control plane with its real node (by PID and record)
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from localcluster.controlplane import REPO, Cluster, default_run_dir, start_cluster
from localcluster.node import NODE_NAME

RUN = default_run_dir() / "demo"
STATE = RUN / "demo.json"
NAMESPACE = "embedops-demo"
EXAMPLE = REPO / "examples" / "cpu-ingestion.yaml"


def _state() -> dict:
    try:
        return json.loads(STATE.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _save(st: dict) -> None:
    RUN.mkdir(parents=True, exist_ok=True)
    STATE.write_text(json.dumps(st, indent=1))


def _alive(pid: int, argv0: str) -> bool:
    """pid runs argv0 (as the program, or as the script a shebang interpreter runs)."""
    try:
        cmd = [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:2]]
    except (FileNotFoundError, PermissionError):
        return False
    return argv0 in cmd


def _stop(name: str, pid: int, argv0: str, timeout: float = 30) -> None:
    if not _alive(pid, argv0):
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while _alive(pid, argv0) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _alive(pid, argv0):
        os.kill(pid, signal.SIGKILL)
    print(f"stopped {name} ({pid})")


def _spawn(argv: list[str], env: dict, log: Path) -> subprocess.Popen:
    with open(log, "ab") as f:
        return subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, cwd=REPO)


def _wait(what: str, fn, timeout: float, log: Path | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = fn()
        if v:
            return v
        time.sleep(0.5)
    tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
    raise SystemExit(f"demo: timed out waiting for {what}\n{tail}")


def up() -> int:
    import yaml
    from kubernetes import client

    from localcluster.kube import Kube
    from localcluster.local_server import LocalServer, local_command, secret_reader
    from localcluster.models import minilm_dir
    from localcluster.workloads import prerequisites

    t0 = time.monotonic()
    if _state().get("server"):
        down(quiet=True)
    cluster, kubeconfig, no_node = start_cluster(RUN / "cluster")
    kubeconfig = str(kubeconfig)
    where = "with the real node cpu-real-0" if not no_node else f"without a real node ({no_node})"
    print(f"demo: control plane up {where} ({time.monotonic() - t0:.0f}s), KUBECONFIG={kubeconfig}")
    kube = Kube(kubeconfig, local=True, real_node=None if no_node else NODE_NAME, real_node_reason=no_node)
    kube.apply(REPO / "crds" / "embedops.dev_embeddingservices.yaml")
    kube.install_crds(["servicemonitor", "httproute", "scaledobject"])
    st: dict = {"kubeconfig": kubeconfig}
    _save(st)

    env = {**os.environ, "KUBECONFIG": kubeconfig,
           "PYTHONPATH": os.pathsep.join([str(REPO / "operator"), str(REPO / "server"), str(REPO)])}
    op_log = RUN / "operator.log"
    op_argv = [sys.executable, "-m", "embedops_operator.cli", "run", "--liveness", ""]
    op = _spawn(op_argv, env, op_log)
    st["operator"] = {"pid": op.pid, "argv0": op_argv[0], "log": str(op_log)}
    _save(st)
    print(f"demo: operator running (pid {op.pid}), log {op_log}")

    with kube.api_client() as api:
        core = client.CoreV1Api(api)
        try:
            core.create_namespace({"metadata": {"name": NAMESPACE}})
        except client.ApiException as e:
            if e.status != 409:
                raise
        _wait("default ServiceAccount", lambda: _sa(core), 60)
        doc = yaml.safe_load(EXAMPLE.read_text())
        if kube.real_node:
            doc = _on_real_node(kube, doc)
        prerequisites(kube, NAMESPACE, [doc])
        kube.apply([doc], namespace=NAMESPACE)
        name = doc["metadata"]["name"]
        co = client.CustomObjectsApi(api)

        def ready():
            o = co.get_namespaced_custom_object("embedops.dev", "v1alpha1", NAMESPACE, "embeddingservices", name)
            conds = {c["type"]: c["status"] for c in (o.get("status") or {}).get("conditions") or []}
            return o if conds.get("Ready") == "True" else None
        _wait(f"EmbeddingService {name} Ready", ready, 180, op_log)
        apps = client.AppsV1Api(api)
        deps = [d for d in apps.list_namespaced_deployment(NAMESPACE).items
                if any(r.kind == "EmbeddingService" and r.name == name for r in d.metadata.owner_references or [])]
        dep = api.sanitize_for_serialization(deps[0])
        pod = core.list_namespaced_pod(NAMESPACE).items[0]
        if kube.real_node:
            ip = core.read_namespaced_service(name, NAMESPACE).spec.cluster_ip
            return _print_real(name, doc, pod, ip, kubeconfig, t0)
        print(f"demo: {name} Ready; its pod runs on kwok node {pod.spec.node_name}")

        models = RUN / "models"
        models.mkdir(parents=True, exist_ok=True)
        link = models / "all-MiniLM-L6-v2"
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(minilm_dir())
        pvc_vols = {v["name"] for v in dep["spec"]["template"]["spec"].get("volumes") or []
                    if v.get("persistentVolumeClaim")}
        port = _port(int(os.environ.get("EMBEDOPS_DEMO_PORT", "8080")))
        argv, senv = local_command(dep, volume_dirs={v: models for v in pvc_vols}, scratch=RUN / "volumes",
                                   port=port, secrets=secret_reader(core, NAMESPACE))
    srv_log = RUN / "server.log"
    srv = LocalServer(argv, senv, srv_log, port).start()
    st["server"] = {"pid": srv.proc.pid, "argv0": argv[0], "log": str(srv_log), "argv": argv}
    _save(st)
    print(f"demo: server process (pid {srv.proc.pid}) = the Deployment's container command:\n  "
          + " ".join([Path(argv[0]).name] + argv[1:]))
    srv.wait_healthy(timeout=300)
    served = doc["spec"]["model"].get("servedModelName") or name
    print(f"\ndemo: ready in {time.monotonic() - t0:.0f}s. Embed through it:\n")
    print(f"  curl -s http://127.0.0.1:{port}/v1/embeddings -H 'Content-Type: application/json' \\\n"
          f"    -d '{{\"model\": \"{served}\", \"input\": [\"hello world\"]}}'\n")
    print(f"  export KUBECONFIG={kubeconfig}; kubectl get embsvc -n {NAMESPACE}")
    print("  stop everything: make demo-down")
    return 0


def _on_real_node(kube, doc: dict) -> dict:
    """Build (cached) and import the CPU server image, stage the model folder the PVC serves, and place the
    example on the real node, sized for this machine."""
    from localcluster import images
    from localcluster.models import DEFAULT_MODELS_HOSTPATH, prepare_models
    from localcluster.workloads import for_real_node

    t = time.monotonic()
    built = images.build(("server",))
    kube.import_images(built)
    prepare_models(Path(DEFAULT_MODELS_HOSTPATH))
    print(f"demo: server image {built['server'].ref} built and imported, model staged "
          f"({time.monotonic() - t:.0f}s)")
    return for_real_node(doc, built["server"].ref, {"kubernetes.io/hostname": kube.real_node})


def _print_real(name: str, doc: dict, pod, ip: str, kubeconfig: str, t0: float) -> int:
    import json
    import urllib.request

    served = doc["spec"]["model"].get("servedModelName") or name
    url = f"http://{ip}/v1/embeddings"
    body = json.dumps({"model": served, "input": ["hello world"]}).encode()
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:   # prove it before printing it
        dim = len(json.loads(r.read())["data"][0]["embedding"])
    print(f"demo: {name} Ready; pod {pod.metadata.name} runs in a real container on {pod.spec.node_name} "
          f"(pod IP {pod.status.pod_ip}); Service ClusterIP {ip} answered with a {dim}-dimensional vector")
    print(f"\ndemo: ready in {time.monotonic() - t0:.0f}s. Embed through the Service (kube-proxy -> the pod):\n")
    print(f"  curl -s {url} -H 'Content-Type: application/json' \\\n"
          f"    -d '{{\"model\": \"{served}\", \"input\": [\"hello world\"]}}'\n")
    print(f"  export KUBECONFIG={kubeconfig}; kubectl get embsvc,pods -n {NAMESPACE} -o wide")
    print(f"  kubectl logs -n {NAMESPACE} {pod.metadata.name}")
    print("  stop everything: make demo-down")
    return 0


def _port(want: int) -> int:
    """The wanted port if it is free on 127.0.0.1, else a free one."""
    import socket

    from localcluster.pki import free_port
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", want))
            return want
        except OSError:
            return free_port()


def _sa(core) -> bool:
    try:
        core.read_namespaced_service_account("default", NAMESPACE)
        return True
    except Exception:  # noqa: BLE001
        return False


def down(quiet: bool = False) -> int:
    st = _state()
    for key in ("server", "operator"):
        p = st.get(key)
        if p:
            _stop(key, p["pid"], p["argv0"])
    Cluster(run_dir=RUN / "cluster", real_node=None).down(quiet=quiet)
    if STATE.exists():
        STATE.unlink()
    return 0


if __name__ == "__main__":
    cmd = sys.argv[1] if len(sys.argv) > 1 else "up"
    sys.exit({"up": up, "down": down}[cmd]() if cmd in ("up", "down") else 2)
