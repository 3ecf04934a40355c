"""Server-Sent Events as an HTTP response: `EventStreamResponse` streams the pipeline's events, framed by
`protocol.sse_wire` in the route's dialect (or the framing the handler sets), and, when streams are resumable, keeps
them in the stream's log (`stores.streams`: every API's, written here only): each stream has an id (`x-stream-id`;
a Responses stream's is its response id), each event an SSE `id:` (its number: a Responses event's
`sequence_number`), and `resumed` plays a stream again from any replica."""

from __future__ import annotations

import asyncio
import functools
import re
import secrets
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

import structlog
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from gateway.errors import ClientDisconnected, InvalidRequest, NotFound, RateLimited, ServiceUnavailable
from gateway.pipeline.answer import Events, Primed
from gateway.pipeline.context import context_of
from gateway.pipeline.disconnect import Watch
from gateway.protocol.batch_objects import Owner
from gateway.protocol.sse_wire import DONE, FRAMINGS, Framing, encode, error_frame
from gateway.stores.streams import OwnedStreams, StreamStore, Takeover, Writer
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


@dataclass(frozen=True, slots=True)
class Resumable:
    """Where a stream's events are kept, what a takeover needs, and how long it outlives its client."""

    streams: OwnedStreams
    takeover: Takeover
    grace_s: float


def resumable_of(scope: Scope) -> Resumable | None:
    """The request's stream log when streams are resumable (None: off, or no gateway state: a unit test's)."""
    gateway = (scope.get("state") or {}).get("gateway")
    if gateway is None or not gateway.settings.streams.resumable:
        return None
    context = context_of(scope)
    takeover = Takeover(Owner(key_id=context.key_id, tenant=context.tenant), scope["path"], context.request_body)
    return Resumable(gateway.streams.of(context.tenant), takeover, gateway.settings.streams.grace_s)


