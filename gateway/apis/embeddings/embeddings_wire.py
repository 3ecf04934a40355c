"""The embeddings API's wire models."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


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

