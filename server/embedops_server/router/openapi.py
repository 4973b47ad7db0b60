"""The OpenAPI document of this server, true to it: the routes the loaded model serves, the limits this
server enforces (from its flags and the model), its error bodies, and its auth.

FastAPI builds the document from the routes and request models; `contract()` then
* keeps only operations the loaded model serves (the others answer 424): an operation's `x-embedops-tasks`
  (openapi_extra) must include the model's task, and its `x-embedops-outputs` must be outputs it has (a list:
  for any task; a dict: per task, e.g. /embed_sparse needs bge-m3's sparse head of an embedder, not of SPLADE),
* replaces the `x-embedops` markers of router/schemas.py with this server's values: `batch` (maxItems =
  --max-client-batch-size), `batch-1` (the same less one: /similarity counts the source sentence),
  `token-id` (maximum = vocabulary size - 1), `dimensions` (maximum = the embedding size), `prompt-name` (enum
  of the model's prompts), `chars` (maxLength of a /tokenize text), `model-id` (the one served model),
  `outputs` (enum of the outputs the model has, ModelInfo.outputs), `colbert-dimensions` (maximum = the
  ColBERT vector size), `vector-types` (without int8 and uint8 where the model has no int8 scale),
* drops FastAPI's default 422 body (`{"detail": [...]}`), which this server never sends, and gives an
  operation that runs the model (it has `x-embedops-tasks`) the inference errors it does not declare itself,
* declares the bearer scheme and 401 on the protected routes when --api-key is set.
Until the model has loaded the document lists every route and only the limits known from the flags; it is
built once for good after that.
"""
from __future__ import annotations

import copy

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from ..core import quantize
from ..core.model_info import EMBEDDER, SPARSE
from ..core.tokenization import CHARS_PER_TOKEN_LIMIT
from .errors import ERROR_SCHEMAS, is_openai, responses
from .middleware import PUBLIC_PATHS
from .schemas import MARK

TASKS = "x-embedops-tasks"
OUTPUTS = "x-embedops-outputs"
_DROP = object()


def install(app: FastAPI, state) -> None:
    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        doc = contract(doc, state.settings, state.service)
        if state.service is not None:
            app.openapi_schema = doc
        return doc

    app.openapi = openapi


def contract(doc: dict, settings, svc) -> dict:
    doc = copy.deepcopy(doc)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(copy.deepcopy(ERROR_SCHEMAS))
    task = svc.info.task if svc is not None else None
    for path in list(doc.get("paths", {})):
        ops = doc["paths"][path]
        for method in list(ops):
            op = ops[method]
            if svc is not None and not _serves(svc, op):
                del ops[method]
                continue
            for code in [c for c, r in op.get("responses", {}).items() if _is_fastapi_422(r)]:
                del op["responses"][code]
            if TASKS in op:  # it runs the model: every inference error can come back, whether declared or not
                for code, r in _str_keys(responses(400, 413, 422, 424, 429, 503, openai=is_openai(path))).items():
                    op.setdefault("responses", {}).setdefault(code, r)
            if settings.api_key and path not in PUBLIC_PATHS:
                op["security"] = [{"bearer": []}]
                op["responses"].update(_str_keys(responses(401, openai=is_openai(path))))
        if not ops:
            del doc["paths"][path]
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    if settings.api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    if task == SPARSE and "EmbedRequest" in schemas:  # SPLADE vectors are not normalized: 424 unless false
        req = schemas["EmbedRequest"]
        req["properties"]["normalize"] = {"type": "boolean", "enum": [False], "title": "Normalize",
                                          "description": "must be false for a SPLADE model"}
        req["required"] = sorted({*req.get("required", []), "normalize"})
    if svc is not None and svc.int8 is not None and "EmbedRequest" in schemas:
        # int8 and uint8 are of normalized vectors (the space's scale is): with `normalize: false` a 422
        schemas["EmbedRequest"]["anyOf"] = [
            {"properties": {"embedding_type": {"not": {"enum": list(quantize.SCALED)}}}},
            {"properties": {"normalize": {"const": True}}}]
    limits = _limits(settings, svc)
    doc["components"]["schemas"] = _resolve(schemas, limits)
    doc["paths"] = _resolve(doc.get("paths", {}), limits)
    return doc


def _serves(svc, op: dict) -> bool:
    """An operation's `x-embedops-tasks` name the model tasks it serves; `x-embedops-outputs` the outputs
    (ModelInfo.outputs, e.g. bge-m3's colbert head) the model must have, for any task (a list) or per task (a
    dict: task -> outputs). Without them it is always listed."""
    if TASKS in op and svc.info.task not in op[TASKS]:
        return False
    have = getattr(svc.info, "outputs", None) or []
    need = op.get(OUTPUTS, ())
    if isinstance(need, dict):
        need = need.get(svc.info.task, ())
    return all(o in have for o in need)


def _str_keys(d: dict) -> dict:
    return {str(k): v for k, v in d.items()}


def _is_fastapi_422(response: dict) -> bool:
    schema = response.get("content", {}).get("application/json", {}).get("schema", {})
    return schema.get("$ref", "").endswith("/HTTPValidationError")


def _limits(settings, svc) -> dict:
    n = settings.max_client_batch_size
    out: dict = {"batch": {"maxItems": n}, "batch-1": {"maxItems": max(n - 1, 1)},
                 "model-id": {"enum": [settings.served_model_name or settings.model_id]}}
    if svc is None:
        return out
    vocab = svc.tokenizers.tokenizer.get_vocab_size()
    out["token-id"] = {"maximum": vocab - 1, "exclusiveMaximum": None}
    # the vector's size: the embedding size, or for SPLADE the MaskedLM head's vocabulary
    size = svc.backend.hidden_size if svc.info.task == EMBEDDER else svc.info.config.get("vocab_size")
    if size:
        out["dimensions"] = {"maximum": int(size)}
    heads = getattr(svc.backend, "heads", None)
    colbert_dim = getattr(heads, "colbert_dim", None) if heads is not None else None
    out["colbert-dimensions"] = {"maximum": int(colbert_dim)} if colbert_dim else {}
    outputs = list(getattr(svc.info, "outputs", None) or [])
    out["outputs"] = {"enum": outputs} if outputs else _DROP
    prompts = sorted(svc.info.prompts)
    out["prompt-name"] = {"enum": prompts} if prompts else _DROP
    longest = max([len(p) for p in svc.info.prompts.values()] + [len(settings.default_prompt or "")])
    out["chars"] = {"maxLength": max(svc.max_input_length * CHARS_PER_TOKEN_LIMIT - longest, 0)}
    if svc.int8 is None:  # no dense vector, or its scale could not be measured: int8 and uint8 are refused
        out["vector-types"] = {"not": {"enum": list(quantize.SCALED)}}
    return out


def _resolve(node, limits: dict):
    """A copy of `node` with each marker replaced by its limits (or the schema removed: no valid value)."""
    if isinstance(node, list):
        items = [_resolve(x, limits) for x in node]
        return [x for x in items if x is not _DROP]
    if not isinstance(node, dict):
        return node
    if MARK in node:
        extra = limits.get(node[MARK], {})
        if extra is _DROP:
            return _DROP
        node = {k: v for k, v in node.items() if k != MARK}
        for k, v in extra.items():
            if v is None:
                node.pop(k, None)
            else:
                node[k] = v
    out = {k: r for k, v in node.items() if (r := _resolve(v, limits)) is not _DROP}
    if "anyOf" in out and len(out["anyOf"]) == 1:  # a branch was removed: inline what is left
        only = out.pop("anyOf")[0]
        out = {**only, **out}
    return out
