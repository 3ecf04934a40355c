"""The completions API's routes."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from gateway.apis.completions.completions_serving import COMPLETIONS
from gateway.pipeline.dispatch import dispatch
from gateway.protocol.openai import CompletionRequest
from gateway.web.answers import respond
from gateway.web.requests import context, parse, state_of


async def text_completions(request: Request) -> Response:
    body = await parse(request, CompletionRequest)
    return respond(await dispatch(context(request), state_of(request), body, COMPLETIONS))

