"""The server's contract: its /openapi.json is true to it (Schemathesis, every check, on real models), empty
texts are refused like TEI, 405 names the allowed methods, deep JSON is a 4xx."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

AUTH = {"Authorization": "Bearer s3cret-key"}  # the `reranker` fixture's key
SCHEMATHESIS = Path(sys.executable).with_name("schemathesis")
# Fixed by default so that a red CI run reproduces; EMBEDOPS_SCHEMATHESIS_SEED=random explores.
SEED = os.environ.get("EMBEDOPS_SCHEMATHESIS_SEED", "20261201")
# Cases per operation and phase: the embedder's routes get the most; the other servers share most routes with it.
EXAMPLES = {"minilm_torch": 20, "reranker": 10, "classifier": 8, "splade": 8, "m3": 6}
if os.environ.get("EMBEDOPS_SCHEMATHESIS_EXAMPLES"):
    EXAMPLES = dict.fromkeys(EXAMPLES, int(os.environ["EMBEDOPS_SCHEMATHESIS_EXAMPLES"]))
TEI_EMPTY = {"error": "Input validation error: `inputs` cannot be empty", "error_type": "Empty"}

# TEI answers 424 (`Backend`) when a request asks a model for what it cannot do: a SPLADE model and
# `normalize: true`. The document says `normalize` must be false there, so Schemathesis sends true as invalid
# data and expects one of its client-error codes; 424 is this API's code for that refusal.
SPLADE_CONFIG = """
[checks.negative_data_rejection]
expected-statuses = ["400", "401", "403", "404", "405", "406", "409", "415", "422", "424", "428", "429", "5xx"]
"""


def schemathesis(url: str, workdir: Path, *args: str, examples: int = 20, config: str | None = None) -> tuple[int, str]:
    """`schemathesis run --checks all` against the server's own document; (cases generated, output)."""
    cmd = [str(SCHEMATHESIS)]
    if config:
        (workdir / "schemathesis.toml").write_text(config)
        cmd += ["--config-file", str(workdir / "schemathesis.toml")]
    seed = [] if SEED == "random" else ["--seed", SEED]
    cmd += ["run", url + "/openapi.json", "--checks", "all", "--max-examples", str(examples), "--workers", "1",
            *seed, "--generation-database", "none", "--request-timeout", "60", "--no-color", *args]
    res = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "SCHEMATHESIS_HOOKS": ""})
    out = res.stdout + res.stderr
    m = re.search(r"(\d+) generated, (\d+) passed", out)
    assert res.returncode == 0 and "No issues found" in out and m, out[-12000:]
    assert m.group(1) == m.group(2)
    return int(m.group(1)), out


@pytest.fixture(scope="module")
def m3(tmp_path_factory):
    """A small random model in bge-m3's layout (dense, sparse and ColBERT heads): /embed_sparse, /embed_colbert
    and /embed_hybrid are in its document."""
    from bench.m3_model import build_m3_folder

    from .conftest import run_server

    folder = build_m3_folder(tmp_path_factory.mktemp("bge-m3-contract"), hidden=32, layers=1)
    with run_server(model_id=str(folder), backend="torch", max_client_batch_size=8) as (url, st):
        yield url


@pytest.mark.slow
@pytest.mark.parametrize("server", ["minilm_torch", "reranker", "classifier", "splade", "m3"])
def test_schemathesis_finds_nothing(server, request, tmp_path):
    """Every operation in the document, every check (status codes, content types, response schemas and headers,
    schema-valid data accepted, invalid data refused, 405 + Allow for undeclared methods, auth not ignored,
    stateful links): no failure. Against an embedder, a reranker behind an API key, a classifier, SPLADE and a
    bge-m3-layout model (its multi-output routes)."""
    url = request.getfixturevalue(server)
    args = ["-H", f"Authorization: {AUTH['Authorization']}"] if server == "reranker" else []
    doc = _doc(url)
    _all_declare_their_contract(doc)
    selected = len([m for ops in doc["paths"].values() for m in ops])
    if server == "m3":  # its own routes and /embed; the others behave as on MiniLM (kept under 40 s on 2 cores)
        assert {"/embed_sparse", "/embed_colbert", "/embed_hybrid"} <= set(doc["paths"])
        args += ["--include-path-regex", "^/embed"]
        selected = len([p for p in doc["paths"] if p.startswith("/embed")])
    n, out = schemathesis(url, tmp_path, *args, examples=EXAMPLES[server],
                          config=SPLADE_CONFIG if server == "splade" else None)
    assert n >= 100, out[-3000:]
    ops = re.search(r"Selected: (\d+)/(\d+)", out)
    assert ops and int(ops.group(1)) == selected >= 5, out[-3000:]
    print(f"schemathesis {server}: {n} cases on {ops.group(1)} operations, no issues")


