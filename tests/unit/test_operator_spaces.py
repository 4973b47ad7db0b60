"""A change of the embedding space never rolls in place (issue 36): the reconciler against the in-memory API of
test_operator_reconcile. The space's Deployments (tracks), the service's Service selector (what the address serves),
promotion, rollback, the previous space's grace period, events and status."""
from __future__ import annotations

import copy
import datetime as dt

import pytest

from embedops_operator import render as R
from embedops_operator import spaces as S
from embedops_operator.reconcile import Reconciler
from embedops_operator.settings import OperatorSettings as Settings
from tests.unit.operator_helpers import CPU
from tests.unit.test_operator_reconcile import FakeKube

ES = ("embedops.dev/v1alpha1", "EmbeddingService", "ml")
DEP = ("apps/v1", "Deployment", "ml")
SVC = ("v1", "Service", "ml")


@pytest.fixture
def kube():
    return FakeKube()


def ready(kube, name):
    """The Deployment controller and kubelet did their part: every replica of the current template available."""
    d = kube.objects[(*DEP, name)]
    n = d["spec"].get("replicas", 1)
    d["status"] = {"observedGeneration": d["metadata"]["generation"], "replicas": n, "readyReplicas": n,
                   "updatedReplicas": n, "availableReplicas": n}


def serving(kube, name="svc"):
    return kube.objects[(*SVC, name)]["spec"]["selector"][R.LABEL_INSTANCE]


def spaces(kube, name="svc"):
    return {x["role"]: x for x in kube.get(*ES, name)["status"].get("spaces", [])}


def condition(kube, ctype, name="svc"):
    return {c["type"]: c for c in kube.get(*ES, name)["status"]["conditions"]}[ctype]


def deployments(kube):
    return sorted(k[3] for k in kube.objects if k[:3] == DEP)


def change(kube, **model):
    spec = copy.deepcopy(kube.get(*ES, "svc")["spec"])
    spec["model"].update(model)
    kube.update_spec("svc", "ml", spec)


def start(kube, spec=None, replicas=3):
    spec = copy.deepcopy(spec or CPU)
    spec["replicas"] = replicas
    kube.create_service(spec)
    rec = Reconciler(kube, Settings())
    rec.reconcile("ml", "svc")
    ready(kube, "svc")
    rec.reconcile("ml", "svc")
    return rec


