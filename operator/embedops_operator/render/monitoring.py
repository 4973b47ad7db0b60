"""The Prometheus-operator ServiceMonitor of a service."""
from __future__ import annotations

from typing import Any

from ..spec import EmbeddingServiceSpec
from .base import SERVICEMONITOR, common_labels, detect_task, object_meta, selector_labels


def service_monitor(name: str, ns: str, spec: EmbeddingServiceSpec, owner: dict | None) -> dict:
    sm = spec.monitoring.service_monitor
    labels = {**common_labels(name, detect_task(spec.model)), **sm.labels}
    # service="<name>" on every series, what the ScaledObject's query, the dashboard and the alerts filter on.
    # Scaled to zero it scrapes <name>-backend; set always, so that switching to minReplicas 0 leaves the
    # ServiceMonitor (and Prometheus' config) as it is: seen live, a Prometheus that had not yet reloaded a
    # changed ServiceMonitor scraped the woken pod as service="<name>-backend" for minutes.
    endpoint: dict[str, Any] = {"port": "http", "path": "/metrics", "interval": sm.interval,
                                "relabelings": [{"action": "replace", "targetLabel": "service", "replacement": name}]}
    return {"apiVersion": SERVICEMONITOR[0], "kind": SERVICEMONITOR[1],
            "metadata": object_meta(name, ns, labels, owner),
            "spec": {"selector": {"matchLabels": selector_labels(name)},


                     "namespaceSelector": {"matchNames": [ns]},
                     "endpoints": [endpoint]}}


