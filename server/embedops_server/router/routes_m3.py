"""bge-m3's outputs over HTTP: lexical weights on TEI's /embed_sparse, ColBERT vectors on /embed_colbert, and
/embed_hybrid for any subset of dense, sparse and ColBERT from one forward.

A model folder in BAAI/bge-m3's layout (`sparse_linear.pt`, `colbert_linear.pt`; see backends/m3.py) has these
outputs; /info lists them. Asking a model for an output it lacks is a 424 (TEI's code for a route the model
cannot serve), never a different result. The engine computes everything; this module only validates, shapes
and serializes (numpy, no tensors).
"""
from __future__ import annotations

import asyncio
import time
from typing import Annotated, Literal

import numpy as np
import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import StrictBool

from ..core.errors import BACKEND, VALIDATION
from ..core.model_info import COLBERT, DENSE, EMBEDDER, LEXICAL, SPARSE
from . import routes_tei, scoring
from .errors import ApiError
from .openapi import OUTPUTS, TASKS
from .routes_tei import INFERENCE_ERRORS, NUMPY, count_success, observe_phases
from .schemas import COLBERT_OK, HYBRID_OK, SPARSE_OK, Dimensions, EmbedAllRequest, Input, Int, doc

router = APIRouter()

Output = Annotated[Literal["dense", "sparse", "colbert"], doc(x_embedops="outputs")]  # the model's own, in /openapi.json
Outputs = Annotated[list[Output], doc(minItems=1)]
Encoding = Literal["float", "base64"]
ColbertDimensions = Annotated[Int, doc(minimum=1, x_embedops="colbert-dimensions")]


class ColbertRequest(EmbedAllRequest):
    normalize: StrictBool = True
    dimensions: ColbertDimensions | None = None
    encoding_format: Encoding = "float"


class HybridRequest(EmbedAllRequest):
    inputs: Input
    outputs: Outputs | None = None  # default: every output the model has (/info "outputs")
    normalize: StrictBool = True
    dimensions: Dimensions | None = None  # the dense size; over the ColBERT size with colbert asked: 422
    encoding_format: Encoding = "float"


_HEAD_FILE = {LEXICAL: "sparse_linear.pt", COLBERT: "colbert_linear.pt"}


def route_doc(ok: dict, outputs, tasks=(EMBEDDER,)) -> dict:
    """As routes_tei._doc, plus the outputs the model must have to list the route (router/openapi.py)."""
    return {"responses": {**ok, **INFERENCE_ERRORS}, "openapi_extra": {TASKS: list(tasks), OUTPUTS: outputs}}


def m3_info(svc) -> dict:
    """/info additions: the outputs the multi-output routes can give, and the ColBERT vector size."""
    return {"outputs": svc.info.outputs, "colbert_dim": _colbert_dim(svc)}


def _colbert_dim(svc) -> int | None:
    heads = getattr(svc.backend, "heads", None)
    return heads.colbert_dim if heads is not None else None


def _require(svc, wanted: list[str]) -> None:
    have = svc.info.outputs
    missing = [o for o in wanted if o not in have]
    if missing:
        o = missing[0]
        raise ApiError(BACKEND, f"Model is not a bge-m3 model with a {o} head: its folder has no {_HEAD_FILE[o]}; "
                                f"its outputs: {', '.join(have)}")  # "Model is not": metrics label model_type


def _check_dimensions(svc, dimensions: int | None, wanted: list[str]) -> None:
    """Before any inference, like /embed: 1..the size of every vector output asked for."""
    if dimensions is None:
        return
    sizes = ([svc.backend.hidden_size] if DENSE in wanted else []) + ([_colbert_dim(svc)] if COLBERT in wanted else [])
    top = min([s for s in sizes if s] or [dimensions])
    if not 1 <= dimensions <= top:
        raise ApiError(VALIDATION, f"Input validation error: `dimensions` must be between 1 and {top}")


async def _run(request: Request, body, wanted: list[str]):
    """The checks in TEI's order (the task, then the texts: an empty text is 400 whatever else is wrong, then the
    heads and limits), then AppState.run with the outputs; + metrics."""
    st = request.app.state.embedops
    t0 = time.perf_counter()
    svc = st.require_task(EMBEDDER)
    texts = st.texts(svc, body.inputs, st.prompt(svc, body.prompt_name))
    _require(svc, wanted)
    _check_dimensions(svc, getattr(body, "dimensions", None), wanted)
    results, req = await st.run(request, svc, texts, st.truncate(body.truncate), body.truncation_direction,
                                outputs=wanted)
    count_success(st, "embed", len(texts), t0)
    observe_phases(st, req)
    return st, svc, results, req, t0


def lexical(rows: list[tuple[np.ndarray, np.ndarray]]) -> list[list[dict]]:
    """TEI's sparse shape: per input [{"index": token id, "value": weight}] (ids ascending)."""
    return [[{"index": i, "value": x} for i, x in zip(ids.tolist(), w.tolist())] for ids, w in rows]


# x-embedops-tasks / -outputs: the OpenAPI document lists an operation only for models that serve it (/embed_sparse:
# SPLADE, and embedders with bge-m3's sparse head; /embed_colbert: those with its colbert head).
@router.post("/embed_sparse", tags=["TEI", "bge-m3"],
             summary="Sparse vectors (non-zero entries): SPLADE, or a bge-m3 model's lexical weights",
             **route_doc(SPARSE_OK, {EMBEDDER: [LEXICAL]}, tasks=(SPARSE, EMBEDDER)))
