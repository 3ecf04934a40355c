"""Remote models: any OpenAI-compatible server (another replica, vLLM's server) reached with aiohttp.

A remote backend (`engine.types.Generator`): requests are forwarded as validated, with `model`
renamed to the upstream's name, and its answer (a whole JSON body, or SSE chunks as they come,
decoded from any `Content-Encoding`; embeddings' vectors) is read into typed outputs, as the
engine's. An answer the gateway cannot take as the engine's (not one choice for each of the n asked
for, a negative count, a chat logprob that is no number, vectors not one per input) is a 502.

One aiohttp session per upstream, made on first use (in the serving loop), its pool sized by the
model's `max_connections`, every connection kept alive between requests for `KEEP_ALIVE_S` (under
the idle timeout of uvicorn-based upstreams, vLLM's server among them). aiohttp, not httpx: httpx's
pool polls every pooled connection on each request, so its cost grows with the requests in flight
(benchmarks/RESULTS.md).

The upstream's failures become the gateway's own errors, mapped here once (`FAILURES`: aiohttp's
errors and its timeouts); why goes to the log (`upstream_failed`), never to the client or /ready:
its status and, from a JSON error body, the error's `type` and `code`; the body's text itself (which
may echo the request) only with `log_prompts`:

    connection error, timeout, 408, 429, 502, 503, 504   → BackendUnavailable (503, fallible)
    401, 403 (our key refused), 404, any other status     → BadGateway (502, fallible)
    400, 413, 422 (the request's own fault)               → `Refused`: passed on as it answered
    a failure in the middle of a stream (an error event)  → BackendUnavailable, raised from the
                                                            outputs (the API layer ends the stream
                                                            with one error event)

Fallible errors happen before the first byte, so the dispatcher tries the model's fallbacks.

What it is sent: the request with the model's defaults where it is silent (`with_defaults`; a chat
request's max_tokens the gateway's `default_max_tokens` after them, as for embedded models), its
tokens estimated for the charge and the output bound (`estimate`: no tokenizer of the upstream's
model here; the prompt's text at 4 characters a token, OpenAI's rule of thumb, token-id prompts by
their length, plus the output budget asked for, times n and the prompts; completions' default 16;
chat without one: 0, its stream cut at its share of the bound, `per_choice`). The upstream's usage,
when it reports one, is the count that stays.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import orjson
import structlog
from aiohttp.helpers import get_env_proxy_for_url
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from pydantic import BaseModel, NonNegativeInt, ValidationError
from yarl import URL

from engine.config import SamplingDefaults
from engine.errors import EngineUnavailable
from engine.types import (
    ChoiceDelta,
    Embeddings,
    EmbedRequest,
    GenerationOutput,
    GenerationRequest,
    ModelInfo,
    TokenLogprob,
    ToolCallDelta,
)
from gateway.errors import APIError, BackendUnavailable, BadGateway, Dialect
from gateway.protocol import sse_wire
from gateway.telemetry import metrics
from gateway.telemetry.record import current_trace
from gateway.telemetry.tracing import headers_of

log = structlog.get_logger(__name__)
PASSED_ON = frozenset({400, 413, 422})  # the client's own mistakes: the upstream's answer explains them
UNAVAILABLE = frozenset({408, 429, 502, 503, 504})  # busy or briefly down: another model may answer
LOGGED_BYTES = 500  # of an upstream's error body, for the log
REFUSAL_BYTES = 64 * 1024  # of an error body passed on to the client (`Refused`): an explanation, not a payload
KEEP_ALIVE_S = 4.0  # an idle connection's life: under uvicorn's 5 s, so we close it before the upstream does
HEALTH_TIMEOUT_S = 5.0
FAILURES = (aiohttp.ClientError, TimeoutError)  # what aiohttp raises when the upstream fails us
CHARS_PER_TOKEN = 4
IMAGE_TOKENS = 85  # an image part of a message, estimated as OpenAI's base cost of one image (low detail)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) when a completions request sends none


class _Vector(BaseModel):
    index: int
    embedding: list[float] | str  # str: base64, as the request's encoding_format asked


class _EmbeddingUsage(BaseModel):
    prompt_tokens: NonNegativeInt | None = None


class _Vectors(BaseModel):
    """What of an upstream's embeddings answer is read."""

    data: list[_Vector]
    usage: _EmbeddingUsage | None = None


