"""Entries in shared LiteLLM ConfigMaps: one data key per EmbeddingService, written by its own field manager.

The ConfigMap may belong to the user, so it carries no owner reference and the garbage collector never
removes an entry. The operator removes it: at once when it sees the service deleted, and in every resync for
entries whose service is gone or now writes to another ConfigMap (deleted while the operator was down,
`litellm.configMapName` changed). Which services have an entry is read from managedFields, not from key
names, so keys the user wrote are never touched.

LiteLLM's config `include` names files, it cannot glob, so a ConfigMap that holds entries also gets an index,
`embedops.yaml` (never an entry's key: those are `embedops-<name>.yaml`), written by its own field manager:
`include:` the entry files, in name order. A LiteLLM config includes that one file and picks up every
service's entry (docs/operator.md). The index stays, with an empty list, after the last entry goes: a config
including it must keep loading.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging

from kubernetes.client.rest import ApiException

from . import render, spec

log = logging.getLogger("embedops.litellm")
MANAGER_PREFIX = f"{render.MANAGER}-litellm-"
INDEX_KEY = "embedops.yaml"
# Outside MANAGER_PREFIX ("_" is in no object name): "embedops-litellm-index" would be the manager of a
# service named "index", and the index's apply would take that service's entry away
INDEX_MANAGER = f"{render.MANAGER}-litellm_index"
LABEL_CONSUMER = "embedops.dev/litellm-config"  # on a LiteLLM Deployment: the ConfigMap it mounts
ANNOTATION_HASH = "embedops.dev/litellm-config-hash"  # on its pod template: embedops' entries there
RESTART_MANAGER = f"{render.MANAGER}-litellm_restart"


def manager(service_name: str) -> str:
    return MANAGER_PREFIX + service_name


def entry_owners(config_map: dict) -> set[str]:
    """Services whose field manager owns their data key in this ConfigMap."""
    owners = set()
    for mf in (config_map.get("metadata") or {}).get("managedFields") or []:
        who = mf.get("manager") or ""
        if not who.startswith(MANAGER_PREFIX) or mf.get("operation") != "Apply":
            continue
        name = who[len(MANAGER_PREFIX):]
        if f"f:{render.litellm_key(name)}" in ((mf.get("fieldsV1") or {}).get("f:data") or {}):
            owners.add(name)
    return owners


def wanted_config_map(resource: dict | None) -> str | None:
    """The ConfigMap an EmbeddingService's entry belongs in now; None when it should have none."""
    if resource is None or resource["metadata"].get("deletionTimestamp"):
        return None
    return ((resource.get("spec") or {}).get("litellm") or {}).get("configMapName")


def index_text(entry_keys) -> str:
    """The index: LiteLLM's `include` of every entry file (relative paths: the index's own folder)."""
    keys = sorted(entry_keys)
    return ("# Managed by embedops: every EmbeddingService entry in this ConfigMap. Include this file from\n"
            "# LiteLLM's config; it is rewritten as services come and go.\n"
            + ("include:\n" + "".join(f"- {k}\n" for k in keys) if keys else "include: []\n"))


def sync_index(kube, live: dict | None, attempts: int = 3) -> dict | None:
    """Make the ConfigMap's index list exactly its entries. ``live`` is the ConfigMap as last read or written.
    The write carries its resourceVersion, so an entry added meanwhile by another service's reconcile is
    never dropped: on a conflict the ConfigMap is read again (from the API server) and the index recomputed.
    Returns the ConfigMap as written, None when the index was already right."""
    for _ in range(attempts):
        if live is None:
            return None
        data = live.get("data") or {}
        owners = entry_owners(live)
        keys = [render.litellm_key(s) for s in owners if render.litellm_key(s) in data]
        if not keys and INDEX_KEY not in data:
            return None  # never held an entry: nothing to index
        text = index_text(keys)
        if data.get(INDEX_KEY) == text:
            return None
        meta = live["metadata"]
        try:
            return kube.apply({"apiVersion": "v1", "kind": "ConfigMap",
                               "metadata": {"name": meta["name"], "namespace": meta["namespace"],
                                            "resourceVersion": meta["resourceVersion"],
                                            "labels": {render.LABEL_LITELLM: "true"}},
                               "data": {INDEX_KEY: text}}, manager=INDEX_MANAGER)
        except ApiException as exc:
            if exc.status != 409:
                raise
            live = getattr(kube, "kube", kube).get("v1", "ConfigMap", meta["namespace"], meta["name"])
    log.warning("LiteLLM index of %s/%s: still conflicting after %d attempts; the next reconcile retries",
                (live or {}).get("metadata", {}).get("namespace"), (live or {}).get("metadata", {}).get("name"),
                attempts)
    return None


def config_hash(live: dict) -> str:
    """What a LiteLLM proxy reads of embedops in this ConfigMap: the entries and the index."""
    data = live.get("data") or {}
    ours = {k: v for k, v in data.items() if k == INDEX_KEY or k.startswith("embedops-")}
    return hashlib.sha256(json.dumps(ours, sort_keys=True).encode()).hexdigest()[:16]


