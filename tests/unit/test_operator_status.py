"""Status: kstatus-compatible conditions computed purely from observed state."""
from __future__ import annotations

import copy
import datetime as dt

from embedops_operator import render as R
from embedops_operator import status as ST
from embedops_operator.validate import defaulted
from tests.unit.operator_helpers import CPU, MIG, es

NOW = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.timezone.utc)


def conds(status: dict) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def deployment(replicas=2, ready=2, updated=2, available=None, generation=1, observed=1, spec_replicas=None,
               conditions=()):
    return {"metadata": {"generation": generation},
            "spec": {"replicas": replicas if spec_replicas is None else spec_replicas},
            "status": {"replicas": replicas, "readyReplicas": ready, "updatedReplicas": updated,
                       "availableReplicas": ready if available is None else available,
                       "observedGeneration": observed, "conditions": list(conditions)}}


def pod(name="p-1", scheduled=None, waiting=None, init_waiting=None):
    st: dict = {"conditions": []}
    if scheduled:
        st["conditions"].append({"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                 "message": scheduled[0], "lastTransitionTime": scheduled[1]})
    if waiting:
        st["containerStatuses"] = [{"name": "server", "state": {"waiting": {"reason": waiting, "message": "boom"}}}]
    if init_waiting:
        st["initContainerStatuses"] = [{"name": "download-model", "state": {"waiting": {"reason": init_waiting}}}]
    return {"metadata": {"name": name}, "status": st}


def compute(spec=MIG, observed=None, generation=3, status=None, **kw):
    res = defaulted(es(spec, generation=generation, status=status))
    return ST.compute(res, observed or ST.Observed(), R.Options(), now=kw.pop("now", NOW), **kw)


def test_creating():
    s = compute()
    assert s["observedGeneration"] == 3
    assert conds(s) == {"Ready": ("False", "Creating"), "Reconciling": ("True", "Creating"),
                        "Stalled": ("False", "Creating"), "MonitoringReady": ("True", "Applied")}
    assert s["selector"] == "app.kubernetes.io/instance=svc,app.kubernetes.io/name=embedops-server"
    assert s["task"] == "embed" and s["accelerator"] == "mig-1g.10gb"
    assert s["replicasSummary"] == "0/1"
    assert s["url"] == "http://svc.ml.svc.cluster.local"
    assert s["endpoints"]["openai"] == "http://svc.ml.svc.cluster.local/v1"
    assert all(c["observedGeneration"] == 3 for c in s["conditions"])


def test_ready_when_rolled_out():
    spec = copy.deepcopy(MIG)
    spec["replicas"] = 2
    s = compute(spec, ST.Observed(deployment=deployment()))
    assert conds(s)["Ready"] == ("True", "Available")
    assert conds(s)["Reconciling"] == ("False", "Available")
    assert conds(s)["Stalled"] == ("False", "Available")
    assert (s["replicas"], s["readyReplicas"], s["updatedReplicas"]) == (2, 2, 2)
    assert s["replicasSummary"] == "2/2"


def test_rolling_out_and_waiting():
    spec = copy.deepcopy(MIG)
    spec["replicas"] = 2
    s = compute(spec, ST.Observed(deployment=deployment(replicas=3, ready=2, updated=1)))
    assert conds(s)["Reconciling"] == ("True", "RollingOut")
    s = compute(spec, ST.Observed(deployment=deployment(ready=1)))
    assert conds(s)["Ready"] == ("False", "WaitingForReplicas")
    # Deployment controller has not seen the new template yet
    s = compute(spec, ST.Observed(deployment=deployment(generation=2, observed=1)))
    assert conds(s)["Ready"][0] == "False"


def test_scaled_to_zero_is_ready():
    spec = copy.deepcopy(CPU)
    spec["replicas"] = 0
    s = compute(spec, ST.Observed(deployment=deployment(replicas=0, ready=0, updated=0)))
    assert conds(s)["Ready"] == ("True", "ScaledToZero")


def test_scaled_to_zero_behind_the_activator_is_ready_only_once_the_activator_is():
    spec = copy.deepcopy(CPU)
    spec.pop("replicas", None)
    spec["autoscaling"] = {"minReplicas": 0, "maxReplicas": 2}
    at_zero = deployment(replicas=0, ready=0, updated=0)
    for activator in (None, deployment(replicas=1, ready=0, updated=1)):  # not created yet / not available
        s = compute(spec, ST.Observed(deployment=at_zero, activator=activator))
        assert conds(s)["Ready"] == ("False", "WaitingForActivator")
        assert conds(s)["Reconciling"] == ("True", "WaitingForActivator")
    s = compute(spec, ST.Observed(deployment=at_zero, activator=deployment(replicas=1, ready=1, updated=1)))
    assert conds(s)["Ready"] == ("True", "ScaledToZero") and s["replicasSummary"] == "0/0"
    assert s["url"] == "http://svc.ml.svc.cluster.local"  # the same address, answered by the activator


def test_autoscaled_desired_comes_from_the_deployment():
    spec = copy.deepcopy(MIG)
    spec["autoscaling"] = {"minReplicas": 1, "maxReplicas": 4}
    s = compute(spec, ST.Observed(deployment=deployment(replicas=3, ready=3, updated=3)))
    assert s["replicasSummary"] == "3/3" and conds(s)["Ready"][0] == "True"
    assert conds(s)["AutoscalingReady"] == ("True", "KEDA")


def test_no_free_mig_slice_stalls_after_grace():
    msg = "0/3 nodes are available: 1 Insufficient nvidia.com/mig-1g.10gb, 2 node(s) didn't match"
    since = (NOW - dt.timedelta(seconds=90)).strftime("%Y-%m-%dT%H:%M:%SZ")
    obs = ST.Observed(deployment=deployment(replicas=1, ready=0, updated=1), pods=[pod(scheduled=(msg, since))])
    s = compute(MIG, obs, stall_after=60)
    assert conds(s)["Stalled"] == ("True", "InsufficientAccelerator")
    assert conds(s)["Ready"] == ("False", "InsufficientAccelerator")
    assert conds(s)["Reconciling"][0] == "False"
    assert "Insufficient nvidia.com/mig-1g.10gb" in next(c for c in s["conditions"] if c["type"] == "Stalled")[
        "message"]
    # within the grace period: still in progress
    s = compute(MIG, obs, stall_after=120)
    assert conds(s)["Stalled"][0] == "False" and conds(s)["Reconciling"][0] == "True"
    # other resources → Unschedulable
    obs.pods = [pod(scheduled=("0/3 nodes are available: Insufficient cpu", since))]
    assert conds(compute(MIG, obs, stall_after=60))["Stalled"] == ("True", "Unschedulable")


def test_stall_check_in_says_when_the_grace_period_ends():
    def at(seconds_ago):
        return (NOW - dt.timedelta(seconds=seconds_ago)).strftime("%Y-%m-%dT%H:%M:%SZ")
    msg = "0/3 nodes are available: 1 Insufficient nvidia.com/mig-1g.10gb"
    assert ST.stall_check_in([], NOW, 60) is None
    assert ST.stall_check_in([pod(waiting="CrashLoopBackOff")], NOW, 60) is None
    assert ST.stall_check_in([pod(scheduled=(msg, at(20)))], NOW, 60) == 40
    assert ST.stall_check_in([pod("a", scheduled=(msg, at(20))), pod("b", scheduled=(msg, at(50)))], NOW, 60) == 10
    assert ST.stall_check_in([pod(scheduled=(msg, at(90)))], NOW, 60) is None  # already Stalled
    gone = pod(scheduled=(msg, at(20)))
    gone["metadata"]["deletionTimestamp"] = at(1)
    assert ST.stall_check_in([gone], NOW, 60) is None


def test_rollout_blocked_by_accelerator():
    since = (NOW - dt.timedelta(seconds=900)).strftime("%Y-%m-%dT%H:%M:%SZ")
    dep = deployment(replicas=1, ready=0, updated=1, conditions=[
        {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded", "message": "timed out"}])
    obs = ST.Observed(deployment=dep, pods=[pod(scheduled=("Insufficient nvidia.com/mig-1g.10gb", since))])
    assert conds(compute(MIG, obs))["Stalled"] == ("True", "RolloutBlockedInsufficientAccelerator")
    obs.pods = []
    assert conds(compute(MIG, obs))["Stalled"] == ("True", "ProgressDeadlineExceeded")


def test_crash_loop_image_pull_and_config_errors():
    dep = deployment(replicas=1, ready=0, updated=1)
    for waiting, reason in [("CrashLoopBackOff", "CrashLoop"), ("ImagePullBackOff", "ImagePullFailure"),
                            ("ErrImagePull", "ImagePullFailure"), ("CreateContainerConfigError", "ConfigError")]:
        s = compute(MIG, ST.Observed(deployment=dep, pods=[pod(waiting=waiting)]))
        assert conds(s)["Stalled"] == ("True", reason), waiting
    s = compute(MIG, ST.Observed(deployment=dep, pods=[pod(init_waiting="ImagePullBackOff")]))
    assert conds(s)["Stalled"] == ("True", "ImagePullFailure")
    # ContainerCreating is normal progress
    s = compute(MIG, ST.Observed(deployment=dep, pods=[pod(waiting="ContainerCreating")]))
    assert conds(s)["Stalled"][0] == "False"


def test_invalid_spec_and_apply_errors():
    s = compute(MIG, ST.Observed(invalid="gateway parentRef namespace not allowed"))
    assert conds(s)["Stalled"] == ("True", "InvalidSpec")
    s = compute(MIG, ST.Observed(apply_error="etcd timeout"))
    assert conds(s)["Reconciling"] == ("True", "ApplyFailed") and conds(s)["Stalled"][0] == "False"
    broken = es({"model": {"id": "x"}, "accelerator": {}})
    s = ST.compute(broken, ST.Observed(), now=NOW)
    assert conds(s)["Stalled"] == ("True", "InvalidSpec")


def test_missing_optional_crds_are_conditions():
    spec = copy.deepcopy(MIG)
    spec["gateway"] = {"parentRefs": [{"name": "gw"}]}
    obs = ST.Observed(deployment=deployment(replicas=1, ready=1, updated=1),
                      missing={"monitoring": "ServiceMonitor", "routes": "HTTPRoute"})
    s = compute(spec, obs)
    assert conds(s)["MonitoringReady"] == ("False", "CRDNotInstalled")
    assert conds(s)["RoutesReady"] == ("False", "CRDNotInstalled")
    assert conds(s)["Ready"][0] == "True"  # the service itself serves


def _route(*parents):
    """An HTTPRoute as a gateway leaves it: one status.parents entry per (gateway name, Accepted, ResolvedRefs)."""
    return {"status": {"parents": [
        {"parentRef": {"name": name, "namespace": "gateway"}, "controllerName": "traefik.io/gateway-controller",
         "conditions": [{"type": "Accepted", "status": accepted, "reason": "NotAllowedByListeners" if accepted ==
                         "False" else "Accepted", "message": "no listener admits this route's namespace"},
                        {"type": "ResolvedRefs", "status": resolved, "reason": "BackendNotFound" if resolved ==
                         "False" else "ResolvedRefs", "message": "service ml/svc not found"}]}
        for name, accepted, resolved in parents]}}


def test_routes_ready_says_what_the_gateways_wrote_on_the_route():
    spec = copy.deepcopy(MIG)
    spec["gateway"] = {"parentRefs": [{"name": "edge", "namespace": "gateway"}, {"name": "internal",
                                                                                 "namespace": "gateway"}]}
    dep = deployment(replicas=1, ready=1, updated=1)

    def routes(route):
        s = compute(spec, ST.Observed(deployment=dep, route=route))
        c = {x["type"]: x for x in s["conditions"]}["RoutesReady"]
        assert conds(s)["Ready"][0] == "True"  # the Service serves whatever a gateway thinks of the route
        return c["status"], c["reason"], c["message"]

    assert routes(None)[:2] == ("Unknown", "WaitingForGateway")
    # no controller runs for the GatewayClass: nothing is ever written, so the status must not claim success
    st, reason, msg = routes({"status": {}})
    assert (st, reason) == ("Unknown", "WaitingForGateway") and "gateway/edge, gateway/internal" in msg
    st, reason, msg = routes(_route(("edge", "True", "True")))
    assert (st, reason) == ("Unknown", "WaitingForGateway") and "gateway/internal" in msg and "edge" not in msg
    st, reason, msg = routes(_route(("edge", "True", "True"), ("internal", "True", "True")))
    assert (st, reason) == ("True", "Accepted") and "traefik.io/gateway-controller" in msg
    st, reason, msg = routes(_route(("edge", "True", "True"), ("internal", "False", "True")))
    assert (st, reason) == ("False", "NotAccepted")
    assert "gateway/internal" in msg and "NotAllowedByListeners" in msg and "no listener admits" in msg
    st, reason, msg = routes(_route(("edge", "True", "False"), ("internal", "True", "True")))
    assert (st, reason) == ("False", "RefsNotResolved") and "BackendNotFound" in msg
    # a report on another Gateway (same name, other namespace) is not this route's parent
    other = _route(("edge", "True", "True"), ("internal", "True", "True"))
    other["status"]["parents"][1]["parentRef"]["namespace"] = "elsewhere"
    assert routes(other)[:2] == ("Unknown", "WaitingForGateway")


def test_recompute_is_stable_and_keeps_transition_times():
    spec = copy.deepcopy(MIG)
    obs = ST.Observed(deployment=deployment(replicas=1, ready=1, updated=1))
    first = compute(spec, obs)
    later = NOW + dt.timedelta(minutes=5)
    second = compute(spec, obs, status=first, now=later)
    assert ST.normalized(first) == ST.normalized(second)
    # a flip gets a new transition time, unchanged conditions keep theirs
    third = compute(spec, ST.Observed(deployment=deployment(replicas=1, ready=0, updated=1)), status=first, now=later)
    t = {c["type"]: c["lastTransitionTime"] for c in third["conditions"]}
    assert t["Ready"] == "2026-01-01T12:05:00Z" and t["Stalled"] == "2026-01-01T12:00:00Z"


def kstatus_binary():
    import os
    from pathlib import Path
    cache = Path(os.environ.get("EMBEDOPS_CACHE", Path.home() / ".cache" / "embedops")) / "bin"
    found = [p for p in sorted(cache.glob("kstatus-*/kstatus")) if os.access(p, os.X_OK)]
    return str(found[-1]) if found else None


def test_kstatus_reads_our_status_like_flux_does():
    """The real kstatus library (cli-utils, what Flux health checks use) on computed statuses."""
    import json
    import subprocess

    import pytest
    binary = kstatus_binary()
    if not binary:
        pytest.skip("kstatus not built (python -m localcluster.build kstatus)")
    since = (NOW - dt.timedelta(seconds=90)).strftime("%Y-%m-%dT%H:%M:%SZ")
    cases = {
        "ready": (ST.Observed(deployment=deployment(replicas=1, ready=1, updated=1)), 3, "Current"),
        "creating": (ST.Observed(), 3, "InProgress"),
        "stalled": (ST.Observed(deployment=deployment(replicas=1, ready=0, updated=1),
                                pods=[pod(scheduled=("Insufficient nvidia.com/mig-1g.10gb", since))]), 3, "Failed"),
        "stale": (ST.Observed(deployment=deployment(replicas=1, ready=1, updated=1)), 4, "InProgress"),
    }
    objs = []
    for name, (obs, generation, _) in cases.items():
        res = defaulted(es(MIG, name=name, generation=3))
        res["status"] = ST.normalized(ST.compute(res, obs, now=NOW, stall_after=60))
        res["metadata"]["generation"] = generation  # "stale": the spec changed after the status was written
        objs.append(res)
    out = subprocess.run([binary], input=json.dumps(objs), capture_output=True, text=True, check=True)
    got = {json.loads(line)["name"]: json.loads(line)["status"] for line in out.stdout.splitlines()}
    assert got == {name: want for name, (_, _, want) in cases.items()}


def test_a_rollout_that_takes_a_replica_away_says_so():
    dep = {"metadata": {"generation": 2}, "spec": {"replicas": 1, "strategy": {"rollingUpdate": {
        "maxSurge": 0, "maxUnavailable": 1}}}, "status": {"observedGeneration": 2, "replicas": 1, "updatedReplicas": 0,
                                                           "readyReplicas": 1, "availableReplicas": 1}}
    st = compute(MIG, ST.Observed(deployment=dep))
    msg = {c["type"]: c for c in st["conditions"]}["Reconciling"]["message"]
    assert msg.startswith("0/1 replicas updated; maxSurge 0: each old replica stops before its replacement loads")


def test_a_new_space_that_cannot_get_all_its_replicas_is_stalled_while_the_old_one_serves():
    """Issue 52: the candidate got 2 of its 3 replicas (one Pending: Insufficient memory); the status said
    Promoted=False Starting and Stalled=False for minutes, and Flux would wait forever."""
    spec = copy.deepcopy(CPU)
    spec["replicas"] = 3
    msg = "0/4 nodes are available: 1 Insufficient memory, 3 node(s) didn't match Pod's node affinity"
    spaces = [{"key": "aaaa1111", "deployment": "svc", "ready": "3/3", "serving": True, "role": "serving"},
              {"key": "bbbb2222", "deployment": "svc-bbbb2222", "ready": "2/3", "serving": False, "role": "candidate"}]

    def observed(waited):
        since = (NOW - dt.timedelta(seconds=waited)).strftime("%Y-%m-%dT%H:%M:%SZ")
        return ST.Observed(deployment=deployment(replicas=3, ready=3, updated=3), spaces=spaces,
                           space_waiting="the new space bbbb2222 is starting (2/3 replicas available)",
                           candidate_pods=[pod("svc-bbbb2222-x", scheduled=(msg, since))])
    s = compute(spec, observed(30), stall_after=60)
    assert conds(s)["Stalled"][0] == "False" and conds(s)["Promoted"] == ("False", "Starting")
    s = compute(spec, observed(61), stall_after=60)
    assert conds(s)["Stalled"] == ("True", "Unschedulable") and conds(s)["Ready"] == ("True", "Available")
    assert conds(s)["Promoted"] == ("False", "Unschedulable") and conds(s)["Reconciling"][0] == "False"
    said = next(c for c in s["conditions"] if c["type"] == "Promoted")["message"]
    assert "the new space bbbb2222 cannot start (2/3 replicas available)" in said and "Insufficient memory" in said
    assert "space aaaa1111 keeps serving" in said
    assert ST.stall_check_in(observed(30).candidate_pods, NOW, 60) == 30


def test_replicas_of_one_template_serving_two_spaces_are_a_failure_not_a_comma():
    """Issue 52: an unpinned model.revision, an upstream commit between two replicas' starts: the address answers
    from two spaces and the status only listed the fingerprints comma-separated."""
    import json

    def prepared(name, space, commit):
        p = pod(name)
        p["status"]["conditions"].append({"type": "Ready", "status": "True"})
        p["status"]["initContainerStatuses"] = [{"name": "prepare", "state": {"terminated": {
            "message": "prepared " + json.dumps({"space": space, "commit": commit})}}}]
        return p
    spec = copy.deepcopy(CPU)
    spec["replicas"] = 3
    pods = [prepared("a", "1111", "a" * 40), prepared("b", "1111", "a" * 40), prepared("c", "2222", "b" * 40)]
    s = compute(spec, ST.Observed(deployment=deployment(replicas=3, ready=3, updated=3), pods=pods))
    assert conds(s)["Stalled"] == ("True", "MixedSpaces") and conds(s)["Ready"][0] == "True"
    msg = next(c for c in s["conditions"] if c["type"] == "Stalled")["message"]
    assert "serve 2 embedding spaces (space 1111: a (commit aaaaaaaaaaaa), b (commit aaaaaaaaaaaa); space 2222: c " \
           "(commit bbbbbbbbbbbb))" in msg and "set model.revision" in msg
    # while a rollout replaces pods, two reports are the rollout's, not a mix
    s = compute(spec, ST.Observed(deployment=deployment(replicas=4, ready=3, updated=2), pods=pods))
    assert conds(s)["Stalled"][0] == "False"
    # one space: nothing to say
    s = compute(spec, ST.Observed(deployment=deployment(replicas=3, ready=3, updated=3), pods=pods[:2]))
    assert conds(s)["Stalled"] == ("False", "Available")
