"""The ASGI app: Starlette's app with the route table's router innermost (`TableRouter`), the
middleware stack the app factory hands over, and the one exception handler (`error_response`).
Paths are matched exactly: no slash redirects (a redirect would echo the client's Host header)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import structlog
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.errors import ServerErrorMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp

from engine.errors import EngineError
from gateway.api.errors import dialect_of, from_exception, render
from gateway.api.routes import TABLE
from gateway.api.table import TableRouter
from gateway.errors import APIError

log = structlog.get_logger(__name__)
Lifespan = Callable[[Any], AbstractAsyncContextManager[Any]]

# the errors `error_response` answers; unknown errors go up to the access log, which answers them
# within the request's log context (Starlette's own outermost handler would answer without
# X-Request-ID and raise on, resetting the connection)
HANDLED = (APIError, ValidationError, EngineError, HTTPException)


async def error_response(request: Request, exc: Exception) -> Response:
    """Every exception a handler raises, answered as its API error (`gateway.errors`)."""
    error = from_exception(exc)
    if error.status == 499:
        log.info("client_disconnected")
    elif error.status >= 500:
        # a traceback (without locals: gateway.telemetry.logs) for the server's own failures, not for refusals
        log.error("request_failed", status=error.status, error=error.message, exc_info=exc if error.status == 500 else None)
    status, headers, body = render(error, dialect_of(request.scope))
    response = Response(body, status_code=status)
    response.raw_headers = [*response.raw_headers, *headers]
    return response


class Gateway(Starlette):
    """Starlette's app with the route table's router innermost: Starlette's stack is its
    outermost error middleware, the app's middleware, its exception middleware and its router; here
    the last two are one `TableRouter` (the same answers, two layers and a regex scan fewer per
    request). Lifespan goes to Starlette's router, as before. Starlette's own exception handlers
    and body limit have no place in this stack: given, they are refused rather than ignored."""

    def build_middleware_stack(self) -> ASGIApp:
        if self.exception_handlers or getattr(self, "max_body_size", None) is not None:
            raise ValueError("errors are answered by error_response (HANDLED) and bodies bounded by our middleware")
        app: ASGIApp = TableRouter(self.router.routes, self.router, HANDLED, error_response)
        for cls, args, kwargs in reversed(self.user_middleware):
            app = cls(app, *args, **kwargs)
        return ServerErrorMiddleware(app, debug=self.debug)


def application(middleware: list[Middleware], lifespan: Lifespan) -> Gateway:
    app = Gateway(routes=TABLE.routes(), middleware=middleware, lifespan=lifespan)
    app.router.redirect_slashes = False
    return app