class Refused(APIError):
    """The upstream refused the request as the client's own fault (`PASSED_ON`): its status and its
    error body, passed on as it answered."""

    def __init__(self, status: int, body: bytes) -> None:
        try:
            error = orjson.loads(body)
        except orjson.JSONDecodeError:
            error = None
        self.error = error if isinstance(error, dict) else None
        inner = (self.error or {}).get("error")
        super().__init__(str(inner.get("message", "")) if isinstance(inner, dict) else body.decode("utf-8", "replace"))
        self.status = status

    def body(self, dialect: Dialect = "openai") -> dict[str, Any]:
        return self.error if self.error is not None and dialect == "openai" else super().body(dialect)


class Upstream:
    def __init__(self, name: str, url: str, upstream_model: str, api_key: str | None,
                 timeout_s: float, connect_timeout_s: float, max_connections: int = 256,
                 log_bodies: bool = False) -> None:
        self.name = name
        self._log_bodies = log_bodies  # an error body's text in the log (log_prompts): it may echo the request
        self.upstream_model = upstream_model
        self.info = ModelInfo(name, max_model_len=0)  # what a backend tells of itself (the upstream's model is its own)
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
        self._url = functools.cache(lambda path: URL(self._base + path))  # path → URL, built once
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

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationOutput, None]:
        """The generation `request.forward` asks for, its answer read as typed outputs (a stream's
        chunk by chunk; a whole answer as one output); closing it early ends the upstream's request."""
        forward, n = request.forward, request.sampling.n
        assert forward is not None
        stream = bool(forward.payload.get("stream"))
        async with self._request(forward.path, forward.payload) as (response, span):
            if not stream:
                try:
                    output = _output(orjson.loads(await self._body(response)), whole=True)
                except ValueError:  # orjson's JSONDecodeError among them
                    raise self._failed(BadGateway, "an answer that is not JSON, or not its API's") from None
                yield self._checked(output, n, whole=True)
                return
            read = False  # a chunk: a stream has one at least (an upstream that ignored `stream` has none)
            try:
                async for event in sse_wire.split(response.content.iter_any()):
                    for chunk in sse_wire.payloads(event):
                        if chunk == sse_wire.UNREADABLE or (isinstance(chunk, dict) and "error" in chunk):
                            raise self._failed(BackendUnavailable, "mid-stream: an error event, or data that is not JSON")
                        if isinstance(chunk, dict):
                            read = True
                            yield self._checked(_output(chunk, whole=False), n)
            except (*FAILURES, ValueError) as exc:  # ValueError: a chunk that is not its API's
                if span is not None:
                    _failed_span(span, exc)
                raise self._failed(BackendUnavailable, f"mid-stream: {type(exc).__name__}: {exc}") from exc
            if not read:
                raise self._failed(BadGateway, "a stream without a chunk")

    def _checked(self, output: GenerationOutput, n: int, whole: bool = False) -> GenerationOutput:
        """The output if its choices are among the n asked for (a whole answer's: each once), no count negative; else a 502."""
        indexes = [delta.index for delta in output.choices]
        if (sorted(indexes) != list(range(n))) if whole else any(not 0 <= index < n for index in indexes):
            raise self._failed(BadGateway, f"not its choices among 0..{n - 1} (a whole answer's each once)")
        if min(output.prompt_tokens, output.cached_tokens, output.completion_tokens or 0) < 0:
            raise self._failed(BadGateway, "a negative token count in its usage")
        return output

    async def embed(self, request: EmbedRequest) -> Embeddings:
        """The vectors `request.forward` asks for, one per input (each index once), read from an
        answer in OpenAI's shape; anything else is a 502. Its usage counts, else the estimate."""
        forward = request.forward
        assert forward is not None
        async with self._request(forward.path, forward.payload) as (response, _):
            body = await self._body(response)
        try:
            answer = _Vectors.model_validate_json(body)
        except ValidationError:
            raise self._failed(BadGateway, "an embeddings answer not in OpenAI's shape") from None
        if sorted(vector.index for vector in answer.data) != list(range(_count(forward.payload.get("input")))):
            raise self._failed(BadGateway, "not one vector for each input")
        usage = answer.usage.prompt_tokens if answer.usage is not None else None
        vectors = [vector.embedding for vector in sorted(answer.data, key=lambda vector: vector.index)]
        return Embeddings(vectors, forward.prompt_tokens if usage is None else usage)

    @asynccontextmanager
    async def _request(self, path: str, body: Mapping[str, Any]) -> AsyncIterator[tuple[aiohttp.ClientResponse, Span | None]]:
        """The request sent, its span (traced: the request's, its traceparent passed on) open and
        the response held until the answer has been read; a failure before it is mapped here."""
        payload = orjson.dumps({**body, "model": self.upstream_model})
        url = self._url(path)
        trace = current_trace()
        span = None if trace is None else trace.start(f"POST {path}", SpanKind.CLIENT, {
            "http.request.method": "POST", "url.full": str(url), "server.address": self._host,
            "gen_ai.request.model": self.upstream_model,
        })
        try:
            try:
                response = await self.session.post(url, data=payload, headers=None if span is None else headers_of(span))
            except FAILURES as exc:
                raise self._failed(BackendUnavailable, f"{type(exc).__name__}: {exc}") from exc
            try:
                await self._check(response, span)
                yield response, span
            finally:
                # a stream read to its end leaves its connection in the pool; one cut short (a client
                # gone mid-stream) closes it, which ends the upstream's request too
                response.release()
        except Exception as exc:
            if span is not None and span.is_recording():
                _failed_span(span, exc)
            raise
        finally:
            if span is not None and span.is_recording():  # not when a failure ended it already
                span.end()

    async def _check(self, response: aiohttp.ClientResponse, span: Span | None) -> None:
        status = response.status
        if span is not None:
            span.set_attribute("http.response.status_code", status)
        if status in PASSED_ON:
            raise Refused(status, await _start(response, REFUSAL_BYTES))
        if status != 200:
            kind = BackendUnavailable if status in UNAVAILABLE else BadGateway
            raise self._failed(kind, f"answered {status}: {await self._excerpt(response)}")

    async def _excerpt(self, response: aiohttp.ClientResponse) -> str:
        """An error body's start, for the log: its text only with log_prompts (it may echo the request, or our key)."""
        excerpt = (await _start(response, LOGGED_BYTES)).decode("utf-8", "replace")
        return excerpt if self._log_bodies else _error_kind(excerpt)

    async def _body(self, response: aiohttp.ClientResponse) -> bytes:
        try:
            return await response.read()  # decoded: gzip and the like are undone here
        except FAILURES as exc:
            raise self._failed(BackendUnavailable, f"{type(exc).__name__}: {exc}") from exc

    def _failed(self, kind: type[APIError], why: str) -> APIError:
        metrics.labelled(metrics.UPSTREAM_ERRORS, self.name).inc()
        log.warning("upstream_failed", model=self.name, why=why)
        return kind(f"The model '{self.name}' is unavailable: its upstream server failed. Please retry later.")

    async def check_health(self) -> None:
        """For /ready: a short reason of ours; the upstream's details go to the log."""
        try:
            async with self.session.get(self._url("/models"), timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)) as response:
                status = response.status
                text = "" if status == 200 else await self._excerpt(response)
        except FAILURES as exc:
            log.warning("upstream_unhealthy", model=self.name, why=f"{type(exc).__name__}: {exc}")
            raise EngineUnavailable("upstream unreachable") from exc
        if status != 200:
            log.warning("upstream_unhealthy", model=self.name, why=f"answered {status}: {text}")
            raise EngineUnavailable(f"upstream answered {status}")

    async def shutdown(self) -> None:
        if self._session is not None:
            await self._session.close()