def test_a_space_change_comes_up_beside_and_the_address_keeps_the_old_space_until_promotion(kube):
    rec = start(kube)
    old_key = spaces(kube)["serving"]["key"]
    assert spaces(kube)["serving"]["since"] and condition(kube, "Promoted")["status"] == "True"
    change(kube, pooling="cls")
    rec.reconcile("ml", "svc")
    new_key = S.key_of(S.declaration(R.render(kube.get(*ES, "svc"))[0]))
    assert new_key != old_key and deployments(kube) == ["svc", f"svc-{new_key}"]
    assert serving(kube) == "svc"  # the address: still the old space
    old = kube.objects[(*DEP, "svc")]
    assert "--pooling" not in old["spec"]["template"]["spec"]["containers"][0]["args"]  # not rolled in place
    cand = kube.objects[(*DEP, f"svc-{new_key}")]
    assert cand["spec"]["replicas"] == 3 and cand["spec"]["selector"]["matchLabels"][R.LABEL_INSTANCE] == f"svc-{new_key}"
    # each space gets its own address during the migration
    assert kube.objects[(*SVC, f"svc-{old_key}")]["spec"]["selector"][R.LABEL_INSTANCE] == "svc"
    assert kube.objects[(*SVC, f"svc-{new_key}")]["spec"]["selector"][R.LABEL_INSTANCE] == f"svc-{new_key}"
    assert condition(kube, "Promoted")["reason"] == "Starting"
    assert condition(kube, "Reconciling")["reason"] == "StartingSpace" and condition(kube, "Ready")["status"] == "True"
    ready(kube, f"svc-{new_key}")
    rec.reconcile("ml", "svc")
    promoted = condition(kube, "Promoted")
    assert (promoted["status"], promoted["reason"]) == ("False", "AwaitingPromotion")
    assert f'spec.migration.promote: "{new_key}"' in promoted["message"]
    assert spaces(kube)["candidate"]["url"] == f"http://svc-{new_key}.ml.svc.cluster.local"
    assert serving(kube) == "svc" and kube.get(*ES, "svc")["status"]["replicasSummary"] == "3/3"
    # promotion: the address moves at once; the old space is kept for a rollback
    spec = kube.get(*ES, "svc")["spec"]
    spec["migration"]["promote"] = new_key
    kube.update_spec("svc", "ml", spec)
    rec.reconcile("ml", "svc")
    assert serving(kube) == f"svc-{new_key}"
    assert [e[2] for e in kube.events] == ["Promoted"]
    assert kube.objects[(*DEP, "svc")]["metadata"]["annotations"][S.ANNOTATION_RETIRED]
    rec.reconcile("ml", "svc")
    by_role = spaces(kube)
    assert by_role["serving"]["key"] == new_key and by_role["previous"]["key"] == old_key
    assert condition(kube, "Promoted")["status"] == "True"
    assert kube.get(*ES, "svc")["status"]["selector"].endswith(f"instance=svc-{new_key},app.kubernetes.io/name=embedops-server") \
        or f"app.kubernetes.io/instance=svc-{new_key}" in kube.get(*ES, "svc")["status"]["selector"]
    # rollback while the old space is kept
    spec["migration"]["promote"] = old_key
    kube.update_spec("svc", "ml", spec)
    rec.reconcile("ml", "svc")
    assert serving(kube) == "svc" and [e[2] for e in kube.events] == ["Promoted", "RolledBack"]
    # its retirement mark goes: the marks' manager applies an intent without it (the real API server removes it;
    # tests/e2e checks that)
    assert "apply Deployment/svc by embedops-spaces" in kube.log[-6:]
    assert deployments(kube) == ["svc", f"svc-{new_key}"]
    assert spaces(kube)["serving"]["key"] == old_key and spaces(kube)["candidate"]["key"] == new_key


def test_the_previous_space_goes_after_its_grace_period(kube):
    spec = copy.deepcopy(CPU)
    spec["migration"] = {"promotion": "Immediate", "keepPreviousSeconds": 60}
    rec = start(kube, spec, replicas=1)
    change(kube, pooling="cls")
    rec.reconcile("ml", "svc")
    new = next(n for n in deployments(kube) if n != "svc")
    ready(kube, new)
    rec.reconcile("ml", "svc")  # Immediate: promoted once ready
    assert serving(kube) == new and deployments(kube) == ["svc", new]
    old = kube.objects[(*DEP, "svc")]["metadata"]["annotations"]
    old[S.ANNOTATION_RETIRED] = (dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=61)).strftime(
        "%Y-%m-%dT%H:%M:%SZ")
    rec.reconcile("ml", "svc")
    assert deployments(kube) == [new]
    assert (*SVC, f"svc-{spaces(kube)['serving']['key']}") not in kube.objects  # one space: no own address
    assert "PreviousRemoved" in [e[2] for e in kube.events]


def test_a_candidate_the_spec_moved_away_from_is_removed_and_the_address_never_left_the_old_space(kube):
    rec = start(kube)
    change(kube, pooling="cls")
    rec.reconcile("ml", "svc")
    first = next(n for n in deployments(kube) if n != "svc")
    change(kube, pooling="mean")
    rec.reconcile("ml", "svc")
    second = next(n for n in deployments(kube) if n not in ("svc", first))
    assert deployments(kube) == sorted(["svc", second]) and serving(kube) == "svc"
    # back to the serving space's own declaration: the candidate goes, nothing else moves
    change(kube, pooling=None)
    rec.reconcile("ml", "svc")
    assert deployments(kube) == ["svc"] and serving(kube) == "svc"


def test_changes_that_keep_the_space_roll_in_place(kube):
    rec = start(kube)
    spec = kube.get(*ES, "svc")["spec"]
    spec["batching"]["maxBatchTokens"] = 4096
    spec["replicas"] = 2
    kube.update_spec("svc", "ml", spec)
    rec.reconcile("ml", "svc")
    assert deployments(kube) == ["svc"]
    assert "4096" in kube.objects[(*DEP, "svc")]["spec"]["template"]["spec"]["containers"][0]["args"]


