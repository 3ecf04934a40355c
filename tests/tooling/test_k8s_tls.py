"""k8s/components/tls-edge and tls-pod (and k8s/overlays/tls, both on the gpu overlay): the Ingress
serves the API routes and nothing else with cert-manager's certificate; the pods serve HTTPS from the
serving certificate's Secret, mounted so that a renewal reaches the gateway; probes, Prometheus and
the Ingress speak HTTPS to them and verify against the private CA. Each component also builds
alone. (test_k8s_manifests.py validates the objects of k8s/overlays/tls with the other builds.)"""

from __future__ import annotations

import os
import re
from pathlib import Path

import kubernetes_validate
import pytest

from gateway.apis.routes import TABLE
from tests.tooling.k8s import (
    BUILDS,
    COMPONENTS,
    CRDS,
    KUBERNETES_VERSION,
    built,
    default_settings,
    gateway_env,
    gateway_pod,
    kustomize,
    one,
    settings_from,
)

NAMESPACE = "llm-gateway"
SIZE_UNITS = {"k": 1024, "m": 1024**2, "g": 1024**3}


def with_components(tmp_path: Path, base: str, *components: str) -> list[dict]:
    """An overlay of `base` (a build of BUILDS) with the named components of k8s/components."""
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    lines = ["apiVersion: kustomize.config.k8s.io/v1beta1", "kind: Kustomization",
             f"namespace: {NAMESPACE}", "labels:", "  - pairs:", "      app.kubernetes.io/part-of: llm-gateway",
             "resources:", f"  - {os.path.relpath(BUILDS[base], overlay)}", "components:"]
    lines += [f"  - {os.path.relpath(COMPONENTS / c, overlay)}" for c in components]
    (overlay / "kustomization.yaml").write_text("\n".join(lines) + "\n")
    return kustomize(overlay)


def path_matches(rule: dict, path: str) -> bool:
    """Kubernetes Ingress path matching: Exact, or Prefix by whole path elements."""
    if rule["pathType"] == "Exact":
        return path == rule["path"]
    prefix = rule["path"].rstrip("/")
    return path == prefix or path.startswith(prefix + "/")


def certificate_for_secret(objects: list[dict], secret: str) -> dict:
    [certificate] = [o for o in objects if o["kind"] == "Certificate" and o["spec"]["secretName"] == secret]
    return certificate


def issuer_resolves(objects: list[dict], certificate: dict) -> bool:
    ref = certificate["spec"]["issuerRef"]
    if ref["kind"] == "ClusterIssuer":
        return True  # cluster-wide, made once by the operator (k8s/README.md)
    return any(o["kind"] == "Issuer" and o["metadata"]["name"] == ref["name"] for o in objects)


def ingress_paths(ingress: dict) -> list[dict]:
    return [p for rule in ingress["spec"]["rules"] for p in rule["http"]["paths"]]


# ---------------------------------------------------------------------------------------------
# TLS at the edge


def test_edge_certificate_covers_the_ingress() -> None:
    objects = built("tls")
    ingress = one(objects, "Ingress", "llm-gateway")
    [tls] = ingress["spec"]["tls"]
    certificate = certificate_for_secret(objects, tls["secretName"])
    assert set(tls["hosts"]) <= set(certificate["spec"]["dnsNames"])
    assert {rule["host"] for rule in ingress["spec"]["rules"]} <= set(tls["hosts"])
    assert certificate["spec"]["issuerRef"]["kind"] == "ClusterIssuer"
    assert issuer_resolves(objects, certificate)
    assert ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/force-ssl-redirect"] == "true"


def test_ingress_serves_the_api_routes_only() -> None:
    objects = built("tls")
    ingress = one(objects, "Ingress", "llm-gateway")
    service = one(objects, "Service", "llm-gateway")
    ports = {p["name"] for p in service["spec"]["ports"]}
    rules = ingress_paths(ingress)
    for rule in rules:
        backend = rule["backend"]["service"]
        assert backend["name"] == service["metadata"]["name"]
        assert backend["port"]["name"] in ports
    public = TABLE.paths("api", "open")
    unserved = [path for path in public if not any(path_matches(r, path) for r in rules)]
    assert not unserved, "API routes the Ingress does not pass on"
    exposed = [path for path in TABLE.paths("ops") if any(path_matches(r, path) for r in rules)]
    assert not exposed, "probe and scrape routes exposed to the internet"


