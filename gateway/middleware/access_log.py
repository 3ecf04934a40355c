"""Access log (pure ASGI, the outermost layer): the request's id (the client's `X-Request-ID`, or a new one) bound to
every log line and returned, the request's context (`pipeline.context`) made for the layers below, the headers they
asked for added, and one access line and the request metrics at the end. Also the last catch of errors: what no layer
below answered becomes a 500 in the API's error shape here, never raised on to the server (which would reset the
keep-alive connection). Not `BaseHTTPMiddleware`, which would lose the contextvars structlog binds the id in."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable

import structlog
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import Dialect
from gateway.pipeline.context import SCOPE_KEY, RequestContext
from gateway.telemetry import metrics
from gateway.telemetry.logs import access_logger
from gateway.telemetry.record import RequestRecord, close_record, open_record
from gateway.web.error_render import dialect_of, from_exception, send_error

log = structlog.get_logger(__name__)
REQUEST_ID_MAX = 200
PATH_LOGGED = 1024  # longer paths are cut in the access line: one request, one bounded line

RouteLabel = Callable[[str], str]  # a path → its route's label (the route table's), "unmatched" else
DialectOf = Callable[[str], Dialect]  # a path → its route's error dialect (the route table's)


def request_id_from(scope: Scope) -> str:
    """The client's X-Request-ID when it is 1 to `REQUEST_ID_MAX` visible ASCII characters, else a new one."""
    for key, value in scope.get("headers", ()):
        if key == b"x-request-id":
            if 0 < len(value) <= REQUEST_ID_MAX and all(0x21 <= byte <= 0x7E for byte in value):
                return str(value.decode("ascii"))
            break
    return os.urandom(16).hex()  # secrets.token_hex(16) (uuid4's 32 hex digits), two calls fewer


class AccessLogMiddleware:
    def __init__(
        self, app: ASGIApp, route_label: RouteLabel, log_content: bool = False, dialect: DialectOf | None = None
    ) -> None:
        self.app = app
        self.route_label = route_label
        self.log_content = log_content
        self.dialect = dialect

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_from(scope)
        started = time.perf_counter()
        record = RequestRecord(arrival=started, log_content=self.log_content)
        dialect = "openai" if self.dialect is None else self.dialect(scope["path"])
        scope[SCOPE_KEY] = RequestContext(request_id, dialect, record)
        first_byte: float | None = None

        async def send_with_id(message: Message) -> None:
            nonlocal first_byte
            if message["type"] == "http.response.start":
                record.status = message["status"]  # also for the layers below that count by status (auth)
                extra = [(k.encode(), v.encode()) for k, v in record.response_headers.items()]
                message["headers"] = [*message.get("headers", []), *extra, (b"x-request-id", request_id.encode())]
            elif first_byte is None and message["type"] == "http.response.body":
                first_byte = time.perf_counter() - started
            await send(message)

        # without two context managers: `bound_contextvars` reads the whole context on the way in
        bound = structlog.contextvars.bind_contextvars(request_id=request_id)
        opened = open_record(record)
        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:  # what no layer below answered: a 500, never raised on
            log.error("request_failed", error_type=type(exc).__name__, exc_info=exc)
            if record.status is None:  # no response started
                with contextlib.suppress(OSError):  # the client may be gone too
                    await send_error(send_with_id, from_exception(exc), dialect=dialect_of(scope))
        finally:
            try:
                duration = time.perf_counter() - started
                status = record.status or 500
                observe_request(record, self.route_label(scope["path"]), status, duration)
                access_logger().info(
                    "request",
                    method=scope["method"],
                    path=_bounded(scope["path"]),
                    status=status,
                    duration_s=round(duration, 4),
                    first_byte_s=round(first_byte, 4) if first_byte is not None else None,
                    **record.as_fields(),
                )
            finally:
                close_record(opened)
                structlog.contextvars.reset_contextvars(**bound)


def _bounded(path: str) -> str:
    """A path as the access line logs it: at most `PATH_LOGGED` characters (a client chooses it)."""
    return path if len(path) <= PATH_LOGGED else path[:PATH_LOGGED] + "..."


def observe_request(record: RequestRecord, route: str, status: int, duration: float) -> None:
    model = record.version or record.model or ""
    metrics.labelled(metrics.REQUESTS, model, route, str(status)).inc()
    if route not in ("/metrics", "/metrics/router"):  # scrapes, not requests to time
        metrics.labelled(metrics.REQUEST_DURATION, model, route).observe(duration)
    if record.disconnected:
        metrics.labelled(metrics.DISCONNECTS, model).inc()
