"""Reconcile loop against an in-memory API: no writes when nothing changed, drift corrected, pruning."""
from __future__ import annotations

import copy
import datetime as dt
import time

import pytest

from embedops_operator import apply as A
from embedops_operator import render as R
from embedops_operator.reconcile import Reconciler
from embedops_operator.settings import OperatorSettings as Settings
from embedops_operator.validate import defaulted
from tests.unit.operator_helpers import CPU, MIG, es


def _merge(base, patch):
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = _merge(base.get(k), v) if k in base else copy.deepcopy(v)
        return out
    return copy.deepcopy(patch)


def _normalize(obj):
    """What the API server would store: quantities canonicalised, a defaulted field added."""
    obj = copy.deepcopy(obj)
    if obj["kind"] == "Deployment":
        for c in obj["spec"]["template"]["spec"]["containers"]:
            for section in c.get("resources", {}).values():
                for k, v in section.items():
                    if isinstance(v, str) and v.endswith("000m"):
                        section[k] = v[:-4]
        obj["spec"]["template"]["spec"].setdefault("dnsPolicy", "ClusterFirst")
    if obj["kind"] == "Service":
        obj["spec"].setdefault("clusterIP", "10.0.0.7")
    return obj


class FakeKube:
    def __init__(self, capabilities=frozenset(R.OPTIONAL_KINDS)):
        self.objects: dict[tuple, dict] = {}
        self.rv = 0
        self.writes = 0
        self.caps = capabilities
        self.log: list[str] = []
        self.events: list[tuple] = []

    def key(self, api_version, kind, ns, name):
        return (api_version, kind, ns, name)

    def get(self, api_version, kind, ns, name):
        obj = self.objects.get(self.key(api_version, kind, ns, name))
        return copy.deepcopy(obj) if obj else None

    get_from_server = get_any = get

    def list(self, api_version, kind, ns, selector=None):
        want = dict(p.split("=") for p in selector.split(",")) if selector else {}
        out = []
        for (av, k, n, _), obj in sorted(self.objects.items()):
            labels = obj["metadata"].get("labels") or {}
            if av == api_version and k == kind and (ns is None or n == ns) and all(
                    labels.get(a) == b for a, b in want.items()):
                out.append(copy.deepcopy(obj))
        return out

    def _store(self, obj):
        m = obj["metadata"]
        self.rv += 1
        m["resourceVersion"] = str(self.rv)
        m.setdefault("uid", f"uid-{m['name']}-{obj['kind']}")
        key = self.key(obj["apiVersion"], obj["kind"], m["namespace"], m["name"])
        before = self.objects.get(key)
        if before is None or before.get("spec") != obj.get("spec"):  # as the API server: metadata is no generation
            m["generation"] = m.get("generation", 0) + 1
        self.objects[key] = obj

    def apply(self, obj, manager=R.MANAGER, dry_run=False, force=True):
        m = obj["metadata"]
        live = self.objects.get(self.key(obj["apiVersion"], obj["kind"], m["namespace"], m["name"]))
        merged = _normalize(_merge(live or {}, obj))
        if live is not None:
            merged["metadata"]["resourceVersion"] = live["metadata"]["resourceVersion"]
        if dry_run:
            return merged
        self.writes += 1
        self.log.append(f"apply {obj['kind']}/{m['name']} by {manager}")
        if live is None or A.comparable(merged) != A.comparable(live):
            self._store(merged)
        return merged

    def delete(self, api_version, kind, ns, name, uid=None):
        self.writes += 1
        self.log.append(f"delete {kind}/{name}")
        self.objects.pop(self.key(api_version, kind, ns, name), None)

    def patch_status(self, resource, status):
        self.writes += 1
        self.log.append("status")
        m = resource["metadata"]
        obj = self.objects[self.key("embedops.dev/v1alpha1", "EmbeddingService", m["namespace"], m["name"])]
        obj["status"] = copy.deepcopy(status)
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)

    def capabilities(self):
        return self.caps

    def forget_capabilities(self):
        pass

    def event(self, obj, kind, reason, message):
        self.log.append(f"event {reason}")
        self.events.append((obj["metadata"]["name"], kind, reason, message))

    def create_service(self, spec, name="svc", ns="ml"):
        obj = defaulted(es(spec, name=name, namespace=ns, generation=0))
        obj["metadata"].pop("generation")
        self._store(obj)
        return obj

    def update_spec(self, name, ns, spec):
        obj = self.objects[self.key("embedops.dev/v1alpha1", "EmbeddingService", ns, name)]
        obj["spec"] = defaulted(es(spec))["spec"]
        obj["metadata"]["generation"] += 1

    def rvs(self):
        return {k: o["metadata"]["resourceVersion"] for k, o in self.objects.items()}


@pytest.fixture
def kube():
    return FakeKube()


def kinds(kube):
    return sorted(k[1] for k in kube.objects if k[1] != "EmbeddingService")


