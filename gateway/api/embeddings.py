"""OpenAI's embeddings route: parse and validate, then the dispatcher (`serving.embeddings`)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from gateway.api.dispatch import dispatch
from gateway.api.requests import parse, state_of
from gateway.protocol.embeddings import EmbeddingRequest
from gateway.serving.embeddings import EMBEDDINGS


async def create(request: Request) -> Response:
    body = await parse(request, EmbeddingRequest)
    return await dispatch(request, state_of(request), body, EMBEDDINGS)
