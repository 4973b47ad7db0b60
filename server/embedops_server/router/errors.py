"""Error responses: TEI's {"error", "error_type"} shape, OpenAI's shape on OpenAI routes."""
from __future__ import annotations

import orjson
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from ..core.errors import BACKEND, EMPTY, OVERLOADED, TOKENIZER, UNHEALTHY, VALIDATION, EngineError

STATUS = {EMPTY: 400, VALIDATION: 422, TOKENIZER: 422, OVERLOADED: 429, BACKEND: 424, UNHEALTHY: 503,
          "Unauthorized": 401, "PayloadTooLarge": 413, "NotFound": 404, "MethodNotAllowed": 405,
          "ClientClosedRequest": 499}  # 499: nginx's code; nobody reads it, the client is gone
_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
                 413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error", 424: "server_error", 503: "server_error"}
OPENAI_PATHS = ("/v1/embeddings", "/embeddings")


class ApiError(Exception):
    """Raised by handlers; rendered in the shape the route's clients expect."""

    def __init__(self, kind: str, message: str, retry_after: int | None = None):
        self.kind, self.message, self.retry_after = kind, message, retry_after
        self.status = STATUS.get(kind, 400)


def is_openai(path: str) -> bool:
    return path in OPENAI_PATHS or path.startswith("/v1/models")


def error_body(path: str, status: int, kind: str, message: str) -> bytes:
    if is_openai(path):
        return orjson.dumps({"error": {"message": message, "type": _OPENAI_TYPES.get(status, "invalid_request_error"),
                                       "param": None, "code": kind.lower()}})
    return orjson.dumps({"error": message, "error_type": kind})


def error_response(path: str, status: int, kind: str, message: str, retry_after: int | None = None) -> Response:
    headers = {"retry-after": str(retry_after)} if retry_after else None
    return Response(error_body(path, status, kind, message), status_code=status,
                    media_type="application/json", headers=headers)


_EXPECTED = {"inputs": "a string, a list of strings, or token ids", "input": "a string, a list of strings, or token ids",
             "ids": "a list of token ids, or a list of such lists", "texts": "a list of strings",
             "documents": "a list of strings or {\"text\": ...} objects"}


def _short(errors: list) -> str:
    """One readable line: pydantic lists every union branch it tried, which buries the point."""
    fields: dict[str, list] = {}
    for e in errors:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        fields.setdefault(loc[0] if loc else "", []).append((loc, e))
    parts = []
    for name, errs in list(fields.items())[:3]:
        loc, e = errs[0]
        if not name:
            parts.append("the body must be a JSON object (content-type: application/json)")
        elif e.get("type") == "missing":
            parts.append(f"`{name}` is required")
        elif len(errs) > 1 or name in _EXPECTED and len(loc) > 1:
            parts.append(f"`{name}` must be {_EXPECTED.get(name, 'of another type')}")
        else:
            parts.append(f"`{'.'.join(loc)}`: {e.get('msg')}")
    return "Input validation error: " + "; ".join(parts)


_FAILURE_LABEL = {EMPTY: "validation", VALIDATION: "validation", TOKENIZER: "tokenization",
                  OVERLOADED: "overloaded", BACKEND: "inference", UNHEALTHY: "unhealthy"}


INPUTS_KEY = "embedops.inputs"  # request.scope: how many inputs the request carried, once known (state.run)


def count_request(st, request: Request) -> None:
    """te_request_count for a request that did not succeed: TEI counts every request, so that
    te_request_failure / te_request_count is a failure ratio. The method (single/batch) is known once the
    inputs were parsed; a request refused before that counts as single."""
    n = request.scope.get(INPUTS_KEY, 1)
    st.metrics.c.inc("te_request_count", method="batch" if n > 1 else "single")


def _record(request: Request, kind: str, message: str = "") -> None:
    st = getattr(request.app.state, "embedops", None)
    if st is not None:
        err = "batch_size" if "batch size" in message else (
            "model_type" if message.startswith("Model is not") else _FAILURE_LABEL.get(kind, "validation"))
        st.metrics.c.inc("te_request_failure", err=err)
        count_request(st, request)


def api_error(request: Request, exc: ApiError) -> Response:
    if exc.status != 499:
        _record(request, exc.kind, exc.message)
    return error_response(request.url.path, exc.status, exc.kind, exc.message, exc.retry_after)


