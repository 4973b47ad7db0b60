"""Request bodies (pydantic) for TEI, OpenAI and Cohere/Jina routes, and the documented shapes of responses.

The models validate types only; limits the routes enforce with TEI's own errors (non-empty texts and lists:
400 `Empty`; batch size, token ids, `dimensions`: 422) are stated in the OpenAPI document through `_Doc`
annotations. Limits that depend on the server's flags or the loaded model are `x-embedops` markers that
router/openapi.py replaces with the values of this server.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator



@dataclass(frozen=True)
class _Doc:
    """JSON Schema keywords added to a type's schema (documentation only: pydantic does not enforce them)."""
    keywords: tuple

    def __get_pydantic_json_schema__(self, core_schema, handler):
        js = handler(core_schema)
        js.update(dict(self.keywords))
        return js


def doc(**keywords: Any) -> _Doc:
    return _Doc(tuple((k.replace("_", "-") if k.startswith("x_") else k, v) for k, v in keywords.items()))


def _integral(v):
    """JSON Schema's integer: 3 and 3.0 alike (clients that write numbers as floats); never a bool or a string."""
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


Int = Annotated[StrictInt, BeforeValidator(_integral)]
MARK = "x-embedops"  # resolved by router/openapi.py: batch, batch-1, token-id, dimensions, prompt-name, chars,
# model-id, outputs, vector-types
Text = Annotated[StrictStr, doc(minLength=1)]  # an input that is embedded, scored or classified
TokenId = Annotated[StrictInt, Field(ge=0, lt=2 ** 32), BeforeValidator(_integral), doc(x_embedops="token-id")]
TokenIds = Annotated[list[TokenId], doc(minItems=1)]
Input = Union[Text, Annotated[list[Union[Text, TokenIds]], doc(minItems=1, x_embedops="batch")], TokenIds]
Direction = Literal["right", "left", "Right", "Left"]
Dimensions = Annotated[Int, doc(minimum=1, x_embedops="dimensions")]
PromptName = Annotated[StrictStr, doc(x_embedops="prompt-name")]


def texts(n_min: int = 1, mark: str = "batch"):
    return Annotated[list[Text], doc(minItems=n_min, x_embedops=mark)]


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore")


# embedops' extension of TEI's /embed and OpenAI's /v1/embeddings: the vector's type (core/quantize.py); binary
# and ubinary are the sign bits packed eight to a byte, int8 and uint8 at the space's scale, as Cohere's /v2/embed
# `vector-types`: the contract leaves int8 and uint8 out for a model without the space's int8 scale
EmbeddingType = Annotated[Literal["float", "int8", "uint8", "binary", "ubinary"], doc(x_embedops="vector-types")]


class EmbedRequest(_Base):
    inputs: Input
    truncate: StrictBool | None = None
    truncation_direction: Direction = "right"
    prompt_name: PromptName | None = None
    normalize: StrictBool = True
    dimensions: Dimensions | None = None
    embedding_type: EmbeddingType = "float"


class EmbedAllRequest(_Base):
    inputs: Input
    truncate: StrictBool | None = None
    truncation_direction: Direction = "right"
    prompt_name: PromptName | None = None


class RerankRequest(_Base):
    query: Text
    texts: texts()
    truncate: StrictBool | None = None
    truncation_direction: Direction = "right"
    raw_scores: StrictBool = False
    return_text: StrictBool = False


PredictItem = Union[Text, Annotated[list[Text], doc(minItems=1, maxItems=2)]]


class PredictRequest(_Base):
    inputs: Union[Text, Annotated[list[PredictItem], doc(minItems=1, x_embedops="batch")]]
    truncate: StrictBool | None = None
    truncation_direction: Direction = "right"
    raw_scores: StrictBool = False


class SimilarityInputs(_Base):
    source_sentence: Text
    sentences: texts(mark="batch-1")  # the batch is the sentences and the source sentence


