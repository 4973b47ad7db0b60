"""Server-side apply of rendered children, with no write when nothing changed, and never onto an object the
operator did not create.

One field manager (`embedops`) for everything the operator owns. Before applying, the live object is
read: when it already carries the desired content hash and contains every desired field, nothing is sent.
Otherwise a server-side dry-run apply tells whether the real apply would change anything; only then is the
object written. A resync therefore never bumps a child's resourceVersion.

Ownership: a child is written only when no object of its name exists, or when the one that exists has the
EmbeddingService as its controller (the LiteLLM ConfigMap, shared by design: when it carries the opt-in label
`embedops.dev/litellm=true`). Anything else is a `Conflict`: left byte for byte as it is, reported in the
status, never pruned. The watch caches hold only objects labelled as the operator's, so "absent from the
cache" is confirmed by a read from the API server before anything is created, and the create itself is not
forced, so an object someone else creates in the moment between that read and the write conflicts (409)
instead of being taken over (controller-runtime's `AlreadyOwnedError`, Crossplane's `MustBeControllableBy`).
"""
from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from typing import Any, Iterable

from kubernetes.client.rest import ApiException

from . import kinds, litellm, metrics, render
from .runtime.client import Client

log = logging.getLogger("embedops.apply")

# The kinds the operator reads and writes, and the children it prunes (kinds.py, the one table of them)
PLURALS = kinds.PLURALS
OWNED_KINDS = kinds.OWNED
VOLATILE_META = ("managedFields", "resourceVersion", "generation", "creationTimestamp", "uid", "selfLink")


def is_subset(desired: Any, live: Any) -> bool:
    """Every field of `desired` is present with the same value in `live` (lists: same length, element-wise)."""
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(k in live and is_subset(v, live[k]) for k, v in desired.items())
    if isinstance(desired, list):
        return isinstance(live, list) and len(desired) == len(live) and all(
            is_subset(d, x) for d, x in zip(desired, live))
    if desired == live:
        return True
    return str(desired) == str(live)  # int-or-string fields, canonical quantities


def comparable(obj: dict) -> dict:
    out = {k: v for k, v in obj.items() if k != "status"}
    out["metadata"] = {k: v for k, v in (obj.get("metadata") or {}).items() if k not in VOLATILE_META}
    return out


class Kube(Client):
    """The operator's API client: the runtime's client naming the kinds the operator reads and writes, its
    field manager, its Events' source, and its request counter (embedops_operator_api_requests)."""

    plurals = PLURALS
    optional_kinds = kinds.OPTIONAL
    field_manager = render.MANAGER
    component = "embedops-operator"
    reporting_controller = "embedops.dev/operator"
    on_request = staticmethod(lambda verb, status: metrics.API_REQUESTS.labels(verb, status).inc())
    on_throttle = staticmethod(lambda seconds: metrics.API_THROTTLED.observe(seconds))


def needs_write(kube: Kube, desired: dict, manager: str = render.MANAGER, live: dict | None = None) -> bool:
    if live is None:
        meta = desired["metadata"]
        live = kube.get(desired["apiVersion"], desired["kind"], meta["namespace"], meta["name"])
    if live is None:
        return True
    want_hash = (desired["metadata"].get("annotations") or {}).get(render.ANNOTATION_HASH)
    live_hash = ((live.get("metadata") or {}).get("annotations") or {}).get(render.ANNOTATION_HASH)
    if want_hash == live_hash and is_subset(desired, live):
        return False
    preview = kube.apply(desired, manager=manager, dry_run=True)
    return comparable(preview) != comparable(live)


# The field manager that holds a Deployment's `spec.replicas` between the operator letting go of it (autoscaling
# turned on) and the autoscaler (HPA or KEDA's HPA) first writing it.
HANDOVER_MANAGER = "embedops-replicas-handover"


def owns_replicas(live: dict, manager: str) -> bool:
    """Whether ``manager`` owns ``spec.replicas`` of a live object by server-side apply."""
    for entry in (live.get("metadata") or {}).get("managedFields") or []:
        if entry.get("manager") == manager and entry.get("operation") == "Apply":
            if "f:replicas" in ((entry.get("fieldsV1") or {}).get("f:spec") or {}):
                return True
    return False


