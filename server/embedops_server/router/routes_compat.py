"""OpenAI embeddings and Cohere/Jina-style rerank routes."""
from __future__ import annotations

import time
import uuid
from typing import Annotated

import numpy as np
from fastapi import APIRouter, Path, Request

from ..core import quantize
from ..core.errors import EMPTY
from ..core.model_info import EMBEDDER, RERANKER
from . import errors, scoring
from .errors import ApiError
from .routes_tei import INFERENCE_ERRORS, app_state, count_success, json_response, observe_phases, route_doc
from .schemas import (MARK, COHERE_EMBED_OK, COHERE_RERANK_OK, MODEL_OK, MODELS_OK, OPENAI_EMBED_OK, CohereEmbedRequest,
                      CohereRerankRequest, OpenAIEmbeddingRequest)

router = APIRouter()


async def openai_embeddings(request: Request, body: OpenAIEmbeddingRequest):
    st = app_state(request)
    t0 = time.perf_counter()
    svc = st.require_task(EMBEDDER)
    st.check_dimensions(svc, body.dimensions)
    scoring.check_types([body.embedding_type], svc.int8)
    texts = st.texts(svc, body.input, st.prompt(svc, None), field="input")
    results, req = await st.run(request, svc, texts, st.settings.auto_truncate, "right")
    v = scoring.dense(results, body.dimensions, True, svc.backend.hidden_size)
    # int8 and uint8: integers, or their bytes (base64); binary and ubinary: integers, or the packed bytes (base64)
    q = scoring.typed(v, body.embedding_type, svc.int8, body.dimensions)
    data = [{"object": "embedding", "embedding": scoring.b64(q[i]) if body.encoding_format == "base64" else q[i],
             "index": i} for i in range(len(q))]
    count_success(st, "embed", len(texts), t0)
    observe_phases(st, req)
    model = st.settings.served_model_name or st.settings.model_id
    return json_response({"object": "list", "data": data, "model": model,
                  "usage": {"prompt_tokens": req.tokens, "total_tokens": req.tokens}}, st.headers(req, t0))


router.add_api_route("/v1/embeddings", openai_embeddings, methods=["POST"], tags=["OpenAI"],
                     summary="OpenAI-compatible embeddings (float or base64)",
                     **route_doc(OPENAI_EMBED_OK, EMBEDDER, errs=errors.responses(400, 413, 422, 424, 429, 503, openai=True)))
router.add_api_route("/embeddings", openai_embeddings, methods=["POST"], tags=["OpenAI"], include_in_schema=False)


# Cohere's input_type -> the prompt names sentence-transformers models declare for it (the first the model has)
INPUT_TYPE_PROMPTS = {"search_query": ("query",), "search_document": ("document", "passage"),
                      "classification": ("classification",), "clustering": ("clustering",)}
COHERE_TRUNCATE = {"NONE": (False, "right"), "START": (True, "left"), "END": (True, "right")}


async def cohere_embed(request: Request, body: CohereEmbedRequest):
    """Cohere's v2 embed: the types asked for from one computation. `input_type` picks the model's prompt of that
    name when it declares one (sentence-transformers' `query`, `document`/`passage`, ...), else the server's
    default prompt applies, as on every route."""
    st = app_state(request)
    t0 = time.perf_counter()
    svc = st.require_task(EMBEDDER)
    st.check_dimensions(svc, body.output_dimension)
    scoring.check_types(body.embedding_types, svc.int8)
    names = [n for n in INPUT_TYPE_PROMPTS.get(body.input_type or "", ()) if n in svc.info.prompts]
    texts = st.texts(svc, body.texts, st.prompt(svc, names[0] if names else None), field="texts")
    truncate, direction = COHERE_TRUNCATE[body.truncate]
    results, req = await st.run(request, svc, texts, truncate, direction)
    v = scoring.dense(results, body.output_dimension, True, svc.backend.hidden_size)
    out: dict = {}
    for kind in dict.fromkeys(body.embedding_types):
        if kind == quantize.FLOAT:
            out[kind] = v
        elif kind == quantize.BASE64:
            out[kind] = [scoring.b64(row) for row in v]
        else:
            out[kind] = scoring.typed(v, kind, svc.int8, body.output_dimension)
    count_success(st, "embed", len(texts), t0)
    observe_phases(st, req)
    return json_response({"id": str(uuid.uuid4()), "embeddings": out, "texts": list(body.texts),
                          "meta": {"api_version": {"version": "2"}, "billed_units": {"input_tokens": req.tokens}},
                          "response_type": "embeddings_by_type"}, st.headers(req, t0))


router.add_api_route("/v2/embed", cohere_embed, methods=["POST"], tags=["Cohere/Jina"],
                     summary="Cohere v2 embed: float, base64, int8, uint8, binary and ubinary vectors",
                     **route_doc(COHERE_EMBED_OK, EMBEDDER))


def _model_card(st) -> dict:
    return {"id": st.settings.served_model_name or st.settings.model_id, "object": "model",
            "created": int(st.started), "owned_by": "embedops"}


@router.get("/v1/models", tags=["OpenAI"], summary="OpenAI-compatible model list (the one served model)",
            responses=MODELS_OK)
async def openai_models(request: Request):
    # OpenAI SDKs, LiteLLM and UIs discover models here before calling /v1/embeddings.
    return json_response({"object": "list", "data": [_model_card(app_state(request))]})


@router.get("/v1/models/{model_id:path}", tags=["OpenAI"], summary="One model, OpenAI-compatible",
            responses={**MODEL_OK, **errors.responses(404, openai=True)})
async def openai_model(request: Request, model_id: Annotated[str, Path(json_schema_extra={MARK: "model-id"})]):
    card = _model_card(app_state(request))
    if model_id != card["id"]:
        raise ApiError("NotFound", f"The model `{model_id}` does not exist; this server serves `{card['id']}`")
    return json_response(card)


@router.post("/v1/rerank", tags=["Cohere/Jina"], summary="Cohere/Jina-style rerank (documents, top_n)",
             **route_doc(COHERE_RERANK_OK, RERANKER))
async def cohere_rerank(request: Request, body: CohereRerankRequest):
    st = app_state(request)
    t0 = time.perf_counter()
    svc = st.require_task(RERANKER)
    docs: list[str] = body.documents  # validator flattened {"text": ...} objects
    if not docs:
        raise ApiError(EMPTY, "`documents` cannot be empty")
    st.refuse_empty("query", [body.query])
    st.refuse_empty("documents", docs)
    st.check_batch(len(docs))
    results, req = await st.run(request, svc, [(body.query, d) for d in docs], st.truncate(body.truncate), "right",
                                query=True)
    s = scoring.scores(np.stack(results), False)[:, 0]
    order = np.argsort(-s, kind="stable")[: body.top_n or len(docs)]
    out = []
    for i in order:
        item = {"index": int(i), "relevance_score": float(s[i])}
        if body.return_documents:
            item["document"] = {"text": docs[i]}
        out.append(item)
    count_success(st, "predict", len(docs), t0)
    observe_phases(st, req)
    return json_response({"id": str(uuid.uuid4()), "results": out,
                  "model": st.settings.served_model_name or st.settings.model_id,
                  "usage": {"total_tokens": req.tokens}, "meta": {"billed_units": {"search_units": 1}}},
                 st.headers(req, t0))
