"""Embedding architectures beyond BERT load and match transformers (tiny random models built here)."""
from __future__ import annotations

import json
import shutil

import httpx
import numpy as np
import pytest
import torch

from localcluster.models import minilm_dir

from .conftest import TEXTS, cosine, run_server

SMALL = dict(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
             pad_token_id=0)


def _configs():
    from transformers import DistilBertConfig, MPNetConfig, ModernBertConfig, RobertaConfig, XLMRobertaConfig

    return {
        "roberta": RobertaConfig(**SMALL, max_position_embeddings=130, type_vocab_size=1),
        "xlm-roberta": XLMRobertaConfig(**SMALL, max_position_embeddings=130, type_vocab_size=1),
        "mpnet": MPNetConfig(**SMALL, max_position_embeddings=130),
        "distilbert": DistilBertConfig(vocab_size=30522, dim=64, n_layers=2, n_heads=2, hidden_dim=128,
                                       pad_token_id=0, max_position_embeddings=128),
        "modernbert": ModernBertConfig(**SMALL, max_position_embeddings=128, global_attn_every_n_layers=1,
                                       bos_token_id=101, eos_token_id=102, sep_token_id=102, cls_token_id=101),
    }


@pytest.fixture(scope="module")
def arch_dirs(tmp_path_factory):
    from transformers import AutoModel

    out = {}
    for name, cfg in _configs().items():
        d = tmp_path_factory.mktemp(name)
        torch.manual_seed(0)
        AutoModel.from_config(cfg).eval().save_pretrained(d)
        shutil.copy(minilm_dir() / "tokenizer.json", d / "tokenizer.json")
        (d / "1_Pooling").mkdir()
        (d / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
        out[name] = d
    return out


@pytest.mark.parametrize("arch", ["roberta", "xlm-roberta", "mpnet", "distilbert", "modernbert"])
def test_architecture_matches_transformers(arch, arch_dirs):
    from transformers import AutoModel
    from tokenizers import Tokenizer

    d = arch_dirs[arch]
    texts = TEXTS[:4]
    with run_server(model_id=str(d), backend="torch") as (url, st):
        r = httpx.post(url + "/embed", json={"inputs": texts, "normalize": False}, timeout=60)
        assert r.status_code == 200, r.text
        got = np.array(r.json())
        max_len = st.service.max_input_length
    model = AutoModel.from_pretrained(str(d)).eval()
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(max_len)
    for text, vec in zip(texts, got):
        ids = torch.tensor([tok.encode(text).ids])
        with torch.no_grad():
            h = model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state[0]
        assert cosine(vec, h.mean(0).numpy()) >= 0.9999, arch


@pytest.mark.parametrize("arch", ["roberta", "xlm-roberta", "mpnet", "distilbert", "modernbert"])
def test_auto_backend_on_cpu_exports_to_onnx(arch, arch_dirs, tmp_path):
    """--backend auto on CPU: ONNX Runtime with an export made at start (torch only if export fails)."""
    d = arch_dirs[arch]
    with run_server(model_id=str(d), onnx_cache=str(tmp_path)) as (url, st):
        got = np.array(httpx.post(url + "/embed", json={"inputs": TEXTS[:3], "normalize": False}).json())
        backend = st.service.backend.name
    with run_server(model_id=str(d), backend="torch") as (url, st):
        ref = np.array(httpx.post(url + "/embed", json={"inputs": TEXTS[:3], "normalize": False}).json())
    print(arch, "auto backend:", backend)
    assert backend == "onnxruntime", f"{arch}: ONNX export failed, fell back to {backend}"
    assert cosine(got, ref).min() >= 0.9999


@pytest.mark.parametrize("pooling, backend", [("cls", "torch"), ("last-token", "torch"), ("cls", "onnxruntime"),
                                              ("last-token", "onnxruntime")])
def test_pooling_modes(pooling, backend, arch_dirs, tmp_path):
    from tokenizers import Tokenizer
    from transformers import AutoModel

    d = arch_dirs["distilbert"]
    texts = TEXTS[:3]
    with run_server(model_id=str(d), backend=backend, pooling=pooling, onnx_cache=str(tmp_path)) as (url, st):
        got = np.array(httpx.post(url + "/embed", json={"inputs": texts, "normalize": False}).json())
        assert httpx.get(url + "/info").json()["model_type"]["embedding"]["pooling"] == pooling
    model = AutoModel.from_pretrained(str(d)).eval()
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tok.no_padding()
    for text, vec in zip(texts, got):
        ids = torch.tensor([tok.encode(text).ids])
        with torch.no_grad():
            h = model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state[0]
        ref = h[0] if pooling == "cls" else h[-1]
        assert cosine(vec, ref.numpy()) >= 0.9999


def test_bfloat16_torch_on_cpu(st_model):
    with run_server(model_id=str(minilm_dir()), backend="torch", dtype="bfloat16") as (url, st):
        assert httpx.get(url + "/info").json()["model_dtype"] == "bfloat16"
        got = np.array(httpx.post(url + "/embed", json={"inputs": TEXTS}).json())
    cos = cosine(got, st_model.encode(TEXTS, normalize_embeddings=True))
    print("bfloat16 cosines", cos.min())
    assert cos.min() >= 0.99
