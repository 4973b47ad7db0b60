"""The CRD is generated from the pydantic models; crds/ and the chart hold identical copies."""
from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from embedops_operator import spec as S
from tests.unit.operator_helpers import REPO

CRD_FILE = REPO / "crds" / "embedops.dev_embeddingservices.yaml"
CHART_CRD = REPO / "charts" / "embedops-operator" / "crds" / "embedops.dev_embeddingservices.yaml"
FIX = "regenerate with: embedops-operator crd > crds/embedops.dev_embeddingservices.yaml (and copy to the chart)"


@pytest.mark.parametrize("path", [CRD_FILE, CHART_CRD], ids=["crds", "chart"])
def test_crd_files_match_code(path):
    assert yaml.safe_load(path.read_text()) == S.crd(), f"{path} drifted from the code; {FIX}"


def test_crd_command_prints_the_generated_crd():
    out = subprocess.run([sys.executable, "-m", "embedops_operator.cli", "crd"], capture_output=True, text=True,
                         check=True, cwd=REPO, env={"PYTHONPATH": str(REPO / "operator")})
    assert yaml.safe_load(out.stdout) == S.crd()
    assert out.stdout == CRD_FILE.read_text()


def _walk(node, path="$"):
    yield path, node
    for key, sub in (node.get("properties") or {}).items():
        yield from _walk(sub, f"{path}.{key}")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}{{}}")


def test_schema_is_structural():
    schema = S.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(schema):
        # int-or-string fields are structural without a type (Kubernetes' structural schema rules)
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields") or \
            node.get("x-kubernetes-int-or-string"), path
        for banned in ("$ref", "anyOf", "oneOf", "allOf", "nullable", "title", "$defs"):
            assert banned not in node, f"{path} has {banned}"


def test_names_subresources_and_columns():
    crd = S.crd()
    assert crd["metadata"]["name"] == "embeddingservices.embedops.dev"
    assert crd["spec"]["names"]["shortNames"] == ["embsvc"]
    assert crd["spec"]["scope"] == "Namespaced"
    version = crd["spec"]["versions"][0]
    assert version["name"] == "v1alpha1"
    assert version["subresources"] == {"status": {}, "scale": {
        "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector"}}
    cols = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert list(cols)[:6] == ["Model", "Task", "Accelerator", "Replicas", "URL", "Ready"]
    assert cols["Ready"] == '.status.conditions[?(@.type=="Ready")].status'
    assert cols["Age"] == ".metadata.creationTimestamp"


def test_defaults_and_enums_in_schema():
    spec = S.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    props = spec["properties"]
    assert props["replicas"]["default"] == 1
    assert props["batching"]["default"] == {}
    assert props["batching"]["properties"]["maxBatchTokens"]["default"] == 16384
    assert props["batching"]["properties"]["autoTruncate"]["default"] is True
    assert props["model"]["properties"]["task"]["enum"] == ["embed", "rerank", "classify", "sparse"]
    mig = props["accelerator"]["properties"]["mig"]
    assert "1g.18gb" in mig["properties"]["profile"]["enum"]
    assert mig["properties"]["strategy"]["default"] == "mixed"
    status = S.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    assert status["default"] == {"observedGeneration": 0}  # a new object is InProgress for kstatus
    conds = status["properties"]["conditions"]
    assert conds["x-kubernetes-list-type"] == "map" and conds["x-kubernetes-list-map-keys"] == ["type"]


def test_every_cel_rule_compiles():
    import celpy

    env = celpy.Environment()
    schema = S.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    rules = [r for _, node in _walk(schema) for r in node.get("x-kubernetes-validations", [])]
    assert len(rules) >= 8
    for rule in rules:
        env.compile(rule["rule"])
        if "messageExpression" in rule:
            env.compile(rule["messageExpression"])
        assert rule.get("message") or rule.get("messageExpression")


def test_mig_profile_tables_are_the_published_ones():
    assert S.MIG_PROFILES["H100-80GB"] == ["1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"]
    assert S.MIG_PROFILES["H200-141GB"] == ["1g.18gb", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"]
    assert S.MIG_PROFILES["A100-40GB"][0] == "1g.5gb"
    assert S.MIG_PROFILES["A30-24GB"] == ["1g.6gb", "2g.12gb", "4g.24gb"]
