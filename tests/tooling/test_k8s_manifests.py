"""k8s/: every kustomization builds (kubectl kustomize), every object validates offline against the
Kubernetes schemas (kubernetes-validate), the gateway's Deployment agrees with its one Settings object,
the autoscaler scales on a gateway metric, and the YAML is well-formed (yamllint).

Needs `kubectl` (or `kustomize`) on PATH and the dev packages kubernetes-validate and yamllint;
nothing here talks to a cluster.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from engine.config import EngineSettings
from tests.tooling.k8s import (
    BUILDS,
    CRDS,
    HPA_METRIC,
    K8S,
    KUBERNETES_VERSION,
    ROOT,
    SERVING,
    baked_model_dir,
    built,
    config_data,
    default_settings,
    dockerfile,
    dockerfile_env,
    gateway_env,
    gateway_pod,
    is_settings_field,
    matches,
    named_port,
    one,
    pod_specs,
    settings_from,
)

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
    assert seen >= CRDS
    for api_version, kind in seen:
        obj = {"apiVersion": api_version, "kind": kind, "metadata": {"name": "x"}}
        if (api_version, kind) in CRDS:
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        else:
            with contextlib.suppress(kubernetes_validate.ValidationError):  # a schema exists (this stub need not satisfy it)
                kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


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
    assert service_port["port"] == port
    assert service_port["targetPort"] in ("http", port)
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
    assert settings.cache.backend == "redis"
    assert settings.cache.redis_url.startswith("redis://")
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
    assert limit.endswith("Gi")
    assert settings.engine.kv_cache_memory_bytes < int(limit[:-2]) * 2**30


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

    import gateway.telemetry.metrics  # noqa: F401  (registers the gateway's metrics)

    assert HPA_METRIC in {family.name for family in REGISTRY.collect()}


# ---------------------------------------------------------------------------------------------
# the YAML


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
