"""Shared helpers for the operator unit tests."""
from __future__ import annotations

import copy
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"


def example(name: str) -> dict:
    return yaml.safe_load((EXAMPLES / name).read_text())


def es(spec: dict, name: str = "svc", namespace: str = "ml", uid: str | None = None, generation: int = 1,
       status: dict | None = None) -> dict:
    meta = {"name": name, "namespace": namespace, "generation": generation}
    if uid:
        meta["uid"] = uid
    out = {"apiVersion": "embedops.dev/v1alpha1", "kind": "EmbeddingService", "metadata": meta,
           "spec": copy.deepcopy(spec)}
    if status is not None:
        out["status"] = status
    return out


MIG = {"model": {"id": "BAAI/bge-m3"}, "accelerator": {"mig": {"profile": "1g.10gb"}}}
CPU = {"model": {"id": "sentence-transformers/all-MiniLM-L6-v2"},
       "accelerator": {"cpu": {"cores": 6, "memory": "6Gi", "instructionSets": ["amx_int8", "avx512_vnni"]}}}
GPU = {"model": {"id": "BAAI/bge-large-en-v1.5"}, "accelerator": {"gpu": {"count": 2, "product": "NVIDIA-L4"}}}


def by_kind(manifests: list[dict]) -> dict[str, dict]:
    """The first manifest of each kind (a service scaled to zero also renders its activator's Deployment and
    Service after its own)."""
    out: dict[str, dict] = {}
    for m in manifests:
        out.setdefault(m["kind"], m)
    return out


def container(manifests: list[dict]) -> dict:
    return by_kind(manifests)["Deployment"]["spec"]["template"]["spec"]["containers"][0]


def pod_spec(manifests: list[dict]) -> dict:
    return by_kind(manifests)["Deployment"]["spec"]["template"]["spec"]


def arg(c: dict, flag: str) -> str | None:
    args = c["args"]
    return args[args.index(flag) + 1] if flag in args else None
