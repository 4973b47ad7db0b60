"""bge-m3's outputs over HTTP: lexical weights on TEI's /embed_sparse, ColBERT vectors on /embed_colbert, and
/embed_hybrid for any subset of dense, sparse and ColBERT from one forward.

A model folder in BAAI/bge-m3's layout (`sparse_linear.pt`, `colbert_linear.pt`; see backends/m3.py) has these
outputs; /info lists them. Asking a model for an output it lacks is a 424 (TEI's code for a route the model
cannot serve), never a different result. The engine computes everything; this module only validates, shapes
and serializes (numpy, no tensors).
"""
from __future__ import annotations

import asyncio
import base64
import time
from typing import Annotated, Literal

import numpy as np
from fastapi import APIRouter, Request
from pydantic import StrictBool

from ..core.errors import BACKEND, VALIDATION
from ..core.model_info import COLBERT, DENSE, EMBEDDER, LEXICAL, SPARSE
from . import routes_tei, scoring
from .errors import ApiError
from .routes_tei import _count, _json, _observe
from .schemas import Dimensions, EmbedAllRequest, Input, doc
from .state import _disconnected

router = APIRouter()

Output = Annotated[Literal["dense", "sparse", "colbert"], doc(x_embedops="outputs")]  # the model's own, in /openapi.json
Outputs = Annotated[list[Output], doc(minItems=1)]
Encoding = Literal["float", "base64"]


class ColbertRequest(EmbedAllRequest):
    normalize: StrictBool = True
    dimensions: Dimensions | None = None
    encoding_format: Encoding = "float"


class HybridRequest(EmbedAllRequest):
    inputs: Input
    outputs: Outputs | None = None  # default: every output the model has (/info "outputs")
    normalize: StrictBool = True
    dimensions: Dimensions | None = None
    encoding_format: Encoding = "float"


_HEAD_FILE = {LEXICAL: "sparse_linear.pt", COLBERT: "colbert_linear.pt"}


def m3_info(svc) -> dict:
    """/info additions: the outputs the multi-output routes can give, and the ColBERT vector size."""
    heads = getattr(svc.backend, "heads", None)
    return {"outputs": svc.info.outputs, "colbert_dim": heads.colbert_dim if heads is not None else None}


def _require(st, wanted: list[str]):
    svc = st.require_task(EMBEDDER)
    have = svc.info.outputs
    missing = [o for o in wanted if o not in have]
    if missing:
        o = missing[0]
        raise ApiError(BACKEND, f"Model is not a bge-m3 model with a {o} head: its folder has no {_HEAD_FILE[o]}; "
                                f"its outputs: {', '.join(have)}")  # "Model is not": metrics label model_type
    return svc