def test_first_reconcile_creates_children_and_status_then_nothing(kube):
    spec = copy.deepcopy(CPU)
    spec["accelerator"]["cpu"]["cores"] = 2
    spec["resources"] = {"requests": {"cpu": "2000m"}}  # stored canonicalised as "2"
    kube.create_service(spec)
    rec = Reconciler(kube, Settings())
    status = rec.reconcile("ml", "svc")
    assert kinds(kube) == ["Deployment", "Service", "ServiceMonitor"]
    dep = kube.get("apps/v1", "Deployment", "ml", "svc")
    assert dep["metadata"]["ownerReferences"][0]["uid"] == "uid-svc-EmbeddingService"
    assert status["observedGeneration"] == 1
    before, writes = kube.rvs(), kube.writes
    for _ in range(3):
        assert rec.reconcile("ml", "svc") is None
    assert kube.writes == writes, kube.log[writes:]
    assert kube.rvs() == before


def test_drift_is_corrected_once(kube):
    kube.create_service(MIG)
    rec = Reconciler(kube, Settings())
    rec.reconcile("ml", "svc")
    key = ("apps/v1", "Deployment", "ml", "svc")
    kube.objects[key]["spec"]["replicas"] = 7  # someone edited the Deployment
    writes = kube.writes
    rec.reconcile("ml", "svc")
    assert kube.objects[key]["spec"]["replicas"] == 1
    assert kube.log[writes:] == ["apply Deployment/svc by embedops"]
    writes = kube.writes
    rec.reconcile("ml", "svc")
    assert kube.writes == writes


def test_spec_change_rolls_out_and_prunes(kube):
    spec = copy.deepcopy(MIG)
    spec["replicas"] = 3
    kube.create_service(spec)
    rec = Reconciler(kube, Settings())
    rec.reconcile("ml", "svc")
    assert "PodDisruptionBudget" in kinds(kube)
    spec["replicas"] = 1
    spec["monitoring"] = {"serviceMonitor": {"enabled": False}}
    kube.update_spec("svc", "ml", spec)
    status = rec.reconcile("ml", "svc")
    assert kinds(kube) == ["Deployment", "Service"]
    assert status["observedGeneration"] == 2


def test_autoscaler_switches_when_keda_appears(kube):
    kube.caps = frozenset({R.SERVICEMONITOR})
    spec = copy.deepcopy(MIG)
    spec["autoscaling"] = {"minReplicas": 1, "maxReplicas": 3}
    kube.create_service(spec)
    rec = Reconciler(kube, Settings())
    rec.reconcile("ml", "svc")
    assert "HorizontalPodAutoscaler" in kinds(kube)
    kube.caps = frozenset(R.OPTIONAL_KINDS)
    rec.reconcile("ml", "svc")
    assert "ScaledObject" in kinds(kube) and "HorizontalPodAutoscaler" not in kinds(kube)


def test_missing_crds_reported_then_picked_up(kube):
    kube.caps = frozenset()
    spec = copy.deepcopy(MIG)
    spec["gateway"] = {"parentRefs": [{"name": "gw"}]}
    kube.create_service(spec)
    rec = Reconciler(kube, Settings())
    status = rec.reconcile("ml", "svc")
    c = {x["type"]: x for x in status["conditions"]}
    assert (c["MonitoringReady"]["status"], c["MonitoringReady"]["reason"]) == ("False", "CRDNotInstalled")
    assert c["RoutesReady"]["status"] == "False"
    assert kinds(kube) == ["Deployment", "Service"]
    kube.caps = frozenset(R.OPTIONAL_KINDS)
    status = rec.reconcile("ml", "svc")
    assert kinds(kube) == ["Deployment", "HTTPRoute", "Service", "ServiceMonitor"]
    c = {x["type"]: x["status"] for x in status["conditions"]}
    # the route is written; no gateway controller runs here to accept it, and the status does not pretend one did
    assert c["MonitoringReady"] == "True" and c["RoutesReady"] == "Unknown"


def test_crd_removed_since_discovery_is_reported_missing_and_retried(kube):
    """Discovery still lists HTTPRoute (cached, or the API server's discovery lags the CRD's deletion) but its
    apply answers 404: RoutesReady says CRDNotInstalled, not Applied, and the service is left unfinished so
    the controller retries it instead of taking the reconcile as done."""
    from kubernetes.client.rest import ApiException

    spec = copy.deepcopy(MIG)
    spec["gateway"] = {"parentRefs": [{"name": "gw"}]}
    kube.create_service(spec)
    applying = kube.apply

    def apply_without_routes(obj, manager=R.MANAGER, dry_run=False, force=True):
        if obj["kind"] == "HTTPRoute":
            raise ApiException(status=404, reason="Not Found")
        return applying(obj, manager=manager, dry_run=dry_run, force=force)
    kube.apply = apply_without_routes
    rec = Reconciler(kube, Settings())
    status = rec.reconcile("ml", "svc")
    c = {x["type"]: x for x in status["conditions"]}
    assert (c["RoutesReady"]["status"], c["RoutesReady"]["reason"]) == ("False", "CRDNotInstalled")
    assert c["Ready"]["reason"] != "ApplyFailed"
    assert ("ml", "svc") in rec.unfinished
    kube.apply = applying
    status = rec.reconcile("ml", "svc")
    c = {x["type"]: x for x in status["conditions"]}["RoutesReady"]
    assert (c["status"], c["reason"]) == ("Unknown", "WaitingForGateway")
    assert ("ml", "svc") not in rec.unfinished


