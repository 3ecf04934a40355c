"""OpenAI's embeddings API as pydantic models, after the openai SDK's types."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field, field_validator

from gateway.protocol.openai import ModelRequest

MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one request

EmbeddingInput = str | list[str] | list[int] | list[list[int]]


class EmbeddingRequest(ModelRequest):
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    prompts_param: ClassVar[str] = "input"

    @field_validator("input")
    @classmethod
    def _not_empty(cls, value: EmbeddingInput) -> EmbeddingInput:
        """No empty input, list or item (OpenAI's rules); at most MAX_INPUTS items."""
        if not value or any(not item for item in value if not isinstance(item, int)):
            raise ValueError("the input must not be empty, nor hold an empty string or list")
        if not isinstance(value, str) and len(value) > MAX_INPUTS:
            raise ValueError(f"at most {MAX_INPUTS} inputs in one request")
        return value