def test_ingress_passes_streams_long_answers_and_large_bodies(clean_env: pytest.MonkeyPatch) -> None:
    annotations = one(built("tls"), "Ingress", "llm-gateway")["metadata"]["annotations"]
    nginx = {k.removeprefix("nginx.ingress.kubernetes.io/"): v for k, v in annotations.items()}
    assert nginx["proxy-buffering"] == "off"
    assert int(nginx["proxy-read-timeout"]) >= 300
    assert int(nginx["proxy-send-timeout"]) >= 300
    number, unit = re.fullmatch(r"(\d+)([kmg]?)", nginx["proxy-body-size"].lower()).groups()
    assert int(number) * SIZE_UNITS.get(unit, 1) >= default_settings().max_body_bytes, (
        "the gateway, not nginx, should answer an oversized body (OpenAI's error shape)"
    )


# ---------------------------------------------------------------------------------------------
# TLS to the pod


def test_pods_serve_https_from_the_serving_certificate(clean_env: pytest.MonkeyPatch) -> None:
    objects = built("tls")
    _, template, container = gateway_pod(objects)
    settings = settings_from(clean_env, gateway_env(objects)).tls
    assert settings.enabled
    assert settings.reload_interval_s > 0
    volumes = {v["name"]: v for v in template["spec"]["volumes"]}
    for file in (settings.cert_file, settings.key_file):
        [mount] = [m for m in container["volumeMounts"] if file.parent == Path(m["mountPath"])]
        assert "subPath" not in mount, "a subPath mount never sees the renewed Secret"
        secret = volumes[mount["name"]]["secret"]["secretName"]
        certificate = certificate_for_secret(objects, secret)
        assert file.name in ("tls.crt", "tls.key")
    assert issuer_resolves(objects, certificate)
    ca_issuer = one(objects, "Issuer", certificate["spec"]["issuerRef"]["name"])
    assert certificate_for_secret(objects, ca_issuer["spec"]["ca"]["secretName"])["spec"]["isCA"] is True
    service = one(objects, "Service", "llm-gateway")
    assert f"llm-gateway.{NAMESPACE}.svc" in certificate["spec"]["dnsNames"]
    assert [p.get("appProtocol") for p in service["spec"]["ports"]] == ["https"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["scheme"] == "HTTPS"
    assert template["metadata"]["annotations"]["prometheus.io/scheme"] == "https"


def test_prometheus_and_the_ingress_verify_the_pods() -> None:
    objects = built("tls")
    _, template, _ = gateway_pod(objects)
    [secret] = [v["secret"]["secretName"] for v in template["spec"]["volumes"] if "secret" in v]
    names = certificate_for_secret(objects, secret)["spec"]["dnsNames"]
    [endpoint] = one(objects, "ServiceMonitor", "llm-gateway")["spec"]["endpoints"]
    assert endpoint["scheme"] == "https"
    tls = endpoint["tlsConfig"]
    assert tls["serverName"] in names
    assert tls["ca"]["secret"] == {"name": secret, "key": "ca.crt"}
    assert tls["cert"]["secret"] == {"name": secret, "key": "tls.crt"}
    assert tls["keySecret"] == {"name": secret, "key": "tls.key"}
    nginx = one(objects, "Ingress", "llm-gateway")["metadata"]["annotations"]
    assert nginx["nginx.ingress.kubernetes.io/backend-protocol"] == "HTTPS"
    assert nginx["nginx.ingress.kubernetes.io/proxy-ssl-verify"] == "on"
    assert nginx["nginx.ingress.kubernetes.io/proxy-ssl-secret"] == f"{NAMESPACE}/{secret}"
    assert nginx["nginx.ingress.kubernetes.io/proxy-ssl-name"] in names


# ---------------------------------------------------------------------------------------------
# each component alone


def validate(objects: list[dict]) -> None:
    for obj in objects:
        if (obj["apiVersion"], obj["kind"]) not in CRDS:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    assert all(o["metadata"]["namespace"] == NAMESPACE for o in objects)


def test_edge_alone_proxies_plain_http_to_the_pods(tmp_path: Path, clean_env: pytest.MonkeyPatch) -> None:
    objects = with_components(tmp_path, "cpu", "tls-edge")
    validate(objects)
    annotations = one(objects, "Ingress", "llm-gateway")["metadata"]["annotations"]
    assert "nginx.ingress.kubernetes.io/backend-protocol" not in annotations
    assert not settings_from(clean_env, gateway_env(objects)).tls.enabled
    _, _, container = gateway_pod(objects)
    assert "scheme" not in container["readinessProbe"]["httpGet"]


def test_pod_tls_alone(tmp_path: Path, clean_env: pytest.MonkeyPatch) -> None:
    objects = with_components(tmp_path, "cpu", "tls-pod")
    validate(objects)
    assert not [o for o in objects if o["kind"] == "Ingress"]
    assert settings_from(clean_env, gateway_env(objects)).tls.enabled
    _, _, container = gateway_pod(objects)
    assert container["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
