"""Monitoring on its real controllers in the local cluster: Prometheus Operator and the Prometheus it runs.

What a platform team installs with kube-prometheus-stack, made here from Go modules (components.py,
``monitoring`` set) since no image can be pulled:

* the ``monitoring.coreos.com`` CRDs Prometheus Operator needs to start;
* Prometheus Operator v0.93.0 as a process beside the control plane (recorded in the cluster's state, so
  ``controlplane down`` stops it), with the admin client certificate; it renders every Prometheus object
  into a StatefulSet, its config from the ServiceMonitors the Prometheus selects;
* the images of Prometheus 3.x and the config reloader (``images.build_binary_image``: the static binaries
  on the Debian base), imported into the real node: the operator is told the reloader's image
  (``--prometheus-config-reloader``) and the Prometheus object names its own ``image``;
* one Prometheus, ``monitoring/embedops``, on the real node, selecting ServiceMonitors and PrometheusRules
  labelled ``release: kube-prometheus-stack`` in every namespace (kube-prometheus-stack's default selector
  for a release of that name). The operator's Service ``prometheus-operated.monitoring`` is the address the
  EmbeddingService's ``autoscaling.prometheusAddress`` defaults to.

* KEDA v2.21.0, operator and metrics adapter, as pods on the real node from KEDA's own install manifests
  (its Go module's ``config/``: namespace ``keda``, RBAC, Deployments, Services, the ``APIService``
  ``v1beta1.external.metrics.k8s.io``) with our images; the operator makes the adapter's certificates and the
  APIService's CA bundle itself (``--enable-cert-rotation``). The API server reaches the adapter through the
  aggregation layer (front-proxy flags in controlplane.py). The admission webhooks are left out.

* prometheus-adapter v0.12.0 (the HPA fallback without KEDA), a pod on the real node serving
  ``custom.metrics.k8s.io`` from this Prometheus with one rule, ``te_queue_size`` per pod
  (``ADAPTER_RULES``: what a platform team adds to its own adapter).

API::

    stack = monitoring.up(kube, cluster)   # idempotent; waits until Prometheus is ready
    monitoring.keda_up(kube)               # idempotent; waits until external metrics are served
    monitoring.adapter_up(kube)            # idempotent; prometheus-adapter serving custom metrics
    stack.url                              # http://<pod IP>:9090, reachable from this machine (the bridge)
    stack.query('up{namespace="x"}')       # the result list of /api/v1/query
    monitoring.SELECTOR                    # the labels a ServiceMonitor needs to be selected
"""
from __future__ import annotations

import json
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from .components import PROMETHEUS_VERSION, expand, provided
from .workloads import REAL_NODE_TOLERATIONS, controller_access

NAMESPACE = "monitoring"
PROMETHEUS = "embedops"
SELECTOR = {"release": "kube-prometheus-stack"}
SCRAPE_INTERVAL = "5s"  # short so that tests see load within seconds; a ServiceMonitor's own interval wins
OPERATOR_PROCESS = "prometheus-operator"