class SimilarityParameters(_Base):
    truncate: StrictBool | None = None
    truncation_direction: Direction = "right"
    prompt_name: PromptName | None = None


class SimilarityRequest(_Base):
    inputs: SimilarityInputs
    parameters: SimilarityParameters | None = None


TokenizeText = Annotated[StrictStr, doc(x_embedops="chars")]


class TokenizeRequest(_Base):
    inputs: Union[TokenizeText, Annotated[list[TokenizeText], doc(minItems=1, x_embedops="batch")]]
    add_special_tokens: StrictBool = True
    prompt_name: PromptName | None = None


DecodeIds = list[TokenId]  # may be empty: it decodes to ""


class DecodeRequest(_Base):
    ids: Union[DecodeIds, Annotated[list[DecodeIds], doc(minItems=1, x_embedops="batch")]]
    skip_special_tokens: StrictBool = True


class OpenAIEmbeddingRequest(_Base):
    input: Input
    model: StrictStr | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Dimensions | None = None
    user: StrictStr | None = None
    embedding_type: EmbeddingType = "float"


CohereEmbeddingType = Annotated[Literal["float", "int8", "uint8", "binary", "ubinary", "base64"],
                                doc(x_embedops="vector-types")]


class CohereEmbedRequest(_Base):
    """Cohere's v2 embed (texts only; `images` and multimodal `inputs` are not served)."""
    texts: texts()
    model: StrictStr | None = None
    input_type: Literal["search_document", "search_query", "classification", "clustering"] | None = None
    embedding_types: Annotated[list[CohereEmbeddingType], Field(min_length=1)] = ["float"]
    truncate: Literal["NONE", "START", "END"] = "END"
    output_dimension: Dimensions | None = None


class RerankDocument(_Base):
    text: Text


class CohereRerankRequest(_Base):
    query: Text
    documents: Annotated[list[Union[Text, RerankDocument]], doc(minItems=1, x_embedops="batch")]
    model: StrictStr | None = None
    top_n: Annotated[StrictInt, Field(ge=1), BeforeValidator(_integral)] | None = None
    return_documents: StrictBool = False
    truncate: StrictBool | None = None

    @field_validator("documents")
    @classmethod
    def _texts(cls, v):
        return [d if isinstance(d, str) else d.text for d in v]


# ---- response bodies as documented (the routes build them as plain JSON) ------------------------------------
def ok(schema: dict, description: str = "Successful Response") -> dict:
    return {200: {"description": description, "content": {"application/json": {"schema": schema}}}}


_NUM = {"type": "number"}
_VEC = {"type": "array", "items": _NUM}
_SPARSE_ITEM = {"type": "object", "required": ["index", "value"],
                "properties": {"index": {"type": "integer", "minimum": 0}, "value": _NUM}}
_LABEL_SCORES = {"type": "array", "items": {"type": "object", "required": ["score", "label"],
                                            "properties": {"score": _NUM, "label": {"type": "string"}}}}
_TOKEN = {"type": "object", "required": ["id", "text", "special", "start", "stop"],
          "properties": {"id": {"type": "integer", "minimum": 0}, "text": {"type": "string"},
                         "special": {"type": "boolean"}, "start": {"type": ["integer", "null"]},
                         "stop": {"type": ["integer", "null"]}}}
_MODEL_CARD = {"type": "object", "required": ["id", "object", "created", "owned_by"],
               "properties": {"id": {"type": "string"}, "object": {"const": "model"},
                              "created": {"type": "integer"}, "owned_by": {"type": "string"}}}

EMBED_OK = ok({"type": "array", "items": _VEC}, "One vector per input (integers for binary and ubinary)")
_B64 = {"type": "string", "contentEncoding": "base64"}
_COLBERT = {"anyOf": [{"type": "array", "items": _VEC}, _B64]}  # tokens x colbert_dim, or its float32 base64
COLBERT_OK = ok({"type": "array", "items": _COLBERT},
                "Per input, one vector per token after the first (or their little-endian float32, base64)")