def test_shared_litellm_config_map_per_service_manager(kube):
    for name in ("a", "b"):
        spec = copy.deepcopy(MIG)
        spec["litellm"] = {"configMapName": "litellm", "modelName": f"model-{name}"}
        kube.create_service(spec, name=name)
        Reconciler(kube, Settings()).reconcile("ml", name)
    cm = kube.get("v1", "ConfigMap", "ml", "litellm")
    assert sorted(cm["data"]) == ["embedops-a.yaml", "embedops-b.yaml"]
    assert "apply ConfigMap/litellm by embedops-litellm-a" in kube.log
    assert "apply ConfigMap/litellm by embedops-litellm-b" in kube.log


def test_a_litellm_model_name_another_service_serves_is_a_conflict_not_a_load_balance(kube):
    """Issue 53: two services naming the same model in one LiteLLM ConfigMap were load-balanced by the proxy, maybe
    across two embedding spaces, and nothing said so. The first keeps the name; the second's entry is not written
    and its status says why."""
    for name in ("a", "b"):
        spec = copy.deepcopy(MIG)
        spec["litellm"] = {"configMapName": "litellm", "modelName": "embedder"}
        kube.create_service(spec, name=name)
        Reconciler(kube, Settings()).reconcile("ml", name)
    assert sorted(kube.get("v1", "ConfigMap", "ml", "litellm")["data"]) == ["embedops-a.yaml"]
    conds = {c["type"]: c for c in kube.get("embedops.dev/v1alpha1", "EmbeddingService", "ml", "b")["status"][
        "conditions"]}
    assert conds["LiteLLMReady"]["status"] == "False" and conds["LiteLLMReady"]["reason"] == "ModelNameConflict"
    assert "LiteLLM model name 'embedder' is served by EmbeddingService a" in conds["LiteLLMReady"]["message"]
    assert "LiteLLMReady" not in {c["type"] for c in kube.get("embedops.dev/v1alpha1", "EmbeddingService", "ml", "a")[
        "status"]["conditions"]}


def test_invalid_stored_object_is_stalled_without_children(kube):
    obj = kube.create_service(MIG)
    kube.objects[("embedops.dev/v1alpha1", "EmbeddingService", "ml", "svc")]["spec"]["accelerator"] = {}
    status = Reconciler(kube, Settings()).reconcile("ml", "svc")
    c = {x["type"]: x for x in status["conditions"]}
    assert c["Stalled"]["status"] == "True" and c["Stalled"]["reason"] == "InvalidSpec"
    assert "exactly one of mig, gpu or cpu" in c["Stalled"]["message"]
    assert kinds(kube) == []
    assert obj


def test_prune_only_touches_owned_children(kube):
    kube.create_service(MIG)
    rec = Reconciler(kube, Settings())
    rec.reconcile("ml", "svc")
    stranger = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
                "metadata": {"name": "other", "namespace": "ml",
                             "labels": {R.LABEL_MANAGED_BY: R.MANAGER, R.LABEL_SERVICE: "svc"},
                             "ownerReferences": [{"uid": "someone-else"}]}}
    kube._store(stranger)
    rec.reconcile("ml", "svc")
    assert ("policy/v1", "PodDisruptionBudget", "ml", "other") in kube.objects


def test_is_subset():
    assert A.is_subset({"a": {"b": [1, {"c": 2}]}}, {"a": {"b": [1, {"c": 2, "d": 3}], "e": 1}})
    assert not A.is_subset({"a": [1, 2]}, {"a": [1]})
    assert not A.is_subset({"a": {"b": 1}}, {"a": {"b": 2}})
    assert A.is_subset({"port": 80}, {"port": "80"})
    assert not A.is_subset({"x": 1}, {})


def test_deleted_service_removes_its_litellm_key(kube):
    spec = copy.deepcopy(MIG)
    spec["litellm"] = {"configMapName": "litellm"}
    body = kube.create_service(spec, name="a")
    rec = Reconciler(kube, Settings())
    rec.reconcile("ml", "a")
    applied = []
    kube.apply = lambda obj, manager=R.MANAGER, dry_run=False, force=True: applied.append((obj, manager))
    rec.forget("ml", "a", body)
    assert applied == [({"apiVersion": "v1", "kind": "ConfigMap",
                         "metadata": {"name": "litellm", "namespace": "ml"}}, "embedops-litellm-a")]


