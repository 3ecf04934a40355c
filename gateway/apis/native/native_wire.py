"""The native API's wire models."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from gateway.protocol.openai import INT64_MAX, ChatMessage, Sampling, TokenId, Usage, _Request, _Response


class TokenizeRequest(_Request):
    """vLLM's /tokenize: either a completion prompt or chat messages."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send either prompt or messages")
        return self


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(_Response):
    prompt: str


class _Sampling(Sampling):
    """The sampling parameters the native routes take; `model` may be left out (the default model)."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None


class GenerateRequest(_Sampling):
    """The native API: a completion's prompt in, text out."""

    prompt: str | Annotated[list[TokenId], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = 16


class GenerateResponse(_Response):
    output: str
    finish_reason: str | None = None
    usage: Usage | None = None


class NativeChatRequest(_Sampling):
    """The native chat API: messages in, text out (`{"output"}`, or SSE with `stream`)."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    stream: bool = False
