"""Pure status computation: (resource, observed children, pods) → kstatus-compatible status.

kstatus reads `observedGeneration`, `Reconciling=True` (in progress), `Stalled=True` (failed) and
`Ready=True` (current). `lastTransitionTime` is kept from the previous status unless the condition's
status flips, so recomputing an unchanged situation yields an identical status (and no write).
"""
from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from embedops_server import sizing

from . import render
from .memory import cpu_memory
from .spec import EmbeddingService, EmbeddingServiceSpec, parse as parse_resource

IMAGE_PULL = {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"}
CONFIG_ERRORS = {"CreateContainerConfigError", "CreateContainerError"}
# after the list of children in conflict (apply.Conflict): what to do about them
CONFLICT_ADVICE = ("the operator never takes over or deletes an object it did not create: delete or rename it, or "
                   "give the EmbeddingService another name")
FEATURE_CONDITIONS = {"monitoring": "MonitoringReady", "routes": "RoutesReady", "autoscaling": "AutoscalingReady",
                      "litellm": "LiteLLMReady"}


@dataclass
class Observed:
    deployment: dict | None = None
    pods: list[dict] = field(default_factory=list)
    missing: dict[str, str] = field(default_factory=dict)  # feature → missing CRD kind
    invalid: str | None = None  # a spec problem found outside the schema
    apply_error: str | None = None
    refused: tuple[str, str] | None = None  # (reason, message): the spec cannot fit its memory (memory.refusal)
    route: dict | None = None  # the live HTTPRoute (its status.parents is what the gateways say of it)
    # minReplicas 0 (render.scales_to_zero): the activator's Deployment, which answers the service's address
    activator: dict | None = None
    # children not written because an object the operator did not create holds their name (apply.Conflict)
    conflicts: list[str] = field(default_factory=list)
    # Deployment ("server", "activator") -> (the pin it keeps, what it leaves out): upgrades.choose kept an older
    # template revision or image for it
    pod_templates: dict[str, tuple[Any, str]] = field(default_factory=dict)
    # the embedding spaces that run (spaces.plan, as status.spaces entries) and why the spec's does not serve yet
    spaces: list[dict] = field(default_factory=list)
    space_waiting: str | None = None
    candidate_pods: list[dict] = field(default_factory=list)  # the pods of the spec's space while it is not promoted
    # model names this service's LiteLLM entry would share with another service's (litellm.model_name_clashes)
    litellm_conflicts: list[str] = field(default_factory=list)
    # the service's Service's cluster IP (kept in the status: a recreated Service asks for it again)
    cluster_ip: str | None = None


def _parse_time(value: str | None) -> dt.datetime | None:
    if not value:
        return None
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00"))


def format_time(now: dt.datetime) -> str:
    return now.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _unschedulable(pod: dict, now: dt.datetime) -> tuple[dict, float] | None:
    """The pod's PodScheduled=False/Unschedulable condition and how long it has held, in seconds (None for
    pods being deleted)."""
    if pod.get("metadata", {}).get("deletionTimestamp"):
        return None
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False" \
                and cond.get("reason") == "Unschedulable":
            since = _parse_time(cond.get("lastTransitionTime")) or now
            return cond, (now - since).total_seconds()
    return None


def _short_of_accelerator(cond: dict) -> bool:
    """An Unschedulable condition whose scheduler message names an NVIDIA resource (a MIG slice or a GPU)."""
    return "nvidia.com/" in cond.get("message", "")


def waits_for_accelerator(pod: dict) -> bool:
    """The scheduler found no node with the pod's accelerator (MIG slice or GPU) free."""
    unsched = _unschedulable(pod, dt.datetime.now(dt.timezone.utc))
    return unsched is not None and _short_of_accelerator(unsched[0])


def _ended(cs: dict) -> dict:
    """A container's termination that is its state now: terminated, or waiting to be restarted after it ({})."""
    state = cs.get("state") or {}
    why = (state.get("waiting") or {}).get("reason", "")
    return state.get("terminated") or ((cs.get("lastState") or {}).get("terminated") if why == "CrashLoopBackOff"
                                       else None) or {}


def _down_after_a_long_run(ended: dict, now: dt.datetime, stall_after: float) -> float | None:
    """For a container that ran at least `stall_after` before it ended (it served, then died: an OOM kill under a
    burst, a node-level kill), ended less than `stall_after` ago: how long it has been down. The kubelet restarts it
    (its first back-off is 10 s), so it is progress, not a failure, until it stays down that long or fails soon after
    starting. None otherwise, and where the kubelet gave no times."""
    if ended.get("reason") == "Completed":  # an init container's normal end
        return None
    started, finished = _parse_time(ended.get("startedAt")), _parse_time(ended.get("finishedAt"))
    if started is None or finished is None or (finished - started).total_seconds() < stall_after:
        return None
    down = (now - finished).total_seconds()
    return down if down < stall_after else None


def stall_check_in(pods: list[dict], now: dt.datetime, stall_after: float) -> float | None:
    """Seconds until the next unschedulable pod has waited `stall_after`, or the next container that died after a
    long run has been down that long (status must be recomputed then: no event marks that moment); None when no
    pod is waiting to cross it."""
    waits = [stall_after - u[1] for u in (_unschedulable(p, now) for p in pods) if u and u[1] < stall_after]
    for pod in pods:
        if (pod.get("metadata") or {}).get("deletionTimestamp"):
            continue
        st = pod.get("status") or {}
        for cs in (st.get("initContainerStatuses") or []) + (st.get("containerStatuses") or []):
            down = _down_after_a_long_run(_ended(cs), now, stall_after)
            if down is not None:
                waits.append(stall_after - down)
    return min(waits) if waits else None


def _memory_note(pod: dict, container: str | None, memory: dict | None) -> str:
    """'; limit 2Gi, the operator estimates 1.4Gi (...)' for an OOMKilled container."""
    limit = None
    for c in ((pod.get("spec") or {}).get("initContainers") or []) + ((pod.get("spec") or {}).get("containers") or []):
        if c.get("name") == container:
            limit = ((c.get("resources") or {}).get("limits") or {}).get("memory")
    note = f"; its limit is {limit}" if limit else ""
    if memory and memory.get("estimate"):
        key = "prepare" if container == "prepare" else "estimate"
        if memory.get(key):
            note += f", the operator estimates {memory[key]} ({memory.get('detail', '')})"
    return note + ": raise accelerator.cpu.memory (or resources.limits.memory), or lower model.maxInputLength"


def _pod_problem(pods: list[dict], now: dt.datetime, stall_after: float,
                 memory: dict | None = None) -> tuple[str, str] | None:
    """The first terminal-looking pod problem: (reason, message)."""
    for pod in sorted(pods, key=lambda p: p.get("metadata", {}).get("name", "")):
        if pod.get("metadata", {}).get("deletionTimestamp"):
            continue
        st = pod.get("status") or {}
        unsched = _unschedulable(pod, now)
        if unsched is not None:
            cond, waited = unsched
            if waited >= stall_after:
                msg = cond.get("message", "")
                reason = "InsufficientAccelerator" if _short_of_accelerator(cond) else "Unschedulable"
                return reason, f"pod {pod['metadata']['name']} cannot be scheduled: {msg}"
        for cs in (st.get("initContainerStatuses") or []) + (st.get("containerStatuses") or []):
            waiting = (cs.get("state") or {}).get("waiting") or {}
            why = waiting.get("reason", "")
            detail = f"container {cs.get('name')} of pod {pod['metadata']['name']}: {why}"
            if waiting.get("message"):
                detail += f": {waiting['message']}"
            # health is now: a container that ended (or waits to be restarted after ending) is failing; one that
            # runs again after an OOM kill is not (recovered() reports it), or one kill would hold the service down.
            # Nor is one the kubelet is restarting after a long run, until it stays down for stall_after
            ended = _ended(cs)
            if ended and _down_after_a_long_run(ended, now, stall_after) is not None:
                continue
            if ended.get("reason") == "OOMKilled":
                return "OOMKilled", (f"container {cs.get('name')} of pod {pod['metadata']['name']} was killed for "
                                     f"memory (OOMKilled, {cs.get('restartCount', 0)} restarts)"
                                     + _memory_note(pod, cs.get("name"), memory))
            if why == "CrashLoopBackOff":
                said = (ended.get("message") or "").strip()
                return "CrashLoop", detail + (f"; it said: {said.splitlines()[-1][:500]}" if said else "")
            if why in IMAGE_PULL:
                return "ImagePullFailure", detail
            if why in CONFIG_ERRORS:
                return "ConfigError", detail
    return None


def recovered(pods: list[dict]) -> str | None:
    """The latest failure of a container that runs again (OOMKilled, Error, ...): reported, never a stall. The kubelet
    keeps only a container's last termination, so this is the newest of those over the service's current pods."""
    latest: tuple[str, str] | None = None
    for pod in pods:
        if (pod.get("metadata") or {}).get("deletionTimestamp"):
            continue
        st = pod.get("status") or {}
        for cs in (st.get("initContainerStatuses") or []) + (st.get("containerStatuses") or []):
            last = (cs.get("lastState") or {}).get("terminated") or {}
            if not (cs.get("state") or {}).get("running") or not last or last.get("reason") == "Completed":
                continue
            at = last.get("finishedAt") or ""
            what = (f"container {cs.get('name')} of pod {pod['metadata']['name']} ended {last.get('reason', 'Error')} "
                    f"(exit {last.get('exitCode', '?')}) at {at or 'an unknown time'} and runs again "
                    f"({cs.get('restartCount', 0)} restarts)")
            if latest is None or at > latest[0]:
                latest = (at, what)
    return latest[1] if latest else None


def _condition(old: dict[str, dict], ctype: str, status: str, reason: str, message: str,
               generation: int | None, now: dt.datetime) -> dict:
    prev = old.get(ctype)
    ltt = prev.get("lastTransitionTime") if prev and prev.get("status") == status else None
    return {"type": ctype, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": ltt or format_time(now), "observedGeneration": generation}


def compute(resource: dict, observed: Observed, options: render.Options | None = None,
            now: dt.datetime | None = None, stall_after: float = 60.0,
            parsed: EmbeddingService | None = None) -> dict:
    """The status of `resource` from what a reconcile observed; a pure function: it changes neither argument.
    `parsed`: `resource` already parsed (the reconciler's Intent, as `render.render` takes it), else it is parsed
    here."""
    options = options or render.Options()
    now = now or dt.datetime.now(dt.timezone.utc)
    meta = resource.get("metadata") or {}
    name, ns = meta.get("name", ""), meta.get("namespace") or "default"
    generation = meta.get("generation")
    old_status = resource.get("status") or {}
    old = {c.get("type"): c for c in old_status.get("conditions") or []}
    status: dict[str, Any] = {"observedGeneration": generation}
    conditions: list[dict] = []

    def cond(ctype: str, st: str, reason: str, message: str) -> None:
        conditions.append(_condition(old, ctype, st, reason, message, generation, now))

    invalid = observed.invalid
    spec = parsed.spec if parsed is not None else None
    if spec is None:
        try:
            spec = parse_resource(resource).spec
        except Exception as exc:  # noqa: BLE001 - any parse error is an invalid spec
            invalid = invalid or f"spec rejected by the operator: {exc}"

    serving_space = next((x for x in observed.spaces if x.get("serving")), None)
    if spec is not None:
        status["task"] = render.detect_task(spec.model)
        status["accelerator"] = render.accelerator_summary(spec)
        status["selector"] = render.selector_string(serving_space["deployment"] if serving_space else name)
        eps = render.endpoints(name, ns, spec, options)
        status["url"] = eps.get("external") or eps["service"]
        if observed.cluster_ip:
            status["clusterIP"] = observed.cluster_ip
        status["endpoints"] = eps

    dep = observed.deployment
    dstat = (dep or {}).get("status") or {}
    replicas = dstat.get("replicas", 0)
    ready = dstat.get("readyReplicas", 0)
    updated = dstat.get("updatedReplicas", 0)
    available = dstat.get("availableReplicas", 0)
    candidate = next((x for x in observed.spaces if x.get("role") == "candidate"), None)
    if spec is not None and (spec.autoscaling or candidate is not None):
        # autoscaled, or the previous space still serves: its Deployment says how many it runs
        fallback = spec.autoscaling.min_replicas if spec.autoscaling else spec.replicas
        desired = ((dep or {}).get("spec") or {}).get("replicas", fallback)
    elif spec is not None:
        desired = spec.replicas
    else:
        desired = 0
    status.update({"replicas": replicas, "readyReplicas": ready, "updatedReplicas": updated,
                   "availableReplicas": available, "replicasSummary": f"{ready}/{desired}"})

    # Stalled: terminal problems that retrying will not fix on its own.
    stalled: tuple[str, str] | None = None
    kept = observed.pod_templates.get("server")
    memory = _memory_status(spec, kept[0].revision if kept else None) if spec is not None else None
    if memory:
        status["memory"] = memory
    served = _served_model(observed.pods)
    if served:
        status["model"] = served
    if invalid:
        stalled = ("InvalidSpec", invalid)
    elif observed.refused:
        stalled = observed.refused
    elif observed.conflicts:
        stalled = ("OwnershipConflict", "; ".join(observed.conflicts) + "; " + CONFLICT_ADVICE)
    elif dep is not None:
        for dc in dstat.get("conditions") or []:
            if dc.get("type") == "Progressing" and dc.get("reason") == "ProgressDeadlineExceeded":
                stalled = ("ProgressDeadlineExceeded", dc.get("message", "rollout exceeded its deadline"))
        problem = _pod_problem(observed.pods, now, stall_after, memory)
        if problem:
            if stalled and problem[0] == "InsufficientAccelerator":
                stalled = ("RolloutBlockedInsufficientAccelerator", problem[1])
            else:
                stalled = problem

    candidate_blocked: tuple[str, str] | None = None
    if candidate is not None and not _up(candidate["ready"]):
        problem = _pod_problem(observed.candidate_pods, now, stall_after, memory)
        if problem is not None:
            serving_key = serving_space["key"] if serving_space else "the previous one"
            candidate_blocked = (problem[0], f"the new space {candidate['key']} cannot start ({candidate['ready']} "
                                             f"replicas available): {problem[1]}; space {serving_key} keeps serving")
    rolled_out = (
        dep is not None
        and dstat.get("observedGeneration", -1) >= (dep.get("metadata") or {}).get("generation", 0)
        and updated >= desired and ready >= desired and available >= desired
        and replicas == desired  # old pods gone
    )
    activator_ready = spec is None or not render.scales_to_zero(spec, options) or (
        ((observed.activator or {}).get("status") or {}).get("availableReplicas", 0) >= 1)
    mixed = spaces_served(observed.pods) if rolled_out else {}
    if not stalled and len(mixed) > 1:
        # every replica runs the current template, yet they serve different spaces: the model changed under a
        # model.revision that names no commit. Queries get vectors of either: a failure, not progress
        said = "; ".join(f"space {fp}: {', '.join(sorted(pods))}" for fp, pods in sorted(mixed.items()))
        cond("Ready", "True", "Available", f"{ready}/{desired} replicas ready")
        cond("Reconciling", "False", "MixedSpaces", "")
        cond("Stalled", "True", "MixedSpaces", (
            f"the replicas behind the service's address serve {len(mixed)} embedding spaces ({said}): the model "
            "changed under an unpinned model.revision between their starts; set model.revision to the commit your "
            "index holds (a migration if that is a new space)"))
    elif stalled:
        cond("Ready", "False", stalled[0], stalled[1])
        cond("Reconciling", "False", stalled[0], "")
        cond("Stalled", "True", stalled[0], stalled[1])
    elif observed.apply_error:
        cond("Ready", "False", "ApplyFailed", observed.apply_error)
        cond("Reconciling", "True", "ApplyFailed", observed.apply_error)
        cond("Stalled", "False", "ApplyFailed", "")
    elif rolled_out and candidate_blocked is not None:
        # the address serves; the spec's new space cannot come up (a pod unschedulable, crash-looping, ...): a
        # migration that cannot finish is a failure kstatus and Flux must see, not progress to wait on forever
        cond("Ready", "True", "Available", f"{ready}/{desired} replicas ready")
        cond("Reconciling", "False", candidate_blocked[0], "")
        cond("Stalled", "True", candidate_blocked[0], candidate_blocked[1])
    elif rolled_out and candidate is not None and not _up(candidate["ready"]):
        # the address serves; the spec's new space is still starting beside it
        msg = f"{ready}/{desired} replicas ready; {observed.space_waiting or 'a new embedding space is starting'}"
        cond("Ready", "True", "Available", f"{ready}/{desired} replicas ready")
        cond("Reconciling", "True", "StartingSpace", msg)
        cond("Stalled", "False", "StartingSpace", "")
    elif rolled_out and candidate is None and observed.space_waiting:
        # migration.promote names a previous space that is not ready yet (scaled back up for a rollback)
        cond("Ready", "True", "Available", f"{ready}/{desired} replicas ready")
        cond("Reconciling", "True", "RollingBack", observed.space_waiting)
        cond("Stalled", "False", "RollingBack", "")
    elif rolled_out and not activator_ready:  # the service's address has nothing behind it yet
        msg = f"{ready}/{desired} replicas ready; the activator that answers the service's address is not available"
        cond("Ready", "False", "WaitingForActivator", msg)
        cond("Reconciling", "True", "WaitingForActivator", msg)
        cond("Stalled", "False", "WaitingForActivator", "")
    elif rolled_out:
        reason = "ScaledToZero" if desired == 0 else "Available"
        cond("Ready", "True", reason, f"{ready}/{desired} replicas ready")
        cond("Reconciling", "False", reason, "")
        cond("Stalled", "False", reason, "")
    else:
        if dep is None:
            reason, msg = "Creating", "creating the Deployment"
        elif updated < desired:
            reason, msg = "RollingOut", f"{updated}/{desired} replicas updated"
            rolling = (((dep.get("spec") or {}).get("strategy") or {}).get("rollingUpdate") or {})
            if str(rolling.get("maxSurge", "")) in ("0", "0%"):
                # no spare accelerator is assumed (MIG, GPU): the old pod frees its slice first
                msg += ("; maxSurge 0: each old replica stops before its replacement loads, so the service runs "
                        f"{max(desired - 1, 0)} replica(s) meanwhile (no spare accelerator was free for a surge pod, "
                        "or spec.rollout says so)")
        else:
            reason, msg = "WaitingForReplicas", f"{ready}/{desired} replicas ready"
        cond("Ready", "False", reason, msg)
        cond("Reconciling", "True", reason, msg)
        cond("Stalled", "False", reason, "")

    if observed.spaces:
        status["spaces"] = observed.spaces
        if candidate is None:
            cond("Promoted", "True", "Serving", f"space {serving_space['key']} serves the service's address"
                 if serving_space else "")
        else:
            reason = (candidate_blocked[0] if candidate_blocked else "Starting" if not _up(candidate["ready"])
                      else "ReindexFailed" if "failed" in (
                observed.space_waiting or "") else "Reindexing" if "reindex" in (observed.space_waiting or "")
                      else "AwaitingPromotion")
            said = candidate_blocked[1] if candidate_blocked else observed.space_waiting or ""
            cond("Promoted", "False", reason, said)
    if spec is not None:
        features = {"monitoring": spec.monitoring.service_monitor.enabled, "routes": spec.gateway is not None,
                    "autoscaling": spec.autoscaling is not None, "litellm": bool(observed.litellm_conflicts)}
        for feature, requested in features.items():
            if not requested:
                continue
            ctype = FEATURE_CONDITIONS[feature]
            if feature in observed.missing:
                kind = observed.missing[feature]
                cond(ctype, "False", "CRDNotInstalled",
                     f"the {kind} CRD is not installed; {feature} is skipped until it is")
            elif feature == "routes":
                blocked = render.gateway_blocked(ns, spec, options)
                cond(ctype, *(("False", "BlockedByNetworkPolicy", blocked) if blocked
                              else route_condition(observed.route, spec.gateway, ns)))
            elif feature == "litellm":  # said only when something is wrong: a name shared with another service
                cond(ctype, "False", "ModelNameConflict", "; ".join(observed.litellm_conflicts))
            elif feature == "autoscaling":
                kind = render.autoscaler_kind(spec, options)
                cond(ctype, "True", "KEDA" if kind == "keda" else "HPA",
                     "ScaledObject on te_queue_size" if kind == "keda" else "HorizontalPodAutoscaler")
            else:
                cond(ctype, "True", "Applied", "")

    note = recovered(observed.pods + observed.candidate_pods)
    if note:
        status["lastFailure"] = note
    if observed.pod_templates:
        status["podTemplates"] = [{"deployment": which, "revision": pin.revision, "image": pin.image,
                                   "pending": note} for which, (pin, note) in sorted(observed.pod_templates.items())]
    status["conditions"] = conditions
    return status


def route_condition(route: dict | None, gateway, namespace: str) -> tuple[str, str, str]:
    """RoutesReady from what the gateways wrote in the HTTPRoute's ``status.parents``: True only when every
    parent Gateway the spec names has Accepted the route and resolved its backend; the gateway's own reason
    and message when one refused; Unknown while no controller has reported on a parent (none runs for its
    GatewayClass, or it has not seen the route yet)."""
    if route is None:
        return "Unknown", "WaitingForGateway", "the HTTPRoute is not written yet"
    reports = {}
    for p in (route.get("status") or {}).get("parents") or []:
        ref = p.get("parentRef") or {}
        key = (ref.get("namespace") or namespace, ref.get("name"), ref.get("sectionName"))
        reports[key] = (p.get("controllerName", ""), {c.get("type"): c for c in p.get("conditions") or []})
    waiting, accepted = [], []
    for ref in gateway.parent_refs:
        where = f"{ref.namespace or namespace}/{ref.name}" + (f" ({ref.section_name})" if ref.section_name else "")
        report = reports.get((ref.namespace or namespace, ref.name, ref.section_name))
        if report is None:
            waiting.append(where)
            continue
        controller, conds = report
        for ctype, reason in (("Accepted", "NotAccepted"), ("ResolvedRefs", "RefsNotResolved")):
            c = conds.get(ctype)
            if c is not None and c.get("status") == "False":
                return "False", reason, (f"gateway {where} ({controller}): {ctype}=False {c.get('reason', '')}: "
                                         f"{c.get('message', '')}").strip()
        if all((conds.get(t) or {}).get("status") == "True" for t in ("Accepted", "ResolvedRefs")):
            accepted.append(f"{where} ({controller})")
        else:
            waiting.append(where)
    if waiting:
        return "Unknown", "WaitingForGateway", (f"no gateway controller has accepted the HTTPRoute on "
                                                f"{', '.join(waiting)} yet (is one running for its GatewayClass?)")
    return "True", "Accepted", f"accepted by {', '.join(accepted)}"


def _memory_status(spec: EmbeddingServiceSpec, revision: int | None = None) -> dict | None:
    """``revision``: the template revision the server's Deployment keeps (None: the latest), whose estimate its
    pods were sized by."""
    est = render.sizing_of(spec, revision)
    if est is None:
        return {"detail": f"no estimate: the operator does not know {spec.model.id}'s geometry (set model.geometry)"}
    out = {"estimate": sizing.quantity(est.replica.total), "detail": f"{est.replica.describe()}; {est.source}"}
    if spec.accelerator.cpu:
        out["limit"] = cpu_memory(spec, est)
    elif spec.accelerator.mig:
        out["limit"] = f"{spec.accelerator.mig.count} x {spec.accelerator.mig.profile}"
    if est.prepare:
        out["prepare"] = sizing.quantity(est.prepare)
    return out


def _up(ready: str) -> bool:
    available, _, want = ready.partition("/")
    return int(want or 0) > 0 and int(available or 0) >= int(want)


def pod_ready(pod: dict) -> bool:
    """The pod's Ready condition is True."""
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def prepared_reports(pods: list[dict], newest_first: bool = False) -> list[tuple[dict, dict]]:
    """(pod, report) for each ready pod whose prepare init container reported what it loaded in its termination
    message ('prepared {"commit": ..., "space": ..., ...}'), oldest first (or newest first)."""
    import json

    out = []
    order = sorted(pods, key=lambda p: ((p.get("metadata") or {}).get("creationTimestamp") or "",
                                        (p.get("metadata") or {}).get("name", "")), reverse=newest_first)
    for pod in order:
        st = pod.get("status") or {}
        if (pod.get("metadata") or {}).get("deletionTimestamp") or not pod_ready(pod):
            continue
        for cs in st.get("initContainerStatuses") or []:
            msg = (((cs.get("state") or {}).get("terminated") or {}).get("message") or "").strip()
            if cs.get("name") == "prepare" and msg.startswith("prepared "):
                try:
                    out.append((pod, json.loads(msg[len("prepared "):])))
                except ValueError:
                    continue
    return out


def spaces_served(pods: list[dict]) -> dict[str, list[str]]:
    """Each embedding space the ready pods report, with the pods and commits serving it: more than one key is an
    address answering from several spaces."""
    out: dict[str, list[str]] = {}
    for pod, report in prepared_reports(pods):
        if report.get("space"):
            commit = f" (commit {report['commit'][:12]})" if report.get("commit") else ""
            out.setdefault(report["space"], []).append(pod["metadata"]["name"] + commit)
    return out


def first_commit(pods: list[dict]) -> str | None:
    """The model commit the oldest ready pod loaded (what a track pins for its later pods)."""
    return next((r["commit"] for _, r in prepared_reports(pods) if r.get("commit")), None)


def served_space(pods: list[dict]) -> str | None:
    """The embedding space(s) the ready pods serve, from their prepare steps' reports (comma-separated, newest
    first, when they disagree); None when none reports one."""
    served = _served_model(pods)
    return (served or {}).get("space")


def _served_model(pods: list[dict]) -> dict | None:
    """The commit and preparation report of the newest ready pod, and the spaces of all (newest first)."""
    out: dict | None = None
    spaces: list[str] = []
    for _, report in prepared_reports(pods, newest_first=True):
        if report.get("space") and report["space"] not in spaces:
            spaces.append(report["space"])
        if out is None:  # the newest ready pod's report
            out = {"prepared": ", ".join(f"{k} {v}" for k, v in report.items()
                                         if k not in ("commit", "space") and v is not None)}
            if report.get("commit"):
                out["commit"] = report["commit"]
    if out is not None and spaces:
        out["space"] = ",".join(spaces)
    return out


def normalized(status: dict | None) -> dict:
    """Status with empty values dropped, for change detection."""
    def clean(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items() if x is not None}
        if isinstance(v, list):
            return [clean(x) for x in v]
        return v
    return clean(status or {})
