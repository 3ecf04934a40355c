from __future__ import annotations

import structlog
import structlog.testing
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from tests.fakes import fake_settings

MODEL = "fake-model"
HELLO = [{"role": "user", "content": "hi"}]


def scrape(client: TestClient) -> dict[tuple[str, tuple], float]:
    samples = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_count_requests_tokens_and_latency(client: TestClient) -> None:
    before = scrape(client)
    for stream in (False, True):
        body = {"model": MODEL, "messages": HELLO, "max_tokens": 4, "stream": stream}
        assert client.post("/v1/chat/completions", json=body).status_code == 200
    client.post("/v1/chat/completions", json={"model": "nope", "messages": HELLO})
    after = scrape(client)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    route = "/v1/chat/completions"
    assert delta("gateway_requests_total", model=MODEL, route=route, status="200") == 2
    assert delta("gateway_requests_total", model="", route=route, status="404") == 1
    assert delta("gateway_completion_tokens_total", model=MODEL) == 8
    assert delta("gateway_prompt_tokens_total", model=MODEL) > 0
    assert delta("gateway_time_to_first_token_seconds_count", model=MODEL) == 2
    assert delta("gateway_inter_token_latency_seconds_count", model=MODEL) == 6
    assert delta("gateway_time_per_output_token_seconds_count", model=MODEL) == 2
    assert delta("gateway_request_duration_seconds_count", model=MODEL, route=route) == 2
    assert value(after, "gateway_requests_in_flight", model=MODEL) == 0


def test_access_log_carries_request_id_and_tokens(client: TestClient) -> None:
    headers = {"X-Request-ID": "req-42"}
    with structlog.testing.capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
        client.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO, "max_tokens": 3}, headers=headers)
    line = next(m for m in logs if m["event"] == "request" and m.get("request_id") == "req-42")
    assert line["model"] == MODEL
    assert line["completion_tokens"] == 3
    assert line["status"] == 200
    assert line["prompt_tokens"] > 0
    assert line["ttft_s"] >= 0


def test_the_access_line_cuts_a_long_path(client: TestClient) -> None:
    with structlog.testing.capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
        assert client.get("/v1/" + "a" * 5000, headers={"X-Request-ID": "long-path"}).status_code == 404
    line = next(m for m in logs if m["event"] == "request" and m.get("request_id") == "long-path")
    assert line["path"] == "/v1/" + "a" * 1020 + "..."


def test_prompts_are_logged_only_when_asked(engine) -> None:
    from gateway.app import create_app

    for log_prompts in (False, True):
        app = create_app(fake_settings(log_prompts=log_prompts), engine_starter=lambda es: engine)
        with TestClient(app) as client, structlog.testing.capture_logs() as logs:
            client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "secret words"}], "max_tokens": 2})
        line = next(m for m in logs if m["event"] == "request")
        assert ("secret words" in str(line)) is log_prompts
        assert (line.get("output") == ["the quick"]) is log_prompts


