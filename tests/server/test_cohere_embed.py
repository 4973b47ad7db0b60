"""Cohere's v2 embed route (issue 56): Cohere's own SDK works unchanged against it, and every served type agrees
with the reference: float with the TEI route's normalized vector, binary and ubinary with sentence-transformers'
`quantize_embeddings`, base64 with the float vector's little-endian float32 bytes, int8 and uint8 the float vector
at the space's one scale (core/quantize.py), which /info shows, so that a client can check or undo it."""
from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest

from embedops_server.core import quantize

TEXTS = ["Binary vectors keep the sign of each dimension.", "A vector database bill is mostly vector bytes.",
         "Rescoring the binary top hits with float vectors recovers most of the recall."]


def test_binary_packing_is_the_references():
    from sentence_transformers.util.quantization import quantize_embeddings

    rng = np.random.default_rng(0)
    for d in (384, 768, 1024, 100):  # 100: the last byte zero-padded
        v = rng.standard_normal((5, d)).astype(np.float32)
        assert np.array_equal(quantize.ubinary(v), quantize_embeddings(v, precision="ubinary"))
        assert np.array_equal(quantize.binary(v), quantize_embeddings(v, precision="binary"))
        assert quantize.binary(v).dtype == np.int8 and quantize.ubinary(v).dtype == np.uint8



def test_int8_is_one_symmetric_scale():
    v = np.array([[0.5, -0.25, 0.0, 0.9, -2.0]], dtype=np.float32)
    assert quantize.int8(v, 0.5).tolist() == [[127, -64, 0, 127, -127]]  # clipped to -127..127, zero stays zero
    assert quantize.uint8(v, 0.5).tolist() == [[255, 64, 128, 255, 1]]
    assert quantize.significant(0.276543) == 0.277 and quantize.significant(0.0012345) == 0.00123
    rng = np.random.default_rng(0)
    unit = rng.standard_normal((500, 384)).astype(np.float32)
    unit /= np.linalg.norm(unit, axis=1, keepdims=True)
    scale = quantize.Int8Scale(unit)
    # the 0.9999 quantile of |components| of unit vectors of 384 Gaussian dimensions: ~3.9 sigma, sigma = 1/sqrt(384)
    assert 0.17 < scale.scale < 0.22 and scale.for_dimensions(384) == scale.scale
    assert scale.for_dimensions(96) > 1.8 * scale.scale  # truncated and renormalized: larger components


def test_calibration_words_are_whole_words_of_any_tokenizer():
    wordpiece = {"[PAD]": 0, "[unused3]": 1, "the": 2, "##ing": 3, "cat": 4, "a": 5, "naïve": 6, "12th": 7, "house": 8,
                 "\u4e2d": 9}
    assert quantize.calibration_words(wordpiece) == ["the", "cat", "naïve", "house", "\u4e2d"]
    sentencepiece = {"<s>": 0, "\u2581the": 1, "ing": 2, "\u2581ab": 3, "\u2581house": 4}
    assert quantize.calibration_words(sentencepiece) == ["the", "ing", "house"]
    many = {f"w{'x' * (i % 7)}{chr(97 + i % 26)}{chr(97 + i // 26 % 26)}": i for i in range(5000)}
    words = quantize.calibration_words({k: v for k, v in many.items() if k.isalpha()}, n=256)
    assert len(words) == 256 and words == quantize.calibration_words(dict(reversed(list(many.items()))), n=256)