async def _run(request: Request, st, svc, body, outputs: list[str]):
    """As AppState.run (admit, queue, drop on disconnect), for a multi-output request; + metrics."""
    t0 = time.perf_counter()
    texts = st.texts(svc, body.inputs, st.prompt(svc, body.prompt_name))
    engine = svc.engine
    n = len(texts)
    engine.admit(n)
    try:
        req = engine.submit(texts, st.truncate(body.truncate), body.truncation_direction.lower(), False, outputs)
        watcher = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait((req.future, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if not req.future.done():
            req.cancelled = True
            req.future.cancel()
            st.metrics.c.inc("te_request_failure", err="dropped")
            raise ApiError("ClientClosedRequest", "client disconnected")
        results = req.future.result()
    finally:
        engine.release(n)
    _count(st, "embed", n, True, t0)
    _observe(st, req)
    return results, req, t0


def _b64(a: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(a, dtype="<f4").tobytes()).decode("ascii")


def colbert(rows: list[np.ndarray], dimensions: int | None, normalize: bool) -> list[np.ndarray]:
    """Per input [tokens - 1, d]: MRL-style truncation first, then L2 normalization per token vector."""
    out = []
    for v in rows:
        if dimensions is not None:
            if dimensions <= 0 or dimensions > v.shape[1]:
                raise ApiError(VALIDATION, f"Input validation error: `dimensions` must be between 1 and {v.shape[1]}")
            v = v[:, :dimensions]
        if normalize:
            v = v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)
        out.append(np.ascontiguousarray(v, dtype=np.float32))
    return out


def lexical(rows: list[tuple[np.ndarray, np.ndarray]]) -> list[list[dict]]:
    """TEI's sparse shape: per input [{"index": token id, "value": weight}] (ids ascending)."""
    return [[{"index": i, "value": x} for i, x in zip(ids.tolist(), w.tolist())] for ids, w in rows]


@router.post("/embed_sparse", include_in_schema=False)
async def embed_sparse(request: Request, body: EmbedAllRequest):
    """TEI's route: SPLADE models as before (routes_tei), bge-m3 models from their sparse head."""
    st = request.app.state.embedops
    svc = st.svc()
    if svc.info.task == SPARSE:
        return await routes_tei.embed_sparse(request, body)
    if svc.info.task == EMBEDDER and LEXICAL not in svc.info.outputs:
        raise ApiError(BACKEND, "Model is not a sparse model: neither SPLADE (*ForMaskedLM) nor an embedder with a "
                                "bge-m3 sparse head (sparse_linear.pt)")
    svc = _require(st, [LEXICAL])
    results, req, t0 = await _run(request, st, svc, body, [LEXICAL])
    return _json(lexical([r[LEXICAL] for r in results]), st.headers(req, t0))


# x-embedops-tasks / -outputs: the OpenAPI document lists an operation only for models that serve it.
@router.post("/embed_colbert", tags=["bge-m3"],
             openapi_extra={"x-embedops-tasks": ["embedding"], "x-embedops-outputs": ["colbert"]},
             summary="ColBERT multi-vectors (bge-m3 colbert head): per input one vector per token after the first")
async def embed_colbert(request: Request, body: ColbertRequest):
    st = request.app.state.embedops
    svc = _require(st, [COLBERT])
    results, req, t0 = await _run(request, st, svc, body, [COLBERT])
    vecs = colbert([r[COLBERT] for r in results], body.dimensions, body.normalize)
    out = [_b64(v) for v in vecs] if body.encoding_format == "base64" else vecs
    return _json(out, st.headers(req, t0))


@router.post("/embed_hybrid", tags=["bge-m3"], openapi_extra={"x-embedops-tasks": ["embedding"]},
             summary="Any of dense, sparse (lexical weights) and ColBERT vectors per input, from one forward")
async def embed_hybrid(request: Request, body: HybridRequest):
    st = request.app.state.embedops
    svc = st.require_task(EMBEDDER)
    if body.outputs is not None and not body.outputs:
        raise ApiError(VALIDATION, "Input validation error: `outputs` must name at least one of dense, sparse, "
                                   "colbert")
    wanted = list(dict.fromkeys(body.outputs)) if body.outputs else list(svc.info.outputs)
    svc = _require(st, wanted)
    results, req, t0 = await _run(request, st, svc, body, wanted)
    cols: dict[str, list] = {}
    if DENSE in wanted:
        d = scoring.dense([r[DENSE] for r in results], body.dimensions, body.normalize, svc.backend.hidden_size)
        cols[DENSE] = [_b64(v) for v in d] if body.encoding_format == "base64" else list(d)
    if LEXICAL in wanted:
        cols[LEXICAL] = lexical([r[LEXICAL] for r in results])
    if COLBERT in wanted:
        c = colbert([r[COLBERT] for r in results], body.dimensions, body.normalize)
        cols[COLBERT] = [_b64(v) for v in c] if body.encoding_format == "base64" else c
    out = [{k: cols[k][i] for k in wanted} for i in range(len(results))]
    return _json(out, st.headers(req, t0))