class EventStreamResponse(StreamingResponse):
    """An ASGI response streaming models as SSE (Starlette's StreamingResponse, its own `__call__`).

    It watches for the client going away (`pipeline.disconnect.Watch`): on a disconnect the stream's task is cancelled,
    which closes the event iterator and so aborts the engine request; a resumable stream is cancelled only after its
    grace, generating into its log meanwhile, unless its model's capacity is wanted (`on_left`: others wait for it)
    or its `deadline` passes first. A client that stops reading is taken for gone after `stream_write_timeout_s`
    (`api.stalls`). `resumable`: set by a handler whose stream plays to nobody (a background response), else the
    request's."""

    def __init__(
        self, events: Events, on_close: Callable[[], None] | None = None, framing: Framing | None = None,
        stream_id: str | None = None, on_left: Callable[[Callable[[], None]], None] | None = None,
        deadline: float | None = None,
    ) -> None:
        self.events = events
        self.framing = framing  # None: the route's dialect decides (in __call__)
        self.on_close = on_close  # e.g. the admission permit's release, held for the whole stream
        self.stream_id = stream_id or "strm_" + secrets.token_hex(16)
        super().__init__((), headers=HEADERS)  # its events are self.events, sent by __call__
        self.disconnected = False
        self.resumable: Resumable | None = None
        self.on_left = on_left
        self.deadline = deadline

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        framing = self.framing or FRAMINGS[dialect_of(scope)]
        resumable = self.resumable or resumable_of(scope)
        log = None
        if resumable is not None:
            log = resumable.streams.writer(self.stream_id, resumable.takeover)
            self.raw_headers.append((b"x-stream-id", self.stream_id.encode()))
        # Plain asyncio, not an anyio cancel scope: cancelling the task once lets the engine's
        # cleanup (its abort) still await; a level-triggered scope would cancel that too.
        watch = Watch(gone_of(receive), grace_s=resumable.grace_s if resumable is not None else 0.0,
                      grace_until=self.deadline, on_left=self.on_left)
        sends, sweep = _stall_watch(scope, watch.expire)
        ending: bytes | None = None  # stopped otherwise (a shutdown's cancel): no end, as when a replica dies
        try:
            async with watch:
                ending = await self._stream(_Sink(send, watch, log), framing, sends)
        except (ClientDisconnected, OSError):  # OSError: the socket went away under send
            self.disconnected = True
            ending = error_frame(from_exception(ClientDisconnected(ABANDONED)).body(framing.dialect), framing)
            ending += framing.end if framing.named else DONE
        except Exception:  # the response has started: nothing left to tell the client
            pass
        finally:
            if sweep is not None:
                sweep.discard(sends)
            if log is not None:
                log.close(ending)
            current_record().disconnected = self.disconnected or watch.left
            await self._close()  # also when the stream was cancelled before it ever ran

    async def _close(self) -> None:
        on_close, self.on_close = self.on_close, None
        try:
            await self.events.aclose()
        finally:
            if on_close is not None:
                on_close()

    async def _stream(self, sink: _Sink, framing: Framing, sends: stalls.Sends) -> bytes:
        """The events, then the ending; the ending it sent (the log's end marker)."""
        time = asyncio.get_running_loop().time
        try:
            await sink.start(self.raw_headers)
            ending = framing.end
            try:
                first, events = self.events.split() if isinstance(self.events, Primed) else (None, self.events)
                if first is not None:
                    await sink.event(encode(first, framing.named))
                async for event in events:
                    sends.since = time()  # a send that waits (the client reads nothing) is seen by the sweep
                    await sink.event(encode(event, framing.named))
                    sends.since = 0.0
            except OSError:
                raise  # the client is gone: nobody to tell
            except Exception as exc:
                log.warning("stream_failed", error=str(exc), error_type=type(exc).__name__)
                if (trace := current_trace()) is not None:
                    trace.failed(type(exc).__qualname__, exc)
                sends.since = time()
                await sink.event(error_frame(from_exception(exc).body(framing.dialect), framing))
                ending = framing.end if framing.named else DONE
            sends.since = time()  # the last send may wait too, and the permit is held until it is done
            await sink.send(ending, more=False)
            sends.since = 0.0
            return ending
        finally:
            await self._close()


ABANDONED = ("The stream was stopped: its client left and no reader came back within streams.grace_s (less when its "
             "model's capacity was wanted by a waiting request or the request's deadline passed)")


class _Sink:
    """Where a stream's bytes go: each event into the log (numbered: its SSE id), then to the client while it is
    there. A resumable stream's client that goes (a send fails) starts the watch's grace; without a log it ends the
    stream as before."""

    __slots__ = ("_log", "_send", "_watch")

    def __init__(self, send: Send, watch: Watch, log: Writer | None) -> None:
        self._send, self._watch, self._log = send, watch, log

    async def start(self, headers: list[tuple[bytes, bytes]]) -> None:
        await self._send({"type": "http.response.start", "status": 200, "headers": headers})

    async def event(self, frame: bytes) -> None:
        if self._log is not None:
            number = self._log.next
            frame = b"id: %d\n" % number + frame
            self._log.append(frame)
            await self._log.logged(number)  # in a shared log before the client has it (`Writer.logged`)
        await self.send(frame)

    async def send(self, body: bytes, more: bool = True) -> None:
        if self._watch.left:
            return  # nobody reads: the log does
        try:
            await self._send({"type": "http.response.body", "body": body, "more_body": more})
        except OSError:
            if self._log is None:
                raise
            self._watch.expire()


def _stall_watch(scope: Scope, expire: Callable[[], None]) -> tuple[stalls.Sends, stalls.Sweep | None]:
    """This stream's sends, watched for a client that stops reading when the stream is served to
    one (the gateway's state in the scope: not a background response, played to nobody). A stall
    drops the connection (the server's extension), or else calls `expire` (the disconnect watch's)."""
    gateway = (scope.get("state") or {}).get("gateway")
    abort = (scope.get("extensions") or {}).get(stalls.ABORT) or expire
    if gateway is None:
        return stalls.Sends(abort), None
    return stalls.watch(gateway.settings.stream_write_timeout_s, abort)


