"""Traces over real OTLP/HTTP from a real gateway on the real engine: the session's gateway exports
its traces, vLLM's own spans on, to a small OTLP receiver (tests/otlp_receiver.py, started by the
conftest), and a request's trace is read back as the receiver got it: the caller's trace continued,
the GenAI attributes, the stages, and vLLM's `llm_request` span under the gateway's engine span."""

from __future__ import annotations

import httpx
import pytest

from tests.integration.conftest import MODEL, SERVICE_NAME
from tests.otlp_receiver import Receiver

pytestmark = [pytest.mark.integration, pytest.mark.gateway_only("the gateway's own traces")]
CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def traced(server: str, otlp: tuple[Receiver, int]) -> tuple[str, Receiver]:
    return server, otlp[0]


@pytest.mark.parametrize("stream", [False, True])
def test_a_requests_trace_reaches_the_collector(traced: tuple[str, Receiver], stream: bool) -> None:
    base, spans = traced
    trace_id = CALLER_TRACE[:-1] + ("1" if stream else "0")  # one trace per case
    body = {"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 5, "temperature": 0.7, "stream": stream}
    headers = {"traceparent": f"00-{trace_id}-{CALLER_SPAN}-01", "Cache-Control": "no-cache"}  # to the engine
    response = httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert response.status_code == 200
    response.read()

    server = spans.wait_for(f"chat {MODEL}", trace_id)
    assert server["service"] == SERVICE_NAME
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
