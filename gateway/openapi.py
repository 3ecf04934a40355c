"""GET /openapi.json: the API described from the same pydantic models that validate it."""

from __future__ import annotations

from functools import cache
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from gateway import protocol as p

# (method, path, request model or None, response model, streams, summary)
OPERATIONS: list[tuple[str, str, type[BaseModel] | None, type[BaseModel], bool, str]] = [
    ("post", "/v1/chat/completions", p.ChatCompletionRequest, p.ChatCompletion, True, "Create a chat completion"),
    ("post", "/v1/completions", p.CompletionRequest, p.Completion, True, "Create a completion"),
    ("get", "/v1/models", None, p.ModelList, False, "List the served models"),
    ("post", "/tokenize", p.TokenizeRequest, p.TokenizeResponse, False, "Tokenize a prompt or chat messages"),
    ("post", "/detokenize", p.DetokenizeRequest, p.DetokenizeResponse, False, "Turn token ids into text"),
    ("post", "/generate", p.GenerateRequest, p.GenerateResponse, False, "Native API: generate text"),
    ("post", "/stream-generate", p.GenerateRequest, p.GenerateResponse, True, "Native API: stream text (SSE)"),
]
ERROR_STATUSES = {"400": "Invalid request", "401": "Invalid API key", "404": "Unknown model or path",
                  "413": "Body too large", "429": "Rate limited or overloaded", "500": "Server error",
                  "503": "Unavailable or shutting down"}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


@cache
def document() -> dict[str, Any]:
    models = {m for _, _, req, res, _, _ in OPERATIONS for m in (req, res) if m is not None}
    models |= {p.ChatCompletionChunk, p.ErrorResponse}
    _, schemas = models_json_schema(
        [(m, "validation") for m in sorted(models, key=lambda m: m.__name__)],
        ref_template="#/components/schemas/{model}",
    )
    paths: dict[str, Any] = {}
    for method, path, request, response, streams, summary in OPERATIONS:
        content: dict[str, Any] = {"application/json": {"schema": _ref(response)}}
        if streams:
            content["text/event-stream"] = {"schema": {"type": "string"}, "description": "with stream: true"}
        operation: dict[str, Any] = {
            "summary": summary,
            "responses": {
                "200": {"description": "OK", "content": content},
                **{code: {"description": text, "content": {"application/json": {"schema": _ref(p.ErrorResponse)}}}
                   for code, text in ERROR_STATUSES.items()},
            },
        }
        if request is not None:
            operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": _ref(request)}}}
        paths.setdefault(path, {})[method] = operation
    paths["/health"] = {"get": {"summary": "Liveness", "responses": {"200": {"description": "alive"}}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "llm-gateway", "version": "0.1.0", "description": "OpenAI-compatible LLM gateway"},
        "paths": paths,
        "components": {"schemas": schemas.get("$defs", {})},
    }
