"""The load generator's lean HTTP client (`benchmarks.loadgen.wire`) against real sockets: a raw
scripted server (what it answers and how it closes is up to each test) and the instant endpoint.
What the load generator needs of it: keep-alive reuse, chunked bodies, status and headers, and every
failure an error the load generator counts (never a hang). `send_request` over it: test_loadgen.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest

from benchmarks import instant_endpoint
from benchmarks.loadgen import wire
from benchmarks.loadgen.client import CLIENT_ERRORS
from benchmarks.loadgen.wire import WireSession, WireStatusError

Answer = Callable[[bytes], bytes | None]  # the request's bytes -> what to write back (None: nothing, then close)


class _Scripted:
    """A raw HTTP/1.1 server: per request it writes what `answer` returns; counts connections."""

    def __init__(self) -> None:
        self.connections = 0
        self.requests: list[bytes] = []
        self.answer: Answer = lambda request: _ok(b'{"a": 1}')
        self.close_after = False

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                request = head + await reader.readexactly(length)
                self.requests.append(request)
                answer = self.answer(request)
                if answer is None:
                    break
                writer.write(answer)
                await writer.drain()
                if self.close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def _ok(body: bytes, extra: str = "") -> bytes:
    return f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Cache: HIT\r\n{extra}content-length: {len(body)}\r\n\r\n".encode() + body


@pytest.fixture
async def scripted() -> AsyncIterator[tuple[str, _Scripted]]:
    script = _Scripted()
    server = await asyncio.start_server(script.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/v1/completions", script
    finally:
        server.close()
        await server.wait_closed()


async def test_keeps_one_connection_alive_and_sends_its_headers(scripted) -> None:
    url, script = scripted
    async with WireSession({"authorization": "Bearer k", "content-type": "application/json"}) as session:
        for _ in range(3):
            async with session.post(url, data=b'{"x": 1}') as response:
                assert response.status == 200
                assert response.headers["x-cache"] == "HIT"
                assert await response.read() == b'{"a": 1}'
    assert script.connections == 1
    assert len(script.requests) == 3
    first = script.requests[0]
    assert first.startswith(b"POST /v1/completions HTTP/1.1\r\n")
    assert b"authorization: Bearer k\r\n" in first
    assert b"content-length: 8\r\n" in first
    assert first.endswith(b'\r\n\r\n{"x": 1}')


async def test_reads_a_chunked_body_as_it_comes(scripted) -> None:
    url, script = scripted
    chunked = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
    script.answer = lambda request: chunked
    async with WireSession() as session:
        async with session.post(url, data=b"{}") as response:
            parts = [chunk async for chunk in response.iter_chunks()]
        assert b"".join(parts) == b"hello world"
        async with session.post(url, data=b"{}") as response:  # the same connection, still in step
            assert await response.read() == b"hello world"
    assert script.connections == 1


async def test_a_server_closing_the_connection_gets_a_new_one(scripted) -> None:
    url, script = scripted
    script.answer = lambda request: _ok(b"{}", "connection: close\r\n")
    script.close_after = True
    async with WireSession() as session:
        for _ in range(2):
            async with session.post(url, data=b"{}") as response:
                assert response.status == 200
                assert await response.read() == b"{}"
    assert script.connections == 2


async def test_a_connection_idle_too_long_is_not_reused(scripted) -> None:
    url, script = scripted
    async with WireSession(idle_s=0.05) as session:
        for _ in range(2):
            async with session.post(url, data=b"{}") as response:
                await response.read()
            await asyncio.sleep(0.1)  # time passing is the behaviour: past idle_s
    assert script.connections == 2


async def test_an_answer_cut_short_is_a_connection_error(scripted) -> None:
    url, script = scripted
    script.answer = lambda request: b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{\"partial"
    script.close_after = True
    async with WireSession() as session:
        with pytest.raises(ConnectionError) as caught:
            async with session.post(url, data=b"{}") as response:
                await response.read()
        assert isinstance(caught.value, CLIENT_ERRORS)
        script.answer, script.close_after = (lambda request: _ok(b"{}")), False
        async with session.post(url, data=b"{}") as response:  # the session goes on, on a new connection
            assert await response.read() == b"{}"


async def test_no_answer_at_all_is_a_connection_error(scripted) -> None:
    url, script = scripted
    script.answer = lambda request: None  # closes without a byte
    async with WireSession() as session:
        with pytest.raises(ConnectionError):
            async with session.post(url, data=b"{}"):
                pass


async def test_a_malformed_answer_is_a_value_error(scripted) -> None:
    url, script = scripted
    script.answer = lambda request: b"NOT HTTP AT ALL\r\n\r\n"
    async with WireSession() as session:
        with pytest.raises(ValueError, match="malformed HTTP answer"):
            async with session.post(url, data=b"{}"):
                pass


async def test_a_silent_server_times_out(scripted, monkeypatch) -> None:
    url, script = scripted
    monkeypatch.setattr(wire, "SWEEP_EVERY_S", 0.05)
    script.answer = lambda request: b""  # writes nothing and keeps the connection open

    async def ask(session: WireSession) -> None:
        async with asyncio.timeout(5), session.post(url, data=b"{}"):  # the test's own bound: the session's must come first
            pass

    async with WireSession(total_timeout_s=0.2) as session:
        with pytest.raises(TimeoutError, match=r"no complete answer .* within 0\.2 s"):
            await ask(session)


async def test_raise_for_status_and_get(scripted) -> None:
    url, script = scripted
    script.answer = lambda request: b"HTTP/1.1 404 Not Found\r\ncontent-length: 2\r\n\r\n{}"
    async with WireSession() as session, session.request("GET", url.replace("/completions", "/models")) as response:
        assert response.status == 404
        with pytest.raises(WireStatusError) as caught:
            response.raise_for_status()
        assert caught.value.status == 404
        assert isinstance(caught.value, CLIENT_ERRORS)
    assert script.requests[0].startswith(b"GET /v1/models HTTP/1.1\r\n")


async def test_against_the_instant_endpoint_many_requests_in_flight() -> None:
    server = await instant_endpoint.serve("127.0.0.1", 0, name="inst")
    port = server.sockets[0].getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1/completions"
    try:
        async with WireSession() as session:

            async def one(stream: bool) -> bytes:
                body = b'{"model": "inst", "prompt": "a b", "max_tokens": 3, "stream": %s}' % (b"true" if stream else b"false")
                async with session.post(url, data=body) as response:
                    assert response.status == 200
                    return await response.read()

            answers = await asyncio.gather(*(one(i % 2 == 1) for i in range(64)))
            assert all(b'"usage"' in a for a in answers[0::2])
            assert all(a.rstrip().endswith(b"data: [DONE]") for a in answers[1::2])
            assert sum(len(c) for c in session._idle.values()) <= 64  # one connection per request in flight, kept
    finally:
        server.close()
        await server.wait_closed()