def restart_consumers(kube, namespace: str, config_map: str, attempts: int = 5) -> list[str]:
    """LiteLLM reads its config at start only. Deployments labelled ``embedops.dev/litellm-config: <this
    ConfigMap>`` (the LiteLLM proxy's, which a platform team labels) get the hash of embedops' entries in their
    pod template, so a changed entry set rolls them out (a Deployment's usual rolling update, under the
    manager embedops-litellm_restart, which owns only that annotation). Returns the Deployments written.

    The hash is of the ConfigMap as the API server has it now, and after a write it is read once more. Two
    writers can race (a service's reconcile and the resync's sweep of the same entry, each writing the index
    or the restart): one holding a version another has since replaced would otherwise leave the older hash
    last, and the proxy pods would carry a hash no ConfigMap has (once seen in CI: the rollout the test
    waited for never came). Whoever wrote last checks and writes again."""
    raw = getattr(kube, "kube", kube)  # not the operator's caches: they hold only its own Deployments
    written: list[str] = []
    current = raw.get("v1", "ConfigMap", namespace, config_map)
    for _ in range(attempts):
        if current is None:
            return written
        digest = config_hash(current)
        wrote = []
        for d in raw.list("apps/v1", "Deployment", namespace, f"{LABEL_CONSUMER}={config_map}"):
            template = ((d.get("spec") or {}).get("template") or {}).get("metadata") or {}
            if (template.get("annotations") or {}).get(ANNOTATION_HASH) == digest:
                continue
            raw.apply({"apiVersion": "apps/v1", "kind": "Deployment",
                       "metadata": {"name": d["metadata"]["name"], "namespace": namespace},
                       "spec": {"template": {"metadata": {"annotations": {ANNOTATION_HASH: digest}}}}},
                      manager=RESTART_MANAGER)
            wrote.append(f"Deployment/{d['metadata']['name']}")
        if wrote:
            log.info("%s/%s: LiteLLM entries changed; rolling %s", namespace, config_map, wrote)
            written += [w for w in wrote if w not in written]
        else:
            return written  # nothing of ours went out: whatever hash is there, its writer checks it
        current = raw.get("v1", "ConfigMap", namespace, config_map)
        if current is None or config_hash(current) == digest:
            return written
    log.warning("%s/%s: LiteLLM entries still changing after %d restarts; the next change rolls the proxies again",
                namespace, config_map, attempts)
    return written


def remove_entry(kube, namespace: str, config_map: str, service_name: str) -> None:
    """Apply an empty intent for the service's manager: the server drops exactly the fields it owned; then
    the index follows."""
    live = kube.get("v1", "ConfigMap", namespace, config_map)
    if live is None or (render.litellm_key(service_name) not in (live.get("data") or {})
                        and service_name not in entry_owners(live)):
        return
    after = kube.apply({"apiVersion": "v1", "kind": "ConfigMap",
                        "metadata": {"name": config_map, "namespace": namespace}}, manager=manager(service_name))
    sync_index(kube, after)
    restart_consumers(kube, namespace, config_map)


def sweep(kube, namespace: str | None, only: str | None = None, hold=None) -> list[str]:
    """Remove stale entries from labelled ConfigMaps in `namespace` (None: all). Returns 'cm/service' removed.

    Each candidate's EmbeddingService is read live just before removal, so one created since a list was taken
    keeps its entry. `only` limits the sweep to one service (its own reconcile). `hold((namespace, service))`,
    when given, is the service's reconcile lock: the resync's sweep takes it around each removal, so it never
    writes the same entry and index as that service's reconcile at the same moment.
    """
    removed = []
    for cm in kube.list("v1", "ConfigMap", namespace, f"{render.LABEL_LITELLM}=true"):
        meta = cm["metadata"]
        for service in sorted(entry_owners(cm)):
            if only is not None and service != only:
                continue
            with hold((meta["namespace"], service)) if hold is not None else contextlib.nullcontext():
                if wanted_config_map(kube.get(spec.API_VERSION, spec.KIND, meta["namespace"], service)) == meta["name"]:
                    continue
                remove_entry(kube, meta["namespace"], meta["name"], service)
            removed.append(f"{meta['namespace']}/{meta['name']}/{service}")
    if removed:
        log.info("removed stale LiteLLM entries: %s", removed)
    return removed


def model_name_clashes(live: dict | None, desired: dict, service: str) -> list[str]:
    """The model names of `desired` (this service's entry in a shared LiteLLM ConfigMap) that another service's
    entry in the live ConfigMap already serves: LiteLLM would load-balance one name over two services, maybe two
    embedding spaces, and nothing would say so (issue 53). The entry that was there first keeps the name."""
    import yaml

    litellm_key = render.litellm_key
    mine = {e.get("model_name") for e in (yaml.safe_load(desired["data"][litellm_key(service)]) or {})
            .get("model_list") or []}
    out = []
    for key, text in sorted(((live or {}).get("data") or {}).items()):
        if key == litellm_key(service) or not key.startswith("embedops-") or key == INDEX_KEY:
            continue
        try:
            theirs = {e.get("model_name") for e in (yaml.safe_load(text) or {}).get("model_list") or []}
        except yaml.YAMLError:
            continue
        for clash in sorted(mine & theirs):
            other = key.removeprefix("embedops-").removesuffix(".yaml")
            out.append(f"LiteLLM model name {clash!r} is served by EmbeddingService {other} in ConfigMap "
                       f"{desired['metadata']['name']}: this service's entries are not written (LiteLLM would "
                       "balance one name over both); give litellm.modelName another value")
    return out