def test_rerankers_store_nothing_and_roll_in_place(kube):
    spec = copy.deepcopy(CPU)
    spec["model"] = {"id": "BAAI/bge-reranker-base", "task": "rerank"}
    rec = start(kube, spec)
    change(kube, id="acme/reranker-2")
    rec.reconcile("ml", "svc")
    assert deployments(kube) == ["svc"] and "spaces" not in kube.get(*ES, "svc")["status"]
    assert "acme/reranker-2" in kube.objects[(*DEP, "svc")]["spec"]["template"]["spec"]["containers"][0]["args"]


def test_a_service_that_never_answered_takes_the_new_space_at_once(kube):
    """A typo in the model id fixed: the old space never served, so no index can hold its vectors."""
    spec = copy.deepcopy(CPU)
    spec["model"] = {"id": "acme/no-such-model"}
    kube.create_service(spec)
    rec = Reconciler(kube, Settings())
    rec.reconcile("ml", "svc")  # its pods never become ready
    change(kube, id="sentence-transformers/all-MiniLM-L6-v2")
    rec.reconcile("ml", "svc")
    new = next(n for n in deployments(kube) if n != "svc")
    ready(kube, new)
    rec.reconcile("ml", "svc")
    assert serving(kube) == new


def test_promote_naming_a_space_that_does_not_run_says_so(kube):
    rec = start(kube)
    spec = kube.get(*ES, "svc")["spec"]
    spec["model"]["pooling"] = "cls"
    spec["migration"]["promote"] = "deadbeef"
    kube.update_spec("svc", "ml", spec)
    rec.reconcile("ml", "svc")
    assert serving(kube) == "svc"
    assert "migration.promote names space deadbeef, which does not run" in condition(kube, "Promoted")["message"]


def test_a_legacy_deployment_is_read_as_its_own_space():
    """A Deployment written by any operator version declares its space through its server's flags and volume."""
    d = R.render({"apiVersion": "embedops.dev/v1alpha1", "kind": "EmbeddingService",
                  "metadata": {"name": "svc", "namespace": "ml"},
                  "spec": {"model": {"id": "BAAI/bge-m3", "pooling": "cls", "quantize": "int8", "maxInputLength": 512,
                                     "source": {"pvc": {"claimName": "models", "subPath": "m3"}}},
                           "accelerator": {"cpu": {}}}})[0]
    decl = S.declaration(d)
    assert decl == {"model-id": "BAAI/bge-m3", "pooling": "cls", "quantize": "int8", "max-input-length": "512",
                    "volume": "models:m3"}
    assert S.describe(decl) == "BAAI/bge-m3 (pooling cls, int8, 512 tokens, volume models:m3)"


def _pods_of(kube, track, space, n=1):
    """Ready pods of a track whose prepare steps reported `space` (what the kubelet and the server would show)."""
    import json as _json

    for i in range(n):
        kube.objects[("v1", "Pod", "ml", f"{track}-{i}")] = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"{track}-{i}", "namespace": "ml", "creationTimestamp": "2026-12-05T00:00:00Z",
                         "labels": {R.LABEL_SERVICE: "svc", R.LABEL_INSTANCE: track,
                                    R.LABEL_NAME: "embedops-server"}},
            "status": {"conditions": [{"type": "Ready", "status": "True"}], "initContainerStatuses": [
                {"name": "prepare", "state": {"terminated": {"message": "prepared " + _json.dumps({"space": space})}}}]}}


