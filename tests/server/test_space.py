"""The embedding space: one fingerprint on every route's response and in /info, equal for every server of the same
model and settings whatever its backend or dtype, different when the vectors change (core/space.py; the numbers
behind what counts: `python -m bench.space`)."""
from __future__ import annotations

import shutil

import httpx
import pytest

from bench.m3_model import build_m3_folder
from embedops_server.core.space import file_digest, model_digest
from localcluster.models import minilm_dir, splade_dir

from .conftest import run_server

ROUTES = [("/embed", {"inputs": ["hello"]}), ("/embed_all", {"inputs": "hello"}),
          ("/v1/embeddings", {"input": ["hello"], "model": "m"}), ("/v1/embeddings", {"input": "hello", "model": "m"}),
          ("/similarity", {"inputs": {"source_sentence": "a", "sentences": ["b"]}}),
          ("/", {"inputs": ["hello"]})]


def spaces(url: str, routes) -> set[str]:
    seen = set()
    for path, body in routes:
        r = httpx.post(url + path, json=body)
        assert r.status_code == 200, (path, r.text)
        seen.add(r.headers.get("embedding-space"))
    info = httpx.get(url + "/info").json()
    seen.add(info["embedding_space"])
    return seen


def test_every_route_and_info_name_one_space_and_backends_and_dtypes_share_it():
    with run_server(model_id=str(minilm_dir()), backend="onnxruntime") as (url, _):
        ort = spaces(url, ROUTES)
        info = httpx.get(url + "/info").json()
        assert info["embedding_space_inputs"]["pooling"] == "mean"
        assert info["embedding_space_inputs"]["quantize"] is None
        r = httpx.post(url + "/embed", json={"inputs": [""]})  # an error the model did not answer: no header
        assert r.status_code == 400 and "embedding-space" not in r.headers
    with run_server(model_id=str(minilm_dir()), backend="torch", dtype="bfloat16") as (url, _):
        torch = spaces(url, ROUTES)
    assert len(ort) == 1 and None not in ort and ort == torch  # bfloat16: cosine 0.99993 with float32


@pytest.mark.parametrize("change", [{"quantize": "int8", "backend": "onnxruntime"}, {"pooling": "cls"},
                                    {"default_prompt": "query: "}, {"max_input_length": 128}])
def test_what_changes_the_vectors_changes_the_space(change):
    with run_server(model_id=str(minilm_dir()), backend=change.pop("backend", "torch")) as (url, _):
        base = spaces(url, ROUTES[:1])
    with run_server(model_id=str(minilm_dir()), backend="onnxruntime", **change) as (url, _):
        other = spaces(url, ROUTES[:1])
    assert len(other) == 1 and other != base


def test_the_model_is_known_by_its_content_not_its_path(tmp_path):
    """A copy of the same files elsewhere (another volume, another commit folder) is the same space; one changed
    byte in the middle of the weights is another."""
    copy = tmp_path / "copy"
    shutil.copytree(minilm_dir(), copy)
    assert model_digest(copy) == model_digest(minilm_dir())
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    before = file_digest(weights)
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert file_digest(weights) != before and model_digest(copy) != model_digest(minilm_dir())


def test_sparse_and_multi_output_routes_carry_it(tmp_path):
    with run_server(model_id=str(splade_dir()), backend="torch") as (url, _):
        assert len(spaces(url, [("/embed_sparse", {"inputs": ["hello"]})])) == 1
    m3 = build_m3_folder(tmp_path / "m3")
    with run_server(model_id=str(m3), backend="torch") as (url, _):
        seen = spaces(url, [("/embed_hybrid", {"inputs": ["hello"]}), ("/embed_colbert", {"inputs": ["hello"]}),
                            ("/embed_sparse", {"inputs": ["hello"]}), ("/embed", {"inputs": ["hello"]})])
        assert len(seen) == 1 and None not in seen
