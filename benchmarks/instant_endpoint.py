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
import collections
import sys
import time
from pathlib import Path
from typing import Any

import httptools
import orjson

if __package__ in (None, ""):  # `python benchmarks/instant_endpoint.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

NAME = "bare"
WORD = " bare"
CACHE_LIMIT = 4096  # canned answers kept (one per shape: endpoint, stream, max_tokens, usage, model)
CREATED = int(time.time())
CHAT = b"/v1/chat/completions"
COMPLETIONS = b"/v1/completions"


def _head(status: str, content_type: str, length: int | None, keep_alive: bool) -> bytes:
    size = f"content-length: {length}\r\n" if length is not None else "transfer-encoding: chunked\r\n"
    connection = "" if keep_alive else "connection: close\r\n"
    return f"HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\n{size}{connection}\r\n".encode()


def _whole(status: str, body: bytes, keep_alive: bool, content_type: str = "application/json") -> bytes:
    return _head(status, content_type, len(body), keep_alive) + body


def _error(status: str, message: str, keep_alive: bool) -> bytes:
    code = int(status.split()[0])
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
    return _whole(status, orjson.dumps(body), keep_alive)


def _event(obj: Any) -> bytes:
    """One SSE event as one HTTP chunk."""
    data = b"data: " + (obj if isinstance(obj, bytes) else orjson.dumps(obj)) + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(data), data)


def _prompt_tokens(body: dict[str, Any]) -> int:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt.count(" ") + 1
    messages = body.get("messages")
    if isinstance(messages, list):
        return sum(str(m.get("content", "")).count(" ") + 1 for m in messages if isinstance(m, dict))
    return 0


