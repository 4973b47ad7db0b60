"""model.outputs (bge-m3 layout: dense, sparse, colbert): CRD schema and CEL refusals, HTTPRoute paths."""
from __future__ import annotations

import copy

import pytest

from embedops_operator import render as R
from embedops_operator import spec as S
from embedops_operator.validate import validate
from tests.unit.operator_helpers import MIG, by_kind, es


def _spec(**model) -> dict:
    spec = copy.deepcopy(MIG)
    spec["model"].update(model)
    spec["gateway"] = {"parentRefs": [{"name": "gw"}], "allowUnauthenticated": True}
    return spec


def _paths(spec: dict) -> list[str]:
    route = by_kind(R.render(es(spec)))["HTTPRoute"]
    return [r["matches"][0]["path"]["value"] for r in route["spec"]["rules"]]


def test_outputs_in_the_crd():
    model = S.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["model"]
    out = model["properties"]["outputs"]
    assert out["items"]["enum"] == ["dense", "sparse", "colbert"]
    assert out["x-kubernetes-list-type"] == "set" and out["minItems"] == 1


def test_valid_outputs():
    assert validate(es(_spec(outputs=["dense", "sparse", "colbert"]))) == []
    assert validate(es(_spec(task="embed", outputs=["sparse"]))) == []


@pytest.mark.parametrize("model", [
    {"task": "rerank"}, {"task": "sparse"}, {"task": "classify"},
    {"id": "BAAI/bge-reranker-v2-m3"}, {"id": "naver/splade-cocondenser-ensembledistil"},
    {"id": "cross-encoder/ms-marco-MiniLM-L-6-v2"}])
def test_outputs_refused_for_tasks_that_cannot_have_them(model):
    errors = validate(es(_spec(outputs=["dense", "sparse"], **model)))
    assert any("model.outputs apply to task embed only" in e for e in errors), errors


def test_outputs_schema_errors():
    assert any("Unsupported value: 'lexical'" in e for e in validate(es(_spec(outputs=["lexical"]))))
    assert any("at least 1 items" in e for e in validate(es(_spec(outputs=[]))))
    assert any("outputs[1]: Duplicate value: 'sparse'" in e for e in validate(es(_spec(outputs=["sparse", "sparse"]))))


@pytest.mark.parametrize("model_id", ["BAAI/bge-m3", "BAAI/bge-reranker-v2-m3", "cross-encoder/ms-marco-MiniLM-L-6-v2",
                                      "naver/splade-v3", "Org/My-ReRanker", "intfloat/e5-large"])
def test_cel_id_pattern_follows_task_detection(model_id):
    """The CEL rule's id pattern and render.detect_task agree on which ids are not embedders."""
    import re

    assert (re.search(S.NON_EMBED_ID_PATTERN, model_id) is not None) == (
        R.detect_task(S.ModelSpec(id=model_id)) != "embed")


def test_route_paths_follow_outputs():
    assert _paths(_spec()) == ["/v1/embeddings", "/embed", "/v2/embed", "/v1/models"]  # /embed_all only with gateway.embedAll
    assert _paths(_spec(outputs=["dense", "sparse", "colbert"])) == [
        "/v1/embeddings", "/embed", "/v2/embed", "/embed_sparse", "/embed_colbert", "/embed_hybrid", "/v1/models"]
    assert _paths(_spec(outputs=["sparse"])) == ["/embed_sparse", "/v1/models"]
    assert _paths(_spec(outputs=["colbert", "dense"])) == [
        "/v1/embeddings", "/embed", "/v2/embed", "/embed_colbert", "/embed_hybrid", "/v1/models"]


def _server_args(spec: dict) -> list[str]:
    deploy = by_kind(R.render(es(spec)))["Deployment"]
    return deploy["spec"]["template"]["spec"]["containers"][0]["args"]


def test_outputs_are_passed_to_the_server_in_one_order():
    """The server refuses to start when the folder lacks a head the manifest asks for (a crash-looping pod
    the operator reports), instead of answering 424 per request."""
    assert "--outputs" not in _server_args(_spec())
    args = _server_args(_spec(outputs=["colbert", "dense", "sparse"]))
    assert args[args.index("--outputs") + 1] == "dense,sparse,colbert"
    args = _server_args(_spec(outputs=["sparse"]))
    assert args[args.index("--outputs") + 1] == "sparse"
