"""The stack's limit: a bare Starlette + uvicorn app answering every completion at once (the race's
`bare` target): it parses the JSON body and answers `max_tokens` words, plain or streamed, with no
validation, middleware, logs or metrics. `python -m benchmarks.bare_app --port 8200`
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from benchmarks.instant_endpoint import chunk, completion

NAME = "bare"
_ids = itertools.count()


def _usage(body: dict[str, Any], tokens: int) -> dict[str, int]:
    prompt_tokens = len(str(body.get("prompt") or body.get("messages") or "").split())
    return {"prompt_tokens": prompt_tokens, "completion_tokens": tokens, "total_tokens": prompt_tokens + tokens}


async def _chunks(body: dict[str, Any], chat: bool, tokens: int) -> AsyncIterator[bytes]:
    """One SSE event per token, encoded per chunk as a server does, then usage and [DONE]."""
    model, ids = body.get("model") or NAME, {"id": f"bare-{next(_ids)}", "created": int(time.time())}
    for step in range(tokens):
        yield b"data: " + orjson.dumps(chunk(chat, model, step, tokens, **ids)) + b"\n\n"
    if (body.get("stream_options") or {}).get("include_usage"):
        yield b"data: " + orjson.dumps({**chunk(chat, model, None, tokens, **ids), "usage": _usage(body, tokens)}) + b"\n\n"
    yield b"data: [DONE]\n\n"


def _completion_route(chat: bool) -> Any:
    async def endpoint(request: Request) -> Response:
        body = orjson.loads(await request.body())
        tokens = max(1, int(body.get("max_tokens") or body.get("max_completion_tokens") or 16))
        if body.get("stream"):
            return StreamingResponse(_chunks(body, chat, tokens), media_type="text/event-stream")
        answer = completion(chat, tokens, body.get("model") or NAME, _usage(body, tokens), f"bare-{next(_ids)}", int(time.time()))
        return Response(orjson.dumps(answer), media_type="application/json")

    return endpoint


def create_bare_app(name: str = NAME) -> Starlette:
    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": name, "object": "model", "owned_by": "bench"}]})

    async def health(request: Request) -> Response:
        return Response(b"{}", media_type="application/json")

    return Starlette(routes=[
        Route("/v1/completions", _completion_route(chat=False), methods=["POST"]),
        Route("/v1/chat/completions", _completion_route(chat=True), methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="A bare Starlette + uvicorn completion endpoint (the stack's limit)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8200)
    p.add_argument("--name", default=NAME, help="served model name")
    args = p.parse_args(argv)

    import uvicorn

    # the gateway's uvicorn settings (gateway/cli.py: defaults, so uvloop and httptools), no logs
    uvicorn.run(create_bare_app(args.name), host=args.host, port=args.port, log_config=None, access_log=False,
                log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
