"""The HTTP side: the shared `httpx` client, the model a server offers, and `send_request`, which
sends one request (streamed or not) and times it into a `RequestRecord`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import httpx

from benchmarks.loadgen.codec import dumps
from benchmarks.loadgen.config import LoadConfig
from benchmarks.loadgen.results import RequestRecord
from benchmarks.loadgen.sse import StreamAccumulator, sse_events

_JSON = {"content-type": "application/json"}


def make_client(config: LoadConfig, concurrency: int | None = None) -> httpx.AsyncClient:
    """One client for a whole run: no connection limit (the load decides), long keep-alive."""
    headers = dict(config.headers)
    if config.api_key:
        headers["authorization"] = f"Bearer {config.api_key}"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None, keepalive_expiry=60)
    timeout = httpx.Timeout(config.request_timeout_s, connect=30.0)
    return httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout)


async def discover_model(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model of GET /models."""
    response = await client.get(f"{base_url.rstrip('/')}/models")
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/models lists no model; pass --model")
    return models[0]["id"]


def _apply_usage(record: RequestRecord, usage: dict[str, Any] | None, fallback_output: int, estimate_input: int) -> None:
    if usage:
        record.usage_reported = True
        record.output_tokens = int(usage.get("completion_tokens") or 0)
        record.input_tokens = int(usage.get("prompt_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        if isinstance(details, dict) and details.get("cached_tokens") is not None:
            record.cached_tokens = int(details["cached_tokens"])
    else:
        record.output_tokens = fallback_output
        record.input_tokens = estimate_input


def _counted(headers: httpx.Headers, names: Sequence[str]) -> dict[str, str]:
    return {h: headers[h] for h in names if h in headers}


async def send_request(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    record: RequestRecord,
    *,
    count_headers: Sequence[str] = (),
    estimate_input: int = 0,
    origin: float = 0.0,
) -> RequestRecord:
    """Send one request and fill `record` (also when cancelled: then `cancelled` is True)."""
    started = time.perf_counter()
    record.start = started - origin
    content = dumps(body)
    send = _send_streaming if body.get("stream") else _send_plain
    try:
        await send(client, url, content, record, started, count_headers, estimate_input)
    except asyncio.CancelledError:
        record.cancelled = True
        record.e2e = time.perf_counter() - started
        raise
    except (httpx.HTTPError, OSError, ValueError) as exc:
        record.e2e = time.perf_counter() - started
        record.error = f"{exc.__class__.__name__}: {exc}"[:300] or exc.__class__.__name__
    return record


async def _send_streaming(
    client: httpx.AsyncClient,
    url: str,
    content: bytes,
    record: RequestRecord,
    started: float,
    count_headers: Sequence[str],
    estimate_input: int,
) -> None:
    """A streamed request: time each event carrying text until `[DONE]`."""
    async with client.stream("POST", url, content=content, headers=_JSON) as response:
        record.status = response.status_code
        record.headers = _counted(response.headers, count_headers)
        if response.status_code != 200:
            detail = (await response.aread()).decode(errors="replace")
            record.error = f"HTTP {response.status_code}: {detail[:200]}"
            return
        acc = StreamAccumulator(started)
        async for data in sse_events(response.aiter_lines()):
            if acc.feed(data, time.perf_counter()):
                break
    _finish_stream(record, acc, time.perf_counter() - started, estimate_input)


def _finish_stream(record: RequestRecord, acc: StreamAccumulator, e2e: float, estimate_input: int) -> None:
    """Copy what the stream said into the record; ok only with `[DONE]` and no error event."""
    record.e2e = e2e
    record.chunks = acc.chunks
    record.itl = acc.itl
    record.text = acc.text
    record.ttft = (acc.first - acc.started) if acc.first is not None else record.e2e
    _apply_usage(record, acc.usage, acc.chunks, estimate_input)
    if acc.error:
        record.error = acc.error
    elif not acc.done:
        record.error = "stream ended without [DONE]"
    else:
        record.ok = True


async def _send_plain(
    client: httpx.AsyncClient,
    url: str,
    content: bytes,
    record: RequestRecord,
    started: float,
    count_headers: Sequence[str],
    estimate_input: int,
) -> None:
    """A request without streaming: the first token is the whole answer (TTFT = e2e)."""
    response = await client.post(url, content=content, headers=_JSON)
    ended = time.perf_counter()
    record.status = response.status_code
    record.headers = _counted(response.headers, count_headers)
    record.e2e = record.ttft = ended - started
    if response.status_code != 200:
        record.error = f"HTTP {response.status_code}: {response.text[:200]}"
        return
    obj = response.json()
    choices = obj.get("choices") or []
    record.text = "".join(
        (c.get("text") or (c.get("message") or {}).get("content") or "") for c in choices
    )
    _apply_usage(record, obj.get("usage"), 1 if record.text else 0, estimate_input)
    record.ok = True