def _output(data: Any, whole: bool) -> GenerationOutput:
    """A whole answer, or one chunk of a stream, typed as the engine's outputs are: a chat choice's
    content, reasoning and tool calls (parsed by the upstream), a completion's text, their logprobs,
    the finish reasons, the usage."""
    if not isinstance(data, dict):
        raise ValueError("an answer that is not a JSON object")
    choices = [_delta(raw, whole) for raw in data.get("choices") or () if isinstance(raw, dict)]
    usage = data["usage"] if isinstance(data.get("usage"), dict) else {}
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else 0
    completion = usage.get("completion_tokens")
    return GenerationOutput(_int(usage.get("prompt_tokens")), choices, finished=whole or bool(usage),
                            cached_tokens=_int(cached), completion_tokens=completion if isinstance(completion, int) else None)


def _delta(raw: dict[str, Any], whole: bool) -> ChoiceDelta:
    body = raw.get("message" if whole else "delta")
    reason = raw.get("finish_reason")
    index, finish = _int(raw.get("index")), reason if isinstance(reason, str) else None
    if not isinstance(body, dict):  # a completion's choice
        text = _str(raw.get("text"))
        return ChoiceDelta(index, text, _ids(text), finish, logprobs=_completion_logprobs(raw.get("logprobs")))
    text, reasoning = _str(body.get("content")), _str(body.get("reasoning_content") or body.get("reasoning"))
    calls = tuple(_call(call, i) for i, call in enumerate(body.get("tool_calls") or ()) if isinstance(call, dict))
    logprobs = raw.get("logprobs")
    entries = logprobs.get("content") if isinstance(logprobs, dict) else None
    if isinstance(entries, list) and not all(isinstance(e, dict) and isinstance(e.get("logprob"), int | float) for e in entries):
        raise ValueError("a chat logprob that is not a number")  # OpenAI's always is (ours are typed so)
    return ChoiceDelta(index, text, _ids(text or reasoning or calls), finish, reasoning=reasoning, tool_calls=calls,
                       logprobs=None if not isinstance(entries, list) else tuple(
                           _logprob(e.get("token"), e.get("logprob"), e.get("top_logprobs")) for e in entries))


