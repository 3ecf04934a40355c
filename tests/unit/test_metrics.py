from __future__ import annotations

import pytest
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


def test_observations_add_up_to_the_same_exposition_as_observe() -> None:
    """Observations writes into prometheus_client's internals: the exposition must equal observe's,
    bucket by bucket, for values on, between and past the bounds, before and after a flush."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from gateway.telemetry.metrics import TOKEN_BUCKETS, Observations

    values = [0.0, 0.001, 0.0011, 0.05, 0.3, 4.9, 5.0, 7.5, 1e9, -0.5] * 10  # more than FLUSH_EVERY in all
    registry = {name: CollectorRegistry() for name in ("observe", "observations")}
    histograms = {
        name: Histogram("gaps_seconds", "gaps", ["model"], buckets=TOKEN_BUCKETS, registry=registry[name])
        for name in registry
    }
    for value in values:
        histograms["observe"].labels("m").observe(value)
    observations = Observations(histograms["observations"].labels("m"))
    for value in values[:70]:
        observations.add(value)

    def exposed(name: str) -> dict[tuple[str, str], float]:
        families = text_string_to_metric_families(generate_latest(registry[name]).decode())
        return {(s.name, s.labels.get("le", "")): s.value for f in families for s in f.samples if "_created" not in s.name}

    assert exposed("observations") != exposed("observe")  # 6 still pending
    for value in values[70:]:
        observations.add(value)
    observations.flush()
    observations.flush()  # nothing pending: adds nothing
    observed, added = exposed("observe"), exposed("observations")
    assert added == pytest.approx(observed, rel=1e-12)  # the sum adds in another order
    assert len(observed) == len(TOKEN_BUCKETS) + 3  # the buckets, +Inf, count, sum


def test_loop_only_metrics_expose_what_prometheus_client_would(monkeypatch: pytest.MonkeyPatch) -> None:
    """`labelled` on a LOOP_ONLY metric changes the child's values without their lock: the same
    exposition (values, sums in the same order, buckets; a NaN in none) as prometheus_client's own
    calls, the child's own calls adding to the same values, and Observations on the same child."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from gateway.telemetry import metrics

    def made(registry: CollectorRegistry) -> tuple[Counter, Gauge, Histogram]:
        return (Counter("hits", "hits", ["route"], registry=registry),
                Gauge("busy", "busy", ["model"], registry=registry),
                Histogram("wait_seconds", "wait", ["model"], buckets=metrics.TOKEN_BUCKETS, registry=registry))

    plain, loop = CollectorRegistry(), CollectorRegistry()
    (counter, gauge, histogram), fast = made(plain), made(loop)
    monkeypatch.setattr(metrics, "LOOP_ONLY", frozenset(fast))
    values = [0.0, 0.001, 0.0011, 0.05, 0.3, 4.9, 5.0, 7.5, 1e9, -0.5, float("nan"), 0.1 + 0.2]
    fronts = [metrics.labelled(metric, "a") for metric in fast]
    assert all(type(front).__name__.endswith("Front") for front in fronts)
    for value in values:
        counter.labels("a").inc(abs(value) if value == value else 1)
        fronts[0].inc(abs(value) if value == value else 1)
        histogram.labels("a").observe(value)
        fronts[2].observe(value)
    counter.labels("a").inc()
    fast[0].labels("a").inc()  # through the child: the same value
    gauge.labels("a").inc(3)
    gauge.labels("a").dec()
    gauge.labels("b").set(7)
    fronts[1].inc(3)
    fronts[1].dec()
    metrics.labelled(fast[1], "b").set(7)
    observations = metrics.Observations(metrics.labelled(fast[2], "b"))
    for value in values[:10]:  # no NaN: Observations counts one in the first bucket (observe in none)
        observations.add(value)
        histogram.labels("b").observe(value)
    observations.flush()

    def exposed(registry: CollectorRegistry) -> list[str]:
        return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]

    assert exposed(loop) == exposed(plain)
    with pytest.raises(ValueError, match="non-negative"):
        fronts[0].inc(-1)
    assert metrics.labelled(counter, "a") is not counter.labels("a") or counter not in metrics.LOOP_ONLY
    assert metrics.labelled(counter, "c") is counter.labels("c")  # not LOOP_ONLY: the child itself
