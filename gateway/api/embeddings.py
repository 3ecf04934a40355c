"""OpenAI's embeddings route: parse and validate, call the pipeline (`serving.embeddings`), encode."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from gateway.api.answers import respond
from gateway.api.requests import context, parse, state_of
from gateway.pipeline.dispatch import dispatch
from gateway.protocol.embeddings import EmbeddingRequest
from gateway.serving.embeddings import EMBEDDINGS


async def create(request: Request) -> Response:
    body = await parse(request, EmbeddingRequest)
    return respond(await dispatch(context(request), state_of(request), body, EMBEDDINGS))