def hand_over_replicas(kube: Kube, desired: dict, live: dict | None, floor: int | None = None) -> bool:
    """Hand a Deployment's ``replicas`` to its autoscaler without the dip to 1.

    When autoscaling is turned on, the rendered Deployment stops carrying ``replicas``. Had the operator's
    manager been the field's only owner, that apply would remove the field and the API server would default
    it to 1: two of three running pods killed until the autoscaler acts (on GPUs, each back only after a model
    load). Kubernetes' documented way out (Server-Side Apply, "Transferring ownership"): first apply the live
    value under a temporary manager, then drop the field. The temporary manager keeps the value until the
    autoscaler first writes a different one, which takes the field from it; a conflict means the autoscaler
    already owns it, and nothing is needed. True when the hand-over was written.

    ``floor``: the HPA's minReplicas when an HPA is what scales the Deployment. An HPA never scales a target at
    zero replicas (its ScalingActive condition says "ScalingDisabled"), so a Deployment left at zero (by KEDA
    when the service scaled to zero, or by ``replicas: 0``) is raised to the floor under the same temporary
    manager, forced: whoever set the zero (KEDA) no longer scales it.
    """
    if desired["kind"] != "Deployment" or live is None or "replicas" in desired.get("spec", {}):
        return False
    running = (live.get("spec") or {}).get("replicas", 1)
    if floor and not running:
        replicas, force = floor, True
    elif owns_replicas(live, render.MANAGER):
        replicas, force = running, False
    else:
        return False
    meta = desired["metadata"]
    patch = {"apiVersion": desired["apiVersion"], "kind": desired["kind"],
             "metadata": {"name": meta["name"], "namespace": meta["namespace"]}, "spec": {"replicas": replicas}}
    try:
        kube.apply(patch, manager=HANDOVER_MANAGER, force=force)
    except ApiException as exc:
        if exc.status == 409:
            return False
        raise
    return True


@dataclass(frozen=True)
class Conflict:
    """A child the operator would write whose name is taken by an object it did not create."""
    kind: str
    name: str
    why: str

    def message(self) -> str:
        return f"{self.kind} {self.name} {self.why}"


@dataclass
class Applied:
    written: list[str] = field(default_factory=list)  # 'Kind/name' of what was written
    conflicts: list[Conflict] = field(default_factory=list)  # children left alone: not the operator's


def controller_of(obj: dict) -> dict | None:
    """The ownerReference marked `controller: true` (at most one, by the API's validation)."""
    return next((r for r in (obj.get("metadata") or {}).get("ownerReferences") or [] if r.get("controller")), None)


def ownership_conflict(desired: dict, live: dict | None) -> Conflict | None:
    """Why the operator may not write `desired` over `live`, or None when it may: nothing of that name exists,
    or what exists has the controller the operator renders (this EmbeddingService, by uid). The LiteLLM
    ConfigMap has no controller (it is shared, maybe the platform team's): it may be written when it carries
    the label `embedops.dev/litellm=true`, which the operator sets on the ConfigMaps it creates and a team sets
    on its own to opt it in."""
    if live is None:
        return None
    kind, name = desired["kind"], desired["metadata"]["name"]
    if kind == "ConfigMap":
        if ((live.get("metadata") or {}).get("labels") or {}).get(render.LABEL_LITELLM) == "true":
            return None
        return Conflict(kind, name, f"exists without the label {render.LABEL_LITELLM}=true (label it to let "
                                    "embedops write LiteLLM entries into it)")
    want, have = controller_of(desired), controller_of(live)
    if want is not None and have is not None and have.get("uid") == want.get("uid"):
        return None
    if have is None:
        return Conflict(kind, name, "exists and was not created by this EmbeddingService (it has no controller "
                                    "reference)")
    same = want is not None and have.get("kind") == want.get("kind") and have.get("name") == want.get("name")
    owner = f"{have.get('kind')} {have.get('name')}" + (f" (uid {have.get('uid')}, a deleted one of the same "
                                                       "name: the garbage collector removes it)" if same else "")
    return Conflict(kind, name, f"is controlled by {owner}, not by this EmbeddingService")


def read_for_write(kube: Kube, desired: dict) -> dict | None:
    """The live object of `desired`'s name, whoever created it. The watch caches hold only the operator's
    labelled objects, so a miss there is asked again of the API server: a foreign object of the same name
    (no labels) must be seen before anything is created."""
    meta = desired["metadata"]
    return kube.get_any(desired["apiVersion"], desired["kind"], meta["namespace"], meta["name"])


def create(kube: Kube, desired: dict, manager: str) -> tuple[dict | None, Conflict | None]:
    """Server-side apply of an object the API server just said was absent, not forced: an object of that name
    created by someone else since then makes the apply conflict (409) on the fields both set, and is then
    judged like any other live object instead of being taken over."""
    try:
        return kube.apply(desired, manager=manager, force=False), None
    except ApiException as exc:
        if exc.status != 409:
            raise
    live = kube.get_from_server(desired["apiVersion"], desired["kind"], desired["metadata"]["namespace"],
                                desired["metadata"]["name"])
    conflict = ownership_conflict(desired, live)
    if conflict is None:  # ours after all (our own earlier write): a plain apply settles it
        return kube.apply(desired, manager=manager), None
    return None, conflict


