"""The operator at fleet scale: ``python -m bench --operator --n 200,1000`` (or ``python -m bench.operator_bench``).

On the local control plane of localcluster (kube-apiserver, controller-manager, scheduler, kwok nodes; a
fresh one per N, in its own run dir), for N CPU EmbeddingServices:

- **floor**: the objects the operator would render for them (Deployment + Service each, without owner
  references) server-side applied directly, 8 at a time; seconds from the first apply until every
  Deployment has its replica ready;
- **operator**: the operator as its own process (``embedops-operator run``, resync 30 s, cluster-wide; the
  code under ``--source``, so an older checkout can be measured), the N EmbeddingServices created 8 at a
  time; seconds until all are Ready (observedGeneration current), and the ratio to the floor;
- the operator's CPU seconds and peak RSS (VmHWM) at that point;
- API requests: the API server's own count, ``apiserver_request_total`` summed, and the operator's share
  alone: it runs as its own ServiceAccount, matched by a FlowSchema of its own, so
  ``apiserver_flowcontrol_dispatched_requests_total{flow_schema=...}`` counts exactly its requests;
- at rest: after a settle time, a window with the operator running, then the same window with it
  stopped: requests per minute (running minus stopped), as the issue defines it, and the operator's own;
- **restart** (``--restart``): the operator started again with every service present, as after a crash, an
  upgrade or an eviction: seconds until its caches listed and every service was reconciled once (its work queue
  drained, read from its own /metrics), its peak RSS then (issue 58: the restart was the peak, 783 MB at 5,000
  services against 453 MB on the way up), CPU, requests and server-side applies of Deployments (0 expected).

Results: a table on stdout and ``bench/results/operator-<stamp>.json`` (+ ``operator-latest.json``).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
NS = "bench"
FLOOR_NS = "bench-floor"
OPERATOR_SA = ("embedops-bench", "bench-system")
FLOW_SCHEMA = "embedops-bench-operator"
GROUP, VERSION, PLURAL = "embedops.dev", "v1alpha1", "embeddingservices"
SPEC = {"model": {"id": "BAAI/bge-small-en-v1.5"}, "accelerator": {"cpu": {"cores": 1, "memory": "1Gi"}},
        "monitoring": {"serviceMonitor": {"enabled": False}}}
PODS_PER_NODE = 250


def log(*a) -> None:
    print(time.strftime("[%H:%M:%S]"), *a, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------- pure helpers

def metric_sum(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    """Sum of a Prometheus counter's samples whose labels include `labels`."""
    total = 0.0
    pat = re.compile(r"^" + re.escape(name) + r"(\{[^}]*\})?\s+([0-9.eE+-]+)", re.M)
    for lab, val in pat.findall(text):
        if labels and not all(f'{k}="{v}"' in lab for k, v in labels.items()):
            continue
        total += float(val)
    return total


def es_body(i: int) -> dict:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "EmbeddingService",
            "metadata": {"name": f"svc-{i:04d}", "namespace": NS}, "spec": json.loads(json.dumps(SPEC))}


def ready(es: dict) -> bool:
    st = es.get("status") or {}
    if st.get("observedGeneration") != es["metadata"].get("generation"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in st.get("conditions") or [])


def floor_manifests(n: int) -> list[dict]:
    """What the operator renders for the N services (no optional CRDs in the cluster), minus owner refs."""
    sys.path.insert(0, str(REPO / "operator"))
    from embedops_operator import render as R
    from embedops_operator.settings import OperatorSettings
    from embedops_operator.validate import defaulted

    out = []
    for i in range(n):
        body = es_body(i)
        body["metadata"].update(namespace=FLOOR_NS, uid="0")
        for m in R.render(defaulted(body), R.Options.of(OperatorSettings(), frozenset())):
            m["metadata"].pop("ownerReferences", None)
            out.append(m)
    return out


def bench_nodes(n: int) -> list[dict]:
    """kwok nodes with room for n one-core pods (the harness's own nodes hold 110 pods each)."""
    cap = {"cpu": "4000", "memory": "16Ti", "pods": str(PODS_PER_NODE), "ephemeral-storage": "10Ti"}
    return [{"apiVersion": "v1", "kind": "Node",
             "metadata": {"name": f"bench-cpu-{i}",
                          "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
                          "labels": {"kubernetes.io/hostname": f"bench-cpu-{i}", "kubernetes.io/os": "linux",
                                     "kubernetes.io/arch": "amd64", "type": "kwok"}},
             "spec": {}, "status": {"capacity": cap, "allocatable": cap}}
            for i in range(math.ceil(n / PODS_PER_NODE) + 1)]


