"""A server span per request, continuing the caller's `traceparent`, current while the layers below run and
ended once the response is sent or the stream ended however it ended."""

from __future__ import annotations

import asyncio

import structlog
from opentelemetry import context as otel_context
from opentelemetry.trace import SpanKind, set_span_in_context
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.middleware.access_log import RouteLabel
from gateway.pipeline.context import context_of
from gateway.telemetry.tracing import RequestTrace, Tracing, continued


class TracingMiddleware:
    def __init__(self, app: ASGIApp, tracing: Tracing, route_label: RouteLabel, log_content: bool = False) -> None:
        self.app = app
        self.tracer = tracing.tracer
        self.route_label = route_label
        self.log_content = log_content

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        parent = continued(scope.get("headers", ()))
        route, method = self.route_label(scope["path"]), scope["method"]
        attributes = {"http.request.method": method, "http.route": route, "url.path": scope["path"]}
        span = self.tracer.start_span(f"{method} {route}", parent, SpanKind.SERVER, attributes)
        record = context_of(scope).record
        trace = record.trace = RequestTrace(self.tracer, span, self.log_content)
        ids = trace.ids()
        attached = otel_context.attach(set_span_in_context(span, parent))
        bound = structlog.contextvars.bind_contextvars(**ids)  # every log line of the request carries them
        try:
            await self.app(scope, receive, send)
        except asyncio.CancelledError:
            raise  # the server cancelled the request (its client gone): not an error of ours
        except Exception as exc:  # answered 500 by the access log above
            trace.failed(type(exc).__qualname__, exc)
            raise
        finally:
            trace.end(record)
            otel_context.detach(attached)
            structlog.contextvars.reset_contextvars(**bound)