def _log(msg: str) -> None:
    print(f"[monitoring {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def manifests(prometheus_image: str, node_selector: dict) -> list[dict]:
    """The namespace, Prometheus' ServiceAccount and read-only RBAC (what kube-prometheus-stack grants it),
    and the Prometheus object."""
    rules = [{"apiGroups": [""], "resources": ["nodes", "nodes/metrics", "services", "endpoints", "pods"],
              "verbs": ["get", "list", "watch"]},
             {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]},
             {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get"]},
             {"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]
    return [
        *controller_access(NAMESPACE, "prometheus", rules),
        {"apiVersion": "monitoring.coreos.com/v1", "kind": "Prometheus",
         "metadata": {"name": PROMETHEUS, "namespace": NAMESPACE},
         "spec": {"image": prometheus_image, "version": f"v{PROMETHEUS_VERSION}", "replicas": 1,
                  "serviceAccountName": "prometheus",
                  "serviceMonitorSelector": {"matchLabels": SELECTOR}, "serviceMonitorNamespaceSelector": {},
                  "ruleSelector": {"matchLabels": SELECTOR}, "ruleNamespaceSelector": {},
                  "podMonitorSelector": {"matchLabels": SELECTOR}, "probeSelector": {"matchLabels": SELECTOR},
                  "scrapeConfigSelector": {"matchLabels": SELECTOR},
                  "scrapeInterval": SCRAPE_INTERVAL, "evaluationInterval": SCRAPE_INTERVAL, "retention": "2h",
                  "nodeSelector": node_selector, "tolerations": REAL_NODE_TOLERATIONS,
                  "resources": {"requests": {"cpu": "50m", "memory": "128Mi"}, "limits": {"memory": "1Gi"}}}},
    ]


@dataclass
class Stack:
    url: str
    operator_log: Path

    def query(self, promql: str, timeout: float = 10) -> list[dict]:
        """The ``result`` of an instant query (``data.result``); raises on an error answer."""
        q = urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{q}", timeout=timeout) as r:
            body = json.loads(r.read())
        if body.get("status") != "success":
            raise RuntimeError(f"Prometheus refused {promql!r}: {body}")
        return body["data"]["result"]

    def rule_groups(self) -> list[dict]:
        with urllib.request.urlopen(f"{self.url}/api/v1/rules", timeout=10) as r:
            return json.loads(r.read())["data"]["groups"]

    def targets(self) -> list[dict]:
        with urllib.request.urlopen(f"{self.url}/api/v1/targets?state=active", timeout=10) as r:
            return json.loads(r.read())["data"]["activeTargets"]


def _build() -> dict:
    """The binaries (built once per version) and the two images, imported by the caller."""
    from . import images
    from .build import Builder

    Builder().build_all(expand(["monitoring"]))
    prom = images.build_binary_image("prometheus", [provided("prometheus"), provided("prometheus", "promtool")])
    reloader = images.build_binary_image("prometheus-config-reloader",
                                         [provided("prometheus-operator", "prometheus-config-reloader")])
    return {"prometheus": prom, "prometheus-config-reloader": reloader}


def _start_operator(cluster, reloader_image: str) -> Path:
    """Prometheus Operator as a process of the cluster (its state file records it; ``down`` stops it)."""
    st = cluster.read_state()
    log = cluster.run_dir / "logs" / f"{OPERATOR_PROCESS}.log"
    running = [p for p in st.get("procs", []) if p["name"] == OPERATOR_PROCESS]
    if running and cluster.exit_status(running[0]) is None and f"--prometheus-config-reloader={reloader_image}" \
            in running[0].get("argv", []):
        return log
    if running:  # dead, or started for another reloader image
        cluster.stop_processes(running)
        st = cluster.read_state()
        st["procs"] = [p for p in st["procs"] if p["name"] != OPERATOR_PROCESS]
        cluster.save_state(st)
    from .pki import free_port

    pki = cluster.run_dir / "pki"
    argv = [str(provided("prometheus-operator")), f"--apiserver={st['server']}",
            f"--cert-file={pki / 'admin.crt'}", f"--key-file={pki / 'admin.key'}", f"--ca-file={pki / 'ca.crt'}",
            f"--prometheus-config-reloader={reloader_image}",
            f"--web.listen-address=127.0.0.1:{free_port()}", "--log-level=info"]
    cluster.spawn(st, OPERATOR_PROCESS, argv)
    return log


def up(kube, cluster, timeout: float = 300) -> Stack:
    """Build what is missing, start Prometheus Operator, apply the Prometheus and wait until it is ready."""
    from kubernetes import client

    if not kube.real_node:
        raise RuntimeError(f"monitoring needs the real node to run Prometheus: {kube.real_node_reason}")
    t = time.monotonic()
    built = _build()
    kube.import_images(list(built.values()))
    kube.install_crds(["monitoring"])
    log = _start_operator(cluster, built["prometheus-config-reloader"].ref)
    kube.apply(manifests(built["prometheus"].ref, {"kubernetes.io/hostname": kube.real_node}))
    pod = f"prometheus-{PROMETHEUS}-0"
    deadline = time.monotonic() + timeout
    with kube.api_client() as api:
        core = client.CoreV1Api(api)
        while True:
            try:
                p = core.read_namespaced_pod(pod, NAMESPACE)
                if p.status.pod_ip and all(c.ready for c in p.status.container_statuses or [False]) \
                        and p.status.container_statuses:
                    stack = Stack(f"http://{p.status.pod_ip}:9090", log)
                    try:
                        stack.query("vector(1)")
                        break
                    except OSError:
                        pass
            except client.ApiException as e:
                if e.status != 404:
                    raise
            exited = [x for x in cluster.read_state().get("procs", []) if x["name"] == OPERATOR_PROCESS
                      and cluster.exit_status(x) is not None]
            if exited or time.monotonic() > deadline:
                tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
                raise TimeoutError(f"Prometheus {NAMESPACE}/{pod} not ready after {time.monotonic() - t:.0f}s "
                                   f"(operator {'exited' if exited else 'running'}); operator log:\n{tail}")
            time.sleep(1)
    _log(f"Prometheus {PROMETHEUS_VERSION} ready at {stack.url} in {time.monotonic() - t:.0f}s")
    return stack


KEDA_NAMESPACE = "keda"


def keda_manifests(operator_image: str, adapter_image: str, node_selector: dict) -> list[dict]:
    """KEDA's own install manifests with our images, placed on the real node."""
    from .components import KEDA_MANIFESTS, component
    from .kube import load_yaml

    c = component("keda-controllers")
    docs = []
    for m in KEDA_MANIFESTS:
        docs += load_yaml(c.path(f"manifests/{m.removeprefix('config/')}").read_text())
    images = {"keda-operator": (operator_image, "/bin/keda-operator"),
              "keda-metrics-apiserver": (adapter_image, "/bin/keda-adapter")}
    for d in docs:
        if d["kind"] != "Deployment":
            continue
        pod = d["spec"]["template"]["spec"]
        pod["nodeSelector"] = {**(pod.get("nodeSelector") or {}), **node_selector}
        pod["tolerations"] = list(pod.get("tolerations") or []) + REAL_NODE_TOLERATIONS
        for ctr in pod["containers"]:
            image, command = images[ctr["name"]]
            ctr.update(image=image, command=[command], imagePullPolicy="IfNotPresent",
                       resources={"requests": {"cpu": "20m", "memory": "64Mi"}, "limits": {"memory": "512Mi"}})
            # readiness gates the APIService; the defaults wait 20 s before the first probe
            for probe in ("readinessProbe", "livenessProbe"):
                if probe in ctr:
                    ctr[probe]["initialDelaySeconds"] = 2 if probe == "readinessProbe" else 30
                    ctr[probe]["periodSeconds"] = 2 if probe == "readinessProbe" else 10
    return docs


def keda_up(kube, timeout: float = 300) -> None:
    """Build what is missing, install KEDA's CRDs and controllers, and wait until the API server serves
    external metrics through KEDA's adapter."""
    from . import images
    from .build import Builder

    if not kube.real_node:
        raise RuntimeError(f"KEDA needs the real node: {kube.real_node_reason}")
    t = time.monotonic()
    Builder().build_all(expand(["keda-controllers"]))
    op = images.build_binary_image("keda-operator", [provided("keda-controllers", "keda-operator")])
    adapter = images.build_binary_image("keda-adapter", [provided("keda-controllers", "keda-adapter")])
    kube.import_images([op, adapter])
    kube.install_crds(["keda"])
    kube.apply(keda_manifests(op.ref, adapter.ref, {"kubernetes.io/hostname": kube.real_node}))
    wait_api_service(kube, "v1beta1.external.metrics.k8s.io", KEDA_NAMESPACE, timeout)
    _log(f"KEDA {op.ref.rsplit(':', 1)[0]} serving external metrics in {time.monotonic() - t:.0f}s")


# ------------------------------------------------------------------------------------- prometheus-adapter
ADAPTER = "prometheus-adapter"
# The rule a platform team adds to prometheus-adapter (its Helm chart's `rules.custom`) for the operator's HPA
# fallback: te_queue_size per pod, as the custom metrics API's pods metric the HPA asks for.
ADAPTER_RULES = {"rules": [{
    "seriesQuery": 'te_queue_size{namespace!="",pod!=""}',
    "resources": {"overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}},
    "name": {"matches": "^te_queue_size$", "as": "te_queue_size"},
    "metricsQuery": "sum(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)",
}]}


def adapter_manifests(image: str, node_selector: dict, prometheus_url: str) -> list[dict]:
    """prometheus-adapter as its own deploy/manifests install it, for custom metrics only: ServiceAccount,
    RBAC (read pods and namespaces, delegated authentication, the API server's authentication ConfigMap, and
    the HPA controller's access to custom.metrics.k8s.io), the rule's ConfigMap, one Deployment on the real
    node with a self-signed serving certificate, its Service and the APIService."""
    labels = {"app.kubernetes.io/name": ADAPTER}
    meta = lambda name, ns=NAMESPACE: {"name": name, "namespace": ns, "labels": labels}  # noqa: E731
    cluster_meta = lambda name: {"name": name, "labels": labels}  # noqa: E731
    sa = {"kind": "ServiceAccount", "name": ADAPTER, "namespace": NAMESPACE}
    probe = {"httpGet": {"path": "/readyz", "port": "https", "scheme": "HTTPS"}, "periodSeconds": 2,
             "failureThreshold": 5}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta(ADAPTER)},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": cluster_meta(ADAPTER),
         "rules": [{"apiGroups": [""], "resources": ["nodes", "namespaces", "pods", "services"],
                    "verbs": ["get", "list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": cluster_meta(ADAPTER),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": ADAPTER},
         "subjects": [sa]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": cluster_meta(f"{ADAPTER}:system:auth-delegator"),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "system:auth-delegator"},
         "subjects": [sa]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": meta(f"{ADAPTER}-auth-reader", "kube-system"),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                     "name": "extension-apiserver-authentication-reader"}, "subjects": [sa]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": cluster_meta("custom-metrics-server-resources"),
         "rules": [{"apiGroups": ["custom.metrics.k8s.io"], "resources": ["*"], "verbs": ["get", "list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": cluster_meta("hpa-controller-custom-metrics"),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                     "name": "custom-metrics-server-resources"},
         "subjects": [{"kind": "ServiceAccount", "name": "horizontal-pod-autoscaler", "namespace": "kube-system"}]},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta(f"{ADAPTER}-config"),
         "data": {"config.yaml": json.dumps(ADAPTER_RULES, indent=1)}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta(ADAPTER),
         "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                  "template": {"metadata": {"labels": labels}, "spec": {
                      "serviceAccountName": ADAPTER, "nodeSelector": node_selector,
                      "tolerations": REAL_NODE_TOLERATIONS,
                      "securityContext": {"runAsNonRoot": True, "runAsUser": 65534,
                                          "seccompProfile": {"type": "RuntimeDefault"}},
                      "containers": [{
                          "name": ADAPTER, "image": image, "imagePullPolicy": "IfNotPresent",
                          "command": ["/bin/prometheus-adapter"],
                          "args": ["--cert-dir=/var/run/serving-cert", "--config=/etc/adapter/config.yaml",
                                   # how soon a new series (a new pod's) becomes a metric; the chart's default is 1m
                                   "--metrics-relist-interval=10s", f"--prometheus-url={prometheus_url}",
                                   "--secure-port=6443"],
                          "ports": [{"name": "https", "containerPort": 6443}],
                          "readinessProbe": probe,
                          "livenessProbe": {**probe, "httpGet": {**probe["httpGet"], "path": "/livez"},
                                            "initialDelaySeconds": 30, "periodSeconds": 10},
                          "resources": {"requests": {"cpu": "20m", "memory": "64Mi"}, "limits": {"memory": "512Mi"}},
                          "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                              "capabilities": {"drop": ["ALL"]}},
                          "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"},
                                           {"name": "serving-cert", "mountPath": "/var/run/serving-cert"},
                                           {"name": "config", "mountPath": "/etc/adapter"}]}],
                      "volumes": [{"name": "tmp", "emptyDir": {}}, {"name": "serving-cert", "emptyDir": {}},
                                  {"name": "config", "configMap": {"name": f"{ADAPTER}-config"}}]}}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": meta(ADAPTER),
         "spec": {"selector": labels, "ports": [{"name": "https", "port": 443, "targetPort": 6443}]}},
        {"apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService", "metadata": cluster_meta(
            "v1beta1.custom.metrics.k8s.io"),
         "spec": {"group": "custom.metrics.k8s.io", "version": "v1beta1", "insecureSkipTLSVerify": True,
                  "groupPriorityMinimum": 100, "versionPriority": 100,
                  "service": {"name": ADAPTER, "namespace": NAMESPACE}}},
    ]


def adapter_up(kube, timeout: float = 300) -> None:
    """Build what is missing, run prometheus-adapter on the real node against this Prometheus, and wait until
    the API server serves the custom metrics API through it."""
    from . import images
    from .build import Builder

    if not kube.real_node:
        raise RuntimeError(f"prometheus-adapter needs the real node: {kube.real_node_reason}")
    t = time.monotonic()
    Builder().build_all(expand(["prometheus-adapter"]))
    image = images.build_binary_image(ADAPTER, [provided("prometheus-adapter", "prometheus-adapter")])
    kube.import_images([image])
    kube.apply(adapter_manifests(image.ref, {"kubernetes.io/hostname": kube.real_node},
                                 f"http://prometheus-operated.{NAMESPACE}.svc:9090/"))
    wait_api_service(kube, "v1beta1.custom.metrics.k8s.io", NAMESPACE, timeout)
    _log(f"prometheus-adapter {image.ref.rsplit(':', 1)[0]} serving custom metrics in {time.monotonic() - t:.0f}s")


def wait_api_service(kube, name: str, namespace: str, timeout: float) -> None:
    """Until the aggregated APIService ``name`` is Available (its server answers the API server); on a timeout
    the error carries its conditions and the Deployments of ``namespace`` (where its server runs)."""
    from kubernetes import client

    deadline = time.monotonic() + timeout
    with kube.api_client() as api:
        reg = client.ApiregistrationV1Api(api)
        while True:
            svc = reg.read_api_service(name)
            conds = {c.type: (c.status, c.message) for c in (svc.status.conditions or [])}
            if conds.get("Available", ("",))[0] == "True":
                return
            if time.monotonic() > deadline:
                deps = {d.metadata.name: (d.status.ready_replicas, d.status.conditions and
                                          [c.message for c in d.status.conditions])
                        for d in client.AppsV1Api(api).list_namespaced_deployment(namespace).items}
                raise TimeoutError(f"APIService {name} not available after {timeout:.0f}s: {conds}; "
                                   f"deployments in {namespace}: {deps}")
            time.sleep(1)