def test_stalled_is_written_when_the_grace_period_ends_without_another_event(kube):
    """No event marks the moment a pending pod has waited stallAfterSeconds: the reconciler sets a timer."""
    kube.create_service(copy.deepcopy(MIG))
    rec = Reconciler(kube, Settings(stall_after_seconds=3.0, resync_seconds=3600))
    rec.reconcile("ml", "svc")
    since = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    labels = kube.get("apps/v1", "Deployment", "ml", "svc")["spec"]["template"]["metadata"]["labels"]
    kube.objects[("v1", "Pod", "ml", "svc-1")] = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "svc-1", "namespace": "ml", "labels": labels},
        "status": {"conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                   "lastTransitionTime": since,
                                   "message": "0/3 nodes are available: 1 Insufficient nvidia.com/mig-1g.10gb"}]}}
    rec.reconcile("ml", "svc", apply_children=False)  # the pod event
    stalled = lambda: {c["type"]: c for c in kube.get(  # noqa: E731
        "embedops.dev/v1alpha1", "EmbeddingService", "ml", "svc")["status"]["conditions"]}["Stalled"]
    assert stalled()["status"] == "False"
    deadline = time.monotonic() + 10
    while stalled()["status"] == "False" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert stalled()["status"] == "True" and stalled()["reason"] == "InsufficientAccelerator"
    assert len(rec.rechecks) == 0  # fired and cleared; nothing left pending


def test_litellm_entry_owners_come_from_managed_fields():
    from embedops_operator import litellm as LL
    cm = {"metadata": {"managedFields": [
        {"manager": "embedops-litellm-a", "operation": "Apply", "fieldsType": "FieldsV1",
         "fieldsV1": {"f:data": {"f:embedops-a.yaml": {}}, "f:metadata": {"f:labels": {"f:embedops.dev/litellm": {}}}}},
        {"manager": "embedops-litellm-b", "operation": "Apply",  # its entry already removed: owns only a label
         "fieldsV1": {"f:metadata": {"f:labels": {"f:embedops.dev/litellm": {}}}}},
        {"manager": "kubectl", "operation": "Update", "fieldsV1": {"f:data": {"f:embedops-c.yaml": {}}}},
        {"manager": "embedops-litellm-d", "operation": "Update", "fieldsV1": {"f:data": {"f:embedops-d.yaml": {}}}},
    ]}, "data": {"embedops-a.yaml": "x", "embedops-c.yaml": "y", "embedops-d.yaml": "z"}}
    assert LL.entry_owners(cm) == {"a"}
    assert LL.wanted_config_map(None) is None
    assert LL.wanted_config_map({"metadata": {}, "spec": {"litellm": {"configMapName": "m"}}}) == "m"
    assert LL.wanted_config_map({"metadata": {"deletionTimestamp": "now"},
                                 "spec": {"litellm": {"configMapName": "m"}}}) is None


def test_no_list_permission_on_configmaps_does_not_fail_the_reconcile(kube):
    """An operator upgraded without the chart's new RBAC (list ConfigMaps for the stale-entry sweep) keeps
    serving: the sweep is skipped with a warning, the status is not ApplyFailed."""
    from kubernetes.client.rest import ApiException

    spec = copy.deepcopy(MIG)
    spec["litellm"] = {"configMapName": "litellm"}
    kube.create_service(spec, name="a")
    listing = kube.list

    def list_without_configmaps(api_version, kind, ns, selector=None):
        if kind == "ConfigMap":
            raise ApiException(status=403, reason="Forbidden")
        return listing(api_version, kind, ns, selector)
    kube.list = list_without_configmaps
    Reconciler(kube, Settings()).reconcile("ml", "a")
    status = kube.get("embedops.dev/v1alpha1", "EmbeddingService", "ml", "a")["status"]
    assert "litellm" in [k[3] for k in kube.objects if k[1] == "ConfigMap"]
    assert not [c for c in status["conditions"] if c.get("reason") == "ApplyFailed"], status["conditions"]


def _deployment(replicas: int, owners: list[str]) -> dict:
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "svc", "namespace": "ml", "managedFields": [
                {"manager": m, "operation": "Apply" if not m.startswith("kube-") else "Update",
                 "fieldsV1": {"f:spec": {"f:replicas": {}, "f:template": {}}}} for m in owners]},
            "spec": {"replicas": replicas}}


class RecordingKube:
    def __init__(self, conflict: bool = False):
        self.applied: list[tuple[dict, str, bool]] = []
        self.conflict = conflict

    def apply(self, obj, manager=R.MANAGER, dry_run=False, force=True):
        from kubernetes.client.rest import ApiException
        if self.conflict and not force:
            raise ApiException(status=409, reason="Conflict")
        self.applied.append((obj, manager, force))
        return obj


def test_replicas_are_handed_over_before_the_operator_lets_go_of_them():
    """Autoscaling turned on for a running Deployment whose replicas the operator owns: the live count is applied
    under a temporary manager (not forced) before the rendered Deployment, which no longer carries replicas,
    is applied; otherwise the API server defaults the field to 1 and kills running pods."""
    desired = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "svc", "namespace": "ml"},
               "spec": {"template": {}}}
    kube = RecordingKube()
    assert A.hand_over_replicas(kube, desired, _deployment(3, [R.MANAGER]))
    (patch, manager, force), = kube.applied
    assert patch["spec"] == {"replicas": 3} and manager == A.HANDOVER_MANAGER and force is False
    assert patch["metadata"] == {"name": "svc", "namespace": "ml"}


