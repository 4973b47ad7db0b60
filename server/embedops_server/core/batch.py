"""What the engine hands a backend and gets back: one flat, padded batch per forward (TEI's backends take the
same shape), so that the backends (backends/) depend on this contract and not on the engine that builds it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass
class Batch:
    """Padded arrays for one forward pass (rows beyond len(entries) are bucket padding)."""
    input_ids: np.ndarray
    attention_mask: np.ndarray
    token_type_ids: np.ndarray
    lengths: np.ndarray
    need_tokens: bool = False
    # Another forward runs (or is about to start) beside this one: a backend with parallel_forwards > 1 then
    # runs it on its share of the cores rather than all of them.
    parallel: bool = False
    # bge-m3 heads some input of the batch asked for ("sparse", "colbert"): computed from the same forward
    heads: frozenset = frozenset()


def padded(ids: Sequence[Sequence[int]], type_ids: Sequence[Sequence[int]] | None, shape: tuple[int, int],
           pad_id: int) -> Batch:
    """Token rows padded into a ``shape`` (rows, cols) batch (the backend's bucket): rows beyond ``ids`` are
    padding; ``type_ids`` None: all 0."""
    rows, cols = shape
    out = np.zeros((rows, cols), dtype=np.int64)
    tti = np.zeros((rows, cols), dtype=np.int64)
    mask = np.zeros((rows, cols), dtype=np.int64)
    lengths = np.zeros(rows, dtype=np.int64)
    for r, row in enumerate(ids):
        n = len(row)
        out[r, :n] = row
        if type_ids is not None:
            tti[r, :n] = type_ids[r]
        mask[r, :n] = 1
        lengths[r] = n
    if pad_id:
        out[mask == 0] = pad_id
    return Batch(out, mask, tti, lengths)


@dataclass
class BatchOutput:
    pooled: np.ndarray | None  # [B, D]: pooled embedding, dense SPLADE vector or classifier logits
    tokens: list[np.ndarray] | None = None  # per-row unpadded hidden states (embed_all)
    lexical: list[tuple[np.ndarray, np.ndarray]] | None = None  # per row (token ids, weights): bge-m3 sparse
    colbert: list[np.ndarray] | None = None  # per row [tokens - 1, d]: bge-m3 ColBERT vectors, not normalized


def multi_result(out: BatchOutput, r: int, outputs: tuple[str, ...]) -> dict:
    """Row r's outputs by name for a multi-output request ("dense", "sparse", "colbert")."""
    res = {}
    for o in outputs:
        res[o] = out.pooled[r] if o == "dense" else (out.lexical if o == "sparse" else out.colbert)[r]
    return res