NUMBER = re.compile(r"[0-9]{1,18}")  # ASCII digits only: int() would take other scripts' digits and whitespace
DIED = "The stream's producer stopped before the stream's end (its replica is gone); the events it produced were sent"


def after_of(value: str | None, param: str) -> int:
    """The number of the last event a client has (`Last-Event-ID`, `starting_after`); absent: -1, from the start."""
    if value is None:
        return -1
    if not NUMBER.fullmatch(value):
        raise InvalidRequest(f"{param} must be the number of an event of this stream (an SSE id we sent)", param)
    return int(value)


async def resumed(
    scope: Scope, stream_id: str, after: int, path: str, missing: Callable[[str], NotFound], param: str,
    framing: Framing | None = None,
) -> StreamingResponse:
    """Stream `stream_id` (of the API at `path`, the asking key's) again after event `after`, from any replica:
    what the log keeps, then the rest live. Unknown, another key's or another API's: `missing`, before the first
    byte, as with resumable streams off."""
    gateway = (scope.get("state") or {}).get("gateway")
    if gateway is None or not gateway.settings.streams.resumable:
        raise missing(stream_id)
    framing = framing or FRAMINGS[dialect_of(scope)]
    end = framing.end if framing.named else DONE
    died = error_frame(from_exception(ServiceUnavailable(DIED)).body(framing.dialect), framing) + end
    context, store = context_of(scope), gateway.streams
    if store.readers[context.key_id] >= gateway.settings.streams.max_readers:
        raise RateLimited("Too many resumed streams read at once by this key (streams.max_readers); retry when one "
                          "ends")
    store.readers[context.key_id] += 1  # until the response is done, or refused
    try:
        events = await store.of(context.tenant).replay(stream_id, after, path, missing, died, param)
        headers = {**HEADERS, "x-stream-id": stream_id}
        return _Reading(_ended(events, framing, end), headers=headers, done=functools.partial(_read, store, context.key_id))
    except BaseException:
        _read(store, context.key_id)
        raise


class _Reading(StreamingResponse):
    """A resumed stream: `done` once it is over (also when it never started: the client left before). A reader that
    stops reading is dropped after `stream_write_timeout_s`, as a stream's first client is: it would hold its place
    among the key's `max_readers` and the events it was sent for ever."""

    def __init__(self, content: AsyncGenerator[bytes, None], headers: dict[str, str], done: Callable[[], None]) -> None:
        super().__init__(content, headers=headers)
        self.done = done

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task, time = asyncio.current_task(), asyncio.get_running_loop().time

        def cancel() -> None:  # without the server's extension: the response stops here
            if task is not None:
                task.cancel()

        sends, sweep = _stall_watch(scope, cancel)

        async def timed(message: Message) -> None:
            sends.since = time()
            try:
                await send(message)
            finally:
                sends.since = 0.0

        try:
            await super().__call__(scope, receive, timed)
        except asyncio.CancelledError:
            if not sends.stalled or task is None or task.uncancel():
                raise  # not (only) the stall's: a shutdown's
        finally:
            if sweep is not None:
                sweep.discard(sends)
            self.done()


def _read(store: StreamStore, key_id: str) -> None:
    store.readers[key_id] -= 1
    if not store.readers[key_id]:
        del store.readers[key_id]


async def _ended(events: AsyncGenerator[bytes, None], framing: Framing, end: bytes) -> AsyncGenerator[bytes, None]:
    """A replay whose log fails midway ends with an error event in the API's shape, as a stream that fails does."""
    try:
        async for event in events:
            yield event
    except Exception as exc:
        log.warning("stream_replay_failed", error=str(exc), error_type=type(exc).__name__)
        yield error_frame(from_exception(exc).body(framing.dialect), framing) + end
    finally:
        await events.aclose()
