"""A whole answer leaves in one send, its head with its body (gateway/server/http.py, `HeldHead`);
a stream's head, a HEAD's, and the head of an answer that fails before its body are not held back.
The protocol is driven read by read over a transport that keeps each write."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import uvicorn
from uvicorn.server import ServerState

from gateway.server.http import HeldHead, http_protocol
from tests.waits import until

App = Callable[[Any, Any, Any], Awaitable[None]]
GET = b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n"


class _Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = self.aborted = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 8000) if name in ("sockname", "peername") else default

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def is_closing(self) -> bool:
        return self.closed or self.aborted

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def _served(app: App, *requests: bytes, between: Callable[[_Transport], None] | None = None) -> _Transport:
    async def main() -> _Transport:
        protocol = http_protocol(10)(config=uvicorn.Config(app), server_state=ServerState(), app_state={})  # type: ignore[call-arg]
        transport = _Transport()
        protocol.connection_made(transport)
        for request in requests:
            protocol.data_received(request)
            if between is not None:
                await until(lambda: transport.writes, what="the head written")
                between(transport)
            await until(lambda: len(asyncio.all_tasks()) == 1, what="the answer over (no task but this one left)")
        protocol.connection_lost(None)
        return transport

    return asyncio.run(main())


def _whole(body: bytes) -> App:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"%d" % len(body)), (b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})
    return app


def test_a_whole_answer_is_one_write_each_time_on_a_kept_connection() -> None:
    transport = _served(_whole(b'{"ok":true}'), GET, GET)
    assert len(transport.writes) == 2  # one per answer
    for write in transport.writes:
        assert write.startswith(b"HTTP/1.1 200 OK\r\n")
        assert write.endswith(b"\r\n\r\n{\"ok\":true}")


def test_a_streams_head_leaves_before_its_first_chunk() -> None:
    seen: list[list[bytes]] = []
    go = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await go.wait()
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    def check(transport: _Transport) -> None:
        seen.append(list(transport.writes))
        go.set()

    transport = _served(app, GET, between=check)
    assert len(seen[0]) == 1
    assert seen[0][0].startswith(b"HTTP/1.1 200")
    assert transport.writes[1:] == [b"9\r\ndata: 1\n\n\r\n", b"0\r\n\r\n"]


def test_a_head_request_and_an_empty_body_are_not_held() -> None:
    transport = _served(_whole(b"abc"), b"HEAD /x HTTP/1.1\r\nHost: x\r\n\r\n")
    assert len(transport.writes) == 1
    assert transport.writes[0].endswith(b"application/json\r\n\r\n")
    transport = _served(_whole(b""), GET)
    assert transport.writes[0].endswith(b"application/json\r\n\r\n")


def test_the_head_of_an_answer_that_fails_before_its_body_goes_out_before_the_close() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"5")]})
        raise RuntimeError("failed after the head")

    transport = _served(app, GET)
    assert transport.closed
    assert b"".join(transport.writes).startswith(b"HTTP/1.1 200")
    assert transport.writes[0].endswith(b"\r\n\r\n")


def test_held_bytes_go_out_on_close_and_are_dropped_by_an_abort() -> None:
    closed, aborted = _Transport(), _Transport()
    for transport, end in ((closed, HeldHead.close), (aborted, HeldHead.abort)):
        held = HeldHead(transport)
        held.write(b"before")
        held.hold()
        held.write(b"head")
        assert transport.writes == [b"before"]  # held
        end(held)
    assert closed.writes == [b"before", b"head"]
    assert closed.closed
    assert aborted.writes == [b"before"]
    assert aborted.aborted


def test_a_held_head_leaves_with_the_next_write() -> None:
    transport = _Transport()
    held = HeldHead(transport)
    held.hold()
    held.write(b"head")
    held.write(b"body")
    held.write(b"more")
    assert transport.writes == [b"headbody", b"more"]
