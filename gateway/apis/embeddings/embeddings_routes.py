"""OpenAI's embeddings route: parse and validate, call the pipeline (`serving.embeddings`), encode."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from gateway.apis.embeddings.embeddings_serving import EMBEDDINGS
from gateway.pipeline.dispatch import dispatch
from gateway.protocol.embeddings import EmbeddingRequest
from gateway.web.answers import respond
from gateway.web.requests import context, parse, state_of


async def create(request: Request) -> Response:
    body = await parse(request, EmbeddingRequest)
    return respond(await dispatch(context(request), state_of(request), body, EMBEDDINGS))
