"""Helpers for the e2e tests on real pods (tests/e2e/test_real_pods.py) and the demo's real node.

* ``prepare_models(root)``: the folder a hostPath PersistentVolume serves to real pods: the bundled
  all-MiniLM-L6-v2 and a tiny random cross-encoder, each with an ONNX export made here by the server's own
  exporter (the locally built CPU image carries no torch, see docs/images.md), world-readable because the
  server runs as uid 10001.
* ``client_pod`` / ``run_client``: a pod of the server image running a short Python program (stdlib only),
  placed on a node that runs containers, with the restricted security context the operator renders.
* ``LOAD_CLIENT``: a bounded closed-loop load generator run inside the cluster: it calls a Service URL from
  N threads until ``/tmp/stop`` exists (or a hard limit passes) and prints one JSON summary line.
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import time
from pathlib import Path

MINILM = "all-MiniLM-L6-v2"
RERANKER = "tiny-reranker"
# A path every real node can read (hostPath): not under a 0700 home or pytest temp dir, since the server
# runs as uid 10001. The same path the kind workflow copies models to.
DEFAULT_MODELS_HOSTPATH = "/var/lib/embedops-models"
# The harness's real node is tainted so that pods of other tests (images no registry holds) stay on the kwok
# nodes; what is meant for it tolerates the taint.
REAL_NODE_TOLERATIONS = [{"key": "embedops.dev/real-node", "operator": "Exists", "effect": "NoSchedule"}]


def _fingerprint(*paths: Path) -> str:
    h = hashlib.sha256()
    for p in paths:
        for f in sorted(p.rglob("*")) if p.is_dir() else [p]:
            if f.is_file():
                h.update(f"{f.relative_to(p) if p.is_dir() else f.name}\0{f.stat().st_size}\0".encode())
    return h.hexdigest()[:16]


def prepare_models(root: Path, onnx: bool = True) -> Path:
    """Fill ``root`` with all-MiniLM-L6-v2 and the tiny reranker (plus ONNX exports when ``onnx``); reused
    when the inputs have not changed (a stamp file), rebuilt atomically otherwise."""
    from tests.e2e.serving import make_tiny_reranker
    from tests.models import minilm_dir

    repo = Path(__file__).resolve().parents[2]
    exporter = repo / "server" / "embedops_server" / "backends" / "onnx_export.py"
    src = minilm_dir()
    stamp = f"{_fingerprint(src, exporter)}-{int(onnx)}"
    if (root / ".stamp").is_file() and (root / ".stamp").read_text() == stamp:
        return root
    tmp = root.with_name(root.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shutil.copytree(src, tmp / MINILM, symlinks=False,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "onnx"))
    make_tiny_reranker(tmp / RERANKER, src)
    if onnx:
        for name in (MINILM, RERANKER):
            _export(tmp / name)
    for d, _, files in os.walk(tmp):
        os.chmod(d, 0o755)
        for f in files:
            os.chmod(os.path.join(d, f), 0o644)
    (tmp / ".stamp").write_text(stamp)
    shutil.rmtree(root, ignore_errors=True)
    root.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(root.parent, os.stat(root.parent).st_mode | 0o055)
    tmp.rename(root)
    return root


def _export(folder: Path) -> None:
    """onnx/model.onnx in ``folder``: the server's own export of its torch weights."""
    import tempfile

    from embedops_server.backends.onnx_export import export_onnx
    from embedops_server.core.model_info import load_model_info

    info = load_model_info(str(folder), None, None)
    with tempfile.TemporaryDirectory() as t:
        out = export_onnx(info, Path(t))
        (folder / "onnx").mkdir(exist_ok=True)
        shutil.move(str(out), folder / "onnx" / "model.onnx")
        data = Path(t) / (out.name + ".data")
        if data.exists():  # large models keep their weights beside the graph
            shutil.move(str(data), folder / "onnx" / data.name)


def for_real_node(doc: dict, image: str | None, node_selector: dict) -> dict:
    """An EmbeddingService manifest placed on a node that runs containers and sized for a 2-core machine:
    ``image`` (None: the operator's default server image), 1 core with a 100m request (several server pods
    share the cores), no instruction-set constraint (placement is by node), a 5 s preStop drain."""
    d = copy.deepcopy(doc)
    spec = d["spec"]
    if image is not None:
        spec["image"] = image
    spec["nodeSelector"] = {**(spec.get("nodeSelector") or {}), **node_selector}
    spec["tolerations"] = list(spec.get("tolerations") or []) + REAL_NODE_TOLERATIONS
    cpu = spec["accelerator"]["cpu"]
    cpu["cores"] = 1
    cpu.pop("instructionSets", None)
    spec["resources"] = {"requests": {"cpu": "100m"}}
    spec["drainSeconds"] = 5
    return d


def restricted_security() -> tuple[dict, dict]:
    """(pod, container) security contexts as the operator renders them for the server."""
    pod = {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001,
           "seccompProfile": {"type": "RuntimeDefault"}}
    container = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                 "capabilities": {"drop": ["ALL"]}}
    return pod, container


