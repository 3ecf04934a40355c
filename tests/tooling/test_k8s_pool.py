"""k8s/components/inference-pool (built in k8s/overlays/routed): the Gateway API and Inference Extension
objects validate against their CRDs (tests/tooling/crds, copied from upstream: the served version's
openAPIV3Schema with unknown fields refused, and the CEL rules that matter, by hand), the picker's
EndpointPickerConfig against its Go types, and the names, ports and selectors agree between the pool,
the picker (its flags, its Service, its config), the route, the Gateway, the NetworkPolicies and the
gateway's Deployment and Service. Each check returns its problems, so the tests can break a manifest
and see the check fail.

The built-in kinds of the same build are validated by test_k8s_manifests.py (kubernetes-validate).
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from gateway.apis.routes import TABLE
from tests.tooling.k8s import BUILDS, CRDS, K8S, built, gateway_pod, matches, named_port, one

CRD_DIR = Path(__file__).parent / "crds"
ROUTED = "routed"
POOL_GROUP = "inference.networking.k8s.io"
PICKER_IMAGE = "ghcr.io/llm-d/llm-d-router-endpoint-picker:v0.10.0"
CRD_FILES = {
    ("inference.networking.k8s.io", "InferencePool"): "inference.networking.k8s.io_inferencepools.yaml",
    ("gateway.networking.k8s.io", "HTTPRoute"): "gateway.networking.k8s.io_httproutes.yaml",
    ("gateway.networking.k8s.io", "Gateway"): "gateway.networking.k8s.io_gateways.yaml",
    ("gateway.networking.k8s.io", "GatewayClass"): "gateway.networking.k8s.io_gatewayclasses.yaml",
    ("llm-d.ai", "InferenceObjective"): "llm-d.ai_inferenceobjectives.yaml",
}
Objects = list[dict[str, Any]]


# ---------------------------------------------------------------------------------------------
# the CRDs' schemas, strict


def strict(schema: Any) -> Any:
    """The schema with unknown fields refused: `additionalProperties: false` wherever it lists
    properties and neither keeps unknown fields nor says what they may be (as the API server prunes
    them, a misspelt field would otherwise vanish silently)."""
    if isinstance(schema, dict):
        out = {key: strict(value) for key, value in schema.items()}
        if ("properties" in out and "additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    return schema


@functools.cache
def validator(group: str, kind: str, version: str) -> jsonschema.Draft7Validator:
    crd = yaml.safe_load((CRD_DIR / CRD_FILES[(group, kind)]).read_text())
    assert crd["spec"]["group"] == group
    assert crd["spec"]["names"]["kind"] == kind
    [served] = [v for v in crd["spec"]["versions"] if v["name"] == version and v["served"]]
    assert not served.get("deprecated"), f"{kind} {version} is deprecated"
    return jsonschema.Draft7Validator(strict(served["schema"]["openAPIV3Schema"]))


def schema_problems(obj: dict[str, Any]) -> list[str]:
    group, version = obj["apiVersion"].split("/")
    found = validator(group, obj["kind"], version).iter_errors(obj)
    return [f"{obj['kind']}/{obj['metadata']['name']} {list(e.absolute_path)}: {e.message}" for e in found]


# The CEL rules (x-kubernetes-validations) that the component's objects could break, by hand.

DURATION = re.compile(r"^(?:[0-9]{1,5}(?:h|m|s|ms)){1,4}$")


def seconds(duration: str) -> float:
    assert DURATION.match(duration), duration
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    return sum(int(n) * units[u] for n, u in re.findall(r"([0-9]+)(h|ms|m|s)", duration))


def cel_problems(obj: dict[str, Any]) -> list[str]:
    spec, problems = obj["spec"], []
    if obj["kind"] == "InferencePool":
        numbers = [p["number"] for p in spec["targetPorts"]]
        if len(numbers) != len(set(numbers)):
            problems.append("port number must be unique")
        ref = spec["endpointPickerRef"]
        if ref.get("kind", "Service") == "Service" and "port" not in ref:
            problems.append("port is required when kind is 'Service' or unspecified")
    elif obj["kind"] == "HTTPRoute":
        parents = [(p.get("group"), p.get("kind"), p["name"], p.get("sectionName")) for p in spec["parentRefs"]]
        if len(parents) != len(set(parents)):
            problems.append("parentRefs must be unique")
        for rule in spec["rules"]:
            for match in rule.get("matches", []):
                path = match.get("path", {})
                if path.get("type", "PathPrefix") in ("Exact", "PathPrefix") and not path.get("value", "/").startswith("/"):
                    problems.append(f"path {path} must start with /")
            for ref in rule.get("backendRefs", []):
                if not ref.get("group") and ref.get("kind", "Service") == "Service" and "port" not in ref:
                    problems.append("a Service backendRef needs a port")
            timeouts = rule.get("timeouts", {})
            if "request" in timeouts and "backendRequest" in timeouts:
                request = seconds(timeouts["request"])
                if request and seconds(timeouts["backendRequest"]) > request:
                    problems.append("backendRequest timeout must be <= request timeout")
    elif obj["kind"] == "Gateway":
        listeners = spec["listeners"]
        if len({lst["name"] for lst in listeners}) != len(listeners):
            problems.append("listener names must be unique")
        if len({(lst["port"], lst["protocol"], lst.get("hostname")) for lst in listeners}) != len(listeners):
            problems.append("port, protocol and hostname must be unique per listener")
        if any(lst["protocol"] in ("HTTP", "TCP", "UDP") and "tls" in lst for lst in listeners):
            problems.append("tls is for HTTPS and TLS listeners only")
    return problems


def custom_resources(objects: Objects) -> Objects:
    return [o for o in objects if (o["apiVersion"].split("/")[0], o["kind"]) in CRD_FILES]


@pytest.mark.parametrize("name", list(BUILDS))
def test_custom_resources_validate_against_their_crds(name: str) -> None:
    found = custom_resources(built(name))
    for obj in found:
        assert schema_problems(obj) == []
        assert cel_problems(obj) == []
    kinds = {o["kind"] for o in found}
    assert kinds == ({"InferencePool", "HTTPRoute", "Gateway"} if name == ROUTED else set())


def test_every_crd_kind_of_the_builds_has_a_schema_here_or_is_known_to_lack_one() -> None:
    """The kinds skipped by kubernetes-validate: the ones validated here, and the Prometheus
    operator's, LeaderWorkerSet's and cert-manager's, of which no schema is kept."""
    here = {(f"{group}/v1", kind) for group, kind in CRD_FILES} & CRDS
    assert {("inference.networking.k8s.io/v1", "InferencePool"), ("gateway.networking.k8s.io/v1", "HTTPRoute"),
            ("gateway.networking.k8s.io/v1", "Gateway")} <= here
    for name in BUILDS:
        for obj in built(name):
            if (obj["apiVersion"], obj["kind"]) in CRDS and obj["apiVersion"].split("/")[0] in {g for g, _ in CRD_FILES}:
                assert (obj["apiVersion"].split("/")[0], obj["kind"]) in CRD_FILES


