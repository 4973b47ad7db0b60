"""The Prometheus-operator ServiceMonitor of a service."""
from __future__ import annotations

from typing import Any

from ..spec import EmbeddingServiceSpec
from .base import ANNOTATION_METRICS_PORT, SERVICEMONITOR, common_labels, detect_task, object_meta, selector_labels

# Prometheus' name for a pod's annotation: every character but letters and digits an underscore
META_METRICS_PORT = "__meta_kubernetes_pod_annotation_" + "".join(
    c if c.isalnum() else "_" for c in ANNOTATION_METRICS_PORT)


def service_monitor(name: str, ns: str, spec: EmbeddingServiceSpec, owner: dict | None) -> dict:
    sm = spec.monitoring.service_monitor
    labels = {**common_labels(name, detect_task(spec.model)), **sm.labels}
    # service="<name>" on every series, what the ScaledObject's query, the dashboard and the alerts filter on.
    # Scaled to zero it scrapes <name>-backend; set always, so that switching to minReplicas 0 leaves the
    # ServiceMonitor (and Prometheus' config) as it is: seen live, a Prometheus that had not yet reloaded a
    # changed ServiceMonitor scraped the woken pod as service="<name>-backend" for minutes.
    # A pod that serves /metrics on a port of its own (template revision 7) says which in an annotation: its
    # address becomes that port (the API's clients cannot read the metrics); older pods are scraped on the API's.
    to_metrics_port = {"action": "replace", "sourceLabels": ["__address__", META_METRICS_PORT],
                       "regex": r"(.+?)(?::\d+)?;(\d+)", "replacement": "$1:$2", "targetLabel": "__address__"}
    endpoint: dict[str, Any] = {"port": "http", "path": "/metrics", "interval": sm.interval,
                                "relabelings": [to_metrics_port,
                                                {"action": "replace", "targetLabel": "service", "replacement": name}]}
    return {"apiVersion": SERVICEMONITOR[0], "kind": SERVICEMONITOR[1],
            "metadata": object_meta(name, ns, labels, owner),
            "spec": {"selector": {"matchLabels": selector_labels(name)},


                     "namespaceSelector": {"matchNames": [ns]},
                     "endpoints": [endpoint]}}


