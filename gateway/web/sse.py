"""Server-Sent Events as an HTTP response: `EventStreamResponse` streams the pipeline's events, framed by
`protocol.sse_wire` in the route's dialect (or the framing the handler sets)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.errors import ClientDisconnected
from gateway.pipeline.answer import Events, Primed
from gateway.pipeline.disconnect import Watch
from gateway.protocol.sse_wire import DONE, FRAMINGS, Framing, encode, error_frame
from gateway.telemetry.record import current_record, current_trace
from gateway.web import stalls
from gateway.web.error_render import dialect_of, from_exception
from gateway.web.requests import gone_of

HEADERS = {
    "content-type": "text/event-stream; charset=utf-8",
    "cache-control": "no-cache",
    "x-accel-buffering": "no",  # proxies such as nginx must not buffer the stream
}

log = structlog.get_logger(__name__)


class EventStreamResponse(StreamingResponse):
    """An ASGI response streaming models as SSE (Starlette's StreamingResponse, its own `__call__`).

    It watches for the client going away (`pipeline.disconnect.Watch`): on a disconnect the stream's task is cancelled,
    which closes the event iterator and so aborts the engine request. A client that stops reading is taken for gone
    after `stream_write_timeout_s` (`api.stalls`)."""

    def __init__(self, events: Events, on_close: Callable[[], None] | None = None, framing: Framing | None = None) -> None:
        self.events = events
        self.framing = framing  # None: the route's dialect decides (in __call__)
        self.on_close = on_close  # e.g. the admission permit's release, held for the whole stream
        super().__init__((), headers=HEADERS)  # its events are self.events, sent by __call__
        self.disconnected = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        framing = self.framing or FRAMINGS[dialect_of(scope)]
        # Plain asyncio, not an anyio cancel scope: cancelling the task once lets the engine's
        # cleanup (its abort) still await; a level-triggered scope would cancel that too.
        watch = Watch(gone_of(receive))
        sends, sweep = _stall_watch(scope, watch)
        try:
            async with watch:
                await self._stream(send, framing, sends)
        except (ClientDisconnected, OSError):  # OSError: the socket went away under send
            self.disconnected = True
        except Exception:  # the response has started: nothing left to tell the client
            pass
        finally:
            if sweep is not None:
                sweep.discard(sends)
            current_record().disconnected = self.disconnected
            await self._close()  # also when the stream was cancelled before it ever ran

    async def _close(self) -> None:
        on_close, self.on_close = self.on_close, None
        try:
            await self.events.aclose()
        finally:
            if on_close is not None:
                on_close()

    async def _stream(self, send: Send, framing: Framing, sends: stalls.Sends) -> None:
        time = asyncio.get_running_loop().time
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            ending = framing.end
            try:
                first, events = self.events.split() if isinstance(self.events, Primed) else (None, self.events)
                if first is not None:
                    await send({"type": "http.response.body", "body": encode(first, framing.named), "more_body": True})
                async for event in events:
                    sends.since = time()  # a send that waits (the client reads nothing) is seen by the sweep
                    await send({"type": "http.response.body", "body": encode(event, framing.named), "more_body": True})
                    sends.since = 0.0
            except OSError:
                raise  # the client is gone: nobody to tell
            except Exception as exc:
                log.warning("stream_failed", error=str(exc), error_type=type(exc).__name__)
                if (trace := current_trace()) is not None:
                    trace.failed(type(exc).__qualname__, exc)
                body = error_frame(from_exception(exc).body(framing.dialect), framing)
                sends.since = time()
                await send({"type": "http.response.body", "body": body, "more_body": True})
                ending = framing.end if framing.named else DONE
            sends.since = time()  # the last send may wait too, and the permit is held until it is done
            await send({"type": "http.response.body", "body": ending, "more_body": False})
            sends.since = 0.0
        finally:
            await self._close()


def _stall_watch(scope: Scope, watch: Watch) -> tuple[stalls.Sends, stalls.Sweep | None]:
    """This stream's sends, watched for a client that stops reading when the stream is served to
    one (the gateway's state in the scope: not a background response, played to nobody). A stall
    drops the connection (the server's extension), or else expires the disconnect watch."""
    gateway = (scope.get("state") or {}).get("gateway")
    abort = (scope.get("extensions") or {}).get(stalls.ABORT) or watch.expire
    if gateway is None:
        return stalls.Sends(abort), None
    return stalls.watch(gateway.settings.stream_write_timeout_s, abort)
