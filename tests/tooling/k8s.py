"""Reading k8s/ for the tooling tests: the kustomize builds (`kubectl kustomize`), the objects in them,
the environment a container gets, the gateway's Settings that environment makes, and the Dockerfiles.

Needs `kubectl` (or `kustomize`) on PATH; nothing here talks to a cluster or a registry.
"""

from __future__ import annotations

import base64
import functools
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from engine.models import default_model_dir
from gateway.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
IMAGES = K8S / "images"
BUILDS = {
    "base": K8S / "base",
    "gpu": K8S / "overlays" / "gpu",
    "cpu": K8S / "overlays" / "cpu",
    "tls": K8S / "overlays" / "tls",  # gpu with components/tls-edge and components/tls-pod
    "routed": K8S / "overlays" / "routed",  # gpu with components/inference-pool
    "multinode": K8S / "examples" / "multinode",
}
SERVING = ("base", "gpu", "cpu", "tls", "routed")  # the builds with the gateway's Deployment
COMPONENTS = K8S / "components"
KUBERNETES_VERSION = "1.30.0"  # the oldest Kubernetes the manifests target
# Custom resources: kubernetes-validate ships only the built-in schemas (see test_k8s_manifests.py);
# those of the Gateway API and the Inference Extension are validated against their CRDs in
# tests/tooling/crds (test_k8s_pool.py).
CRDS = {
    ("inference.networking.k8s.io/v1", "InferencePool"),
    ("gateway.networking.k8s.io/v1", "HTTPRoute"),
    ("gateway.networking.k8s.io/v1", "Gateway"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"),
    ("cert-manager.io/v1", "Certificate"),
    ("cert-manager.io/v1", "Issuer"),
}
HPA_METRIC = "gateway_requests_in_flight"


# ---------------------------------------------------------------------------------------------
# building and reading the manifests


def kustomize_command() -> list[str]:
    beside_python = Path(sys.executable).parent / "kubectl"  # e.g. from a wheel in the venv
    if kubectl := str(beside_python) if beside_python.is_file() else shutil.which("kubectl"):
        return [kubectl, "kustomize"]
    if kustomize := shutil.which("kustomize"):
        return [kustomize, "build"]
    pytest.fail("neither kubectl nor kustomize is on PATH: the manifests cannot be built")


def kustomize(directory: Path) -> list[dict[str, Any]]:
    result = subprocess.run(
        [*kustomize_command(), str(directory)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, f"kustomize {directory}:\n{result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@functools.cache
def _built(name: str) -> tuple[dict[str, Any], ...]:
    return tuple(kustomize(BUILDS[name]))


def built(name: str) -> list[dict[str, Any]]:
    return json.loads(json.dumps(_built(name)))  # a deep copy: tests may not change the cache


def one(objects: list[dict], kind: str, name: str | None = None) -> dict:
    found = [
        o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def pod_specs(objects: list[dict]) -> list[dict]:
    specs = []
    for obj in objects:
        if obj["kind"] in ("Deployment", "StatefulSet", "Job"):
            specs.append(obj["spec"]["template"]["spec"])
        elif obj["kind"] == "LeaderWorkerSet":
            template = obj["spec"]["leaderWorkerTemplate"]
            specs += [template["leaderTemplate"]["spec"], template["workerTemplate"]["spec"]]
    return specs


def gateway_pod(objects: list[dict]) -> tuple[dict, dict, dict]:
    """(Deployment, pod template, gateway container) of a serving build."""
    deployment = one(objects, "Deployment", "llm-gateway")
    template = deployment["spec"]["template"]
    containers = template["spec"]["containers"]
    assert len(containers) == 1
    return deployment, template, containers[0]


def config_data(objects: list[dict], kind: str, name: str) -> dict[str, str]:
    obj = one(objects, kind, name)
    data = dict(obj.get("stringData") or {})
    if kind == "Secret":
        data |= {k: base64.b64decode(v).decode() for k, v in (obj.get("data") or {}).items()}
    else:
        data |= obj.get("data") or {}
    return data


def container_env(objects: list[dict], container: dict) -> dict[str, str]:
    """The environment a container gets from its envFrom sources and env entries."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if ref := source.get("configMapRef"):
            env |= config_data(objects, "ConfigMap", ref["name"])
        elif ref := source.get("secretRef"):
            present = any(
                o["kind"] == "Secret" and o["metadata"]["name"] == ref["name"] for o in objects
            )
            if present or not ref.get("optional"):
                env |= config_data(objects, "Secret", ref["name"])
    env |= {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    return env


def gateway_env(objects: list[dict]) -> dict[str, str]:
    return container_env(objects, gateway_pod(objects)[2])


def named_port(container: dict, name: str) -> int:
    ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    return ports[name]


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def default_settings() -> Settings:
    return Settings(_env_file=None)


def settings_from(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> Settings:
    for key, value in env.items():
        if key.startswith("GATEWAY_"):
            monkeypatch.setenv(key, value)
    return Settings(_env_file=None)


def is_settings_field(env_name: str) -> bool:
    """GATEWAY_ENGINE__MAX_MODEL_LEN names Settings.engine.max_model_len (unknown names are ignored
    by pydantic-settings, so a typo would pass silently: hence this check)."""
    model: type[BaseModel] = Settings
    parts = env_name.removeprefix("GATEWAY_").lower().split("__")
    for depth, part in enumerate(parts):
        field = model.model_fields.get(part)
        if field is None:
            return False
        if depth < len(parts) - 1:
            if not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
                return False
            model = field.annotation
    return True


# ---------------------------------------------------------------------------------------------
# Dockerfiles


def dockerfile(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    instructions, pending = [], ""
    for raw in (IMAGES / name).read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, rest = (pending + line).partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
        pending = ""
    return instructions


def dockerfile_env(name: str) -> dict[str, str]:
    env = {}
    for keyword, rest in dockerfile(name):
        if keyword == "ENV":
            env |= dict(token.split("=", 1) for token in shlex.split(rest))
    return env


def baked_model_dir(name: str) -> Path:
    """Where the image converts the default model (`engine.models prepare --cache-dir DIR`)."""
    runs = " ".join(rest for keyword, rest in dockerfile(name) if keyword == "RUN")
    found = re.search(r"-m engine\.models prepare --cache-dir (\S+)", runs)
    assert found, f"{name} does not prepare the default model"
    return default_model_dir(Path(found.group(1)))