def test_cohere_sdk_gets_every_served_type(minilm_ort):
    import cohere

    co = cohere.ClientV2(api_key="unused", base_url=minilm_ort, timeout=60)
    r = co.embed(texts=TEXTS, model="minilm", input_type="search_document",
                 embedding_types=["float", "binary", "ubinary", "base64"])
    ref = np.array(httpx.post(minilm_ort + "/embed", json={"inputs": TEXTS}, timeout=60).json(), dtype=np.float32)
    got = np.array(r.embeddings.float_, dtype=np.float32)
    assert got.shape == (3, 384) and np.allclose(got, ref, atol=1e-6)
    assert np.array_equal(np.array(r.embeddings.binary), quantize.binary(ref))
    assert np.array_equal(np.array(r.embeddings.ubinary), quantize.ubinary(ref))
    assert len(r.embeddings.binary[0]) == 48  # 384 bits: 32x fewer bytes than float32
    decoded = np.stack([np.frombuffer(base64.b64decode(b), dtype="<f4") for b in r.embeddings.base64])
    assert np.array_equal(decoded, got)
    assert r.texts == TEXTS and r.meta.billed_units.input_tokens > 0
    scale = httpx.get(minilm_ort + "/info", timeout=60).json()["int8"]["scale"]
    r = co.embed(texts=TEXTS, model="minilm", input_type="search_document", embedding_types=["int8", "uint8"])
    assert np.array_equal(np.array(r.embeddings.int8), quantize.int8(ref, scale))
    assert np.array_equal(np.array(r.embeddings.uint8), np.array(r.embeddings.int8) + 128)


def test_options_truncation_and_refusals(minilm_ort):
    url = minilm_ort + "/v2/embed"
    r = httpx.post(url, json={"texts": TEXTS[:1], "embedding_types": ["float", "ubinary"], "output_dimension": 64},
                   timeout=60)
    assert r.status_code == 200, r.text
    e = r.json()["embeddings"]
    assert len(e["float"][0]) == 64 and len(e["ubinary"][0]) == 8
    assert np.isclose(np.linalg.norm(e["float"][0]), 1.0, atol=1e-5)  # truncated, then normalized, as Cohere's
    assert r.json()["response_type"] == "embeddings_by_type"
    long = "a text far longer than the model's input limit " * 200
    assert httpx.post(url, json={"texts": [long], "truncate": "NONE"}, timeout=60).status_code in (413, 422)
    start = httpx.post(url, json={"texts": [long], "truncate": "START"}, timeout=60).json()["embeddings"]["float"]
    end = httpx.post(url, json={"texts": [long], "truncate": "END"}, timeout=60).json()["embeddings"]["float"]
    assert not np.allclose(start, end)
    r = httpx.post(url, json={"texts": TEXTS[:1], "embedding_types": ["float", "int8"], "output_dimension": 64},
                   timeout=60).json()["embeddings"]
    scale = httpx.get(minilm_ort + "/info", timeout=60).json()["int8"]["scale"]
    # a truncated, renormalized vector has larger components: its scale is measured on vectors truncated alike
    # (the full vector's would leave it a narrower range of integers and clip its largest components)
    f, i = np.array(r["float"], dtype=np.float32), np.array(r["int8"], dtype=np.float32)
    assert i.shape == (1, 64) and np.corrcoef(f[0], i[0])[0, 1] > 0.999
    assert np.abs(f).max() * 127 / np.abs(i).max() > 1.5 * scale
    for bad in ({"texts": []}, {"texts": TEXTS, "embedding_types": ["int4"]}, {"texts": TEXTS, "truncate": "MIDDLE"},
                {"texts": TEXTS, "input_type": "image"}):
        r = httpx.post(url, json=bad, timeout=60)
        assert r.status_code in (400, 422) and "error" in r.json(), (bad, r.text)


@pytest.mark.parametrize("input_type, prompt", [("search_query", "query: "), ("search_document", "passage: ")])
def test_input_type_picks_the_models_prompt_of_that_name(tmp_path, input_type, prompt):
    """A model that declares prompts (e5's `query: ` / `passage: `): Cohere's input_type selects them."""
    import json
    import shutil

    from localcluster.models import minilm_onnx_dir

    from .conftest import run_server

    model = tmp_path / "with-prompts"
    shutil.copytree(minilm_onnx_dir(), model)
    cfg = model / "config_sentence_transformers.json"
    st_cfg = json.loads(cfg.read_text()) if cfg.exists() else {}
    st_cfg["prompts"] = {"query": "query: ", "passage": "passage: "}
    cfg.write_text(json.dumps(st_cfg))
    with run_server(model_id=str(model), backend="onnxruntime", pooling="mean") as (url, _):
        got = httpx.post(url + "/v2/embed", json={"texts": TEXTS[:1], "input_type": input_type}, timeout=60).json()
        ref = httpx.post(url + "/embed", json={"inputs": [prompt + TEXTS[0]]}, timeout=60).json()
        assert np.allclose(got["embeddings"]["float"], ref, atol=1e-6)


