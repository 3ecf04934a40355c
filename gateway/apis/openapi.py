"""GET /openapi.json: the API described from the route table and the pydantic models that validate it."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.routing import compile_path

from gateway.apis.messages import messages_wire as a
from gateway.errors import Dialect
from gateway.protocol import openai as p
from gateway.web.table import Endpoint

ERROR_STATUSES = {"400": "Invalid request", "401": "Invalid API key", "404": "Unknown model or path",
                  "413": "Body too large", "429": "Rate limited or overloaded", "500": "Server error",
                  "503": "Unavailable or shutting down"}


ERROR_MODELS: dict[Dialect, type[BaseModel]] = {"openai": p.ErrorResponse, "anthropic": a.AnthropicErrorResponse}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _schemas(endpoints: Sequence[Endpoint]) -> dict[str, Any]:
    models = {m for e in endpoints for m in (e.request, e.response) if m is not None}
    models |= {p.ChatCompletionChunk, *ERROR_MODELS.values()}
    _, schemas = models_json_schema(
        [(m, "validation") for m in sorted(models, key=lambda m: m.__name__)],
        ref_template="#/components/schemas/{model}",
    )
    return dict(schemas.get("$defs", {}))


_UPLOAD = {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file", "purpose"],
    "properties": {
        "file": {"type": "string", "format": "binary", "description": "JSONL: one batch request a line"},
        "purpose": {"type": "string", "enum": ["batch"]},
        "expires_after[anchor]": {"type": "string", "enum": ["created_at"]},
        "expires_after[seconds]": {"type": "integer", "minimum": 3600, "maximum": 2592000},
    },
}}}


def _body(endpoint: Endpoint) -> dict[str, Any]:
    if endpoint.upload:
        return {"requestBody": {"required": True, "content": _UPLOAD}}
    if endpoint.request is None:
        return {}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": _ref(endpoint.request)}}}}


def _operation(endpoint: Endpoint) -> dict[str, Any]:
    if endpoint.response is None:  # ops, admin and this document: no schema of their own (text, or none)
        return {"summary": endpoint.summary, "responses": {"200": {"description": "OK"}}, **_body(endpoint)}
    content: dict[str, Any] = {"application/json": {"schema": _ref(endpoint.response)}}
    if endpoint.streams:
        content["text/event-stream"] = {"schema": {"type": "string"}, "description": "with stream: true"}
    errors = {"application/json": {"schema": _ref(ERROR_MODELS[endpoint.dialect])}}
    operation: dict[str, Any] = {
        "summary": endpoint.summary,
        "responses": {
            "200": {"description": "OK", "content": content},
            **{code: {"description": text, "content": errors} for code, text in ERROR_STATUSES.items()},
        },
    }
    parameters = [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
                  for name in compile_path(endpoint.path)[2]]
    if parameters:
        operation["parameters"] = parameters
    return {**operation, **_body(endpoint)}


@cache
def document(endpoints: tuple[Endpoint, ...]) -> dict[str, Any]:
    paths: dict[str, Any] = {}
    for endpoint in endpoints:
        paths.setdefault(endpoint.template, {})[endpoint.method.lower()] = _operation(endpoint)
    return {
        "openapi": "3.1.0",
        "info": {"title": "llm-gateway", "version": "0.1.0", "description": "OpenAI-compatible LLM gateway"},
        "paths": paths,
        "components": {"schemas": _schemas(endpoints)},
    }
