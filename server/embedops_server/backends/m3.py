"""bge-m3's sparse and ColBERT heads (BAAI/bge-m3 layout: `sparse_linear.pt`, `colbert_linear.pt` beside the
XLM-RoBERTa weights), computed from the same forward as the dense vector.

What FlagEmbedding's BGEM3FlagModel computes, reimplemented here from its documented behaviour:
- lexical (sparse) weights: ReLU(sparse_linear(token state)) per token; per token id the maximum over the
  input's tokens; the tokenizer's cls/eos/pad/unk tokens and zero weights dropped;
- ColBERT vectors: colbert_linear over the token states after the first (the CLS), one per remaining token
  (the final </s> included), L2-normalized (normalization is applied by the caller with `normalize`).

The backends run the linear layers (torch on the model's device; ONNX Runtime: a small session per head over the
main graph's token states, see OrtHeads); the per-row work below (max per id, splitting rows) is numpy on the
inference thread.
"""
from __future__ import annotations

import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..core.model_info import COLBERT, LEXICAL, ModelError, ModelInfo, torch_installed


@dataclass(frozen=True)
class Linear:
    weight: np.ndarray  # (out, in) float32
    bias: np.ndarray | None

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """x [..., in] -> [..., out], one 2-D BLAS matmul."""
        y = x.reshape(-1, x.shape[-1]) @ self.weight.T
        if self.bias is not None:
            y += self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


@dataclass(frozen=True)
class Heads:
    sparse: Linear | None
    colbert: Linear | None
    unused_ids: np.ndarray  # token ids that never get a lexical weight

    @property
    def colbert_dim(self) -> int | None:
        return self.colbert.out_features if self.colbert is not None else None


def load_heads(info: ModelInfo, tokenizer, hidden_size: int) -> Heads | None:
    """The folder's heads as float32 numpy layers (None when it has none)."""
    if not info.heads:
        return None
    from ..core.model_info import unused_token_ids

    layers = {}
    for name, path in info.heads.items():
        state = load_state_dict(path)
        w = state.get("weight")
        if w is None or w.ndim != 2:
            raise ModelError(f"{path}: expected a linear layer's state dict with `weight` (out, in)")
        if hidden_size and w.shape[1] != hidden_size:
            raise ModelError(f"{path}: weight {tuple(w.shape)} does not take the model's hidden size {hidden_size}")
        if name == LEXICAL and w.shape[0] != 1:
            raise ModelError(f"{path}: the sparse head maps to one weight per token, not {w.shape[0]}")
        b = state.get("bias")
        layers[name] = Linear(np.ascontiguousarray(w, np.float32),
                              None if b is None else np.ascontiguousarray(b, np.float32).reshape(-1))
    ids = np.array(unused_token_ids(info, tokenizer), dtype=np.int64) if tokenizer is not None else np.zeros(0, np.int64)
    return Heads(layers.get(LEXICAL), layers.get(COLBERT), ids)


def numpy_heads(heads: Heads, batch, hidden: np.ndarray) -> tuple[list | None, list | None]:
    """The heads a batch asked for, over float32 token states [B, L, H], in numpy (reference; see OrtHeads)."""
    n = len(batch.lengths)
    lexical = colbert = None
    if "sparse" in batch.heads and heads.sparse is not None:
        tw = np.maximum(heads.sparse(hidden)[..., 0], 0)
        lexical = lexical_weights(batch.input_ids, tw, batch.lengths, n, heads.unused_ids)
    if "colbert" in batch.heads and heads.colbert is not None:
        colbert = colbert_rows(heads.colbert(np.ascontiguousarray(hidden[:, 1:])), batch.lengths, n)
    return lexical, colbert


def head_onnx(layer: Linear, skip_first: bool, relu: bool) -> bytes:
    """A one-layer ONNX graph: token states [B, L, H] -> [B, L(-1), out] (float32 weights, never quantized)."""
    from onnx import TensorProto, helper, numpy_helper

    hidden = layer.weight.shape[1]
    nodes, x = [], "hidden"
    inits = [numpy_helper.from_array(np.ascontiguousarray(layer.weight.T), "w")]
    if skip_first:  # the states after the first (CLS) token
        inits += [numpy_helper.from_array(np.array([v], np.int64), n) for n, v in
                  (("one", 1), ("end", np.iinfo(np.int64).max), ("axis", 1))]
        nodes.append(helper.make_node("Slice", ["hidden", "one", "end", "axis"], ["rest"]))
        x = "rest"
    nodes.append(helper.make_node("MatMul", [x, "w"], ["mm"]))
    y = "mm"
    if layer.bias is not None:
        inits.append(numpy_helper.from_array(layer.bias, "b"))
        nodes.append(helper.make_node("Add", ["mm", "b"], ["biased"]))
        y = "biased"
    nodes.append(helper.make_node("Relu" if relu else "Identity", [y], ["out"]))
    graph = helper.make_graph(
        nodes, "head", [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["b", "s", hidden])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["b", "t", layer.out_features])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


