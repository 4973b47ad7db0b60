"""Smaller vectors on the wire: binary embeddings (issue 56).

A vector database bill is mostly vector bytes: a binary vector is 32x smaller than float32 and, with a float
rescoring step over its top hits, keeps most of the recall. Binary is by sign, as the references do (Cohere's
`binary`/`ubinary`, sentence-transformers' `quantize_embeddings`): one bit per dimension, 1 where the value is
above 0, packed eight to a byte, most significant bit first; `ubinary` the bytes as 0-255, `binary` the same minus
128 as -128-127. No calibration: the sign of a value is the same whoever computes it (to float rounding), so both
are of the embedding space of the float vector and need nothing else to be shared.

int8 and uint8 need ranges per dimension computed once per space and shared exactly by every writer and reader
(two sets of ranges are two spaces); they are not served yet.
"""
from __future__ import annotations

import numpy as np

FLOAT, BASE64, BINARY, UBINARY, INT8, UINT8 = "float", "base64", "binary", "ubinary", "int8", "uint8"
CALIBRATED = (INT8, UINT8)  # need the space's ranges per dimension: refused for now (see above)


def ubinary(v: np.ndarray) -> np.ndarray:
    """[n, d] floats -> [n, ceil(d / 8)] uint8: bit i of a row is 1 where v[:, i] > 0 (big-endian bit order; the
    last byte zero-padded when d is not a multiple of 8)."""
    return np.packbits(v > 0, axis=-1)


def binary(v: np.ndarray) -> np.ndarray:
    return (ubinary(v).astype(np.int16) - 128).astype(np.int8)


def refusal(kind: str) -> str | None:
    """Why a request of int8 or uint8 is refused (None for a served type)."""
    if kind not in CALIBRATED:
        return None
    return (f"embedding type {kind} needs the embedding space's ranges per dimension, which this server does not "
            "compute yet; float, base64, binary and ubinary are served")


def as_type(v: np.ndarray, kind: str) -> np.ndarray:
    """Rows of float vectors [n, d] as `kind` (float, binary or ubinary)."""
    if kind == BINARY:
        return binary(v)
    if kind == UBINARY:
        return ubinary(v)
    return v