def test_after_reindex_the_jobs_success_promotes_and_its_failure_keeps_the_old_space(kube):
    spec = copy.deepcopy(CPU)
    spec["migration"] = {"promotion": "AfterReindex", "reindex": {"template": {"spec": {"containers": [
        {"name": "ingest", "image": "acme/ingest:1", "env": [{"name": "TABLE", "value": "docs"}]}]}}}}
    rec = start(kube, spec, replicas=1)
    _pods_of(kube, "svc", "aaaa000000000001")
    rec.reconcile("ml", "svc")
    old_key = spaces(kube)["serving"]["key"]
    change(kube, pooling="cls")
    rec.reconcile("ml", "svc")
    new = next(n for n in deployments(kube) if n != "svc")
    assert not [k for k in kube.objects if k[1] == "Job"]  # not before the new space is up
    ready(kube, new)
    _pods_of(kube, new, "bbbb000000000002")
    rec.reconcile("ml", "svc")  # the status learns the new space's fingerprint
    rec.reconcile("ml", "svc")
    jobs = [o for k, o in kube.objects.items() if k[1] == "Job"]
    assert len(jobs) == 1
    job = jobs[0]
    env = {e["name"]: e["value"] for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    new_key = new.rsplit("-", 1)[1]
    assert env == {"TABLE": "docs", "EMBEDOPS_SPACE": new_key, "EMBEDOPS_SPACE_FINGERPRINT": "bbbb000000000002",
                   "EMBEDOPS_SPACE_URL": f"http://svc-{new_key}.ml.svc.cluster.local",
                   "EMBEDOPS_PREVIOUS_SPACE": old_key,
                   "EMBEDOPS_PREVIOUS_SPACE_URL": f"http://svc-{old_key}.ml.svc.cluster.local"}
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never" and job["spec"]["backoffLimit"] == 2
    assert condition(kube, "Promoted")["reason"] == "Reindexing" and serving(kube) == "svc"
    assert spaces(kube)["candidate"]["reindex"] == f"Job {job['metadata']['name']}: running"
    # it fails: the old space keeps serving, the status says why
    job["status"] = {"conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
                                     "message": "Job has reached the specified backoff limit"}]}
    rec.reconcile("ml", "svc")
    promoted = condition(kube, "Promoted")
    assert promoted["reason"] == "ReindexFailed" and "BackoffLimitExceeded" in promoted["message"]
    assert serving(kube) == "svc" and condition(kube, "Ready")["status"] == "True"
    # a corrected Job (a new template) runs anew; its success promotes
    spec = kube.get(*ES, "svc")["spec"]
    spec["migration"]["reindex"]["template"]["spec"]["containers"][0]["image"] = "acme/ingest:2"
    kube.update_spec("svc", "ml", spec)
    rec.reconcile("ml", "svc")
    jobs = [o for k, o in kube.objects.items() if k[1] == "Job"]
    assert len(jobs) == 1 and jobs[0]["metadata"]["name"] != job["metadata"]["name"]
    jobs[0]["status"] = {"conditions": [{"type": "Complete", "status": "True"}]}
    rec.reconcile("ml", "svc")
    assert serving(kube) == new and "Promoted" in [e[2] for e in kube.events]


def test_litellm_names_each_space_during_a_migration(kube):
    import yaml

    spec = copy.deepcopy(CPU)
    spec["litellm"] = {"configMapName": "litellm", "modelName": "minilm"}
    rec = start(kube, spec, replicas=1)
    entries = lambda: yaml.safe_load(kube.objects[("v1", "ConfigMap", "ml", "litellm")]["data"]["embedops-svc.yaml"])[  # noqa: E731
        "model_list"]
    assert [e["model_name"] for e in entries()] == ["minilm"]
    old_key = spaces(kube)["serving"]["key"]
    change(kube, pooling="cls")
    rec.reconcile("ml", "svc")
    new_key = spaces(kube)["candidate"]["key"]
    got = {e["model_name"]: e["litellm_params"]["api_base"] for e in entries()}
    assert got == {"minilm": "http://svc.ml.svc.cluster.local/v1",
                   f"minilm@{old_key}": f"http://svc-{old_key}.ml.svc.cluster.local/v1",
                   f"minilm@{new_key}": f"http://svc-{new_key}.ml.svc.cluster.local/v1"}


# ------------------------------------------------------------- faults (issue 52): the record decides, not the Service
def _awaiting_promotion(kube):
    """A service of three replicas with a new space ready beside it, not promoted (Manual)."""
    rec = start(kube)
    change(kube, pooling="cls")
    rec.reconcile("ml", "svc")
    new = next(n for n in deployments(kube) if n != "svc")
    ready(kube, new)
    rec.reconcile("ml", "svc")
    assert condition(kube, "Promoted")["reason"] == "AwaitingPromotion" and serving(kube) == "svc"
    return rec, new


