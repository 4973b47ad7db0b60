"""Prompts from config_sentence_transformers.json: per request (prompt_name) and server default."""
from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from localcluster.models import minilm_dir

from .conftest import cosine, run_server


@pytest.fixture(scope="module")
def prompted_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("minilm-prompts")
    for f in minilm_dir().iterdir():
        if f.name != "config_sentence_transformers.json":
            (d / f.name).symlink_to(f)
    (d / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": {"query": "query: ", "passage": "passage: "}, "default_prompt_name": None}))
    return d


def test_prompt_name_and_default_prompt(prompted_dir, st_model):
    texts = ["how do operators work?", "Paris"]
    with run_server(model_id=str(prompted_dir), backend="torch", default_prompt_name="passage") as (url, st):
        q = np.array(httpx.post(url + "/embed", json={"inputs": texts, "prompt_name": "query"}).json())
        assert cosine(q, st_model.encode(["query: " + t for t in texts])).min() >= 0.9999
        p = np.array(httpx.post(url + "/embed", json={"inputs": texts}).json())  # server default: passage
        assert cosine(p, st_model.encode(["passage: " + t for t in texts])).min() >= 0.9999
        tok = httpx.post(url + "/tokenize", json={"inputs": "Paris", "prompt_name": "query"}).json()[0]
        assert [t["text"] for t in tok][1:3] == ["query", ":"]
        r = httpx.post(url + "/embed", json={"inputs": "x", "prompt_name": "nope"})
        assert r.status_code == 422 and "passage" in r.json()["error"]
        assert httpx.get(url + "/info").json()["prompts"] == ["passage", "query"]
