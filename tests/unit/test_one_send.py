"""`server.http.OneSendPerTurn`: through uvicorn's real HTTP protocol on a port-0 socket, a whole answer's head and
body leave in one send (uvicorn alone makes two), a stream's events each leave before the next is made, a close
sends what is held and an abort drops it. Writes are counted on the connection's own transport; no timing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

import pytest
import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol
from uvicorn.server import ServerState

from gateway.server.http import OneSendPerTurn, http_protocol

App = Callable[[dict[str, Any], Any, Any], Any]


class Recorder:
    """The connection's transport, each write it is given recorded (what reaches the socket, one send each)."""

    def __init__(self, transport: asyncio.Transport, writes: list[bytes]) -> None:
        self.transport, self.writes = transport, writes

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))
        self.transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


async def whole(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    body = b'{"answer": "whole"}'
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def serve(app: App, base: type[asyncio.Protocol], writes: list[bytes]) -> AsyncIterator[tuple[str, int]]:
    config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off")
    config.load()
    state = ServerState()

    class Recorded(base):  # type: ignore[valid-type,misc]
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(cast(asyncio.Transport, Recorder(cast(asyncio.Transport, transport), writes)))

    server = await asyncio.get_running_loop().create_server(
        lambda: Recorded(config=config, server_state=state, app_state={}), "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[:2]
    finally:
        server.close()
        for connection in list(state.connections):
            connection.shutdown()
        await server.wait_closed()


async def answer(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    return head + await reader.readexactly(length)


@pytest.mark.parametrize(("protocol", "sends"), [(http_protocol(10.0), 1), (AutoHTTPProtocol, 2)])
async def test_a_whole_answer_s_head_and_body_leave_in_one_send(protocol: type[asyncio.Protocol], sends: int) -> None:
    """(uvicorn's protocol without the gateway's mix-in: two sends, head then body)"""
    writes: list[bytes] = []
    async for host, port in serve(whole, protocol, writes):
        reader, writer = await asyncio.open_connection(host, port)
        for n in (1, 2):  # and again on the kept-alive connection
            writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            received = await asyncio.wait_for(answer(reader), 10)
            assert received.endswith(b'\r\n\r\n{"answer": "whole"}')
            assert len(writes) == n * sends
            assert b"".join(writes[-sends:]) == received
        writer.close()


async def test_a_stream_s_event_leaves_before_the_next_is_made() -> None:
    """The app makes each event only once the client has read the one before (a held event would never arrive:
    the wait is bounded, so the test fails, not hangs)."""
    read = [asyncio.Event() for _ in range(3)]
    writes: list[bytes] = []

    async def stream(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for n, event in enumerate(read):
            await send({"type": "http.response.body", "body": b"data: %d\n\n" % n, "more_body": True})
            await event.wait()
        await send({"type": "http.response.body", "body": b""})

    async for host, port in serve(stream, http_protocol(10.0), writes):
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        for n, event in enumerate(read):
            await asyncio.wait_for(reader.readuntil(b"data: %d\n\n\r\n" % n), 10)
            event.set()
        assert await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), 10) == b"0\r\n\r\n"
        assert len(writes) == 1 + len(read)  # the head went with the first event; the end alone
        writer.close()


async def test_a_close_sends_what_is_held_and_an_abort_drops_it() -> None:
    loop = asyncio.get_running_loop()
    sent: list[bytes] = []
    ended: list[str] = []

    class Ends:
        def write(self, data: bytes) -> None:
            sent.append(data)

        def is_closing(self) -> bool:
            return bool(ended)

        def close(self) -> None:
            ended.append("close")

        def abort(self) -> None:
            ended.append("abort")

        def get_write_buffer_size(self) -> int:
            return 0

    closing = OneSendPerTurn(cast(asyncio.Transport, Ends()), loop)
    closing.write(b"head ")
    closing.write(b"body")
    assert closing.get_write_buffer_size() == len(b"head body")
    closing.close()
    assert (sent, ended) == ([b"head body"], ["close"])

    sent.clear()
    ended.clear()
    aborting = OneSendPerTurn(cast(asyncio.Transport, Ends()), loop)
    aborting.write(b"unsent")
    aborting.abort()
    flushed = loop.create_future()
    loop.call_soon(flushed.set_result, None)  # after the turn's end, when the held bytes would have left
    await flushed
    assert (sent, ended) == ([], ["abort"])