def per_minute(count: float, seconds: float) -> float:
    return count / seconds * 60 if seconds > 0 else math.nan


# ---------------------------------------------------------------------------------------------- the cluster

class Bench:
    def __init__(self, args, n: int):
        self.args, self.n = args, n
        self.run_dir = Path(args.cluster_dir) / f"n{n}"
        self.row: dict = {"n": n, "label": args.label, "source": str(Path(args.source).resolve()),
                          "resync_s": args.resync, "rest_window_s": args.rest_window}

    def up(self) -> None:
        from kubernetes import client, config

        from localcluster.controlplane import Cluster

        os.environ["EMBEDOPS_REAL_NODE"] = "0"
        self.cluster = Cluster(run_dir=self.run_dir, real_node=False)
        self.cluster.down(quiet=True)  # a fresh etcd for every N
        t = time.monotonic()
        self.kubeconfig = str(self.cluster.up())
        log(f"control plane up in {time.monotonic() - t:.1f}s ({self.run_dir})")
        self.api = config.new_client_from_config(config_file=self.kubeconfig)
        self.api.configuration.connection_pool_maxsize = 16
        self.core = client.CoreV1Api(self.api)
        self.apps = client.AppsV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        for node in bench_nodes(self.n):
            self.core.create_node(node)
            self.core.patch_node_status(node["metadata"]["name"], {"status": node["status"]})
        self._wait("bench nodes Ready", self._nodes_ready, 120)
        import yaml

        crd = yaml.safe_load((REPO / "crds" / "embedops.dev_embeddingservices.yaml").read_text())
        client.ApiextensionsV1Api(self.api).create_custom_resource_definition(crd)
        for ns in (NS, FLOOR_NS, OPERATOR_SA[1]):
            self.core.create_namespace({"metadata": {"name": ns}})
        self._wait("CRD established", lambda: self._get_raw(f"/apis/{GROUP}/{VERSION}") is not None, 60)
        self._wait("default ServiceAccounts", lambda: self._sa_exists(NS) and self._sa_exists(FLOOR_NS), 60)
        self.operator_kubeconfig = self._operator_identity()

    def down(self) -> None:
        if getattr(self, "cluster", None) and not self.args.keep:
            self.cluster.down(quiet=True)

    def _nodes_ready(self) -> bool:
        items = self.core.list_node(label_selector="type=kwok").items
        ok = [n for n in items if n.metadata.name.startswith("bench-")
              and any(c.type == "Ready" and c.status == "True" for c in n.status.conditions or [])
              and not any(t.key.startswith("node.kubernetes.io/") for t in n.spec.taints or [])]
        return len(ok) == len(bench_nodes(self.n))

    def _sa_exists(self, ns: str) -> bool:
        try:
            self.core.read_namespaced_service_account("default", ns)
            return True
        except Exception:  # noqa: BLE001
            return False

    def _get_raw(self, path: str) -> str | None:
        try:
            resp = self.api.call_api("GET", self.api.configuration.host + path,
                                     header_params={"Accept": "*/*"}, _request_timeout=30)
            data = resp.read()
            return data.decode() if resp.status == 200 else None
        except Exception:  # noqa: BLE001
            return None

    def metrics(self) -> dict[str, float]:
        text = self._get_raw("/metrics") or ""
        return {"all": metric_sum(text, "apiserver_request_total"),
                "operator": metric_sum(text, "apiserver_flowcontrol_dispatched_requests_total",
                                       {"flow_schema": FLOW_SCHEMA})}

    def _wait(self, what: str, ok, timeout: float, interval: float = 0.5) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if ok():
                    return
            except Exception:  # noqa: BLE001
                pass
            time.sleep(interval)
        raise TimeoutError(f"timed out waiting for {what}")

    def _operator_identity(self) -> str:
        """A ServiceAccount bound to cluster-admin (the same rights for every operator version measured), a
        FlowSchema matching only it, and a kubeconfig with its token."""
        from kubernetes import client
        import yaml

        name, ns = OPERATOR_SA
        self.core.create_namespaced_service_account(ns, {"metadata": {"name": name}})
        client.RbacAuthorizationV1Api(self.api).create_cluster_role_binding({
            "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ns}]})
        client.FlowcontrolApiserverV1Api(self.api).create_flow_schema({
            "metadata": {"name": FLOW_SCHEMA},
            "spec": {"matchingPrecedence": 500, "priorityLevelConfiguration": {"name": "workload-high"},
                     "distinguisherMethod": {"type": "ByUser"},
                     "rules": [{"subjects": [{"kind": "ServiceAccount",
                                              "serviceAccount": {"name": name, "namespace": ns}}],
                                "resourceRules": [{"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"],
                                                   "clusterScope": True, "namespaces": ["*"]}],
                                "nonResourceRules": [{"verbs": ["*"], "nonResourceURLs": ["*"]}]}]}})
        token = self.core.create_namespaced_service_account_token(name, ns, {
            "spec": {"audiences": [], "expirationSeconds": 7200}}).status.token
        admin = yaml.safe_load(Path(self.kubeconfig).read_text())
        cluster = admin["clusters"][0]
        path = self.run_dir / "operator.kubeconfig"
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "clusters": [cluster],
            "users": [{"name": "operator", "user": {"token": token}}],
            "contexts": [{"name": "operator", "context": {"cluster": cluster["name"], "user": "operator"}}],
            "current-context": "operator"}))
        os.chmod(path, 0o600)
        return str(path)

    # ------------------------------------------------------------------------------------------ floor
    def floor(self) -> None:
        from kubernetes.client.rest import ApiException

        manifests = floor_manifests(self.n)

        def apply(m: dict) -> None:
            meta = m["metadata"]
            group = "/apis/apps/v1" if m["kind"] == "Deployment" else "/api/v1"
            plural = "deployments" if m["kind"] == "Deployment" else "services"
            for attempt in range(5):
                try:
                    resp = self.api.call_api(
                        "PATCH", f"{self.api.configuration.host}{group}/namespaces/{meta['namespace']}/{plural}/"
                        f"{meta['name']}?fieldManager=bench-floor&force=true",
                        header_params={"Content-Type": "application/apply-patch+yaml",
                                       "Accept": "application/json"}, body=m, _request_timeout=60)
                    resp.read()
                    if resp.status < 300:
                        return
                    raise ApiException(status=resp.status, reason=resp.reason)
                except ApiException:
                    if attempt == 4:
                        raise
                    time.sleep(1)

        log(f"floor: applying {len(manifests)} objects directly")
        t0 = time.monotonic()
        with ThreadPoolExecutor(8) as ex:
            list(ex.map(apply, manifests))
        applied = time.monotonic() - t0

        def all_ready() -> bool:
            items = self.apps.list_namespaced_deployment(FLOOR_NS).items
            return len(items) == self.n and all((d.status.ready_replicas or 0) >= 1 for d in items)
        self._wait("floor Deployments ready", all_ready, self.args.timeout, interval=1.0)
        self.row["floor_ready_s"] = round(time.monotonic() - t0, 1)
        self.row["floor_apply_s"] = round(applied, 1)
        log(f"floor: all {self.n} ready after {self.row['floor_ready_s']} s (applied in {applied:.1f} s)")
        self.core.delete_namespace(FLOOR_NS)
        self._wait("floor namespace gone", lambda: not [
            n for n in self.core.list_namespace().items if n.metadata.name == FLOOR_NS], self.args.timeout, 2.0)

    # ------------------------------------------------------------------------------------------ operator
    def start_operator(self, phase: str = "") -> None:
        from localcluster.pki import free_port

        src = Path(self.args.source).resolve()
        env = {**os.environ, "KUBECONFIG": self.operator_kubeconfig,
               "PYTHONPATH": str(src / "operator") + os.pathsep + os.environ.get("PYTHONPATH", "")}
        log_path = self.run_dir / f"operator-{self.args.label}{phase}.log"
        self.op_log = open(log_path, "w")
        self.op_metrics = f"127.0.0.1:{free_port()}"
        code = ("import sys, embedops_operator; print('embedops_operator from', embedops_operator.__file__, "
                "file=sys.stderr, flush=True); from embedops_operator.cli import main; "
                "sys.exit(main(sys.argv[1:]))")
        self.op = subprocess.Popen(
            [sys.executable, "-c", code, "run", "--resync-seconds", str(self.args.resync), "--liveness", "",
             "--metrics-address", self.op_metrics, "--metrics-auth", "none"],
            env=env, stdout=self.op_log, stderr=subprocess.STDOUT, cwd=str(src), start_new_session=True)
        self._wait("operator started", lambda: "startup' succeeded" in log_path.read_text(), 120)
        log(f"operator: {log_path.read_text().splitlines()[0]}")

    def operator_metrics(self) -> str:
        import urllib.request

        with urllib.request.urlopen(f"http://{self.op_metrics}/metrics", timeout=30) as r:
            return r.read().decode()

    def deployment_applies(self) -> float:
        text = self._get_raw("/metrics") or ""
        return sum(metric_sum(text, "apiserver_request_total", {"resource": "deployments", "verb": verb,
                                                                 "subresource": ""}) for verb in ("APPLY", "PATCH"))

    def proc_stats(self) -> dict:
        status = Path(f"/proc/{self.op.pid}/status").read_text()
        hwm = int(re.search(r"VmHWM:\s+(\d+)", status).group(1)) / 1024
        rss = int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024
        fields = Path(f"/proc/{self.op.pid}/stat").read_text().rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return {"cpu_s": round(cpu, 1), "peak_rss_mb": round(hwm, 1), "rss_mb": round(rss, 1)}

    def stop_operator(self) -> None:
        if getattr(self, "op", None) and self.op.poll() is None:
            os.killpg(self.op.pid, signal.SIGTERM)
            try:
                self.op.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.op.pid, signal.SIGKILL)
                self.op.wait(10)

    def rollout(self) -> None:
        m0 = self.metrics()
        t0 = time.monotonic()
        # the operator's request rate, its busiest 10 s (its FlowSchema's count, sampled beside the ramp)
        rates, done = [], threading.Event()

        def sample() -> None:
            last = m0["operator"]
            while not done.wait(10.0):
                with contextlib.suppress(Exception):
                    now = self.metrics()["operator"]
                    rates.append((now - last) / 10.0)
                    last = now
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        with ThreadPoolExecutor(8) as ex:
            list(ex.map(lambda i: self.custom.create_namespaced_custom_object(
                GROUP, VERSION, NS, PLURAL, es_body(i)), range(self.n)))
        created = time.monotonic() - t0
        polls = 0

        def all_ready() -> bool:
            nonlocal polls
            polls += 1
            items = self.custom.list_namespaced_custom_object(GROUP, VERSION, NS, PLURAL)["items"]
            return len(items) == self.n and all(ready(e) for e in items)
        self._wait("all EmbeddingServices Ready", all_ready, self.args.timeout, interval=1.0)
        self.row["operator_ready_s"] = round(time.monotonic() - t0, 1)
        self.row["create_s"] = round(created, 1)
        done.set()
        sampler.join(30)
        self.row["rollout_peak_rps"] = round(max(rates, default=0.0), 1)
        m1 = self.metrics()
        self.row["rollout_requests_operator"] = int(m1["operator"] - m0["operator"])
        # the bench's own creates and Ready polls are in the server's total; subtract them
        self.row["rollout_requests_all_minus_bench"] = int(m1["all"] - m0["all"] - self.n - polls - 2)
        self.row.update({f"rollout_{k}": v for k, v in self.proc_stats().items()})
        log(f"operator: all {self.n} Ready after {self.row['operator_ready_s']} s; "
            f"{self.row['rollout_requests_operator']} operator requests; {self.proc_stats()}")

    def at_rest(self) -> None:
        w = self.args.rest_window
        time.sleep(self.args.settle)
        cpu0 = self.proc_stats()["cpu_s"]
        m0 = self.metrics()
        time.sleep(w)
        m1 = self.metrics()
        stats = self.proc_stats()
        self.row["rest_operator_cpu_s_per_min"] = round((stats["cpu_s"] - cpu0) / w * 60, 2)
        self.row["peak_rss_mb"] = stats["peak_rss_mb"]
        self.row["cpu_s_total"] = stats["cpu_s"]
        # one Prometheus scrape of the operator's /metrics at rest (the fleet's conditions, replicas, restarts):
        # the median of five, after one that fills what the scrapes keep between them
        took = []
        for _ in range(6):
            t = time.monotonic()
            self.operator_metrics()
            took.append(time.monotonic() - t)
        self.row["scrape_ms"] = round(sorted(took[1:])[2] * 1000, 1)
        self.row["first_scrape_ms"] = round(took[0] * 1000, 1)
        self.stop_operator()
        time.sleep(2)
        m2 = self.metrics()
        time.sleep(w)
        m3 = self.metrics()
        running, stopped = m1["all"] - m0["all"], m3["all"] - m2["all"]
        self.row["rest_all_running_per_min"] = round(per_minute(running, w), 1)
        self.row["rest_all_stopped_per_min"] = round(per_minute(stopped, w), 1)
        self.row["rest_per_min"] = round(per_minute(running - stopped, w), 1)
        self.row["rest_operator_per_min"] = round(per_minute(m1["operator"] - m0["operator"], w), 1)
        log(f"at rest ({w:.0f} s windows): running {self.row['rest_all_running_per_min']}/min, stopped "
            f"{self.row['rest_all_stopped_per_min']}/min -> {self.row['rest_per_min']}/min; the operator's own "
            f"(FlowSchema) {self.row['rest_operator_per_min']}/min")

    def restart(self) -> None:
        """After at_rest (the operator stopped): a new operator process with every service present."""
        m0, applies0 = self.metrics(), self.deployment_applies()
        t0 = time.monotonic()
        self.start_operator("-restart")

        def drained() -> bool:
            text = self.operator_metrics()
            done = metric_sum(text, "embedops_operator_reconciles_total")
            return done >= self.n and metric_sum(text, "embedops_operator_workqueue_depth") == 0
        self._wait("the restarted operator's queue drained", drained, self.args.timeout, interval=1.0)
        self.row["restart_s"] = round(time.monotonic() - t0, 1)
        stats = self.proc_stats()
        self.row.update({"restart_cpu_s": stats["cpu_s"], "restart_peak_rss_mb": stats["peak_rss_mb"],
                         "restart_rss_mb": stats["rss_mb"]})
        m1 = self.metrics()
        self.row["restart_requests_operator"] = int(m1["operator"] - m0["operator"])
        self.row["restart_deployment_applies"] = int(self.deployment_applies() - applies0)
        time.sleep(self.args.settle)
        self.row["restart_settled_rss_mb"] = self.proc_stats()["rss_mb"]
        log(f"restart: every service reconciled after {self.row['restart_s']} s; {stats}; "
            f"{self.row['restart_requests_operator']} operator requests, "
            f"{self.row['restart_deployment_applies']} Deployment applies")
        self.stop_operator()

    def run(self) -> dict:
        try:
            self.up()
            if not self.args.no_floor:
                self.floor()
            self.start_operator()
            self.rollout()
            self.at_rest()
            if self.args.restart:
                self.restart()
            if self.row.get("floor_ready_s"):
                self.row["vs_floor"] = round(self.row["operator_ready_s"] / self.row["floor_ready_s"], 2)
        except Exception as exc:  # noqa: BLE001 - reported in the row
            import traceback

            traceback.print_exc()
            self.row["error"] = f"{type(exc).__name__}: {exc}"[:500]
        finally:
            self.stop_operator()
            self.down()
        return self.row


