"""The load generator without vLLM: its statistics and SSE parsing, request bodies and sessions, and
end-to-end runs against the gateway on the instant echo engine (in-process uvicorn); the race's
tests are in test_race.py. Behaviour only, never timings."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import socket
from collections.abc import AsyncIterator

import pytest
import uvicorn
from aiohttp import web

from benchmarks import loadgen
from benchmarks.echo_engine import create_echo_app, echo_engine
from benchmarks.loadgen import LoadConfig, RequestRecord, SSEDecoder, StreamAccumulator, runner
from benchmarks.loadgen.results import Stats, tpot
from tests.fakes import FakeEngine
from tests.waits import until

# ---------------------------------------------------------------------------------------------
# statistics


def test_percentile_interpolates_like_numpy() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert loadgen.percentile(values, 50) == pytest.approx(2.5)
    assert loadgen.percentile(values, 90) == pytest.approx(3.7)
    assert loadgen.percentile(values, 99) == pytest.approx(3.97)
    assert loadgen.percentile(values, 0) == 1.0
    assert loadgen.percentile(values, 100) == 4.0
    assert loadgen.percentile([7.0], 99) == 7.0
    assert math.isnan(loadgen.percentile([], 50))


def test_percentile_of_1_to_100() -> None:
    values = list(range(1, 101))
    assert loadgen.percentile(values, 50) == pytest.approx(50.5)
    assert loadgen.percentile(values, 99) == pytest.approx(99.01)


def test_stats_skip_missing_values_and_serialize_nan_as_null() -> None:
    stats = Stats.of([0.1, None, 0.3, float("nan")])  # type: ignore[list-item]
    assert stats.n == 2
    assert stats.mean == pytest.approx(0.2)
    assert stats.p50 == pytest.approx(0.2)
    assert stats.min == 0.1
    assert stats.max == 0.3
    empty = Stats.of([])
    assert empty.n == 0
    assert math.isnan(empty.p99)


def test_tpot_is_decode_time_per_token_after_the_first() -> None:
    assert tpot(e2e=1.0, ttft=0.2, output_tokens=5) == pytest.approx(0.2)
    assert tpot(e2e=1.0, ttft=0.2, output_tokens=1) is None
    assert tpot(e2e=1.0, ttft=0.2, output_tokens=0) is None
    record = RequestRecord(ok=True, ttft=0.1, e2e=0.9, output_tokens=9, chunks=9)
    assert record.tpot == pytest.approx(0.1)


def test_aggregate_throughput_and_counts() -> None:
    records = [
        RequestRecord(ok=True, ttft=0.1, e2e=1.1, output_tokens=11, input_tokens=20, chunks=11, itl=[0.1] * 10, usage_reported=True),
        RequestRecord(ok=True, ttft=0.3, e2e=1.3, output_tokens=11, input_tokens=20, chunks=11, itl=[0.1] * 10, usage_reported=True),
        RequestRecord(ok=False, error="HTTP 500: boom", e2e=0.01),
        RequestRecord(cancelled=True, e2e=0.5),
    ]
    result = loadgen.aggregate(records, duration_s=2.0, concurrency=2)
    assert (result.completed, result.failed, result.cancelled) == (2, 1, 1)
    assert result.total_output_tokens == 22
    assert result.output_throughput == pytest.approx(11.0)
    assert result.request_throughput == pytest.approx(1.0)
    assert result.input_throughput == pytest.approx(20.0)
    assert result.ttft.p50 == pytest.approx(0.2)
    assert result.tpot.mean == pytest.approx(0.1)
    assert result.itl.n == 20
    assert result.errors == {"HTTP 500: boom": 1}
    assert result.usage_reported
    data = result.to_dict()
    json.dumps(data)  # plain JSON, no NaN
    assert data["tpot"]["p50"] == pytest.approx(0.1)


# ---------------------------------------------------------------------------------------------
# SSE


def test_sse_decoder_follows_the_event_stream_rules() -> None:
    decoder = SSEDecoder()
    body = b': keep-alive\n\ndata: {"a": 1}\n\nevent: x\ndata: line1\ndata:line2\n\ndata: [DONE]\r\n\r\ndata: tail'
    assert decoder.feed(body) == [b'{"a": 1}', "line1\nline2", b"[DONE]"]
    assert decoder.finish() == ["tail"]
    assert decoder.finish() == []


def test_stream_accumulator_counts_text_chunks_only() -> None:
    acc = StreamAccumulator(started=0.0)
    role_only = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    assert not acc.feed(json.dumps(role_only), 0.05)
    assert acc.first is None
    acc.feed(json.dumps({"choices": [{"index": 0, "delta": {"content": "Hel"}}]}), 0.1)
    acc.feed(json.dumps({"choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "length"}]}), 0.3)
    acc.feed(json.dumps({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}), 0.31)
    assert acc.feed("[DONE]", 0.32)
    assert acc.first == 0.1
    assert acc.chunks == 2
    assert acc.itl == [pytest.approx(0.2)]
    assert acc.text == "Hello"
    assert acc.finish_reason == "length"
    assert acc.usage == {"prompt_tokens": 5, "completion_tokens": 3}
    errored = StreamAccumulator(0.0)
    errored.feed(json.dumps({"error": {"message": "engine died", "type": "server_error"}}), 0.1)
    assert errored.error == "engine died"


def _sse(*events: object) -> list[bytes]:
    out = []
    for event in events:
        data = event if isinstance(event, str) else json.dumps(event)
        out.append(f"data: {data}\n\n".encode())
    return out


class _Script:
    """What the scripted server answers: these parts of a body, with a pause before each, each
    written in two halves (an event cut across reads) when `split`."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.status = 200
        self.delay = 0.0
        self.split = False
        self.bodies: list[dict] = []


