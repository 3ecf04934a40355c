"""Traces (telemetry.tracing, middleware.tracing) with the SDK's in-memory exporter: the server
span's GenAI attributes, its child spans, the caller's traceparent continued and passed on (to a
remote upstream, to the engine), no prompt text unless log_prompts, errors recorded, a stream's
span ended when its client leaves, and no tracing layer at all when tracing is off."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import structlog.testing
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from pydantic import ValidationError
from starlette.testclient import TestClient

from gateway.app import create_app
from gateway.middleware.trace_context import TracingMiddleware
from gateway.settings import Settings
from tests.fakes import FakeEngine, chat_body, fake_settings
from tests.scripted_upstream import scripted
from tests.unit.test_disconnect import drive

ENDPOINT = "http://collector.invalid/v1/traces"  # never reached: the in-memory exporter takes the spans
CALLER_TRACE = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"
SECRET = "my secret prompt words"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}


def traced_app(engine: FakeEngine, exporter: InMemorySpanExporter, **settings: Any) -> Any:
    tracing = {"otlp_endpoint": ENDPOINT, **settings.pop("tracing", {})}
    return create_app(fake_settings(tracing=tracing, **settings), engine_starter=lambda es: engine,
                      trace_exporter=exporter)


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def client(engine: FakeEngine, exporter: InMemorySpanExporter) -> Iterator[TestClient]:
    with TestClient(traced_app(engine, exporter), raise_server_exceptions=False) as client:
        yield client


def server_span(exporter: InMemorySpanExporter) -> ReadableSpan:
    servers = [s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER]
    assert len(servers) == 1, [s.name for s in servers]
    return servers[0]


def children(exporter: InMemorySpanExporter, parent: ReadableSpan) -> dict[str, ReadableSpan]:
    return {s.name: s for s in exporter.get_finished_spans()
            if s.parent is not None and s.parent.span_id == parent.context.span_id}


def values(exporter: InMemorySpanExporter) -> str:
    """Every attribute and event of every span, as one text to search."""
    return json.dumps([[dict(s.attributes or {}), [dict(e.attributes or {}) for e in s.events]]
                       for s in exporter.get_finished_spans()], default=str)


def test_tracing_off_adds_no_layer_and_no_trace(engine: FakeEngine) -> None:
    app = create_app(fake_settings(), engine_starter=lambda es: engine)
    assert all(m.cls is not TracingMiddleware for m in app.user_middleware)
    with TestClient(app) as client, structlog.testing.capture_logs() as logs:
        assert client.post("/v1/chat/completions", json=chat_body()).status_code == 200
    line = next(m for m in logs if m["event"] == "request")
    assert "trace_id" not in line
    assert engine.requests[0].trace_headers is None


@pytest.mark.parametrize("settings", [
    {"otlp_endpoint": "collector:4318"},  # no scheme: not an OTLP/HTTP URL
    {"otlp_endpoint": ENDPOINT, "sample_ratio": 1.5},
    {"otlp_endpoint": ENDPOINT, "export_timeout_s": 0},
    {"engine_spans": True},  # vLLM's spans need somewhere to go
])
def test_bad_tracing_settings_are_refused(settings: dict[str, Any]) -> None:
    with pytest.raises(ValidationError, match="tracing"):
        Settings(tracing=settings)


def test_engine_spans_point_the_engine_at_the_same_endpoint() -> None:
    settings = Settings(tracing={"otlp_endpoint": ENDPOINT, "engine_spans": True})
    assert settings.engine.otlp_traces_endpoint == ENDPOINT
    assert Settings(tracing={"otlp_endpoint": ENDPOINT}).engine.otlp_traces_endpoint is None


def test_a_chat_request_is_one_server_span_with_the_genai_attributes(
    client: TestClient, exporter: InMemorySpanExporter
) -> None:
    body = chat_body(temperature=0.5, top_p=0.9, max_tokens=3, stop=["\n\n"])
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    span = server_span(exporter)
    attributes = dict(span.attributes or {})
    assert span.name == "chat fake-model"
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.request.model"] == "fake-model"
    assert attributes["gen_ai.response.model"] == "fake-model"
    assert attributes["gen_ai.request.temperature"] == 0.5
    assert attributes["gen_ai.request.top_p"] == 0.9
    assert attributes["gen_ai.request.max_tokens"] == 3
    assert attributes["gen_ai.request.stop_sequences"] == ("\n\n",)
    assert attributes["gen_ai.usage.output_tokens"] == 3
    assert attributes["gen_ai.usage.input_tokens"] > 0
    assert attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert attributes["http.response.status_code"] == 200
    assert attributes["http.route"] == "/v1/chat/completions"
    assert span.status.status_code is StatusCode.UNSET


def test_the_stages_are_child_spans_of_the_server_span(client: TestClient, exporter: InMemorySpanExporter) -> None:
    assert client.post("/v1/chat/completions", json=chat_body(stream=True)).status_code == 200
    span = server_span(exporter)
    stages = children(exporter, span)
    assert {"gateway.prepare", "engine.first_token", "engine.decode"} <= set(stages)
    assert "gateway.admission.wait" not in stages  # admitted at once: nothing waited
    first, decode = stages["engine.first_token"], stages["engine.decode"]
    assert first.end_time <= decode.start_time
    assert decode.attributes["gen_ai.usage.output_tokens"] == 3
    assert all(s.context.trace_id == span.context.trace_id for s in stages.values())


def test_the_callers_traceparent_is_continued_and_passed_to_the_engine(
    client: TestClient, engine: FakeEngine, exporter: InMemorySpanExporter
) -> None:
    response = client.post("/v1/chat/completions", json=chat_body(), headers={"traceparent": TRACEPARENT})
    assert response.status_code == 200
    span = server_span(exporter)
    assert f"{span.context.trace_id:032x}" == CALLER_TRACE
    assert span.parent is not None
    assert f"{span.parent.span_id:016x}" == CALLER_SPAN
    engine_span = children(exporter, span)["engine.first_token"]
    headers = engine.requests[0].trace_headers
    assert headers is not None
    assert headers["traceparent"] == f"00-{CALLER_TRACE}-{engine_span.context.span_id:016x}-01"


def test_the_trace_ids_are_in_the_access_line(client: TestClient, exporter: InMemorySpanExporter) -> None:
    with structlog.testing.capture_logs() as logs:
        client.post("/v1/chat/completions", json=chat_body(), headers={"traceparent": TRACEPARENT})
    line = next(m for m in logs if m["event"] == "request")
    span = server_span(exporter)
    assert line["trace_id"] == CALLER_TRACE
    assert line["span_id"] == f"{span.context.span_id:016x}"


def test_a_cached_answer_reports_its_usage_and_finish_reasons(engine: FakeEngine, exporter: InMemorySpanExporter) -> None:
    with TestClient(traced_app(engine, exporter, cache={"backend": "memory"})) as client:
        for _ in range(2):
            assert client.post("/v1/chat/completions", json=chat_body(temperature=0)).status_code == 200
    hit = [s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER][1]
    attributes = dict(hit.attributes or {})
    assert attributes["gateway.cache"] == "hit"
    assert attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert attributes["gen_ai.usage.output_tokens"] == 3
    lookup = children(exporter, hit)["gateway.cache.lookup"]
    assert lookup.attributes["gateway.cache.hit"] is True
    assert "engine.first_token" not in children(exporter, hit)


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_are_the_finish_reason(
    client: TestClient, engine: FakeEngine, exporter: InMemorySpanExporter, stream: bool
) -> None:
    engine.reply = ['<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>']
    body = chat_body(tools=[WEATHER], tool_choice="auto", stream=stream)
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    assert server_span(exporter).attributes["gen_ai.response.finish_reasons"] == ("tool_calls",)


def test_no_prompt_or_output_text_unless_prompts_are_logged(engine: FakeEngine, exporter: InMemorySpanExporter) -> None:
    body = {"model": "fake-model", "messages": [{"role": "user", "content": SECRET}], "max_tokens": 2}
    with TestClient(traced_app(engine, exporter)) as client:
        client.post("/v1/chat/completions", json=body)
    assert SECRET not in values(exporter)
    assert "the quick" not in values(exporter)  # the fake engine's answer
    exporter = InMemorySpanExporter()  # the first app's shut down with its provider
    with TestClient(traced_app(engine, exporter, log_prompts=True)) as client:
        client.post("/v1/chat/completions", json=body)
    attributes = server_span(exporter).attributes
    assert SECRET in attributes["gen_ai.input.messages"]
    output = json.loads(attributes["gen_ai.output.messages"])
    assert output[0]["parts"][0]["content"] == "the quick"
    assert output[0]["finish_reason"] == "length"


def test_a_server_error_is_recorded(client: TestClient, engine: FakeEngine, exporter: InMemorySpanExporter) -> None:
    engine.fail_after = 1
    assert client.post("/v1/chat/completions", json=chat_body()).status_code == 500
    span = server_span(exporter)
    assert span.status.status_code is StatusCode.ERROR
    assert span.attributes["http.response.status_code"] == 500
    assert "error.type" in span.attributes
    assert [e.name for e in span.events] == ["exception"]


def test_a_stream_failing_after_its_first_byte_is_recorded(
    client: TestClient, engine: FakeEngine, exporter: InMemorySpanExporter
) -> None:
    engine.fail_after = 2
    assert client.post("/v1/chat/completions", json=chat_body(stream=True)).status_code == 200
    span = server_span(exporter)
    assert span.status.status_code is StatusCode.ERROR
    assert [e.name for e in span.events] == ["exception"]


def test_a_refusal_is_not_an_error(client: TestClient, exporter: InMemorySpanExporter) -> None:
    assert client.post("/v1/chat/completions", json=chat_body(model="nope")).status_code == 404
    span = server_span(exporter)
    assert span.status.status_code is StatusCode.UNSET
    assert span.attributes["http.response.status_code"] == 404


async def test_a_stream_ends_its_spans_when_the_client_leaves(exporter: InMemorySpanExporter) -> None:
    engine = FakeEngine(max_model_len=10_000, delay=0.01)
    app = traced_app(engine, exporter, streams={"grace_s": 0})  # no grace for a reconnect: the work ends at once
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000, "stream": True}
    async with app.router.lifespan_context(app) as state:
        async def with_state(scope: Any, receive: Any, send: Any) -> None:
            scope["state"] = dict(state)
            await app(scope, receive, send)

        await drive(with_state, body, disconnect_after_chunks=3)
    assert engine.aborted == [engine.requests[0].request_id]
    span = server_span(exporter)  # finished: exported
    assert span.attributes["gateway.client_disconnected"] is True
    assert span.status.status_code is StatusCode.UNSET
    decode = children(exporter, span)["engine.decode"]
    assert decode.attributes["gateway.engine.aborted"] is True


MODELS = """
models:
  - name: remote
    kind: remote
    url: http://upstream.test/v1