# ---------------------------------------------------------------------------------------------- report

COLUMNS = [("label", "{}", 8), ("n", "{}", 5), ("floor_ready_s", "{:.1f}", 8), ("create_s", "{:.1f}", 8),
           ("operator_ready_s", "{:.1f}", 8), ("vs_floor", "{:.2f}", 6), ("rollout_cpu_s", "{:.1f}", 7),
           ("peak_rss_mb", "{:.0f}", 7), ("rollout_requests_operator", "{}", 9), ("rollout_peak_rps", "{:.1f}", 8),
           ("rest_per_min", "{:.1f}", 9),
           ("rest_operator_per_min", "{:.1f}", 8), ("rest_operator_cpu_s_per_min", "{:.2f}", 8),
           ("scrape_ms", "{:.1f}", 9),
           ("restart_s", "{:.1f}", 9), ("restart_peak_rss_mb", "{:.0f}", 10), ("restart_cpu_s", "{:.1f}", 9),
           ("restart_requests_operator", "{}", 9), ("restart_deployment_applies", "{}", 9)]
HEADERS = ["version", "N", "floor s", "create s", "Ready s", "/floor", "CPU s", "RSS MB", "rollout req", "peak r/s",
           "rest/min",
           "own/min", "CPU s/min", "scrape ms", "restart s", "restart MB", "restart CPU", "restart req", "dep applies"]


