"""Errors as HTTP answers, the one place: Starlette's own exceptions mapped onto the error tree, and an error rendered
in the route's dialect for the exception handler and pure ASGI middleware alike."""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from typing import Any

import orjson
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Send

from gateway import errors
from gateway.errors import APIError, ClientDisconnected, Dialect, MethodNotAllowed, no_route
from gateway.pipeline.context import SCOPE_KEY, RequestContext


def dialect_of(scope: MutableMapping[str, Any]) -> Dialect:
    context = scope.get(SCOPE_KEY)
    return context.dialect if isinstance(context, RequestContext) else "openai"


def from_exception(exc: BaseException) -> APIError:
    if isinstance(exc, ClientDisconnect):  # gone while its body was read
        return ClientDisconnected()
    if not isinstance(exc, HTTPException):
        return errors.from_exception(exc)
    headers = dict(exc.headers or {})
    if exc.status_code == 404:
        return no_route(headers)
    if exc.status_code == 405:
        allowed = headers.get("Allow", "")
        return MethodNotAllowed(f"Method not allowed here; allowed: {allowed}", headers=headers)
    error = APIError(exc.detail, headers=headers)
    error.status = exc.status_code
    error.type = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return error


def render(error: APIError, dialect: Dialect = "openai") -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    headers = [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    if isinstance(error, ClientDisconnected):
        return error.status, headers, b""
    return error.status, [(b"content-type", b"application/json"), *headers], orjson.dumps(error.body(dialect))


async def send_error(
    send: Send, error: APIError, extra_headers: Sequence[tuple[bytes, bytes]] = (), dialect: Dialect = "openai"
) -> None:
    """Answer with an API error from pure ASGI code, with its length: sent chunked, an HTTP/1.0 client could not read
    it."""
    status, headers, body = render(error, dialect)
    length = (b"content-length", str(len(body)).encode())
    await send({"type": "http.response.start", "status": status, "headers": [*headers, length, *extra_headers]})
    await send({"type": "http.response.body", "body": body})
