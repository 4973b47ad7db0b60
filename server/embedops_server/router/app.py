"""FastAPI application: routes, errors, metrics, readiness, and model loading in the background."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import Response

from .. import __version__
from ..core import quantize
from ..core.engine import EngineStats
from ..core.model_info import ModelError
from ..service import build_service
from ..settings import Settings, Tuning
from . import errors, openapi, routes_compat, routes_m3, routes_tei
from .errors import error_response
from .fast_path import FastPath
from .middleware import AfterResponseMiddleware, ConnectionCloseMiddleware, GuardMiddleware, MetricsPortMiddleware
from .timing import TimingMiddleware
from .tracing import Tracing
from .routes_tei import json_response
from .schemas import INFO_OK
from .state import AppState

log = logging.getLogger(__name__)
METRICS_TYPE = "text/plain; version=0.0.4"


def _stats(st: AppState) -> EngineStats:
    m = st.metrics
    return EngineStats(
        on_batch=lambda size, tokens: (m.batch_size.observe(size), m.batch_tokens.observe(tokens)),
        on_dropped=lambda n: m.c.inc("te_queue_dropped_inputs", n),
        on_input_length=m.input_length.observe,
    )


def create_app(settings: Settings, service=None,
               on_model_error: Callable[[BaseException], None] | None = None,
               tuning: Tuning | None = None) -> FastAPI:
    """``on_model_error``: called (on the event loop) when the model cannot be loaded, for any reason; the CLI
    exits non-zero then. Without it the app keeps answering 503 with the reason. ``tuning``: the EMBEDOPS_*
    switches the server read at its start (default: the environment's now), for the routes and the backend."""
    tuning = tuning if tuning is not None else Tuning()
    st = AppState(settings)
    tracing = Tracing.of(settings.otlp_endpoint, settings.otlp_service_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        task = None
        if service is not None:
            st.service = service
        else:
            # Load in the background so /health can answer 503 (not connection refused) while loading.
            async def load():
                try:
                    st.service = await asyncio.to_thread(build_service, settings, _stats(st), tuning)
                    log.info("model %s ready (%s, %s, %s) in %.1fs", settings.model_id, st.service.info.task,
                             st.service.backend.name, st.service.backend.dtype, st.service.load_seconds)
                except ModelError as e:  # the folder cannot be served: one line says why, no traceback
                    log.error("model loading failed: %s", e)
                    st.load_error = f"model loading failed: {e}"
                    if on_model_error is not None:
                        on_model_error(e)
                except Exception as e:  # noqa: BLE001 - anything else (out of memory, a full disk, a bug)
                    # ends the process too: a server that never loads must not sit answering 503 until its
                    # startup probe gives up; restarted at once, its pod shows the reason
                    log.exception("model loading failed")
                    st.load_error = f"model loading failed: {type(e).__name__}: {e}"
                    if on_model_error is not None:
                        on_model_error(e)
            task = asyncio.create_task(load())
        yield
        st.draining = True
        if task is not None and not task.done():
            task.cancel()
        if st.service is not None:
            st.service.close()
        if tracing is not None:  # the spans still queued are exported (the SDK bounds the wait)
            await asyncio.to_thread(tracing.shutdown)

    app = FastAPI(title="embedops-server", version=__version__, lifespan=lifespan,
                  description="TEI-compatible embeddings, rerank, sparse and classification server")
    app.state.embedops = st
    errors.install(app)
    openapi.install(app, st)
    app.include_router(routes_m3.router)  # first: its /embed_sparse also serves bge-m3, else defers to TEI's
    app.include_router(routes_tei.router)
    app.include_router(routes_compat.router)

    @app.get("/health", tags=["Ops"], summary="200 once the model is loaded and warmed up, else 503",
             response_class=Response, responses={200: {"description": "Healthy (empty body)"},
                                                 **errors.responses(503)})
    async def health(request: Request):
        if st.service is None or st.draining or not st.service.lanes.healthy():
            msg = st.load_error or ("shutting down" if st.draining else "unhealthy")
            return error_response(request.url.path, 503, "Unhealthy", msg)
        return Response(status_code=200)

    app.add_api_route("/ping", health, methods=["GET"], include_in_schema=False)
    app.add_api_route("/", health, methods=["GET"], include_in_schema=False)

    async def by_task(request: Request):
        """POST / and /invocations (SageMaker-style): the route that fits the model's task, as TEI does."""
        from .schemas import EmbedAllRequest, EmbedRequest, PredictRequest, RerankRequest

        task = st.svc().info.task
        route, model = {"embedding": (routes_tei.embed, EmbedRequest),
                        "sparse": (routes_tei.embed_sparse, EmbedAllRequest),
                        "reranker": (routes_tei.rerank, RerankRequest),
                        "classifier": (routes_tei.predict, PredictRequest)}[task]
        return await route(request, model.model_validate_json(await request.body()))

    for path in ("/", "/invocations"):
        app.add_api_route(path, by_task, methods=["POST"], include_in_schema=False)

    @app.get("/metrics", tags=["Ops"], summary="Prometheus metrics (TEI te_* names)",
             response_class=Response,
             responses={200: {"description": "Prometheus text exposition format 0.0.4",
                              "content": {METRICS_TYPE: {"schema": {"type": "string"}}}}})
    async def metrics():
        if st.service is not None:
            lanes = st.service.lanes
            st.metrics.queue_size.set(lanes.queued())
            st.metrics.in_flight.set(lanes.in_flight)
            st.metrics.update_lanes(lanes)
            st.metrics.update_cache(st.service.cache)
            st.metrics.update_gpu(st.service.backend.memory_stats())
        return Response(st.metrics.render(), media_type=METRICS_TYPE + "; charset=utf-8")

    @app.get("/info", tags=["Ops"], summary="Model and server configuration",
             responses={**INFO_OK, **errors.responses(503)})
    async def info():
        svc = st.svc()
        i = svc.info
        if i.task in ("classifier", "reranker"):
            labels = {str(k): v for k, v in i.id2label.items()}
            mt = {i.task: {"id2label": labels, "label2id": {v: int(k) for k, v in labels.items()}}}
        else:
            mt = {"embedding": {"pooling": i.pooling}}
        s = settings
        return json_response({
            "model_id": s.model_id, "model_sha": i.commit, "model_dtype": svc.backend.dtype,
            "model_type": mt, "task": i.task, "architecture": i.architecture,
            "served_model_name": s.served_model_name or s.model_id, "backend": svc.backend.name,
            "device": svc.backend.device, "hidden_size": svc.backend.hidden_size,
            "int8_cosine": getattr(svc.backend, "int8_cosine", None),
            # ONNX Runtime: the graph one-query forwards run ("fused", "fused-int8", "plain", "off"), see fuse_for_latency
            "latency_graph": getattr(svc.backend, "latency_graph", None),
            "max_concurrent_requests": s.max_concurrent_requests, "max_input_length": svc.max_input_length,
            "max_batch_tokens": s.max_batch_tokens, "max_batch_requests": s.max_batch_requests,
            "max_forward_tokens": svc.engine.queue.forward_tokens,
            "parallel_forwards": svc.engine.workers,
            # core/lanes.py: separate = an engine per lane (the batch one's threads at batch_lane_nice)
            "lanes": {"enabled": svc.lanes.enabled, "separate": svc.lanes.separate, "default": s.default_lane,
                      "auto_max_inputs": s.lane_auto_max_inputs, "batch_limit": svc.lanes.batch_limit,
                      "batch_nice": s.batch_lane_nice if svc.lanes.separate else 0},
            # core/cache.py: exact-match answers of this space, bounded by bytes (null: off)
            "answer_cache": {"max_bytes": svc.cache.max_bytes, "bytes": svc.cache.bytes, "entries": len(svc.cache),
                             "hits": svc.cache.hits, "misses": svc.cache.misses} if svc.cache else None,
            # core/quantize.py: int8 = round(v * 127 / scale) of the normalized vector (uint8: + 128); null: not served
            "int8": {"scale": svc.int8.scale, "calibration": f"{quantize.CALIBRATION_WORDS} vocabulary words",
                     "quantile": quantize.CALIBRATION_QUANTILE} if svc.int8 else None,
            "max_client_batch_size": s.max_client_batch_size, "auto_truncate": s.auto_truncate,
            "tokenization_workers": svc.tokenizers.workers, "version": __version__, "sha": None,
            # the embedding space the vectors belong to (core/space.py): the `embedding-space` header's value
            "embedding_space": svc.space.fingerprint if svc.space else None,
            "embedding_space_inputs": svc.space.inputs if svc.space else None,
            "docker_label": None, "prompts": sorted(i.prompts), **routes_m3.m3_info(svc),
        })

    inner = app
    if tuning.fast_path:  # the embedding routes without FastAPI's machinery
        inner = FastPath(app, settings.payload_limit)
    state = app.state.embedops
    outer = AfterResponseMiddleware(ConnectionCloseMiddleware(
        TimingMiddleware(MetricsPortMiddleware(GuardMiddleware(inner, settings.payload_limit, settings.api_key),
                                               settings.prometheus_port), space=state.space_header, tracing=tracing),
        state, settings.max_connection_age))
    if settings.cors_allow_origin:
        from starlette.middleware.cors import CORSMiddleware

        # Outside the guard: a preflight carries no API key, and a 401/413 still needs CORS headers for the
        # browser to show it. TEI allows only content-type, so browsers sending Authorization fail preflight.
        origins = [o.strip() for o in settings.cors_allow_origin.split(",") if o.strip()]
        outer = CORSMiddleware(outer, allow_origins=origins, allow_methods=["GET", "POST"],
                               allow_headers=["content-type", "authorization"], max_age=600)
    outer.fastapi = app
    return outer
