"""bge-m3 layout (sparse_linear.pt, colbert_linear.pt): dense, sparse lexical weights and ColBERT vectors from
one forward, on torch and ONNX Runtime (float32 and int8), against FlagEmbedding's own BGEM3FlagModel on the
same folder. FlagEmbedding 1.4.2 needs transformers<5: it runs in a venv of its own (bench/flagembedding.py,
created once under ~/.cache/embedops, torch shared with the main venv through a .pth file)."""
from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest

from bench.m3_model import build_m3_folder
from localcluster.models import minilm_dir

from .conftest import TEXTS, run_server

M3_TEXTS = TEXTS + ["a rather long passage about retrieval and lexical matching " * 40]  # over 256: truncated
MAX_LEN = 256  # the test model's max_position_embeddings 258 minus XLM-R's offset


@pytest.fixture(scope="module")
def m3_dir(tmp_path_factory):
    return build_m3_folder(tmp_path_factory.mktemp("bge-m3-tiny"))


@pytest.fixture(scope="module")
def flag_ref(m3_dir):
    from bench.flagembedding import encode

    return encode(m3_dir, M3_TEXTS, max_length=MAX_LEN, threads=1)


def _cos_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1) + 1e-12)


def compare(got: list[dict], ref: dict) -> dict:
    """Agreement of a server's /embed_hybrid answer with FlagEmbedding's."""
    dense_cos = _cos_rows(np.array([g["dense"] for g in got]), ref["dense"])
    col_cos = np.concatenate([_cos_rows(np.array(g["colbert"]), r) for g, r in zip(got, ref["colbert"])])
    same_keys, max_diff, sparse_cos = True, 0.0, []
    for g, r in zip(got, ref["sparse"]):
        gd = {e["index"]: e["value"] for e in g["sparse"]}
        same_keys &= set(gd) == set(r)
        keys = sorted(set(gd) | set(r))
        a, b = np.array([gd.get(k, 0.0) for k in keys]), np.array([r.get(k, 0.0) for k in keys])
        if keys:  # the sparse vectors' cosine: how lexical-match scores agree
            sparse_cos.append(_cos_rows(a, b))
        max_diff = max([max_diff, *np.abs(a - b)])
    return {"dense_min_cos": float(dense_cos.min()), "colbert_min_cos": float(col_cos.min()),
            "colbert_mean_cos": float(col_cos.mean()), "sparse_same_keys": bool(same_keys),
            "sparse_max_abs_diff": float(max_diff), "sparse_min_cos": float(min(sparse_cos)),
            "colbert_rows_match": all(len(g["colbert"]) == len(r) for g, r in zip(got, ref["colbert"]))}


def test_reference_is_not_degenerate(flag_ref):
    """The widened random sparse head gives real weights (not all zero) and ColBERT rows are per token."""
    assert sum(len(d) for d in flag_ref["sparse"]) > 3 * len(M3_TEXTS)
    assert len(flag_ref["colbert"][-1]) == MAX_LEN - 1  # truncated to 256 tokens, the CLS's row dropped


@pytest.mark.parametrize("backend, quantize", [("torch", None), ("onnxruntime", None), ("onnxruntime", "int8")])
def test_matches_flagembedding(backend, quantize, m3_dir, flag_ref, tmp_path):
    kw = {"quantize": quantize, "int8_min_cosine": 0.9} if quantize else {}
    with run_server(model_id=str(m3_dir), backend=backend, onnx_cache=str(tmp_path), **kw) as (url, st):
        info = httpx.get(url + "/info").json()
        assert info["outputs"] == ["dense", "sparse", "colbert"] and info["colbert_dim"] == 64
        # the dense vector's int8 scale, measured at start through this backend's forward (core/quantize.py)
        assert 0 < info["int8"]["scale"] <= 1
        int8 = httpx.post(url + "/embed", json={"inputs": M3_TEXTS, "embedding_type": "int8"}, timeout=120).json()
        r = httpx.post(url + "/embed_hybrid", json={"inputs": M3_TEXTS}, timeout=120)
        assert r.status_code == 200, r.text
        got = r.json()
        assert [sorted(g) for g in got] == [["colbert", "dense", "sparse"]] * len(M3_TEXTS)
        # The separate routes return the same numbers as the combined request (same inputs, same batches).
        dense = httpx.post(url + "/embed", json={"inputs": M3_TEXTS}, timeout=120).json()
        sparse = httpx.post(url + "/embed_sparse", json={"inputs": M3_TEXTS}, timeout=120).json()
        colbert = httpx.post(url + "/embed_colbert", json={"inputs": M3_TEXTS}, timeout=120).json()
        b64 = httpx.post(url + "/embed_hybrid", json={"inputs": M3_TEXTS, "encoding_format": "base64"},
                         timeout=120).json()
    for g, d, s, c, b, q in zip(got, dense, sparse, colbert, b64, int8):
        assert np.allclose(g["dense"], d, atol=1e-6)
        assert np.array_equal(q, np.clip(np.rint(np.float32(d) * 127 / info["int8"]["scale"]), -127, 127))
        assert [e["index"] for e in g["sparse"]] == [e["index"] for e in s]
        assert np.allclose([e["value"] for e in g["sparse"]], [e["value"] for e in s], atol=1e-6)
        assert np.allclose(g["colbert"], c, atol=1e-6)
        assert np.array_equal(np.frombuffer(base64.b64decode(b["dense"]), "<f4"), np.float32(g["dense"]))
        assert np.array_equal(np.frombuffer(base64.b64decode(b["colbert"]), "<f4").reshape(-1, 64),
                              np.float32(g["colbert"]))
        assert b["sparse"] == g["sparse"]
    m = compare(got, flag_ref)
    print(f"\n{backend} {quantize or 'float32'} vs FlagEmbedding BGEM3FlagModel:", m)
    if quantize:
        print("server int8 gate (dense min cosine vs float32):", info["int8_cosine"])
        # int8 (dynamic, per-channel) on a random 2-layer model: stated agreement, judged like the int8 gate
        assert m["dense_min_cos"] >= 0.98 and m["colbert_mean_cos"] >= 0.98 and m["colbert_rows_match"]
        assert m["sparse_min_cos"] >= 0.98
        return
    assert m["dense_min_cos"] >= 0.9999
    assert m["colbert_min_cos"] >= 0.999 and m["colbert_rows_match"]
    assert m["sparse_same_keys"] and m["sparse_max_abs_diff"] <= 1e-4


