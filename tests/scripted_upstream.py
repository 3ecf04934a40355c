"""A scripted upstream for remote-model tests: a real HTTP server on loopback (uvicorn, in a thread
of the test process, on a free port) that answers every request with `script(request)`, an
`httpx.Request` in and an `httpx.Response` out, its body sent as the response's raw stream (so a
`content-encoding: gzip` body goes out compressed). A stream that raises mid-way (an
`httpx.ReadError`) cuts the connection there, as a failing upstream does: the gateway's client
sees an answer that stops short. A client that hangs up mid-answer stops it, as a real server does."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import uvicorn

from tests.served import HOST, running

Script = Callable[[httpx.Request], httpx.Response]
FRAMED = frozenset({"content-length", "transfer-encoding", "connection"})  # uvicorn frames the answer itself


@contextlib.contextmanager
def scripted(script: Script) -> Iterator[str]:
    """The server's base URL (http://127.0.0.1:PORT) while it runs."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        target = scope["path"] + (("?" + scope["query_string"].decode()) if scope["query_string"] else "")
        headers = [(name.decode(), value.decode()) for name, value in scope["headers"]]
        answer = script(httpx.Request(scope["method"], f"http://{HOST}{target}", headers=headers, content=body))
        raw = [(name, value) for name, value in answer.headers.raw if name.decode().lower() not in FRAMED]
        await send({"type": "http.response.start", "status": answer.status_code, "headers": raw})

        async def stream() -> None:
            async for chunk in answer.stream:  # type: ignore[union-attr]
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})

        # as a real server: a client that hangs up stops the answer (its stream is closed)
        sending, gone = asyncio.ensure_future(stream()), asyncio.ensure_future(receive())
        await asyncio.wait({sending, gone}, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if not sending.done():
            sending.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sending
            return
        await sending

    config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off")
    with running(uvicorn.Server(config)) as port:
        yield f"http://{HOST}:{port}"
