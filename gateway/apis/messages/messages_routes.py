"""Anthropic's Messages routes: parse and validate, then the chat pipeline (`serving.messages`).
Their errors and streams speak Anthropic's dialect (the route table says so)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from gateway.apis.messages import messages_serving
from gateway.apis.messages.messages_serving import MESSAGES
from gateway.apis.messages.messages_wire import CountTokensRequest, MessagesRequest
from gateway.pipeline.dispatch import dispatch
from gateway.serving import offload
from gateway.web.answers import json_response, respond
from gateway.web.requests import body_size, context, engine_for, parse, state_of


async def create(request: Request) -> Response:
    body = await parse(request, MessagesRequest)
    return respond(await dispatch(context(request), state_of(request), messages_serving.to_chat(body), MESSAGES))


async def count_tokens(request: Request) -> Response:
    body = await parse(request, CountTokensRequest)
    engine = engine_for(request, body.model)
    answer = await offload.by_size(body_size(request), messages_serving.count_tokens, body, engine)
    return json_response(answer)