def test_outputs_options_and_errors(m3_dir, tmp_path):
    one_head = build_m3_folder(tmp_path / "sparse-only", heads=("sparse",))
    with run_server(model_id=str(one_head), backend="torch", max_client_batch_size=4) as (url, st):
        assert httpx.get(url + "/info").json()["outputs"] == ["dense", "sparse"]
        r = httpx.post(url + "/embed_colbert", json={"inputs": ["hello"]})
        assert r.status_code == 424 and "colbert_linear.pt" in r.json()["error"], r.text
        assert r.json()["error_type"] == "Backend"
        r = httpx.post(url + "/embed_hybrid", json={"inputs": ["hello"], "outputs": ["dense", "colbert"]})
        assert r.status_code == 424, r.text
        r = httpx.post(url + "/embed_hybrid", json={"inputs": ["hello"]})  # default: what the model has
        assert r.status_code == 200 and sorted(r.json()[0]) == ["dense", "sparse"]
        r = httpx.post(url + "/embed_hybrid", json={"inputs": ["hello"], "outputs": ["sparse"]})
        assert list(r.json()[0]) == ["sparse"]
        for body in ({"inputs": ["hello"], "outputs": []}, {"inputs": ["hello"], "outputs": ["lexical"]},
                     {"inputs": ["a"] * 5}, {"inputs": ["hello"], "dimensions": 0},
                     {"inputs": [M3_TEXTS[-1]], "truncate": False}):
            r = httpx.post(url + "/embed_hybrid", json=body)
            assert r.status_code == 422 and r.json()["error_type"] == "Validation", (body, r.text)
        r = httpx.post(url + "/embed_hybrid", json={"inputs": "hello", "outputs": ["dense"], "dimensions": 16,
                                                    "normalize": False})
        assert r.status_code == 200 and len(r.json()[0]["dense"]) == 16
    with run_server(model_id=str(m3_dir), backend="torch") as (url, st):
        r = httpx.post(url + "/embed_colbert", json={"inputs": ["hello world"], "dimensions": 8})
        v = np.array(r.json()[0])
        assert v.shape == (3, 8) and np.allclose(np.linalg.norm(v, axis=1), 1, atol=1e-5)
        r = httpx.post(url + "/embed_colbert", json={"inputs": ["hello world"], "normalize": False})
        assert not np.allclose(np.linalg.norm(np.array(r.json()[0]), axis=1), 1, atol=1e-3)
    with run_server(model_id=str(minilm_dir()), backend="torch") as (url, st):
        assert httpx.get(url + "/info").json()["outputs"] == ["dense"]
        r = httpx.post(url + "/embed_sparse", json={"inputs": ["hello"]})
        assert r.status_code == 424 and "sparse_linear.pt" in r.json()["error"], r.text


def test_a_large_colbert_answer_is_streamed_and_says_the_same(m3_dir):
    """Over 65,536 numbers a ColBERT answer is made input by input and streamed (chunked, no Content-Length), so
    the server never holds the whole JSON body; what it says is what the whole-body path says. With normalize
    off, truncating to 64 dimensions is a prefix, and 64 x ~250 tokens stays under the streaming threshold."""
    long_text = M3_TEXTS[-1]
    with run_server(model_id=str(m3_dir), backend="torch") as (url, st):
        small = httpx.post(url + "/embed_colbert", json={"inputs": [long_text], "normalize": False,
                                                         "dimensions": 64})
        assert small.status_code == 200 and "content-length" in small.headers
        ref = np.array(small.json()[0])
        assert ref.shape[1] == 64 and ref.shape[0] * ref.shape[1] < 1 << 16
        body = {"inputs": [long_text] * 8, "normalize": False}
        big = httpx.post(url + "/embed_colbert", json=body)
        assert big.status_code == 200 and big.headers.get("transfer-encoding") == "chunked"
        assert "content-length" not in big.headers and big.headers["content-type"] == "application/json"
        rows = [np.array(r) for r in big.json()]
        assert len(rows) == 8 and all(r.shape == (ref.shape[0], rows[0].shape[1]) for r in rows)
        assert all(np.allclose(r[:, :64], ref, atol=1e-5) for r in rows)
        hybrid = httpx.post(url + "/embed_hybrid", json={**body, "encoding_format": "base64"})
        assert hybrid.headers.get("transfer-encoding") == "chunked"
        for r, got in zip(rows, hybrid.json()):
            assert sorted(got) == ["colbert", "dense", "sparse"]
            vecs = np.frombuffer(base64.b64decode(got["colbert"]), "<f4").reshape(r.shape)
            assert np.array_equal(vecs, r.astype(np.float32))
        assert httpx.get(url + "/health").status_code == 200


