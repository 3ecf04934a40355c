"""The stack's limit (the race's `bare` target): Starlette + uvicorn parsing the JSON body and
answering `max_tokens` words, plain or streamed (one event per token, encoded per chunk as a server
does), with no validation, middleware, logs or metrics. `python -m benchmarks.bare_app --port 8200`"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from benchmarks.instant_endpoint import chunk, completion, max_tokens, usage

NAME = "bare"
_ids = itertools.count()


async def _events(body: dict[str, Any], chat: bool, tokens: int, model: str, id: str, created: int) -> AsyncIterator[bytes]:
    for step in range(tokens):
        yield b"data: " + orjson.dumps(chunk(chat, model, step, tokens, id, created)) + b"\n\n"
    if (body.get("stream_options") or {}).get("include_usage"):
        yield b"data: " + orjson.dumps({**chunk(chat, model, None, tokens, id, created), "usage": usage(body, tokens)}) + b"\n\n"
    yield b"data: [DONE]\n\n"


def _completions(chat: bool) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        body = orjson.loads(await request.body())
        tokens, model, id, created = max_tokens(body), body.get("model") or NAME, f"bare-{next(_ids)}", int(time.time())
        if body.get("stream"):
            return StreamingResponse(_events(body, chat, tokens, model, id, created), media_type="text/event-stream")
        answer = completion(chat, tokens, model, usage(body, tokens), id, created)
        return Response(orjson.dumps(answer), media_type="application/json")

    return endpoint


def create_bare_app(name: str = NAME) -> Starlette:
    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": name, "object": "model", "owned_by": "bench"}]})

    async def health(request: Request) -> Response:
        return Response(b"{}", media_type="application/json")

    return Starlette(routes=[Route("/v1/completions", _completions(chat=False), methods=["POST"]),
                             Route("/v1/chat/completions", _completions(chat=True), methods=["POST"]),
                             Route("/v1/models", models, methods=["GET"]), Route("/health", health, methods=["GET"])])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="A bare Starlette + uvicorn completion endpoint (the stack's limit)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8200)
    p.add_argument("--name", default=NAME, help="served model name")
    args = p.parse_args(argv)
    import uvicorn

    # the gateway's uvicorn settings (defaults, so uvloop and httptools), no logs
    uvicorn.run(create_bare_app(args.name), host=args.host, port=args.port, log_config=None, access_log=False,
                log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
