"""A small OpenAI-compatible upstream for tests: a real Starlette app under uvicorn on loopback, in
a thread of the test process.

`/v1/moderations`: text with a word of FLAGGED is flagged (as violence), "broken" answers 500,
"slow" answers after SLOW_S seconds (past the guards' timeout in the tests).
`/v1/chat/completions`: answers with the last message's content, as a remote model would.
"""

from __future__ import annotations

import asyncio
import contextlib

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tests.served import running

FLAGGED = ("kill", "murder")
SLOW_S = 2.0


class LoopbackServer:
    def __init__(self) -> None:
        self.inputs: list[str] = []  # what moderation was asked about
        self.chats: list[dict] = []  # the chat requests received
        self.port = 0  # known once started
        app = Starlette(routes=[Route("/v1/moderations", self._moderate, methods=["POST"]),
                                Route("/v1/chat/completions", self._chat, methods=["POST"])])
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self._running = contextlib.ExitStack()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def _moderate(self, request: Request) -> JSONResponse:
        text = (await request.json())["input"]
        self.inputs.append(text)
        if "broken" in text:
            return JSONResponse({"error": {"message": "down"}}, status_code=500)
        if "slow" in text:
            await asyncio.sleep(SLOW_S)
        flagged = any(word in text.lower() for word in FLAGGED)
        result = {"flagged": flagged, "categories": {"violence": flagged, "hate": False},
                  "category_scores": {"violence": 0.9 if flagged else 0.01, "hate": 0.0}}
        return JSONResponse({"id": "modr-test", "model": "test-moderation", "results": [result]})

    async def _chat(self, request: Request) -> JSONResponse:
        body = await request.json()
        self.chats.append(body)
        message = {"role": "assistant", "content": body["messages"][-1]["content"]}
        return JSONResponse({"id": "chatcmpl-echo", "object": "chat.completion", "created": 0, "model": body["model"],
                             "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                             "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    def start(self) -> LoopbackServer:
        self.port = self._running.enter_context(running(self._server))
        return self

    def stop(self) -> None:
        self._running.close()