def test_tei_and_openai_routes_take_the_same_types(minilm_ort):
    """The extension field `embedding_type` on /embed and /v1/embeddings (OpenAI's base64: the packed bytes)."""
    ref = np.array(httpx.post(minilm_ort + "/embed", json={"inputs": TEXTS}, timeout=60).json(), dtype=np.float32)
    for kind in ("binary", "ubinary"):
        got = httpx.post(minilm_ort + "/embed", json={"inputs": TEXTS, "embedding_type": kind}, timeout=60).json()
        assert np.array_equal(np.array(got), quantize.as_type(ref, kind)), kind
        oa = httpx.post(minilm_ort + "/v1/embeddings", json={"input": TEXTS, "model": "m", "embedding_type": kind},
                        timeout=60).json()["data"]
        assert np.array_equal(np.array([d["embedding"] for d in oa]), quantize.as_type(ref, kind))
        body = {"input": TEXTS, "model": "m", "embedding_type": kind, "encoding_format": "base64"}
        packed = httpx.post(minilm_ort + "/v1/embeddings", json=body, timeout=60).json()["data"]
        raw = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype=np.int8 if kind == "binary"
                                      else np.uint8) for d in packed])
        assert np.array_equal(raw, quantize.as_type(ref, kind))
    scale = httpx.get(minilm_ort + "/info", timeout=60).json()["int8"]["scale"]
    for kind, dtype in (("int8", np.int8), ("uint8", np.uint8)):
        want = quantize.as_type(ref, kind, scale)
        got = httpx.post(minilm_ort + "/embed", json={"inputs": TEXTS, "embedding_type": kind}, timeout=60).json()
        assert np.array_equal(np.array(got), want) and len(got[0]) == 384, kind
        body = {"input": TEXTS, "model": "m", "embedding_type": kind, "encoding_format": "base64"}
        packed = httpx.post(minilm_ort + "/v1/embeddings", json=body, timeout=60).json()["data"]
        raw = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype=dtype) for d in packed])
        assert np.array_equal(raw, want) and raw.nbytes == 3 * 384  # 4x fewer bytes than float32
    r = httpx.post(minilm_ort + "/embed", json={"inputs": TEXTS, "embedding_type": "int8", "normalize": False},
                   timeout=60)
    assert r.status_code == 422 and "normalized" in r.json()["error"], r.text


def test_int8_ranks_like_float(minilm_ort):
    """What an index does with int8 vectors: compares them as they are. One scale for the space changes every dot
    product by the same factor, so the ranking is float32's up to rounding."""
    docs = ["The capital of France is Paris.", "Bananas are rich in potassium.", "A GPU runs many threads at once.",
            "Rust has no garbage collector.", "The Nile flows north into the Mediterranean."]
    queries = ["Which city is France's capital?", "What fruit has potassium?", "Which river ends in the Mediterranean?"]
    body = {"embedding_types": ["float", "int8"]}
    d = httpx.post(minilm_ort + "/v2/embed", json={"texts": docs, **body}, timeout=60).json()["embeddings"]
    q = httpx.post(minilm_ort + "/v2/embed", json={"texts": queries, **body}, timeout=60).json()["embeddings"]
    by_float = np.argsort(-(np.array(q["float"]) @ np.array(d["float"]).T), axis=1)
    by_int8 = np.argsort(-(np.array(q["int8"], dtype=np.int32) @ np.array(d["int8"], dtype=np.int32).T), axis=1)
    assert np.array_equal(by_float[:, 0], [0, 1, 4]) and np.array_equal(by_int8, by_float)
    scale = httpx.get(minilm_ort + "/info", timeout=60).json()["int8"]["scale"]
    undone = np.array(d["int8"]) * scale / 127  # what a client that needs floats back computes
    assert np.abs(undone - np.array(d["float"])).max() <= scale / 127 / 2 + 1e-6