def _marks(kube, track):
    a = kube.objects[(*DEP, track)]["metadata"].get("annotations") or {}
    return {k: a[k] for k in (S.ANNOTATION_SERVING_EPOCH, S.ANNOTATION_RETIRED) if k in a}


def test_the_serving_track_is_recorded_on_its_deployment(kube):
    rec, new = _awaiting_promotion(kube)
    assert _marks(kube, "svc") == {S.ANNOTATION_SERVING_EPOCH: "1"} and _marks(kube, new) == {}
    assert kube.objects[(*DEP, "svc")]["metadata"]["annotations"][S.ANNOTATION_SERVING_SINCE]
    spec = kube.get(*ES, "svc")["spec"]
    spec["migration"]["promote"] = new.rsplit("-", 1)[1]
    kube.update_spec("svc", "ml", spec)
    before = len(kube.log)
    rec.reconcile("ml", "svc")
    assert _marks(kube, new) == {S.ANNOTATION_SERVING_EPOCH: "2"}
    assert _marks(kube, "svc")[S.ANNOTATION_SERVING_EPOCH] == "1" and S.ANNOTATION_RETIRED in _marks(kube, "svc")
    # the record is written before the Service's selector moves
    writes = [x for x in kube.log[before:] if x.startswith("apply")]
    assert writes.index(f"apply Deployment/{new} by embedops-spaces") < writes.index("apply Service/svc by embedops")


def test_a_deleted_service_comes_back_on_the_space_that_serves_and_nothing_that_served_is_removed(kube):
    """The fault of issue 52: the Service deleted while a candidate waits for its promotion. Before, the Service was
    recreated selecting the unpromoted candidate, and the Deployment that served was deleted as 'never served'."""
    rec, new = _awaiting_promotion(kube)
    del kube.objects[(*SVC, "svc")]
    rec.reconcile("ml", "svc")
    assert serving(kube) == "svc" and deployments(kube) == ["svc", new]
    assert [e[2] for e in kube.events] == ["AddressRepaired"]
    assert "was missing" in kube.events[-1][3] and kube.events[-1][1] == "Warning"
    assert condition(kube, "Promoted")["reason"] == "AwaitingPromotion"
    assert spaces(kube)["serving"]["deployment"] == "svc" and spaces(kube)["candidate"]["deployment"] == new


def test_a_service_edited_to_select_the_candidate_is_written_back(kube):
    rec, new = _awaiting_promotion(kube)
    kube.objects[(*SVC, "svc")]["spec"]["selector"][R.LABEL_INSTANCE] = new  # someone else's edit
    rec.reconcile("ml", "svc")
    assert serving(kube) == "svc" and deployments(kube) == ["svc", new]
    assert [e[2] for e in kube.events] == ["AddressRepaired"] and f"selected {new}" in kube.events[-1][3]
    assert _marks(kube, new) == {}  # never promoted by it


def test_a_crash_between_the_promotions_two_marks_converges_on_the_promoted_space(kube):
    """The operator died after recording the new serving track and before retiring the old one (and before the
    Service moved): the next reconcile serves the promoted track and keeps the old one as the previous space."""
    rec, new = _awaiting_promotion(kube)
    kube.objects[(*DEP, new)]["metadata"].setdefault("annotations", {}).update(
        {S.ANNOTATION_SERVING_EPOCH: "2", S.ANNOTATION_SERVING_SINCE: "2026-12-07T06:00:00Z"})
    spec = kube.get(*ES, "svc")["spec"]
    spec["migration"]["promote"] = new.rsplit("-", 1)[1]
    kube.update_spec("svc", "ml", spec)
    rec.reconcile("ml", "svc")
    assert serving(kube) == new and deployments(kube) == ["svc", new]
    assert S.ANNOTATION_RETIRED in _marks(kube, "svc") and spaces(kube)["previous"]["deployment"] == "svc"
    # the same crash, then the promotion taken back before the operator came back: the old space serves again
    kube2 = FakeKube()
    rec, new = _awaiting_promotion(kube2)
    kube2.objects[(*DEP, new)]["metadata"].setdefault("annotations", {}).update({S.ANNOTATION_SERVING_EPOCH: "2"})
    rec.reconcile("ml", "svc")  # promote still names nothing: the record says the new one serves
    assert serving(kube2) == new and S.ANNOTATION_RETIRED in _marks(kube2, "svc")


