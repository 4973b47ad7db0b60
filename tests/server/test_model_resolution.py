"""Hub ids resolve from the Hugging Face cache the operator's download init container fills."""
from __future__ import annotations

import pytest

from embedops_server.core.model_info import EMBEDDER, ModelError, load_model_info
from localcluster.models import minilm_dir


def test_hub_id_from_hf_cache(tmp_path, monkeypatch):
    snap = tmp_path / "hub" / "models--sentence-transformers--all-MiniLM-L6-v2" / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    for f in minilm_dir().iterdir():
        (snap / f.name).symlink_to(f)
    refs = snap.parents[1] / "refs"
    refs.mkdir()
    (refs / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    info = load_model_info("sentence-transformers/all-MiniLM-L6-v2")
    assert info.path == snap and info.task == EMBEDDER and info.pooling == "mean" and info.max_input_length == 256
    with pytest.raises(ModelError, match="not in the Hugging Face cache"):
        load_model_info("someone/missing-model")
    with pytest.raises(ModelError, match="not a local folder"):
        load_model_info(str(tmp_path / "nope"))
