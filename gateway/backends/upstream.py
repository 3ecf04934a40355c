"""Remote models: any OpenAI-compatible server (another replica, vLLM's server) reached with httpx.

Requests are forwarded as validated, with `model` renamed to the upstream's name; streams pass
through event by event, unbuffered, decoded from any `Content-Encoding` the upstream chose (the
header is not passed on: the client gets plain bytes).

The upstream's failures become the gateway's own errors, mapped here once; what the upstream
said goes to the log (`upstream_failed`), never to the client or /ready:

    connection error, timeout, 408, 429, 502, 503, 504   → BackendUnavailable (503, fallible)
    401, 403 (our key refused), 404, any other status     → BadGateway (502, fallible)
    400, 413, 422 (the request's own fault)               → passed on as the upstream answered
    a failure in the middle of a stream                   → BackendUnavailable, raised from the
                                                            events (the API layer ends the stream
                                                            with one error event)

Fallible errors happen before the first byte, so the dispatcher tries the model's fallbacks.
What comes back is an `UpstreamAnswer`; the API layer makes the HTTP response of it.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import structlog
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from engine.config import SamplingDefaults
from engine.errors import EngineUnavailable
from gateway.errors import APIError, BackendUnavailable, BadGateway
from gateway.telemetry import metrics
from gateway.telemetry.record import current_record
from gateway.telemetry.tracing import headers_of

log = structlog.get_logger(__name__)
PASSED_ON = frozenset({400, 413, 422})  # the client's own mistakes: the upstream's answer explains them
UNAVAILABLE = frozenset({408, 429, 502, 503, 504})  # busy or briefly down: another model may answer
LOGGED_BYTES = 500  # of an upstream's error body, for the log


@dataclass(frozen=True, slots=True)
class UpstreamAnswer:
    """The upstream's answer: a whole body, or (a 200 stream) its SSE events, each one block of
    lines without the blank line that ends it."""

    status: int
    media_type: str
    body: bytes = b""
    events: AsyncGenerator[bytes, None] | None = None


class Upstream:
    def __init__(self, name: str, url: str, upstream_model: str, api_key: str | None,
                 timeout_s: float, connect_timeout_s: float, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.name = name
        self.upstream_model = upstream_model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(
            base_url=url.rstrip("/"),
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            transport=transport,
        )

    async def forward(
        self, path: str, body: dict[str, Any], stream: bool, on_close: Callable[[], None]
    ) -> UpstreamAnswer:
        """Forward; `on_close` runs once the answer has been passed on (or failed)."""
        payload = {**body, "model": self.upstream_model}
        request = self._client.build_request("POST", path, json=payload)
        trace = current_record().trace
        if trace is None:
            return await self._forward(request, stream, on_close)
        # the request's span, its traceparent passed on; ended when the answer has been passed on
        span = trace.start(f"POST {path}", SpanKind.CLIENT, {
            "http.request.method": "POST", "url.full": str(request.url), "server.address": request.url.host,
            "gen_ai.request.model": self.upstream_model,
        })
        request.headers.update(headers_of(span))

        def closed() -> None:
            if span.is_recording():  # not when a failure ended it already
                span.end()
            on_close()

        try:
            return await self._forward(request, stream, closed, span)
        except BaseException as exc:
            _failed_span(span, exc)
            raise

    async def _forward(
        self, request: httpx.Request, stream: bool, on_close: Callable[[], None], span: Span | None = None
    ) -> UpstreamAnswer:
        try:
            response = await self._client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise self._failed(BackendUnavailable, f"{type(exc).__name__}: {exc}") from exc
        status = response.status_code
        if span is not None:
            span.set_attribute("http.response.status_code", status)
        if status != 200 and status not in PASSED_ON:
            excerpt = await _excerpt(response)
            kind = BackendUnavailable if status in UNAVAILABLE else BadGateway
            raise self._failed(kind, f"answered {status}: {excerpt}")
        media_type = response.headers.get("content-type", "application/json")
        if not stream or status != 200:
            try:
                content = await response.aread()  # decoded: gzip and the like are undone here
            except httpx.HTTPError as exc:
                raise self._failed(BackendUnavailable, f"{type(exc).__name__}: {exc}") from exc
            finally:
                await response.aclose()
            on_close()
            return UpstreamAnswer(status, media_type, body=content)
        return UpstreamAnswer(200, media_type, events=self._events(response, on_close, span))

    def _failed(self, kind: type[APIError], why: str) -> APIError:
        metrics.labelled(metrics.UPSTREAM_ERRORS, self.name).inc()
        log.warning("upstream_failed", model=self.name, why=why)
        return kind(f"The model '{self.name}' is unavailable: its upstream server failed. Please retry later.")

    async def _events(
        self, response: httpx.Response, on_close: Callable[[], None], span: Span | None
    ) -> AsyncGenerator[bytes, None]:
        """The stream's events as they complete (an event cut by a failure is not passed on)."""
        pending = b""
        try:
            async for chunk in response.aiter_bytes():
                pending = (pending + chunk).replace(b"\r\n", b"\n")
                *complete, pending = pending.split(b"\n\n")
                for event in complete:
                    if event.strip():
                        yield event
            if pending.strip():
                yield pending
        except httpx.HTTPError as exc:
            if span is not None:
                _failed_span(span, exc)
            raise self._failed(BackendUnavailable, f"mid-stream: {type(exc).__name__}: {exc}") from exc
        finally:
            on_close()
            await response.aclose()  # a client gone mid-stream closes the upstream request too

    async def check_health(self) -> None:
        """For /ready: a short reason of ours; the upstream's details go to the log."""
        try:
            response = await self._client.get("/models", timeout=5)
        except httpx.HTTPError as exc:
            log.warning("upstream_unhealthy", model=self.name, why=f"{type(exc).__name__}: {exc}")
            raise EngineUnavailable("upstream unreachable") from exc
        if response.status_code != 200:
            log.warning("upstream_unhealthy", model=self.name, why=f"answered {response.status_code}: {response.text[:LOGGED_BYTES]}")
            raise EngineUnavailable(f"upstream answered {response.status_code}")

    async def aclose(self) -> None:
        await self._client.aclose()


def with_defaults(payload: dict[str, Any], defaults: SamplingDefaults | None, output_budget: bool) -> dict[str, Any]:
    """The request with the model's sampling defaults (the models file's `defaults`) where it is
    silent: an upstream cannot know them. `max_tokens` only where the output budget is open (chat),
    as for embedded models."""
    if defaults is None:
        return payload
    values = defaults.model_dump(exclude_none=True)
    if not output_budget or "max_completion_tokens" in payload:
        values.pop("max_tokens", None)
    silent = {key: value for key, value in values.items() if payload.get(key) is None}
    return {**payload, **silent}


def _failed_span(span: Span, exc: BaseException) -> None:
    """The upstream request's span, failed (recorded) and ended."""
    span.record_exception(exc)
    span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
    span.end()


async def _excerpt(response: httpx.Response) -> str:
    """The start of an error body, for the log; the response is closed."""
    try:
        async for chunk in response.aiter_bytes():
            return chunk[:LOGGED_BYTES].decode("utf-8", "replace")
        return ""
    except httpx.HTTPError as exc:
        return f"(unreadable: {type(exc).__name__})"
    finally:
        await response.aclose()