def test_head_files_read_without_torch(m3_dir, tmp_path):
    """The ONNX Runtime-only image has no torch: the heads' .pt files are read by a small zip/pickle reader."""
    import torch

    from embedops_server.backends.m3 import _read_torch_zip

    for name in ("sparse_linear.pt", "colbert_linear.pt"):
        ref = torch.load(m3_dir / name, weights_only=True)
        got = _read_torch_zip(m3_dir / name)
        assert set(got) == set(ref)
        for k in ref:
            assert np.array_equal(got[k], ref[k].numpy())
    half = tmp_path / "half.pt"
    w = torch.randn(4, 6)
    torch.save({"weight": w.half(), "bias": torch.randn(8)[::2].bfloat16()}, half)  # a strided view too
    got = _read_torch_zip(half)
    assert np.array_equal(got["weight"], w.half().float().numpy())
    assert got["bias"].shape == (4,)


def test_cuda_graph_compute_path_on_cpu(m3_dir):
    """What a CUDA graph captures for a batch with heads (_compute(heads=True) -> _head_output) equals the eager
    forward; run on CPU here (no GPU in CI), the capture itself is covered by the GPU profile."""
    import torch
    from tokenizers import Tokenizer

    from embedops_server.backends.torch_backend import TorchBackend
    from embedops_server.core.batch import Batch
    from embedops_server.core.model_info import load_model_info

    info = load_model_info(m3_dir)
    tok = Tokenizer.from_file(str(m3_dir / "tokenizer.json"))
    be = TorchBackend(info, threads=1, tokenizer=tok)
    encs = tok.encode_batch(TEXTS[:4])
    L = max(len(e.ids) for e in encs)
    ids = np.ones((4, L), np.int64)
    mask = np.zeros_like(ids)
    for i, e in enumerate(encs):
        ids[i, : len(e.ids)], mask[i, : len(e.ids)] = e.ids, 1
    batch = Batch(ids, mask, np.zeros_like(ids), mask.sum(1), heads=frozenset({"sparse", "colbert"}))
    eager = be.forward(batch)
    t = [torch.from_numpy(a) for a in (ids, mask, np.zeros_like(ids), mask.sum(1))]
    with torch.inference_mode():
        graphed = be._head_output(batch, *be._compute(*t, heads=True))
    assert np.allclose(eager.pooled, graphed.pooled, atol=1e-6)
    for (a, b), (c, d) in zip(eager.lexical, graphed.lexical):
        assert np.array_equal(a, c) and np.allclose(b, d, atol=1e-6)
    for a, b in zip(eager.colbert, graphed.colbert):
        assert np.allclose(a, b, atol=1e-6)
    assert all(len(c) == n - 1 for c, n in zip(eager.colbert, mask.sum(1)))


def test_outputs_flag_refuses_a_folder_without_the_heads(tmp_path):
    """--outputs (the operator's model.outputs): a missing head stops the start with one line naming the file,
    and /health answers 503 with it, instead of a Ready server answering 424 per request."""
    import time

    from embedops_server.cli import parse_args
    from embedops_server.core.model_info import ModelError, load_model_info
    from embedops_server.service import check_outputs

    one_head = build_m3_folder(tmp_path / "sparse-only", heads=("sparse",))
    info = load_model_info(str(one_head))
    check_outputs("dense,sparse", info)
    check_outputs(None, info)
    with pytest.raises(ModelError, match="asks for colbert but .* has no colbert_linear.pt"):
        check_outputs("dense,colbert", info)
    with pytest.raises(ModelError, match="lexical: not an output"):
        check_outputs("dense,lexical", info)
    with pytest.raises(ModelError, match="has no sparse_linear.pt"):
        check_outputs("sparse", load_model_info(str(minilm_dir())))
    assert parse_args(["--model-id", "m", "--outputs", "dense,colbert"]).outputs == "dense,colbert"
    with run_server(model_id=str(one_head), backend="torch", outputs="dense,colbert", wait=False) as (url, st):
        deadline = time.monotonic() + 60
        while st.load_error is None and time.monotonic() < deadline:
            time.sleep(0.1)
        r = httpx.get(url + "/health")
        assert r.status_code == 503 and "colbert_linear.pt" in r.text, r.text