def create_service_at(kube: Kube, desired: dict, manager: str, cluster_ip: str) -> tuple[dict | None, Conflict | None]:
    """Create a Service asking for the cluster IP it had before (deleted by mistake: clients that resolved its name
    then reach it again); an address the API server refuses (taken since, outside the range) gives way to a new
    one. Only the creation names it: later applies leave it out, and the API server keeps an allocated IP that an
    update omits."""
    asked = copy.deepcopy(desired)
    asked["spec"]["clusterIP"] = cluster_ip
    try:
        return create(kube, asked, manager)
    except ApiException as exc:
        if exc.status != 422:
            raise
        log.warning("%s/%s: the cluster IP %s it had was refused (%s); created with a new one",
                    desired["metadata"]["namespace"], desired["metadata"]["name"], cluster_ip, exc.reason)
    return create(kube, desired, manager)


def apply_all(kube: Kube, manifests: Iterable[dict], service_name: str,
              cluster_ips: dict[str, str] | None = None) -> Applied:
    """Apply each manifest that differs from the cluster and belongs to the operator; the others are returned
    as conflicts, untouched. ``cluster_ips``: Service name -> the cluster IP to ask for if it must be created."""
    out = Applied()
    manifests = list(manifests)
    hpa_floor = next((m["spec"].get("minReplicas", 1) for m in manifests if m["kind"] == "HorizontalPodAutoscaler"),
                     None)
    for obj in manifests:
        # The shared LiteLLM ConfigMap gets one field manager per service, so services never remove
        # each other's keys.
        manager = litellm.manager(service_name) if obj["kind"] == "ConfigMap" else render.MANAGER
        meta = obj["metadata"]
        try:
            live = read_for_write(kube, obj)
            conflict = ownership_conflict(obj, live)
            if conflict is not None:
                out.conflicts.append(conflict)
                continue
            if hand_over_replicas(kube, obj, live, floor=hpa_floor):
                out.written.append(f"{obj['kind']}/{meta['name']} (replicas handed to the autoscaler)")
            wrote = live is None or needs_write(kube, obj, manager=manager, live=live)
            if wrote:
                if live is None:
                    ip = (cluster_ips or {}).get(meta["name"]) if obj["kind"] == "Service" else None
                    live, conflict = create_service_at(kube, obj, manager, ip) if ip else create(kube, obj, manager)
                    if conflict is not None:
                        out.conflicts.append(conflict)
                        continue
                else:
                    live = kube.apply(obj, manager=manager)
                out.written.append(f"{obj['kind']}/{meta['name']}")
        except ApiException as exc:
            exc.failed_object = obj  # the reconciler names what failed (a CRD removed since discovery)
            raise
        if obj["kind"] == "ConfigMap":  # a LiteLLM entry: the ConfigMap's index, then its proxies' restart
            indexed = litellm.sync_index(kube, live)
            if indexed is not None:
                out.written.append(f"ConfigMap/{meta['name']} (LiteLLM index)")
            if wrote or indexed is not None:
                out.written += litellm.restart_consumers(kube, meta["namespace"], meta["name"])
    return out


def prune(kube: Kube, resource: dict, desired: list[dict], capabilities: frozenset,
          keep: set[tuple[str, str]] = frozenset()) -> list[str]:
    """Delete children this EmbeddingService controls that are no longer rendered (e.g. HPA → ScaledObject).
    Only objects whose controller reference is this EmbeddingService (by uid) are candidates, whatever their
    labels say; the delete carries the object's uid as a precondition."""
    meta = resource["metadata"]
    uid, ns, name = meta.get("uid"), meta["namespace"], meta["name"]
    keep = {(o["kind"], o["metadata"]["name"]) for o in desired} | set(keep)
    selector = f"{render.LABEL_MANAGED_BY}={render.MANAGER},{render.LABEL_SERVICE}={name}"
    deleted = []
    for api_version, kind in OWNED_KINDS:
        if (api_version, kind) in kinds.OPTIONAL and (api_version, kind) not in capabilities:
            continue
        try:
            items = kube.list(api_version, kind, ns, selector)
        except ApiException as exc:
            if exc.status == 404:  # the CRD went away since discovery: nothing of that kind to prune
                continue
            raise
        for item in items:
            im = item["metadata"]
            owned = (controller_of(item) or {}).get("uid") == uid
            if uid and owned and (kind, im["name"]) not in keep:
                kube.delete(api_version, kind, ns, im["name"], uid=im.get("uid"))
                deleted.append(f"{kind}/{im['name']}")
    return deleted

