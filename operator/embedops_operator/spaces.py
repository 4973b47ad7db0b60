"""Vectors are state: a change of the embedding space never rolls in place (issue 36).

A *track* is one Deployment of the model server and the space its pods serve; its name is also its pods'
`app.kubernetes.io/instance` label, so each track's pods are selected apart. A service starts with one track named
after it. When the spec's space changes (what `declaration` reads: the model, revision, pooling, prompt,
quantization, input limit, the model volume), the spec's track is a new one, `<name>-<key>`, beside the one that
serves; the service's address (its Service's selector) moves to it only at promotion, at once, and the previous
track keeps running for `migration.keepPreviousSeconds` so that switching back is a rollback. Changes that keep the
space (replicas, batching, resources, the image) roll the spec's track in place as before.

`plan()` is pure: from the spec's track, the live tracks, which one the address serves now, the policy and the
reindex Job's state, it says which track serves, which are kept, which go, and what happened (events).
"""
from __future__ import annotations

import datetime as dt
import hashlib
import json
from dataclasses import dataclass, field

# the server flags that decide the space (core/space.py measured what else does not: dtype, backend)
SPACE_FLAGS = ("--model-id", "--revision", "--pooling", "--default-prompt-name", "--default-prompt", "--quantize",
               "--max-input-length")
MIGRATING_TASKS = ("embed", "sparse")  # rerankers and classifiers store nothing: they roll in place
ANNOTATION_SPACE = "embedops.dev/space"  # on a track's Deployment: its key (what status and promote name)
ANNOTATION_RETIRED = "embedops.dev/retired-at"  # on a track's Deployment: when it stopped serving


def declaration(deployment: dict) -> dict:
    """What shapes a Deployment's vectors, read from its server container and its model volume: the same function
    for the spec (its rendered Deployment) and for a live Deployment, whichever operator version wrote it."""
    pod = deployment["spec"]["template"]["spec"]
    server = next((c for c in pod.get("containers") or [] if c.get("name") == "server"), None) or {}
    args = list(server.get("args") or [])
    out: dict = {}
    for i, flag in enumerate(args[:-1]):
        if flag in SPACE_FLAGS:
            out[flag.lstrip("-")] = args[i + 1]
    volume = next((v for v in pod.get("volumes") or [] if v.get("name") == "models"), None)
    if volume and volume.get("persistentVolumeClaim"):
        mount = next((m for m in server.get("volumeMounts") or [] if m.get("name") == "models"), {})
        out["volume"] = f"{volume['persistentVolumeClaim'].get('claimName')}:{mount.get('subPath', '')}"
    return out


def key_of(decl: dict) -> str:
    return hashlib.sha256(json.dumps(decl, sort_keys=True).encode()).hexdigest()[:8]


def describe(decl: dict) -> str:
    """'BAAI/bge-m3@abc123 (pooling cls, int8, 512 tokens)'"""
    head = decl.get("model-id", "?") + (f"@{decl['revision'][:12]}" if decl.get("revision") else "")
    extra = [f"pooling {decl['pooling']}" if decl.get("pooling") else "",
             f"prompt {decl.get('default-prompt-name') or json.dumps(decl['default-prompt'])}"
             if decl.get("default-prompt-name") or decl.get("default-prompt") else "",
             decl.get("quantize") or "", f"{decl['max-input-length']} tokens" if decl.get("max-input-length") else "",
             f"volume {decl['volume']}" if decl.get("volume") else ""]
    extra = [e for e in extra if e]
    return head + (f" ({', '.join(extra)})" if extra else "")


def track_name(service: str, key: str) -> str:
    """A new track's Deployment (and pod instance label, at most 63 characters): `<service>-<key>`."""
    return f"{service[:54]}-{key}"


def space_service_name(service: str, key: str) -> str:
    """The Service every track gets during a migration: the space's own address."""
    return f"{service[:54]}-{key}"


@dataclass
class Track:
    name: str  # its Deployment and its pods' instance label
    key: str
    decl: dict
    live: dict | None = None  # its live Deployment (None: not created yet)

    def annotation(self, key: str) -> str | None:
        return (((self.live or {}).get("metadata") or {}).get("annotations") or {}).get(key)

    @property
    def ready(self) -> tuple[int, int]:
        """(available, desired) replicas of its live Deployment."""
        if self.live is None:
            return 0, 0
        st, want = self.live.get("status") or {}, (self.live.get("spec") or {}).get("replicas", 1)
        updated = st.get("updatedReplicas", 0) >= want and st.get("observedGeneration", 0) >= \
            self.live["metadata"].get("generation", 0)
        return (st.get("availableReplicas", 0) if updated else 0), want

    @property
    def up(self) -> bool:
        available, want = self.ready
        return self.live is not None and want > 0 and available >= want


@dataclass
class Plan:
    spec: Track  # rendered from the spec
    serving: Track  # what the service's address answers from
    previous: list[Track] = field(default_factory=list)  # kept for a rollback, with when they stopped serving
    remove: list[Track] = field(default_factory=list)  # abandoned candidates and previous tracks past their time
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)
    waiting: str | None = None  # why the spec's track does not serve yet
    migrating: bool = False  # more than one track runs: each gets its own Service

    @property
    def tracks(self) -> list[Track]:
        out = [self.serving] + ([self.spec] if self.spec is not self.serving else [])
        return out + [t for t in self.previous if t is not self.serving and t is not self.spec]


