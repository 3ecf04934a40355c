"""The request context: one `RequestRecord` per request, filled in as the request goes, which the access line and the
request metrics report at its end.

A contextvar, so that every layer reaches the record of the request it serves without passing it down; the access-log
middleware opens it (`open_record`) and reports it."""

from __future__ import annotations

from contextvars import ContextVar, Token
from dataclasses import dataclass, field, fields

from gateway.telemetry.tracing import RequestTrace


@dataclass(slots=True)
class RequestRecord:
    """What one request's access line and metrics report."""

    model: str | None = None
    version: str | None = None  # the model (version) that answered, when routing chose one
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    ttft_s: float | None = None
    cache: str | None = None
    failover: list[str] | None = None  # a stream's switches of model past its first byte, as "from>to"
    api_key_id: str | None = None
    disconnected: bool = False
    status: int | None = None  # the response's status, once it has started (set by the access log)
    arrival: float | None = None  # perf_counter() when the request arrived
    log_content: bool = False  # put prompts and outputs in the access line (a setting; off by default)
    guards: list[str] | None = None  # guard actions taken, as "stage:guard:action" (never the matched text)
    guard_matches: list[str] | None = None  # the matched text, only when log_content is on
    prompt: str | None = None
    output: list[str] | None = None
    response_headers: dict[str, str] = field(default_factory=dict)  # added to the response
    trace: RequestTrace | None = None  # the request's trace, when tracing is on (its ids go in the access line)

    def as_fields(self) -> dict[str, object]:
        """The fields that are set, for the access line (a shallow read: no copy of the record)."""
        logged = {name: value for name in _LOGGED if (value := getattr(self, name)) is not None
                  and value is not False and value != []}
        if self.ttft_s is not None:
            logged["ttft_s"] = round(self.ttft_s, 4)
        if self.trace is not None:
            logged.update(self.trace.ids())
        return logged


_LOGGED = tuple(f.name for f in fields(RequestRecord)
                if f.name not in ("arrival", "log_content", "response_headers", "status", "trace"))


_record: ContextVar[RequestRecord | None] = ContextVar("gateway_request_record", default=None)


def current_record() -> RequestRecord:
    """This request's record (a throwaway one outside a request, e.g. in warm-up)."""
    return _record.get() or RequestRecord()


def current_trace() -> RequestTrace | None:
    """This request's trace, when tracing is on: what the layers below the pipeline read of the record."""
    record = _record.get()
    return record.trace if record is not None else None


def open_record(record: RequestRecord) -> Token[RequestRecord | None]:
    """Make `record` the current one, until `close_record` with what this returned (in a `finally`)."""
    return _record.set(record)


def close_record(opened: Token[RequestRecord | None]) -> None:
    """The record before `open_record` the current one again."""
    _record.reset(opened)
