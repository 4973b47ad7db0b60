"""Cohere's v2 embed route (issue 56): Cohere's own SDK works unchanged against it, and every served type agrees
with the reference: float with the TEI route's normalized vector, binary and ubinary with sentence-transformers'
`quantize_embeddings`, base64 with the float vector's little-endian float32 bytes. int8 and uint8, which need the
embedding space's calibration ranges, are refused with a 422 that says so, never answered from ranges of its own."""
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
    for types in (["int8"], ["float", "uint8"]):
        r = httpx.post(url, json={"texts": TEXTS, "embedding_types": types}, timeout=60)
        assert r.status_code == 422 and "ranges per dimension" in r.json()["error"], r.text
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
        packed = httpx.post(minilm_ort + "/v1/embeddings", json={"input": TEXTS, "model": "m", "embedding_type": kind,
                                                                 "encoding_format": "base64"}, timeout=60).json()["data"]
        raw = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype=np.int8 if kind == "binary"
                                      else np.uint8) for d in packed])
        assert np.array_equal(raw, quantize.as_type(ref, kind))
    for route, body in (("/embed", {"inputs": TEXTS, "embedding_type": "int8"}),
                        ("/v1/embeddings", {"input": TEXTS, "embedding_type": "uint8"})):
        r = httpx.post(minilm_ort + route, json=body, timeout=60)
        assert r.status_code == 422 and "ranges per dimension" in r.text, r.text
