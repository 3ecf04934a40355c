"""The chat API's routes."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from gateway.apis.chat.chat_serving import CHAT
from gateway.pipeline.dispatch import dispatch
from gateway.protocol.openai import ChatCompletionRequest
from gateway.web.answers import respond
from gateway.web.requests import context, parse, state_of


async def chat_completions(request: Request) -> Response:
    body = await parse(request, ChatCompletionRequest)
    return respond(await dispatch(context(request), state_of(request), body, CHAT))

