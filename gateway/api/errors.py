"""Errors as HTTP answers, the one place: Starlette's own exceptions (a 404 or 405 of the router, a
client gone while its body was read) mapped onto the error tree (`gateway.errors`), and an error
rendered as status, headers and body in the route's dialect, for the app's exception handler and
the pure ASGI middleware alike."""

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
    """The error dialect of the request's route (in its context, put there by the access log)."""
    context = scope.get(SCOPE_KEY)
    return context.dialect if isinstance(context, RequestContext) else "openai"


def from_exception(exc: BaseException) -> APIError:
    """Any exception as the API error the client sees (`gateway.errors.from_exception`), Starlette's too."""
    if isinstance(exc, HTTPException):
        return _http_exception(exc)
    if isinstance(exc, ClientDisconnect):  # gone while its body was read
        return ClientDisconnected()
    return errors.from_exception(exc)


def _http_exception(exc: HTTPException) -> APIError:
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
    """The error as an HTTP answer: status, headers, body (none for a client that is gone)."""
    headers = [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    if isinstance(error, ClientDisconnected):
        return error.status, headers, b""
    return error.status, [(b"content-type", b"application/json"), *headers], orjson.dumps(error.body(dialect))


async def send_error(
    send: Send, error: APIError, extra_headers: Sequence[tuple[bytes, bytes]] = (), dialect: Dialect = "openai"
) -> None:
    """Answer with an API error from pure ASGI code (middleware that runs before the router). With
    its length: without one the server sends it chunked, which an HTTP/1.0 client cannot read."""
    status, headers, body = render(error, dialect)
    length = (b"content-length", str(len(body)).encode())
    await send({"type": "http.response.start", "status": status, "headers": [*headers, length, *extra_headers]})
    await send({"type": "http.response.body", "body": body})
