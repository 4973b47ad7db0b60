"""The operator's LiteLLM entries on a real LiteLLM proxy (issue 19): LiteLLM 1.110.2 in its own environment
(localcluster/litellm_proxy.py) loads the files of the shared ConfigMap exactly as a ConfigMap volume
presents them (one file per data key) through the index the operator writes, and calls real embedops
servers on loopback: an embedder, and a reranker behind an API key.

The one liberty taken: each entry's ``api_base`` names the Service's cluster DNS name, which this machine
cannot resolve, so it is replaced by the loopback URL of the server standing in for that Service; the rest
of every file is as rendered. (The in-cluster proxy reading the mounted ConfigMap is the next step.)
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import httpx
import pytest
import yaml

from embedops_operator import litellm, render
from embedops_operator.spec import parse as parse_resource
from localcluster import litellm_proxy
from localcluster.models import make_tiny_reranker, minilm_dir
from tests.server.conftest import run_server

pytestmark = [pytest.mark.slow]

NS = "search"
API_KEY = "rerank-secret-0123"
TEXTS = ["A man is eating food.", "The girl is carrying a baby.", "Kubernetes schedules pods onto nodes."]
QUERY = "Where is the Eiffel Tower?"
DOCS = ["Paris is the capital of France.", "Bananas are yellow.", "The Eiffel Tower is in Paris."]


def resource(name: str, spec: dict) -> dict:
    return {"apiVersion": "embedops.dev/v1alpha1", "kind": "EmbeddingService",
            "metadata": {"name": name, "namespace": NS}, "spec": spec}


EMBEDDER = resource("minilm", {
    "model": {"id": "/models/all-MiniLM-L6-v2", "servedModelName": "all-MiniLM-L6-v2", "task": "embed"},
    "accelerator": {"cpu": {"cores": 1}}, "litellm": {"configMapName": "litellm-models", "modelName": "minilm"}})
RERANKER = resource("tiny-reranker", {
    "model": {"id": "/models/tiny-reranker", "task": "rerank"}, "accelerator": {"cpu": {"cores": 1}},
    "apiKeySecretRef": {"name": "rerank-key"}, "litellm": {"configMapName": "litellm-models"}})


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    reranker = make_tiny_reranker(tmp_path_factory.mktemp("models") / "tiny-reranker", minilm_dir())
    with run_server(model_id=str(minilm_dir()), backend="torch", served_model_name="all-MiniLM-L6-v2") as (e, _), \
            run_server(model_id=str(reranker), backend="torch", api_key=API_KEY) as (r, _):
        yield {"minilm": e, "tiny-reranker": r}


def mounted_config_map(folder: Path, servers: dict) -> tuple[Path, dict]:
    """The shared ConfigMap's files as its volume shows them, plus a LiteLLM config including the index.
    Returns (config path, the env variable names the entries read their API keys from)."""
    options = render.Options()
    files, env_names = {}, {}
    for res in (EMBEDDER, RERANKER):
        name = res["metadata"]["name"]
        spec = parse_resource(res).spec
        (text,) = render.litellm_config_map(name, NS, spec, options)["data"].values()
        files[render.litellm_key(name)] = text.replace(render.service_url(name, NS, spec, options), servers[name])
        for entry in yaml.safe_load(text)["model_list"]:
            key = entry["litellm_params"]["api_key"]
            if key.startswith("os.environ/"):
                env_names[name] = key.removeprefix("os.environ/")
    files[litellm.INDEX_KEY] = litellm.index_text(files)
    mount = folder / "embedops"
    mount.mkdir()
    for key, text in files.items():
        (mount / key).write_text(text)
    config = folder / "config.yaml"
    config.write_text(yaml.safe_dump({"include": [f"embedops/{litellm.INDEX_KEY}"],
                                      "litellm_settings": {"drop_params": True}}))
    return config, env_names


def auth() -> dict:
    return {"Authorization": f"Bearer {litellm_proxy.MASTER_KEY}"}


def test_openai_sdk_and_rerank_through_litellm_match_the_servers(servers, tmp_path):
    config, env_names = mounted_config_map(tmp_path, servers)
    assert list(env_names) == ["tiny-reranker"]  # only the protected service names a key variable
    with litellm_proxy.run(config, {env_names["tiny-reranker"]: API_KEY}) as url:
        models = httpx.get(url + "/v1/models", headers=auth(), timeout=30).json()
        assert {m["id"] for m in models["data"]} == {"minilm", "/models/tiny-reranker"}, models

        from openai import OpenAI

        client = OpenAI(base_url=url + "/v1", api_key=litellm_proxy.MASTER_KEY, timeout=60)
        via = client.embeddings.create(model="minilm", input=TEXTS)  # the SDK asks for base64 by default
        direct = httpx.post(servers["minilm"] + "/v1/embeddings",
                            json={"model": "all-MiniLM-L6-v2", "input": TEXTS}, timeout=60).json()
        got = [d.embedding for d in sorted(via.data, key=lambda d: d.index)]
        want = [d["embedding"] for d in sorted(direct["data"], key=lambda d: d["index"])]
        assert len(got) == len(want) == 3 and all(len(g) == 384 for g in got)
        worst = max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g, w))
        print(f"/v1/embeddings through LiteLLM vs the server: max |diff| {worst:.1e}")
        assert worst < 1e-6

        r = httpx.post(url + "/rerank", headers=auth(), timeout=60,
                       json={"model": "/models/tiny-reranker", "query": QUERY, "documents": DOCS})
        assert r.status_code == 200, (r.status_code, r.text, litellm_proxy.log_of(config)[-3000:])
        via_scores = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
        direct = httpx.post(servers["tiny-reranker"] + "/rerank", json={"query": QUERY, "texts": DOCS},
                            headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60).json()
        want_scores = {x["index"]: x["score"] for x in direct}
        print(f"/rerank through LiteLLM: {via_scores}; the server: {want_scores}")
        assert set(via_scores) == {0, 1, 2}
        assert all(math.isclose(via_scores[i], want_scores[i], rel_tol=1e-6) for i in range(3))


def test_a_protected_service_without_its_key_variable_fails_clearly(servers, tmp_path):
    config, env_names = mounted_config_map(tmp_path, servers)
    with litellm_proxy.run(config, {}) as url:  # the entry's os.environ/ variable is not set
        r = httpx.post(url + "/rerank", headers=auth(), timeout=60,
                       json={"model": "/models/tiny-reranker", "query": QUERY, "documents": DOCS})
        print(f"rerank without {env_names['tiny-reranker']}: {r.status_code} {r.text[:300]}")
        assert r.status_code in (401, 403, 500, 502), r.text
        assert "401" in r.text or "nauthorized" in r.text or "API key" in r.text, r.text
        # the unprotected embedder still answers through the same proxy
        e = httpx.post(url + "/v1/embeddings", headers=auth(), timeout=60,
                       json={"model": "minilm", "input": TEXTS[:1], "encoding_format": "float"})
        assert e.status_code == 200 and len(e.json()["data"][0]["embedding"]) == 384, e.text
        assert json.loads(r.text)  # an error body LiteLLM wrote, not a dropped connection