def _ids(output: object) -> tuple[int, ...]:
    """An upstream's token ids are not known: one stand-in for a choice's piece of output, so that it
    counts as a token (and times as one) until the upstream's usage gives the count."""
    return (0,) if output else ()


def _call(call: dict[str, Any], position: int) -> ToolCallDelta:
    function = call["function"] if isinstance(call.get("function"), dict) else {}
    index, name, call_id = call.get("index", position), function.get("name"), call.get("id")
    return ToolCallDelta(_int(index), _str(function.get("arguments")), name if isinstance(name, str) else None,
                         call_id if isinstance(call_id, str) else None)


def _completion_logprobs(logprobs: Any) -> tuple[TokenLogprob, ...] | None:
    if not isinstance(logprobs, dict) or not isinstance(logprobs.get("tokens"), list):
        return None
    values, tops = logprobs.get("token_logprobs") or [], logprobs.get("top_logprobs") or []
    return tuple(_logprob(token, values[i] if i < len(values) else None, tops[i] if i < len(tops) else None)
                 for i, token in enumerate(logprobs["tokens"]))


def _logprob(token: Any, logprob: Any, top: Any) -> TokenLogprob:
    """One token's logprob; its alternatives a chat list of {token, logprob} or a completion's map."""
    pairs = top.items() if isinstance(top, dict) else ((t.get("token"), t.get("logprob")) for t in top or () if isinstance(t, dict))
    alternatives = tuple((0, _str(t), float(lp)) for t, lp in pairs if isinstance(lp, int | float))
    return TokenLogprob(0, _str(token), float(logprob) if isinstance(logprob, int | float) else None, None, alternatives)


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _int(value: Any) -> int:
    return value if isinstance(value, int) else 0


