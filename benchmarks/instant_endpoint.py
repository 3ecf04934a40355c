"""The instant endpoint: an OpenAI-compatible server that costs nearly nothing (a raw uvloop protocol
with httptools, canned answers built once per shape), so that a client's rate against it is the
client's own limit (`benchmarks.loadgen.ceiling`).

    python -m benchmarks.instant_endpoint --port 8300 [--name bare] [--paced]

POST /v1/completions and /v1/chat/completions (plain, or streamed: one chunk per token, all written
at once unless --paced), GET /v1/models, GET /health; anything else 404. No vllm or gateway import.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

import httptools
import orjson

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


def _prompt_tokens(body: dict[str, Any]) -> int:
    if isinstance(body.get("prompt"), str):
        return body["prompt"].count(" ") + 1
    return sum(str(m.get("content", "")).count(" ") + 1 for m in body.get("messages") or [] if isinstance(m, dict))


def _usage(prompt: int, tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": tokens, "total_tokens": prompt + tokens}


DONE = _event(b"[DONE]") + b"0\r\n\r\n"


class Canned:
    """The answers of one served model name, built on first use per shape (chat, tokens, model) and kept."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.plain: dict[tuple[bool, int, str], tuple[bytes, bytes]] = {}  # before and after the usage
        self.streams: dict[tuple[bool, int, str], list[bytes]] = {}
        self.models = orjson.dumps({"object": "list", "data": [{"id": name, "object": "model", "created": CREATED,
                                                                "owned_by": "bench"}]})

    def answer(self, chat: bool, tokens: int, model: str, prompt: int) -> bytes:
        """A non-streamed completion (JSON), its usage filled in."""
        parts = self.plain.get((chat, tokens, model))
        if parts is None:
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
            choice.update({"message": {"role": "assistant", "content": WORD * tokens}} if chat else {"text": WORD * tokens})
            doc = {"id": "instant-0", "object": "chat.completion" if chat else "text_completion",
                   "created": CREATED, "model": model, "choices": [choice], "usage": None}
            before, _, after = orjson.dumps(doc).rpartition(b"null")
            parts = self.plain[(chat, tokens, model)] = (before, after)
        return parts[0] + orjson.dumps(_usage(prompt, tokens)) + parts[1]

    def stream(self, chat: bool, tokens: int, model: str) -> list[bytes]:
        """The events of a streamed completion (each one chunk), without the usage and [DONE]."""
        events = self.streams.get((chat, tokens, model))
        if events is None:
            head = {"id": "instant-0", "object": "chat.completion.chunk" if chat else "text_completion",
                    "created": CREATED, "model": model}
            events = self.streams[(chat, tokens, model)] = []
            for step in range(tokens):
                choice: dict[str, Any] = {"index": 0, "finish_reason": "length" if step == tokens - 1 else None}
                if chat:
                    choice["delta"] = {"role": "assistant", "content": WORD} if step == 0 else {"content": WORD}
                else:
                    choice["text"] = WORD
                events.append(_event({**head, "choices": [choice]}))
        return events

    def usage_event(self, chat: bool, model: str, prompt: int, tokens: int) -> bytes:
        obj = "chat.completion.chunk" if chat else "text_completion"
        return _event({"id": "instant-0", "object": obj, "created": CREATED, "model": model, "choices": [],
                       "usage": _usage(prompt, tokens)})


class InstantProtocol(asyncio.Protocol):
    """One connection: httptools parses, each request is answered as it completes (the load
    generator's clients send one request at a time on a connection)."""

    def __init__(self, canned: Canned, paced: bool) -> None:
        self.canned, self.paced = canned, paced
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
            parts = [_whole("200 OK", self.canned.models if path == b"/v1/models" else b"{}", keep_alive)]
        else:
            parts = [_error("404 Not Found", f"no route {method.decode()} {path.decode(errors='replace')}", keep_alive)]
        self._write(parts, close=not keep_alive)

    def _complete(self, chat: bool, raw: bytes, keep_alive: bool) -> list[bytes]:
        try:
            body = orjson.loads(raw)
            tokens = max(1, int(body.get("max_tokens") or body.get("max_completion_tokens") or 16))
        except (orjson.JSONDecodeError, AttributeError, TypeError, ValueError):
            return [_error("400 Bad Request", "the body is not a JSON object with an integer max_tokens", keep_alive)]
        model = body["model"] if isinstance(body.get("model"), str) else self.canned.name
        prompt = _prompt_tokens(body)
        if not body.get("stream"):
            return [_whole("200 OK", self.canned.answer(chat, tokens, model, prompt), keep_alive)]
        parts = [_head("200 OK", "text/event-stream", None, keep_alive), *self.canned.stream(chat, tokens, model)]
        if (body.get("stream_options") or {}).get("include_usage"):
            parts.append(self.canned.usage_event(chat, model, prompt, tokens))
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
    canned = Canned(name)
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: InstantProtocol(canned, paced), host, port, backlog=4096)


async def _main(host: str, port: int, name: str, paced: bool) -> None:
    server = await serve(host, port, name, paced)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="An instant OpenAI-compatible endpoint (the load generator's ceiling)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8300)
    p.add_argument("--name", default=NAME, help="served model name")
    p.add_argument("--paced", action="store_true",
                   help="write a stream's events one per turn of the loop (as a server generating them does), "
                        "not all at once")
    args = p.parse_args(argv)
    try:
        import uvloop

        uvloop.run(_main(args.host, args.port, args.name, args.paced))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