@pytest.mark.parametrize("desired_spec,live,conflict", [
    ({"replicas": 3, "template": {}}, _deployment(3, [R.MANAGER]), False),  # fixed replicas: the operator keeps them
    ({"template": {}}, None, False),  # created now: nothing to hand over
    ({"template": {}}, _deployment(4, ["kube-controller-manager"]), False),  # the autoscaler owns them already
    ({"template": {}}, _deployment(4, [A.HANDOVER_MANAGER]), False),  # handed over earlier
    ({"template": {}}, _deployment(4, [R.MANAGER, "kube-controller-manager"]), True),  # conflict: autoscaler wrote
])
def test_no_hand_over_when_none_is_needed(desired_spec, live, conflict):
    desired = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "svc", "namespace": "ml"},
               "spec": desired_spec}
    kube = RecordingKube(conflict=conflict)
    assert not A.hand_over_replicas(kube, desired, live)
    assert kube.applied == []


def test_an_hpa_takes_over_a_deployment_at_zero_only_after_it_is_raised_to_the_floor():
    """KEDA left the service at zero (minReplicas 0) and the service now scales by HPA: an HPA never scales a
    target at zero, so the operator raises it to the HPA's minimum under the hand-over manager, forced (KEDA
    wrote the zero); a Deployment above zero is left to the HPA."""
    desired = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "svc", "namespace": "ml"},
               "spec": {"template": {}}}
    kube = RecordingKube()
    assert A.hand_over_replicas(kube, desired, _deployment(0, ["keda"]), floor=2)
    (patch, manager, force), = kube.applied
    assert patch["spec"] == {"replicas": 2} and manager == A.HANDOVER_MANAGER and force is True
    kube = RecordingKube()
    assert not A.hand_over_replicas(kube, desired, _deployment(3, ["kube-controller-manager"]), floor=2)
    assert not A.hand_over_replicas(kube, desired, _deployment(0, ["keda"]), floor=None)  # KEDA wakes it itself
    assert kube.applied == []


def test_the_deployment_cache_keeps_only_the_replicas_owners():
    from embedops_operator.controller import TRANSFORMS

    live = _deployment(3, [R.MANAGER])
    live["metadata"]["managedFields"].append({"manager": "kubectl", "operation": "Update",
                                              "fieldsV1": {"f:metadata": {"f:labels": {}}}})
    view = TRANSFORMS["Deployment"](live)
    assert view["metadata"]["managedFields"] == [
        {"manager": R.MANAGER, "operation": "Apply", "fieldsV1": {"f:spec": {"f:replicas": {}}}}]
    assert A.owns_replicas(view, R.MANAGER) and not A.owns_replicas(view, "kubectl")


def test_a_service_named_index_keeps_its_litellm_entry_apart_from_the_index():
    """The index's field manager is no service's: a service named "index" (manager embedops-litellm-index)
    is an entry owner, the index's own manager is not."""
    from embedops_operator import litellm

    cm = {"metadata": {"managedFields": [
        {"manager": litellm.manager("index"), "operation": "Apply",
         "fieldsV1": {"f:data": {f"f:{R.litellm_key('index')}": {}}}},
        {"manager": litellm.INDEX_MANAGER, "operation": "Apply", "fieldsV1": {"f:data": {f"f:{litellm.INDEX_KEY}": {}}}},
    ]}, "data": {R.litellm_key("index"): "model_list: []\n", litellm.INDEX_KEY: "include: []\n"}}
    assert litellm.manager("index") != litellm.INDEX_MANAGER
    assert litellm.entry_owners(cm) == {"index"}


# ---------------------------------------------------------------------------------------------------- ownership

def _foreign(kind_key: tuple[str, str], name: str, ns: str = "ml", labels: dict | None = None,
             owner: dict | None = None) -> dict:
    obj = {"apiVersion": kind_key[0], "kind": kind_key[1],
           "metadata": {"name": name, "namespace": ns, "labels": dict(labels or {"app": "theirs"})},
           "spec": {"theirs": True}}
    if owner:
        obj["metadata"]["ownerReferences"] = [owner]
    return obj


def _conditions(status: dict) -> dict:
    return {c["type"]: c for c in status["conditions"]}


@pytest.mark.parametrize("kind_key", [("apps/v1", "Deployment"), ("v1", "Service"),
                                      ("policy/v1", "PodDisruptionBudget"), R.SERVICEMONITOR, R.HTTPROUTE,
                                      R.SCALEDOBJECT])
