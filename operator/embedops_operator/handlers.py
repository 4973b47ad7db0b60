"""Thin kopf handlers: kopf runs the process (login, liveness, signals); controller.py does the watching.

Why the operator's own watch caches instead of kopf's event handlers: reconciles must read from memory, and
a cache must notice deletions that happened while its watch was away (kopf re-lists after a 410 but gives no
DELETED for objects gone in the gap, and does not tell handlers when a re-listing is complete). It also keeps
kopf from writing anything: its create/update handlers store progress and diff-base annotations on every
object and its timers add a finalizer. Without CRD scanning (it would need list/watch on CRDs and
namespaces) kopf never watches a kind whose CRD appears after start-up; the informers keep retrying quietly.
"""
from __future__ import annotations

import asyncio
import logging

import kopf

from . import apply
from .controller import Controller
from .settings import OperatorSettings

log = logging.getLogger("embedops.handlers")
_state: dict = {}


def configure(settings: OperatorSettings) -> None:
    """The settings `embedops-operator run` read (flags over variables), for the controller kopf starts below;
    without them (an operator embedded in a test), the controller reads its variables itself."""
    _state["settings"] = settings


@kopf.on.login()
def login(**_: object) -> kopf.ConnectionInfo:
    """The same credentials as the operator's own client (in-cluster, else $KUBECONFIG read at start)."""
    cfg = apply.Kube.configuration()
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
    settings.scanning.disabled = True
    settings.execution.max_workers = 8
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        # urllib3 warns on every retry of every request while the API server is away; the client's ApiHealth logs
        # one line per kind of failure instead
        logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)
    controller = Controller(apply.Kube(), _state.get("settings") or OperatorSettings())
    _state["controller"] = controller
    await asyncio.to_thread(controller.start)


@kopf.on.cleanup()
async def cleanup(**_: object) -> None:
    controller = _state.pop("controller", None)
    if controller:
        await asyncio.to_thread(controller.stop)
