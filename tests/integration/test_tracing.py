"""Traces over real OTLP/HTTP from a real gateway on the real engine: a small OTLP receiver started
here (on port 0, its port read back), the gateway pointed at it with vLLM's own spans on, and a
request's trace read back as the receiver got it: the caller's trace continued, the GenAI
attributes, the stages, and vLLM's `llm_request` span under the gateway's engine span."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from tests.integration.conftest import MODEL, gateway_process

pytestmark = [pytest.mark.integration, pytest.mark.gateway_only("the gateway's own traces")]
CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
WAIT_S = 60  # a bound on waiting for the batches (exported every 5 s), not a measurement


class Receiver:
    """An OTLP/HTTP traces endpoint: every span it was sent, decoded, with its service name."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def take(self, body: bytes) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        with self.lock:
            for resource in request.resource_spans:
                service = _attributes(resource.resource.attributes).get("service.name")
                for scope in resource.scope_spans:
                    self.spans.extend(_span(span, service) for span in scope.spans)

    def wait_for(self, name: str, trace_id: str) -> dict[str, Any]:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            with self.lock:
                found = [s for s in self.spans if s["name"] == name and s["trace_id"] == trace_id]
            if found:
                return found[0]
            time.sleep(0.2)
        raise AssertionError(f"no span {name!r} in trace {trace_id}: {[s['name'] for s in self.spans]}")


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


def _attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


def _span(span: Any, service: str | None) -> dict[str, Any]:
    return {
        "name": span.name, "service": service, "trace_id": span.trace_id.hex(), "span_id": span.span_id.hex(),
        "parent": span.parent_span_id.hex(), "kind": span.kind, "attributes": _attributes(span.attributes),
    }


@contextlib.contextmanager
def receiver() -> Iterator[tuple[Receiver, int]]:
    """The receiver served on a port it bound itself (port 0), and that port."""
    spans = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            spans.take(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield spans, server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Receiver]]:
    with receiver() as (spans, port):
        env = {
            "GATEWAY_TRACING__OTLP_ENDPOINT": f"http://127.0.0.1:{port}/v1/traces",
            "GATEWAY_TRACING__SERVICE_NAME": "gateway-under-test",
            "GATEWAY_TRACING__ENGINE_SPANS": "true",
            "GATEWAY_ENGINE__ENFORCE_EAGER": "true",
            "GATEWAY_WARMUP": "false",
            "GATEWAY_LOG_FORMAT": "json",
        }
        folder: Path = tmp_path_factory.mktemp("traced")
        with gateway_process(folder, env) as (base, _):
            yield base, spans


@pytest.mark.parametrize("stream", [False, True])
def test_a_requests_trace_reaches_the_collector(traced: tuple[str, Receiver], stream: bool) -> None:
    base, spans = traced
    trace_id = CALLER_TRACE[:-1] + ("1" if stream else "0")  # one trace per case
    body = {"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 5, "temperature": 0.7, "stream": stream}
    headers = {"traceparent": f"00-{trace_id}-{CALLER_SPAN}-01"}
    response = httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert response.status_code == 200
    response.read()

    server = spans.wait_for(f"chat {MODEL}", trace_id)
    assert server["service"] == "gateway-under-test"
    assert server["parent"] == CALLER_SPAN
    attributes = server["attributes"]
    assert attributes["gen_ai.request.model"] == MODEL
    assert attributes["gen_ai.response.model"] == MODEL
    assert attributes["gen_ai.request.temperature"] == 0.7
    assert attributes["gen_ai.request.max_tokens"] == 5
    assert attributes["gen_ai.usage.output_tokens"] == 5
    assert attributes["gen_ai.usage.input_tokens"] > 5
    assert attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert "gen_ai.input.messages" not in attributes  # no prompt text: log_prompts is off

    first = spans.wait_for("engine.first_token", trace_id)
    decode = spans.wait_for("engine.decode", trace_id)
    assert first["parent"] == server["span_id"]
    assert decode["parent"] == server["span_id"]
    # vLLM's own span, exported by its front end, under the engine span the gateway passed it
    engine = spans.wait_for("llm_request", trace_id)
    assert engine["parent"] == first["span_id"]
    assert engine["attributes"]["gen_ai.usage.completion_tokens"] == 5