def client_pod(name: str, image: str, script: str, node_selector: dict, env: dict | None = None,
               restart: str = "Never") -> dict:
    pod_sc, c_sc = restricted_security()
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "e2e-client"}},
        "spec": {
            "restartPolicy": restart, "nodeSelector": node_selector, "securityContext": pod_sc,
            "tolerations": REAL_NODE_TOLERATIONS,
            "automountServiceAccountToken": False, "enableServiceLinks": False,
            "terminationGracePeriodSeconds": 2,
            "containers": [{
                "name": "client", "image": image, "imagePullPolicy": "IfNotPresent",
                "command": ["python3", "-c", script],
                "env": [{"name": k, "value": str(v)} for k, v in (env or {}).items()],
                "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}},
                "securityContext": c_sc,
                "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
            }],
            "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": "16Mi"}}],
        },
    }


# Calls each request in $REQUESTS (a JSON list of [path, body]) on $BASE once and prints one JSON line per
# answer: {"path", "status", "body"}. stdlib only: the server image has no HTTP client library of its own.
CALLS = r"""
import json, os, sys, urllib.error, urllib.request
base = os.environ["BASE"]
for path, body in json.loads(os.environ["REQUESTS"]):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            status, raw = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read().decode()
    try:
        out = json.loads(raw)
    except ValueError:
        out = raw
    print(json.dumps({"path": path, "status": status, "body": out}), flush=True)
"""

# Closed-loop load: $THREADS threads POST $BODY to $URL one request at a time (a new connection each, as a
# client behind a Service would after a failure), until /tmp/stop exists or $MAX_SECONDS pass. Prints
# "started" after the first success, then one JSON summary line with counts and the first failures.
LOAD_CLIENT = r"""
import collections, json, os, threading, time, urllib.error, urllib.request
url, body = os.environ["URL"], os.environ["BODY"].encode()
threads, limit = int(os.environ.get("THREADS", "4")), float(os.environ.get("MAX_SECONDS", "240"))
t0 = time.monotonic()
ok = [0]; fails = collections.Counter(); first = []; last = [None]; lat = []; lock = threading.Lock()
started = threading.Event()
def stop():
    return os.path.exists("/tmp/stop") or time.monotonic() - t0 > limit
def worker():
    while not stop():
        req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
        t = time.monotonic()
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                r.read()
                good, why = r.status == 200, f"HTTP {r.status}"
        except urllib.error.HTTPError as e:
            good, why = False, f"HTTP {e.code}: {e.read()[:200]!r}"
        except Exception as e:
            good, why = False, f"{type(e).__name__}: {e}"
        with lock:
            if good:
                ok[0] += 1; lat.append(time.monotonic() - t)
                if not started.is_set():
                    started.set(); print("started", flush=True)
            else:
                fails[why.split(":")[0]] += 1
                last[0] = round(time.monotonic() - t0, 2)
                if len(first) < 10:
                    first.append([round(time.monotonic() - t0, 2), why])
        if not good:
            time.sleep(0.05)
ts = [threading.Thread(target=worker) for _ in range(threads)]
[t.start() for t in ts]; [t.join() for t in ts]
lat.sort()
p = lambda q: round(lat[min(len(lat) - 1, int(q * len(lat)))] * 1000, 1) if lat else None
print(json.dumps({"ok": ok[0], "failed": sum(fails.values()), "failures": dict(fails), "first_failures": first,
                  "failure_window_s": round(last[0] - first[0][0], 2) if first else 0, "seconds": round(time.monotonic() - t0, 1), "p50_ms": p(0.5), "p99_ms": p(0.99),
                  "stopped_by": "signal" if os.path.exists("/tmp/stop") else "limit"}), flush=True)
"""


def wait_pod_phase(core, ns: str, name: str, phases: tuple[str, ...], timeout: float = 180) -> object:
    deadline = time.monotonic() + timeout
    pod = None
    while time.monotonic() < deadline:
        pod = core.read_namespaced_pod(name, ns)
        if pod.status.phase in phases:
            return pod
        if pod.status.phase == "Failed" and "Failed" not in phases:
            break
        time.sleep(0.5)
    raise AssertionError(f"pod {ns}/{name} not {phases} after {timeout}s: {pod.status if pod else None}\n"
                         + pod_log(core, ns, name))


def pod_log(core, ns: str, name: str) -> str:
    try:
        return core.read_namespaced_pod_log(name, ns, tail_lines=200) or ""
    except Exception as e:  # noqa: BLE001 - diagnostics only
        return f"(no log: {e})"


def run_client(core, ns: str, name: str, image: str, base: str, requests: list, node_selector: dict,
               timeout: float = 180) -> list[dict]:
    """Run CALLS in a pod to completion; the parsed answers, in order."""
    pod = client_pod(name, image, CALLS, node_selector, {"BASE": base, "REQUESTS": json.dumps(requests)})
    core.create_namespaced_pod(ns, pod)
    try:
        p = wait_pod_phase(core, ns, name, ("Succeeded",), timeout)
        assert p.status.phase == "Succeeded"
        lines = core.read_namespaced_pod_log(name, ns).splitlines()
        return [json.loads(x) for x in lines if x.startswith("{")]
    finally:
        core.delete_namespaced_pod(name, ns, grace_period_seconds=0)


def exec_in(kube, ns: str, pod: str, argv: list[str], container: str | None = None) -> str:
    """Run argv in a container of a running pod (the API server's exec, i.e. the kubelet's streaming), on an
    API client of its own: the websocket stream patches the client it is given."""
    from kubernetes import client
    from kubernetes.stream import stream

    kw = {"container": container} if container else {}
    with kube.api_client() as api:
        return stream(client.CoreV1Api(api).connect_get_namespaced_pod_exec, pod, ns, command=argv, stderr=True,
                      stdin=False, stdout=True, tty=False, _request_timeout=60, **kw)