class OrtHeads:
    """The heads as small ONNX Runtime sessions run after the main graph, on its float32 token states.

    Measured (bench/m3_ort_heads.py, docs/server.md) against the alternatives: numpy (OpenBLAS) after the graph
    cost several times more than ONNX Runtime's MatMul, and exporting the heads into the model's graph costs the
    same as these sessions when they are asked for but then runs them on every dense-only forward too, gets
    them int8-quantized under --quantize int8, and needs our own export (a folder's own ONNX file could not have
    them). Separate sessions: dense-only forwards pay nothing, the heads stay float32, any token-state graph works.
    """

    def __init__(self, heads: Heads, make_session):
        self.heads = heads
        self.sparse = make_session(head_onnx(heads.sparse, False, True)) if heads.sparse is not None else None
        self.colbert = make_session(head_onnx(heads.colbert, True, False)) if heads.colbert is not None else None

    def __call__(self, batch, hidden: np.ndarray) -> tuple[list | None, list | None]:
        n = len(batch.lengths)
        lexical = colbert = None
        hidden = np.ascontiguousarray(hidden, dtype=np.float32)
        if "sparse" in batch.heads and self.sparse is not None:
            tw = self.sparse.run(None, {"hidden": hidden})[0][..., 0]
            lexical = lexical_weights(batch.input_ids, tw, batch.lengths, n, self.heads.unused_ids)
        if "colbert" in batch.heads and self.colbert is not None:
            colbert = colbert_rows(self.colbert.run(None, {"hidden": hidden})[0], batch.lengths, n)
        return lexical, colbert


# ---- reading the .pt files (torch.save zip format) -------------------------------------------------------

def load_state_dict(path: Path) -> dict[str, np.ndarray]:
    """A torch.save'd state dict of tensors as float32 numpy arrays: with the small reader below, and with
    torch (weights_only) only for a file it cannot read. Importing torch just for two small heads would add
    ~300 MB to an ONNX Runtime server's resident memory (measured with bge-m3 int8)."""
    try:
        return _read_torch_zip(path)
    except Exception as e:
        if not torch_installed():
            raise ModelError(f"{path}: cannot read this torch file without torch ({e})") from e
    import torch

    state = torch.load(path, map_location="cpu", weights_only=True)
    return {k: v.float().numpy() for k, v in state.items()}


_STORAGES = {"FloatStorage": np.float32, "HalfStorage": np.float16, "DoubleStorage": np.float64,
             "BFloat16Storage": "bfloat16"}


class _Storage:
    def __init__(self, dtype, data: bytes):
        self.dtype, self.data = dtype, data


class _Unpickler(pickle.Unpickler):
    """Only what a state dict of dense tensors needs: OrderedDict, tensor rebuild, float storages."""

    def __init__(self, f, archive: zipfile.ZipFile, prefix: str):
        super().__init__(f)
        self.archive, self.prefix = archive, prefix

    def find_class(self, module, name):
        if module == "collections" and name == "OrderedDict":
            import collections

            return collections.OrderedDict
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild
        if module == "torch" and name in _STORAGES:
            return name
        raise pickle.UnpicklingError(f"unsupported object {module}.{name}")

    def persistent_load(self, pid):
        kind, storage_type, key, _location, _numel = pid
        if kind != "storage" or storage_type not in _STORAGES:
            raise pickle.UnpicklingError(f"unsupported storage {pid!r}")
        return _Storage(_STORAGES[storage_type], self.archive.read(f"{self.prefix}/data/{key}"))


def _rebuild(storage: _Storage, offset, size, stride, *_):
    if storage.dtype == "bfloat16":
        raw = np.frombuffer(storage.data, dtype="<u2").astype(np.uint32) << 16
        flat = raw.view(np.float32)
    else:
        flat = np.frombuffer(storage.data, dtype=np.dtype(storage.dtype).newbyteorder("<"))
    item = flat.itemsize
    return np.lib.stride_tricks.as_strided(flat[offset:], shape=tuple(size),
                                           strides=tuple(s * item for s in stride)).astype(np.float32)


def _read_torch_zip(path: Path) -> dict[str, np.ndarray]:
    with zipfile.ZipFile(path) as z:
        pkl = next(n for n in z.namelist() if n.endswith("/data.pkl"))
        prefix = pkl[: -len("/data.pkl")]
        with z.open(pkl) as f:
            state = _Unpickler(f, z, prefix).load()
    return {k: np.asarray(v, np.float32) for k, v in state.items()}


# ---- per-row post-processing (numpy, inference thread) ----------------------------------------------------

def lexical_weights(input_ids: np.ndarray, token_weights: np.ndarray, lengths: np.ndarray, n: int,
                    unused_ids: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per row: (token ids ascending, weights) with the maximum weight per id, weights > 0 only, unused ids
    dropped. `token_weights` [B, L] are the ReLU'd head outputs."""
    out = []
    for r in range(n):
        ids = input_ids[r, : lengths[r]]
        w = token_weights[r, : lengths[r]].astype(np.float32, copy=False)
        uniq, inv = np.unique(ids, return_inverse=True)
        best = np.zeros(len(uniq), np.float32)
        np.maximum.at(best, inv, w)
        keep = best > 0
        if len(unused_ids):
            keep &= ~np.isin(uniq, unused_ids)
        out.append((uniq[keep], best[keep]))
    return out


def colbert_rows(vecs: np.ndarray, lengths: np.ndarray, n: int) -> list[np.ndarray]:
    """`vecs` [B, L-1, d]: the head over the token states after the first; row r keeps its lengths[r]-1."""
    return [np.ascontiguousarray(vecs[r, : max(int(lengths[r]) - 1, 0)], dtype=np.float32) for r in range(n)]
