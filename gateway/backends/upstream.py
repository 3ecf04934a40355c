"""Remote models: any OpenAI-compatible server (another replica, vLLM's server) reached with aiohttp.

Requests are forwarded as validated, with `model` renamed to the upstream's name; streams pass
through event by event, unbuffered, decoded from any `Content-Encoding` the upstream chose (the
header is not passed on: the client gets plain bytes).

One aiohttp session per upstream, made on first use (in the serving loop), its pool sized by the
model's `max_connections`, every connection kept alive between requests for `KEEP_ALIVE_S` (under
the idle timeout of uvicorn-based upstreams, vLLM's server among them). aiohttp, not httpx: httpx's
pool polls every pooled connection on each request, so its cost grows with the requests in flight
(benchmarks/RESULTS.md, "Remote path (issue 27)").

The upstream's failures become the gateway's own errors, mapped here once (`FAILURES`: aiohttp's
errors and its timeouts); why goes to the log (`upstream_failed`), never to the client or /ready:
its status and, from a JSON error body, the error's `type` and `code`; the body's text itself (which
may echo the request) only with `log_prompts`:

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

import aiohttp
import orjson
import structlog
from aiohttp.helpers import get_env_proxy_for_url
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from yarl import URL

from engine.config import SamplingDefaults
from engine.errors import EngineUnavailable
from gateway.errors import APIError, BackendUnavailable, BadGateway
from gateway.protocol import sse_wire
from gateway.telemetry import metrics
from gateway.telemetry.record import current_trace
from gateway.telemetry.tracing import headers_of

log = structlog.get_logger(__name__)
PASSED_ON = frozenset({400, 413, 422})  # the client's own mistakes: the upstream's answer explains them
UNAVAILABLE = frozenset({408, 429, 502, 503, 504})  # busy or briefly down: another model may answer
LOGGED_BYTES = 500  # of an upstream's error body, for the log
KEEP_ALIVE_S = 4.0  # an idle connection's life: under uvicorn's 5 s, so we close it before the upstream does
HEALTH_TIMEOUT_S = 5.0
FAILURES = (aiohttp.ClientError, TimeoutError)  # what aiohttp raises when the upstream fails us


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
                 timeout_s: float, connect_timeout_s: float, max_connections: int = 256,
                 log_bodies: bool = False) -> None:
        self.name = name
        self._log_bodies = log_bodies  # an error body's text in the log (log_prompts): it may echo the request
        self.upstream_model = upstream_model
        self._base = url.rstrip("/")
        self._host = URL(self._base).host or ""
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        # as httpx's Timeout(timeout_s, connect=...): each read (not the whole answer) within
        # timeout_s, and a free connection of the pool too; a new connection within connect_timeout_s
        self._timeout = aiohttp.ClientTimeout(total=None, connect=timeout_s, sock_connect=connect_timeout_s,
                                              sock_read=timeout_s)
        self._max_connections = max_connections
        self._proxy, self._proxy_auth = _env_proxy(self._base)  # HTTP(S)_PROXY and NO_PROXY, read once (as httpx did)
        self._urls: dict[str, URL] = {}  # path → URL, built once
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        """Made on first use: an aiohttp session belongs to the loop that serves."""
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self._max_connections, limit_per_host=0,
                                             keepalive_timeout=KEEP_ALIVE_S)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout, headers=self._headers,
                                                  proxy=self._proxy, proxy_auth=self._proxy_auth)
        return self._session

    def _url(self, path: str) -> URL:
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = URL(self._base + path)
        return url

    async def forward(
        self, path: str, body: dict[str, Any], stream: bool, on_close: Callable[[], None]
    ) -> UpstreamAnswer:
        """Forward; `on_close` runs once the answer has been passed on (or failed)."""
        payload = orjson.dumps({**body, "model": self.upstream_model})
        url = self._url(path)
        trace = current_trace()
        if trace is None:
            return await self._forward(url, payload, None, stream, on_close)
        # the request's span, its traceparent passed on; ended when the answer has been passed on
        span = trace.start(f"POST {path}", SpanKind.CLIENT, {
            "http.request.method": "POST", "url.full": str(url), "server.address": self._host,
            "gen_ai.request.model": self.upstream_model,
        })

        def closed() -> None:
            if span.is_recording():  # not when a failure ended it already
                span.end()
            on_close()

        try:
            return await self._forward(url, payload, headers_of(span), stream, closed, span)
        except BaseException as exc:
            _failed_span(span, exc)
            raise

    async def _forward(
        self, url: URL, payload: bytes, headers: dict[str, str] | None, stream: bool,
        on_close: Callable[[], None], span: Span | None = None,
    ) -> UpstreamAnswer:
        try:
            response = await self.session.post(url, data=payload, headers=headers)
        except FAILURES as exc:
            raise self._failed(BackendUnavailable, f"{type(exc).__name__}: {exc}") from exc
        status = response.status
        if span is not None:
            span.set_attribute("http.response.status_code", status)
        if status != 200 and status not in PASSED_ON:
            excerpt = await _excerpt(response)
            if not self._log_bodies:
                excerpt = _error_kind(excerpt)
            kind = BackendUnavailable if status in UNAVAILABLE else BadGateway
            raise self._failed(kind, f"answered {status}: {excerpt}")
        media_type = response.headers.get("Content-Type", "application/json")
        if not stream or status != 200:
            try:
                content = await response.read()  # decoded: gzip and the like are undone here
            except FAILURES as exc:
                raise self._failed(BackendUnavailable, f"{type(exc).__name__}: {exc}") from exc
            finally:
                response.release()  # the connection back to the pool (closed when the answer was cut)
            on_close()
            return UpstreamAnswer(status, media_type, body=content)
        return UpstreamAnswer(200, media_type, events=self._events(response, on_close, span))

    def _failed(self, kind: type[APIError], why: str) -> APIError:
        metrics.labelled(metrics.UPSTREAM_ERRORS, self.name).inc()
        log.warning("upstream_failed", model=self.name, why=why)
        return kind(f"The model '{self.name}' is unavailable: its upstream server failed. Please retry later.")

    async def _events(
        self, response: aiohttp.ClientResponse, on_close: Callable[[], None], span: Span | None
    ) -> AsyncGenerator[bytes, None]:
        """The stream's events as they complete (an event cut by a failure is not passed on)."""
        try:
            async for event in sse_wire.split(response.content.iter_any()):
                yield event
        except FAILURES as exc:
            if span is not None:
                _failed_span(span, exc)
            raise self._failed(BackendUnavailable, f"mid-stream: {type(exc).__name__}: {exc}") from exc
        finally:
            on_close()
            # a stream read to its end leaves its connection in the pool; one cut short (a client
            # gone mid-stream) closes it, which ends the upstream's request too
            response.release()

    async def check_health(self) -> None:
        """For /ready: a short reason of ours; the upstream's details go to the log."""
        try:
            async with self.session.get(self._url("/models"), timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)) as response:
                status = response.status
                text = "" if status == 200 else (await response.content.read(LOGGED_BYTES)).decode("utf-8", "replace")
        except FAILURES as exc:
            log.warning("upstream_unhealthy", model=self.name, why=f"{type(exc).__name__}: {exc}")
            raise EngineUnavailable("upstream unreachable") from exc
        if status != 200:
            log.warning("upstream_unhealthy", model=self.name, why=f"answered {status}: {text}")
            raise EngineUnavailable(f"upstream answered {status}")

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


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


