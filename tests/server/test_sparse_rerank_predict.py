"""SPLADE sparse vectors, rerank and predict equal references computed with transformers."""
from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch

from localcluster.models import splade_dir

from .conftest import TEXTS

AUTH = {"Authorization": "Bearer s3cret-key"}


def _tok(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def test_splade_matches_transformers(splade):
    from transformers import AutoModelForMaskedLM

    torch.set_num_threads(1)
    texts = TEXTS[:5]
    r = httpx.post(splade + "/embed_sparse", json={"inputs": texts}, timeout=60)
    assert r.status_code == 200, r.text
    got = r.json()
    model = AutoModelForMaskedLM.from_pretrained(str(splade_dir())).eval()
    tok = _tok(splade_dir())
    enc = tok(texts, padding=True, truncation=True, max_length=512, return_tensors="pt")
    with torch.no_grad():
        logits = model(**enc).logits
    ref = (torch.log1p(torch.relu(logits)) * enc["attention_mask"][..., None]).amax(1).numpy()
    for row, ref_row in zip(got, ref):
        dense = np.zeros_like(ref_row)
        idx = [e["index"] for e in row]
        dense[idx] = [e["value"] for e in row]
        assert set(idx) == set(np.flatnonzero(ref_row).tolist())
        np.testing.assert_allclose(dense, ref_row, rtol=1e-4, atol=1e-5)
    # sorted by index, non-zeros only
    assert all(e["value"] > 0 for e in got[0]) and [e["index"] for e in got[0]] == sorted(e["index"] for e in got[0])
    # /embed on a SPLADE model gives the dense vector (normalize=false only, as TEI)
    d = httpx.post(splade + "/embed", json={"inputs": texts[0], "normalize": False}).json()
    np.testing.assert_allclose(d[0], ref[0], rtol=1e-4, atol=1e-5)
    r = httpx.post(splade + "/embed", json={"inputs": texts[0]})
    assert r.status_code == 424 and r.json()["error_type"] == "Backend"
    r = httpx.post(splade + "/embed_all", json={"inputs": texts[0]})
    assert r.status_code == 424


def _logits(path, pairs):
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    tok = _tok(path)
    a = [p[0] for p in pairs]
    b = [p[1] for p in pairs] if len(pairs[0]) == 2 else None
    enc = tok(a, b, padding=True, truncation=True, max_length=512, return_tensors="pt")
    with torch.no_grad():
        return model(**enc).logits.double().numpy()


def test_rerank_matches_transformers(reranker, reranker_dir):
    query = "What is the capital of France?"
    texts = ["Paris is the capital of France.", "Berlin is in Germany.", "Bananas are yellow.", TEXTS[4]]
    r = httpx.post(reranker + "/rerank", json={"query": query, "texts": texts, "return_text": True}, headers=AUTH)
    assert r.status_code == 200, r.text
    got = r.json()
    logits = _logits(reranker_dir, [(query, t) for t in texts])[:, 0]
    ref = 1 / (1 + np.exp(-logits))
    assert [g["index"] for g in got] == list(np.argsort(-ref, kind="stable"))
    for g in got:
        assert g["score"] == pytest.approx(ref[g["index"]], abs=1e-5)
        assert g["text"] == texts[g["index"]]
    raw = httpx.post(reranker + "/rerank", json={"query": query, "texts": texts, "raw_scores": True},
                     headers=AUTH).json()
    for g in raw:
        assert g["score"] == pytest.approx(logits[g["index"]], abs=1e-4)
        assert "text" not in g
    # Cohere/Jina-style route: same scores, top_n and documents
    r = httpx.post(reranker + "/v1/rerank", headers=AUTH, json={
        "query": query, "documents": [texts[0], {"text": texts[1]}, texts[2]], "top_n": 2, "return_documents": True})
    assert r.status_code == 200, r.text
    res = r.json()["results"]
    assert len(res) == 2
    order = list(np.argsort(-ref[:3], kind="stable"))[:2]
    assert [x["index"] for x in res] == order
    assert res[0]["relevance_score"] == pytest.approx(ref[order[0]], abs=1e-5)
    assert res[0]["document"]["text"] == texts[order[0]]
    assert r.json()["usage"]["total_tokens"] > 0


def test_predict_matches_transformers(classifier, classifier_dir):
    texts = ["I love it", "This is terrible", "meh"]
    logits = _logits(classifier_dir, [(t,) for t in texts])
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    labels = ["negative", "neutral", "positive"]
    # single
    r = httpx.post(classifier + "/predict", json={"inputs": texts[0]})
    assert r.status_code == 200, r.text
    single = r.json()
    assert [s["label"] for s in single] == [labels[j] for j in np.argsort(-probs[0])]
    for s in single:
        assert s["score"] == pytest.approx(probs[0][labels.index(s["label"])], abs=1e-5)
    # batch (texts and a pair), raw scores
    pair_logits = _logits(classifier_dir, [("premise here", "hypothesis there")])[0]
    r = httpx.post(classifier + "/predict", json={"inputs": [[texts[1]], ["premise here", "hypothesis there"], texts[2]],
                                                  "raw_scores": True})
    assert r.status_code == 200, r.text
    batch = r.json()
    assert len(batch) == 3
    got1 = {s["label"]: s["score"] for s in batch[0]}
    got2 = {s["label"]: s["score"] for s in batch[1]}
    for j, name in enumerate(labels):
        assert got1[name] == pytest.approx(logits[1][j], abs=1e-4)
        assert got2[name] == pytest.approx(pair_logits[j], abs=1e-4)
    # pair as a single input
    r = httpx.post(classifier + "/predict", json={"inputs": ["premise here", "hypothesis there"], "raw_scores": True})
    assert {s["label"]: s["score"] for s in r.json()}[labels[0]] == pytest.approx(pair_logits[0], abs=1e-4)
    info = httpx.get(classifier + "/info").json()
    assert info["model_type"]["classifier"]["id2label"] == {"0": "negative", "1": "neutral", "2": "positive"}
    # classifier routes refuse embedding work with 424, and vice versa
    r = httpx.post(classifier + "/embed", json={"inputs": "x"})
    assert r.status_code == 424 and "not an embedding" in r.json()["error"]
    r = httpx.post(classifier + "/rerank", json={"query": "q", "texts": ["a"]})
    assert r.status_code == 424


def test_splade_on_onnxruntime_matches_torch(splade, tmp_path):
    from .conftest import run_server

    texts = TEXTS[:4]
    ref = httpx.post(splade + "/embed_sparse", json={"inputs": texts}).json()
    with run_server(model_id=str(splade_dir()), backend="onnxruntime", onnx_cache=str(tmp_path)) as (url, st):
        assert st.service.backend.name == "onnxruntime"
        got = httpx.post(url + "/embed_sparse", json={"inputs": texts}).json()
    for g, r in zip(got, ref):
        gd = {e["index"]: e["value"] for e in g}
        rd = {e["index"]: e["value"] for e in r}
        assert len(set(gd) ^ set(rd)) <= 2  # a value at ~0 may land on either side of relu
        for k in set(gd) | set(rd):
            assert gd.get(k, 0.0) == pytest.approx(rd.get(k, 0.0), rel=1e-3, abs=1e-4)
