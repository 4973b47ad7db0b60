"""Entries in shared LiteLLM ConfigMaps: one data key per EmbeddingService, written by its own field manager.

The ConfigMap may belong to the user, so it carries no owner reference and the garbage collector never
removes an entry. The operator removes it: at once when it sees the service deleted, and in every resync for
entries whose service is gone or now writes to another ConfigMap (deleted while the operator was down,
`litellm.configMapName` changed). Which services have an entry is read from managedFields, not from key
names, so keys the user wrote are never touched.
"""
from __future__ import annotations

import logging

from . import render, spec

log = logging.getLogger("embedops.litellm")
MANAGER_PREFIX = f"{render.MANAGER}-litellm-"


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


def remove_entry(kube, namespace: str, config_map: str, service_name: str) -> None:
    """Apply an empty intent for the service's manager: the server drops exactly the fields it owned."""
    live = kube.get("v1", "ConfigMap", namespace, config_map)
    if live is None or (render.litellm_key(service_name) not in (live.get("data") or {})
                        and service_name not in entry_owners(live)):
        return
    kube.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": config_map, "namespace": namespace}},
               manager=manager(service_name))


def sweep(kube, namespace: str | None, only: str | None = None) -> list[str]:
    """Remove stale entries from labelled ConfigMaps in `namespace` (None: all). Returns 'cm/service' removed.

    Each candidate's EmbeddingService is read live just before removal, so one created since a list was taken
    keeps its entry. `only` limits the sweep to one service (its own reconcile).
    """
    removed = []
    for cm in kube.list("v1", "ConfigMap", namespace, f"{render.LABEL_LITELLM}=true"):
        meta = cm["metadata"]
        for service in sorted(entry_owners(cm)):
            if only is not None and service != only:
                continue
            if wanted_config_map(kube.get(spec.API_VERSION, spec.KIND, meta["namespace"], service)) == meta["name"]:
                continue
            remove_entry(kube, meta["namespace"], meta["name"], service)
            removed.append(f"{meta['namespace']}/{meta['name']}/{service}")
    if removed:
        log.info("removed stale LiteLLM entries: %s", removed)
    return removed
