"""The seed's models at their real size, with random weights (no hub here): bge-m3 and bge-reranker-v2-m3.

Both are XLM-RoBERTa-large encoders: 24 layers, hidden 1024, 16 heads, intermediate 4096, vocabulary 250002,
8194 positions (8192 tokens), 566.7M parameters (+1M for the reranker's classifier). Built once per machine
into ``~/.cache/embedops/real-size`` (``$EMBEDOPS_BENCH_CACHE``, else ``$EMBEDOPS_CACHE``), ~2.3 GB each, in the layout the Hub
repositories ship:

* ``bge_m3()``: XLMRobertaModel safetensors, sentence-transformers files (CLS pooling, Normalize),
  FlagEmbedding's ``sparse_linear.pt`` (1024 -> 1) and ``colbert_linear.pt`` (1024 -> 1024), and
  ``onnx/model.onnx`` with its weights in ``onnx/model.onnx_data`` (external data), as BAAI/bge-m3 does.
* ``bge_reranker()``: XLMRobertaForSequenceClassification with one label, safetensors only (as
  BAAI/bge-reranker-v2-m3).

The tokenizer is a Unigram model with 250002 pieces behind XLM-R's Metaspace pre-tokenizer and
``<s> A </s></s> B </s>`` template: the real one's size and kind (a tokenizer instance's memory, the
embedding matrix's rows), not its pieces (texts tokenize into different, but as many, tokens).

``python -m bench.real_size`` builds both and prints their folders.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

CACHE = Path(os.environ.get("EMBEDOPS_BENCH_CACHE") or os.environ.get("EMBEDOPS_CACHE")
             or Path.home() / ".cache" / "embedops") / "real-size"
GEOMETRY = dict(vocab_size=250002, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                intermediate_size=4096, max_position_embeddings=8194, type_vocab_size=1, pad_token_id=1,
                bos_token_id=0, eos_token_id=2, layer_norm_eps=1e-5)
SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]
VERSION = "1"  # bump when what is built changes: the cached folders are rebuilt


def _tokenizer_json(vocab_size: int) -> dict:
    """A 250002-piece Unigram tokenizer in XLM-R's shape: specials 0-3, then pieces scored like a real
    SentencePiece model (frequent short pieces first). Pieces: every WordPiece of all-MiniLM-L6-v2 with and
    without the word-start mark, then generated letter pairs and triples, then numbered fillers."""
    import itertools
    import string

    from bench.models import minilm_dir

    words = [w for w in json.loads((minilm_dir() / "tokenizer.json").read_text())["model"]["vocab"]
             if not w.startswith("[")]
    pieces: list[str] = []
    seen = set(SPECIALS)

    def add(p: str) -> None:
        if p not in seen:
            seen.add(p)
            pieces.append(p)

    for w in words:
        add("\u2581" + w.removeprefix("##"))
        add(w.removeprefix("##"))
    letters = string.ascii_lowercase
    for n in (2, 3):
        for t in itertools.product(letters, repeat=n):
            add("".join(t))
            add("\u2581" + "".join(t))
    i = 0
    while len(pieces) < vocab_size - len(SPECIALS):
        add(f"\u2581x{i}")
        i += 1
    vocab = [[s, 0.0] for s in SPECIALS] + [[p, -2.0 - 14.0 * k / len(pieces)] for k, p in enumerate(pieces)]
    s = lambda tok: {"SpecialToken": {"id": tok, "type_id": 0}}  # noqa: E731
    a, b = {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 0}}
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i, t in enumerate(SPECIALS)],
        "normalizer": {"type": "Sequence", "normalizers": [{"type": "NFKC"}, {"type": "Lowercase"}]},
        "pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": True},
        "post_processor": {
            "type": "TemplateProcessing", "single": [s("<s>"), a, s("</s>")],
            "pair": [s("<s>"), a, s("</s>"), s("</s>"), b, s("</s>")],
            "special_tokens": {t: {"id": t, "ids": [SPECIALS.index(t)], "tokens": [t]} for t in ("<s>", "</s>")}},
        "decoder": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": True},
        "model": {"type": "Unigram", "unk_id": 3, "vocab": vocab, "byte_fallback": False},
    }


def _tokenizer_files(out: Path) -> None:
    (out / "tokenizer.json").write_text(json.dumps(_tokenizer_json(GEOMETRY["vocab_size"]), ensure_ascii=False))
    names = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "sep_token": "</s>",
             "pad_token": "<pad>", "cls_token": "<s>", "mask_token": "<unk>"}
    (out / "special_tokens_map.json").write_text(json.dumps(names))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "XLMRobertaTokenizer", "model_max_length": 8192, **names}))


def _build(name: str, make) -> Path:
    out = CACHE / name
    stamp = out / ".built"
    if stamp.exists() and stamp.read_text() == VERSION:
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    make(tmp)
    for f in tmp.rglob("*"):  # as a Hub download leaves them: readable by the pod's non-root user
        f.chmod(0o755 if f.is_dir() else 0o644)
    (tmp / ".built").write_text(VERSION)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def _make_m3(out: Path) -> None:
    import torch
    from transformers import XLMRobertaConfig, XLMRobertaModel

    torch.manual_seed(0)
    cfg = XLMRobertaConfig(**GEOMETRY, architectures=["XLMRobertaModel"])
    model = XLMRobertaModel(cfg, add_pooling_layer=False).eval()
    model.save_pretrained(out, safe_serialization=True)
    _tokenizer_files(out)
    (out / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 1024, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}))
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 8192, "do_lower_case": False}))
    g = torch.Generator().manual_seed(1)
    torch.save({"weight": torch.randn(1, 1024, generator=g) * 0.03, "bias": torch.zeros(1)},
               out / "sparse_linear.pt")
    torch.save({"weight": torch.randn(1024, 1024, generator=g) * 0.03, "bias": torch.zeros(1024)},
               out / "colbert_linear.pt")
    del model
    _hub_onnx(out)


def _hub_onnx(out: Path) -> None:
    """onnx/model.onnx + onnx/model.onnx_data, exported by the server's own exporter (token states, eager
    attention) in a scratch cache, then moved under the Hub's names."""
    import onnx

    from embedops_server.backends.onnx_export import export_onnx, external_data_suffix
    from embedops_server.core.model_info import load_model_info

    scratch = out / ".export"
    scratch.mkdir()
    graph = export_onnx(load_model_info(out), scratch)
    (out / "onnx").mkdir()
    data = external_data_suffix(graph)
    os.replace(data, out / "onnx" / "model.onnx_data")
    model = onnx.load(str(graph), load_external_data=False)
    for t in model.graph.initializer:
        for entry in t.external_data:
            if entry.key == "location":
                entry.value = "model.onnx_data"
    onnx.save_model(model, str(out / "onnx" / "model.onnx"))
    shutil.rmtree(scratch)


def _make_reranker(out: Path) -> None:
    import torch
    from transformers import XLMRobertaConfig, XLMRobertaForSequenceClassification

    torch.manual_seed(2)
    cfg = XLMRobertaConfig(**GEOMETRY, num_labels=1, architectures=["XLMRobertaForSequenceClassification"])
    XLMRobertaForSequenceClassification(cfg).eval().save_pretrained(out, safe_serialization=True)
    _tokenizer_files(out)


def bge_m3() -> Path:
    """bge-m3's geometry and Hub layout (safetensors, heads, onnx/ with external data), random weights."""
    return _build("bge-m3", _make_m3)


def bge_reranker() -> Path:
    """bge-reranker-v2-m3's geometry (XLM-R-large cross-encoder, one label), random weights."""
    return _build("bge-reranker-v2-m3", _make_reranker)


def parameters(folder: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "np") as f:
        return sum(int(__import__("math").prod(f.get_slice(k).get_shape())) for k in f.keys())


if __name__ == "__main__":
    for build in (bge_m3, bge_reranker):
        path = build()
        print(f"{path}  {parameters(path) / 1e6:.1f}M parameters")
