"""k8s/README.md, the deploy guide: its YAML examples (the metrics adapter rule, the production
overlay, the routing examples, the TLS overlays and their ClusterIssuer) agree with the manifests
and build; the mTLS probe it gives passes against a real gateway with client certificates required."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import pytest
import trustme
import yaml

from gateway.settings import TLSSettings
from gateway.tenancy.tenants import read as read_keys_file
from tests.tls_support import serving
from tests.tooling.k8s import (
    BUILDS,
    COMPONENTS,
    HPA_METRIC,
    K8S,
    built,
    config_data,
    gateway_env,
    gateway_pod,
    is_settings_field,
    kustomize,
    matches,
    named_port,
    one,
    settings_from,
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
    _, template, container = gateway_pod(built("gpu"))
    for pool in [d for b in blocks for d in yaml.safe_load_all(b) if d and d.get("kind") == "InferencePool"]:
        assert matches(pool["spec"]["selector"]["matchLabels"], template["metadata"]["labels"])
        assert [p["number"] for p in pool["spec"]["targetPorts"]] == [named_port(container, "http")]
    # section 8 deploys the component and names only the current API (v1), none of v1alpha2's fields
    readme = (K8S / "README.md").read_text()
    routing = readme[readme.index("## 8. Routing"):readme.index("## 9. TLS")]
    assert "/metrics/router" in routing
    for path in ("components/inference-pool", "overlays/routed", "examples/picker-local"):
        assert path in routing, path
        assert (K8S / path).is_dir(), path
    for removed in ("inference.networking.x-k8s.io", "v1alpha2", "targetPortNumber", "extensionRef", "InferenceModel "):
        assert removed not in routing, removed

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


def readme_block(first_line: str) -> str:
    [block] = [b for b in readme_yaml_blocks() if b.startswith(first_line)]
    return block


def test_readme_cluster_issuer_is_the_one_the_edge_certificate_names() -> None:
    issuer = yaml.safe_load(readme_block("# clusterissuer.yaml"))
    objects = built("tls")
    ref = one(objects, "Certificate", "llm-gateway-edge")["spec"]["issuerRef"]
    assert (issuer["kind"], issuer["metadata"]["name"]) == (ref["kind"], ref["name"])
    [solver] = issuer["spec"]["acme"]["solvers"]
    ingress_class = one(objects, "Ingress", "llm-gateway")["spec"]["ingressClassName"]
    assert solver["http01"]["ingress"]["ingressClassName"] == ingress_class


@pytest.fixture
def mtls_build(tmp_path: Path) -> list[dict]:
    """The README's production-tls overlay (on the gpu overlay here) and its mTLS overlay, built."""
    overlays = tmp_path / "overlays"
    tls, mtls = overlays / "production-tls", overlays / "production-mtls"
    tls.mkdir(parents=True)
    mtls.mkdir()
    block = readme_block("# k8s/overlays/production-tls/kustomization.yaml")
    block = block.replace("- ../production ", f"- {os.path.relpath(BUILDS['gpu'], tls)} ")
    block = block.replace("../../components/", os.path.relpath(COMPONENTS, tls) + "/")
    (tls / "kustomization.yaml").write_text(block)
    (mtls / "kustomization.yaml").write_text(readme_block("# k8s/overlays/production-mtls/kustomization.yaml"))
    return kustomize(mtls)


def test_readme_tls_overlays_build(mtls_build: list[dict], clean_env: pytest.MonkeyPatch) -> None:
    objects = mtls_build
    ingress = one(objects, "Ingress", "llm-gateway")
    hosts = [ingress["spec"]["tls"][0]["hosts"], [r["host"] for r in ingress["spec"]["rules"]],
             one(objects, "Certificate", "llm-gateway-edge")["spec"]["dnsNames"]]
    assert hosts == [["llm.mycompany.com"]] * 3
    tls = settings_from(clean_env, gateway_env(objects)).tls
    assert tls.client_auth == "required"
    assert tls.ca_file.parent == tls.cert_file.parent
    _, _, container = gateway_pod(objects)
    assert container["startupProbe"]["tcpSocket"]["port"] == "http"
    for probe, path in (("readinessProbe", "/ready"), ("livenessProbe", "/health")):
        assert "httpGet" not in container[probe]
        command = container[probe]["exec"]["command"]
        assert command[:2] == ["python", "-c"]
        assert command[3] == path
        assert f":{named_port(container, 'http')}'" in command[2]


