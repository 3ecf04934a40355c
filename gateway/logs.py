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
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field

import structlog
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway import metrics

access = structlog.get_logger("gateway.access")

ROUTES = frozenset(
    ["/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize", "/detokenize", "/generate",
     "/stream-generate", "/health", "/ready", "/metrics", "/openapi.json"]
)


@dataclass(slots=True)
class RequestRecord:
    """What one request's access line and metrics report; filled in as the request goes."""

    model: str | None = None
    version: str | None = None  # the model (version) that answered, when routing chose one
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    ttft_s: float | None = None
    cache: str | None = None
    api_key_id: str | None = None
    disconnected: bool = False
    arrival: float | None = None  # perf_counter() when the request arrived
    log_content: bool = False  # put prompts and outputs in the access line (a setting; off by default)
    prompt: str | None = None
    output: list[str] | None = None
    response_headers: dict[str, str] = field(default_factory=dict)  # added to the response

    def as_fields(self) -> dict[str, object]:
        fields = {k: v for k, v in asdict(self).items() if v is not None and v is not False}
        fields.pop("arrival", None)
        fields.pop("log_content", None)
        fields.pop("response_headers", None)
        if self.ttft_s is not None:
            fields["ttft_s"] = round(self.ttft_s, 4)
        return fields


_record: ContextVar[RequestRecord | None] = ContextVar("gateway_request_record", default=None)


def current_record() -> RequestRecord:
    """This request's record (a throwaway one outside a request, e.g. in warm-up)."""
    return _record.get() or RequestRecord()


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

    def __init__(self, app: ASGIApp, log_content: bool = False) -> None:
        self.app = app
        self.log_content = log_content

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_from(scope)
        scope.setdefault("state", {})["request_id"] = request_id
        started = time.perf_counter()
        record = RequestRecord(arrival=started, log_content=self.log_content)
        token = _record.set(record)
        status = 500
        first_byte: float | None = None

        async def send_with_id(message: Message) -> None:
            nonlocal status, first_byte
            if message["type"] == "http.response.start":
                status = message["status"]
                extra = [(k.encode(), v.encode()) for k, v in record.response_headers.items()]
                message["headers"] = [*message.get("headers", []), *extra, (b"x-request-id", request_id.encode())]
            elif first_byte is None and message["type"] == "http.response.body":
                first_byte = time.perf_counter() - started
            await send(message)

        with structlog.contextvars.bound_contextvars(request_id=request_id):
            try:
                await self.app(scope, receive, send_with_id)
            finally:
                _record.reset(token)
                duration = time.perf_counter() - started
                route = scope["path"] if scope["path"] in ROUTES else "unmatched"
                observe_request(record, route, status, duration)
                access.info(
                    "request",
                    method=scope["method"],
                    path=scope["path"],
                    status=status,
                    duration_s=round(duration, 4),
                    first_byte_s=round(first_byte, 4) if first_byte is not None else None,
                    **record.as_fields(),
                )


def observe_request(record: RequestRecord, route: str, status: int, duration: float) -> None:
    model = record.version or record.model or ""
    metrics.REQUESTS.labels(model, route, str(status)).inc()
    if route != "/metrics":
        metrics.REQUEST_DURATION.labels(model, route).observe(duration)
    if record.disconnected:
        metrics.DISCONNECTS.labels(model).inc()
