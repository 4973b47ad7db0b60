"""Embeddings equal sentence-transformers' for all-MiniLM-L6-v2 on torch and ONNX Runtime (cosine >= 0.9999)."""
from __future__ import annotations

import httpx
import numpy as np

from .conftest import TEXTS, cosine


def _embed(url, texts, **kw):
    r = httpx.post(url + "/embed", json={"inputs": texts, **kw}, timeout=60)
    assert r.status_code == 200, r.text
    return np.array(r.json())


def test_torch_parity_with_sentence_transformers(minilm_torch, st_model):
    ref = st_model.encode(TEXTS, normalize_embeddings=True)
    got = _embed(minilm_torch, TEXTS)
    cos = cosine(got, ref)
    print("torch cosines", cos.min())
    assert got.shape == (len(TEXTS), 384)
    assert cos.min() >= 0.9999
    # single-text requests go through different (unbatched) shapes: same vectors
    for t, r in zip(TEXTS[:3], ref[:3]):
        assert cosine(_embed(minilm_torch, t)[0], r) >= 0.9999


def test_onnxruntime_parity_with_sentence_transformers(minilm_ort, st_model):
    ref = st_model.encode(TEXTS, normalize_embeddings=True)
    got = _embed(minilm_ort, TEXTS)
    cos = cosine(got, ref)
    print("onnxruntime cosines", cos.min())
    assert cos.min() >= 0.9999
    info = httpx.get(minilm_ort + "/info").json()
    assert info["backend"] == "onnxruntime" and info["model_type"] == {"embedding": {"pooling": "mean"}}


def test_openai_route_parity(minilm_ort, st_model):
    r = httpx.post(minilm_ort + "/v1/embeddings", json={"input": TEXTS[:4], "model": "x"}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and [d["index"] for d in body["data"]] == [0, 1, 2, 3]
    assert body["usage"]["prompt_tokens"] > 0
    got = np.array([d["embedding"] for d in body["data"]])
    assert cosine(got, st_model.encode(TEXTS[:4], normalize_embeddings=True)).min() >= 0.9999
