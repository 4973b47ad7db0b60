"""Thin kopf handlers. All logic lives in reconcile.py.

Why watch events instead of kopf's create/update/resume handlers and timers: those persist progress and
diff-base annotations on the EmbeddingService and timers add a finalizer, i.e. the operator would write to
every object on start-up and block deletion while it is down. Watch events (including the initial listing
on start-up) drive the same level-based reconcile, which writes nothing when nothing changed; a resync loop
corrects drift and picks up CRDs installed later.
"""
from __future__ import annotations

import asyncio
import logging

import kopf

from . import apply as A
from . import render as R
from . import spec as S
from .reconcile import Reconciler, Settings

log = logging.getLogger("embedops.handlers")
_state: dict = {}
MANAGED = {R.LABEL_MANAGED_BY: R.MANAGER}


def reconciler() -> Reconciler:
    if "reconciler" not in _state:
        _state["reconciler"] = Reconciler(A.Kube(), Settings.from_env())
    return _state["reconciler"]


@kopf.on.login()
def login(**_: object) -> kopf.ConnectionInfo:
    """The same credentials as the operator's own client (in-cluster, else $KUBECONFIG read at start)."""
    cfg = A.Kube.configuration()
    header = cfg.get_api_key_with_prefix("BearerToken") or cfg.get_api_key_with_prefix("authorization")
    parts = header.split(" ", 1) if header else []
    scheme, token = (None, None) if not parts else (None, parts[0]) if len(parts) == 1 else (parts[0], parts[1])
    return kopf.ConnectionInfo(server=cfg.host, ca_path=cfg.ssl_ca_cert, insecure=not cfg.verify_ssl,
                               scheme=scheme, token=token, certificate_path=cfg.cert_file,
                               private_key_path=cfg.key_file)


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, **_: object) -> None:
    settings.posting.level = logging.WARNING
    settings.peering.standalone = True
    # No cluster-wide CRD/namespace scanning: it would need list/watch on CRDs and namespaces. The
    # EmbeddingService CRD must exist when the operator starts (the chart installs it first).
    settings.scanning.disabled = True
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.execution.max_workers = 8
    rec = reconciler()

    async def loop() -> None:
        # Services deleted while the operator was down left their LiteLLM entries; no event will come.
        await asyncio.to_thread(rec.sweep_litellm)
        while True:
            await asyncio.sleep(rec.settings.resync_seconds)
            try:
                await asyncio.to_thread(rec.resync)
            except Exception:  # noqa: BLE001
                log.exception("resync failed")

    _state["resync"] = asyncio.get_running_loop().create_task(loop())


@kopf.on.cleanup()
async def cleanup(**_: object) -> None:
    task = _state.pop("resync", None)
    if task:
        task.cancel()
    _state.pop("reconciler", None)


@kopf.on.event(S.GROUP, S.VERSION, S.PLURAL)
def on_embedding_service(event: dict, body: kopf.Body, namespace: str, name: str, **_: object) -> None:
    if event.get("type") == "DELETED":
        reconciler().forget(namespace, name, dict(body))
        return
    reconciler().reconcile(namespace, name)


@kopf.on.event("apps", "v1", "deployments", labels=MANAGED)
@kopf.on.event("", "v1", "services", labels=MANAGED)
def on_owned_child(body: kopf.Body, namespace: str, **_: object) -> None:
    owner = (body.get("metadata", {}).get("labels") or {}).get(R.LABEL_SERVICE)
    if owner:  # drift on a child, or its status moved: re-apply and refresh status
        reconciler().reconcile(namespace, owner)


@kopf.on.event("", "v1", "pods", labels=MANAGED)
def on_pod(body: kopf.Body, namespace: str, **_: object) -> None:
    owner = (body.get("metadata", {}).get("labels") or {}).get(R.LABEL_SERVICE)
    if owner:
        reconciler().reconcile(namespace, owner, apply_children=False)