def with_defaults(payload: dict[str, Any], defaults: SamplingDefaults | None, output_budget: bool,
                  default_max_tokens: int | None = None) -> dict[str, Any]:
    """The request with the model's sampling defaults (the models file's `defaults`) where it is
    silent: an upstream cannot know them. `max_tokens` only where the output budget is open (chat):
    the model's default, else `default_max_tokens` (the caller's: the gateway's, else the bound's share)."""
    values = defaults.model_dump(exclude_none=True) if defaults is not None else {}
    if default_max_tokens is not None:
        values.setdefault("max_tokens", default_max_tokens)
    if not output_budget or payload.get("max_completion_tokens") is not None:
        values.pop("max_tokens", None)
    silent = {key: value for key, value in values.items() if payload.get(key) is None}
    return {**payload, **silent}


def estimate(payload: dict[str, Any]) -> tuple[int, int]:
    """(prompt tokens, output budget) of a request about to be forwarded."""
    prompts = payload.get("prompt", payload.get("input"))
    # tools and a response format's schema are rendered into the prompt: their JSON's length, roughly
    schemas = sum(math.ceil(len(orjson.dumps(payload[key])) / CHARS_PER_TOKEN) for key in ("tools", "response_format")
                  if payload.get(key))
    prompt = _message_tokens(payload.get("messages") or []) + _prompt_tokens(prompts) + schemas
    return prompt, _asked(payload) * _choices(payload)


def per_choice(payload: dict[str, Any], bound: int) -> int:
    """The most tokens one choice of a forwarded request may bring: what it asks for, else its
    choices' even share of `bound` (the gateway's `max_output_tokens_per_request`)."""
    return _asked(payload) or max(1, bound // _choices(payload))


def _asked(payload: dict[str, Any]) -> int:
    """The output budget per choice (completions' default when unsaid; 0: none)."""
    asked = payload.get("max_completion_tokens") or payload.get("max_tokens")
    if asked is None and "prompt" in payload:
        asked = COMPLETIONS_DEFAULT_MAX_TOKENS
    return int(asked or 0)


def _choices(payload: dict[str, Any]) -> int:
    """Choices per prompt, times the prompts."""
    return max(int(payload.get("n") or 1), int(payload.get("best_of") or 1)) * _count(payload.get("prompt", payload.get("input")))


def _count(prompts: object) -> int:
    """How many prompts (or inputs to embed) a request's `prompt` (`input`) holds."""
    return len(prompts) if isinstance(prompts, list) and prompts and isinstance(prompts[0], str | list) else 1


def _chars(text: str) -> int:
    return math.ceil(len(text) / CHARS_PER_TOKEN)


def _message_tokens(messages: list[dict[str, Any]]) -> int:
    total = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            total += _chars(content)
        elif isinstance(content, list):
            total += sum(IMAGE_TOKENS if part.get("type") == "image_url" else _chars(part.get("text") or "")
                         for part in content if isinstance(part, dict))
        for call in message.get("tool_calls") or ():
            total += _chars(str((call.get("function") or {}).get("arguments") or ""))
    return total


def _prompt_tokens(prompt: object) -> int:
    if isinstance(prompt, str):
        return _chars(prompt)
    if isinstance(prompt, list):
        return sum(1 if isinstance(item, int) else _prompt_tokens(item) for item in prompt)
    return 0


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


async def _start(response: aiohttp.ClientResponse, most: int) -> bytes:
    """An error body's first `most` bytes, as many as could be read (the rest is not read: the
    response's release closes its connection)."""
    body = b""
    with contextlib.suppress(*FAILURES):
        while len(body) < most and (piece := await response.content.read(most - len(body))):
            body += piece
    return body


def _env_proxy(url: str) -> tuple[URL | None, aiohttp.BasicAuth | None]:
    """The proxy the environment names for `url` (HTTP_PROXY, HTTPS_PROXY, NO_PROXY), if any."""
    try:
        return get_env_proxy_for_url(URL(url))
    except LookupError:
        return None, None
