"""sentence-transformers Dense projections after pooling (LaBSE-, embeddinggemma-style models): served
vectors match sentence-transformers itself on both backends; modules the server cannot reproduce are refused."""
from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from embedops_server.core.model_info import ModelError, load_model_info
from localcluster.models import minilm_dir

from .conftest import TEXTS, cosine, run_server


@pytest.fixture(scope="module")
def dense_model(tmp_path_factory):
    """all-MiniLM-L6-v2 + Dense(384->128, tanh) + Dense(128->64, identity), no Normalize, saved by
    sentence-transformers (random projection weights, fixed seed)."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.models import Dense, Pooling, Transformer

    torch.manual_seed(7)
    path = tmp_path_factory.mktemp("st-dense")
    st = SentenceTransformer(modules=[Transformer(str(minilm_dir())), Pooling(384, "mean"), Dense(384, 128),
                                      Dense(128, 64, activation_function=torch.nn.Identity())], device="cpu")
    st.save(str(path))
    return path, st.encode(TEXTS, convert_to_numpy=True)


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_dense_projection_matches_sentence_transformers(dense_model, backend, tmp_path):
    path, want = dense_model
    with run_server(model_id=str(path), backend=backend, onnx_cache=str(tmp_path)) as (url, st):
        assert httpx.get(url + "/info").json()["hidden_size"] == 64
        got = np.array(httpx.post(url + "/embed", json={"inputs": TEXTS, "normalize": False}).json())
        assert got.shape == (len(TEXTS), 64)
        np.testing.assert_allclose(got, want, atol=2e-4)
        unit = np.array(httpx.post(url + "/v1/embeddings", json={"input": TEXTS[:2]}).json()["data"][0]["embedding"])
        assert cosine(unit[None], want[:1]).min() >= 0.9999 and abs(np.linalg.norm(unit) - 1) < 1e-4
        assert len(httpx.post(url + "/embed", json={"inputs": "x", "dimensions": 32}).json()[0]) == 32
        r = httpx.post(url + "/embed", json={"inputs": "x", "dimensions": 65})
        assert r.status_code == 422 and "between 1 and 64" in r.json()["error"]


def test_modules_the_server_cannot_reproduce_are_refused(dense_model, tmp_path):
    import shutil

    path, _ = dense_model
    copy = tmp_path / "m"
    shutil.copytree(path, copy)
    modules = json.loads((copy / "modules.json").read_text())
    modules.append({"idx": len(modules), "name": "x", "path": "x_LayerNorm",
                    "type": "sentence_transformers.models.LayerNorm"})
    (copy / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ModelError, match="unsupported sentence-transformers module .*LayerNorm"):
        load_model_info(copy)
    cfg_path = next(copy.glob("2_Dense/config.json"))
    cfg = json.loads(cfg_path.read_text())
    cfg["activation_function"] = "my_package.Swish"
    cfg_path.write_text(json.dumps(cfg))
    modules.pop()
    (copy / "modules.json").write_text(json.dumps(modules))
    from embedops_server.backends.dense import load_dense
    with pytest.raises(ModelError, match="unsupported Dense activation"):
        load_dense(load_model_info(copy).dense)


@pytest.mark.parametrize("cfg, want", [
    ({"embedding_dimension": 384, "pooling_mode": "mean", "include_prompt": True}, "mean"),  # sentence-transformers 6
    ({"embedding_dimension": 384, "pooling_mode": ["cls"]}, "cls"),
    ({"embedding_dimension": 384, "pooling_mode": "lasttoken"}, "last-token"),
    ({"word_embedding_dimension": 384, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, "cls"),
    ({"word_embedding_dimension": 384, "pooling_mode_mean_tokens": True}, "mean"),
    ({"word_embedding_dimension": 384, "pooling_mode_lasttoken": True}, "last-token"),
    ({"embedding_dimension": 384, "pooling_mode": "max"}, None),
    ({"embedding_dimension": 384, "pooling_mode": ["cls", "mean"]}, None),  # concatenated: not implemented
    ({"word_embedding_dimension": 384, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}, None),
    ({"word_embedding_dimension": 384, "pooling_mode_weightedmean_tokens": True}, None),
])
def test_pooling_configs_old_and_new(cfg, want, tmp_path):
    import shutil

    src = minilm_dir()
    for name in ("config.json", "tokenizer.json", "modules.json", "model.safetensors"):
        if (src / name).exists():
            shutil.copy(src / name, tmp_path / name)
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(cfg))
    if want is None:
        with pytest.raises(ModelError, match="unsupported sentence-transformers pooling"):
            load_model_info(tmp_path)
        assert load_model_info(tmp_path, pooling="mean").pooling == "mean"  # --pooling overrides
    else:
        assert load_model_info(tmp_path).pooling == want


def test_dense_path_picks_one_of_the_dense_modules_a_model_ships_and_its_space(dense_model, tmp_path):
    """TEI's --dense-path (issue 54): a model that ships Dense modules for several output sizes (2_Dense_32 beside
    modules.json's) serves the one named; the Dense module applied is part of the embedding space. A folder that
    is not a Dense module, or outside the model's, is refused at start."""
    import shutil

    import torch
    from sentence_transformers.models import Dense

    from embedops_server.core.space import fingerprint

    path, _ = dense_model
    copy = tmp_path / "m"
    shutil.copytree(path, copy)
    torch.manual_seed(11)
    (copy / "2_Dense_32").mkdir()
    Dense(384, 32).save(str(copy / "2_Dense_32"))
    default, small = load_model_info(copy), load_model_info(copy, dense_path="2_Dense_32")
    assert [d.name for d in default.dense] == ["2_Dense", "3_Dense"] and small.dense == (copy / "2_Dense_32",)
    space = lambda info: fingerprint(info, quantize=None, default_prompt=None, max_input_length=256)  # noqa: E731
    assert space(default).fingerprint != space(small).fingerprint
    for bad in ("no_such_folder", "../m", "1_Pooling", "modules.json"):
        with pytest.raises(ModelError, match="--dense-path"):
            load_model_info(copy, dense_path=bad)
    with run_server(model_id=str(copy), backend="onnxruntime", onnx_cache=str(tmp_path / "c"),
                    dense_path="2_Dense_32") as (url, st):
        assert httpx.get(url + "/info").json()["hidden_size"] == 32
        assert len(httpx.post(url + "/embed", json={"inputs": "x"}).json()[0]) == 32