@pytest.fixture
async def scripted() -> AsyncIterator[tuple[str, _Script]]:
    """A real HTTP server on loopback (aiohttp.web) that streams what the test scripts."""
    script = _Script()

    async def handler(request: web.Request) -> web.StreamResponse:
        script.bodies.append(await request.json())
        response = web.StreamResponse(status=script.status, headers={"content-type": "text/event-stream", "x-cache": "MISS"})
        await response.prepare(request)
        for part in script.parts:
            if script.delay:
                await asyncio.sleep(script.delay)
            halves = (part[: len(part) // 2], part[len(part) // 2 :]) if script.split else (part,)
            for half in halves:
                await response.write(half)
                if script.split:
                    await asyncio.sleep(0.002)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}/v1/completions", script
    finally:
        await runner.cleanup()


async def _send(url: str, **kwargs: object) -> RequestRecord:
    async with loadgen.make_client(LoadConfig()) as client:
        return await loadgen.send_request(client, url, {"stream": True}, RequestRecord(), **kwargs)  # type: ignore[arg-type]


def _completion_chunk(text: str) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": None}]}


async def test_send_request_times_a_stream_and_takes_usage(scripted) -> None:
    url, script = scripted
    script.parts = _sse(*(_completion_chunk(f" w{i}") for i in range(4)),
                        {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 4}}, "[DONE]")
    script.delay, script.split = 0.01, True
    record = await _send(url, count_headers=["x-cache"])
    assert record.ok, record.error
    assert script.bodies == [{"stream": True}]
    assert record.output_tokens == 4
    assert record.input_tokens == 7
    assert record.usage_reported
    assert record.chunks == 4
    assert len(record.itl) == 3
    assert 0 < record.ttft < record.e2e
    assert record.tpot == pytest.approx((record.e2e - record.ttft) / 3)
    assert record.headers == {"x-cache": "MISS"}
    assert record.text == " w0 w1 w2 w3"