def test_tracks_of_an_older_operator_are_read_from_the_service_then_the_status_and_never_guessed_away(kube):
    rec, new = _awaiting_promotion(kube)
    for track in ("svc", new):  # as an operator before records left them
        for k in (S.ANNOTATION_SERVING_EPOCH, S.ANNOTATION_SERVING_SINCE):
            kube.objects[(*DEP, track)]["metadata"]["annotations"].pop(k, None)
    rec.reconcile("ml", "svc")  # the Service's selector: recorded now
    assert _marks(kube, "svc") == {S.ANNOTATION_SERVING_EPOCH: "1"} and kube.events == []
    kube.objects[(*DEP, "svc")]["metadata"]["annotations"].pop(S.ANNOTATION_SERVING_EPOCH)
    del kube.objects[(*SVC, "svc")]
    rec.reconcile("ml", "svc")  # no record, no Service: the status's serving space
    assert serving(kube) == "svc" and deployments(kube) == ["svc", new]
    # nothing at all says which serves: the oldest serves, the other is kept (retired, not removed), said so
    kube.objects[(*DEP, "svc")]["metadata"]["annotations"].pop(S.ANNOTATION_SERVING_EPOCH)
    kube.objects[(*DEP, "svc")]["metadata"]["creationTimestamp"] = "2026-12-01T00:00:00Z"
    kube.objects[(*DEP, new)]["metadata"]["creationTimestamp"] = "2026-12-02T00:00:00Z"
    del kube.objects[(*SVC, "svc")]
    kube.objects[(*ES, "svc")]["status"].pop("spaces")
    rec.reconcile("ml", "svc")
    assert serving(kube) == "svc" and deployments(kube) == ["svc", new]
    assert "ServingUnknown" in [e[2] for e in kube.events] and spaces(kube)["candidate"]["deployment"] == new


def test_an_autoscaled_service_promotes_a_space_of_the_size_that_serves_and_scales_the_previous_down_later(kube):
    """Issue 52: the candidate ran at minReplicas while the serving track ran at N under load, and the previous track
    idled at N for a day. Now the candidate runs as many replicas as serve (within maxReplicas); after the promotion
    the previous space keeps them for scaleDownPreviousAfterSeconds, then none; a rollback scales it back first."""
    spec = copy.deepcopy(CPU)
    spec["autoscaling"] = {"minReplicas": 1, "maxReplicas": 8}
    spec["migration"] = {"scaleDownPreviousAfterSeconds": 300}
    rec = start(kube, spec, replicas=1)
    kube.objects[(*DEP, "svc")]["spec"]["replicas"] = 5  # the autoscaler's doing, under load
    ready(kube, "svc")
    change(kube, pooling="cls")
    rec.reconcile("ml", "svc")
    new = next(n for n in deployments(kube) if n != "svc")
    assert kube.objects[(*DEP, new)]["spec"]["replicas"] == 5
    ready(kube, new)
    spec = kube.get(*ES, "svc")["spec"]
    spec["migration"]["promote"] = new_key = new.rsplit("-", 1)[1]
    kube.update_spec("svc", "ml", spec)
    rec.reconcile("ml", "svc")
    assert serving(kube) == new and kube.objects[(*DEP, "svc")]["spec"]["replicas"] == 5  # kept for a rollback
    # past the delay: the previous space runs no replica, and says so
    kube.objects[(*DEP, "svc")]["metadata"]["annotations"][S.ANNOTATION_RETIRED] = (
        dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=301)).strftime("%Y-%m-%dT%H:%M:%SZ")
    rec.reconcile("ml", "svc")
    assert kube.objects[(*DEP, "svc")]["spec"]["replicas"] == 0 and "PreviousScaled" in [e[2] for e in kube.events]
    assert "apply Deployment/svc by embedops-spaces-scale" in kube.log
    assert deployments(kube) == ["svc", new]
    # a rollback: scaled back to the serving size first; the address moves once those replicas are available
    old_key = spaces(kube)["previous"]["key"]
    spec["migration"]["promote"] = old_key
    kube.update_spec("svc", "ml", spec)
    rec.reconcile("ml", "svc")
    assert kube.objects[(*DEP, "svc")]["spec"]["replicas"] == 5 and serving(kube) == new
    waiting = condition(kube, "Reconciling")
    assert waiting["reason"] == "RollingBack" and f"space {old_key} is named by migration.promote: scaled back to 5 " \
        "replicas" in waiting["message"] and spaces(kube)["serving"]["key"] == new_key
    rec.reconcile("ml", "svc")  # scaled, not available yet: the usual message
    assert "is named by migration.promote but is not ready yet (0/5" in condition(kube, "Reconciling")["message"]
    ready(kube, "svc")
    rec.reconcile("ml", "svc")
    assert serving(kube) == "svc" and "RolledBack" in [e[2] for e in kube.events]


