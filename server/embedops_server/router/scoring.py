"""Numpy post-processing of engine outputs (runs on the event loop; vectorized, microseconds per request)."""
from __future__ import annotations

import base64

import numpy as np

from ..core import quantize
from ..core.errors import VALIDATION
from .errors import ApiError


def dense(results: list, dimensions: int | None, normalize: bool, hidden: int) -> np.ndarray:
    return truncate_normalize(np.stack(results), dimensions, normalize)


def truncate_normalize(v: np.ndarray, dimensions: int | None, normalize: bool) -> np.ndarray:
    """Rows of v [n, d] (pooled vectors, or one input's ColBERT token vectors): MRL truncation to `dimensions`,
    then L2 normalization per row, as TEI and sentence-transformers do (in that order); float32 throughout."""
    v = v.astype(np.float32, copy=False)
    if dimensions is not None:
        if dimensions <= 0 or dimensions > v.shape[1]:
            raise ApiError(VALIDATION, f"Input validation error: `dimensions` must be between 1 and {v.shape[1]}")
        v = v[:, :dimensions]
    if normalize:
        v = v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)
    return np.ascontiguousarray(v)


def check_types(kinds, int8: quantize.Int8Scale | None, normalize: bool = True) -> None:
    """Refuse, before any forward, a vector type this server cannot give as asked (422, saying why)."""
    scaled = [k for k in kinds if k in quantize.SCALED]
    if not scaled:
        return
    if int8 is None:
        raise ApiError(VALIDATION, f"Input validation error: embedding type {scaled[0]} is not served by this model "
                                   "(it gives no dense vector, or its int8 scale could not be measured at start)")
    if not normalize:
        raise ApiError(VALIDATION, f"Input validation error: embedding type {scaled[0]} is of normalized vectors "
                                   "(the space's int8 scale is); drop `normalize: false`")


def typed(v: np.ndarray, kind: str, int8: quantize.Int8Scale | None, dimensions: int | None) -> np.ndarray:
    """Normalized rows as `kind`; int8 and uint8 at the space's scale for vectors of that many dimensions."""
    scale = int8.for_dimensions(dimensions) if int8 is not None and kind in quantize.SCALED else None
    return quantize.as_type(v, kind, scale)


def b64(a: np.ndarray) -> str:
    """An array's bytes, base64: floats as little-endian float32 (what OpenAI's SDK decodes), packed bits (binary,
    ubinary) as they are."""
    if a.dtype.kind == "f":
        a = a.astype("<f4", copy=False)
    return base64.b64encode(np.ascontiguousarray(a).tobytes()).decode("ascii")


def sparse(results: list) -> list[list[dict]]:
    out = []
    for v in results:
        idx = np.flatnonzero(v)
        out.append([{"index": int(i), "value": float(x)} for i, x in zip(idx.tolist(), v[idx].tolist())])
    return out


def scores(logits: np.ndarray, raw: bool) -> np.ndarray:
    logits = logits.astype(np.float64)
    if raw:
        return logits
    if logits.shape[-1] == 1:
        return 1.0 / (1.0 + np.exp(-logits))
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)