def _usage(prompt: int, tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": tokens, "total_tokens": prompt + tokens}


class Canned:
    """The answers of one served model name, built on first use per shape and kept."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.plain: dict[tuple[bool, int, str], tuple[bytes, bytes]] = {}  # before and after the usage
        self.streams: dict[tuple[bool, int, str], list[bytes]] = {}
        models = {"object": "list", "data": [{"id": name, "object": "model", "created": CREATED, "owned_by": "bench"}]}
        self.models = orjson.dumps(models)

    def answer(self, chat: bool, tokens: int, model: str, prompt: int) -> bytes:
        """A non-streamed completion (JSON), its usage filled in."""
        key = (chat, tokens, model)
        parts = self.plain.get(key)
        if parts is None:
            text = WORD * tokens
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
            choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
            doc = {"id": "instant-0", "object": "chat.completion" if chat else "text_completion",
                   "created": CREATED, "model": model, "choices": [choice], "usage": None}
            before, _, after = orjson.dumps(doc).rpartition(b"null")
            parts = self._keep(self.plain, key, (before, after))
        return parts[0] + orjson.dumps(_usage(prompt, tokens)) + parts[1]

    def stream(self, chat: bool, tokens: int, model: str) -> list[bytes]:
        """The events of a streamed completion (each one chunk), without the usage and [DONE]."""
        key = (chat, tokens, model)
        events = self.streams.get(key)
        if events is None:
            head = {"id": "instant-0", "object": "chat.completion.chunk" if chat else "text_completion",
                    "created": CREATED, "model": model}
            events = []
            for step in range(tokens):
                choice: dict[str, Any] = {"index": 0, "finish_reason": "length" if step == tokens - 1 else None}
                if chat:
                    choice["delta"] = {"role": "assistant", "content": WORD} if step == 0 else {"content": WORD}
                else:
                    choice["text"] = WORD
                events.append(_event({**head, "choices": [choice]}))
            events = self._keep(self.streams, key, events)
        return events

    def usage_event(self, chat: bool, model: str, prompt: int, tokens: int) -> bytes:
        obj = "chat.completion.chunk" if chat else "text_completion"
        return _event({"id": "instant-0", "object": obj, "created": CREATED, "model": model, "choices": [],
                       "usage": _usage(prompt, tokens)})

    @staticmethod
    def _keep(cache: dict[Any, Any], key: Any, value: Any) -> Any:
        if len(cache) >= CACHE_LIMIT:
            cache.clear()
        cache[key] = value
        return value


DONE = _event(b"[DONE]") + b"0\r\n\r\n"


class InstantProtocol(asyncio.Protocol):
    """One connection: httptools parses; complete requests are answered in order, at once (a paced
    stream holds the requests after it until its last event is written)."""

    def __init__(self, canned: Canned, paced: bool) -> None:
        self.canned = canned
        self.paced = paced
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []
        self.queue: collections.deque[tuple[bytes, bytes, bytes, bool]] = collections.deque()
        self.stream: list[bytes] = []  # a paced stream's parts still to write
        self.close_after = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.stream = []

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self.transport is not None:
                self.transport.write(_error("400 Bad Request", "malformed HTTP request", False))
                self.transport.close()

    # httptools' callbacks
    def on_message_begin(self) -> None:
        self.url = b""
        self.body = []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        path = self.url.partition(b"?")[0]
        self.queue.append((self.parser.get_method(), path, b"".join(self.body), self.parser.should_keep_alive()))
        if not self.stream:
            self._answer_queued()

    def _answer_queued(self) -> None:
        """Answer the requests that came, in order, until a paced stream is under way."""
        while self.queue and not self.stream:
            transport = self.transport
            if transport is None or transport.is_closing():
                return
            method, path, body, keep_alive = self.queue.popleft()
            self._answer(transport, method, path, body, keep_alive)
            if not keep_alive:
                if self.stream:
                    self.close_after = True
                else:
                    transport.close()
                return

    def _answer(self, transport: asyncio.Transport, method: bytes, path: bytes, body: bytes, keep_alive: bool) -> None:
        if method == b"POST" and path in (CHAT, COMPLETIONS):
            self._complete(transport, path == CHAT, body, keep_alive)
        elif method == b"GET" and path == b"/v1/models":
            transport.write(_whole("200 OK", self.canned.models, keep_alive))
        elif method == b"GET" and path == b"/health":
            transport.write(_whole("200 OK", b"{}", keep_alive))
        else:
            transport.write(_error("404 Not Found", f"no route {method.decode()} {path.decode(errors='replace')}", keep_alive))

    def _complete(self, transport: asyncio.Transport, chat: bool, raw: bytes, keep_alive: bool) -> None:
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
        if not isinstance(body, dict):
            transport.write(_error("400 Bad Request", "the body is not a JSON object", keep_alive))
            return
        try:
            tokens = max(1, int(body.get("max_tokens") or body.get("max_completion_tokens") or 16))
        except (TypeError, ValueError):
            transport.write(_error("400 Bad Request", "max_tokens is not an integer", keep_alive))
            return
        requested = body.get("model")
        model = requested if isinstance(requested, str) else self.canned.name
        prompt = _prompt_tokens(body)
        if not body.get("stream"):
            transport.write(_whole("200 OK", self.canned.answer(chat, tokens, model, prompt), keep_alive))
            return
        parts = [_head("200 OK", "text/event-stream", None, keep_alive), *self.canned.stream(chat, tokens, model)]
        options = body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            parts.append(self.canned.usage_event(chat, model, prompt, tokens))
        parts.append(DONE)
        if not self.paced:
            transport.writelines(parts)  # each event its own HTTP chunk, all in one system call
            return
        parts.reverse()
        self.stream = parts
        self._next_event()

    def _next_event(self) -> None:
        """A paced stream: one event written per turn of the loop (other connections' turns between)."""
        transport = self.transport
        if transport is None or transport.is_closing() or not self.stream:
            self.stream = []
            return
        transport.write(self.stream.pop())
        if self.stream:
            asyncio.get_running_loop().call_soon(self._next_event)
        elif self.close_after:
            transport.close()
        else:
            self._answer_queued()


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
