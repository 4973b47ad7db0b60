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


def error_body(path: str, status: int, kind: str, message: str) -> bytes:
    if path in OPENAI_PATHS or path.startswith("/v1/models"):
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


def _record(request: Request, kind: str, message: str = "") -> None:
    st = getattr(request.app.state, "embedops", None)
    if st is not None:
        err = "batch_size" if "batch size" in message else (
            "model_type" if message.startswith("Model is not") else _FAILURE_LABEL.get(kind, "validation"))
        st.metrics.c.inc("te_request_failure", err=err)


def install(app) -> None:
    @app.exception_handler(ApiError)
    async def _api(request: Request, exc: ApiError):
        if exc.status != 499:
            _record(request, exc.kind, exc.message)
        return error_response(request.url.path, exc.status, exc.kind, exc.message, exc.retry_after)

    @app.exception_handler(EngineError)
    async def _engine(request: Request, exc: EngineError):
        _record(request, exc.kind, exc.message)
        return error_response(request.url.path, STATUS[exc.kind], exc.kind, exc.message, exc.retry_after)

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
        if exc.status_code == 400:
            msg = "Input validation error: the request body is not valid UTF-8 JSON"
        return error_response(request.url.path, exc.status_code, kind, msg)