BREAKS: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    # v1alpha2's fields, removed in v1: refused as unknown
    ("InferencePool", lambda o: o["spec"].update(targetPortNumber=8000), "schema"),
    ("InferencePool", lambda o: o["spec"].update(extensionRef={"name": "llm-gateway-epp"}), "schema"),
    ("InferencePool", lambda o: o["spec"].update(selector={"app.kubernetes.io/name": "llm-gateway"}), "schema"),
    ("InferencePool", lambda o: o["spec"]["targetPorts"].append({"number": 8000}), "cel"),
    ("InferencePool", lambda o: o["spec"]["endpointPickerRef"].pop("port"), "cel"),
    ("InferencePool", lambda o: o["spec"].update(appProtocol="grpc"), "schema"),
    ("HTTPRoute", lambda o: o["spec"]["rules"][0]["backendRefs"][0].update(weigth=1), "schema"),
    ("HTTPRoute", lambda o: o["spec"]["rules"][0]["timeouts"].update(backendRequest="20m"), "cel"),
    ("HTTPRoute", lambda o: o["spec"]["rules"][0]["timeouts"].update(request="ten minutes"), "schema"),
    ("Gateway", lambda o: o["spec"]["listeners"].append(dict(o["spec"]["listeners"][0])), "cel"),
    ("Gateway", lambda o: o["spec"]["listeners"][0].update(protocl="HTTP"), "schema"),
]


@pytest.mark.parametrize(("kind", "change", "caught_by"), BREAKS)
def test_a_broken_custom_resource_is_refused(kind: str, change: Callable[[dict[str, Any]], None], caught_by: str) -> None:
    obj = copy.deepcopy(one(built(ROUTED), kind))
    assert schema_problems(obj) == cel_problems(obj) == []
    change(obj)
    problems = schema_problems(obj) if caught_by == "schema" else cel_problems(obj)
    assert problems, f"{kind}: the change went unnoticed"