def plan(service: str, task: str, spec_decl: dict, live: list[dict], serving_name: str | None,
         migration, reindex_state: str | None, now: dt.datetime, served: frozenset[str] = frozenset()) -> Plan:
    """Which track serves. `live`: the service's live model Deployments (any operator version's); `serving_name`:
    the instance its Service's selector names now (None: no Service yet); `migration`: spec.Migration;
    `reindex_state`: None, "running", "succeeded" or "failed: <why>" for the spec track's reindex Job; `served`:
    the keys of spaces that have answered at the service's address (the status remembers)."""
    spec_key = key_of(spec_decl)
    tracks = [Track(d["metadata"]["name"], key_of(declaration(d)), declaration(d), d) for d in live]
    by_name = {t.name: t for t in tracks}
    serving = by_name.get(serving_name or "")
    if task not in MIGRATING_TASKS or not tracks:
        # in place: the serving track (or the service's own name) takes the spec, whatever its space
        name = serving.name if serving else (service if service in by_name or not tracks else tracks[0].name)
        own = Track(name, spec_key, spec_decl, by_name.get(name))
        return Plan(own, own, remove=[t for t in tracks if t.name != name])
    mine = next((t for t in tracks if t.key == spec_key), None)
    spec = mine or Track(track_name(service, spec_key), spec_key, spec_decl)
    if spec.name in by_name and by_name[spec.name] is not mine:  # the name is held by another space's Deployment
        spec = Track(track_name(service, spec_key), spec_key, spec_decl)
    if serving is None:  # no Service yet, or it selects none of them: the spec's track (if it runs), else the oldest
        serving = mine if mine is not None else sorted(tracks, key=_created)[0]
    out = Plan(spec, serving)
    target, why = _promotion(out, migration, reindex_state, tracks, served)
    if target is not None and target is not serving:
        out.events.append(("Normal", "Promoted" if target is spec else "RolledBack",
                           f"space {target.key} ({describe(target.decl)}) now serves the service's address; "
                           f"space {serving.key} stops serving"))
        out.serving = target
    out.waiting = why if out.serving is not spec else None
    keep = timedelta(migration)
    for t in tracks:
        if t is out.serving or t is spec:
            continue
        retired = _time(t.annotation(ANNOTATION_RETIRED))
        if t is serving:  # it stopped serving in this reconcile
            out.previous.append(t)
        elif retired is None:
            out.remove.append(t)  # a candidate that never served: abandoned (the spec moved on)
            out.events.append(("Normal", "CandidateRemoved", f"space {t.key} ({describe(t.decl)}) never served and "
                                                               "the spec no longer asks for it"))
        elif retired is not None and now - retired >= keep:
            out.remove.append(t)
            out.events.append(("Normal", "PreviousRemoved", f"space {t.key} ({describe(t.decl)}) removed "
                                                              f"{int(keep.total_seconds())} s after it stopped serving"))
        else:
            out.previous.append(t)
    out.migrating = len(out.tracks) > 1
    return out


def timedelta(migration) -> dt.timedelta:
    return dt.timedelta(seconds=migration.keep_previous_seconds)


def _promotion(p: Plan, migration, reindex_state: str | None, tracks: list[Track],
               served: frozenset[str]) -> tuple[Track | None, str | None]:
    """The track that should serve now, and why the spec's track does not (when it does not)."""
    spec, serving = p.spec, p.serving
    if migration.promote:
        named = next((t for t in tracks + [spec] if t.key == migration.promote), None)
        if named is None:
            return serving, (f"migration.promote names space {migration.promote}, which does not run (spaces: "
                             f"{', '.join(sorted({t.key for t in tracks + [spec]}))})")
        if named is serving:
            return serving, (None if named is spec else f"migration.promote keeps space {named.key} serving")
        if not named.up:
            return serving, f"space {named.key} is named by migration.promote but is not ready yet ({_ready(named)})"
        return named, None
    if spec is serving:
        return serving, None
    if not spec.up:
        return serving, f"the new space {spec.key} is starting ({_ready(spec)})"
    if serving.key not in served and not serving.up:
        return spec, None  # the serving track never answered: no index can hold its vectors
    if migration.promotion == "Immediate":
        return spec, None
    if migration.promotion == "AfterReindex":
        if reindex_state == "succeeded":
            return spec, None
        if reindex_state and reindex_state.startswith("failed"):
            return serving, f"the reindex Job into space {spec.key} {reindex_state}; space {serving.key} keeps serving"
        return serving, f"the reindex Job into space {spec.key} is {reindex_state or 'starting'}"
    return serving, (f"space {spec.key} is ready at its own address; set spec.migration.promote: \"{spec.key}\" to "
                     f"serve it at the service's address (space {serving.key} serves until then)")


def _ready(t: Track) -> str:
    available, want = t.ready
    return f"{available}/{want} replicas available"


def _created(t: Track) -> str:
    return ((t.live or {}).get("metadata") or {}).get("creationTimestamp") or ""


def _time(value: str | None) -> dt.datetime | None:
    if not value:
        return None
    try:
        return dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
