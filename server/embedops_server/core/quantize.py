"""Smaller vectors on the wire: binary and int8 embeddings (issue 56).

A vector database bill is mostly vector bytes: int8 is 4x smaller than float32, a binary vector 32x, and binary
with a float rescoring step over its top hits keeps most of the recall.

Binary is by sign, as the references do (Cohere's `binary`/`ubinary`, sentence-transformers'
`quantize_embeddings`): one bit per dimension, 1 where the value is above 0, packed eight to a byte, most
significant bit first; `ubinary` the bytes as 0-255, `binary` the same minus 128 as -128-127. The sign of a value is
the same whoever computes it (to float rounding), so both belong to the space of the float vector.

int8 is one scale for the whole space, symmetric: ``round(v * 127 / scale)`` clipped to -127..127, where ``scale``
is measured once from the model's own vectors (`calibrate`). Not sentence-transformers' ranges per dimension
(``(v - min_d) / (max_d - min_d) * 255 - 128``): an index compares int8 vectors as they are, by dot product or
cosine, and ranges per dimension change those (each dimension shifted and weighted by its own range); measured on
all-MiniLM-L6-v2 (`python -m bench.vector_types`), the int8 top 10 shared 0.78-0.83 of float32's with ranges per
dimension and 0.99 with one scale, which changes every dot product by the same factor. For the same reason the
scale is not part of the embedding space's identity: two scales (0.2 and 0.3 measured) rank alike, so vectors a
GPU replica quantized beside those of a CPU one (their scales may differ in the last digit) stay comparable.
``uint8`` is int8 + 128 (1..255) for stores that take unsigned bytes: subtract 128 before comparing.
"""
from __future__ import annotations

import math

import numpy as np

FLOAT, BASE64, BINARY, UBINARY, INT8, UINT8 = "float", "base64", "binary", "ubinary", "int8", "uint8"
SCALED = (INT8, UINT8)  # need the space's int8 scale
CALIBRATION_WORDS = 128  # the model's own vocabulary words the scale is measured on (256 to 2,048 gave the same)
CALIBRATION_QUANTILE = 0.9999  # of |components|: the rare larger ones are clipped rather than widening every step


def ubinary(v: np.ndarray) -> np.ndarray:
    """[n, d] floats -> [n, ceil(d / 8)] uint8: bit i of a row is 1 where v[:, i] > 0 (big-endian bit order; the
    last byte zero-padded when d is not a multiple of 8)."""
    return np.packbits(v > 0, axis=-1)


def binary(v: np.ndarray) -> np.ndarray:
    return (ubinary(v).astype(np.int16) - 128).astype(np.int8)


def int8(v: np.ndarray, scale: float) -> np.ndarray:
    return np.clip(np.rint(v * (127.0 / scale)), -127, 127).astype(np.int8)


def uint8(v: np.ndarray, scale: float) -> np.ndarray:
    return (int8(v, scale).astype(np.int16) + 128).astype(np.uint8)


def calibration_words(vocabulary: dict[str, int], n: int = CALIBRATION_WORDS) -> list[str]:
    """``n`` whole words of a tokenizer's vocabulary (token -> id), evenly spaced by id: data every model has, so the
    scale needs no calibration set (a set of sentences and the words gave scales that rank alike, above)."""
    words = []
    for token, _ in sorted(vocabulary.items(), key=lambda kv: kv[1]):
        word = token.lstrip("\u2581\u0120")  # sentencepiece's and byte-level BPE's word-start marks
        # whole words; of scripts without spaces (CJK) single characters are words
        if not token.startswith("##") and word.isalpha() and (len(word) >= 3 or not word.isascii()):
            words.append(word)
    step = max(1, len(words) // n)
    return words[::step][:n]


class Int8Scale:
    """The space's int8 scale, from calibration vectors [n, d] (normalized here, as served); a
    `dimensions`-truncated (and renormalized) vector has larger components, so its scale is measured on the
    calibration vectors truncated alike, once per size asked for."""

    def __init__(self, calibration: np.ndarray):
        self._vectors = calibration.astype(np.float32, copy=False)
        self._by_dims: dict[int, float] = {}
        self.scale = self.for_dimensions(None)

    def for_dimensions(self, dimensions: int | None) -> float:
        d = dimensions or self._vectors.shape[1]
        if d not in self._by_dims:
            v = self._vectors[:, :d]
            v = v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)
            self._by_dims[d] = significant(float(np.quantile(np.abs(v), CALIBRATION_QUANTILE)))
        return self._by_dims[d]


def significant(x: float, digits: int = 3) -> float:
    """``x`` to ``digits`` significant digits: what /info shows is the scale used, exactly."""
    if x <= 0 or not math.isfinite(x):
        return 1.0
    return round(x, digits - 1 - math.floor(math.log10(x)))


def as_type(v: np.ndarray, kind: str, scale: float | None = None) -> np.ndarray:
    """Rows of normalized float vectors [n, d] as `kind` (float, binary, ubinary, or int8/uint8 at ``scale``)."""
    if kind == BINARY:
        return binary(v)
    if kind == UBINARY:
        return ubinary(v)
    if kind in SCALED:
        if scale is None:
            raise ValueError(f"{kind} needs the space's scale")
        return int8(v, scale) if kind == INT8 else uint8(v, scale)
    return v
