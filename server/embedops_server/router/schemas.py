"""Request bodies (pydantic) for TEI, OpenAI and Cohere/Jina routes. Responses are built as plain JSON."""
from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator

TokenIds = list[Annotated[int, Field(ge=0, lt=2 ** 32)]]
Input = Union[StrictStr, list[Union[StrictStr, TokenIds]], TokenIds]
Direction = Literal["right", "left", "Right", "Left"]


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore")


class EmbedRequest(_Base):
    inputs: Input
    truncate: bool | None = None
    truncation_direction: Direction = "right"
    prompt_name: str | None = None
    normalize: bool = True
    dimensions: StrictInt | None = None


class EmbedAllRequest(_Base):
    inputs: Input
    truncate: bool | None = None
    truncation_direction: Direction = "right"
    prompt_name: str | None = None


class RerankRequest(_Base):
    query: StrictStr
    texts: list[StrictStr]
    truncate: bool | None = None
    truncation_direction: Direction = "right"
    raw_scores: bool = False
    return_text: bool = False


PredictItem = Union[StrictStr, list[StrictStr]]


class PredictRequest(_Base):
    inputs: Union[StrictStr, list[PredictItem]]
    truncate: bool | None = None
    truncation_direction: Direction = "right"
    raw_scores: bool = False


class SimilarityInputs(_Base):
    source_sentence: StrictStr
    sentences: list[StrictStr]


class SimilarityParameters(_Base):
    truncate: bool | None = None
    truncation_direction: Direction = "right"
    prompt_name: str | None = None


class SimilarityRequest(_Base):
    inputs: SimilarityInputs
    parameters: SimilarityParameters | None = None


class TokenizeRequest(_Base):
    inputs: Union[StrictStr, list[StrictStr]]
    add_special_tokens: bool = True
    prompt_name: str | None = None


class DecodeRequest(_Base):
    ids: Union[TokenIds, list[TokenIds]]
    skip_special_tokens: bool = True


class OpenAIEmbeddingRequest(_Base):
    input: Input
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    user: str | None = None


class RerankDocument(_Base):
    text: StrictStr


class CohereRerankRequest(_Base):
    query: StrictStr
    documents: list[Union[StrictStr, RerankDocument]]
    model: str | None = None
    top_n: StrictInt | None = Field(default=None, ge=1)
    return_documents: bool = False
    truncate: bool | None = None

    @field_validator("documents")
    @classmethod
    def _texts(cls, v):
        return [d if isinstance(d, str) else d.text for d in v]
