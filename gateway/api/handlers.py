"""The OpenAI routes' handlers: parse and validate, then hand over to the dispatcher."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from gateway.api.dispatch import dispatch
from gateway.api.requests import json_response, parse, state_of
from gateway.protocol.openai import ChatCompletionRequest, CompletionRequest
from gateway.serving.chat import CHAT
from gateway.serving.completions import COMPLETIONS


async def chat_completions(request: Request) -> Response:
    body = await parse(request, ChatCompletionRequest)
    return await dispatch(request, state_of(request), body, CHAT)


async def text_completions(request: Request) -> Response:
    body = await parse(request, CompletionRequest)
    return await dispatch(request, state_of(request), body, COMPLETIONS)


async def list_models(request: Request) -> Response:
    return json_response(state_of(request).models.listing())
