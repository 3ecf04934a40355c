"""Server-Sent Events: the one place that frames stream events, as OpenAI does.

Each event is `data: <json>\n\n`; the stream ends with `data: [DONE]\n\n`. An error after the
stream has started is one event `data: {"error": {...}}` followed by `[DONE]`. A remote model's
stream is relayed event by event in its own framing (`RelayedEventStream`), and ends the same way
when its upstream fails in the middle.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping

import orjson
import structlog
from pydantic import BaseModel
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.api.disconnect import wait_for_disconnect
from gateway.context import current_record
from gateway.errors import from_exception

DONE = b"data: [DONE]\n\n"
HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # proxies such as nginx must not buffer the stream
]

log = structlog.get_logger(__name__)


def encode(event: BaseModel | bytes) -> bytes:
    """One event; bytes are JSON the producer encoded itself (the per-token chunks, ChunkEncoder)."""
    if isinstance(event, bytes):
        return b"data: " + event + b"\n\n"
    return b"data: " + event.__pydantic_serializer__.to_json(event, exclude_none=True) + b"\n\n"


def encode_error(exc: BaseException) -> bytes:
    return b"data: " + orjson.dumps(from_exception(exc).body()) + b"\n\n"


class EventStreamResponse(Response):
    """An ASGI response streaming models as SSE (a Response as Starlette's StreamingResponse is:
    its own `__call__`, no body).

    It watches for the client going away the whole time: on a disconnect the stream's task is
    cancelled at once, which closes the event iterator and so aborts the engine request.
    """

    ending = DONE  # after the last event

    def __init__(
        self,
        events: AsyncIterator[BaseModel | bytes],
        headers: Mapping[str, str] | None = None,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self.events = events
        self.on_close = on_close  # e.g. the admission permit's release, held for the whole stream
        self.status_code = 200
        self.background = None
        self.raw_headers = HEADERS + [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
        self.disconnected = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Plain asyncio, not an anyio cancel scope: cancelling the stream's task once lets the
        # engine's cleanup (its abort) still await; a level-triggered scope would cancel that too.
        stream = asyncio.ensure_future(self._stream(send))
        watcher = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            done, _ = await asyncio.wait({stream, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if stream not in done:
                self.disconnected = True
                stream.cancel()
            await asyncio.gather(stream, return_exceptions=True)
            if not stream.cancelled() and isinstance(stream.exception(), OSError):
                self.disconnected = True  # the socket went away under send
            current_record().disconnected = self.disconnected
        finally:
            watcher.cancel()
            stream.cancel()
            await self._close()  # also when the stream was cancelled before it ever ran

    async def _close(self) -> None:
        on_close, self.on_close = self.on_close, None
        try:
            await self.events.aclose()  # type: ignore[attr-defined]
        finally:
            if on_close is not None:
                on_close()

    def frame(self, event: BaseModel | bytes) -> bytes:
        return encode(event)

    async def _stream(self, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            ending = self.ending
            try:
                async for event in self.events:
                    await send({"type": "http.response.body", "body": self.frame(event), "more_body": True})
            except OSError:
                raise  # the client is gone: nobody to tell
            except Exception as exc:
                log.warning("stream_failed", error=str(exc), error_type=type(exc).__name__)
                await send({"type": "http.response.body", "body": encode_error(exc), "more_body": True})
                ending = DONE
            await send({"type": "http.response.body", "body": ending, "more_body": False})
        finally:
            await self._close()


class RelayedEventStream(EventStreamResponse):
    """A remote model's SSE events (bytes, one event's lines each) passed on as they were framed,
    its own `[DONE]` included; a failure of the upstream mid-way still ends with one error event
    and `[DONE]`."""

    ending = b""

    def frame(self, event: BaseModel | bytes) -> bytes:
        assert isinstance(event, bytes)
        return event + b"\n\n"


class Primed:
    """A stream whose first event was already taken; closing it closes the stream underneath."""

    def __init__(self, first: BaseModel | bytes | None, rest: AsyncIterator[BaseModel | bytes]) -> None:
        self._first = first
        self._rest = rest
        self._done = first is None

    def __aiter__(self) -> Primed:
        return self

    async def __anext__(self) -> BaseModel | bytes:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        if self._done:
            raise StopAsyncIteration
        return await anext(self._rest)

    async def aclose(self) -> None:
        self._done = True
        await self._rest.aclose()  # type: ignore[attr-defined]


async def primed(events: AsyncIterator[BaseModel | bytes]) -> Primed:
    """Run a stream up to its first event, so that refusals raise before the response starts."""
    try:
        first = await anext(events)
    except StopAsyncIteration:
        first = None
    return Primed(first, events)
