"""Helpers for the e2e tests on real pods (tests/e2e/test_real_pods.py); the staged model folder and the
placement on the real node are the local cluster's (localcluster/models.py, localcluster/workloads.py).

* ``client_pod`` / ``run_client``: a pod of the server image running a short Python program (stdlib only),
  placed on a node that runs containers, with the restricted security context the operator renders.
* ``LOAD_CLIENT``: a bounded closed-loop load generator run inside the cluster: it calls a Service URL from
  N threads until ``/tmp/stop`` exists (or a hard limit passes) and prints one JSON summary line.
"""
from __future__ import annotations

import json
import time

from localcluster.workloads import REAL_NODE_TOLERATIONS


def restricted_security() -> tuple[dict, dict]:
    """(pod, container) security contexts as the operator renders them for the server."""
    pod = {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001,
           "seccompProfile": {"type": "RuntimeDefault"}}
    container = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                 "capabilities": {"drop": ["ALL"]}}
    return pod, container


def client_pod(name: str, image: str, script: str, node_selector: dict, env: dict | None = None,
               restart: str = "Never", wait_reachable: bool = True) -> dict:
    """With ``wait_reachable`` (and a $URL or $BASE in ``env``) the script first waits until that address accepts
    a connection: see WAIT_REACHABLE."""
    if wait_reachable and ({"URL", "BASE"} & set(env or {})):
        script = WAIT_REACHABLE + script
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
    url = path if path.startswith("http://") else base + path  # a full URL: another address (a pod's port)
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            status, raw = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read().decode()
    except OSError as e:  # no answer (refused, unreachable): said, and the next call made
        status, raw = 0, repr(e)
    try:
        out = json.loads(raw)
    except ValueError:
        out = raw
    print(json.dumps({"path": path, "status": status, "body": out}), flush=True)
"""

# Closed-loop load: $THREADS threads POST $BODY to $URL (with the Host header $HOST when set: a gateway's
# hostname match) one request at a time (a new connection each, as a
# client behind a Service would after a failure), until /tmp/stop exists or $MAX_SECONDS pass. Prints
# "started" after the first success, then one JSON summary line with counts and the first failures.
# A new pod's first connections can be refused for a moment where a NetworkPolicy admits it by its address: the
# policy implementation (kube-router here, Calico likewise) learns the pod's IP from the status the kubelet posts
# after the container started (seen here: a client's first request refused, its second one admitted). Kubernetes'
# NetworkPolicy docs ask pods to be resilient to that or to wait until their destinations are reachable; the
# clients here count every failed request, so they wait first (client_pod prepends this): a TCP connect to $URL's
# or $BASE's host and port, no request sent (an activator does not count it as demand), at most 60 s.
WAIT_REACHABLE = r"""
import os as _os, socket as _socket, time as _time, urllib.parse as _parse
_u = _parse.urlsplit(_os.environ.get("URL") or _os.environ["BASE"])
_deadline = _time.monotonic() + 60
while True:
    try:
        _socket.create_connection((_u.hostname, _u.port or 80), timeout=3).close()
        break
    except OSError:
        if _time.monotonic() > _deadline:
            break
        _time.sleep(0.2)
"""

LOAD_CLIENT = r"""
import collections, json, os, threading, time, urllib.error, urllib.request
url, body = os.environ["URL"], os.environ["BODY"].encode()
headers = {"Content-Type": "application/json", **({"Host": os.environ["HOST"]} if os.environ.get("HOST") else {})}
threads, limit = int(os.environ.get("THREADS", "4")), float(os.environ.get("MAX_SECONDS", "240"))
t0 = time.monotonic()
ok = [0]; fails = collections.Counter(); first = []; last = [None]; lat = []; lock = threading.Lock()
started = threading.Event()
def stop():
    return os.path.exists("/tmp/stop") or time.monotonic() - t0 > limit
def worker():
    while not stop():
        req = urllib.request.Request(url, data=body, headers=headers)
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


# $CONCURRENCY requests at once, each $INPUTS texts over 512 tokens (truncated) to $URL (/embed_hybrid: dense,
# sparse and ColBERT as JSON floats, the largest answer the service gives); each answer is read as it streams
# and only counted (the client pod has 256Mi). The server holds an answer's float32 vectors until they are sent
# and starts it once its last forward is done, so a fast reader frees the first answer while the engine is still
# making the next: the first answer to begin is read up to its first chunk only, until every other answer has
# begun, so that all of them are held at once (what the operator's estimate sizes: RESPONSES_IN_FLIGHT; a client
# that reads slowly does this in production). Prints one JSON list: status, bytes, inputs answered, seconds, and
# for the held one how long it waited.
HYBRID_BURST = r"""
import json, os, threading, time, urllib.request
url, n, k = os.environ["URL"], int(os.environ["INPUTS"]), int(os.environ["CONCURRENCY"])
texts = [f"passage {i}: hybrid retrieval with lexical weights and late-interaction vectors " * 60 for i in range(n)]
body = json.dumps({"inputs": texts, "truncate": True}).encode()
mark = b'"colbert":'
out = [None] * k
begun, lock, all_begun = [], threading.Lock(), threading.Event()
def call(j):
    t = time.monotonic()
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=900) as r:
            with lock:
                begun.append(j)
                first = len(begun) == 1
                if len(begun) == k:
                    all_begun.set()
            size, rows, tail, held = 0, 0, b"", None
            while True:
                chunk = r.read(1 << 20)
                if not chunk:
                    break
                size += len(chunk)
                rows += (tail + chunk).count(mark)
                tail = chunk[-(len(mark) - 1):]
                if first and held is None:
                    h = time.monotonic()
                    held = round(time.monotonic() - h, 1) if all_begun.wait(900) else "timed out"
            out[j] = {"status": r.status, "bytes": size, "rows": rows, "seconds": round(time.monotonic() - t, 1),
                      "transfer_encoding": r.headers.get("Transfer-Encoding"), "held_s": held}
    except Exception as e:
        out[j] = {"status": getattr(e, "code", None), "error": f"{type(e).__name__}: {e}"[:300]}
threads = [threading.Thread(target=call, args=(j,)) for j in range(k)]
[t.start() for t in threads]; [t.join() for t in threads]
print(json.dumps(out), flush=True)
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
