"""The HTTP side: one `loadgen.wire` session per run (`make_client`), `send_request` (one request
sent and timed into a record) and the reading of a stream: Server-Sent Events into event data
(`SSEDecoder`), event data into one answer's timing and text (`StreamAccumulator`)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from typing import Any

import orjson

from benchmarks.loadgen.results import LoadConfig, RequestRecord
from benchmarks.loadgen.wire import WireSession

Client = WireSession
KEEPALIVE_S = 3.0  # idle connections dropped before uvicorn's 5-second keep-alive closes them under a request
CLIENT_ERRORS = (asyncio.TimeoutError, OSError, ValueError)  # WireStatusError is a ValueError


def make_client(config: LoadConfig) -> Client:
    """One session for a whole run: no connection limit (the load decides), keep-alive, JSON headers."""
    headers = {"content-type": "application/json", **config.headers}
    if config.api_key:
        headers["authorization"] = f"Bearer {config.api_key}"
    return WireSession(headers, total_timeout_s=config.request_timeout_s, idle_s=KEEPALIVE_S)


async def get_json(client: Client, url: str, body: Any = None) -> Any:
    """GET (or POST `body`) and decode the JSON answer; raises WireStatusError on a non-2xx."""
    async with client.request("GET" if body is None else "POST", url, None if body is None else orjson.dumps(body)) as response:
        response.raise_for_status()
        return orjson.loads(await response.read())


async def discover_model(client: Client, base_url: str) -> str:
    if not (models := (await get_json(client, f"{base_url.rstrip('/')}/models")).get("data")):
        raise RuntimeError(f"{base_url}/models lists no model; pass --model")
    return str(models[0]["id"])


class SSEDecoder:
    """Splits a `text/event-stream` body (bytes, cut anywhere) into the data of each event (WHATWG
    rules, data fields only; LF or CRLF). The hot path: an event of one `data: ` line comes back as
    its raw bytes, never decoded (orjson reads them as they are); any other event as str."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, chunk: bytes) -> list[bytes | str]:
        buffer = self._pending + chunk
        if b"\r" in buffer:
            buffer = buffer.replace(b"\r\n", b"\n")  # a CR cut from its LF stays for the next chunk
        parts = buffer.split(b"\n\n")
        self._pending = parts.pop()
        events = [part[6:] if part.startswith(b"data: ") and b"\n" not in part else _data(part) for part in parts]
        return [e for e in events if e is not None]

    def finish(self) -> list[bytes | str]:
        """The end of the body: the event it ends, if any."""
        data, self._pending = _data(self._pending.rstrip(b"\r\n")), b""
        return [] if data is None else [data]


def _data(event: bytes) -> str | None:
    """The data of one event's lines (None for an event without data: a comment, a keep-alive)."""
    values = []
    for line in event.decode("utf-8", "replace").split("\n"):
        name, _, value = line.partition(":")
        if name == "data":
            values.append(value[1:] if value.startswith(" ") else value)
    return "\n".join(values) if values else None


class StreamAccumulator:
    """Follows one streamed response: when text arrives, what it says, the usage at the end."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.first: float | None = None
        self.last: float | None = None
        self.done_at: float | None = None
        self.itl: list[float] = []
        self.pieces: list[str] = []
        self.usage: dict[str, Any] | None = None
        self.error: str | None = None
        self.finish_reason: str | None = None
        self.done = False

    def feed(self, data: str | bytes, now: float) -> bool:
        """Take one event's data (str, or bytes from `SSEDecoder.feed`); return True at `[DONE]`."""
        try:
            obj = None if data == b"[DONE]" else orjson.loads(data)
        except ValueError:  # not JSON: [DONE] with spaces around, or garbage
            if data.strip() not in ("[DONE]", b"[DONE]"):
                self.error = f"undecodable event: {data[:120]!r}"
                return False
            obj = None
        if obj is None:
            self.done, self.done_at = True, now
            return True
        if not isinstance(obj, dict):
            return False
        if err := obj.get("error"):
            self.error = str(err.get("message", err) if isinstance(err, dict) else err)[:300]
            return False
        self.usage = obj.get("usage") or self.usage
        text = ""
        for choice in obj.get("choices") or ():
            delta = choice.get("delta") or {}
            text += (choice.get("text") or delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
                     or (json.dumps(delta["tool_calls"]) if delta.get("tool_calls") else ""))
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        if text:
            if self.first is None:
                self.first = now
            elif self.last is not None:
                self.itl.append(now - self.last)
            self.last = now
            self.pieces.append(text)
        return False

    @property
    def chunks(self) -> int:
        return len(self.pieces)

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def _apply_usage(record: RequestRecord, usage: dict[str, Any] | None, fallback_output: int, estimate_input: int) -> None:
    record.usage_reported = bool(usage)
    record.output_tokens = int(usage.get("completion_tokens") or 0) if usage else fallback_output
    record.input_tokens = int(usage.get("prompt_tokens") or 0) if usage else estimate_input
    details = (usage or {}).get("prompt_tokens_details") or {}
    if isinstance(details, dict) and details.get("cached_tokens") is not None:
        record.cached_tokens = int(details["cached_tokens"])


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
                # each event carrying text timed until [DONE]; then the body read to its end (the chunked
                # terminator follows [DONE]) so that the connection goes back to the pool
                decoder = SSEDecoder()
                async for chunk in response.iter_chunks():
                    if not acc.done:
                        now = time.perf_counter()
                        for data in decoder.feed(chunk):
                            if acc.feed(data, now):
                                break
                for data in [] if acc.done else decoder.finish():
                    acc.feed(data, time.perf_counter())
                record.e2e = (acc.done_at or time.perf_counter()) - started
                record.chunks, record.itl, record.text = acc.chunks, acc.itl, acc.text
                record.ttft = (acc.first - started) if acc.first is not None else record.e2e
                _apply_usage(record, acc.usage, acc.chunks, estimate_input)
                record.error = acc.error or (None if acc.done else "stream ended without [DONE]")
                record.ok = record.error is None
            else:  # the first token is the whole answer (TTFT = e2e)
                payload = await response.read()
                record.e2e = record.ttft = time.perf_counter() - started
                obj = orjson.loads(payload)
                record.text = "".join((c.get("text") or (c.get("message") or {}).get("content") or "")
                                      for c in obj.get("choices") or [])
                _apply_usage(record, obj.get("usage"), 1 if record.text else 0, estimate_input)
                record.ok = True
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

