"""A small random XLM-RoBERTa saved in BAAI/bge-m3's layout (the tests and the bench build it; no hub).

Folder: config.json + model.safetensors (XLMRobertaModel), an XLM-R-style tokenizer (<s>=0, <pad>=1, </s>=2,
<unk>=3, <mask>=4; made from all-MiniLM-L6-v2's WordPiece vocabulary, whose first ids are unused), tokenizer
config and special-tokens map, sentence-transformers files (CLS pooling, Normalize) and random
`sparse_linear.pt` (hidden -> 1) / `colbert_linear.pt` (hidden -> hidden) heads. The sparse head is widened
(weights ~N(0, 0.3)) and centred (see below) so that about half the token weights are positive, not all zero.
"""
from __future__ import annotations

import json
from pathlib import Path

from localcluster.models import minilm_dir

SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
CALIBRATION = ["Kubernetes operators reconcile custom resources.", "The quick brown fox jumps over the lazy dog.",
               "What is the capital of France? Paris is.", "hybrid retrieval with lexical weights and vectors", "hello world", "a"]


def _tokenizer_json() -> dict:
    t = json.loads((minilm_dir() / "tokenizer.json").read_text())
    inv = {i: tok for tok, i in t["model"]["vocab"].items()}
    for i, tok in enumerate(SPECIALS):  # ids 0-4 were [PAD], [unused0..3]
        inv[i] = tok
    t["model"]["vocab"] = {tok: i for i, tok in sorted(inv.items())}
    t["model"]["unk_token"] = "<unk>"
    t["added_tokens"] = [{"id": i, "special": True, "content": tok, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False} for i, tok in enumerate(SPECIALS)]
    s = lambda tok: {"SpecialToken": {"id": tok, "type_id": 0}}  # noqa: E731
    a = {"Sequence": {"id": "A", "type_id": 0}}
    b = {"Sequence": {"id": "B", "type_id": 0}}
    t["post_processor"] = {
        "type": "TemplateProcessing", "single": [s("<s>"), a, s("</s>")],
        "pair": [s("<s>"), a, s("</s>"), s("</s>"), b, s("</s>")],
        "special_tokens": {tok: {"id": tok, "ids": [SPECIALS.index(tok)], "tokens": [tok]}
                           for tok in ("<s>", "</s>")}}
    t["truncation"] = None
    t["padding"] = None
    return t


def build_m3_folder(path: Path, heads: tuple[str, ...] = ("sparse", "colbert"), seed: int = 0, hidden: int = 64,
                    layers: int = 2, max_positions: int = 258, colbert_dim: int | None = None) -> Path:
    import torch
    from transformers import XLMRobertaConfig, XLMRobertaModel

    path.mkdir(parents=True, exist_ok=True)
    cfg = XLMRobertaConfig(vocab_size=30522, hidden_size=hidden, num_hidden_layers=layers,
                           num_attention_heads=max(2, hidden // 64), intermediate_size=hidden * 4,
                           max_position_embeddings=max_positions, type_vocab_size=1, pad_token_id=1,
                           bos_token_id=0, eos_token_id=2)
    torch.manual_seed(seed)
    model = XLMRobertaModel(cfg, add_pooling_layer=False).eval()
    model.save_pretrained(path)
    (path / "tokenizer.json").write_text(json.dumps(_tokenizer_json()))
    names = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "sep_token": "</s>",
             "pad_token": "<pad>", "cls_token": "<s>", "mask_token": "<mask>"}
    (path / "special_tokens_map.json").write_text(json.dumps(names))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "XLMRobertaTokenizer", "model_max_length": max_positions - 2, **names}))
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": hidden, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}))
    g = torch.Generator().manual_seed(seed + 1)
    if "sparse" in heads:
        # The random model's token states share a large common component, so a random head scores every token
        # on the same side of zero. Centre it: the bias puts the median token of some calibration text at 0,
        # so about half the tokens get a positive weight.
        w = torch.randn(1, hidden, generator=g) * 0.3
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        with torch.no_grad():
            scores = torch.cat([model(input_ids=torch.tensor([tok.encode(t).ids])).last_hidden_state[0, 1:-1] @ w[0]
                                for t in CALIBRATION])
        torch.save({"weight": w, "bias": -scores.median().reshape(1)}, path / "sparse_linear.pt")
    if "colbert" in heads:
        d = colbert_dim or hidden
        torch.save({"weight": torch.randn(d, hidden, generator=g) * 0.1, "bias": torch.randn(d, generator=g) * 0.1},
                   path / "colbert_linear.pt")
    return path


if __name__ == "__main__":
    import sys

    print(build_m3_folder(Path(sys.argv[1])))
