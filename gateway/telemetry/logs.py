"""Log set-up (structlog): JSON lines in production, readable lines in development, one handler for ours, uvicorn's
and the libraries' lines; and the access line's fast writer."""

from __future__ import annotations

import datetime
import json
import logging
import sys
from typing import Any

import orjson
import structlog
from structlog.tracebacks import ExceptionDictTransformer

_access: Any = structlog.get_logger("gateway.access")  # until `configure`: the plain structlog path


def access_logger() -> Any:
    """The access line's logger: rendered by the same processors but written straight to the handler's stream, without
    a `LogRecord`, caller lookup and formatter hop."""
    return _access


class _HandlerLines:
    def __init__(self, handler: logging.StreamHandler[Any]) -> None:
        self._handler = handler

    def msg(self, line: str) -> None:
        handler = self._handler
        with handler.lock:  # type: ignore[union-attr]  # a Handler creates its lock in __init__
            try:
                handler.stream.write(line + "\n")
                handler.flush()
            except (OSError, ValueError):  # as logging's handlers: a failed line never fails the request
                pass

    debug = info = warning = error = critical = exception = msg


class _JsonAccessLine:
    """The access line in JSON exactly as structlog's chain renders it (tests/unit/test_logs.py compares the two),
    built in one call: the fields in order, then `event`, the bound contextvars (never over a field), `level` and
    `timestamp`. Only the access line's calls are supported."""

    def __init__(self, lines: _HandlerLines, level: int) -> None:
        self._lines = lines
        self._enabled = level <= logging.INFO  # as structlog's filtering logger: nothing below the level

    def info(self, event: str, **fields: Any) -> None:
        if not self._enabled:
            return
        fields["event"] = event
        for key, value in structlog.contextvars.get_contextvars().items():
            fields.setdefault(key, value)
        fields["level"] = "info"
        fields["timestamp"] = datetime.datetime.now(tz=datetime.UTC).isoformat().replace("+00:00", "Z")
        self._lines.msg(_json(fields))


def renderer(fmt: str, colors: bool) -> list[Any]:
    """The last processors of a line: exception rendering (never with local variables, which hold keys and prompts,
    and a bounded frame count: an error costs a few kilobytes of log, not hundreds), then the format."""
    if fmt == "json":
        tracebacks = structlog.processors.ExceptionRenderer(ExceptionDictTransformer(show_locals=False, max_frames=50))
        return [tracebacks, structlog.processors.JSONRenderer(serializer=_json)]
    # plain text: a rich traceback (even without locals) blocks the event loop far longer than a plain one
    return [structlog.dev.ConsoleRenderer(colors=colors, exception_formatter=structlog.dev.plain_traceback)]


def _json(value: Any, **kwargs: Any) -> str:
    """orjson for the log lines; the stdlib's for what orjson refuses (integers past 64 bits, non-string keys)."""
    try:
        return orjson.dumps(value, default=str).decode()
    except TypeError:
        return json.dumps(value, default=str)


def shared_processors() -> list[Any]:
    return [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]


def configure(level: str = "info", fmt: str = "console") -> None:
    global _access
    shared = shared_processors()
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    rendering = renderer(fmt, colors=sys.stderr.isatty())
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *rendering],
            foreign_pre_chain=shared,
        )
    )
    level_number = logging.getLevelName(level.upper())
    if fmt == "json":
        _access = _JsonAccessLine(_HandlerLines(handler), level_number)
    else:
        _access = structlog.wrap_logger(
            _HandlerLines(handler), processors=[*shared, *rendering], cache_logger_on_first_use=True,
            wrapper_class=structlog.make_filtering_bound_logger(level_number),
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("httpx2", "mcp"):  # the MCP client's request lines name URLs and sessions: a failure is ours to log
        logging.getLogger(name).setLevel(max(level_number, logging.WARNING))
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = name != "uvicorn.access"  # our access line replaces it
