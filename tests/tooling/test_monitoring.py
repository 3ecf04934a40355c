"""The alert rules and dashboard parse, ask for what the issue names, and read only gateway
metrics that exist (vLLM's own are checked on the real engine in tests/integration)."""

from __future__ import annotations

from starlette.testclient import TestClient

from tests.tooling.monitoring import alert_rules, all_exprs, exposed_names, is_exposed, metric_names


def test_every_expression_parses() -> None:
    exprs = all_exprs()
    assert len(exprs) > 15
    for expr in exprs:
        assert metric_names(expr), expr


def test_alert_rules_cover_the_four_alerts() -> None:
    rules = {rule["alert"]: rule for rule in alert_rules()}
    assert all(rule["for"] == "5m" for rule in rules.values())
    ttft = rules["LLMGatewayTimeToFirstTokenHigh"]["expr"]
    assert "0.99" in ttft and "> 0.8" in ttft and "gateway_time_to_first_token_seconds_bucket" in ttft
    assert "vllm:kv_cache_usage_perc" in rules["LLMGatewayKVCacheNearlyFull"]["expr"]
    assert "> 0.01" in rules["LLMGatewayServerErrors"]["expr"]
    assert "< 0.99" in rules["LLMGatewaySuccessRateLow"]["expr"]


def test_gateway_metrics_read_by_rules_exist(client: TestClient) -> None:
    names = exposed_names(client.get("/metrics").text)
    wanted = {m for expr in all_exprs() for m in metric_names(expr) if m.startswith("gateway_")}
    missing = [m for m in sorted(wanted) if not is_exposed(m, names)]
    assert not missing