# ---------------------------------------------------------------------------------------------
# the picker's configuration against its Go types (apix/config/v1alpha1, router v0.10.0)


@functools.cache
def go_structs() -> dict[str, dict[str, str]]:
    """Each struct of endpointpickerconfig_types.go: its JSON field names → their Go types."""
    source = (CRD_DIR / "epp-examples" / "endpointpickerconfig_types.go").read_text()
    structs: dict[str, dict[str, str]] = {}
    for name, body in re.findall(r"^type (\w+) struct \{\n(.*?)^\}", source, re.S | re.M):
        fields = {}
        for go_type, tag in re.findall(r"^\s+\w+\s+(\S+)\s+`json:\"([^\"]*)\"`", body, re.M):
            json_name = tag.split(",")[0]
            if json_name:
                fields[json_name] = go_type
        structs[name] = fields
    return structs


def go_type_problems(value: Any, go_type: str, where: str) -> list[str]:
    go_type = go_type.lstrip("*")
    structs = go_structs()
    if go_type.startswith("[]"):
        if not isinstance(value, list):
            return [f"{where}: a list expected"]
        return [p for i, item in enumerate(value) for p in go_type_problems(item, go_type[2:], f"{where}[{i}]")]
    if go_type in structs:
        if not isinstance(value, dict):
            return [f"{where}: an object expected"]
        fields = structs[go_type]
        problems = [f"{where}.{key}: no such field of {go_type}" for key in value if key not in fields]
        for key, item in value.items():
            if key in fields:
                problems += go_type_problems(item, fields[key], f"{where}.{key}")
        return problems
    expected = {"string": str, "bool": bool, "float64": (int, float), "int": int, "FeatureGates": list}
    if go_type in expected and not isinstance(value, expected[go_type]):
        return [f"{where}: {go_type} expected, not {value!r}"]
    return []  # json.RawMessage (a plugin's parameters), quantities and durations


def picker_config_problems(config: dict[str, Any]) -> list[str]:
    problems = go_type_problems({k: v for k, v in config.items() if k not in ("apiVersion", "kind")},
                                "EndpointPickerConfig", "config")
    if (config.get("apiVersion"), config.get("kind")) != ("llm-d.ai/v1alpha1", "EndpointPickerConfig"):
        problems.append("apiVersion/kind: llm-d.ai/v1alpha1 EndpointPickerConfig expected")
    plugins = [p.get("name") or p["type"] for p in config.get("plugins", [])]
    if len(plugins) != len(set(plugins)):
        problems.append("plugin names must be unique")
    refs = [ref["pluginRef"] for profile in config.get("schedulingProfiles", []) for ref in profile["plugins"]]
    for source in (config.get("dataLayer") or {}).get("sources", []):
        refs += [source["pluginRef"], *(e["pluginRef"] for e in source["extractors"])]
    problems += [f"pluginRef {ref} names no plugin" for ref in refs if ref not in plugins]
    return problems


def picker_config(objects: Objects) -> tuple[str, dict[str, Any]]:
    """(the file name, the EndpointPickerConfig) the picker's --config-file names, through its mount."""
    _, picker = picker_pod(objects)
    path = Path(flags(picker)["config-file"])
    volumes = {v["name"]: v for v in picker_deployment(objects)["spec"]["template"]["spec"]["volumes"]}
    [mount] = [m for m in picker["volumeMounts"] if path.parent == Path(m["mountPath"])]
    config_map = one(objects, "ConfigMap", volumes[mount["name"]]["configMap"]["name"])
    return path.name, yaml.safe_load(config_map["data"][path.name])


@pytest.mark.parametrize("sample", ["epp-config.yaml", "epp-precise-prefix-cache-config.yaml"])
def test_the_go_types_check_accepts_the_router_s_own_samples(sample: str) -> None:
    assert {"EndpointPickerConfig", "PluginSpec", "SchedulingProfile", "DataLayerConfig"} <= set(go_structs())
    config = yaml.safe_load((CRD_DIR / "epp-examples" / sample).read_text())
    assert picker_config_problems(config) == []