def _error_kind(excerpt: str) -> str:
    """What of an error body is safe to log whatever it holds: the `type` and `code` of a JSON error
    (OpenAI's and Anthropic's shapes), short strings only; never its message."""
    try:
        body = orjson.loads(excerpt)
    except orjson.JSONDecodeError:
        return "(a body that is not JSON; its text is logged with log_prompts)"
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return "(its text is logged with log_prompts)"
    named = {key: error[key] for key in ("type", "code") if isinstance(error.get(key), str) and len(error[key]) <= 64}
    return ", ".join(f"{key} {value}" for key, value in named.items()) or "(its text is logged with log_prompts)"


async def _excerpt(response: aiohttp.ClientResponse) -> str:
    """The start of an error body, for the log; the response is released (its connection closed
    when the rest was not read)."""
    try:
        return (await response.content.read(LOGGED_BYTES)).decode("utf-8", "replace")
    except FAILURES as exc:
        return f"(unreadable: {type(exc).__name__})"
    finally:
        response.release()


def _env_proxy(url: str) -> tuple[URL | None, aiohttp.BasicAuth | None]:
    """The proxy the environment names for `url` (HTTP_PROXY, HTTPS_PROXY, NO_PROXY), if any."""
    try:
        return get_env_proxy_for_url(URL(url))
    except LookupError:
        return None, None