def _doc(url: str) -> dict:
    return httpx.get(url + "/openapi.json").json()


def _all_declare_their_contract(doc: dict) -> None:
    """Every POST route that runs the model says which tasks it serves (so models that cannot are not offered it)
    and every inference error it can return."""
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            if method == "post" and path not in ("/tokenize", "/decode"):
                assert "x-embedops-tasks" in op, path
                assert {"200", "400", "413", "422", "424", "429", "503"} <= set(op["responses"]), path


def test_document_lists_the_loaded_models_routes_and_its_limits(minilm_torch, reranker):
    doc = _doc(minilm_torch)
    paths = set(doc["paths"])
    assert {"/embed", "/embed_all", "/similarity", "/v1/embeddings", "/tokenize", "/decode", "/health", "/metrics",
            "/info", "/v1/models", "/v1/models/{model_id}"} <= paths
    assert not paths & {"/rerank", "/predict", "/embed_sparse", "/v1/rerank"}  # they answer 424 here
    rr = _doc(reranker)
    assert {"/rerank", "/predict", "/v1/rerank"} <= set(rr["paths"]) and "/embed" not in rr["paths"]

    s = doc["components"]["schemas"]
    text, batch, ids = s["EmbedRequest"]["properties"]["inputs"]["anyOf"]
    assert text == {"type": "string", "minLength": 1}
    assert batch["minItems"] == 1 and batch["maxItems"] == 64  # the fixture's --max-client-batch-size
    assert ids["minItems"] == 1 and ids["items"]["maximum"] == 30521  # MiniLM's vocabulary
    dims = s["EmbedRequest"]["properties"]["dimensions"]["anyOf"][0]
    assert (dims["minimum"], dims["maximum"]) == (1, 384)
    assert s["SimilarityInputs"]["properties"]["sentences"]["maxItems"] == 63
    assert s["TokenizeRequest"]["properties"]["inputs"]["anyOf"][0]["maxLength"] == 256 * 250
    text = json.dumps(doc)
    assert '"x-embedops":' not in text and "HTTPValidationError" not in text  # markers resolved, FastAPI's 422 gone
    assert doc["paths"]["/embed"]["post"]["x-embedops-tasks"] == ["embedding", "sparse"]

    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            if method == "post":
                codes = set(op["responses"])
                assert {"200", "400", "413", "422", "503"} <= codes, (path, codes)
                if path not in ("/tokenize", "/decode"):
                    assert {"424", "429"} <= codes and "Retry-After" in op["responses"]["429"]["headers"]
                ref = op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"]
                assert ref.endswith("/OpenAIErrorResponse" if path == "/v1/embeddings" else "/ErrorResponse")
    assert "content" not in doc["paths"]["/health"]["get"]["responses"]["200"]  # empty body
    assert "503" in doc["paths"]["/health"]["get"]["responses"]
    assert list(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain; version=0.0.4"]
    assert httpx.get(minilm_torch + "/metrics").headers["content-type"].startswith("text/plain; version=0.0.4")
    assert httpx.get(minilm_torch + "/health").content == b""
    model = doc["paths"]["/v1/models/{model_id}"]["get"]["parameters"][0]["schema"]
    assert model["enum"] == [httpx.get(minilm_torch + "/v1/models").json()["data"][0]["id"]]
    assert "404" in doc["paths"]["/v1/models/{model_id}"]["get"]["responses"]

    # with --api-key: the bearer scheme, and 401 on every route that needs it
    assert rr["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
    assert rr["paths"]["/rerank"]["post"]["security"] == [{"bearer": []}]
    assert "401" in rr["paths"]["/rerank"]["post"]["responses"]
    assert "security" not in rr["paths"]["/health"]["get"] and "security" not in doc["paths"]["/embed"]["post"]


@pytest.mark.parametrize("path, body", [
    ("/embed", {"inputs": ""}),
    ("/embed", {"inputs": ["fine", ""]}),
    ("/embed", {"inputs": ["fine", []]}),  # an empty list of token ids
    ("/embed", {"inputs": "", "prompt_name": None, "normalize": False}),
    ("/embed_all", {"inputs": [""]}),
    ("/", {"inputs": ""}),  # POST / routes by task, as TEI
    ("/invocations", {"inputs": [""]}),
])
def test_empty_text_is_400_empty_exactly_like_tei(minilm_torch, path, body):
    r = httpx.post(minilm_torch + path, json=body)
    assert (r.status_code, r.json()) == (400, TEI_EMPTY)


def test_empty_text_is_refused_on_every_route_that_embeds_scores_or_classifies(minilm_torch, reranker, classifier,
                                                                               splade):
    def refused(url, path, body, field, headers=None):
        r = httpx.post(url + path, json=body, headers=headers)
        assert r.status_code == 400, (path, body, r.text)
        assert r.json() == {"error": f"Input validation error: `{field}` cannot be empty", "error_type": "Empty"}

    refused(minilm_torch, "/similarity", {"inputs": {"source_sentence": "", "sentences": ["a"]}}, "source_sentence")
    refused(minilm_torch, "/similarity", {"inputs": {"source_sentence": "a", "sentences": ["b", ""]}}, "sentences")
    refused(reranker, "/rerank", {"query": "", "texts": ["a"]}, "query", AUTH)
    refused(reranker, "/rerank", {"query": "q", "texts": ["a", ""]}, "texts", AUTH)
    refused(reranker, "/v1/rerank", {"query": "", "documents": ["a"]}, "query", AUTH)
    refused(reranker, "/v1/rerank", {"query": "q", "documents": ["a", {"text": ""}]}, "documents", AUTH)
    refused(reranker, "/predict", {"inputs": ["q", ""]}, "inputs", AUTH)  # a pair
    refused(classifier, "/predict", {"inputs": ""}, "inputs")
    refused(classifier, "/predict", {"inputs": [["fine"], ["a", ""]]}, "inputs")
    refused(splade, "/embed_sparse", {"inputs": ["a", ""]}, "inputs")
    refused(splade, "/embed", {"inputs": "", "normalize": False}, "inputs")

    # OpenAI's route answers in OpenAI's shape
    r = httpx.post(minilm_torch + "/v1/embeddings", json={"input": ["a", ""]})
    assert r.status_code == 400
    assert r.json()["error"] == {"message": "Input validation error: `input` cannot be empty",
                                 "type": "invalid_request_error", "param": None, "code": "empty"}
    from openai import BadRequestError, OpenAI

    with pytest.raises(BadRequestError):
        OpenAI(base_url=minilm_torch + "/v1", api_key="x", max_retries=0).embeddings.create(model="m", input="")

    # not inference: tokenizing "" is fine ([CLS] [SEP]), as in TEI; whitespace is a text
    tok = httpx.post(minilm_torch + "/tokenize", json={"inputs": ""})
    assert tok.status_code == 200 and [t["text"] for t in tok.json()[0]] == ["[CLS]", "[SEP]"]
    assert httpx.post(minilm_torch + "/embed", json={"inputs": " "}).status_code == 200


def test_405_lists_the_allowed_methods(minilm_torch):
    for method, path, allow in [("GET", "/embed", "POST"), ("PUT", "/v1/embeddings", "POST"),
                                ("DELETE", "/health", "GET"), ("TRACE", "/info", "GET"),
                                ("PATCH", "/", "GET, POST"), ("DELETE", "/v1/models/x", "GET")]:
        r = httpx.request(method, minilm_torch + path)
        assert r.status_code == 405, (method, path, r.text)
        assert r.headers["allow"] == allow, (method, path, r.headers)
        body = r.json()
        assert body.get("error_type") == "MethodNotAllowed" or body["error"]["code"] == "methodnotallowed"


def test_decode_accepts_what_its_schema_allows(minilm_torch):
    assert httpx.post(minilm_torch + "/decode", json={"ids": []}).json() == [""]
    assert httpx.post(minilm_torch + "/decode", json={"ids": [[], [7592]]}).json() == ["", "hello"]
    assert httpx.post(minilm_torch + "/decode", json={"ids": [7592.0]}).json() == ["hello"]  # JSON's integer
    # outside the vocabulary is outside the schema's maximum too: 422
    r = httpx.post(minilm_torch + "/decode", json={"ids": [30522]})
    assert r.status_code == 422 and "vocabulary size 30522" in r.json()["error"]
    for bad in ({"ids": ["7592"]}, {"ids": [True]}, {"ids": [1.5]}, {"ids": [1], "skip_special_tokens": "yes"}):
        assert httpx.post(minilm_torch + "/decode", json=bad).status_code == 422, bad


def test_dimensions_out_of_range_is_refused_before_any_inference(minilm_torch):
    def batches() -> float:
        m = re.search(r"^te_batch_next_size_count (\S+)$", httpx.get(minilm_torch + "/metrics").text, re.M)
        return float(m.group(1))

    before = batches()
    for path, body in [("/embed", {"inputs": ["x"] * 64, "dimensions": 385}),
                       ("/v1/embeddings", {"input": ["x"] * 64, "dimensions": 0})]:
        r = httpx.post(minilm_torch + path, json=body)
        assert r.status_code == 422 and "between 1 and 384" in r.text, r.text
    assert batches() == before


@pytest.mark.parametrize("path", ["/embed", "/v1/embeddings", "/rerank", "/decode", "/tokenize", "/", "/invocations"])
def test_json_nested_10000_deep_is_a_4xx(minilm_torch, path):
    d = 10_000
    for body in ["[" * d + "]" * d, '{"inputs": ' + "[" * d + "]" * d + "}", '{"input": ' + '{"a": ' * d + "1" + "}" * d + "}"]:
        r = httpx.post(minilm_torch + path, content=body.encode(), headers={"content-type": "application/json"},
                       timeout=30)
        assert 400 <= r.status_code < 500, (path, r.status_code, r.text[:300])
        assert "nested too deeply" in r.text or "malformed JSON" in r.text or r.status_code in (404, 422), r.text
    assert httpx.post(minilm_torch + "/embed", json={"inputs": "still serving"}).status_code == 200


def test_markers_resolve_to_this_servers_limits():
    """router/openapi.py's markers: a limit replaces the marker; a schema with no valid value leaves its anyOf."""
    from embedops_server.router.openapi import _DROP, _resolve

    limits = {"outputs": {"enum": ["dense", "colbert"]}, "prompt-name": _DROP,
              "token-id": {"maximum": 9, "exclusiveMaximum": None}}
    doc = {"outputs": {"type": "array", "items": {"type": "string", "enum": ["dense", "sparse", "colbert"],
                                                   "x-embedops": "outputs"}},
           "prompt_name": {"anyOf": [{"type": "string", "x-embedops": "prompt-name"}, {"type": "null"}],
                           "title": "Prompt Name"},
           "ids": {"type": "array", "items": {"type": "integer", "minimum": 0, "exclusiveMaximum": 2 ** 32,
                                              "x-embedops": "token-id"}},
           "other": {"type": "string", "x-embedops": "unknown-marker"}}
    assert _resolve(doc, limits) == {
        "outputs": {"type": "array", "items": {"type": "string", "enum": ["dense", "colbert"]}},
        "prompt_name": {"type": "null", "title": "Prompt Name"},
        "ids": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}},
        "other": {"type": "string"}}


