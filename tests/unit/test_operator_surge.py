"""A GPU/MIG rollout surges while a spare accelerator exists and gives an old replica's accelerator up first as
soon as its surge pod cannot be scheduled (issue 36: a single GPU replica is not down for a model load when a
slice is free, and a full node never deadlocks a rollout). The real scheduler's side: tests/e2e/test_mig_capacity.py."""
from __future__ import annotations

import copy
import datetime as dt

from embedops_operator import render as R
from embedops_operator.reconcile import Reconciler
from embedops_operator.settings import OperatorSettings as Settings
from tests.unit.operator_helpers import MIG
from tests.unit.test_operator_reconcile import FakeKube

NO_SLICE = "0/3 nodes are available: 1 Insufficient nvidia.com/mig-1g.10gb, 2 node(s) didn't match selector."


def deployment(kube) -> dict:
    return kube.get("apps/v1", "Deployment", "ml", "svc")


def rolling(kube) -> dict:
    return deployment(kube)["spec"]["strategy"]["rollingUpdate"]


def rollout_with_a_pending_surge_pod(kube, message: str = NO_SLICE) -> None:
    """What the Deployment controller and the scheduler do after a template change with maxSurge 1: one more pod
    than desired, the new one pending."""
    dep = kube.objects[("apps/v1", "Deployment", "ml", "svc")]
    dep["status"] = {"observedGeneration": dep["metadata"]["generation"], "replicas": 2, "updatedReplicas": 1,
                     "readyReplicas": 1, "availableReplicas": 1, "unavailableReplicas": 1}
    labels = dep["spec"]["template"]["metadata"]["labels"]
    kube.objects[("v1", "Pod", "ml", "svc-new")] = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "svc-new", "namespace": "ml", "labels": labels},
        "status": {"phase": "Pending", "conditions": [{
            "type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message,
            "lastTransitionTime": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}]}}


def test_a_rollout_surges_then_gives_a_slice_up_when_none_is_free_and_the_next_one_surges_again():
    kube = FakeKube()
    kube.create_service(copy.deepcopy(MIG))
    rec = Reconciler(kube, Settings(resync_seconds=3600))
    rec.reconcile("ml", "svc")
    assert rolling(kube) == {"maxSurge": 1, "maxUnavailable": 0}
    assert R.ANNOTATION_SURGE_REFUSED not in deployment(kube)["metadata"]["annotations"]

    spec = copy.deepcopy(MIG)
    spec["batching"] = {"maxBatchTokens": 8192}  # a template change: a rollout
    kube.update_spec("svc", "ml", spec)
    rec.reconcile("ml", "svc")
    assert rolling(kube) == {"maxSurge": 1, "maxUnavailable": 0}  # tries a surge first

    rollout_with_a_pending_surge_pod(kube)
    rec.reconcile("ml", "svc", apply_children=False)  # the pod's event: status-only, but this must be written now
    assert rolling(kube) == {"maxSurge": 0, "maxUnavailable": 1}
    annotations = deployment(kube)["metadata"]["annotations"]
    assert annotations[R.ANNOTATION_SURGE_REFUSED] == annotations[R.ANNOTATION_TEMPLATE_HASH]

    # the pod scheduled once an old one stopped; the rollout ends; the choice holds for this template
    del kube.objects[("v1", "Pod", "ml", "svc-new")]
    dep = kube.objects[("apps/v1", "Deployment", "ml", "svc")]
    dep["status"].update({"replicas": 1, "updatedReplicas": 1, "unavailableReplicas": 0})
    rec.reconcile("ml", "svc")
    assert rolling(kube) == {"maxSurge": 0, "maxUnavailable": 1}

    spec["batching"] = {"maxBatchTokens": 4096}  # the next rollout tries a surge again
    kube.update_spec("svc", "ml", spec)
    rec.reconcile("ml", "svc")
    assert rolling(kube) == {"maxSurge": 1, "maxUnavailable": 0}
    annotations = deployment(kube)["metadata"]["annotations"]  # (server-side apply drops it; this fake merges)
    assert annotations.get(R.ANNOTATION_SURGE_REFUSED) != annotations[R.ANNOTATION_TEMPLATE_HASH]


def test_a_pod_waiting_for_a_slice_outside_a_rollout_changes_nothing():
    """A scale-up beyond the free slices is not a rollout: the strategy stays (Stalled reports the pod)."""
    kube = FakeKube()
    kube.create_service(copy.deepcopy(MIG))
    rec = Reconciler(kube, Settings(resync_seconds=3600))
    rec.reconcile("ml", "svc")
    rollout_with_a_pending_surge_pod(kube)
    kube.objects[("apps/v1", "Deployment", "ml", "svc")]["status"].update({"replicas": 1, "updatedReplicas": 1})
    rec.reconcile("ml", "svc", apply_children=False)
    assert rolling(kube) == {"maxSurge": 1, "maxUnavailable": 0}


def test_a_pending_pod_for_another_reason_and_an_explicit_rollout_are_left_alone():
    kube = FakeKube()
    kube.create_service(copy.deepcopy(MIG))
    rec = Reconciler(kube, Settings(resync_seconds=3600))
    rec.reconcile("ml", "svc")
    rollout_with_a_pending_surge_pod(kube, "0/3 nodes are available: 3 node(s) had untolerated taint.")
    rec.reconcile("ml", "svc", apply_children=False)
    assert rolling(kube) == {"maxSurge": 1, "maxUnavailable": 0}

    explicit = copy.deepcopy(MIG)
    explicit["rollout"] = {"maxSurge": 1, "maxUnavailable": 0}
    kube = FakeKube()
    kube.create_service(explicit)
    rec = Reconciler(kube, Settings(resync_seconds=3600))
    rec.reconcile("ml", "svc")
    rollout_with_a_pending_surge_pod(kube)
    rec.reconcile("ml", "svc")
    assert rolling(kube) == {"maxSurge": 1, "maxUnavailable": 0}  # what the manifest says, whatever happens

    empty = copy.deepcopy(MIG)
    empty["rollout"] = {}  # fixes nothing: still adaptive
    kube = FakeKube()
    kube.create_service(empty)
    rec = Reconciler(kube, Settings(resync_seconds=3600))
    rec.reconcile("ml", "svc")
    spec = copy.deepcopy(empty)
    spec["batching"] = {"maxBatchTokens": 8192}
    kube.update_spec("svc", "ml", spec)
    rec.reconcile("ml", "svc")
    rollout_with_a_pending_surge_pod(kube)
    rec.reconcile("ml", "svc", apply_children=False)
    assert rolling(kube) == {"maxSurge": 0, "maxUnavailable": 1}
