"""HTTP handlers: parse and validate, pick the model, hand over to chat or completions, encode.

Everything that can refuse a request happens before a response starts, so a 4xx is a real status.
"""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway import chat, completions, metrics
from gateway.disconnect import unless_disconnected
from gateway.errors import InvalidRequest, PayloadTooLarge, ServiceUnavailable
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.sse import EventStreamResponse, primed
from gateway.state import GatewayState

M = TypeVar("M", bound=BaseModel)


def state_of(request: Request) -> GatewayState:
    return request.state.gateway


def json_response(model: BaseModel, status: int = 200) -> Response:
    body = model.__pydantic_serializer__.to_json(model, exclude_none=True)
    return Response(body, status_code=status, media_type="application/json")


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


def check_open(state: GatewayState) -> None:
    if state.draining:
        raise ServiceUnavailable("The server is shutting down")


async def chat_completions(request: Request) -> Response:
    state = state_of(request)
    check_open(state)
    body = await parse(request, ChatCompletionRequest)
    engine = state.models.get(body.model)
    prepared = chat.prepare(body, engine, state.settings.default_max_tokens)
    if body.stream:
        events = await unless_disconnected(request.receive, primed(chat.stream(prepared)))
        return EventStreamResponse(events)  # type: ignore[return-value]
    result = await unless_disconnected(request.receive, chat.complete(prepared))
    return json_response(result)


async def text_completions(request: Request) -> Response:
    state = state_of(request)
    check_open(state)
    body = await parse(request, CompletionRequest)
    engine = state.models.get(body.model)
    prepared = completions.prepare(body, engine, state.settings.default_max_tokens)
    if body.stream:
        events = await unless_disconnected(request.receive, primed(completions.stream(prepared)))
        return EventStreamResponse(events)  # type: ignore[return-value]
    result = await unless_disconnected(request.receive, completions.complete(prepared))
    return json_response(result)


async def list_models(request: Request) -> Response:
    return json_response(state_of(request).models.listing())


async def prometheus(request: Request) -> Response:
    body, content_type = metrics.exposition()
    return Response(body, media_type=content_type)


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


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
    ]
