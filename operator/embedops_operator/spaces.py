"""Vectors are state: a change of the embedding space never rolls in place (issue 36), and no fault moves the
address to a space that was not promoted (issue 52).

A *track* is one Deployment of the model server and the space its pods serve; its name is also its pods'
`app.kubernetes.io/instance` label, so each track's pods are selected apart. A service starts with one track named
after it. When the spec's space changes (what `declaration` reads: the model, revision, pooling, prompt,
quantization, input limit, the model volume), the spec's track is a new one, `<name>-<key>`, beside the one that
serves; the service's address (its Service's selector) moves to it only at promotion, at once, and the previous
track keeps running for `migration.keepPreviousSeconds` so that switching back is a rollback. Changes that keep the
space (replicas, batching, resources, the image) roll the spec's track in place as before.

Which track serves is recorded on the tracks' Deployments, not read back from the Service: a track that is made the
address's gets `embedops.dev/serving-epoch` (one more than any track's before) before the Service is written, and
the highest epoch serves. A Service deleted, recreated or edited by someone else is only output: the next reconcile
writes it from the record. A track that ever served keeps its epoch, so it is never mistaken for an abandoned
candidate and goes only `keepPreviousSeconds` after its retirement.

`plan()` is pure: from the spec's track, the live tracks and their records, the policy and the reindex Job's state,
it says which track serves, which are kept, which go, and what happened (events).
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
# on a track's Deployment, once it has served: the how-many-th track to serve the address it was (the highest serves)
# and since when. Written under their own field manager before the Service's selector moves, kept after retirement.
ANNOTATION_SERVING_EPOCH = "embedops.dev/serving-epoch"
ANNOTATION_SERVING_SINCE = "embedops.dev/serving-since"
# where plan() read which track serves (Plan.record)
RECORDED, FROM_SERVICE, FROM_STATUS, ONLY_TRACK, NEW, UNKNOWN = (
    "recorded", "service", "status", "only-track", "new", "unknown")


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
    def epoch(self) -> int | None:
        """Its serving epoch (None: it never served, or it served under an operator that kept no record)."""
        try:
            return int(self.annotation(ANNOTATION_SERVING_EPOCH) or "")
        except ValueError:
            return None

    @property
    def has_served(self) -> bool:
        """Recorded as having served the address: an epoch, or a retirement (older operators marked only that)."""
        return self.epoch is not None or self.annotation(ANNOTATION_RETIRED) is not None

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
    record: str = RECORDED  # where the serving track was read from (RECORDED, FROM_SERVICE, ..., UNKNOWN)
    epoch: int = 1  # the serving track's epoch once the reconcile has written its marks
    # replicas to give previous tracks: 0 once scaleDownPreviousAfterSeconds passed, the serving size for a rollback
    scale: dict[str, int] = field(default_factory=dict)
    next_change: float | None = None  # seconds until a previous track is scaled down or removed (no event says so)

    def later(self, seconds: float) -> None:
        self.next_change = seconds if self.next_change is None else min(self.next_change, seconds)


    @property
    def tracks(self) -> list[Track]:
        out = [self.serving] + ([self.spec] if self.spec is not self.serving else [])
        return out + [t for t in self.previous if t is not self.serving and t is not self.spec]


def plan(service: str, task: str, spec_decl: dict, live: list[dict], address: str | None,
         migration, reindex_state: str | None, now: dt.datetime, served: frozenset[str] = frozenset(),
         status_serving: str | None = None, foreign_address: bool = False) -> Plan:
    """Which track serves. `live`: the service's live model Deployments (any operator version's); `address`: the
    instance its Service's selector names now (None: no Service of its own); `migration`: spec.Migration;
    `reindex_state`: None, "running", "succeeded" or "failed: <why>" for the spec track's reindex Job; `served`:
    the keys of spaces that have answered at the service's address (the status remembers); `status_serving`: the key
    the status last said serves (read only where no Deployment carries a record); `foreign_address`: an object the
    operator did not create holds the Service's name (reported as a conflict, not repaired)."""
    spec_key = key_of(spec_decl)
    tracks = [Track(d["metadata"]["name"], key_of(declaration(d)), declaration(d), d) for d in live]
    by_name = {t.name: t for t in tracks}
    serving, record = serving_track(tracks, address, status_serving)
    if task not in MIGRATING_TASKS or not tracks:
        # in place: the serving track (or the service's own name) takes the spec, whatever its space
        name = serving.name if serving else service
        own = Track(name, spec_key, spec_decl, by_name[name].live if name in by_name else None)
        highest = max([t.epoch or 0 for t in tracks] or [0])
        return Plan(own, own, remove=[t for t in tracks if t.name != name], record=record,
                    epoch=own.epoch if own.epoch is not None and own.epoch == highest else highest + 1)
    mine = next((t for t in tracks if t.key == spec_key), None)
    spec = mine or Track(track_name(service, spec_key), spec_key, spec_decl)
    if spec.name in by_name and by_name[spec.name] is not mine:  # the name is held by another space's Deployment
        spec = Track(track_name(service, spec_key), spec_key, spec_decl)
    assert serving is not None  # tracks is not empty
    out = Plan(spec, serving, record=record)
    if record == RECORDED and address != serving.name and not foreign_address:
        # the address is output: whoever deleted or edited the Service, it is written back from the record
        what = f"selected {address}" if address else "was missing"
        out.events.append(("Warning", "AddressRepaired",
                           f"the service's Service {what}; it selects space {serving.key} ({describe(serving.decl)}, "
                           f"track {serving.name}) again, the space that serves since "
                           f"{serving.annotation(ANNOTATION_SERVING_SINCE) or 'its promotion'}"))
    elif record == UNKNOWN:
        held = ", ".join(f"{t.key} ({t.name})" for t in tracks if t is not serving)
        out.events.append(("Warning", "ServingUnknown",
                           f"no record says which space serves (no track carries {ANNOTATION_SERVING_EPOCH}, the "
                           f"Service selects none of them, the status names none): space {serving.key} "
                           f"({serving.name}, the oldest) serves; {held} are kept as previous spaces for "
                           f"migration.keepPreviousSeconds; name the right one in spec.migration.promote"))
    target, why = _promotion(out, migration, reindex_state, tracks, served)
    if target is not None and target is not serving:
        out.events.append(("Normal", "Promoted" if target is spec else "RolledBack",
                           f"space {target.key} ({describe(target.decl)}) now serves the service's address; "
                           f"space {serving.key} stops serving"))
        out.serving = target
    # why the spec's track does not serve yet, or why the track migration.promote names does not (a rollback waits)
    out.waiting = why if out.serving is not spec or (migration.promote and migration.promote != out.serving.key) \
        else None
    highest = max([t.epoch or 0 for t in tracks] or [0])
    current = out.serving.epoch
    out.epoch = current if current is not None and current == highest and \
        sum(1 for t in tracks if t.epoch == current) == 1 else highest + 1
    keep = timedelta(migration)
    for t in tracks:
        if t is out.serving or t is spec:
            continue
        retired = _time(t.annotation(ANNOTATION_RETIRED))
        if t is serving or t.has_served or record == UNKNOWN:
            # it serves no more (now, or before a crash let it be marked): kept for a rollback, retired if not yet;
            # with no record of what served, every other track is kept the same way rather than guessed abandoned
            if retired is not None and now - retired >= keep:
                out.remove.append(t)
                out.events.append(("Normal", "PreviousRemoved", f"space {t.key} ({describe(t.decl)}) removed "
                                                                  f"{int(keep.total_seconds())} s after it stopped "
                                                                  "serving"))
            else:
                out.previous.append(t)
                out.later((keep - (now - (retired or now))).total_seconds())
        else:
            out.remove.append(t)  # a candidate that never served: abandoned (the spec moved on)
            out.events.append(("Normal", "CandidateRemoved", f"space {t.key} ({describe(t.decl)}) never served and "
                                                               "the spec no longer asks for it"))
    out.migrating = len(out.tracks) > 1
    _size_previous(out, migration, now)
    return out