def test_an_object_the_operator_did_not_create_is_never_written(kube, kind_key):
    """A foreign object holding a child's name is left byte for byte as it was, the status says Stalled with
    the kind and name, the other children are still written, and the service is retried (no event would come
    when the user removes the object: the caches hold only the operator's)."""
    spec = copy.deepcopy(MIG)
    spec["replicas"] = 2  # a PDB
    spec["gateway"] = {"parentRefs": [{"name": "gw"}]}
    spec["autoscaling"] = {"minReplicas": 2, "maxReplicas": 3}
    kube.create_service(spec)
    theirs = _foreign(kind_key, "svc")
    kube._store(theirs)
    before = copy.deepcopy(kube.objects[(*kind_key, "ml", "svc")])
    rec = Reconciler(kube, Settings())
    status = rec.reconcile("ml", "svc")
    assert kube.objects[(*kind_key, "ml", "svc")] == before
    stalled = _conditions(status)["Stalled"]
    assert (stalled["status"], stalled["reason"]) == ("True", "OwnershipConflict")
    assert stalled["message"].startswith(f"{kind_key[1]} svc exists and was not created by this EmbeddingService")
    assert _conditions(status)["Ready"]["status"] == "False"
    assert ("ml", "svc") in rec.unfinished
    others = {"Deployment", "Service", "PodDisruptionBudget", "ServiceMonitor", "HTTPRoute", "ScaledObject"} - {
        kind_key[1]}
    assert others <= set(kinds(kube))
    # its removal by the user lets the next (retried) reconcile create the operator's own
    del kube.objects[(*kind_key, "ml", "svc")]
    status = rec.reconcile("ml", "svc")
    assert _conditions(status)["Stalled"]["status"] == "False"
    assert kube.objects[(*kind_key, "ml", "svc")]["metadata"]["ownerReferences"][0]["uid"] == \
        "uid-svc-EmbeddingService"
    assert ("ml", "svc") not in rec.unfinished


def test_an_object_controlled_by_another_owner_is_a_conflict_naming_it(kube):
    kube.create_service(copy.deepcopy(MIG))
    other = {"apiVersion": "embedops.dev/v1alpha1", "kind": "EmbeddingService", "name": "svc", "uid": "old-uid",
             "controller": True}
    kube._store(_foreign(("v1", "Service"), "svc", owner=other))
    status = Reconciler(kube, Settings()).reconcile("ml", "svc")
    msg = _conditions(status)["Stalled"]["message"]
    assert msg.startswith("Service svc is controlled by EmbeddingService svc (uid old-uid, a deleted one"), msg
    helm = {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web-1", "uid": "rs", "controller": True}
    kube.objects.pop(("v1", "Service", "ml", "svc"))
    kube._store(_foreign(("v1", "Service"), "svc", owner=helm))
    status = Reconciler(kube, Settings()).reconcile("ml", "svc")
    assert _conditions(status)["Stalled"]["message"].startswith(
        "Service svc is controlled by ReplicaSet web-1, not by this EmbeddingService")


def test_an_object_wearing_the_operators_labels_without_its_controller_is_neither_written_nor_pruned(kube):
    """Labels are anyone's to set: only the controller reference says who created an object."""
    kube.create_service(copy.deepcopy(MIG))  # one replica: no PDB is rendered
    rec = Reconciler(kube, Settings())
    rec.reconcile("ml", "svc")
    ours = {R.LABEL_MANAGED_BY: R.MANAGER, R.LABEL_SERVICE: "svc"}
    lookalike = _foreign(("policy/v1", "PodDisruptionBudget"), "svc", labels=ours)
    lookalike["metadata"]["ownerReferences"] = [{"uid": "uid-svc-EmbeddingService", "kind": "EmbeddingService",
                                                 "name": "svc"}]  # an owner, but not the controller
    kube._store(lookalike)
    before = copy.deepcopy(kube.objects[("policy/v1", "PodDisruptionBudget", "ml", "svc")])
    rec.reconcile("ml", "svc")
    assert kube.objects[("policy/v1", "PodDisruptionBudget", "ml", "svc")] == before
    # rendered again (two replicas): still not written, a conflict
    spec = copy.deepcopy(MIG)
    spec["replicas"] = 2
    kube.update_spec("svc", "ml", spec)
    status = rec.reconcile("ml", "svc")
    assert kube.objects[("policy/v1", "PodDisruptionBudget", "ml", "svc")] == before
    assert _conditions(status)["Stalled"]["reason"] == "OwnershipConflict"


def test_a_litellm_config_map_is_written_only_when_created_by_the_operator_or_labelled_to_opt_in(kube):
    spec = copy.deepcopy(MIG)
    spec["litellm"] = {"configMapName": "team-config"}
    kube.create_service(spec)
    user = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "team-config", "namespace": "ml"},
            "data": {"config.yaml": "general_settings: {}\n"}}
    kube._store(copy.deepcopy(user))
    before = copy.deepcopy(kube.objects[("v1", "ConfigMap", "ml", "team-config")])
    rec = Reconciler(kube, Settings())
    status = rec.reconcile("ml", "svc")
    assert kube.objects[("v1", "ConfigMap", "ml", "team-config")] == before
    msg = _conditions(status)["Stalled"]["message"]
    assert msg.startswith("ConfigMap team-config exists without the label embedops.dev/litellm=true"), msg
    kube.objects[("v1", "ConfigMap", "ml", "team-config")]["metadata"]["labels"] = {R.LABEL_LITELLM: "true"}
    status = rec.reconcile("ml", "svc")
    assert _conditions(status)["Stalled"]["status"] == "False"
    data = kube.objects[("v1", "ConfigMap", "ml", "team-config")]["data"]
    assert data["config.yaml"] == "general_settings: {}\n" and "embedops-svc.yaml" in data


