"""Model folders the bench uses: the bundled all-MiniLM-L6-v2 (and its ONNX export), and random-weight
models of given shapes built on demand into ~/.cache/embedops/bench-models (never downloaded)."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from localcluster.models import minilm_dir, minilm_onnx_dir

CACHE = Path(os.environ.get("EMBEDOPS_BENCH_CACHE") or os.environ.get("EMBEDOPS_CACHE")
             or Path.home() / ".cache" / "embedops")


def minilm_onnx_file() -> Path:
    return minilm_onnx_dir() / "onnx" / "model.onnx"


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        if (src / name).exists():
            shutil.copy2(src / name, dst / name)


def random_model(kind: str, *, hidden: int, layers: int, heads: int, intermediate: int,
                 vocab_from: Path | None = None, max_pos: int = 512, vocab_size: int | None = None,
                 model_type: str = "bert", seed: int = 0, save_dtype: str = "float32") -> Path:
    """Build (once) a random-weight model folder.

    ``kind`` = "embed" (BertModel/XLMRobertaModel + mean-pooling sentence-transformers files) or
    "rerank" (…ForSequenceClassification, num_labels=1). The tokenizer is copied from ``vocab_from``.
    """
    import torch
    import transformers

    vocab_from = vocab_from or minilm_dir()
    vocab_size = vocab_size or json.loads((vocab_from / "config.json").read_text())["vocab_size"] \
        if (vocab_from / "config.json").exists() else (vocab_size or 30522)
    name = f"{model_type}-{kind}-h{hidden}-l{layers}-a{heads}-i{intermediate}-v{vocab_size}-p{max_pos}" + (
        "" if save_dtype == "float32" else f"-{save_dtype}")
    out = CACHE / "bench-models" / name
    if (out / "model.safetensors").exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.manual_seed(seed)
    if model_type == "bert":
        cfg = transformers.BertConfig(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                                      num_attention_heads=heads, intermediate_size=intermediate,
                                      max_position_embeddings=max_pos)
    else:
        cfg = transformers.XLMRobertaConfig(vocab_size=vocab_size, hidden_size=hidden,
                                            num_hidden_layers=layers, num_attention_heads=heads,
                                            intermediate_size=intermediate, max_position_embeddings=max_pos + 2,
                                            pad_token_id=1, bos_token_id=0, eos_token_id=2,
                                            type_vocab_size=2)  # borrowed BERT tokenizer: pair type ids 0/1
    if kind == "rerank":
        cfg.num_labels = 1
        auto = transformers.AutoModelForSequenceClassification
    else:
        auto = transformers.AutoModel
    model = auto.from_config(cfg)
    model.eval()
    if save_dtype != "float32":  # big random models: half the disk and load time (served in float16 anyway)
        model = model.to(getattr(torch, save_dtype))
    model.save_pretrained(tmp, safe_serialization=True)
    _copy_tokenizer(vocab_from, tmp)
    if kind == "embed":
        (tmp / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        ]))
        (tmp / "1_Pooling").mkdir()
        (tmp / "1_Pooling" / "config.json").write_text(json.dumps(
            {"word_embedding_dimension": hidden, "pooling_mode_mean_tokens": True}))
        (tmp / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_pos}))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def minilm_cross_encoder() -> Path:
    """Random-weight BertForSequenceClassification(num_labels=1) of MiniLM-L6's shape, MiniLM's tokenizer."""
    return random_model("rerank", hidden=384, layers=6, heads=12, intermediate=1536)