def _size_previous(out: Plan, migration, now: dt.datetime) -> None:
    """A previous track keeps the serving size for scaleDownPreviousAfterSeconds after its retirement, then runs no
    replica; one that migration.promote names (a rollback) gets the serving size back before the address moves."""
    serving_size = max(out.serving.ready[1], 1)
    after = dt.timedelta(seconds=migration.scale_down_previous_after_seconds)
    for t in out.previous:
        if t.live is None:
            continue
        retired = _time(t.annotation(ANNOTATION_RETIRED)) or now
        if migration.promote == t.key:
            want = max(t.ready[1], serving_size)
        elif now - retired >= after:
            want = 0
        else:
            out.later((after - (now - retired)).total_seconds())
            continue
        if t.ready[1] != want:
            out.scale[t.name] = want
            if want:
                out.waiting = (f"space {t.key} is named by migration.promote: scaled back to {want} replicas, it "
                               "serves the service's address once they are all available")
            out.events.append(("Normal", "PreviousScaled", (
                f"space {t.key} ({describe(t.decl)}) scaled to {want} replicas: " + (
                    "migration.promote names it; the address moves once they are available" if want else
                    f"{migration.scale_down_previous_after_seconds} s after it stopped serving (kept until "
                    f"keepPreviousSeconds; naming it in migration.promote scales it back first)"))))


def serving_track(tracks: list[Track], address: str | None, status_serving: str | None) -> tuple[Track | None, str]:
    """The track the address serves and where that was read. The record on the Deployments decides; the Service's
    selector, then the status, only for tracks written before records existed (an operator upgrade), and never
    when a Deployment carries a record; a lone track serves; several without any record: the oldest, said so."""
    marked = [t for t in tracks if t.epoch is not None]
    if marked:
        return max(marked, key=lambda t: (t.epoch, t.annotation(ANNOTATION_SERVING_SINCE) or "", t.name)), RECORDED
    if not tracks:
        return None, NEW
    by_name = {t.name: t for t in tracks}
    if address in by_name:
        return by_name[address], FROM_SERVICE
    from_status = next((t for t in tracks if status_serving and t.key == status_serving), None)
    if from_status is not None:
        return from_status, FROM_STATUS
    unretired = [t for t in tracks if t.annotation(ANNOTATION_RETIRED) is None]
    if len(tracks) == 1 or len(unretired) == 1 and all(t.has_served for t in tracks if t not in unretired):
        return (unretired or tracks)[0], ONLY_TRACK
    return sorted(unretired or tracks, key=_created)[0], UNKNOWN


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
