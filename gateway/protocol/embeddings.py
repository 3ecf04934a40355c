"""OpenAI's embeddings API (`POST /v1/embeddings`) as pydantic models, after the openai SDK's
`EmbeddingCreateParams`, `CreateEmbeddingResponse` and `Embedding`."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.protocol.openai import ModelRequest

MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one request

Text = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[int], Field(min_length=1)]
EmbeddingInput = (
    Text
    | Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS)]
    | TokenIds
    | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_INPUTS)]
)


class EmbeddingRequest(ModelRequest):
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


class Embedding(_Response):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32, with encoding_format "base64"


class EmbeddingUsage(_Response):
    prompt_tokens: int
    total_tokens: int


class CreateEmbeddingResponse(_Response):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
