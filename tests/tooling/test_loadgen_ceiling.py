"""The load generator's ceiling: the instant endpoint over a real socket (its JSON
and SSE are what the load generator parses, keep-alive holds for several requests on one
connection), runs against it, and the
ceiling line. Behaviour only, never timings."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httptools
import orjson
import pytest

from benchmarks import instant_endpoint
from benchmarks.loadgen import LoadConfig, SSEDecoder, StreamAccumulator, aggregate, run_load
from benchmarks.loadgen.results import Result, compare, describe


@pytest.fixture
async def instant() -> AsyncIterator[int]:
    """The instant endpoint in this test's loop, on a free loopback port."""
    server = await instant_endpoint.serve("127.0.0.1", 0, name="inst")
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


class _Response:
    """One HTTP response read with httptools' response parser (its own, not the server's)."""

    def __init__(self) -> None:
        self.headers: dict[str, str] = {}
        self.body = b""
        self.complete = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode().lower()] = value.decode()

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.complete = True


async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, method: str, path: str,
                    body: object = None, close: bool = False) -> tuple[int, _Response]:
    data = b"" if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    head = f"{method} {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {len(data)}\r\n"
    writer.write((head + ("connection: close\r\n" if close else "") + "\r\n").encode() + data)
    response = _Response()
    parser = httptools.HttpResponseParser(response)
    while not response.complete:
        chunk = await asyncio.wait_for(reader.read(65536), 10)
        assert chunk, "the connection closed before the answer was complete"
        parser.feed_data(chunk)
    return parser.get_status_code(), response


def _events(body: bytes) -> StreamAccumulator:
    """The stream as the load generator reads it."""
    decoder, acc = SSEDecoder(), StreamAccumulator(0.0)
    for data in decoder.feed(body) + decoder.finish():
        acc.feed(data, 1.0)
    return acc


async def test_instant_endpoint_answers_many_requests_on_one_keep_alive_connection(instant) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", instant)
    try:
        status, models = await _exchange(reader, writer, "GET", "/v1/models")
        assert status == 200
        assert json.loads(models.body)["data"][0]["id"] == "inst"

        status, plain = await _exchange(reader, writer, "POST", "/v1/completions",
                                        {"model": "m", "prompt": "one two three", "max_tokens": 3})
        answer = orjson.loads(plain.body)
        assert status == 200
        assert plain.headers["content-type"] == "application/json"
        assert answer["choices"][0]["text"] == " bare bare bare"
        assert answer["model"] == "m"
        assert answer["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}

        status, chat = await _exchange(reader, writer, "POST", "/v1/chat/completions",
                                       {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2})
        assert orjson.loads(chat.body)["choices"][0]["message"] == {"role": "assistant", "content": " bare bare"}

        body = {"prompt": "x", "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}}
        status, streamed = await _exchange(reader, writer, "POST", "/v1/completions", body)
        assert status == 200
        assert streamed.headers["content-type"] == "text/event-stream"
        assert streamed.headers["transfer-encoding"] == "chunked"
        acc = _events(streamed.body)
        assert acc.done
        assert acc.error is None
        assert acc.chunks == 5
        assert acc.text == " bare" * 5
        assert acc.usage == {"prompt_tokens": 1, "completion_tokens": 5, "total_tokens": 6}
        assert acc.finish_reason == "length"

        body = {"messages": [{"role": "user", "content": "a b"}], "max_tokens": 3, "stream": True}
        status, chat_stream = await _exchange(reader, writer, "POST", "/v1/chat/completions", body)
        acc = _events(chat_stream.body)
        assert acc.done
        assert acc.chunks == 3
        assert acc.usage is None
        first = orjson.loads(chat_stream.body.split(b"\n\n")[0].split(b"data: ", 1)[1])
        assert first["object"] == "chat.completion.chunk"
        assert first["choices"][0]["delta"]["role"] == "assistant"

        status, health = await _exchange(reader, writer, "GET", "/health")
        assert status == 200
        assert health.body == b"{}"
        status, missing = await _exchange(reader, writer, "GET", "/v1/nothing")
        assert status == 404
        assert "error" in json.loads(missing.body)
        status, bad = await _exchange(reader, writer, "POST", "/v1/completions", b"[1, 2]")
        assert status == 400
        assert json.loads(bad.body)["error"]["code"] == 400
        status, bad = await _exchange(reader, writer, "POST", "/v1/completions", {"max_tokens": "many"})
        assert status == 400
        assert "max_tokens" in json.loads(bad.body)["error"]["message"]

        # still the same connection; `connection: close` ends it after the answer
        status, last = await _exchange(reader, writer, "GET", "/health", close=True)
        assert status == 200
        assert last.headers["connection"] == "close"
        assert await asyncio.wait_for(reader.read(), 10) == b""
    finally:
        writer.close()


# ---------------------------------------------------------------------------------------------
# runs against the instant endpoint


async def test_a_run_against_the_instant_endpoint_is_on_one_time_line(instant) -> None:
    base_url = f"http://127.0.0.1:{instant}/v1"
    config = LoadConfig(base_url=base_url, endpoint="completions", concurrency=4, num_requests=40, input_tokens=6,
                        output_tokens=5, tokenizer="words", warmup_requests=4, keep_records=True)
    result = await run_load(config)
    assert result.completed == 40, result.errors
    assert result.failed == 0, result.errors
    assert result.cancelled == 0, result.errors
    assert result.concurrency == 4
    assert result.config["model"] == "inst"
    assert len(result.records) == 40
    assert all(r.text == " bare" * 5 for r in result.records)
    assert min(r.start for r in result.records) >= 0
    assert max(r.start + r.e2e for r in result.records) <= result.duration_s + 1e-6
    assert result.usage_reported
    assert result.mean_output_tokens == 5
    assert result.tpot.n == 40
    assert result.client_cpu_s is not None
    assert result.client_cpu_s > 0
    json.dumps(result.to_dict(records=True))


async def test_the_ceiling_beside_the_run(instant) -> None:
    base_url = f"http://127.0.0.1:{instant}/v1"
    config = LoadConfig(base_url=base_url, endpoint="chat", concurrency=2, num_requests=10, input_tokens=4,
                        output_tokens=3, tokenizer="words", ceiling_s=0.3)
    result = await run_load(config)
    top = result.ceiling
    assert result.completed == 10
    assert top is not None
    assert top["completed"] > 0
    assert top["failed"] == 0
    assert top["endpoint"] == "benchmarks.instant_endpoint"
    assert top["latency_bound"] is False
    assert "client ceiling" in describe(top)


def _result(concurrency: int, req_s: float) -> Result:
    result = aggregate([], 1.0, concurrency=concurrency, config={"concurrency": concurrency})
    result.request_throughput = result.output_throughput = req_s
    return result


def test_the_ceiling_line_says_when_it_is_bound_by_latency() -> None:
    low = compare(_result(1, 300.0), _result(1, 100.0))
    assert low["headroom"] == pytest.approx(3.0)
    assert not low["enough"]
    assert low["latency_bound"]
    assert "bound by latency" in describe(low)
    busy = compare(_result(16, 300.0), _result(16, 100.0))
    assert not busy["latency_bound"]
    assert "below 5x" in describe(busy)
    assert "latency" not in describe(busy)
    fine = compare(_result(1, 600.0), _result(1, 100.0))
    assert fine["enough"]
    assert "below" not in describe(fine)
