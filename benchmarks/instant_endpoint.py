"""The two floors under any server, both answering `max_tokens` words to completions and chat
completions (streams: one chunk per token), GET /v1/models and /health:

- the instant endpoint, which costs nearly nothing (a raw uvloop protocol with httptools, canned
  answers built once per shape; a stream's events written at once unless --paced), so that a
  client's rate against it is the client's own limit (`benchmarks.loadgen`'s ceiling);
- `--starlette` (`create_bare_app`), the stack's limit (the race's `bare` target): Starlette +
  uvicorn parsing the JSON body and encoding each answer per request as a server does, with no
  validation, middleware, logs or metrics."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import httptools
import orjson
import uvloop
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

NAME = "bare"
WORD = " bare"
CREATED = int(time.time())
CHAT = b"/v1/chat/completions"


def _head(status: str, content_type: str, length: int | None, keep_alive: bool) -> bytes:
    size = f"content-length: {length}\r\n" if length is not None else "transfer-encoding: chunked\r\n"
    connection = "" if keep_alive else "connection: close\r\n"
    return f"HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\n{size}{connection}\r\n".encode()


def _whole(status: str, body: bytes, keep_alive: bool) -> bytes:
    return _head(status, "application/json", len(body), keep_alive) + body


def _error(status: str, message: str, keep_alive: bool) -> bytes:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": int(status.split()[0])}}
    return _whole(status, orjson.dumps(body), keep_alive)


def _event(obj: Any) -> bytes:
    """One SSE event as one HTTP chunk."""
    data = b"data: " + (obj if isinstance(obj, bytes) else orjson.dumps(obj)) + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(data), data)


def usage(body: dict[str, Any], tokens: int) -> dict[str, int]:
    """A word per token of the prompt (or of each message)."""
    if isinstance(prompt := body.get("prompt"), str):
        words = prompt.count(" ") + 1
    else:
        words = sum(str(m.get("content", "")).count(" ") + 1 for m in body.get("messages") or [] if isinstance(m, dict))
    return {"prompt_tokens": words, "completion_tokens": tokens, "total_tokens": words + tokens}


def max_tokens(body: dict[str, Any]) -> int:
    return max(1, int(body.get("max_tokens") or body.get("max_completion_tokens") or 16))


DONE = _event(b"[DONE]") + b"0\r\n\r\n"


def completion(chat: bool, tokens: int, model: str, used: Any = None, id: str = "instant-0", created: int = CREATED) -> dict[str, Any]:
    """A non-streamed completion of `tokens` words (the bare app's too)."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
    choice.update({"message": {"role": "assistant", "content": WORD * tokens}} if chat else {"text": WORD * tokens})
    return {"id": id, "object": "chat.completion" if chat else "text_completion", "created": created, "model": model,
            "choices": [choice], "usage": used}


def chunk(chat: bool, model: str, step: int | None, tokens: int, id: str = "instant-0", created: int = CREATED) -> dict[str, Any]:
    """The stream's chunk carrying word `step` of `tokens` (None: the chunk without choices, for the usage)."""
    choices: list[dict[str, Any]] = []
    if step is not None:
        choices.append({"index": 0, "finish_reason": "length" if step == tokens - 1 else None})
        if chat:
            choices[0]["delta"] = {"role": "assistant", "content": WORD} if step == 0 else {"content": WORD}
        else:
            choices[0]["text"] = WORD
    return {"id": id, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": choices}


@functools.cache  # the canned answers: built on first use per shape (chat, tokens, model) and kept
def _models(name: str) -> bytes:
    return orjson.dumps({"object": "list", "data": [{"id": name, "object": "model", "created": CREATED, "owned_by": "bench"}]})


@functools.cache
def _plain(chat: bool, tokens: int, model: str) -> tuple[bytes, bytes]:
    """A non-streamed completion's JSON, cut where its usage goes (the last null)."""
    before, _, after = orjson.dumps(completion(chat, tokens, model)).rpartition(b"null")
    return before, after


@functools.cache
def _stream(chat: bool, tokens: int, model: str) -> tuple[bytes, ...]:
    """The events of a streamed completion (each one chunk), without the usage and [DONE]."""
    return tuple(_event(chunk(chat, model, step, tokens)) for step in range(tokens))


class InstantProtocol(asyncio.Protocol):
    """One connection: httptools parses, each request is answered as it completes (the load
    generator's clients send one request at a time on a connection)."""

    def __init__(self, name: str, paced: bool) -> None:
        self.name, self.paced = name, paced
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self._write([_error("400 Bad Request", "malformed HTTP request", False)], close=True)

    # httptools' callbacks
    def on_message_begin(self) -> None:
        self.url, self.body = b"", []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        method, path, keep_alive = self.parser.get_method(), self.url.partition(b"?")[0], self.parser.should_keep_alive()
        if method == b"POST" and path in (CHAT, b"/v1/completions"):
            parts = self._complete(path == CHAT, b"".join(self.body), keep_alive)
        elif method == b"GET" and path in (b"/v1/models", b"/health"):
            parts = [_whole("200 OK", _models(self.name) if path == b"/v1/models" else b"{}", keep_alive)]
        else:
            parts = [_error("404 Not Found", f"no route {method.decode()} {path.decode(errors='replace')}", keep_alive)]
        self._write(parts, close=not keep_alive)

    def _complete(self, chat: bool, raw: bytes, keep_alive: bool) -> list[bytes]:
        try:
            body = orjson.loads(raw)
            tokens = max_tokens(body)
        except (orjson.JSONDecodeError, AttributeError, TypeError, ValueError):
            return [_error("400 Bad Request", "the body is not a JSON object with an integer max_tokens", keep_alive)]
        model = body["model"] if isinstance(body.get("model"), str) else self.name
        if not body.get("stream"):
            before, after = _plain(chat, tokens, model)
            return [_whole("200 OK", before + orjson.dumps(usage(body, tokens)) + after, keep_alive)]
        parts = [_head("200 OK", "text/event-stream", None, keep_alive), *_stream(chat, tokens, model)]
        if (body.get("stream_options") or {}).get("include_usage"):
            parts.append(_event({**chunk(chat, model, None, tokens), "usage": usage(body, tokens)}))
        return [*parts, DONE]

    def _write(self, parts: list[bytes], close: bool) -> None:
        """All at once (each event its own HTTP chunk, one system call), or paced: one part per turn
        of the loop, as a server generating them does (other connections' turns between)."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if not self.paced or len(parts) == 1:
            transport.writelines(parts)
            if close:
                transport.close()
            return
        transport.write(parts[0])
        asyncio.get_running_loop().call_soon(self._write, parts[1:], close)


async def serve(host: str = "127.0.0.1", port: int = 0, name: str = NAME, paced: bool = False) -> asyncio.Server:
    """Start listening in the running loop; the port is `server.sockets[0].getsockname()[1]`."""
    return await asyncio.get_running_loop().create_server(lambda: InstantProtocol(name, paced), host, port, backlog=4096)


def create_bare_app(name: str = NAME) -> Starlette:
    """The Starlette app of the same answers, built and encoded per request (ids and times of their own)."""
    ids = itertools.count()

    async def events(body: dict[str, Any], chat: bool, tokens: int, model: str, id: str) -> AsyncIterator[bytes]:
        created = int(time.time())
        for step in range(tokens):
            yield b"data: " + orjson.dumps(chunk(chat, model, step, tokens, id, created)) + b"\n\n"
        if (body.get("stream_options") or {}).get("include_usage"):
            yield b"data: " + orjson.dumps({**chunk(chat, model, None, tokens, id, created), "usage": usage(body, tokens)}) + b"\n\n"
        yield b"data: [DONE]\n\n"

    async def complete(request: Request) -> Response:
        body, chat = orjson.loads(await request.body()), request.url.path == CHAT.decode()
        tokens, model, id = max_tokens(body), body.get("model") or name, f"bare-{next(ids)}"
        if body.get("stream"):
            return StreamingResponse(events(body, chat, tokens, model, id), media_type="text/event-stream")
        answer = completion(chat, tokens, model, usage(body, tokens), id, int(time.time()))
        return Response(orjson.dumps(answer), media_type="application/json")

    async def get(request: Request) -> Response:
        return Response(_models(name) if request.url.path == "/v1/models" else b"{}", media_type="application/json")

    return Starlette(routes=[Route("/v1/completions", complete, methods=["POST"]), Route(CHAT.decode(), complete, methods=["POST"]),
                             Route("/v1/models", get, methods=["GET"]), Route("/health", get, methods=["GET"])])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="An instant OpenAI-compatible endpoint (the load generator's ceiling)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8300)
    p.add_argument("--name", default=NAME, help="served model name")
    p.add_argument("--paced", action="store_true", help="a stream's events one per turn of the loop, not all at once")
    p.add_argument("--starlette", action="store_true", help="the same answers from Starlette + uvicorn (the stack's limit)")
    args = p.parse_args(argv)
    if args.starlette:  # the gateway's uvicorn settings (defaults, so uvloop and httptools), no logs
        import uvicorn

        uvicorn.run(create_bare_app(args.name), host=args.host, port=args.port, log_config=None, access_log=False,
                    log_level="warning")
        return 0

    async def forever() -> None:
        async with await serve(args.host, args.port, args.name, args.paced) as server:
            await server.serve_forever()

    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(forever())
    return 0


if __name__ == "__main__":
    sys.exit(main())
