"""k8s/README.md, the deploy guide: its YAML examples (the metrics adapter rule, the production
overlay, the routing examples) agree with the manifests and build."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from urllib.parse import urlparse

import yaml

from tests.tooling.k8s import (
    BUILDS,
    HPA_METRIC,
    K8S,
    built,
    config_data,
    gateway_pod,
    kustomize,
    matches,
    named_port,
    one,
)


def readme_yaml_blocks() -> list[str]:
    return re.findall(r"```yaml\n(.*?)```", (K8S / "README.md").read_text(), re.DOTALL)


def test_readme_adapter_rule_serves_the_hpa_metric() -> None:
    [values] = [yaml.safe_load(b) for b in readme_yaml_blocks() if "seriesQuery" in b]
    rules = {rule["name"]["as"]: rule for rule in values["rules"]["custom"]}
    rule = rules[HPA_METRIC]
    assert rule["seriesQuery"].startswith(HPA_METRIC + "{")
    assert re.fullmatch(rule["name"]["matches"], HPA_METRIC)
    assert rule["resources"]["overrides"] == {
        "namespace": {"resource": "namespace"},
        "pod": {"resource": "pod"},
    }
    for placeholder in ("<<.Series>>", "<<.LabelMatchers>>", "<<.GroupBy>>"):
        assert placeholder in rule["metricsQuery"]


def test_readme_production_overlay_builds(tmp_path: Path) -> None:
    [block] = [
        b
        for b in readme_yaml_blocks()
        if b.startswith("# k8s/overlays/production/kustomization.yaml")
    ]
    overlay = tmp_path / "production"
    overlay.mkdir()
    gpu = os.path.relpath(BUILDS["gpu"], overlay)
    (overlay / "kustomization.yaml").write_text(block.replace("- ../gpu", f"- {gpu}"))
    (overlay / "secrets.env").write_text(
        'GATEWAY_API_KEYS=["sk-test"]\nGATEWAY_CACHE__REDIS_URL=redis://redis.test:6379/0\n'
    )
    objects = kustomize(overlay)
    secret = config_data(objects, "Secret", "llm-gateway-secrets")
    assert json.loads(secret["GATEWAY_API_KEYS"]) == ["sk-test"]
    assert secret["GATEWAY_CACHE__REDIS_URL"] == "redis://redis.test:6379/0"
    for kind in ("ServiceMonitor", "PrometheusRule"):
        assert (
            one(objects, kind, "llm-gateway")["metadata"]["labels"]["release"]
            == "kube-prometheus-stack"
        )


def test_readme_routing_examples_match_the_manifests() -> None:
    blocks = readme_yaml_blocks()
    [pool] = [
        d for b in blocks for d in yaml.safe_load_all(b) if d and d.get("kind") == "InferencePool"
    ]
    _, template, container = gateway_pod(built("gpu"))
    assert matches(pool["spec"]["selector"]["matchLabels"], template["metadata"]["labels"])
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [named_port(container, "http")]

    [front] = [yaml.safe_load(b) for b in blocks if "kind: remote" in b]
    services = {
        o["metadata"]["name"]
        for name in ("gpu", "multinode")
        for o in built(name)
        if o["kind"] == "Service"
    }
    for entry in front["models"]:
        url = urlparse(entry["url"])
        service, namespace = url.hostname.split(".")[:2]
        assert (service in services, namespace, url.port, url.path) == (
            True,
            "llm-gateway",
            8000,
            "/v1",
        )
        assert entry["upstream_model"]
