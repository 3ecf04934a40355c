"""The pipeline's answers as HTTP responses: a whole answer as JSON (a model written once, or JSON
already written), a stream as Server-Sent Events (`web.sse`)."""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from gateway.pipeline.answer import Answer, Stream, json_bytes
from gateway.pipeline.dispatch import dispatch
from gateway.protocol.openai import ModelRequest
from gateway.protocol.sse_wire import Framing
from gateway.serving.service import Service
from gateway.stores.streams import not_found
from gateway.web.requests import context, parse, state_of
from gateway.web.sse import EventStreamResponse, after_of, resumed
from gateway.web.table import Handler

RequestT = TypeVar("RequestT", bound=ModelRequest)


def json_response(model: BaseModel, status: int = 200) -> Response:
    return Response(json_bytes(model), status_code=status, media_type="application/json")


def respond(answer: Answer, framing: Framing | None = None) -> Response:
    """`framing`: how a stream's events are put on the wire (None: the route's dialect decides)."""
    if isinstance(answer, Stream):
        return stream_response(answer, framing)
    body = answer.body
    if isinstance(body, BaseModel):
        return json_response(body, answer.status)
    return Response(body, status_code=answer.status, media_type=answer.media_type)


def stream_response(stream: Stream, framing: Framing | None = None, stream_id: str | None = None) -> EventStreamResponse:
    return EventStreamResponse(stream.events, on_close=stream.on_close, framing=framing, stream_id=stream_id,
                               on_left=stream.on_left, deadline=stream.deadline)


def served(model: type[RequestT], service: Service[RequestT, Any, Any]) -> Handler:
    """The handler of a route that is only parse, the pipeline, answer: the body as `model`, answered by `service`."""

    async def handler(request: Request) -> Response:
        body = await parse(request, model)
        return respond(await dispatch(context(request), state_of(request), body, service))

    return handler


def resuming(path: str) -> Handler:
    """The handler of `GET <path>/streams/{stream_id}`: a stream of the API at `path` again, after the event the
    `Last-Event-ID` header names (absent: from the start), from any replica (`web.sse.resumed`)."""

    async def handler(request: Request) -> Response:
        after = after_of(request.headers.get("last-event-id"), "Last-Event-ID")
        return await resumed(request.scope, request.path_params["stream_id"], after, path, not_found, "Last-Event-ID")

    return handler