def test_readme_mtls_probe_passes_against_a_gateway_requiring_client_certificates(
    mtls_build: list[dict], clean_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The probe, run as the kubelet would, against the app served with the same settings and a
    Secret laid out as cert-manager's (ca.crt, tls.crt, tls.key): it passes, and fails on a 404."""
    _, _, container = gateway_pod(mtls_build)
    tls = settings_from(clean_env, gateway_env(mtls_build)).tls
    for key in [k for k in os.environ if k.startswith("GATEWAY_")]:
        clean_env.delenv(key)  # the app below takes the test's settings, not the pod's
    ca = trustme.CA()
    secret = tmp_path / "secret"
    secret.mkdir()
    leaf = ca.issue_cert("llm-gateway.llm-gateway.svc")
    ca.cert_pem.write_to_path(str(secret / tls.ca_file.name))
    leaf.cert_chain_pems[0].write_to_path(str(secret / tls.cert_file.name))
    leaf.private_key_pem.write_to_path(str(secret / tls.key_file.name))
    local = TLSSettings(**{**tls.model_dump(), **{k: secret / getattr(tls, k).name
                                                   for k in ("cert_file", "key_file", "ca_file")}})
    code = container["readinessProbe"]["exec"]["command"][2]
    with serving(local) as base:
        port = base.rsplit(":", 1)[1]
        code = code.replace(f"'{tls.cert_file.parent}/'", f"'{secret}/'")
        code = code.replace(f":{named_port(container, 'http')}'", f":{port}'")
        for path, status in (("/ready", 0), ("/health", 0), ("/nowhere", 1)):
            probe = subprocess.run([sys.executable, "-c", code, path], capture_output=True, timeout=60)
            assert probe.returncode == status, probe.stderr
        no_client_cert = code.replace("c.load_cert_chain", "(lambda *a: None)")
        assert subprocess.run([sys.executable, "-c", no_client_cert, "/ready"], capture_output=True,
                              timeout=60).returncode == 1


def test_readme_tenants_overlay_builds_and_mounts_a_valid_keys_file(tmp_path: Path) -> None:
    """Section 10's overlay on section 2's production overlay: the keys file reaches the pod as a
    volume (not a subPath: edits are reloaded), at the path GATEWAY_KEYS_FILE names, and it is a
    keys file the gateway accepts; the Redis setting it gives is a settings field."""
    production, tenants = tmp_path / "overlays" / "production", tmp_path / "overlays" / "production-tenants"
    production.mkdir(parents=True)
    tenants.mkdir()
    block = readme_block("# k8s/overlays/production/kustomization.yaml")
    (production / "kustomization.yaml").write_text(block.replace("- ../gpu", f"- {os.path.relpath(BUILDS['gpu'], production)}"))
    (production / "secrets.env").write_text('GATEWAY_API_KEYS=["sk-test"]\n')
    (tenants / "kustomization.yaml").write_text(readme_block("# k8s/overlays/production-tenants/kustomization.yaml"))
    (tenants / "keys.yaml").write_text(readme_block("# k8s/overlays/production-tenants/keys.yaml"))
    objects = kustomize(tenants)
    keys_path = Path(gateway_env(objects)["GATEWAY_KEYS_FILE"])
    _, template, container = gateway_pod(objects)
    [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == str(keys_path.parent)]
    assert "subPath" not in mount
    [volume] = [v for v in template["spec"]["volumes"] if v["name"] == mount["name"]]
    copy = tmp_path / keys_path.name
    copy.write_text(config_data(objects, "ConfigMap", volume["configMap"]["name"])[keys_path.name])
    assert set(read_keys_file(copy).keys) == {"research-batch", "support-bot"}
    redis_line = re.search(r"^(GATEWAY_LIMITS__REDIS_URL)=redis://", (K8S / "README.md").read_text(), re.MULTILINE)
    assert redis_line
    assert is_settings_field(redis_line.group(1))
    assert is_settings_field("GATEWAY_KEYS_FILE")
