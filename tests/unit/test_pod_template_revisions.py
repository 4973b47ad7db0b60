"""Upgrade safety: the pod templates the operator renders at each template revision never change.

A running service's pods are replaced when its spec asks for it, never because the operator was upgraded
(render.TEMPLATE_REVISION, docs/operator.md "Operator upgrades"). So every change to what the operator itself puts
into a pod template ships behind a new revision, and the templates of the revisions before it stay exactly what
they were: the Deployments of services that keep their revision are rendered with it, byte for byte.

`pod_templates/r<N>.json` holds what revision N renders for the cases below; this test renders them again.
A failure here means a change reached an existing revision's template, which would roll every running service
on upgrade: gate it behind `revision >= <a new revision>` instead. After adding a revision, write its file:
`python -m tests.unit.test_pod_template_revisions` (writes the latest revision's file, never an older one).
"""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

from embedops_operator import render as R
from embedops_operator.validate import defaulted
from tests.unit.operator_helpers import CPU, GPU, MIG, es, example

GOLDEN = Path(__file__).parent / "pod_templates"
SCALE_TO_ZERO = {**CPU, "autoscaling": {"minReplicas": 0, "maxReplicas": 2}}
DOWNLOAD = {**MIG, "model": {"id": "BAAI/bge-m3", "revision": "5617a9f61b028005a4858fdac845db406aefb181",
                              "source": {"download": {"hfTokenSecretRef": {"name": "hf"}}}},
            "apiKeySecretRef": {"name": "key"}}
CPU_DOWNLOAD_INT8 = {**CPU, "model": {"id": "BAAI/bge-m3", "quantize": "int8", "source": {"download": {}}},
                     "apiKeySecretRef": {"name": "key", "key": "token"}, "env": [{"name": "LOG_LEVEL", "value": "debug"}]}
# a spec field a revision introduced: its case is rendered from that revision on (older files never held it)
CPU_LANES = {**CPU, "lanes": {"enabled": True, "default": "batch", "batchService": True}}
# an estimated CPU limit that counts /embed_all's answers (revision 6)
CPU_FLOAT32_BGE_M3 = {"model": {"id": "BAAI/bge-m3", "maxInputLength": 512}, "accelerator": {"cpu": {"cores": 4}},
                      "batching": {"maxBatchTokens": 8192}}
SINCE = {"cpu-lanes": 3, "cpu-float32-bge-m3": 6}


def cases(revision: int) -> dict[str, dict]:
    """EmbeddingServices whose templates together use every branch of the pod template (at `revision`)."""
    out = {name: defaulted(example(name)) for name in (
        "mig-embedder.yaml", "mig-reranker.yaml", "cpu-ingestion.yaml", "bge-m3-cpu-ingestion.yaml")}
    for name, spec in (("gpu", GPU), ("mig", MIG), ("cpu", CPU), ("cpu-scale-to-zero", SCALE_TO_ZERO),
                       ("mig-download-api-key", DOWNLOAD), ("cpu-download-int8", CPU_DOWNLOAD_INT8),
                       ("cpu-lanes", CPU_LANES), ("cpu-float32-bge-m3", CPU_FLOAT32_BGE_M3)):
        if revision >= SINCE.get(name, 0):
            out[name] = defaulted(es(copy.deepcopy(spec), name="svc", uid="u"))
    return out


def templates(revision: int) -> dict[str, dict[str, dict]]:
    """case -> Deployment name -> its pod template, rendered at `revision` with the default options."""
    out = {}
    for case, resource in cases(revision).items():
        manifests = R.render(resource, R.Options(), R.Pins.at(revision))
        out[case] = {m["metadata"]["name"]: m["spec"]["template"] for m in manifests if m["kind"] == "Deployment"}
    return out


def golden(revision: int) -> dict:
    return json.loads((GOLDEN / f"r{revision}.json").read_text())


@pytest.mark.parametrize("revision", range(R.TEMPLATE_REVISION + 1))
def test_a_revision_renders_the_templates_it_always_rendered(revision):
    path = GOLDEN / f"r{revision}.json"
    assert path.exists(), f"no {path.name}: run `python -m tests.unit.test_pod_template_revisions`"
    want, have = golden(revision), templates(revision)
    assert sorted(have) == sorted(want)
    for case in want:
        assert have[case] == want[case], (
            f"revision {revision}'s pod template of {case} changed: running services at that revision would all "
            f"roll on upgrade; put the change behind a new revision (render.TEMPLATE_REVISION)")


def test_each_revision_is_described_and_differs_from_the_one_before():
    assert sorted(R.TEMPLATE_REVISIONS) == list(range(R.TEMPLATE_REVISION + 1))
    for revision in range(1, R.TEMPLATE_REVISION + 1):
        assert golden(revision) != golden(revision - 1), f"revision {revision} renders what {revision - 1} did"


if __name__ == "__main__":
    revision = R.TEMPLATE_REVISION
    path = GOLDEN / f"r{revision}.json"
    if path.exists() and "--force" not in sys.argv:
        sys.exit(f"{path} exists; an existing revision's templates never change (--force only while it is unreleased)")
    path.write_text(json.dumps(templates(revision), indent=1, sort_keys=True) + "\n")
    print(f"wrote {path}")
