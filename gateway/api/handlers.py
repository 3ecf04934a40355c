"""The OpenAI routes' handlers: parse and validate, then hand over to the dispatcher."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from gateway.api.dispatch import dispatch
from gateway.api.requests import json_response, key_models, parse, state_of
from gateway.protocol.openai import ChatCompletionRequest, CompletionRequest, ModelList
from gateway.serving.chat import CHAT
from gateway.serving.completions import COMPLETIONS


async def chat_completions(request: Request) -> Response:
    body = await parse(request, ChatCompletionRequest)
    return await dispatch(request, state_of(request), body, CHAT)


async def text_completions(request: Request) -> Response:
    body = await parse(request, CompletionRequest)
    return await dispatch(request, state_of(request), body, COMPLETIONS)


async def list_models(request: Request) -> Response:
    """The models the key may use (the keys file's `models`; every model for other keys)."""
    listing = state_of(request).models.listing()
    allows = key_models(request)
    if allows is not None:
        listing = ModelList(data=[card for card in listing.data if allows(card.id, card.root or card.id)])
    return json_response(listing)