def test_a_track_pins_the_commit_its_first_replica_loaded_once(kube):
    """Issue 52 (one space, one set of weights): a hub model without a commit in model.revision. Once its first
    replica is ready and reported the commit it loaded, that commit goes into the ConfigMap every later pod of the
    track reads (owned by the track's Deployment) and into the Deployment's record; then nothing more is written."""
    import json as _json

    from embedops_operator.reconcile import ANNOTATION_MODEL_COMMIT

    spec = copy.deepcopy(CPU)
    spec["model"] = {"id": "BAAI/bge-small-en-v1.5", "source": {"download": {}}}
    rec = start(kube, spec, replicas=2)
    assert ("v1", "ConfigMap", "ml", "svc-model-commit") not in kube.objects  # no replica reported one yet
    first, later = "a" * 40, "b" * 40
    for i, (sha, created) in enumerate(((later, "2026-12-07T06:00:05Z"), (first, "2026-12-07T06:00:00Z"))):
        kube.objects[("v1", "Pod", "ml", f"svc-{i}")] = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"svc-{i}", "namespace": "ml", "creationTimestamp": created,
                         "labels": {R.LABEL_SERVICE: "svc", R.LABEL_INSTANCE: "svc", R.LABEL_NAME: "embedops-server"}},
            "status": {"conditions": [{"type": "Ready", "status": "True"}], "initContainerStatuses": [
                {"name": "prepare", "state": {"terminated": {"message": "prepared " + _json.dumps(
                    {"space": "s" + sha[:3], "commit": sha})}}}]}}
    rec.reconcile("ml", "svc")
    cm = kube.objects[("v1", "ConfigMap", "ml", "svc-model-commit")]
    assert cm["data"] == {"commit": first}  # the oldest replica's
    assert cm["metadata"]["ownerReferences"][0]["kind"] == "Deployment"
    assert kube.objects[(*DEP, "svc")]["metadata"]["annotations"][ANNOTATION_MODEL_COMMIT] == first
    assert spaces(kube)["serving"]["commit"] == first
    writes = kube.writes
    rec.reconcile("ml", "svc")
    assert kube.writes == writes  # recorded once

    # the ConfigMap deleted (a clean-up): nothing is read or written at rest, and once a pod of the track starts
    # (a scale-up, a restart) it is written back from the Deployment's record, with an Event
    del kube.objects[("v1", "ConfigMap", "ml", "svc-model-commit")]
    rec.reconcile("ml", "svc")
    assert ("v1", "ConfigMap", "ml", "svc-model-commit") not in kube.objects and kube.writes == writes
    kube.objects[("v1", "Pod", "ml", "svc-2")] = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "svc-2", "namespace": "ml", "creationTimestamp": "2026-12-07T07:00:00Z",
                     "labels": {R.LABEL_SERVICE: "svc", R.LABEL_INSTANCE: "svc", R.LABEL_NAME: "embedops-server"}},
        "status": {"conditions": [{"type": "Ready", "status": "False"}]}}
    rec.reconcile("ml", "svc")
    assert kube.objects[("v1", "ConfigMap", "ml", "svc-model-commit")]["data"] == {"commit": first}
    assert "ModelCommitRepaired" in [e[2] for e in kube.events]
    # edited to another commit: the same
    kube.objects[("v1", "ConfigMap", "ml", "svc-model-commit")]["data"] = {"commit": later}
    rec.reconcile("ml", "svc")
    assert kube.objects[("v1", "ConfigMap", "ml", "svc-model-commit")]["data"] == {"commit": first}
