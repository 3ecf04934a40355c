"""The HTTP side: one `loadgen.wire` session per run (`make_client`), the model a server offers, and
`send_request`, which sends one request and times it into a record. Idle connections are dropped
after `KEEPALIVE_S`, before uvicorn's 5-second keep-alive closes them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import orjson

from benchmarks.loadgen.config import LoadConfig
from benchmarks.loadgen.results import RequestRecord
from benchmarks.loadgen.sse import SSEDecoder, StreamAccumulator
from benchmarks.loadgen.wire import WireResponse, WireSession

Client = WireSession

KEEPALIVE_S = 3.0  # below uvicorn's default timeout_keep_alive (5 s), which vLLM's server keeps too
CLIENT_ERRORS = (asyncio.TimeoutError, OSError, ValueError)  # WireStatusError is a ValueError


def make_client(config: LoadConfig) -> Client:
    """One session for a whole run: no connection limit (the load decides), keep-alive, JSON headers."""
    headers = {"content-type": "application/json", **config.headers}
    if config.api_key:
        headers["authorization"] = f"Bearer {config.api_key}"
    return WireSession(headers, total_timeout_s=config.request_timeout_s, idle_s=KEEPALIVE_S)


async def get_json(client: Client, url: str, body: Any = None) -> Any:
    """GET (or POST `body`) and decode the JSON answer; raises WireStatusError on a non-2xx."""
    method = "POST" if body is not None else "GET"
    async with client.request(method, url, data=None if body is None else orjson.dumps(body)) as response:
        response.raise_for_status()
        return orjson.loads(await response.read())


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


async def send_request(client: Client, url: str, body: dict[str, Any], record: RequestRecord, *,
                       count_headers: Sequence[str] = (), estimate_input: int = 0, origin: float = 0.0) -> RequestRecord:
    """Send one request and fill `record` (also when cancelled: then `cancelled` is True, and
    `ttft` is kept when the first token had come)."""
    started = time.perf_counter()
    record.start = started - origin
    acc = StreamAccumulator(started)
    try:
        async with client.post(url, data=orjson.dumps(body)) as response:
            record.status = response.status
            record.headers = {h: response.headers[h.lower()] for h in count_headers if h.lower() in response.headers}
            if response.status != 200:
                record.e2e = record.ttft = time.perf_counter() - started
                record.error = f"HTTP {response.status}: {(await response.read())[:200].decode(errors='replace')}"
            elif body.get("stream"):
                await _read_stream(response, acc)
                _finish_stream(record, acc, estimate_input)
            else:
                _finish_plain(record, await response.read(), started, estimate_input)
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


async def _read_stream(response: WireResponse, acc: StreamAccumulator) -> None:
    """Time each event carrying text until `[DONE]`, then read the body to its end (the chunked
    terminator follows [DONE]) so that the connection goes back to the pool."""
    decoder = SSEDecoder()
    async for chunk in response.iter_chunks():
        if not acc.done:
            now = time.perf_counter()
            for data in decoder.feed(chunk):
                if acc.feed(data, now):
                    break
    if not acc.done:
        for data in decoder.finish():
            acc.feed(data, time.perf_counter())


def _finish_stream(record: RequestRecord, acc: StreamAccumulator, estimate_input: int) -> None:
    """Copy what the stream said into the record; ok only with `[DONE]` and no error event."""
    record.e2e = (acc.done_at or time.perf_counter()) - acc.started
    record.chunks, record.itl, record.text = acc.chunks, acc.itl, acc.text
    record.ttft = (acc.first - acc.started) if acc.first is not None else record.e2e
    _apply_usage(record, acc.usage, acc.chunks, estimate_input)
    if acc.error:
        record.error = acc.error
    elif not acc.done:
        record.error = "stream ended without [DONE]"
    else:
        record.ok = True


def _finish_plain(record: RequestRecord, payload: bytes, started: float, estimate_input: int) -> None:
    """A request without streaming: the first token is the whole answer (TTFT = e2e)."""
    record.e2e = record.ttft = time.perf_counter() - started
    obj = orjson.loads(payload)
    record.text = "".join((c.get("text") or (c.get("message") or {}).get("content") or "") for c in obj.get("choices") or [])
    _apply_usage(record, obj.get("usage"), 1 if record.text else 0, estimate_input)
    record.ok = True