def test_an_object_created_by_someone_else_between_the_read_and_the_create_is_not_taken_over(kube):
    """The create is a server-side apply that is not forced: an object someone created after the operator's read
    makes it conflict (409) instead of being taken over, and is then reported like any other."""
    from kubernetes.client.rest import ApiException

    kube.create_service(copy.deepcopy(MIG))
    applying = kube.apply

    def racing_apply(obj, manager=R.MANAGER, dry_run=False, force=True):
        if obj["kind"] == "Service" and not dry_run and ("v1", "Service", "ml", "svc") not in kube.objects:
            kube._store(_foreign(("v1", "Service"), "svc"))  # the user's kubectl, a moment earlier
            assert not force
            raise ApiException(status=409, reason="Conflict")
        return applying(obj, manager=manager, dry_run=dry_run, force=force)
    kube.apply = racing_apply
    status = Reconciler(kube, Settings()).reconcile("ml", "svc")
    assert kube.objects[("v1", "Service", "ml", "svc")]["spec"] == {"theirs": True}
    assert _conditions(status)["Stalled"]["reason"] == "OwnershipConflict"


# ---------------------------------------------------------------------------------------------------- upgrades

ES_KEY = ("embedops.dev/v1alpha1", "EmbeddingService", "ml")
DEPLOYMENT = ("apps/v1", "Deployment", "ml")


def _written_by_an_older_operator(kube, name="svc", image=None):
    """The service's Deployment as an operator of template revision 0 wrote it (no revision annotations)."""
    res = kube.get(*ES_KEY, name)
    dep = R.render(res, R.Options(), R.Pins(R.Pin(0, image), R.Pin(0, image)))[0]
    for key in (R.ANNOTATION_TEMPLATE_REVISION, R.ANNOTATION_TEMPLATE_HASH):
        dep["metadata"]["annotations"].pop(key)
    kube._store(_normalize(dep))
    return copy.deepcopy(dep["spec"]["template"])


def test_an_operator_upgrade_leaves_running_pod_templates_alone_until_the_spec_changes(kube, monkeypatch):
    spec = copy.deepcopy(CPU)
    spec["apiKeySecretRef"] = {"name": "key"}  # revision 1 drops it from the prepare step: a template change
    kube.create_service(spec)
    old = _written_by_an_older_operator(kube, image="registry/embedops-server:0.0.9-cpu")
    rec = Reconciler(kube, Settings())
    status = rec.reconcile("ml", "svc")
    dep = kube.objects[(*DEPLOYMENT, "svc")]
    assert _normalize({"kind": "Deployment", "spec": {"template": old}})["spec"]["template"] == dep["spec"]["template"]
    assert dep["metadata"]["annotations"][R.ANNOTATION_TEMPLATE_REVISION] == "0"
    assert status["podTemplates"] == [{
        "deployment": "server", "revision": 0, "image": "registry/embedops-server:0.0.9-cpu",
        "pending": f"template revision {R.TEMPLATE_REVISION} (runs 0) and image {R.Options().cpu_image} (runs "
                   "registry/embedops-server:0.0.9-cpu): kept until the spec changes the pod template (the "
                   "operator's pod upgrades are Keep)"}]
    # a scale is no template change: still kept
    spec["replicas"] = 3
    kube.update_spec("svc", "ml", spec)
    rec.reconcile("ml", "svc")
    assert kube.objects[(*DEPLOYMENT, "svc")]["spec"]["template"] == dep["spec"]["template"]
    assert kube.objects[(*DEPLOYMENT, "svc")]["spec"]["replicas"] == 3
    # a change of the template by the spec takes the latest revision and image with it
    spec["batching"] = {"maxBatchTokens": 4096}
    kube.update_spec("svc", "ml", spec)
    status = rec.reconcile("ml", "svc")
    dep = kube.objects[(*DEPLOYMENT, "svc")]
    assert dep["metadata"]["annotations"][R.ANNOTATION_TEMPLATE_REVISION] == str(R.TEMPLATE_REVISION)
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == R.Options().cpu_image
    assert "podTemplates" not in status


def test_a_new_server_image_in_the_operators_options_waits_for_the_spec(kube, monkeypatch):
    kube.create_service(copy.deepcopy(MIG))
    rec = Reconciler(kube, Settings())
    rec.reconcile("ml", "svc")
    before = copy.deepcopy(kube.objects[(*DEPLOYMENT, "svc")])
    monkeypatch.setenv("EMBEDOPS_SERVER_IMAGE_CUDA", "registry/embedops-server:0.2.0-cuda")
    rec = Reconciler(kube, Settings())  # the operator restarted with the new image in its settings
    status = rec.reconcile("ml", "svc")
    assert kube.objects[(*DEPLOYMENT, "svc")]["spec"] == before["spec"]
    assert status["podTemplates"][0]["pending"].startswith("image registry/embedops-server:0.2.0-cuda (runs ")


