"""HTTP handlers: parse and validate, pick the model, hand over to chat or completions, encode.

Everything that can refuse a request happens before a response starts, so a 4xx is a real status.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway import metrics
from gateway.dispatch import CHAT, COMPLETIONS, dispatch, json_response
from gateway.errors import InvalidRequest, PayloadTooLarge
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.state import GatewayState

M = TypeVar("M", bound=BaseModel)


def state_of(request: Request) -> GatewayState:
    return request.state.gateway


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"Request body of {declared} bytes exceeds the limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"Request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def parse(request: Request, model: type[M]) -> M:
    body = await read_body(request, state_of(request).settings.max_body_bytes)
    request.state.body_bytes = len(body)  # large bodies are prepared off the event loop (offload)
    if not body.strip():
        raise InvalidRequest("The request body is empty; send a JSON object")
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        kind = exc.errors()[0]["type"]
        if kind == "json_invalid":
            raise InvalidRequest("We could not parse the JSON body of your request: it is not valid JSON") from exc
        if kind == "model_type":
            raise InvalidRequest("The request body must be a JSON object") from exc
        raise


async def chat_completions(request: Request) -> Response:
    body = await parse(request, ChatCompletionRequest)
    return await dispatch(request, state_of(request), body, CHAT)


async def text_completions(request: Request) -> Response:
    body = await parse(request, CompletionRequest)
    return await dispatch(request, state_of(request), body, COMPLETIONS)


async def list_models(request: Request) -> Response:
    return json_response(state_of(request).models.listing())


async def prometheus(request: Request) -> Response:
    body, content_type = metrics.exposition()
    return Response(body, media_type=content_type)


async def _failure(check: Awaitable[None]) -> str | None:
    """What is wrong with a model by its health check (None: healthy), waiting 5 s at most."""
    try:
        await asyncio.wait_for(check, timeout=5)
    except Exception as exc:  # any failure of a health check
        return str(exc)
    return None


async def health(request: Request) -> Response:
    """Liveness: 200 while every embedded engine is alive. A dead engine (its engine core process
    gone) never comes back in this process, so 503 here lets the orchestrator restart us
    (Kubernetes' livenessProbe); remote upstreams are not checked, restarting us cures nothing there."""
    dead = {}
    for name, engine in state_of(request).models.engines():
        if (failure := await _failure(engine.check_health())) is not None:
            dead[name] = f"dead: {failure}"
    if dead:
        return JSONResponse({"status": "dead", "models": dead}, status_code=503)
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    """Every model loaded and healthy: 200; otherwise (or while draining) 503, per model."""
    state = state_of(request)
    models = {}
    for name, backend in state.models.backends.items():
        failure = await _failure(backend.check_health())
        models[name] = "ready" if failure is None else f"unavailable: {failure}"
    ok = all(status == "ready" for status in models.values()) and not state.lifecycle.draining
    status = "ready" if ok else ("draining" if state.lifecycle.draining else "unavailable")
    return JSONResponse({"status": status, "models": models}, status_code=200 if ok else 503)


async def openapi(request: Request) -> Response:
    from gateway.openapi import document

    return JSONResponse(document())


def all_routes() -> list[Route]:
    from gateway import native

    return [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", text_completions, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/tokenize", native.tokenize, methods=["POST"]),
        Route("/detokenize", native.detokenize, methods=["POST"]),
        Route("/generate", native.generate, methods=["POST"]),
        Route("/stream-generate", native.stream_generate, methods=["POST"]),
        Route("/openapi.json", openapi, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
    ]
