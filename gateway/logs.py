"""Structured logs (structlog): JSON lines in production, readable lines in development, and one
access line per request carrying its request id, which `X-Request-ID` sets or we generate.

The access log is pure ASGI middleware: `BaseHTTPMiddleware` would lose the contextvars that
structlog binds the request id in.
"""

from __future__ import annotations

import logging
import sys
import time
import uuid

import structlog
from starlette.types import ASGIApp, Message, Receive, Scope, Send

access = structlog.get_logger("gateway.access")


def configure(level: str = "info", fmt: str = "console") -> None:
    renderer = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
            foreign_pre_chain=shared,
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = name != "uvicorn.access"  # our access line replaces it


def request_id_from(scope: Scope) -> str:
    for key, value in scope.get("headers", ()):
        if key == b"x-request-id":
            text = value.decode("latin-1").strip()
            if 0 < len(text) <= 200:
                return text
    return uuid.uuid4().hex


class AccessLogMiddleware:
    """Binds the request id to every log line of the request, returns it, logs one access line."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_from(scope)
        scope.setdefault("state", {})["request_id"] = request_id
        started = time.perf_counter()
        status = 500
        first_byte: float | None = None

        async def send_with_id(message: Message) -> None:
            nonlocal status, first_byte
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            elif first_byte is None and message["type"] == "http.response.body":
                first_byte = time.perf_counter() - started
            await send(message)

        with structlog.contextvars.bound_contextvars(request_id=request_id):
            try:
                await self.app(scope, receive, send_with_id)
            finally:
                access.info(
                    "request",
                    method=scope["method"],
                    path=scope["path"],
                    status=status,
                    duration_s=round(time.perf_counter() - started, 4),
                    first_byte_s=round(first_byte, 4) if first_byte is not None else None,
                    **scope["state"].get("access", {}),
                )