def table(rows: list[dict]) -> str:
    hdr = " ".join(f"{h:>{w}}" for h, (_, _, w) in zip(HEADERS, COLUMNS))
    lines = [hdr, "-" * len(hdr)]
    for r in rows:
        cells = []
        for key, fmt, w in COLUMNS:
            v = r.get(key)
            cells.append(f"{'-' if v is None else fmt.format(v):>{w}}")
        lines.append(" ".join(cells) + (f"  error: {r['error']}" if r.get("error") else ""))
    lines += ["", "Ready s: first create until every EmbeddingService is Ready; floor s: the same rendered objects "
              "applied directly; create s: the bench's own creates of the N EmbeddingServices (8 at once), what "
              "the operator's requests slow for everyone else; CPU s and RSS MB: the operator process until all "
              "Ready (RSS: peak, VmHWM); rollout req: the operator's requests (its FlowSchema), peak r/s: their "
              "busiest 10 s; scrape ms: one GET of the operator's /metrics at rest (median of five); rest/min: apiserver_request_total with the "
              "operator running minus the same window stopped; own/min: the operator's requests at rest; restart "
              "(--restart): a new operator process with every service present, until every service was reconciled "
              "once: seconds, peak RSS (VmHWM), CPU s, its requests and server-side applies of Deployments."]
    return "\n".join(lines)


