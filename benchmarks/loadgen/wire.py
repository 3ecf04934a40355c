"""The load generator's HTTP/1.1 client (benchmarks/README.md says why not aiohttp): each request one
pre-built write on a keep-alive connection (one per request in flight, dropped after `idle_s` idle),
the answer parsed by httptools. `async with session.post(url, data) as response` gives the
connection itself as the response (`status`, `headers`, `read()`, `iter_chunks()`,
`raise_for_status()`); its errors are those `loadgen.client.CLIENT_ERRORS` counts."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import time
from collections.abc import AsyncIterator, Mapping
from urllib.parse import urlsplit

import httptools

Origin = tuple[str, int, bool]  # host, port, TLS
SWEEP_EVERY_S = 1.0
_OWN_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection"})


class WireStatusError(ValueError):
    """A non-2xx answer, from `raise_for_status`."""

    def __init__(self, status: int, url: str) -> None:
        super().__init__(f"HTTP {status} from {url}")
        self.status = status


class WireResponse(asyncio.Protocol):
    """One keep-alive connection and the answer to the one request on it at a time, filled by
    httptools' callbacks; the reader is woken once per read from the socket."""

    def __init__(self, origin: Origin) -> None:
        self.origin = origin
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.closed, self.keep_alive, self.idle_since = False, True, 0.0
        self.busy = False
        self.reset("", 0.0)

    def reset(self, url: str, deadline: float) -> None:
        self.url, self.deadline = url, deadline
        self.status = 0
        self.headers: dict[str, str] = {}  # names in lower case
        self.complete = False
        self.error: BaseException | None = None
        self.chunks: list[bytes] = []  # of the body, not yet read
        self._waiter: asyncio.Future[None] | None = None

    # the socket's side
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if (sock := transport.get_extra_info("socket")) is not None:
            with contextlib.suppress(OSError):  # not TCP
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.busy:
            self.fail(ConnectionResetError("the server closed the connection before its answer ended"))

    def data_received(self, data: bytes) -> None:
        if not self.busy:  # nothing was asked: a server that talks out of turn
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.fail(ValueError(f"malformed HTTP answer: {exc}"))
            self.close()
        self.wake()  # one wake for all the events this read brought

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)  # a chunk of a chunked body each: one per event of a stream

    def on_message_complete(self) -> None:
        self.keep_alive, self.complete = self.parser.should_keep_alive(), True

    def fail(self, error: BaseException) -> None:
        if not self.complete and self.error is None:
            self.error = error
            self.wake()

    def wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def send(self, data: bytes) -> None:
        assert self.transport is not None
        if self.closed or self.transport.is_closing():
            self.fail(ConnectionResetError("the connection closed before the request went out"))
        else:
            self.transport.write(data)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    # the reader's side
    async def _wait(self) -> None:
        if self.error is None:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter  # the session's sweep fails it past its deadline
            finally:
                self._waiter = None
        if self.error is not None:
            raise self.error

    async def wait_headers(self) -> None:
        while not self.status:
            await self._wait()

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives: what came since the last step."""
        while True:
            while not self.chunks and not self.complete:
                await self._wait()
            if not self.chunks:
                return
            chunks, self.chunks = self.chunks, []
            yield chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def read(self) -> bytes:
        while not self.complete:
            await self._wait()
        chunks, self.chunks = self.chunks, []
        return b"".join(chunks)

    def raise_for_status(self) -> None:
        if not 200 <= self.status < 300:
            raise WireStatusError(self.status, self.url)


class _Exchange:
    """`async with session.post(...) as response`: the request goes out on enter; on exit the
    connection goes back to the pool when its answer was read to the end, else it is closed."""

    def __init__(self, session: WireSession, method: str, url: str, data: bytes | None) -> None:
        self.session, self.method, self.url, self.data = session, method, url, data
        self.response: WireResponse | None = None

    async def __aenter__(self) -> WireResponse:
        response = self.response = await self.session._send(self.method, self.url, self.data)
        try:
            await response.wait_headers()
        except BaseException:  # no __aexit__ after a failed __aenter__: the connection is let go here
            self.session._release(response)
            raise
        return response

    async def __aexit__(self, *exc_info: object) -> None:
        if self.response is not None:
            self.session._release(self.response)


class WireSession:
    """Keep-alive connections per origin, requests with the session's headers."""

    def __init__(self, headers: Mapping[str, str] | None = None, total_timeout_s: float = 600.0, idle_s: float = 3.0) -> None:
        self.fixed = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items() if k.lower() not in _OWN_HEADERS)
        self.total_timeout_s, self.idle_s = total_timeout_s, idle_s
        self.closed = False
        self._idle: dict[Origin, list[WireResponse]] = {}
        self._busy: set[WireResponse] = set()
        self._targets: dict[tuple[str, str], tuple[Origin, bytes]] = {}
        self._sweeper: asyncio.TimerHandle | None = None

    def post(self, url: str, data: bytes | None = None) -> _Exchange:
        return _Exchange(self, "POST", url, data)

    def request(self, method: str, url: str, data: bytes | None = None) -> _Exchange:
        return _Exchange(self, method.upper(), url, data)

    def _target(self, method: str, url: str) -> tuple[Origin, bytes]:
        """(origin, the request's head up to its length), built once per URL."""
        if (found := self._targets.get((method, url))) is None:
            parsed = urlsplit(url)
            if parsed.scheme not in ("http", "https") or not parsed.hostname:
                raise ValueError(f"not an http(s) URL: {url}")
            tls = parsed.scheme == "https"
            target = (parsed.path or "/") + (f"?{parsed.query}" if parsed.query else "")
            head = f"{method} {target} HTTP/1.1\r\nhost: {parsed.netloc}\r\n{self.fixed}".encode("latin-1")
            found = self._targets[(method, url)] = ((parsed.hostname, parsed.port or (443 if tls else 80), tls), head)
        return found

    async def _connection(self, origin: Origin, deadline: float) -> WireResponse:
        idle, now = self._idle.get(origin), time.monotonic()
        while idle:
            if not (connection := idle.pop()).closed and now - connection.idle_since < self.idle_s:
                return connection
            connection.close()
        host, port, tls = origin
        async with asyncio.timeout_at(deadline):
            _, connection = await asyncio.get_running_loop().create_connection(
                lambda: WireResponse(origin), host, port, ssl=ssl.create_default_context() if tls else None)
        return connection

    def _sweep(self) -> None:
        """Fail the answers past their deadline once a second: one timer for the session, not one per request."""
        loop = asyncio.get_running_loop()
        for connection in list(self._busy):
            if connection.deadline <= loop.time() and not connection.complete:
                connection.fail(TimeoutError(f"no complete answer from {connection.url} within {self.total_timeout_s} s"))
                connection.close()
        self._sweeper = loop.call_later(SWEEP_EVERY_S, self._sweep) if not self.closed else None

    async def _send(self, method: str, url: str, data: bytes | None) -> WireResponse:
        if self.closed:
            raise RuntimeError("the session is closed")
        origin, head = self._target(method, url)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.total_timeout_s
        if self._sweeper is None:
            self._sweeper = loop.call_later(SWEEP_EVERY_S, self._sweep)
        connection = await self._connection(origin, deadline)
        connection.reset(url, deadline)
        connection.busy = True
        self._busy.add(connection)
        if data is None:
            connection.send(head + (b"content-length: 0\r\n\r\n" if method == "POST" else b"\r\n"))
        else:
            connection.send(b"%scontent-length: %d\r\n\r\n%s" % (head, len(data), data))
        return connection

    def _release(self, connection: WireResponse) -> None:
        self._busy.discard(connection)
        connection.busy = False
        if connection.complete and connection.keep_alive and not connection.closed and not self.closed:
            connection.idle_since = time.monotonic()
            self._idle.setdefault(connection.origin, []).append(connection)
        else:
            connection.close()

    async def close(self) -> None:
        self.closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for connection in [*(c for idle in self._idle.values() for c in idle), *self._busy]:
            connection.close()
        self._idle.clear()
        self._busy.clear()

    async def __aenter__(self) -> WireSession:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
