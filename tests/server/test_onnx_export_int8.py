"""ONNX export from torch weights (no ONNX file in the folder) and the quality-gated int8 option."""
from __future__ import annotations

import time

import httpx
import numpy as np
import pytest

from embedops_server.backends import onnx_export
from embedops_server.backends.ort_backend import OrtBackend
from embedops_server.core.model_info import load_model_info
from localcluster.models import minilm_dir

from .conftest import TEXTS, cosine, run_server


@pytest.fixture(scope="module")
def int8_server(tmp_path_factory):
    cache = tmp_path_factory.mktemp("onnx-cache")
    with run_server(model_id=str(minilm_dir()), backend="onnxruntime", quantize="int8",
                    onnx_cache=str(cache)) as (url, st):
        yield url, cache


def test_int8_quality_gate_and_export(int8_server, st_model):
    url, cache = int8_server
    info = httpx.get(url + "/info").json()
    assert info["backend"] == "onnxruntime" and info["model_dtype"] == "int8"
    print("int8 min cosine vs float32 (check sentences):", info["int8_cosine"])
    assert info["int8_cosine"] >= 0.98
    got = np.array(httpx.post(url + "/embed", json={"inputs": TEXTS}, timeout=60).json())
    cos = cosine(got, st_model.encode(TEXTS, normalize_embeddings=True))
    print("int8 cosines vs sentence-transformers:", cos.round(4))
    assert cos.min() >= 0.97
    # The float32 export written next to it matches sentence-transformers exactly.
    exported = list(cache.rglob("model.eager.onnx"))
    assert exported, "export from torch weights did not happen"
    mi = load_model_info(minilm_dir())
    mi.onnx_path = exported[0]
    be = OrtBackend(mi, threads=1)
    import tokenizers
    from embedops_server.core.batch import Batch

    tok = tokenizers.Tokenizer.from_file(str(minilm_dir() / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(256)
    encs = tok.encode_batch(TEXTS)
    L = max(len(e.ids) for e in encs)
    ids = np.zeros((len(encs), L), np.int64)
    mask = np.zeros_like(ids)
    for i, e in enumerate(encs):
        ids[i, : len(e.ids)], mask[i, : len(e.ids)] = e.ids, 1
    out = be.forward(Batch(ids, mask, np.zeros_like(ids), mask.sum(1))).pooled
    assert cosine(out, st_model.encode(TEXTS)).min() >= 0.9999


def test_int8_refused_when_gate_unmet(int8_server):
    url, cache = int8_server  # reuses the cached export and int8 file
    with run_server(wait=False, model_id=str(minilm_dir()), backend="onnxruntime", quantize="int8",
                    onnx_cache=str(cache), int8_min_cosine=0.99999) as (url2, st):
        import time

        deadline = time.time() + 120
        while st.load_error is None and time.time() < deadline:
            time.sleep(0.2)
        r = httpx.get(url2 + "/health")
        assert r.status_code == 503 and "quality gate" in r.json()["error"]
        r = httpx.post(url2 + "/embed", json={"inputs": "x"})
        assert r.status_code == 503 and r.json()["error_type"] == "Unhealthy"


def test_int8_gate_on_reranker_scores_is_a_correlation(reranker_dir, tmp_path):
    """A reranker row has one logit, whose own cosine is only its sign (always 1 unless it flips): the gate
    compares the score vectors across query-passage pairs instead (Pearson correlation)."""
    import tokenizers

    from embedops_server.backends import ort_backend as OB

    info = load_model_info(str(reranker_dir), None, "main")
    tok = tokenizers.Tokenizer.from_file(str(reranker_dir / "tokenizer.json"))
    tok.no_padding()
    be = OrtBackend(info, threads=1, quantize="int8", cache=str(tmp_path), int8_min_cosine=-1.0, tokenizer=tok)
    fp32 = be._session(be.fp32_path)
    assert be._compare(fp32, fp32, tok) == pytest.approx(1.0)
    # the same number computed here: correlation of float32 and int8 scores over the gate's pairs
    pairs = [(q, t) for q in OB.CHECK_TEXTS[:4] for t in OB.CHECK_TEXTS]
    encs = tok.encode_batch(pairs)
    L = max(len(e.ids) for e in encs)
    feed = {k: np.zeros((len(encs), L), np.int64) for k in ("input_ids", "attention_mask", "token_type_ids")}
    for i, e in enumerate(encs):
        n = len(e.ids)
        feed["input_ids"][i, :n], feed["token_type_ids"][i, :n], feed["attention_mask"][i, :n] = e.ids, e.type_ids, 1
    scores = [sess.run(None, {i.name: feed[i.name] for i in sess.get_inputs()})[0][:, 0].astype(np.float64)
              for sess in (fp32, be.session)]
    corr = float(np.corrcoef(scores[0], scores[1])[0, 1])
    print("int8 reranker score correlation:", be.int8_cosine, "recomputed:", corr)
    assert be.int8_cosine == pytest.approx(corr, abs=1e-3)
    assert be.int8_cosine < 0.9999  # int8 moves the scores; the old per-row cosine said exactly 1.0


def test_export_cache_follows_new_weights_at_the_same_path(tmp_path):
    """A new model revision copied to the same path must not be served from the old export."""
    import onnxruntime as ort
    import torch
    from transformers import AutoModelForSequenceClassification

    from embedops_server.backends.onnx_export import model_file

    from .conftest import build_classifier

    model_dir, cache = tmp_path / "model", tmp_path / "cache"
    ids = np.array([[101, 7592, 2088, 102]], dtype=np.int64)

    def exported_logits():
        path = model_file(load_model_info(model_dir), str(cache))
        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
        names = {i.name for i in sess.get_inputs()}
        return path, sess.run(None, {k: v for k, v in feeds.items() if k in names})[0]

    build_classifier(model_dir, 3, seed=2)
    first_path, first = exported_logits()
    assert exported_logits()[0] == first_path  # unchanged folder: the export is reused
    build_classifier(model_dir, 3, seed=3)  # new weights, same folder
    second_path, second = exported_logits()
    assert second_path != first_path
    # the earlier revision's entry stays while it may be in use (held, or used within STALE_AFTER_SECONDS: a pod of
    # that revision may still run on a shared cache), and goes once stale, not piling up
    assert first_path.parent.exists()
    onnx_export.release(first_path.parent)
    week_later = time.time() + onnx_export.STALE_AFTER_SECONDS + 60
    assert onnx_export.prune_stale(cache, keep=second_path.parent, now=week_later) == [first_path.parent]
    assert [d.name for d in cache.iterdir()] == [second_path.parent.name]
    with torch.no_grad():
        ref = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()(
            input_ids=torch.from_numpy(ids)).logits.numpy()
    np.testing.assert_allclose(second, ref, atol=1e-4)
    assert not np.allclose(first, ref, atol=1e-3)