def engine_error(request: Request, exc: EngineError) -> Response:
    _record(request, exc.kind, exc.message)
    return error_response(request.url.path, STATUS[exc.kind], exc.kind, exc.message, exc.retry_after)


def install(app) -> None:
    @app.exception_handler(ApiError)
    async def _api(request: Request, exc: ApiError):
        return api_error(request, exc)

    @app.exception_handler(EngineError)
    async def _engine(request: Request, exc: EngineError):
        return engine_error(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        _record(request, VALIDATION)
        if any(e.get("type") == "json_invalid" for e in errs):
            return error_response(request.url.path, 422, VALIDATION, "Input validation error: malformed JSON body")
        return error_response(request.url.path, 422, VALIDATION, _short(errs))

    @app.exception_handler(ValidationError)
    async def _pydantic(request: Request, exc: ValidationError):
        _record(request, VALIDATION)
        if any(e.get("type") == "json_invalid" for e in exc.errors()):
            return error_response(request.url.path, 422, VALIDATION, "Input validation error: malformed JSON body")
        return error_response(request.url.path, 422, VALIDATION, _short(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        kind = {404: "NotFound", 405: "MethodNotAllowed"}.get(exc.status_code, VALIDATION)
        msg = str(exc.detail)
        if exc.status_code == 400:  # FastAPI could not parse the body: not UTF-8, or JSON nested too deeply
            msg = "Input validation error: the request body is not UTF-8 JSON, or is nested too deeply"
        response = error_response(request.url.path, exc.status_code, kind, msg)
        if exc.status_code == 405:  # RFC 9110: a 405 lists the methods the resource supports
            response.headers["allow"] = ", ".join(allowed_methods(request.app, request.scope))
        return response


_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def allowed_methods(app, scope) -> list[str]:
    """Every method some route serves at this path (Starlette's own Allow names only the first route found)."""
    from starlette.routing import Match

    return [m for m in _METHODS
            if any(route.matches({**scope, "method": m})[0] == Match.FULL for route in app.router.routes)]


# ---- the error responses as the OpenAPI document states them (router/openapi.py adds the schemas) ----------
ERROR_SCHEMAS = {
    "ErrorResponse": {
        "title": "ErrorResponse", "type": "object", "required": ["error", "error_type"],
        "description": "TEI's error body",
        "properties": {"error": {"type": "string"},
                       "error_type": {"type": "string", "enum": sorted({*STATUS} - {"ClientClosedRequest"})}},
    },
    "OpenAIErrorResponse": {
        "title": "OpenAIErrorResponse", "type": "object", "required": ["error"],
        "description": "OpenAI's error body (OpenAI routes)",
        "properties": {"error": {
            "type": "object", "required": ["message", "type", "param", "code"],
            "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                           "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}},
        }},
    },
}
_WHEN = {
    400: "`Empty`: an empty text, or an empty list of inputs; or a body that is not UTF-8 JSON or is nested too "
         "deeply (`Validation`)",
    401: "`Unauthorized`: missing or wrong `Authorization: Bearer` key",
    404: "`NotFound`",
    413: "`PayloadTooLarge`: the body is over --payload-limit bytes",
    422: "`Validation`: malformed JSON or wrong types, more inputs than --max-client-batch-size, an input over "
         "the model's maximum length with `truncate: false` (token counts are not expressible in this "
         "document), bad `dimensions`, unknown `prompt_name`, token ids outside the vocabulary; `Tokenizer`: the "
         "tokenizer refused an input",
    424: "`Backend`: inference failed, or the loaded model's task does not serve this route (this document "
         "lists only the routes of the loaded model once it has loaded)",
    429: "`Overloaded`: more than --max-concurrent-requests inputs in flight; retry after `Retry-After` seconds",
    503: "`Unhealthy`: the model is loading or failed to load (the message says why)",
}


def responses(*codes: int, openai: bool = False) -> dict:
    """The `responses=` of a route: each status code with its error schema (OpenAI's on OpenAI routes)."""
    ref = {"$ref": "#/components/schemas/" + ("OpenAIErrorResponse" if openai else "ErrorResponse")}
    out: dict = {}
    for code in codes:
        out[code] = {"description": _WHEN[code], "content": {"application/json": {"schema": ref}}}
        if code == 429:
            out[code]["headers"] = {"Retry-After": {"description": "seconds until the queue has likely drained",
                                                    "schema": {"type": "integer", "minimum": 1}}}
    return out