def test_bge_m3_document_lists_the_heads_the_folder_has(m3, tmp_path):
    """/embed_sparse for SPLADE and for bge-m3's sparse head (not for a plain embedder), /embed_colbert only with
    the colbert head; ColBERT's `dimensions` limit is the ColBERT size."""
    from bench.m3_model import build_m3_folder

    from .conftest import run_server

    doc = _doc(m3)
    assert {"/embed", "/embed_sparse", "/embed_colbert", "/embed_hybrid"} <= set(doc["paths"])
    assert doc["paths"]["/embed_sparse"]["post"]["x-embedops-tasks"] == ["sparse", "embedding"]
    s = doc["components"]["schemas"]
    assert s["HybridRequest"]["properties"]["outputs"]["anyOf"][0]["items"]["enum"] == ["dense", "sparse", "colbert"]
    assert s["ColbertRequest"]["properties"]["dimensions"]["anyOf"][0]["maximum"] == 32
    sparse_only = build_m3_folder(tmp_path / "sparse-only", heads=("sparse",), hidden=32, layers=1)
    with run_server(model_id=str(sparse_only), backend="torch") as (url, st):
        doc = _doc(url)
        assert "/embed_sparse" in doc["paths"] and "/embed_colbert" not in doc["paths"]
        outputs = doc["components"]["schemas"]["HybridRequest"]["properties"]["outputs"]["anyOf"][0]["items"]
        assert outputs["enum"] == ["dense", "sparse"]
        # a head the model lacks does not win over the empty text
        r = httpx.post(url + "/embed_colbert", json={"inputs": [""]})
        assert (r.status_code, r.json()) == (400, TEI_EMPTY)
        r = httpx.post(url + "/embed_colbert", json={"inputs": ["a"]})
        assert r.status_code == 424 and "colbert_linear.pt" in r.text