def test_the_local_recipe_s_picker_config_fits_its_types() -> None:
    """k8s/examples/picker-local (the picker without Kubernetes): file discovery, the router page."""
    recipe = K8S / "examples" / "picker-local"
    config = yaml.safe_load((recipe / "picker-config.yaml").read_text())
    assert picker_config_problems(config) == []
    plugins = {p.get("name") or p["type"]: p for p in config["plugins"]}
    assert config["dataLayer"]["discovery"]["pluginRef"] == "file-discovery"
    assert plugins["metrics-data-source"]["parameters"]["path"] == "/metrics/router"
    endpoints = yaml.safe_load((recipe / "endpoints.yaml").read_text())["endpoints"]
    assert all(isinstance(e["port"], str) and e["address"].count(".") == 3 for e in endpoints)


def test_the_picker_s_config_fits_its_types_and_reads_the_router_page() -> None:
    objects = built(ROUTED)
    _, config = picker_config(objects)
    assert picker_config_problems(config) == []
    plugins = {p.get("name") or p["type"]: p for p in config["plugins"]}
    assert {"queue-scorer", "kv-cache-utilization-scorer", "prefix-cache-scorer"} <= set(plugins)
    [profile] = config["schedulingProfiles"]
    weighted = {ref["pluginRef"] for ref in profile["plugins"] if ref.get("weight")}
    assert {"queue-scorer", "kv-cache-utilization-scorer", "prefix-cache-scorer"} <= weighted
    # the data source scrapes the gateway's router page, an ops route of the one route table
    source = plugins["metrics-data-source"]["parameters"]
    assert source["path"] == "/metrics/router"
    assert source["path"] in TABLE.paths("ops")
    assert source["scheme"] == "http"
    [data_source] = config["dataLayer"]["sources"]
    assert data_source["pluginRef"] == "metrics-data-source"
    assert [e["pluginRef"] for e in data_source["extractors"]] == ["core-metrics-extractor"]


@pytest.mark.parametrize("change", [
    lambda c: c["plugins"].append({"type": "queue-scorer", "paramters": {}}),  # misspelt field
    lambda c: c["schedulingProfiles"][0]["plugins"].append({"pluginRef": "no-such-scorer"}),
    lambda c: c["schedulingProfiles"][0]["plugins"][0].update(weight="heavy"),
    lambda c: c.update(schedulingProfile=[]),
])
def test_a_broken_picker_config_is_refused(change: Callable[[dict[str, Any]], None]) -> None:
    _, config = picker_config(built(ROUTED))
    change(config)
    assert picker_config_problems(config)


# ---------------------------------------------------------------------------------------------
# names, ports and selectors agree


def picker_deployment(objects: Objects) -> dict[str, Any]:
    return one(objects, "Deployment", "llm-gateway-epp")


def picker_pod(objects: Objects) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the picker's pod template, its container)."""
    template = picker_deployment(objects)["spec"]["template"]
    [container] = template["spec"]["containers"]
    return template, container


def flags(container: dict[str, Any]) -> dict[str, str]:
    out = {}
    for arg in container.get("args", []):
        assert arg.startswith("--"), f"{arg}: flags as --name=value"
        assert "=" in arg, f"{arg}: flags as --name=value"
        name, _, value = arg[2:].partition("=")
        out[name] = value
    return out


def service_port(service: dict[str, Any], number: int) -> dict[str, Any]:
    """The Service's port of this number ({} when it has none)."""
    return next((p for p in service["spec"]["ports"] if p["port"] == number), {})


def container_port(container: dict[str, Any], target: int | str | None) -> int | None:
    """The container port a Service's or a NetworkPolicy's port means (None: no such port)."""
    if isinstance(target, str):
        return {p["name"]: p["containerPort"] for p in container.get("ports", [])}.get(target)
    return target


