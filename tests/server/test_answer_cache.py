"""The answer cache (core/cache.py, --answer-cache-bytes, issue 56): a repeated input is answered from the cache
with the vector it was computed with, over every route that keeps answers, never across the options applied after
the engine or across truncation; bounded by bytes; off by default. On the real server (MiniLM, ONNX Runtime)."""
from __future__ import annotations

import httpx
import numpy as np
import pytest

from embedops_server.core.cache import AnswerCache
from localcluster.models import minilm_onnx_dir

from .conftest import run_server

TEXTS = ["The cache answers repeated chunks.", "Boilerplate repeats in every document.", "A header, again."]


@pytest.fixture(scope="module")
def cached():
    with run_server(model_id=str(minilm_onnx_dir()), backend="onnxruntime", pooling="mean",
                    answer_cache_bytes=1 << 20, max_input_length=64) as (url, st):
        yield url, st


def _embed(url, inputs, **kw):
    r = httpx.post(url + "/embed", json={"inputs": inputs, **kw}, timeout=60)
    assert r.status_code == 200, r.text
    return np.array(r.json()), int(r.headers["embedops-cache-hits"])


def test_a_repeated_input_is_answered_from_the_cache_with_the_same_vector(cached):
    url, st = cached
    cache = st.service.cache
    before = (cache.hits, cache.misses)
    first, hits = _embed(url, TEXTS)
    assert hits == 0
    again, hits = _embed(url, TEXTS[::-1])
    assert hits == 3 and np.array_equal(again, first[::-1])  # the very vectors, in the request's order
    # a mix: two kept, one new; the new one is computed, the answer in order
    mixed, hits = _embed(url, [TEXTS[1], "something new", TEXTS[0]])
    assert hits == 2 and np.array_equal(mixed[0], first[1]) and np.array_equal(mixed[2], first[0])
    alone, hits = _embed(url, ["something new"])
    assert hits == 1 and np.array_equal(alone[0], mixed[1])
    # the computed one of the mix is that text's vector (another key: a short text truncated from the left)
    fresh, hits = _embed(url, ["something new"], truncation_direction="Left")
    assert hits == 0 and np.allclose(fresh[0], mixed[1], atol=1e-6)
    assert (cache.hits - before[0], cache.misses - before[1]) == (6, 5)
    # options applied after the engine come out right from a kept answer: dimensions, normalize
    short, hits = _embed(url, TEXTS[:1], dimensions=8, normalize=False)
    raw, _ = _embed(url, TEXTS[:1], normalize=False)
    assert hits == 1 and short.shape == (1, 8) and np.allclose(short[0], raw[0][:8])
    assert np.isclose(np.linalg.norm(first[0]), 1.0, atol=1e-5) and not np.isclose(np.linalg.norm(raw[0]), 1.0)
    # the batch lane's engine shares the one cache (6 inputs: the batch lane under --default-lane auto)
    r = httpx.post(url + "/embed", json={"inputs": TEXTS * 2}, timeout=60)
    assert r.headers["embedops-lane"] == "batch" and r.headers["embedops-cache-hits"] == "6"
    # OpenAI's route shares the answers
    r = httpx.post(url + "/v1/embeddings", json={"input": TEXTS[2], "model": "m"}, timeout=60)
    assert r.headers["embedops-cache-hits"] == "1"
    assert np.allclose(r.json()["data"][0]["embedding"], first[2], atol=1e-7)


def test_truncation_is_part_of_the_key(cached):
    url, _ = cached
    long = "a passage longer than the sixty-four token input limit of this server " * 10
    truncated, hits = _embed(url, [long], truncate=True)
    assert hits == 0
    r = httpx.post(url + "/embed", json={"inputs": [long], "truncate": False}, timeout=60)
    assert r.status_code == 413 or r.status_code == 422, r.text  # refused, never answered from the kept one
    left, hits = _embed(url, [long], truncate=True, truncation_direction="Left")
    assert hits == 0 and not np.allclose(left, truncated)


def test_hits_take_no_admission_and_the_metrics_say_so(cached):
    url, st = cached
    _embed(url, TEXTS)
    lanes = st.service.lanes
    admitted = lanes.max_concurrent
    lanes._in_flight["interactive"] += admitted  # the budget full: a computed input would be 429
    try:
        got, hits = _embed(url, TEXTS)
        assert hits == 3
        r = httpx.post(url + "/embed", json={"inputs": ["not kept"]}, timeout=60)
        assert r.status_code == 429
    finally:
        lanes._in_flight["interactive"] -= admitted
    text = httpx.get(url + "/metrics").text
    for name in ("embedops_answer_cache_hits", "embedops_answer_cache_misses", "embedops_answer_cache_evictions",
                 "embedops_answer_cache_bytes", "embedops_answer_cache_entries"):
        assert f"\n{name} " in text, name
    info = httpx.get(url + "/info").json()["answer_cache"]
    assert info["max_bytes"] == 1 << 20 and info["entries"] >= 3 and info["hits"] >= 3


def test_off_by_default():
    with run_server(model_id=str(minilm_onnx_dir()), backend="onnxruntime", pooling="mean") as (url, st):
        r = httpx.post(url + "/embed", json={"inputs": TEXTS}, timeout=60)
        assert r.status_code == 200 and "embedops-cache-hits" not in r.headers
        assert st.service.cache is None and httpx.get(url + "/info").json()["answer_cache"] is None
        assert "embedops_answer_cache" not in httpx.get(url + "/metrics").text


def test_bounded_by_bytes_least_recently_used_out():
    row = np.ones(384, dtype=np.float32)
    one = row.nbytes + 200 + 60  # an entry: its vector, the overhead, a short key
    cache = AnswerCache(3 * one)
    for i in range(3):
        cache.put((f"text {i}", True, "right"), row * i)
    assert len(cache) == 3 and cache.bytes <= cache.max_bytes
    cache.lookup(["text 0"], True, "right")  # used: the least recently used is now text 1
    cache.put(("text 3", True, "right"), row)
    assert len(cache) == 3 and cache.evictions == 1 and cache.bytes <= cache.max_bytes
    got = cache.lookup(["text 0", "text 1", "text 3"], True, "right")
    assert got.missing == [1] and got.results[0][0] == 0.0
    # what it returns cannot be changed by whoever gets it
    with pytest.raises(ValueError):
        got.results[2][0] = 5.0
    # a value alone over the bound is not kept; a view's base is not held
    big = np.zeros((100, 384), dtype=np.float32)
    cache.put(("huge", True, "right"), np.zeros(4 * 384 * 4, dtype=np.float32))
    assert cache.lookup(["huge"], True, "right").missing == [0]
    cache.put(("view", True, "right"), big[0])
    assert cache.lookup(["view"], True, "right").results[0].base is None


def test_rerank_scores_are_kept_per_pair(reranker_dir):
    """A rerank's (query, passage) pairs are answers too; the same passage under another query is another key."""
    docs = ["Paris is the capital of France.", "Berlin is in Germany."]
    with run_server(model_id=str(reranker_dir), backend="torch", answer_cache_bytes=1 << 20) as (url, _):
        a = httpx.post(url + "/rerank", json={"query": "capital of France", "texts": docs}, timeout=60)
        b = httpx.post(url + "/rerank", json={"query": "capital of France", "texts": docs}, timeout=60)
        c = httpx.post(url + "/rerank", json={"query": "a city in Germany", "texts": docs}, timeout=60)
        assert a.headers["embedops-cache-hits"] == "0" and b.headers["embedops-cache-hits"] == "2"
        assert c.headers["embedops-cache-hits"] == "0"
        assert a.json() == b.json()