def test_pod_upgrades_roll_at_most_n_services_at_a_time_each_ready_before_the_next(kube, monkeypatch):
    for name in ("a", "b", "c"):
        kube.create_service(copy.deepcopy(MIG), name=name)
        _written_by_an_older_operator(kube, name)
    monkeypatch.setenv("EMBEDOPS_POD_UPGRADES", "Roll")
    monkeypatch.setenv("EMBEDOPS_MAX_CONCURRENT_UPGRADES", "1")
    rec = Reconciler(kube, Settings())
    queued = []
    rec.requeue = queued.append
    revision = lambda n: kube.objects[(*DEPLOYMENT, n)]["metadata"]["annotations"][  # noqa: E731
        R.ANNOTATION_TEMPLATE_REVISION]
    for name in ("a", "b", "c"):
        rec.reconcile("ml", name)
    assert [revision(n) for n in ("a", "b", "c")] == [str(R.TEMPLATE_REVISION), "0", "0"]
    status = kube.get(*ES_KEY, "b")["status"]
    assert "waiting for one of the 1 upgrade slots" in status["podTemplates"][0]["pending"]
    assert rec.upgrading.keys() == {("ml", "a")} and queued == []
    # a's new pods become ready: its slot frees, and the services waiting are queued
    dep = kube.objects[(*DEPLOYMENT, "a")]
    dep["status"] = {"observedGeneration": dep["metadata"]["generation"], "replicas": 1, "readyReplicas": 1,
                     "updatedReplicas": 1, "availableReplicas": 1}
    rec.reconcile("ml", "a")
    assert rec.upgrading == {} and queued == [("ml", "b"), ("ml", "c")]
    rec.reconcile("ml", "b")
    rec.reconcile("ml", "c")
    assert [revision(n) for n in ("b", "c")] == [str(R.TEMPLATE_REVISION), "0"]


def test_one_reconcile_parses_the_manifest_once_and_status_changes_nothing_it_is_given(kube, monkeypatch):
    """One typed intent per reconcile (intent.py): the manifest is parsed once, whatever the steps (spaces, pins,
    render, memory refusal, missing CRDs, status); status.compute leaves the observations it is given as they were."""
    from embedops_operator import spec as S
    from embedops_operator import status as ST

    kube.create_service(copy.deepcopy(CPU))
    rec = Reconciler(kube, Settings())
    rec.reconcile("ml", "svc")  # first: children created
    parses = []
    real = S.EmbeddingService.model_validate
    monkeypatch.setattr(S.EmbeddingService, "model_validate",
                        classmethod(lambda cls, obj, *a, **kw: parses.append(1) or real(obj, *a, **kw)))
    kube.update_spec("svc", "ml", dict(copy.deepcopy(CPU), replicas=2))
    assert rec.reconcile("ml", "svc") is not None
    assert len(parses) == 1
    observed = ST.Observed(invalid=None)
    bad = {"metadata": {"name": "x", "namespace": "ml", "generation": 1}, "spec": {"model": 5}}
    out = ST.compute(bad, observed)
    assert observed.invalid is None  # the verdict is in the status, not written into the caller's observations
    assert any(c["reason"] == "InvalidSpec" for c in out["conditions"])


def test_a_deleted_service_is_created_again_at_the_cluster_ip_it_had_or_a_new_one_if_refused(kube):
    """Issue 52: a Service deleted by mistake came back at a new ClusterIP, so clients that resolved its name before
    (a DNS cache, a pooled connection) failed until they resolved it again. The status keeps the address; the
    Service is created again asking for it; an address the API server refuses (taken meanwhile) gives way."""
    from kubernetes.client.rest import ApiException

    kube.create_service(copy.deepcopy(CPU))
    rec = Reconciler(kube, Settings())
    rec.reconcile("ml", "svc")
    key = ("v1", "Service", "ml", "svc")
    kube.objects[key]["spec"]["clusterIP"] = "10.96.0.77"  # what the API server allocated
    status = rec.reconcile("ml", "svc")
    assert status["clusterIP"] == "10.96.0.77"
    kube.objects[("embedops.dev/v1alpha1", "EmbeddingService", "ml", "svc")]["status"] = status
    del kube.objects[key]
    rec.reconcile("ml", "svc")
    assert kube.objects[key]["spec"]["clusterIP"] == "10.96.0.77"
    # taken meanwhile: created with a new one (the API server allocates it)
    del kube.objects[key]
    plain_apply = kube.apply

    def refusing(obj, **kw):
        if obj["kind"] == "Service" and obj["spec"].get("clusterIP"):
            raise ApiException(status=422, reason="spec.clusterIPs: Invalid value: provided IP is already allocated")
        return plain_apply(obj, **kw)
    kube.apply = refusing
    rec.reconcile("ml", "svc")
    assert kube.objects[key]["spec"]["clusterIP"] != "10.96.0.77"  # the (fake) API server's new allocation
