"""Per-process server state and the one code path every inference route goes through."""
from __future__ import annotations

import asyncio
import time
from typing import Sequence

from fastapi import Request

from ..core.errors import BACKEND, EMPTY, OVERLOADED, UNHEALTHY, VALIDATION, EngineError
from ..core.lanes import BATCH, choose_lane
from ..core.model_info import EMBEDDER
from ..service import Service
from ..settings import Settings
from .errors import INPUTS_KEY, ApiError, count_request
from .middleware import AFTER_RESPONSE_KEY
from .timing import ENGINE_REQUEST_KEY
from .metrics import Metrics, after_response

# The client's word on a request's lane (core/lanes.py): "interactive" or "batch". A header, so that a client
# sets it without touching bodies: the OpenAI SDK per call (extra_headers) or per client (default_headers),
# LiteLLM per model (litellm_params.extra_headers) or per call.
LANE_HEADER = "embedops-lane"
# How many of a request's inputs the answer cache answered (core/cache.py), on every answer while it is on.
CACHE_HEADER = "embedops-cache-hits"


class AppState:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.metrics = Metrics()
        self.service: Service | None = None
        self.load_error: str | None = None
        self.draining = False
        self.started = time.time()  # the OpenAI model card's `created`
        # How many HTTP requests the server holds, begun or not (set by router/server.py; None: not known).
        self.requests_in_flight = None
        self._space_header: tuple | None = None  # (service, its header value), made once

    def space_header(self) -> bytes | None:
        """The `embedding-space` header's value: the loaded model's fingerprint (core/space.py)."""
        svc = self.service
        if svc is None or svc.space is None:
            return None
        if self._space_header is None or self._space_header[0] is not svc:
            self._space_header = (svc, svc.space.fingerprint.encode())
        return self._space_header[1]

    def alone(self) -> bool:
        """Is the request calling this the only one the HTTP server holds? uvicorn makes a request's task when
        its headers arrive, so requests read in the same pass over the sockets count before they run."""
        return self.requests_in_flight is None or self.requests_in_flight() <= 1

    # ---- helpers used by routes -----------------------------------------------------------
    def svc(self) -> Service:
        if self.service is None:
            raise ApiError(UNHEALTHY, self.load_error or "model is loading")
        return self.service  # also while draining: see router/server.py's DrainingServer

    def require_task(self, *tasks: str) -> Service:
        svc = self.svc()
        if svc.info.task not in tasks:
            names = {"embedding": "an embedding", "sparse": "a sparse (SPLADE)", "reranker": "a re-ranker",
                     "classifier": "a classifier"}
            raise ApiError(BACKEND, f"Model is not {' or '.join(names[t] for t in tasks)} model "
                                    f"(it is {names[svc.info.task]} model)")
        return svc

    def truncate(self, value: bool | None) -> bool:
        return self.settings.auto_truncate if value is None else value

    def prompt(self, svc: Service, prompt_name: str | None) -> str | None:
        if prompt_name is not None:
            if prompt_name not in svc.info.prompts:
                raise ApiError(VALIDATION, f"Input validation error: unknown prompt_name {prompt_name!r}; "
                                           f"available: {sorted(svc.info.prompts)}")
            return svc.info.prompts[prompt_name]
        if self.settings.default_prompt_name:
            return svc.info.prompts[self.settings.default_prompt_name]
        return self.settings.default_prompt

    def texts(self, svc: Service, inputs, prompt: str | None, field: str = "inputs") -> list[str]:
        """Normalize TEI `Input` (string, ids, or a batch of either) to a list of strings."""
        if isinstance(inputs, str):
            items = [inputs]
        elif inputs and all(isinstance(x, int) for x in inputs):
            items = [inputs]
        else:
            items = list(inputs)
        if not items:
            raise ApiError(EMPTY, f"`{field}` cannot be empty")
        self.refuse_empty(field, items)
        self.check_batch(len(items))
        out = []
        for x in items:
            if not isinstance(x, str):  # token ids: decoded and re-tokenized, as TEI does
                x = self.decode(svc, x)
            out.append(prompt + x if prompt else x)
        return out

    def decode(self, svc: Service, ids: list[int]) -> str:
        vocab = svc.tokenizers.tokenizer.get_vocab_size()
        if any(i >= vocab for i in ids):
            raise ApiError(VALIDATION, f"Input validation error: token id out of range (vocabulary size {vocab})")
        return svc.tokenizers.tokenizer.decode(ids, skip_special_tokens=True)

    @staticmethod
    def refuse_empty(field: str, items) -> None:
        """TEI's 400 `Empty` for an empty text, pair member or token-id list (checked before any prompt)."""
        if any(_empty(x) for x in items):
            raise ApiError(EMPTY, f"Input validation error: `{field}` cannot be empty")

    def check_dimensions(self, svc: Service, dimensions: int | None) -> None:
        """Before any inference: `dimensions` outside 1..the embedding size (scoring.dense checks it again)."""
        hidden = svc.backend.hidden_size
        if dimensions is not None and svc.info.task == EMBEDDER and hidden and not 1 <= dimensions <= hidden:
            raise ApiError(VALIDATION, f"Input validation error: `dimensions` must be between 1 and {hidden}")

    def check_batch(self, n: int) -> None:
        limit = self.settings.max_client_batch_size
        if n > limit:
            raise ApiError(VALIDATION, f"batch size {n} > maximum allowed batch size {limit}")

    def lane(self, request: Request, n: int, query: bool) -> str:
        """The header's lane, else batch on --batch-port, else the service's default (core/lanes.py)."""
        s = self.settings
        default = s.default_lane
        server = request.scope.get("server")
        if s.batch_port and server and server[1] == s.batch_port:
            default = BATCH
        try:
            return choose_lane(request.headers.get(LANE_HEADER), n, default, s.lane_auto_max_inputs, query)
        except EngineError as exc:
            raise ApiError(VALIDATION, f"{exc.message} (header {LANE_HEADER})") from None

    async def run(self, request: Request, svc: Service, texts: Sequence, truncate: bool, direction: str,
                  need_tokens: bool = False, outputs: Sequence[str] | None = None, query: bool = False):
        """Admit, queue and await inputs; drop them if the client goes away. Returns (results, engine request).
        ``outputs``: a multi-output (bge-m3) request, see Engine.submit; each result is then a dict of them.
        ``query``: the inputs answer one question (a rerank's candidates): interactive under --default-lane auto."""
        lanes = svc.lanes
        n = len(texts)
        request.scope[INPUTS_KEY] = n
        lane = self.lane(request, n, query)
        engine = lanes.engine(lane)
        if need_tokens or (outputs is not None and "colbert" in outputs):
            lanes.admit_token_answer()  # 429 while as many answers of every token's state are in progress
            # held until the answer is sent (middleware.AfterResponseMiddleware), not only computed
            request.scope.setdefault(AFTER_RESPONSE_KEY, []).append(lanes.release_token_answer)
        # the answer cache's (--answer-cache-bytes): only the inputs it misses are admitted and computed
        cached = engine.lookup(texts, truncate, direction.lower(), need_tokens, outputs)
        if cached is not None:
            n = len(cached.missing)
        try:
            lanes.admit(lane, n)  # raises Overloaded (429 + Retry-After) at once
        except EngineError as exc:
            if exc.kind == OVERLOADED:
                self.metrics.c.inc("embedops_lane_overloaded", lane=lane)
            raise
        try:
            req = engine.submit(texts, truncate, direction.lower(), need_tokens, outputs, alone=self.alone(),
                                lane=lane, cached=cached)
            request.scope[ENGINE_REQUEST_KEY] = req
            fut = req.future
            if not fut.done():  # (a lone query run on the event loop is answered already)
                watcher = asyncio.ensure_future(_disconnected(request))
                try:
                    await asyncio.wait((fut, watcher), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    watcher.cancel()
            if not fut.done():
                req.cancelled = True  # the batcher drops its queued entries
                fut.cancel()
                self.metrics.c.inc("te_request_failure", err="dropped")
                count_request(self, request)  # a 499 is not recorded by the error handler
                raise ApiError("ClientClosedRequest", "client disconnected")
            results = fut.result()
            after_response(self._count_lane, lane, max(0.0, (req.t_done or time.perf_counter()) - req.t_start))
            return results, req
        finally:
            lanes.release(lane, n)

    def _count_lane(self, lane: str, seconds: float) -> None:
        self.metrics.c.inc("embedops_lane_requests", lane=lane)
        self.metrics.lane_duration_of[lane].observe(seconds)

    def headers(self, req, t_start: float) -> dict[str, str]:
        n = max(1, req.n)
        total = (time.perf_counter() - t_start) * 1000
        tok = max(0.0, (req.t_tokenized - req.t_start) * 1000)
        return {
            "x-compute-type": self.service.backend.device if self.service else "cpu",
            "x-compute-time": f"{total:.3f}",
            "x-total-time": f"{total:.3f}",
            "x-tokenization-time": f"{tok:.3f}",
            "x-queue-time": f"{req.t_queue * 1000 / n:.3f}",
            "x-inference-time": f"{req.t_infer * 1000 / n:.3f}",
            "x-compute-tokens": str(req.tokens),
            LANE_HEADER: req.lane,
            **({CACHE_HEADER: str(req.cached.hits if req.cached else 0)}
               if self.service and self.service.cache is not None else {}),
        }


def _empty(x) -> bool:
    if isinstance(x, str):
        return not x
    if isinstance(x, tuple):  # a (query, text) pair
        return any(_empty(y) for y in x)
    return len(x) == 0  # token ids


async def _disconnected(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return
