"""The LiteLLM proxy's restart hash against a real API server (tests/conftest.py `kube`), without an operator.

Two writers can act on one shared ConfigMap at once: a service's reconcile removing its entry and the resync's
sweep of the same entry (every 5 s in the e2e tests, on its own thread). Each writes the entry, the index and
the proxies' pod-template hash in turn. Whatever order their requests land in, the proxy must end with the
hash of the ConfigMap as it is: a hash no version of it has rolls the proxy to nothing a caller waits for
(CI saw it once: tests/e2e/test_gateway_and_litellm.py waited 300 s for a rollout that had gone elsewhere).
"""
from __future__ import annotations

import pytest
import yaml

from embedops_operator import litellm, render
from embedops_operator.apply import Kube

pytestmark = [pytest.mark.cluster]

NS = "embedops-litellm-restart"
CM = "litellm-models"
PROXY = "litellm"


class WritesBetween:
    """The raw client, except that ``between`` runs just before this writer's first Deployment write: another
    writer finishing its whole change after this one read the ConfigMap."""

    def __init__(self, kube: Kube, between):
        # not `.kube`: restart_consumers takes that attribute for the raw client behind the operator's caches
        self.inner, self.between = kube, between

    def get(self, *args):
        return self.inner.get(*args)

    def list(self, *args):
        return self.inner.list(*args)

    def apply(self, obj: dict, manager: str | None = None) -> dict:
        if obj["kind"] == "Deployment" and self.between is not None:
            between, self.between = self.between, None
            between()
        return self.inner.apply(obj, manager=manager)


def proxy_hash(kube: Kube) -> str | None:
    template = kube.get("apps/v1", "Deployment", NS, PROXY)["spec"]["template"]["metadata"]
    return (template.get("annotations") or {}).get(litellm.ANNOTATION_HASH)


def included(kube: Kube) -> list[str]:
    return yaml.safe_load(kube.get("v1", "ConfigMap", NS, CM)["data"][litellm.INDEX_KEY])["include"]


def add_entry(kube: Kube, service: str) -> dict:
    """What a service's reconcile writes: its entry under its own manager, then the index."""
    after = kube.apply({"apiVersion": "v1", "kind": "ConfigMap",
                        "metadata": {"name": CM, "namespace": NS, "labels": {render.LABEL_LITELLM: "true"}},
                        "data": {render.litellm_key(service): f"model_list: [{{model_name: {service}}}]\n"}},
                       manager=litellm.manager(service))
    return litellm.sync_index(kube, after) or after


def drop_entry(kube: Kube, service: str) -> dict:
    """The first of a removal's writes: the entry goes, the index still lists it."""
    return kube.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": CM, "namespace": NS}},
                      manager=litellm.manager(service))


@pytest.fixture
def entries(kube):
    k = Kube(kube.api_client())
    kube.apply([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}])
    for obj in (("apps/v1", "Deployment", PROXY), ("v1", "ConfigMap", CM)):
        if k.get(obj[0], obj[1], NS, obj[2]) is not None:
            k.delete(obj[0], obj[1], NS, obj[2])
    # the platform team's proxy, labelled as the ConfigMap's consumer (no replicas: its template is what counts)
    labels = {"app.kubernetes.io/name": PROXY}
    kube.apply([{"apiVersion": "apps/v1", "kind": "Deployment",
                 "metadata": {"name": PROXY, "namespace": NS, "labels": {litellm.LABEL_CONSUMER: CM}},
                 "spec": {"replicas": 0, "selector": {"matchLabels": labels},
                          "template": {"metadata": {"labels": labels},
                                       "spec": {"containers": [{"name": "litellm", "image": "litellm:1"}]}}}}],
               namespace=NS)
    for service in ("a", "b", "c"):
        add_entry(k, service)
        litellm.restart_consumers(k, NS, CM)
    assert proxy_hash(k) == litellm.config_hash(k.get("v1", "ConfigMap", NS, CM))
    return k


def test_a_writer_holding_an_older_config_map_does_not_leave_its_hash_on_the_proxy(entries):
    k = entries
    stale = drop_entry(k, "c")  # the racing writer's view: c's entry gone, the index not yet rewritten
    litellm.sync_index(k, stale)
    litellm.restart_consumers(k, NS, CM)  # the removal, whole
    litellm.restart_consumers(k, NS, CM)  # the racing writer restarts last
    assert included(k) == ["embedops-a.yaml", "embedops-b.yaml"]
    assert proxy_hash(k) == litellm.config_hash(k.get("v1", "ConfigMap", NS, CM))


def test_a_change_landing_between_a_writers_read_and_its_restart_is_rolled_out_last(entries):
    k = entries
    drop_entry(k, "b")
    # this writer reads the ConfigMap (the entry gone, the index stale); the other completes the removal (the
    # index, then its restart) before this writer's Deployment write lands
    def other():
        litellm.sync_index(k, k.get("v1", "ConfigMap", NS, CM))
        litellm.restart_consumers(k, NS, CM)
    written = litellm.restart_consumers(WritesBetween(k, other), NS, CM)
    assert included(k) == ["embedops-a.yaml", "embedops-c.yaml"]
    assert proxy_hash(k) == litellm.config_hash(k.get("v1", "ConfigMap", NS, CM))
    assert written == [f"Deployment/{PROXY}"]
