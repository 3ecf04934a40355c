"""The alert rules and dashboard parse, ask for what the issue names, and read only gateway
metrics that exist (vLLM's own are checked on the real engine in tests/integration); every serving
build of k8s/ ships them, with a ServiceMonitor that finds the gateway's /metrics."""

from __future__ import annotations

import json

import pytest
import yaml
from starlette.testclient import TestClient

from gateway.apis.routes import TABLE
from gateway.web.table import UNMATCHED
from tests.tooling.k8s import K8S, SERVING, built, matches, one
from tests.tooling.monitoring import (
    alert_rules,
    all_exprs,
    dashboard_exprs,
    exposed_names,
    is_exposed,
    metric_names,
    selections,
)


def test_every_expression_parses() -> None:
    exprs = all_exprs()
    assert len(exprs) > 15
    for expr in exprs:
        assert metric_names(expr), expr


def test_alert_rules_cover_the_four_alerts() -> None:
    rules = {rule["alert"]: rule for rule in alert_rules()}
    assert all(rule["for"] == "5m" for rule in rules.values())
    ttft = rules["LLMGatewayTimeToFirstTokenHigh"]["expr"]
    assert "0.99" in ttft
    assert "> 0.8" in ttft
    assert "gateway_time_to_first_token_seconds_bucket" in ttft
    assert "vllm:kv_cache_usage_perc" in rules["LLMGatewayKVCacheNearlyFull"]["expr"]
    assert "> 0.01" in rules["LLMGatewayServerErrors"]["expr"]
    assert "< 0.99" in rules["LLMGatewaySuccessRateLow"]["expr"]


def test_request_ratios_count_the_api_routes_only() -> None:
    """Probes and scrapes (/health, /ready, /metrics) would dilute the 5xx and success ratios: every
    read of gateway_requests_total, in the alert rules and on the dashboard, keeps exactly the API
    routes of the route table (route labels are table paths, or `unmatched`)."""
    api = TABLE.paths("api")
    labels = api | TABLE.paths("ops", "open") | {UNMATCHED}
    rules = {rule["alert"]: rule["expr"] for rule in alert_rules()}
    ratios = [rules["LLMGatewayServerErrors"], rules["LLMGatewaySuccessRateLow"]]
    reads = [keeps for expr in ratios + dashboard_exprs() for keeps in selections(expr, "gateway_requests_total")]
    assert len(reads) == 2 * 2 + 3  # numerator and denominator of both alerts; the dashboard's three
    for keeps in reads:
        assert {label for label in labels if keeps("route", label)} == api
    assert all(not keeps("route", "/health") for expr in all_exprs() for keeps in selections(expr, "gateway_requests_total"))


def test_gateway_metrics_read_by_rules_exist(client: TestClient) -> None:
    names = exposed_names(client.get("/metrics").text)
    wanted = {m for expr in all_exprs() for m in metric_names(expr) if m.startswith("gateway_")}
    missing = [m for m in sorted(wanted) if not is_exposed(m, names)]
    assert not missing


@pytest.mark.parametrize("name", SERVING)
def test_monitoring(name: str) -> None:
    objects = built(name)
    service = one(objects, "Service", "llm-gateway")
    monitor = one(objects, "ServiceMonitor", "llm-gateway")
    assert matches(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}

    rules = one(objects, "PrometheusRule", "llm-gateway")
    alerts = yaml.safe_load((K8S / "monitoring" / "alerts.yaml").read_text())
    assert rules["spec"] == alerts["spec"]

    dashboard = one(objects, "ConfigMap", "llm-gateway-grafana-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    [content] = dashboard["data"].values()
    assert json.loads(content) == json.loads(
        (K8S / "monitoring" / "grafana-dashboard.json").read_text()
    )