def targets_check(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        if r.get("n") == 1000 and r.get("operator_ready_s"):
            out.append(f"{r['label']} N=1000: Ready {r.get('vs_floor')}x floor (target <= 1.5), RSS "
                       f"{r.get('peak_rss_mb')} MB (<= 300), at rest {r.get('rest_per_min')}/min (<= 60)")
        if r.get("n", 0) >= 1000 and (r.get("peak_rss_mb") or r.get("restart_peak_rss_mb")):
            out.append(f"{r['label']} N={r['n']}: RSS through the ramp {r.get('peak_rss_mb')} MB and the restart "
                       f"{r.get('restart_peak_rss_mb')} MB (issue 58: <= 300 at 5,000)")
        if r.get("n") == 200 and r.get("rest_per_min") is not None:
            out.append(f"{r['label']} N=200: at rest {r['rest_per_min']}/min (target <= 20)")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench --operator", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", default="200", help="comma list of fleet sizes (default 200)")
    ap.add_argument("--source", default=str(REPO), help="checkout whose operator/ is measured (default: this)")
    ap.add_argument("--label", default="this", help="name of the version in the table (e.g. before, after)")
    ap.add_argument("--resync", type=float, default=30.0, help="the operator's --resync-seconds")
    ap.add_argument("--rest-window", type=float, default=120.0, help="seconds of each at-rest window")
    ap.add_argument("--settle", type=float, default=20.0, help="seconds after all Ready before measuring rest")
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--no-floor", action="store_true")
    ap.add_argument("--restart", action="store_true",
                    help="after the at-rest windows, start the operator again and measure its restart")
    ap.add_argument("--keep", action="store_true", help="leave the cluster running")
    ap.add_argument("--cluster-dir", default=str(Path(os.environ.get("TMPDIR", "/tmp")) / "embedops-opbench"))
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    rows = []
    for n in [int(x) for x in args.n.split(",") if x]:
        log(f"N={n}: {args.label} ({args.source})")
        rows.append(Bench(args, n).run())
        print(table(rows), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    res = {"meta": {"utc": stamp, "argv": sys.argv[1:], "cpus": len(os.sched_getaffinity(0)),
                    "loadavg": os.getloadavg()}, "rows": rows, "targets": targets_check(rows)}
    for name in (f"operator-{args.label}-{stamp}.json", "operator-latest.json"):
        (out / name).write_text(json.dumps(res, indent=1))
    print("\n".join(res["targets"]))
    log("results:", out / f"operator-{args.label}-{stamp}.json")
    return 0 if not any(r.get("error") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
