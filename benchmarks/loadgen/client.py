"""The HTTP side: one client session per run (`make_client`: aiohttp, or the lean `wire` client), the
model a server offers, and `send_request`, which sends one request and times it into a record.
Idle connections are dropped after `KEEPALIVE_S`, before uvicorn's 5-second keep-alive closes them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp
from yarl import URL

from benchmarks.loadgen.codec import dumps, loads
from benchmarks.loadgen.config import LoadConfig
from benchmarks.loadgen.results import RequestRecord
from benchmarks.loadgen.sse import SSEDecoder, StreamAccumulator
from benchmarks.loadgen.wire import WireSession

Client = aiohttp.ClientSession | WireSession  # the same calls on both (`loadgen.wire`)

KEEPALIVE_S = 3.0  # below uvicorn's default timeout_keep_alive (5 s), which vLLM's server keeps too
CLIENT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError)


def make_client(config: LoadConfig, concurrency: int | None = None) -> Client:
    """One session for a whole run: no connection limit (the load decides), keep-alive, JSON headers;
    aiohttp's, or with `config.http_client == "wire"` the leaner `loadgen.wire` client.

    Call it inside a running event loop (aiohttp's rule)."""
    headers = {"content-type": "application/json", **config.headers}
    if config.api_key:
        headers["authorization"] = f"Bearer {config.api_key}"
    if config.http_client == "wire":
        return WireSession(headers, total_timeout_s=config.request_timeout_s, idle_s=KEEPALIVE_S)
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S, ttl_dns_cache=None)
    timeout = aiohttp.ClientTimeout(total=config.request_timeout_s, sock_connect=30.0)
    return aiohttp.ClientSession(
        connector=connector, headers=headers, timeout=timeout,
        cookie_jar=aiohttp.DummyCookieJar(),  # no cookie bookkeeping per response
        skip_auto_headers=("User-Agent", "Accept-Encoding"),  # no compression: servers send plain bytes
    )


async def get_json(client: Client, url: str, body: Any = None) -> Any:
    """GET (or POST `body`) and decode the JSON answer; raises aiohttp.ClientResponseError on a non-2xx."""
    method = "POST" if body is not None else "GET"
    async with client.request(method, url, data=None if body is None else dumps(body)) as response:
        response.raise_for_status()
        return loads(await response.read())


async def discover_model(client: Client, base_url: str) -> str:
    """The first model of GET /models."""
    models = (await get_json(client, f"{base_url.rstrip('/')}/models")).get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/models lists no model; pass --model")
    return str(models[0]["id"])


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


def _counted(headers: Mapping[str, str], names: Sequence[str]) -> dict[str, str]:
    return {h: headers[h] for h in names if h in headers}


async def send_request(
    client: Client,
    url: str | URL,
    body: dict[str, Any],
    record: RequestRecord,
    *,
    count_headers: Sequence[str] = (),
    estimate_input: int = 0,
    origin: float = 0.0,
) -> RequestRecord:
    """Send one request and fill `record` (also when cancelled: then `cancelled` is True, and
    `ttft` is kept when the first token had come)."""
    started = time.perf_counter()
    record.start = started - origin
    content = dumps(body)
    acc = StreamAccumulator(started)
    try:
        if body.get("stream"):
            await _send_streaming(client, url, content, record, acc, count_headers, estimate_input)
        else:
            await _send_plain(client, url, content, record, started, count_headers, estimate_input)
    except asyncio.CancelledError:
        record.cancelled = True
        record.e2e = time.perf_counter() - started
        if acc.first is not None:
            record.ttft = acc.first - started
        raise
    except CLIENT_ERRORS as exc:
        record.e2e = time.perf_counter() - started
        record.error = f"{exc.__class__.__name__}: {exc}"[:300] or exc.__class__.__name__
    return record


async def _send_streaming(
    client: Client,
    url: str | URL,
    content: bytes,
    record: RequestRecord,
    acc: StreamAccumulator,
    count_headers: Sequence[str],
    estimate_input: int,
) -> None:
    """A streamed request: time each event carrying text until `[DONE]`."""
    async with client.post(url, data=content) as response:
        record.status = response.status
        record.headers = _counted(response.headers, count_headers)
        if response.status != 200:
            detail = (await response.read()).decode(errors="replace")
            record.error = f"HTTP {response.status}: {detail[:200]}"
            return
        decoder = SSEDecoder()
        # read to the end of the body even after [DONE] (the chunked terminator follows it), so
        # that the connection goes back to the pool instead of being closed
        async for chunk in response.content.iter_any():
            if not acc.done:
                now = time.perf_counter()
                for data in decoder.feed_raw(chunk):
                    if acc.feed(data, now):
                        break
        if not acc.done:
            for data in decoder.finish():
                acc.feed(data, time.perf_counter())
    _finish_stream(record, acc, (acc.done_at or time.perf_counter()) - acc.started, estimate_input)


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
    client: Client,
    url: str | URL,
    content: bytes,
    record: RequestRecord,
    started: float,
    count_headers: Sequence[str],
    estimate_input: int,
) -> None:
    """A request without streaming: the first token is the whole answer (TTFT = e2e)."""
    async with client.post(url, data=content) as response:
        record.status = response.status
        record.headers = _counted(response.headers, count_headers)
        payload = await response.read()
    record.e2e = record.ttft = time.perf_counter() - started
    if record.status != 200:
        record.error = f"HTTP {record.status}: {payload[:200].decode(errors='replace')}"
        return
    obj = loads(payload)
    choices = obj.get("choices") or []
    record.text = "".join(
        (c.get("text") or (c.get("message") or {}).get("content") or "") for c in choices
    )
    _apply_usage(record, obj.get("usage"), 1 if record.text else 0, estimate_input)
    record.ok = True