async def test_send_request_counts_chunks_without_usage(scripted) -> None:
    url, script = scripted
    script.parts = _sse(*(_completion_chunk("x") for i in range(3)), "[DONE]")
    record = await _send(url, estimate_input=12)
    assert record.ok
    assert record.output_tokens == 3
    assert record.input_tokens == 12
    assert not record.usage_reported


async def test_send_request_reports_errors(scripted) -> None:
    url, script = scripted
    script.status, script.parts = 429, [b'{"error": {"message": "nope"}}']
    record = await _send(url)
    assert not record.ok
    assert record.status == 429
    assert record.error.startswith("HTTP 429")
    script.status, script.parts = 200, _sse(_completion_chunk("x"))  # no [DONE]
    record = await _send(url)
    assert not record.ok
    assert "without [DONE]" in record.error
    script.parts = _sse({"error": {"message": "engine died"}}, "[DONE]")
    record = await _send(url)
    assert not record.ok
    assert record.error == "engine died"


async def test_send_request_reports_a_refused_connection_as_an_error() -> None:
    record = await _send(f"http://127.0.0.1:{_closed_port()}/v1/completions")
    assert not record.ok
    assert not record.cancelled
    assert record.error
    assert record.e2e is not None


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_sse_events_cut_anywhere_are_the_same_events(newline) -> None:
    text = 'data: {"t": "caf\u00e9 \u00e9t\u00e9"}\n\n: ping\n\ndata: a\ndata: b\n\nevent: x\ndata: c\n\ndata: [DONE]\n'
    body = text.replace("\n", newline).encode()
    expected = ['{"t": "caf\u00e9 \u00e9t\u00e9"}', "a\nb", "c", "[DONE]"]
    for cut in range(len(body) + 1):  # every cut, including inside a two-byte é and between CR and LF
        decoder = SSEDecoder()
        events = decoder.feed(body[:cut]) + decoder.feed(body[cut:]) + decoder.finish()
        assert [e.decode() if isinstance(e, bytes) else e for e in events] == expected
    assert SSEDecoder().feed(b'data: {"x": 1}\n\n') == [b'{"x": 1}']  # the common case: bytes, never decoded


def test_request_bodies() -> None:
    session = loadgen.Session(turns=["hello there"], system="shared prefix")
    chat = loadgen.request_body(LoadConfig(endpoint="chat", ignore_eos=True, output_tokens=8), "m", session,
                                [("q1", "a1")], "q2")
    assert chat["messages"] == [
        {"role": "system", "content": "shared prefix"},
        {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
    ]
    assert chat["ignore_eos"] is True
    assert chat["max_tokens"] == 8
    assert chat["stream_options"] == {"include_usage": True}
    assert chat["temperature"] == 0.0
    plain = loadgen.request_body(LoadConfig(endpoint="completions", stream=False, temperature=None), "m", session, [], "hi")
    assert plain["prompt"] == "shared prefix\nhi"
    assert "stream_options" not in plain
    assert "temperature" not in plain
    assert "ignore_eos" not in plain


async def test_sessions_are_deterministic_and_shaped() -> None:
    config = LoadConfig(prompts="shared-prefix", input_tokens=10, prefix_tokens=30, num_prefixes=2)
    first = await loadgen.build_sessions(config, 6, tokenizer=None, seed=5)
    again = await loadgen.build_sessions(config, 6, tokenizer=None, seed=5)
    assert first == again
    assert len({s.system for s in first}) <= 2
    assert all(len(s.system.split()) == 30 and len(s.turns[0].split()) == 10 for s in first)
    assert all(s.input_tokens == 40 for s in first)
    assert len({s.turns[0] for s in first}) == 6
    multi = await loadgen.build_sessions(LoadConfig(prompts="multi-turn", turns=3, input_tokens=4), 2, tokenizer=None)
    assert [len(s.turns) for s in multi] == [3, 3]
    assert multi[0].system is None


# ---------------------------------------------------------------------------------------------
# end to end: the real gateway app on the echo engine, over loopback HTTP


@pytest.fixture
async def echo_gateway() -> AsyncIterator[tuple[str, FakeEngine]]:
    from gateway.settings import Settings

    engine = echo_engine("echo-model")
    # no grace for a reconnect: a stream the run cancels ends with its client, not at the server's shutdown
    app = create_echo_app(Settings(warmup=False, log_level="warning", cache={"backend": "off"}, streams={"grace_s": 0}),
                          engine)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None, access_log=False, lifespan="on"))
    task = asyncio.create_task(server.serve())
    await until(lambda: server.started or task.done(), what="the echo gateway started")
    assert server.started, "the echo gateway did not start"
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/v1", engine
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 60)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
async def test_loadgen_end_to_end_on_the_echo_gateway(echo_gateway, endpoint) -> None:
    base_url, engine = echo_gateway
    config = LoadConfig(base_url=base_url, endpoint=endpoint, concurrency=4, num_requests=12, input_tokens=16,
                        output_tokens=8, ignore_eos=True, duration_s=30, warmup_requests=2, keep_records=True)
    result = await loadgen.run_load(config)
    assert result.completed == 12, result.errors
    assert result.failed == 0, result.errors
    assert len(engine.requests) == 14  # with the warm-up
    assert result.config["model"] == "echo-model"  # found with GET /v1/models
    assert result.usage_reported
    assert result.mean_output_tokens == 8
    # /tokenize of the echo gateway counts words: prompts are exactly 16 tokens (plus the chat template)
    assert result.mean_input_tokens == (18 if endpoint == "chat" else 16)
    assert result.ttft.n == 12
    assert result.tpot.n == 12
    assert result.e2e.p99 >= result.e2e.p50
    assert result.output_throughput > 0
    assert result.request_throughput > 0
    assert all(len(r.text.split()) == 8 for r in result.records)
    json.dumps(result.to_dict(records=True))


