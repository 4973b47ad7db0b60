"""Level-based reconciliation of one EmbeddingService: render → apply (only when different) → prune → status.

Kept free of kopf: the controller's workers run it for the keys its work queue hands out (controller.py), and the
tests call it directly.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import threading
import time
from collections import defaultdict
from typing import Callable

from kubernetes.client.rest import ApiException
from pydantic import ValidationError

from . import apply, litellm, memory, render, spaces, status, upgrades
from .intent import Intent
from .runtime.client import unavailable_reason
from .runtime.delayed import DelayedCalls
from .settings import OperatorSettings
from .spec import API_VERSION, KIND

log = logging.getLogger("embedops.reconcile")
SPACES_MANAGER = "embedops-spaces"  # the field manager of the tracks' serving/retired annotations
# the field manager of a previous track's replicas (scaled down after a delay, back up for a rollback): its own, as
# an apply must name every field its manager keeps, and the marks' manager names only annotations
PREVIOUS_SCALE_MANAGER = "embedops-spaces-scale"
# the field manager of a track's model-commit record (its Deployment's annotation and the ConfigMap its pods read)
COMMIT_MANAGER = "embedops-model-commit"
ANNOTATION_MODEL_COMMIT = "embedops.dev/model-commit"
# lastTransitionTime has one-second resolution: recheck a little after the stall deadline, not on it.
RECHECK_MARGIN = 1.0


def _api_message(exc: ApiException) -> str:
    import json
    try:
        return json.loads(exc.body).get("message", str(exc.body))
    except Exception:  # noqa: BLE001
        return f"{exc.status} {exc.reason}"


def reindex_state(job: dict | None) -> str | None:
    """None (no Job), "running", "succeeded" or "failed: <its reason and message>"."""
    if job is None:
        return None
    for c in (job.get("status") or {}).get("conditions") or []:
        if c.get("status") != "True":
            continue
        if c.get("type") == "Complete":
            return "succeeded"
        if c.get("type") == "Failed":
            return f"failed: {c.get('reason', '')}: {c.get('message', '')}".rstrip(": ")
    return "running"


class Reconciler:
    def __init__(self, kube: apply.Kube, settings: OperatorSettings | None = None):
        self.kube = kube
        self.settings = settings or OperatorSettings()
        self._locks: dict[tuple[str, str], threading.Lock] = defaultdict(threading.Lock)
        self._guard = threading.Lock()
        # status rechecks due later (a pending pod's stall deadline): one heap and thread for all services
        self.rechecks = DelayedCalls("status-rechecks")
        # services whose last apply stopped at an API error or left a child in conflict: retried with a back-off
        self.unfinished: set[tuple[str, str]] = set()
        # pod upgrades the operator started (Options.pod_upgrades "Roll"), until the service is Ready again, and
        # the services waiting for one of those slots
        self.upgrading: dict[tuple[str, str], float] = {}
        self.awaiting_upgrade: set[tuple[str, str]] = set()
        self.requeue: Callable[[tuple[str, str]], None] | None = None  # the controller's queue, when there is one
        # a status-only reconcile through the controller's queue (never two threads on one service); without
        # one (a reconciler used alone) the recheck reconciles on the rechecks' thread
        self.requeue_status: Callable[[tuple[str, str]], None] | None = None

    def _lock(self, key: tuple[str, str]) -> threading.Lock:
        with self._guard:
            return self._locks[key]

    def options(self) -> render.Options:
        return render.Options.of(self.settings, self.kube.capabilities())

    def reconcile(self, namespace: str, name: str, apply_children: bool = True) -> dict | None:
        """Bring one EmbeddingService's children and status up to date. Returns the written status or None."""
        with self._lock((namespace, name)):
            with self._guard:
                self.unfinished.discard((namespace, name))
            resource = self.kube.get(API_VERSION, KIND, namespace, name)
            if resource is None or resource["metadata"].get("deletionTimestamp"):
                return None
            options = self.options()
            observed = status.Observed()
            manifests: list[dict] | None = None
            plan: spaces.Plan | None = None
            intent: Intent | None = None
            try:
                intent = Intent.of(resource, options)  # the one parse of this reconcile
                plan = self.space_plan(intent)
                tracks = self.tracks(intent, plan)
                pins = self.pins(intent, observed, tracks)
                manifests = render.render(resource, options, pins, tracks, parsed=intent.es)
                if not apply_children and pins.server.give_up_first and self._surge_refusal_unwritten(manifests):
                    apply_children = True  # a pod event found the surge pod unschedulable: switch the rollout now
            except ValidationError as exc:
                observed.invalid = "; ".join(
                    f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
            if manifests is not None:
                # a spec that cannot fit its memory or MIG slice is refused before anything is applied: its
                # pods would only be OOM-killed or never load (the status says what it needs)
                observed.refused = memory.refusal(intent.spec, intent.sizing)
            if manifests is not None and observed.refused is None:
                observed.missing = render.missing_capabilities(intent.spec, options)
                if apply_children:
                    try:
                        # before the Service's selector moves: a track that stops serving is marked first, so a
                        # failure between the two never leaves a served space looking like an abandoned candidate
                        observed.litellm_conflicts, manifests = self._litellm_clashes(intent, manifests)
                        marked = self._record_tracks(intent, plan)
                        self._announce(intent, plan)
                        applied = apply.apply_all(self.kube, manifests, name, cluster_ips=self._cluster_ips(intent))
                        if plan.serving.live is None:  # a new service's first track: recorded once it exists
                            marked += self._record_tracks(intent, plan)
                        written = marked + applied.written
                        if plan.next_change is not None:  # no event marks a previous space's scale-down or removal
                            self._reconcile_later((namespace, name), plan.next_change + RECHECK_MARGIN)
                        observed.conflicts = [c.message() for c in applied.conflicts]
                        if applied.conflicts:
                            # no event comes when the user removes a foreign object (the caches hold only the
                            # operator's): retried with the key's back-off (up to a minute), one read each
                            log.warning("%s/%s: not written, not the operator's: %s", namespace, name,
                                        "; ".join(observed.conflicts))
                            with self._guard:
                                self.unfinished.add((namespace, name))
                        # the track that still serves (or is kept for a rollback) is not rendered: not pruned
                        kept = {("Deployment", t.name) for t in plan.tracks if t is not plan.spec}
                        pruned = apply.prune(self.kube, resource, manifests, options.capabilities, kept)
                        # a changed or dropped litellm.configMapName leaves a key in the old ConfigMap; only a
                        # spec change can do that, so pod and status events skip this LIST
                        meta, st = resource["metadata"], resource.get("status") or {}
                        if written or st.get("observedGeneration") != meta.get("generation"):
                            pruned += self._sweep_own_litellm(namespace, name)
                        if written or pruned:
                            log.info("%s/%s: applied %s, pruned %s", namespace, name, written, pruned)
                    except ApiException as exc:
                        msg = _api_message(exc)
                        failed = getattr(exc, "failed_object", None) or {}
                        gone = render.FEATURE_OF_KIND.get((failed.get("apiVersion"), failed.get("kind")))
                        if exc.status == 404 and gone:
                            # its CRD was removed since discovery: the same as never installed, not an error
                            observed.missing[gone] = failed["kind"]
                        elif exc.status in (400, 422):
                            observed.invalid = f"a rendered child was refused: {msg}"
                        else:
                            observed.apply_error = msg
                        # an unavailable API server is reported once by the client's ApiHealth, not per service
                        (log.debug if unavailable_reason(exc) else log.warning)(
                            "%s/%s: apply failed: %s", namespace, name, msg)
                        if exc.status >= 500 or exc.status in (404, 409, 429):
                            self.kube.forget_capabilities()
                        # the children after the failed one were not applied: the controller retries
                        # with a back-off instead of taking this reconcile as done
                        with self._guard:
                            self.unfinished.add((namespace, name))
            if manifests is not None and "routes" not in observed.missing \
                    and any((m["apiVersion"], m["kind"]) == render.HTTPROUTE for m in manifests):
                observed.route = self.kube.get(*render.HTTPROUTE, namespace, name)
            serving = plan.serving.name if plan is not None else name
            observed.deployment = self.kube.get("apps/v1", "Deployment", namespace, serving)
            address = ((self.kube.get("v1", "Service", namespace, name) or {}).get("spec") or {}).get("clusterIP")
            observed.cluster_ip = address if address and address != "None" else None
            if manifests is not None and intent.scales_to_zero:
                observed.activator = self.kube.get("apps/v1", "Deployment", namespace, render.activator_name(name))
            pods = self.kube.list("v1", "Pod", namespace, f"{render.LABEL_SERVICE}={name}")
            by_track: dict[str, list[dict]] = {}
            for pod in pods:
                by_track.setdefault(((pod.get("metadata") or {}).get("labels") or {}).get(render.LABEL_INSTANCE), []
                                    ).append(pod)
            observed.pods = by_track.get(serving, [])
            if plan is not None:
                self._pin_commits(intent, plan, by_track)
            if plan is not None and intent.task in spaces.MIGRATING_TASKS:
                observed.spaces = self._space_status(intent, plan, by_track)
                observed.space_waiting = plan.waiting
                if plan.spec is not plan.serving:
                    observed.candidate_pods = by_track.get(plan.spec.name, [])
            written = self.write_status(resource, observed, options, intent)
            if written and written.get("lastFailure") and written["lastFailure"] != (resource.get("status") or {}).get(
                    "lastFailure"):  # the status remembers what was said: one Event per failure
                self.kube.event(resource, "Warning", "ContainerRestarted", written["lastFailure"])
            self._release_upgrade((namespace, name), written or resource.get("status") or {})
            wait = status.stall_check_in(observed.pods + observed.candidate_pods, dt.datetime.now(dt.timezone.utc),
                                         self.settings.stall_after_seconds)
            if wait is not None:
                self._recheck((namespace, name), wait + RECHECK_MARGIN)
            return written

    # ------------------------------------------------------------------ pod templates across operator upgrades
    def pins(self, intent: Intent, observed: status.Observed, tracks: render.Tracks) -> render.Pins:
        """What the service's Deployments are rendered with besides the spec (upgrades.py): a running Deployment
        keeps the template revision and image it was written with until its spec changes the template, or until
        the operator rolls it (pod upgrades "Roll": at most `max_concurrent_upgrades` services at a time)."""
        spec, options, owner = intent.spec, intent.options, intent.owner
        ns, name = key = intent.namespace, intent.name
        live = self._own_deployment(intent, tracks.spec)
        render_at = lambda pin: render.deployment(name, ns, spec, options, owner, pin, tracks.spec,  # noqa: E731
                                                  tracks.replicas)
        server = self._choose(key, options, live, render_at, observed, "server")
        r = spec.rollout  # a rollout the manifest fixes is applied as written
        fixed = r is not None and (r.max_surge is not None or r.max_unavailable is not None)
        if not spec.accelerator.cpu and not fixed:
            server = dataclasses.replace(server, give_up_first=self._surge_refused(ns, live, lambda: render_at(server)))
        activator = render.Pin()
        if intent.scales_to_zero:
            activator = self._choose(key, options, self._own_deployment(intent, render.activator_name(name)),
                                     lambda pin: render.activator_deployment(name, ns, spec, options, owner, pin),
                                     observed, "activator")
        return render.Pins(server, activator)

    # ------------------------------------------------------------------ embedding spaces (spaces.py)
    def space_plan(self, intent: Intent) -> spaces.Plan:
        """Which model Deployment serves the service's address and which the spec renders: one, but while a change
        of the embedding space is under way."""
        spec, options = intent.spec, intent.options
        ns, name, uid = intent.namespace, intent.name, intent.uid
        decl = spaces.declaration(render.deployment(name, ns, spec, options, None))
        selector = f"{render.LABEL_SERVICE}={name},{render.LABEL_NAME}=embedops-server"
        live = [d for d in self.kube.list("apps/v1", "Deployment", ns, selector)
                if (apply.controller_of(d) or {}).get("uid") == uid]
        model_service = render.backend_name(name) if intent.scales_to_zero else name
        svc = self.kube.get("v1", "Service", ns, model_service)
        address = None  # what the address selects now: output, read to say what was repaired (and by an upgrade)
        foreign = svc is not None and (apply.controller_of(svc) or {}).get("uid") != uid  # a conflict says so
        if svc is not None and not foreign:
            address = ((svc.get("spec") or {}).get("selector") or {}).get(render.LABEL_INSTANCE)
        before = intent.status.get("spaces") or []
        served = frozenset(x.get("key") for x in before if x.get("serving") and x.get("since"))
        status_serving = next((x.get("key") for x in before if x.get("serving")), None)
        job = self._reindex_job(intent, spaces.key_of(decl)) if spec.migration.reindex else None
        return spaces.plan(name, intent.task, decl, live, address, spec.migration,
                           reindex_state(job), dt.datetime.now(dt.timezone.utc), served, status_serving,
                           foreign_address=foreign)

    def _reindex_job(self, intent: Intent, key: str) -> dict | None:
        """The space's reindex Job: the one of the current template, else the newest (whose environment a new one
        keeps)."""
        selector = f"{render.LABEL_SERVICE}={intent.name},{render.LABEL_SPACE}={key}"
        jobs = [j for j in self.kube.list("batch/v1", "Job", intent.namespace, selector)
                if (apply.controller_of(j) or {}).get("uid") == intent.uid]
        spec = intent.spec
        current = render.reindex_job_name(intent.name, key, render.reindex_digest(spec)) if spec.migration.reindex \
            else None
        return max(jobs, key=lambda j: (j["metadata"]["name"] == current, j["metadata"].get("creationTimestamp") or ""),
                   default=None)

    def tracks(self, intent: Intent, plan: spaces.Plan) -> render.Tracks:
        spec = intent.spec
        replicas = None
        if plan.spec is not plan.serving:
            # a candidate: fixed replicas (the autoscaler scales the serving track), as many as serve now, so the
            # promotion moves the address to a space of the size its load needs
            if spec.autoscaling:
                serving_now = plan.serving.ready[1] if plan.serving.live is not None else 0
                replicas = min(max(spec.autoscaling.min_replicas, 1, serving_now), spec.autoscaling.max_replicas)
            else:
                replicas = max(spec.replicas, 1)
        return render.Tracks(plan.spec.name, plan.serving.name, replicas,
                             tuple((t.key, t.name) for t in plan.tracks) if plan.migrating else (),
                             self._reindex_env(intent, plan) if spec.migration.reindex and plan.migrating else None)

    def _reindex_env(self, intent: Intent, plan: spaces.Plan) -> tuple[tuple[str, str], ...] | None:
        """The reindex Job's environment: once its Job exists, what it was created with (a Job's template cannot
        change); before, only when the new space's replicas are all up and report their fingerprint."""
        live = self._reindex_job(intent, plan.spec.key)
        if live is not None:
            containers = (((live.get("spec") or {}).get("template") or {}).get("spec") or {}).get("containers") or [{}]
            env = {e["name"]: e.get("value", "") for e in containers[0].get("env") or []
                   if e.get("name", "").startswith("EMBEDOPS_")}
            return tuple(sorted(env.items())) if "EMBEDOPS_SPACE" in env else None
        if plan.spec is plan.serving or not plan.spec.up:
            return None
        before = {x.get("key"): x for x in intent.status.get("spaces") or []}
        fingerprint = (before.get(plan.spec.key) or {}).get("fingerprint")
        if not fingerprint or "," in fingerprint:  # not reported yet, or its replicas disagree: wait
            return None
        url = lambda key: render.service_url(spaces.space_service_name(intent.name, key), intent.namespace,  # noqa: E731
                                             intent.spec, intent.options)
        return (("EMBEDOPS_PREVIOUS_SPACE", plan.serving.key), ("EMBEDOPS_PREVIOUS_SPACE_URL", url(plan.serving.key)),
                ("EMBEDOPS_SPACE", plan.spec.key), ("EMBEDOPS_SPACE_FINGERPRINT", fingerprint),
                ("EMBEDOPS_SPACE_URL", url(plan.spec.key)))

    def _record_tracks(self, intent: Intent, plan: spaces.Plan) -> list[str]:
        """The record of which track serves, on the tracks' Deployments (annotations under their own field manager:
        nothing rolls), written before the Service's selector moves: the serving track's epoch (one more than any
        before it when it starts serving) and since when, with no retirement; a track that stops serving keeps its
        epoch and gets its retirement time. The serving track first: an operator killed between two of these writes
        leaves the new serving track the highest epoch, and the next reconcile retires the other. Then the plan's
        events."""
        now = status.format_time(dt.datetime.now(dt.timezone.utc))
        ns = intent.namespace
        written = []
        for track in [plan.serving] + plan.previous:
            live = self.kube.get("apps/v1", "Deployment", ns, track.name)
            if live is None or (apply.controller_of(live) or {}).get("uid") != intent.uid:
                continue  # not created yet (recorded once it is), or not ours
            has = (live.get("metadata") or {}).get("annotations") or {}
            marks = {k: has[k] for k in (spaces.ANNOTATION_SERVING_EPOCH, spaces.ANNOTATION_SERVING_SINCE,
                                         spaces.ANNOTATION_RETIRED) if k in has}
            if track is plan.serving:
                if marks.get(spaces.ANNOTATION_SERVING_EPOCH) != str(plan.epoch) or \
                        spaces.ANNOTATION_SERVING_SINCE not in marks:
                    marks[spaces.ANNOTATION_SERVING_EPOCH] = str(plan.epoch)
                    marks[spaces.ANNOTATION_SERVING_SINCE] = now
                marks.pop(spaces.ANNOTATION_RETIRED, None)
            else:
                marks.setdefault(spaces.ANNOTATION_RETIRED, now)
            if all(has.get(k) == v for k, v in marks.items()) and all(
                    (k in marks) == (k in has) for k in (spaces.ANNOTATION_SERVING_EPOCH, spaces.ANNOTATION_RETIRED)):
                continue
            # the intent names every mark this manager keeps on the Deployment: one it leaves out is removed
            meta = {"name": track.name, "namespace": ns, "annotations": marks}
            self.kube.apply({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta}, manager=SPACES_MANAGER)
            what = "serving again" if track is plan.serving and spaces.ANNOTATION_RETIRED in has else \
                "serving" if track is plan.serving else "retired"
            written.append(f"Deployment/{track.name} ({what}, epoch {marks.get(spaces.ANNOTATION_SERVING_EPOCH)})")
        for track, replicas in plan.scale.items():
            self.kube.apply({"apiVersion": "apps/v1", "kind": "Deployment",
                             "metadata": {"name": track, "namespace": ns}, "spec": {"replicas": replicas}},
                            manager=PREVIOUS_SCALE_MANAGER)
            written.append(f"Deployment/{track} (previous: {replicas} replicas)")
        return written

    def _pin_commits(self, intent: Intent, plan: spaces.Plan, pods: dict[str, list[dict]]) -> None:
        """One space, one set of weights: a track whose pods resolve the model's commit at start (template revision
        5, render.pins_commit) gets the commit its first ready replica loaded, once: the ConfigMap its pods read
        (PINNED_REVISION; owned by the track's Deployment, so it goes with it), then the Deployment's annotation,
        the record that it is done (read from the cache: a reconcile at rest sends nothing). Every later pod of the
        track, a restart, a scale-up or a replacement, loads that commit; a new upstream commit is taken only by a
        spec that names it in model.revision (a new space, a migration)."""
        ns = intent.namespace
        for track in plan.tracks:
            live = self.kube.get("apps/v1", "Deployment", ns, track.name)
            if live is None or (apply.controller_of(live) or {}).get("uid") != intent.uid:
                continue
            pinned = ((live.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_MODEL_COMMIT)
            if pinned:
                self._repair_commit_record(intent, track.name, live, pinned, pods.get(track.name, []))
                continue
            server = next((c for c in live["spec"]["template"]["spec"].get("containers") or []
                           if c.get("name") == "server"), {})
            if not any(e.get("name") == render.PINNED_REVISION and e.get("valueFrom") for e in server.get("env") or []):
                continue  # a commit in the spec, a local folder, or a template from before revision 5
            commit = status.first_commit(pods.get(track.name, []))
            if commit is None:
                continue
            self._write_commit_record(intent, track.name, live, commit)
            self.kube.apply({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {
                "name": track.name, "namespace": ns, "annotations": {ANNOTATION_MODEL_COMMIT: commit}}},
                manager=COMMIT_MANAGER)
            log.info("%s/%s: the model commit of track %s pinned to %s (its first replica's)", ns, intent.name,
                     track.name, commit)

    @staticmethod
    def _cluster_ips(intent: Intent) -> dict[str, str]:
        """The address the service's Service had (its status): asked for again if it must be created."""
        ip = intent.status.get("clusterIP")
        return {intent.name: ip} if ip else {}

    def _write_commit_record(self, intent: Intent, track: str, live: dict, commit: str) -> None:
        """The ConfigMap a track's pods read PINNED_REVISION from (owned by its Deployment: it goes with it)."""
        self.kube.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {
            "name": render.commit_config_map(track), "namespace": intent.namespace,
            "labels": {render.LABEL_SERVICE: intent.name, render.LABEL_INSTANCE: track},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "name": track,
                                 "uid": live["metadata"]["uid"]}]}, "data": {"commit": commit}},
            manager=COMMIT_MANAGER)

    def _repair_commit_record(self, intent: Intent, track: str, live: dict, commit: str, pods: list[dict]) -> None:
        """A pinned track's ConfigMap deleted or edited (a clean-up, another tool's prune) would let its next pod
        resolve the branch again. The ConfigMap is not watched (the cache holds only LiteLLM's), so it is read
        from the API server only while a pod of the track is starting, when a pod reads it: nothing at rest.
        Written back from the Deployment's record, with an Event. A pod that started in the gap may have loaded
        another commit: MixedSpaces says so (status.py), and deleting it reloads it at the pinned commit."""
        if not any(not (p.get("metadata") or {}).get("deletionTimestamp") and not status.pod_ready(p) for p in pods):
            return  # no pod of the track is starting
        name = render.commit_config_map(track)
        found = self.kube.get_from_server("v1", "ConfigMap", intent.namespace, name)
        if found is not None and (found.get("data") or {}).get("commit") == commit:
            return
        self._write_commit_record(intent, track, live, commit)
        what = "deleted" if found is None else f"changed to {(found.get('data') or {}).get('commit')!r}"
        message = (f"ConfigMap {name} ({what}) written again with the commit track {track} pinned, {commit}: "
                   f"its starting pods load that commit")
        self.kube.event(intent.resource, "Warning", "ModelCommitRepaired", message)
        log.warning("%s/%s: ModelCommitRepaired: %s", intent.namespace, intent.name, message)

    def _litellm_clashes(self, intent: Intent, manifests: list[dict]) -> tuple[list[str], list[dict]]:
        """A model name another service's entry already serves in the shared LiteLLM ConfigMap: said in the status
        (LiteLLMReady=False ModelNameConflict) and this service's entry left unwritten, never load-balanced."""
        if intent.spec.litellm is None:
            return [], manifests
        entry = next((m for m in manifests if m["kind"] == "ConfigMap"), None)
        if entry is None:
            return [], manifests
        live = self.kube.get("v1", "ConfigMap", intent.namespace, entry["metadata"]["name"])
        clashes = litellm.model_name_clashes(live, entry, intent.name)
        return clashes, [m for m in manifests if m is not entry] if clashes else manifests

    def _announce(self, intent: Intent, plan: spaces.Plan) -> None:
        for kind, reason, message in plan.events:
            self.kube.event(intent.resource, kind, reason, message)
            (log.warning if kind == "Warning" else log.info)("%s/%s: %s: %s", intent.namespace, intent.name,
                                                             reason, message)

    def _space_status(self, intent: Intent, plan: spaces.Plan, pods: dict[str, list[dict]]) -> list[dict]:
        spec, options = intent.spec, intent.options
        ns, name = intent.namespace, intent.name
        before = intent.status.get("spaces") or []
        now = status.format_time(dt.datetime.now(dt.timezone.utc))
        out = []
        for t in plan.tracks:
            live = self.kube.get("apps/v1", "Deployment", ns, t.name)
            track = spaces.Track(t.name, t.key, t.decl, live)
            available, want = track.ready
            role = "serving" if t is plan.serving else "candidate" if t is plan.spec else "previous"
            if role == "serving":  # since it first answered at the service's address: what the status remembers
                since = next((x.get("since") for x in before if x.get("key") == t.key and x.get("serving")), None)
                served = since or (now if track.up else None)
            else:
                served = track.annotation(spaces.ANNOTATION_RETIRED) if role == "previous" else None
            reindex = None
            if t is plan.spec and spec.migration.reindex is not None and plan.migrating:
                job = self._reindex_job(intent, t.key)
                reindex = f"Job {job['metadata']['name']}: {reindex_state(job)}" if job else "waits for the space"
            entry = {"key": t.key, "model": spaces.describe(t.decl), "deployment": t.name, "reindex": reindex,
                     "commit": track.annotation(ANNOTATION_MODEL_COMMIT),
                     "fingerprint": status.served_space(pods.get(t.name, [])), "ready": f"{available}/{want}",
                     "serving": t is plan.serving, "role": role, "since": served}
            if plan.migrating:
                entry["url"] = render.service_url(spaces.space_service_name(name, t.key), ns, spec, options)
                if spec.gateway is not None:
                    entry["gatewayPath"] = render.space_gateway_path(spec, t.key)
            out.append({k: v for k, v in entry.items() if v is not None})
        return out

    def _surge_refused(self, namespace: str, live: dict | None, desired: Callable[[], dict]) -> bool:
        """Whether a GPU/MIG Deployment's rollout to the template `desired()` renders must give an old replica's
        accelerator up first: it was found so before (the live annotation names this template), or the rollout is
        under way and a pod of it waits for an accelerator (the surge pod: no spare slice in the cluster). A new
        template starts with a surge again. A Deployment at rest without the annotation (the usual case) is
        answered without rendering."""
        if live is None:
            return False
        annotations = (live.get("metadata") or {}).get("annotations") or {}
        st, want = live.get("status") or {}, (live.get("spec") or {}).get("replicas") or 0
        # rolling: a surge pod beside the old ones, or old ones left (updatedReplicas counts pending pods too)
        rolling = (st.get("replicas") or 0) > want or (st.get("updatedReplicas") or 0) < want
        refused = annotations.get(render.ANNOTATION_SURGE_REFUSED)
        if not rolling and not refused:
            return False  # (a pod waiting for an accelerator now is a scale-up: Stalled says so)
        template = desired()["metadata"]["annotations"][render.ANNOTATION_TEMPLATE_HASH]
        if refused == template:
            return True
        if not rolling or annotations.get(render.ANNOTATION_TEMPLATE_HASH) != template:
            return False  # the rollout to this template has not started: try a surge first
        labels = (live.get("metadata") or {}).get("labels") or {}
        pods = self.kube.list("v1", "Pod", namespace, f"{render.LABEL_SERVICE}={labels.get(render.LABEL_SERVICE)}")
        track = labels.get(render.LABEL_INSTANCE)
        return any(status.waits_for_accelerator(p) for p in pods
                   if ((p.get("metadata") or {}).get("labels") or {}).get(render.LABEL_INSTANCE) == track)

    def _surge_refusal_unwritten(self, manifests: list[dict]) -> bool:
        dep = manifests[0]
        live = self.kube.get("apps/v1", "Deployment", dep["metadata"]["namespace"], dep["metadata"]["name"])
        have = ((live or {}).get("metadata") or {}).get("annotations") or {}
        return have.get(render.ANNOTATION_SURGE_REFUSED) != dep["metadata"]["annotations"].get(
            render.ANNOTATION_SURGE_REFUSED)

    def _own_deployment(self, intent: Intent, name: str) -> dict | None:
        live = self.kube.get("apps/v1", "Deployment", intent.namespace, name)
        if live is None or (apply.controller_of(live) or {}).get("uid") != intent.uid:
            return None  # none yet, or someone else's (a conflict the apply reports)
        return live

    def _choose(self, key: tuple[str, str], options: render.Options, live: dict | None, render_at,
                observed: status.Observed, which: str) -> render.Pin:
        choice = upgrades.choose(render_at, live, self._same_template)
        if choice.reason == upgrades.KEPT and options.pod_upgrades == "Roll":
            if self._grant_upgrade(key, options.max_concurrent_upgrades):
                log.info("%s/%s: rolling the %s's pods to %s", *key, which, upgrades.describe(choice))
                return choice.latest
            pending = upgrades.describe(choice)
            observed.pod_templates[which] = (choice.pin, f"{pending}: waiting for one of the "
                                             f"{options.max_concurrent_upgrades} upgrade slots")
            return choice.pin
        if choice.reason == upgrades.KEPT:
            observed.pod_templates[which] = (choice.pin, f"{upgrades.describe(choice)}: kept until the spec changes "
                                             "the pod template (the operator's pod upgrades are Keep)")
        return choice.pin

    def _same_template(self, desired: dict, live: dict) -> bool:
        """Whether `desired`'s pod template is what `live` runs, for a Deployment written before templates carried
        their hash: every rendered field is there, else the API server's dry-run of the apply says (quantities
        and defaults normalised) whether the template would change."""
        if apply.is_subset(desired["spec"]["template"], live["spec"]["template"]):
            return True
        try:
            preview = self.kube.apply(desired, dry_run=True)
        except ApiException as exc:
            if unavailable_reason(exc) is not None:
                raise
            return False
        return (preview.get("spec") or {}).get("template") == live["spec"]["template"]

    def _grant_upgrade(self, key: tuple[str, str], limit: int) -> bool:
        with self._guard:
            if key in self.upgrading:
                return True
            if len(self.upgrading) >= limit:
                self.awaiting_upgrade.add(key)
                return False
            self.awaiting_upgrade.discard(key)
            self.upgrading[key] = time.monotonic()
            return True

    def _release_upgrade(self, key: tuple[str, str], current: dict) -> None:
        """An upgrade slot is free once its service is Ready again; the services waiting for one are queued."""
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in current.get("conditions") or [])
        with self._guard:
            if key not in self.upgrading or not ready or current.get("observedGeneration") is None:
                return
            del self.upgrading[key]
            waiting = sorted(self.awaiting_upgrade)
        log.info("%s/%s: pod upgrade done", *key)
        if self.requeue is not None:
            for other in waiting:
                self.requeue(other)

    def _sweep_own_litellm(self, namespace: str, name: str) -> list[str]:
        """This service's entries in ConfigMaps it no longer names (litellm.configMapName changed or removed).
        Best effort: without list on ConfigMaps (RBAC older than the chart's) it logs instead of failing."""
        try:
            return litellm.sweep(self.kube, namespace, only=name)
        except ApiException as exc:
            if exc.status != 403:
                raise
            log.warning("%s/%s: cannot list ConfigMaps to remove stale LiteLLM entries: %s",
                        namespace, name, _api_message(exc))
            return []

    def _recheck(self, key: tuple[str, str], delay: float) -> None:
        """Reconcile `key` (status only) after `delay` s; one pending recheck per object, the earliest wins."""
        self.rechecks.call_later(key, delay, lambda: self._recheck_now(key), keep_earlier=True)

    def _reconcile_later(self, key: tuple[str, str], delay: float) -> None:
        """A full reconcile of `key` after `delay` s (a previous space's removal); the earliest pending one wins."""
        def now() -> None:
            if self.requeue is not None:
                self.requeue(key)
                return
            try:
                self.reconcile(*key)
            except Exception as exc:  # noqa: BLE001 - the resync loop retries
                if unavailable_reason(exc) is None:
                    log.exception("reconcile of %s/%s failed", *key)
        self.rechecks.call_later((*key, "reconcile"), delay, now, keep_earlier=True)

    def _recheck_now(self, key: tuple[str, str]) -> None:
        if self.requeue_status is not None:
            self.requeue_status(key)
            return
        try:
            self.reconcile(*key, apply_children=False)
        except Exception as exc:  # noqa: BLE001 - the resync loop retries
            if unavailable_reason(exc) is None:
                log.exception("status recheck of %s/%s failed", *key)

    def write_status(self, resource: dict, observed: status.Observed, options: render.Options,
                     intent: Intent | None = None) -> dict | None:
        """`intent`: the resource parsed (None: its spec did not parse, and the status says why)."""
        new = status.normalized(status.compute(resource, observed, options, stall_after=self.settings.stall_after_seconds,
                                               parsed=intent.es if intent is not None else None))
        if new == status.normalized(resource.get("status")):
            return None
        try:
            self.kube.patch_status(resource, new)
        except ApiException as exc:
            if exc.status == 404:  # deleted while this reconcile ran; its DELETED event cleans up
                return None
            raise
        return new

    def list_all(self) -> list[tuple[str, str]]:
        keys = []
        for ns in self.settings.namespaces or [None]:
            try:
                items = self.kube.list(API_VERSION, KIND, ns)
            except ApiException as exc:
                if exc.status != 404:
                    raise
                # the CRD is not installed (yet): nothing to resync; its watch picks services up once it is
                log.debug("no %s served yet", KIND)
                continue
            keys += [(item["metadata"]["namespace"], item["metadata"]["name"]) for item in items]
        return keys

    def sweep_litellm(self) -> None:
        """Entries of services deleted while the operator was down (or whose DELETED event was missed)."""
        for ns in self.settings.namespaces or [None]:
            try:
                litellm.sweep(self.kube, ns, hold=self._lock)
            except Exception as exc:  # noqa: BLE001 - retried next resync
                if unavailable_reason(exc) is None:
                    log.exception("LiteLLM sweep in %s failed", ns or "all namespaces")

    def forget(self, namespace: str, name: str, body: dict) -> None:
        key = (namespace, name)
        # Under the object's lock: a reconcile already past its read of the (then live) object would
        # otherwise re-apply the entry right after it was removed. Later reconciles find the object gone.
        with self._lock(key):
            config_map = ((body.get("spec") or {}).get("litellm") or {}).get("configMapName")
            if config_map:
                litellm.remove_entry(self.kube, namespace, config_map, name)
        with self._guard:
            self._locks.pop(key, None)
            self.awaiting_upgrade.discard(key)
            freed = self.upgrading.pop(key, None) is not None
            waiting = sorted(self.awaiting_upgrade) if freed else []
        for other in waiting:
            if self.requeue is not None:
                self.requeue(other)
        self.rechecks.cancel(key)
        self.rechecks.cancel((*key, "reconcile"))
