"""The HTTP server: uvicorn with SIGTERM as a graceful drain, SIGHUP as a reload, and slow clients bounded. Its
reaches into uvicorn are listed in docs/development.md ("Seams") and checked by tests/unit/test_seams.py."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
import time
from collections.abc import Callable, Generator, Sequence
from types import FrameType
from typing import Any, cast

import structlog
import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from gateway.apis.routes import TABLE
from gateway.errors import InvalidRequest
from gateway.pipeline.lifecycle import Lifecycle
from gateway.settings import Reloadable, Settings
from gateway.web.error_render import render
from gateway.web.stalls import ABORT

log = structlog.get_logger(__name__)
MAX_HEADER_BYTES = 64 * 1024
LATE_TIMER_S = 0.5  # a timer that fires later than this past its time was held up by a busy loop


class HeaderTimeout(asyncio.Protocol):
    """Mixed in before uvicorn's HTTP protocol, which waits for headers for ever: closes a connection whose request
    headers take longer than `header_timeout_s`, or more than `MAX_HEADER_BYTES`. A request's headers are done when
    uvicorn starts its request cycle (`self.cycle` changes)."""

    header_timeout_s = 10.0
    idle_timeout_s = 5.0  # a new connection that sends nothing (uvicorn's keep-alive timer: between requests)
    _timer: asyncio.TimerHandle | None = None
    _idle = False  # the timer running is the idle one: no byte yet
    _header_bytes = 0
    _connection: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._connection = cast(asyncio.Transport, transport)  # a stream's: uvicorn serves TCP and unix sockets
        super().connection_made(transport)
        self._arm(self.idle_timeout_s)  # a connection that never sends a byte is closed as an idle one
        self._idle = True

    def data_received(self, data: bytes) -> None:
        if self._idle:  # the first bytes: from now on the headers' own timeout
            self._idle = False
            self._disarm()
        before = getattr(self, "cycle", None)
        held = len(before.body) if before is not None else 0
        super().data_received(data)
        if (cycle := getattr(self, "cycle", None)) is not before:  # the headers are complete: a request started
            self._disarm()
            self._header_bytes = 0
            if cycle is not None:  # for a stream whose client stops reading (api.stalls)
                cycle.scope.setdefault("extensions", {})[ABORT] = self._drop
                if getattr(cycle, "waiting_for_100_continue", False):
                    _close_if_answered_unread(cycle)
                if cycle.scope.get("http_version") == "1.0":
                    _close_delimited(cycle)
            return  # (the usual case: whole headers in one read, so no timer is made per request)
        if before is None or before.response_complete:  # between requests: these bytes began headers
            self._arm(self.header_timeout_s)
        elif len(before.body) > held:  # the body of the request in progress: uvicorn bounds what it holds
            self._header_bytes = 0
            return
        # else bytes that added nothing to the body of the request in progress: chunk framing, a chunked body's
        # trailers, or the next request's headers sent while this one is answered (pipelined); headers, which uvicorn
        # would hold all of: bounded, not timed (a stream in progress is not cut for slow pipelined headers)
        self._header_bytes += len(data)
        if self._header_bytes > MAX_HEADER_BYTES:
            self._expire()

    def on_headers_complete(self) -> None:
        """(httptools) The request's headers as they are now: httptools' protocol appends a chunked
        body's trailers to the same list, which the app must not read as headers."""
        getattr(super(), "on_headers_complete")()  # noqa: B009 - asyncio.Protocol declares no such hook
        if (cycle := getattr(self, "cycle", None)) is not None:
            cycle.scope["headers"] = list(cycle.scope["headers"])

    def _drop(self) -> None:
        """Unsent bytes and all: for a client that stopped reading."""
        if self._connection is not None and not self._connection.is_closing():
            self._connection.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """The API's 400 in its route's error shape, not uvicorn's plain text, then the connection closed. When an
        answer is under way, or due to a pipelined request before the bad one, that answer ends first and the
        connection closes without the 400: written now, it would land inside that answer or be taken for it."""
        cycle = getattr(self, "cycle", None)
        if cycle is not None and not cycle.response_complete and (cycle.response_started or not cycle.more_body):
            cycle.keep_alive = False
            return
        path = bytes(getattr(self, "url", b"")).partition(b"?")[0].decode("latin-1")  # httptools': parsed so far
        _, headers, body = render(InvalidRequest(msg), TABLE.dialect(path))
        state = getattr(self, "server_state", None)
        headers = [*(state.default_headers if state else ()), *headers,
                   (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
        head = b"".join(name + b": " + value + b"\r\n" for name, value in headers)
        if self._connection is not None and not self._connection.is_closing():
            self._connection.write(b"HTTP/1.1 400 Bad Request\r\n" + head + b"\r\n" + body)
            self._connection.close()

    def _arm(self, timeout_s: float) -> None:
        if self._timer is None:
            self._header_bytes = 0
            self._timer = asyncio.get_running_loop().call_later(timeout_s, self._expire)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None and asyncio.get_running_loop().time() - timer.when() > LATE_TIMER_S:
            # the loop was late (a flood's arrivals), not the client: the loop runs due timers before it polls
            # the sockets, so this connection's bytes may be waiting unread; one more poll before it is judged
            self._timer = asyncio.get_running_loop().call_later(LATE_TIMER_S, self._expire)
            return
        if self._connection is not None and not self._connection.is_closing():
            self._connection.close()


def _close_if_answered_unread(cycle: Any) -> None:
    """A request sent with `Expect: 100-continue` and answered before its body was asked for: the connection closes
    after the answer, since the client may never send that body and its next request would be read as one."""
    send = cycle.send

    async def closing_send(message: Any) -> None:
        if message["type"] == "http.response.start" and cycle.waiting_for_100_continue:
            cycle.keep_alive = False  # uvicorn then says `connection: close` and closes after the answer
        await send(message)

    cycle.send = closing_send


def _close_delimited(cycle: Any) -> None:
    """An answer to an HTTP/1.0 client without a Content-Length is delimited by the connection's close: HTTP/1.0 has
    no chunked encoding, which uvicorn's httptools protocol would use (h11 does this by itself)."""
    if not hasattr(cycle, "chunked_encoding"):
        return
    send, delimited = cycle.send, False

    async def delimited_send(message: Any) -> None:
        nonlocal delimited
        if message["type"] == "http.response.start":
            framing = {name.lower() for name, _ in message.get("headers", ())} & {b"content-length", b"transfer-encoding"}
            if not framing:
                delimited = True
                cycle.chunked_encoding, cycle.keep_alive = False, False  # the close ends the body
        elif message["type"] == "http.response.body" and delimited:
            cycle.expected_content_length += len(message.get("body", b""))  # uvicorn counts down what it was told
        await send(message)

    cycle.send = delimited_send


def http_protocol(header_timeout_s: float, idle_timeout_s: float = 5.0) -> type[asyncio.Protocol]:
    attributes = {"header_timeout_s": header_timeout_s, "idle_timeout_s": idle_timeout_s}
    return type("GatewayHTTPProtocol", (HeaderTimeout, AutoHTTPProtocol), attributes)


def server_config(app: Any, settings: Settings, tls_options: dict[str, Any] | None = None) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        http=http_protocol(settings.header_timeout_s, settings.keep_alive_timeout_s),
        timeout_keep_alive=settings.keep_alive_timeout_s,
        limit_concurrency=settings.max_connections,
        proxy_headers=False,  # the client address is decided once, by tenancy.keys.TrustedProxies
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=5,  # the drain already waited for requests in progress
        **(tls_options or {}),
    )


class DrainingServer(uvicorn.Server):
    """On SIGTERM readiness and new requests turn 503 while requests in progress finish, for up to
    `drain_timeout_s`; only then does uvicorn shut down. A second signal exits at once."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle, drain_timeout_s: float,
                 reloadables: Sequence[Reloadable] = (), announce: Callable[[], None] | None = None) -> None:
        """`announce`: a worker's, called once serving in place of the `listening` line (the parent logs that)."""
        super().__init__(config)
        self.announce = announce
        self.lifecycle = lifecycle
        self.drain_timeout_s = drain_timeout_s
        self.reloadables = tuple(reloadables)
        self._drain_requested = False
        self._reload_requested = False
        self._deadline = 0.0

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        with super().capture_signals():
            if not self.reloadables or threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = signal.signal(signal.SIGHUP, self.handle_hangup)
            try:
                yield
            finally:
                signal.signal(signal.SIGHUP, previous)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and self.announce is not None:
            self.announce()
        elif self.started:
            scheme = "https" if self.config.ssl else "http"
            for host, port in self.addresses():
                log.info("listening", host=host, port=port, scheme=scheme)

    def addresses(self) -> list[tuple[str, int]]:
        """With `port` 0, the port the system gave each TCP socket."""
        bound = []
        for server in getattr(self, "servers", ()):
            for sock in server.sockets:
                name = sock.getsockname()
                if isinstance(name, tuple):  # (a unix socket's name is its path)
                    bound.append((str(name[0]), int(name[1])))
        return bound

    def handle_hangup(self, sig: int, frame: FrameType | None) -> None:
        self._reload_requested = True  # acted on in on_tick, outside the signal handler

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and not self._drain_requested and not self.should_exit:
            self._drain_requested = True  # acted on in on_tick, outside the signal handler
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self._reload_requested:
            self._reload_requested = False
            for reloadable in self.reloadables:
                reloadable.reload("SIGHUP")
        for reloadable in self.reloadables:
            reloadable.poll()
        if self._drain_requested and not self.lifecycle.draining:
            self.lifecycle.start_drain()
            self._deadline = time.monotonic() + self.drain_timeout_s
            log.info("draining", in_flight=self.lifecycle.active, timeout_s=self.drain_timeout_s)
        drained = self.lifecycle.active == 0 or time.monotonic() >= self._deadline
        if self.lifecycle.draining and not self.should_exit and drained:
            log.info("drained", left_in_flight=self.lifecycle.active)
            if self._drain_requested:  # uvicorn's own exit on the signal (raised again once it stopped)
                super().handle_exit(signal.SIGTERM, None)
            else:
                self.should_exit = True
        return await super().on_tick(counter)