HYBRID_OK = ok({"type": "array", "items": {
    "type": "object", "properties": {"dense": {"anyOf": [_VEC, _B64]},
                                     "sparse": {"type": "array", "items": _SPARSE_ITEM}, "colbert": _COLBERT}}},
    "Per input, the outputs asked for (default: all the model has)")
EMBED_ALL_OK = ok({"type": "array", "items": {"type": "array", "items": _VEC}}, "Per input, one vector per token")
SPARSE_OK = ok({"type": "array", "items": {"type": "array", "items": _SPARSE_ITEM}},
               "Per input, its non-zero entries")
RERANK_OK = ok({"type": "array", "items": {
    "type": "object", "required": ["index", "score"],
    "properties": {"index": {"type": "integer", "minimum": 0}, "score": _NUM, "text": {"type": "string"}}}},
    "Sorted by score, highest first")
PREDICT_OK = ok({"anyOf": [_LABEL_SCORES, {"type": "array", "items": _LABEL_SCORES}]},
                "Labels by score, highest first: one list for a single input, a list of lists for a batch")
SIMILARITY_OK = ok(_VEC, "Cosine similarity of each sentence to the source sentence")
TOKENIZE_OK = ok({"type": "array", "items": {"type": "array", "items": _TOKEN}})
DECODE_OK = ok({"type": "array", "items": {"type": "string"}})
OPENAI_EMBED_OK = ok({
    "type": "object", "required": ["object", "data", "model", "usage"],
    "properties": {
        "object": {"const": "list"}, "model": {"type": "string"},
        "data": {"type": "array", "items": {
            "type": "object", "required": ["object", "embedding", "index"],
            "properties": {"object": {"const": "embedding"}, "index": {"type": "integer", "minimum": 0},
                           "embedding": {"anyOf": [_VEC, {"type": "string", "contentEncoding": "base64"}]}}}},
        "usage": {"type": "object", "required": ["prompt_tokens", "total_tokens"],
                  "properties": {"prompt_tokens": {"type": "integer"}, "total_tokens": {"type": "integer"}}}}})
_INTS = {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}}
COHERE_EMBED_OK = ok({
    "type": "object", "required": ["id", "embeddings", "texts", "meta", "response_type"],
    "properties": {
        "id": {"type": "string"}, "response_type": {"const": "embeddings_by_type"},
        "texts": {"type": "array", "items": {"type": "string"}}, "meta": {"type": "object"},
        "embeddings": {"type": "object", "properties": {
            "float": {"type": "array", "items": _VEC}, "binary": _INTS, "ubinary": _INTS,
            "base64": {"type": "array", "items": _B64}}}}},
    "The vectors of each type asked for (binary, ubinary: the sign bits, packed eight to a byte)")
MODELS_OK = ok({"type": "object", "required": ["object", "data"],
                "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": _MODEL_CARD}}})
MODEL_OK = ok(_MODEL_CARD)
COHERE_RERANK_OK = ok({
    "type": "object", "required": ["id", "results", "model", "usage", "meta"],
    "properties": {
        "id": {"type": "string"}, "model": {"type": "string"}, "usage": {"type": "object"}, "meta": {"type": "object"},
        "results": {"type": "array", "items": {
            "type": "object", "required": ["index", "relevance_score"],
            "properties": {"index": {"type": "integer", "minimum": 0}, "relevance_score": _NUM,
                           "document": {"type": "object", "required": ["text"],
                                        "properties": {"text": {"type": "string"}}}}}}}})
INFO_OK = ok({"type": "object", "required": ["model_id", "task", "max_input_length", "max_client_batch_size"],
              "properties": {"model_id": {"type": "string"}, "task": {"type": "string"},
                             "max_input_length": {"type": "integer"}, "max_client_batch_size": {"type": "integer"}}},
             "Model and server configuration (TEI's fields and embedops' own)")
