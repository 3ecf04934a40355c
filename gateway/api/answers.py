"""The pipeline's answers as HTTP responses: a whole answer as JSON (a model written once, or JSON
already written, sent as Starlette's `Response` would send it), a stream as Server-Sent Events
(`api.sse`)."""

from __future__ import annotations

from pydantic import BaseModel
from starlette.responses import Response

from gateway.api.sse import EventStreamResponse
from gateway.pipeline.answer import Answer, Stream, json_bytes
from gateway.protocol.sse_wire import RELAYED, Framing


class JSONBytes(Response):
    """A 200 of JSON already written: what `Response(body, media_type="application/json")` makes
    (the same headers in the same order: content-length, content-type), without its rendering
    and header-building layers."""

    media_type = "application/json"

    def __init__(self, body: bytes) -> None:
        self.status_code = 200
        self.background = None
        self.body = body
        self.raw_headers = [(b"content-length", b"%d" % len(body)), (b"content-type", b"application/json")]


def json_response(model: BaseModel, status: int = 200) -> Response:
    return Response(json_bytes(model), status_code=status, media_type="application/json")


def respond(answer: Answer, framing: Framing | None = None) -> Response:
    """`framing`: how a stream's events are put on the wire (None: the route's dialect decides)."""
    if isinstance(answer, Stream):
        return stream_response(answer, framing)
    body = answer.body
    if isinstance(body, BaseModel):
        return json_response(body, answer.status)
    if answer.status == 200 and answer.media_type == "application/json":
        return JSONBytes(body)
    return Response(body, status_code=answer.status, media_type=answer.media_type)


def stream_response(stream: Stream, framing: Framing | None = None) -> EventStreamResponse:
    """A stream as SSE: a remote model's events relayed as they were framed (its own `[DONE]`)."""
    return EventStreamResponse(stream.events, on_close=stream.on_close, framing=RELAYED if stream.relayed else framing)
