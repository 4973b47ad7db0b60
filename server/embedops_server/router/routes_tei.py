"""TEI-compatible routes."""
from __future__ import annotations

import asyncio
import time

import numpy as np
import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from ..core.errors import BACKEND, EMPTY, VALIDATION
from ..core.model_info import CLASSIFIER, EMBEDDER, RERANKER, SPARSE
from . import errors, scoring
from .errors import ApiError
from .metrics import after_response
from .openapi import TASKS
from .schemas import (DECODE_OK, EMBED_ALL_OK, EMBED_OK, PREDICT_OK, RERANK_OK, SIMILARITY_OK, TOKENIZE_OK,
                      DecodeRequest, EmbedAllRequest, EmbedRequest, PredictRequest, RerankRequest, SimilarityRequest,
                      TokenizeRequest)

router = APIRouter()
NUMPY = orjson.OPT_SERIALIZE_NUMPY
INFERENCE_ERRORS = errors.responses(400, 413, 422, 424, 429, 503)
TEXT_ERRORS = errors.responses(400, 413, 422, 503)  # /tokenize, /decode: no model run, no admission


def route_doc(ok: dict, *tasks: str, errs: dict = INFERENCE_ERRORS) -> dict:
    """Route keywords for the OpenAPI document: its responses and the tasks it serves (router/openapi.py)."""
    return {"responses": {**ok, **errs}, "openapi_extra": {TASKS: list(tasks)} if tasks else None}


def json_response(obj, headers=None) -> Response:
    return Response(orjson.dumps(obj, option=NUMPY), media_type="application/json", headers=headers)


def app_state(request: Request):
    return request.app.state.embedops


def count_success(st, route: str, n: int, t0: float) -> None:
    """A request answered: te_request_count and _success (failures count in errors._record). Recorded once the
    answer is written: see after_response."""
    after_response(_count_success, st, route, n, t0)


def _count_success(st, route: str, n: int, t0: float) -> None:
    c = st.metrics.c
    method = "batch" if n > 1 else "single"
    c.inc("te_request_count", method=method)
    c.inc(f"te_{route}_count", n)
    c.inc("te_request_success", method=method)
    c.inc(f"te_{route}_success", n)
    dt = time.perf_counter() - t0
    st.metrics.request_duration.observe(dt)
    (st.metrics.embed_duration if route == "embed" else st.metrics.predict_duration).observe(dt)


async def _embed_like(request: Request, body, need_tokens: bool, tasks: tuple[str, ...], route="embed"):
    st = app_state(request)
    t0 = time.perf_counter()
    svc = st.require_task(*tasks)
    texts = st.texts(svc, body.inputs, st.prompt(svc, body.prompt_name))
    results, req = await st.run(request, svc, texts, st.truncate(body.truncate), body.truncation_direction,
                                need_tokens)
    count_success(st, route, len(texts), t0)
    observe_phases(st, req)
    return results, req, t0


def observe_phases(st, req) -> None:
    """The request's tokenization, queue and inference times (TEI's histograms), after the answer."""
    after_response(_observe_phases, st, req)


def _observe_phases(st, req) -> None:
    m = st.metrics
    n = max(1, req.n)
    m.request_tok.observe(max(0.0, req.t_tokenized - req.t_start))
    m.request_queue.observe(req.t_queue / n)
    m.request_inf.observe(req.t_infer / n)


@router.post("/embed", tags=["TEI"], summary="Embed inputs (pooled, optionally normalized and MRL-truncated)",
             **route_doc(EMBED_OK, EMBEDDER, SPARSE))
async def embed(request: Request, body: EmbedRequest):
    st = app_state(request)
    svc = st.require_task(EMBEDDER, SPARSE)
    if svc.info.task == SPARSE and body.normalize:
        raise ApiError(BACKEND, "`normalize` is not available for SPLADE models; pass normalize=false")
    st.check_dimensions(svc, body.dimensions)
    scoring.check_types([body.embedding_type], svc.int8, body.normalize)
    results, req, t0 = await _embed_like(request, body, False, (EMBEDDER, SPARSE))
    vecs = scoring.typed(scoring.dense(results, body.dimensions, body.normalize, svc.backend.hidden_size),
                         body.embedding_type, svc.int8, body.dimensions)
    return json_response(vecs, st.headers(req, t0))


@router.post("/embed_all", tags=["TEI"], summary="Per-token hidden states (no pooling)",
             **route_doc(EMBED_ALL_OK, EMBEDDER))
async def embed_all(request: Request, body: EmbedAllRequest):
    st = app_state(request)
    results, req, t0 = await _embed_like(request, body, True, (EMBEDDER,))
    return json_response([np.ascontiguousarray(r, dtype=np.float32) for r in results], st.headers(req, t0))


# documented by routes_m3's /embed_sparse (first on the path), which defers here for SPLADE models
@router.post("/embed_sparse", include_in_schema=False)
async def embed_sparse(request: Request, body: EmbedAllRequest):
    st = app_state(request)
    results, req, t0 = await _embed_like(request, body, False, (SPARSE,))
    return json_response(scoring.sparse(results), st.headers(req, t0))


@router.post("/rerank", tags=["TEI"], summary="Score (query, text) pairs with a re-ranker; sorted by score",
             **route_doc(RERANK_OK, RERANKER))
