"""Metrics and logs after real traffic on the real engine."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.conftest import MODEL
from tests.tooling.monitoring import all_exprs, exposed_names, is_exposed, metric_names
from tests.waits import until_sync

pytestmark = [pytest.mark.integration, pytest.mark.gateway_only("vLLM's server has no gateway_* metrics")]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# long enough to fill whole KV blocks, so that repeating it hits vLLM's prefix cache
SHARED = [{"role": "system", "content": "You are a geography tutor. " * 60}, *QUESTION]
ROUTE = "/v1/chat/completions"


def samples(base_url: str) -> dict[tuple[str, tuple], float]:
    result = {}
    for family in text_string_to_metric_families(httpx.get(f"{base_url}/metrics").text):
        for s in family.samples:
            result[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return result


def total(snapshot: dict, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in snapshot.items() if n == name and all((k, v2) in ls for k, v2 in labels.items()))


def test_metrics_after_real_traffic(sdk: openai.OpenAI, base_url: str) -> None:
    before = samples(base_url)
    usage_tokens = 0
    for _ in range(3):
        usage_tokens += sdk.chat.completions.create(model=MODEL, messages=SHARED, max_tokens=8).usage.completion_tokens
    stream = sdk.chat.completions.create(model=MODEL, messages=SHARED, max_tokens=8, stream=True, stream_options={"include_usage": True})
    usage_tokens += [c for c in stream][-1].usage.completion_tokens

    def settled(now: dict[tuple[str, tuple], float]) -> bool:  # vLLM's gauges and counters follow its engine steps
        return (total(now, "vllm:request_success_total") - total(before, "vllm:request_success_total") >= 4
                and total(now, "vllm:num_requests_running") == 0
                and total(now, "gateway_requests_in_flight", model=MODEL) == 0)

    after = until_sync(lambda: settled(now := samples(base_url)) and now, what="the metrics settled", step_s=0.2)

    def delta(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    assert delta("gateway_requests_total", model=MODEL, route=ROUTE, status="200") == 4
    assert delta("gateway_request_duration_seconds_count", model=MODEL, route=ROUTE) == 4
    assert delta("gateway_time_to_first_token_seconds_count", model=MODEL) == 4
    assert delta("gateway_completion_tokens_total", model=MODEL) == usage_tokens
    assert delta("gateway_prompt_tokens_total", model=MODEL) > 4 * 300
    assert delta("gateway_inter_token_latency_seconds_count", model=MODEL) > 0
    assert delta("gateway_time_per_output_token_seconds_count", model=MODEL) == 4
    assert 0 < total(after, "gateway_time_to_first_token_seconds_sum") < 60 * total(after, "gateway_time_to_first_token_seconds_count")
    assert total(after, "gateway_requests_in_flight", model=MODEL) == 0
    # the engine's own statistics, under vLLM's names
    assert delta("vllm:request_success_total") >= 4
    assert delta("vllm:generation_tokens_total") >= usage_tokens
    assert delta("vllm:prefix_cache_queries_total") > 0
    assert delta("vllm:prefix_cache_hits_total") > 0  # the same prompt four times
    assert total(after, "vllm:num_requests_running") == 0
    assert 0 <= total(after, "vllm:kv_cache_usage_perc") <= 1


def test_every_metric_of_dashboard_and_alerts_is_exposed(base_url: str) -> None:
    names = exposed_names(httpx.get(f"{base_url}/metrics").text)
    wanted = {m for expr in all_exprs() for m in metric_names(expr)}
    assert any(m.startswith("vllm:") for m in wanted)
    missing = [m for m in sorted(wanted) if not is_exposed(m, names)]
    assert not missing
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:num_preemptions", "vllm:prefix_cache_hits", "vllm:prefix_cache_queries"):
        assert is_exposed(name, names), name


def test_access_log_line_carries_request_id_and_tokens(base_url: str, server_log: Path) -> None:
    headers = {"X-Request-ID": "obs-test-123"}
    response = httpx.post(f"{base_url}{ROUTE}", json={"model": MODEL, "messages": QUESTION, "max_tokens": 5}, headers=headers, timeout=60)
    assert response.headers["x-request-id"] == "obs-test-123"
    usage = response.json()["usage"]
    generated = httpx.get(f"{base_url}/health").headers["x-request-id"]
    assert len(generated) == 32

    def logged() -> dict | None:
        records = [json.loads(raw) for raw in server_log.read_text().splitlines()
                   if raw.startswith("{") and '"obs-test-123"' in raw]
        return next((record for record in records if record.get("event") == "request"), None)

    line = until_sync(logged, 30, "the access line", step_s=0.1)
    assert line["status"] == 200
    assert line["model"] == MODEL
    assert line["path"] == ROUTE
    assert line["prompt_tokens"] == usage["prompt_tokens"]
    assert line["completion_tokens"] == usage["completion_tokens"]
    assert line["ttft_s"] > 0
    assert line["duration_s"] >= line["ttft_s"]
    assert "What is the capital" not in json.dumps(line)  # prompts are not logged by default


def test_vllm_log_lines_are_json_too(base_url: str, server_log: Path) -> None:
    """With GATEWAY_LOG_FORMAT=json, vLLM's own lines (front end, engine core, worker) are JSON
    objects as well, not its "(EngineCore pid=...) INFO ..." text."""
    httpx.get(f"{base_url}/health", timeout=10)
    lines = server_log.read_text().splitlines()
    text_lines = [raw for raw in lines if re.match(r"^\((\w|\s)+ pid=\d+\) (DEBUG|INFO|WARNING|ERROR) ", raw)]
    assert text_lines == []
    records = [json.loads(raw) for raw in lines if raw.startswith("{")]
    vllm_records = [r for r in records if str(r.get("name", "")).startswith("vllm")]
    assert vllm_records, "no vLLM log line at all: the check above proves nothing"
    assert {r["process"] for r in vllm_records} != {vllm_records[0]["process"]}, "only one process's lines"
    assert all(r["levelname"] in ("INFO", "WARNING", "ERROR", "CRITICAL") for r in vllm_records)