async def test_loadgen_multi_turn_rate_and_cycling(echo_gateway) -> None:
    base_url, engine = echo_gateway
    multi = await loadgen.run_load(LoadConfig(base_url=base_url, prompts="multi-turn", turns=3, concurrency=2,
                                              num_requests=6, input_tokens=5, output_tokens=4, keep_records=True))
    assert multi.completed == 6
    inputs = sorted({r.input_tokens for r in multi.records})
    assert len(inputs) == 3
    assert inputs[0] < inputs[1] < inputs[2]
    poisson = await loadgen.run_load(LoadConfig(base_url=base_url, request_rate=200.0, concurrency=None,
                                                num_requests=10, input_tokens=4, output_tokens=2, stream=False))
    assert poisson.completed == 10
    assert poisson.request_rate == 200.0
    assert poisson.ttft.p50 == poisson.e2e.p50  # no stream: first token = whole answer
    before = len(engine.tokenizer.words)
    same = await loadgen.run_load(LoadConfig(base_url=base_url, unique_prompts=1, concurrency=3, num_requests=9,
                                             input_tokens=4, output_tokens=2, keep_records=True))
    assert same.completed == 9
    assert len({r.input_tokens for r in same.records}) == 1
    assert len(engine.tokenizer.words) - before <= 4


async def test_loadgen_time_limit_stops_a_run(echo_gateway) -> None:
    base_url, engine = echo_gateway
    engine.delay = 0.05  # 64 tokens take 3 s; the limit is 0.3 s
    result = await loadgen.run_load(LoadConfig(base_url=base_url, concurrency=2, num_requests=100,
                                               output_tokens=64, input_tokens=4, duration_s=0.3))
    assert result.completed == 0
    assert result.cancelled == 2
    assert result.failed == 0
    assert result.duration_s < 5


