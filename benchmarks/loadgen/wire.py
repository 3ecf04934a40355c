"""The load generator's HTTP/1.1 client: each request one pre-built write on a keep-alive connection,
the answer parsed by httptools (benchmarks/README.md says why not aiohttp).

`WireSession` offers `post` and `request` as async context managers giving responses with
`status`, `headers`, `read()`, `iter_chunks()` and `raise_for_status()`; one keep-alive
connection per request in flight, dropped after `idle_s` idle. Errors are those
`loadgen.client.CLIENT_ERRORS` counts.
"""

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


class WireStatusError(ValueError):
    """A non-2xx answer, from `raise_for_status`."""

    def __init__(self, status: int, url: str) -> None:
        super().__init__(f"HTTP {status} from {url}")
        self.status = status


class WireResponse:
    """One answer on one connection, filled by the connection's parser callbacks."""

    def __init__(self, connection: _Connection, origin: Origin, url: str, deadline: float) -> None:
        self.connection, self.origin, self.url, self.deadline = connection, origin, url, deadline
        self.status = 0  # set with the headers; the connection's parser fills all of these
        self.headers: dict[str, str] = {}  # names in lower case
        self.complete = False
        self.error: BaseException | None = None
        self.chunks: list[bytes] = []  # of the body, not yet read
        self._waiter: asyncio.Future[None] | None = None

    # the connection's side (it wakes the reader once per read from the socket, `wake`)
    def fail(self, error: BaseException) -> None:
        if not self.complete and self.error is None:
            self.error = error
            self.wake()

    def wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # the reader's side
    async def _wait(self) -> None:
        if self.error is not None:
            raise self.error
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


class _Connection(asyncio.Protocol):
    """One keep-alive connection: at most one request on it at a time."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.response: WireResponse | None = None
        self.closed = False
        self.keep_alive = True
        self.idle_since = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):  # not TCP
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.response is not None:
            self.response.fail(ConnectionResetError("the server closed the connection before its answer ended"))

    def data_received(self, data: bytes) -> None:
        if self.response is None:  # nothing was asked: a server that talks out of turn
            self.close()
            return
        response = self.response
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            response.fail(ValueError(f"malformed HTTP answer: {exc}"))
            self.close()
        response.wake()  # one wake for all the events this read brought

    def eof_received(self) -> bool | None:
        return None  # close the transport: connection_lost fails an unfinished answer

    # httptools' callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        if self.response is not None:
            self.response.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        if self.response is not None:
            self.response.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if self.response is not None:
            self.response.chunks.append(body)  # a chunk of a chunked body each: one per event of a stream

    def on_message_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()
        if self.response is not None:
            self.response.complete = True

    # the session's side
    def send(self, data: bytes, response: WireResponse) -> None:
        assert self.transport is not None
        self.response = response
        if self.closed or self.transport.is_closing():
            response.fail(ConnectionResetError("the connection closed before the request went out"))
            return
        self.transport.write(data)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


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
        response = self.response
        if response is not None:
            self.session._release(response)


class WireSession:
    """Keep-alive connections per origin, requests with the session's headers (see the module docstring)."""

    def __init__(
        self, headers: Mapping[str, str] | None = None, total_timeout_s: float = 600.0, idle_s: float = 3.0,
    ) -> None:
        self.fixed = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items() if k.lower() not in _OWN_HEADERS)
        self.total_timeout_s = total_timeout_s
        self.idle_s = idle_s
        self.closed = False
        self._idle: dict[Origin, list[_Connection]] = {}
        self._busy: set[_Connection] = set()
        self._targets: dict[tuple[str, str], tuple[Origin, bytes, str]] = {}
        self._sweeper: asyncio.TimerHandle | None = None

    def post(self, url: str, data: bytes | None = None) -> _Exchange:
        return _Exchange(self, "POST", url, data)

    def request(self, method: str, url: str, data: bytes | None = None) -> _Exchange:
        return _Exchange(self, method.upper(), url, data)

    def _target(self, method: str, url: str) -> tuple[Origin, bytes, str]:
        """(origin, the request's head up to its length, the URL as text), built once per URL."""
        found = self._targets.get((method, url))
        if found is None:
            parsed = urlsplit(url)
            if parsed.scheme not in ("http", "https") or not parsed.hostname:
                raise ValueError(f"not an http(s) URL: {url}")
            tls = parsed.scheme == "https"
            port = parsed.port or (443 if tls else 80)
            target = (parsed.path or "/") + (f"?{parsed.query}" if parsed.query else "")
            head = f"{method} {target} HTTP/1.1\r\nhost: {parsed.netloc}\r\n{self.fixed}".encode("latin-1")
            found = self._targets[(method, url)] = ((parsed.hostname, port, tls), head, url)
        return found

    async def _connection(self, origin: Origin, deadline: float) -> _Connection:
        idle = self._idle.get(origin)
        now = time.monotonic()
        while idle:
            connection = idle.pop()
            if not connection.closed and now - connection.idle_since < self.idle_s:
                return connection
            connection.close()
        host, port, tls = origin
        context = ssl.create_default_context() if tls else None
        loop = asyncio.get_running_loop()
        async with asyncio.timeout_at(deadline):
            _, connection = await loop.create_connection(_Connection, host, port, ssl=context)
        return connection

    def _sweep(self) -> None:
        """Fail the answers past their deadline (the session's total timeout), once a second: one
        timer for the session instead of one per request."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        for connection in list(self._busy):
            response = connection.response
            if response is not None and response.deadline <= now and not response.complete:
                response.fail(TimeoutError(f"no complete answer from {response.url} within {self.total_timeout_s} s"))
                connection.close()
        self._sweeper = loop.call_later(SWEEP_EVERY_S, self._sweep) if not self.closed else None

    async def _send(self, method: str, url: str, data: bytes | None) -> WireResponse:
        if self.closed:
            raise RuntimeError("the session is closed")
        origin, head, text = self._target(method, url)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.total_timeout_s
        if self._sweeper is None:
            self._sweeper = loop.call_later(SWEEP_EVERY_S, self._sweep)
        connection = await self._connection(origin, deadline)
        response = WireResponse(connection, origin, text, deadline)
        if data is None:
            message = head + (b"content-length: 0\r\n\r\n" if method == "POST" else b"\r\n")
        else:
            message = b"%scontent-length: %d\r\n\r\n%s" % (head, len(data), data)
        self._busy.add(connection)
        connection.send(message, response)
        return response

    def _release(self, response: WireResponse) -> None:
        connection = response.connection
        self._busy.discard(connection)
        connection.response = None
        if response.complete and connection.keep_alive and not connection.closed and not self.closed:
            connection.idle_since = time.monotonic()
            self._idle.setdefault(response.origin, []).append(connection)
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


SWEEP_EVERY_S = 1.0
_OWN_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection"})