def agreement_problems(objects: Objects) -> list[str]:
    problems: list[str] = []

    def check(ok: bool, what: str) -> None:
        if not ok:
            problems.append(what)

    gateway, template, container = gateway_pod(objects)
    pod_labels = template["metadata"]["labels"]
    pool = one(objects, "InferencePool")
    selector = pool["spec"]["selector"]["matchLabels"]
    # the pool: the Deployment's pods exactly (its selector), on the gateway's port
    check(matches(selector, pod_labels), "the pool's selector does not select the gateway's pods")
    check(selector == gateway["spec"]["selector"]["matchLabels"], "the pool's selector is not the Deployment's")
    check(selector == one(objects, "Service", "llm-gateway")["spec"]["selector"], "the pool's selector is not the Service's")
    check([p["number"] for p in pool["spec"]["targetPorts"]] == [named_port(container, "http")],
          "the pool's target port is not the gateway's port")
    check(pod_labels.get("llm-d.ai/engine-type") == "vllm", "the gateway's pods lack llm-d.ai/engine-type: vllm")
    others = [d for d in objects if d["kind"] == "Deployment" and d is not gateway]
    check(not any(matches(selector, d["spec"]["template"]["metadata"]["labels"]) for d in others),
          "the pool's selector selects other pods too")

    # the pool's picker: its Service, the port of its ext_proc server, its pods
    ref = pool["spec"]["endpointPickerRef"]
    picker_template, picker = picker_pod(objects)
    picker_flags = flags(picker)
    service = one(objects, ref.get("kind", "Service"), ref["name"])
    check(matches(service["spec"]["selector"], picker_template["metadata"]["labels"]),
          "the picker's Service does not select the picker")
    grpc = service_port(service, ref["port"]["number"])
    check(grpc.get("appProtocol") == "kubernetes.io/h2c", "ext_proc is h2c gRPC")
    check(container_port(picker, grpc.get("targetPort")) == int(picker_flags["grpc-port"]),
          "the picker's Service port does not reach --grpc-port")
    metrics = [p for p in service["spec"]["ports"] if p["name"] == "http-metrics"]
    check(len(metrics) == 1 and container_port(picker, metrics[0]["targetPort"]) == int(picker_flags["metrics-port"]),
          "the picker's metrics port is not --metrics-port")
    # the picker's flags: this pool, in its own namespace
    check(picker_flags["pool-name"] == pool["metadata"]["name"], "--pool-name is not the pool")
    check(picker_flags["pool-group"] == POOL_GROUP, "--pool-group is not the pool's group")
    check(picker_flags["pool-namespace"] == "$(NAMESPACE)", "--pool-namespace is not the pod's namespace")
    env = {e["name"]: e for e in picker.get("env", [])}
    check(env.get("NAMESPACE", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.namespace",
          "NAMESPACE is not the pod's namespace")
    check(picker["image"] == PICKER_IMAGE, "the picker's image is not the pinned release")
    health = int(picker_flags["grpc-health-port"])
    for probe in ("livenessProbe", "readinessProbe"):
        check(picker[probe]["grpc"]["port"] == health, f"the picker's {probe} is not on --grpc-health-port")
    check(not any(f.endswith("-metric") for f in picker_flags),
          "the metric-name flags are refused by v0.10.0 (engineConfigs instead)")

    # RBAC: the picker's ServiceAccount may read what it watches
    account = picker_template["spec"]["serviceAccountName"]
    granted = set()
    for binding in (o for o in objects if o["kind"] == "RoleBinding"):
        if any(s["kind"] == "ServiceAccount" and s["name"] == account for s in binding["subjects"]):
            role = one(objects, binding["roleRef"]["kind"], binding["roleRef"]["name"])
            for rule in role["rules"]:
                if {"get", "list", "watch"} <= set(rule["verbs"]):
                    granted |= {(g, r) for g in rule["apiGroups"] for r in rule["resources"]}
    for needed in [("", "pods"), (POOL_GROUP, "inferencepools"), ("llm-d.ai", "inferenceobjectives"),
                   ("llm-d.ai", "inferencemodelrewrites")]:
        check(needed in granted, f"the picker may not watch {needed}")

    # the route: from the Gateway's listener to the pool, long enough for streams
    route, gateway_api = one(objects, "HTTPRoute"), one(objects, "Gateway")
    [parent] = route["spec"]["parentRefs"]
    listeners = {lst["name"] for lst in gateway_api["spec"]["listeners"]}
    check(parent["name"] == gateway_api["metadata"]["name"] and parent.get("sectionName") in listeners,
          "the route's parent is not the Gateway's listener")
    for rule in route["spec"]["rules"]:
        for backend in rule["backendRefs"]:
            check((backend.get("group"), backend.get("kind")) == (POOL_GROUP, "InferencePool")
                  and backend["name"] == pool["metadata"]["name"], "the route's backend is not the pool")
        timeouts = rule.get("timeouts", {})
        check(seconds(timeouts.get("request", "0s")) >= 600 and seconds(timeouts.get("backendRequest", "0s")) >= 600,
              "streams need 10 minutes")
    check(any(m["path"]["value"] == "/v1" for rule in route["spec"]["rules"] for m in rule["matches"]),
          "the route does not carry the API (/v1)")

    # the NetworkPolicies: the picker and the Gateway's proxies reach the pods' port, the proxies the picker
    proxy = {"gateway.networking.k8s.io/gateway-name": gateway_api["metadata"]["name"]}
    to_pods = [p for p in objects if p["kind"] == "NetworkPolicy"
               and matches(p["spec"]["podSelector"]["matchLabels"], pod_labels)]
    check(len(to_pods) == 1, "one NetworkPolicy for the gateway's pods")
    peers = [(peer, rule) for policy in to_pods for rule in policy["spec"]["ingress"] for peer in rule["from"]]
    for who, labels in (("the picker", picker_template["metadata"]["labels"]), ("the Gateway's proxies", proxy)):
        allowed = [rule for peer, rule in peers if matches(peer.get("podSelector", {}).get("matchLabels", {}), labels)]
        check(any(container_port(container, port["port"]) == named_port(container, "http")
                  for rule in allowed for port in rule["ports"]), f"{who} may not reach the gateway's port")
    to_picker = [p for p in objects if p["kind"] == "NetworkPolicy"
                 and matches(p["spec"]["podSelector"]["matchLabels"], picker_template["metadata"]["labels"])]
    check(any(matches(peer.get("podSelector", {}).get("matchLabels", {}), proxy)
              and any(container_port(picker, port["port"]) == int(picker_flags["grpc-port"]) for port in rule["ports"])
              for policy in to_picker for rule in policy["spec"]["ingress"] for peer in rule["from"]),
          "the Gateway's proxies may not reach the picker's ext_proc port")
    return problems


def test_names_ports_and_selectors_agree() -> None:
    assert agreement_problems(built(ROUTED)) == []


def _set(kind: str, name: str | None, path: str, value: Any) -> Callable[[Objects], None]:
    def change(objects: Objects) -> None:
        target: Any = one(objects, kind, name)
        keys = [key.replace("~1", "/") for key in path.split("/")]  # JSON Pointer's escape
        for key in keys[:-1]:
            target = target[int(key)] if key.isdigit() else target[key]
        target[int(keys[-1]) if keys[-1].isdigit() else keys[-1]] = value
    return change


def _arg(flag: str, value: str) -> Callable[[Objects], None]:
    def change(objects: Objects) -> None:
        _, picker = picker_pod(objects)
        picker["args"] = [f"--{flag}={value}" if a.startswith(f"--{flag}=") else a for a in picker["args"]]
    return change


@pytest.mark.parametrize("change", [
    _set("InferencePool", None, "spec/selector/matchLabels/app.kubernetes.io~1component", "x"),
    _set("InferencePool", None, "spec/targetPorts/0/number", 8080),
    _set("InferencePool", None, "spec/endpointPickerRef/port/number", 9003),
    _set("InferencePool", None, "spec/endpointPickerRef/name", "llm-gateway"),
    _arg("pool-name", "other-pool"),
    _arg("grpc-port", "9100"),
    _arg("grpc-health-port", "9004"),
    _set("HTTPRoute", None, "spec/rules/0/backendRefs/0/name", "llm-gateway-other"),
    _set("HTTPRoute", None, "spec/rules/0/timeouts/request", "30s"),
    _set("HTTPRoute", None, "spec/parentRefs/0/sectionName", "https"),
    _set("Deployment", "llm-gateway", "spec/template/metadata/labels", {"app.kubernetes.io/name": "llm-gateway",
                                                                        "app.kubernetes.io/component": "server"}),
    _set("NetworkPolicy", "llm-gateway", "spec/ingress/0/ports/0/port", 9000),
    _set("NetworkPolicy", "llm-gateway-epp", "spec/ingress/0/ports/0/port", "metrics"),
    _set("Role", "llm-gateway-epp", "rules/1/verbs", ["get"]),
])
def test_a_disagreement_is_caught(change: Callable[[Objects], None]) -> None:
    objects = built(ROUTED)
    change(objects)
    assert agreement_problems(objects)


def test_the_component_adds_only_the_engine_type_label_to_the_gateway() -> None:
    """Everything of the gpu build is in the routed build unchanged, but the pod template's label."""
    gpu = {(o["kind"], o["metadata"]["name"]): o for o in built("gpu")}
    routed = {(o["kind"], o["metadata"]["name"]): o for o in built(ROUTED)}
    assert set(gpu) <= set(routed)
    for key, obj in gpu.items():
        other = copy.deepcopy(routed[key])
        if key == ("Deployment", "llm-gateway"):
            assert other["spec"]["template"]["metadata"]["labels"].pop("llm-d.ai/engine-type") == "vllm"
        assert other == obj, key