"""


@pytest.mark.parametrize("stream", [False, True])
def test_the_trace_goes_on_to_a_remote_upstream(tmp_path: Path, exporter: InMemorySpanExporter, stream: bool) -> None:
    def models(base: str) -> Path:
        path = tmp_path / "models.yaml"
        path.write_text(MODELS.replace("http://upstream.test", base))
        return path

    seen: list[httpx.Request] = []
    chat = {"id": "x", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}}
    chunk = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]}

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if stream:
            sse = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()
            return httpx.Response(200, content=sse, headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json=chat)

    with scripted(answer) as base, TestClient(traced_app(FakeEngine(), exporter, models_file=models(base))) as client:
        body = chat_body(model="remote", stream=stream)
        assert client.post("/v1/chat/completions", json=body, headers={"traceparent": TRACEPARENT}).status_code == 200
    span = server_span(exporter)
    call = next(s for s in exporter.get_finished_spans() if s.kind is SpanKind.CLIENT)
    assert call.parent is not None
    assert call.parent.span_id == span.context.span_id
    assert call.attributes["http.response.status_code"] == 200
    assert seen[0].headers["traceparent"] == f"00-{CALLER_TRACE}-{call.context.span_id:016x}-01"
    assert span.attributes["gen_ai.response.finish_reasons"] == ("stop",)


def test_an_unsampled_caller_is_not_recorded_but_still_passed_on(
    client: TestClient, engine: FakeEngine, exporter: InMemorySpanExporter
) -> None:
    unsampled = f"00-{CALLER_TRACE}-{CALLER_SPAN}-00"
    assert client.post("/v1/chat/completions", json=chat_body(), headers={"traceparent": unsampled}).status_code == 200
    assert exporter.get_finished_spans() == ()
    headers = engine.requests[0].trace_headers
    assert headers is not None
    assert headers["traceparent"].startswith(f"00-{CALLER_TRACE}-")
    assert headers["traceparent"].endswith("-00")
