"""The ASGI app: Starlette over the route table, the middleware stack and the one exception handler. Paths match
exactly: a slash redirect would echo the client's Host header."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import structlog
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response

from engine.errors import EngineError
from gateway.apis.routes import TABLE
from gateway.errors import APIError
from gateway.telemetry.record import current_trace
from gateway.web.error_render import dialect_of, from_exception, render

log = structlog.get_logger(__name__)
Lifespan = Callable[[Any], AbstractAsyncContextManager[Any]]
App = Starlette

# the errors `error_response` answers; unknown errors go up to the access log, which answers them
# within the request's log context (Starlette's own outermost handler would answer without
# X-Request-ID and raise on, resetting the connection)
HANDLED = (APIError, ValidationError, EngineError, HTTPException)


async def error_response(request: Request, exc: Exception) -> Response:
    error = from_exception(exc)
    if error.status == 499:
        log.info("client_disconnected")
    elif error.status >= 500:
        if (trace := current_trace()) is not None:
            trace.failed(error.code or error.type, exc)
        # a traceback (without locals: gateway.telemetry.logs) for the server's own failures, not for refusals
        log.error("request_failed", status=error.status, error=error.message, exc_info=exc if error.status == 500 else None)
    status, headers, body = render(error, dialect_of(request.scope))
    response = Response(body, status_code=status)
    response.raw_headers = [*response.raw_headers, *headers]
    return response


def application(middleware: list[Middleware], lifespan: Lifespan) -> App:
    app = Starlette(routes=TABLE.routes(), middleware=middleware, lifespan=lifespan,
                    exception_handlers=dict.fromkeys(HANDLED, error_response))
    app.router.redirect_slashes = False
    return app