async def rerank(request: Request, body: RerankRequest):
    st = app_state(request)
    t0 = time.perf_counter()
    svc = st.require_task(RERANKER)
    if not body.texts:
        raise ApiError(EMPTY, "`texts` cannot be empty")
    st.refuse_empty("query", [body.query])
    st.refuse_empty("texts", body.texts)
    st.check_batch(len(body.texts))
    pairs = [(body.query, t) for t in body.texts]
    results, req = await st.run(request, svc, pairs, st.truncate(body.truncate), body.truncation_direction,
                                query=True)
    s = scoring.scores(np.stack(results), body.raw_scores)[:, 0]
    if np.isnan(s).any():
        raise ApiError(BACKEND, "score is NaN")
    order = np.argsort(-s, kind="stable")
    out = [{"index": int(i), "score": float(s[i]), **({"text": body.texts[i]} if body.return_text else {})}
           for i in order]
    count_success(st, "predict", len(pairs), t0)
    observe_phases(st, req)
    return json_response(out, st.headers(req, t0))


@router.post("/predict", tags=["TEI"], summary="Classify a text or a pair (single or batch)",
             **route_doc(PREDICT_OK, CLASSIFIER, RERANKER))
async def predict(request: Request, body: PredictRequest):
    st = app_state(request)
    t0 = time.perf_counter()
    svc = st.require_task(CLASSIFIER, RERANKER)
    inp = body.inputs
    if isinstance(inp, str):
        items, single = [inp], True
    elif inp and all(isinstance(x, str) for x in inp) and len(inp) <= 2:
        items, single = [tuple(inp) if len(inp) == 2 else inp[0]], True
    else:
        items, single = [], False
        for x in inp:
            if isinstance(x, list) and not 1 <= len(x) <= 2:
                raise ApiError(VALIDATION, "Input validation error: each input must be a text or a [text, text] pair")
            items.append(x if isinstance(x, str) else (tuple(x) if len(x) == 2 else x[0]))
    if not items:
        raise ApiError(EMPTY, "`inputs` cannot be empty")
    st.refuse_empty("inputs", items)
    st.check_batch(len(items))
    results, req = await st.run(request, svc, items, st.truncate(body.truncate), body.truncation_direction)
    probs = scoring.scores(np.stack(results), body.raw_scores)
    labels = svc.info.id2label
    out = []
    for row in probs:
        order = np.argsort(-row, kind="stable")
        out.append([{"score": float(row[j]), "label": labels.get(int(j), f"LABEL_{j}")} for j in order])
    count_success(st, "predict", len(items), t0)
    observe_phases(st, req)
    return json_response(out[0] if single else out, st.headers(req, t0))


@router.post("/similarity", tags=["TEI"], summary="Cosine similarity of a source sentence to sentences",
             **route_doc(SIMILARITY_OK, EMBEDDER))
async def similarity(request: Request, body: SimilarityRequest):
    st = app_state(request)
    t0 = time.perf_counter()
    svc = st.require_task(EMBEDDER)
    if not body.inputs.sentences:
        raise ApiError(EMPTY, "`sentences` cannot be empty")
    st.refuse_empty("source_sentence", [body.inputs.source_sentence])
    st.refuse_empty("sentences", body.inputs.sentences)
    p = body.parameters
    prompt = st.prompt(svc, p.prompt_name if p else None)
    texts = [body.inputs.source_sentence, *body.inputs.sentences]
    st.check_batch(len(texts))
    texts = [prompt + t if prompt else t for t in texts]
    results, req = await st.run(request, svc, texts, st.truncate(p.truncate if p else None),
                                p.truncation_direction if p else "right")
    v = scoring.dense(results, None, True, 0)
    count_success(st, "embed", len(texts), t0)
    return json_response((v[1:] @ v[0]).astype(np.float32), st.headers(req, t0))


@router.post("/tokenize", tags=["TEI"], summary="Tokenize inputs (no truncation)", **route_doc(TOKENIZE_OK, errs=TEXT_ERRORS))
async def tokenize(request: Request, body: TokenizeRequest):
    st = app_state(request)
    svc = st.svc()
    texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
    if not texts:
        raise ApiError(EMPTY, "`inputs` cannot be empty")
    st.check_batch(len(texts))
    prompt = st.prompt(svc, body.prompt_name)
    texts = [prompt + t if prompt else t for t in texts]
    limit = svc.max_input_length * 250
    if any(len(t) > limit for t in texts):
        raise ApiError(VALIDATION, f"Input validation error: `inputs` must have less than {limit} characters")
    encs = await asyncio.to_thread(svc.tokenizers.encode_untruncated, texts, body.add_special_tokens)
    out = []
    for text, e in zip(texts, encs):
        toks = []
        for tid, piece, special, (a, b) in zip(e.ids, e.tokens, e.special_tokens_mask, e.offsets):
            toks.append({"id": tid, "text": piece if special or a == b else text[a:b], "special": bool(special),
                         "start": None if special else a, "stop": None if special else b})
        out.append(toks)
    return json_response(out)


@router.post("/decode", tags=["TEI"], summary="Decode token ids to text (an empty list decodes to \"\")",
             **route_doc(DECODE_OK, errs=TEXT_ERRORS))
async def decode(request: Request, body: DecodeRequest):
    st = app_state(request)
    svc = st.svc()
    batch = [body.ids] if not body.ids or isinstance(body.ids[0], int) else body.ids
    st.check_batch(len(batch))
    vocab = svc.tokenizers.tokenizer.get_vocab_size()
    if any(i >= vocab for ids in batch for i in ids):
        raise ApiError(VALIDATION, f"Input validation error: token id out of range (vocabulary size {vocab})")
    texts = svc.tokenizers.tokenizer.decode_batch(batch, skip_special_tokens=body.skip_special_tokens)
    return json_response(texts)
