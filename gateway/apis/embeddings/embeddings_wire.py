"""The embeddings API's answer (its request is `protocol.embeddings`: the guards read it too)."""

from __future__ import annotations

from typing import Literal

from gateway.protocol.openai import _Response


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