async def test_loadgen_cli_writes_json(echo_gateway, tmp_path) -> None:
    base_url, _ = echo_gateway
    output = tmp_path / "out.json"
    argv = ["--base-url", base_url, "--concurrency", "2", "--num-requests", "4", "--input-tokens", "4",
            "--output-tokens", "3", "--endpoint", "completions", "--output", str(output)]
    assert await asyncio.to_thread(loadgen.main, argv) == 0  # its own event loop, in a thread
    document = json.loads(output.read_text())
    (result,) = document["results"]
    assert result["completed"] == 4
    assert result["concurrency"] == 2
    assert result["mean_output_tokens"] == 3
    assert result["client_cpu_s"] > 0
    assert result["client_cpu_share"] > 0
    # the client's ceiling, measured by default: the same load against the instant endpoint, beside the run
    ceiling = result["ceiling"]
    assert ceiling["completed"] > 0
    assert ceiling["failed"] == 0
    assert ceiling["req_s"] > 0
    assert ceiling["headroom"] == pytest.approx(min(ceiling["headroom_req_s"], ceiling["headroom_tok_s"]))
    assert ceiling["enough"] == (ceiling["headroom"] >= 5)


async def test_loadgen_sweep_runs_each_level(echo_gateway) -> None:
    base_url, _ = echo_gateway
    config = LoadConfig(base_url=base_url, num_requests=4, input_tokens=4, output_tokens=3)
    results = await loadgen.run_sweep(config, [1, 2], waves=3)
    assert [r.concurrency for r in results] == [1, 2]
    assert [r.completed for r in results] == [4, 6]


def test_the_command_line_is_loadconfigs_fields() -> None:
    def config(*argv: str) -> LoadConfig:
        return runner.config_from(runner.parser().parse_args(list(argv)))

    default = config()
    assert default == LoadConfig(ceiling_s=2.0)  # the CLI measures the client's ceiling by default
    given = config("--base-url", "http://h:1/v1", "--concurrency", "4", "16", "--endpoint", "completions", "--ignore-eos",
                   "--no-stream", "--duration", "0", "--warmup", "3", "--save-requests", "--extra-body", '{"top_k": 20}',
                   "--count-header", "X-Served-By", "--unique-prompts", "1", "--temperature", "-1", "--no-ceiling",
                   "--request-timeout", "5")
    assert given == LoadConfig(base_url="http://h:1/v1", concurrency=4, endpoint="completions", ignore_eos=True, stream=False,
                               duration_s=None, warmup_requests=3, keep_records=True, extra_body={"top_k": 20},
                               count_headers=["x-served-by"], unique_prompts=1, temperature=None, ceiling_s=0.0,
                               request_timeout_s=5.0)
    assert config("--request-rate", "5").concurrency is None  # a Poisson run has no cap unless one is given
    for field in dataclasses.fields(LoadConfig):
        if field.name not in ("headers", "label"):
            assert any(field.name == action.dest for action in runner.parser()._actions), field.name


# ---------------------------------------------------------------------------------------------
# the bare endpoint (the stack's limit: the race's "bare" target)


def test_bare_app_answers_a_fixed_completion_plain_and_streamed() -> None:
    from starlette.testclient import TestClient

    from benchmarks.instant_endpoint import create_bare_app

    with TestClient(create_bare_app("b")) as client:
        assert client.get("/v1/models").json()["data"][0]["id"] == "b"
        plain = client.post("/v1/completions", json={"model": "b", "prompt": "one two three", "max_tokens": 3}).json()
        assert plain["choices"][0]["text"] == " bare bare bare"
        assert plain["usage"]["completion_tokens"] == 3
        chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).json()
        assert chat["choices"][0]["message"]["content"] == " bare bare"
        body = {"prompt": "x", "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
        streamed = client.post("/v1/completions", json=body)
    assert streamed.headers["content-type"].startswith("text/event-stream")
    decoder, acc = SSEDecoder(), StreamAccumulator(0.0)
    for data in decoder.feed(streamed.content) + decoder.finish():
        acc.feed(data, 1.0)
    assert acc.done
    assert acc.chunks == 4
    assert acc.text == " bare" * 4
    assert acc.usage["completion_tokens"] == 4