async def embed_sparse(request: Request, body: EmbedAllRequest):
    """TEI's route: SPLADE models as before (routes_tei), bge-m3 models from their sparse head."""
    st = request.app.state.embedops
    svc = st.svc()
    if svc.info.task != EMBEDDER:  # SPLADE, or TEI's 424 naming what the model is
        return await routes_tei.embed_sparse(request, body)
    if LEXICAL not in svc.info.outputs:
        st.texts(svc, body.inputs, None)  # an empty text is 400 first
        raise ApiError(BACKEND, "Model is not a sparse model: neither SPLADE (*ForMaskedLM) nor an embedder with a "
                                "bge-m3 sparse head (sparse_linear.pt)")
    st, svc, results, req, t0 = await _run(request, body, [LEXICAL])
    return await _json(lexical([r[LEXICAL] for r in results]), st.headers(req, t0))


@router.post("/embed_colbert", tags=["bge-m3"], **route_doc(COLBERT_OK, [COLBERT]),
             summary="ColBERT multi-vectors (bge-m3 colbert head): per input one vector per token after the first")
async def embed_colbert(request: Request, body: ColbertRequest):
    st, svc, results, req, t0 = await _run(request, body, [COLBERT])
    vectors = _ColbertRows([r[COLBERT] for r in results], body)
    return await _json_rows(len(results), vectors, vectors.floats, st.headers(req, t0))


@router.post("/embed_hybrid", tags=["bge-m3"], **route_doc(HYBRID_OK, []),
             summary="Any of dense, sparse (lexical weights) and ColBERT vectors per input, from one forward")
async def embed_hybrid(request: Request, body: HybridRequest):
    if body.outputs is not None and not body.outputs:
        raise ApiError(VALIDATION, "Input validation error: `outputs` must name at least one of dense, sparse, "
                                   "colbert")
    svc = request.app.state.embedops.require_task(EMBEDDER)
    wanted = list(dict.fromkeys(body.outputs)) if body.outputs else list(svc.info.outputs)
    st, svc, results, req, t0 = await _run(request, body, wanted)
    cols: dict[str, list] = {}
    if DENSE in wanted:
        d = scoring.dense([r[DENSE] for r in results], body.dimensions, body.normalize, svc.backend.hidden_size)
        cols[DENSE] = [scoring.b64(v) for v in d] if body.encoding_format == "base64" else list(d)
    if LEXICAL in wanted:
        cols[LEXICAL] = lexical([r[LEXICAL] for r in results])
    vectors = _ColbertRows([r[COLBERT] for r in results] if COLBERT in wanted else [], body)

    def row(i: int) -> dict:
        return {k: vectors(i) if k == COLBERT else cols[k][i] for k in wanted}
    return await _json_rows(len(results), row, vectors.floats + sum(len(c) for c in cols.values()),
                            st.headers(req, t0))


class _ColbertRows:
    """One input's ColBERT vectors as the response carries them (truncated, normalized, base64 when asked), made
    when that input is sent; its float32 rows are dropped then, so a streamed answer's memory falls as it goes."""

    def __init__(self, raw: list, body):
        self.raw, self.body = raw, body
        self.floats = _floats(raw)

    def __call__(self, i: int):
        v = scoring.truncate_normalize(self.raw[i], self.body.dimensions, self.body.normalize)
        self.raw[i] = None
        return scoring.b64(v) if self.body.encoding_format == "base64" else v


OFF_LOOP_FLOATS = 1 << 16  # ~30 ms of orjson: above this a body is serialized in a worker thread and streamed


async def _json(rows: list, headers: dict) -> Response:
    """orjson, as routes_tei._json, for bodies built whole (/embed_sparse's lexical weights)."""
    return await _json_rows(len(rows), rows.__getitem__, _floats(rows), headers)


async def _json_rows(n: int, row, size: int, headers: dict) -> Response:
    """A JSON array of ``row(i)`` for i < n. ColBERT multiplies a response by its token count (64 inputs x 512
    tokens x 1024 floats: 134 MB of float32, ~410 MB as JSON), so a large one (``size`` numbers, about) is never
    held whole: each input is made (normalized, encoded) and serialized in a worker thread when the client is
    ready for it, and streamed. orjson holds the GIL while it runs, so one call per input also lets the event
    loop (other requests, the engine's results) run between them. The memory a response holds is then its
    float32 outputs, falling as they are sent, plus one input's JSON, instead of the outputs, their normalized
    copies and the whole body (and its pieces while they were joined): ~4x the float32 outputs for floats.
    The status and headers go first; orjson cannot fail on these arrays, so the 200 is not a promise broken."""
    if size < OFF_LOOP_FLOATS:
        return Response(orjson.dumps([row(i) for i in range(n)], option=NUMPY), media_type="application/json",
                        headers=headers)

    async def body():
        yield b"["
        for i in range(n):
            chunk = await asyncio.to_thread(_dump_row, row, i)
            yield chunk if i == 0 else b"," + chunk
        yield b"]"
    return StreamingResponse(body(), media_type="application/json", headers=headers)


def _dump_row(row, i: int) -> bytes:
    return orjson.dumps(row(i), option=NUMPY)


def _floats(rows: list) -> int:
    """About how many numbers the JSON body has (arrays count by size; base64 strings and sparse lists as 1)."""
    n = 0
    for r in rows:
        for v in (r.values() if isinstance(r, dict) else (r,)):
            n += v.size if isinstance(v, np.ndarray) else 1
    return n
