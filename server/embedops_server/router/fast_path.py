"""The embedding routes' hot path without FastAPI's request machinery.

`POST /embed` and `/v1/embeddings` carry every query a RAG service sends. Through FastAPI each one pays for
Starlette's middleware stack, the match against every route, `json.loads` and then pydantic on the Python
objects, and dependency solving: ~0.3 ms of a 3 ms answer on the bench's lone query (docs/bench.md). Here the
body goes straight through the route's own pydantic model (`model_validate_json`, one pass in Rust) into the
same route function, and its errors through the same handlers, so answers, headers and metrics are FastAPI's.

Only what FastAPI would accept takes this path: a body the model refuses, or one FastAPI would not read as JSON
(another content type), is handed to FastAPI untouched, which answers it exactly as before. Placed inside the
guard (API key, payload limit) and the timing middleware. EMBEDOPS_FAST_PATH=0 turns it off.
"""
from __future__ import annotations

from pydantic import ValidationError
from starlette.requests import Request

from ..asgi import read_body, replay
from ..core.errors import EngineError
from . import errors, routes_compat, routes_tei
from .errors import ApiError
from .schemas import EmbedRequest, OpenAIEmbeddingRequest

ROUTES = {
    "/embed": (routes_tei.embed, EmbedRequest),
    "/v1/embeddings": (routes_compat.openai_embeddings, OpenAIEmbeddingRequest),
    "/embeddings": (routes_compat.openai_embeddings, OpenAIEmbeddingRequest),
}


def _json_body(scope) -> bool:
    """FastAPI parses a body as JSON only under an application/json (or application/*+json) content type; without
    one it answers 422 (its strict content-type check)."""
    for k, v in scope["headers"]:
        if k == b"content-type":
            kind = v.split(b";", 1)[0].strip().lower()
            return kind == b"application/json" or (kind.startswith(b"application/") and kind.endswith(b"+json"))
    return False


class FastPath:
    def __init__(self, app, payload_limit: int):
        self.app = app  # the FastAPI app: everything else, and what the routes read as request.app
        self.limit = payload_limit

    async def __call__(self, scope, receive, send):
        route = ROUTES.get(scope.get("path")) if scope["type"] == "http" and scope["method"] == "POST" else None
        if route is None or not _json_body(scope):
            return await self.app(scope, receive, send)
        body = await read_body(receive, self.limit)  # the guard outside already refused what is over the limit
        if body is None:
            return  # the client left before its body ended: nothing to answer
        handler, model = route
        try:
            parsed = model.model_validate_json(body)
        except ValidationError:  # FastAPI answers it (its 422, or 400 for bodies it cannot decode), as ever
            return await self.app(scope, replay(body, receive), send)
        scope["app"] = self.app  # what request.app reads (Starlette sets it when the request goes through it)
        request = Request(scope, receive)
        try:
            response = await handler(request, parsed)
        except ApiError as exc:
            response = errors.api_error(request, exc)
        except EngineError as exc:
            response = errors.engine_error(request, exc)
        await response(scope, receive, send)
