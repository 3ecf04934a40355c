"""LoRA adapters as models, on the fake engine: the models file's adapter entries (checked at
start), what a key reaches through them on every route and every way in, the response cache and
the metrics under the adapter's name, and the admin API that loads and unloads them."""

from __future__ import annotations

import asyncio
import re
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY
from starlette.testclient import TestClient

from engine.config import EngineSettings
from engine.types import GenerationRequest, SamplingOptions
from gateway.app import create_app
from gateway.backends import modelfile
from gateway.backends.adapters import AdapterAdmin, AdapterEngine
from gateway.backends.admission import Admission
from gateway.backends.modelfile import ConfigError
from gateway.backends.registry import Backend, ModelRegistry
from gateway.errors import InvalidRequest, ModelNotFound, NotFound
from gateway.settings import AdmissionSettings
from tests.adapters import write_stub
from tests.fakes import HELLO, FakeEngine, fake_settings
from tests.unit.test_reach import ROUTES

MODELS = """
models:
  - {{name: base, fallback: [spare]}}
  - {{name: spare}}
  - {{name: lora-a, kind: adapter, base: base, path: {a}, aliases: [la]}}
  - {{name: lora-b, kind: adapter, base: base, path: {b}, version: 1.0.0, defaults: {{max_tokens: 2}}}}
  - {{name: ab, kind: split, versions: {{lora-a: 1, base: 1}}}}
  - {{name: lora-fb, kind: adapter, base: base, path: {a}, fallback: [lora-a]}}
"""
KEYS = """
keys:
  adapter-only: {key: sk-adapter, models: [lora-a]}
  base-only: {key: sk-base, models: [base]}
  everything: {key: sk-all}
"""
ADAPTER_ONLY, BASE_ONLY, ALL = ({"Authorization": f"Bearer sk-{k}"} for k in ("adapter", "base", "all"))
ADMIN = {"Authorization": "Bearer sk-admin"}

# (how the request names a model, what the adapter-only key reaches, what the base-only key reaches;
# None: a 404; "base": the base model itself, else the adapter the engine was asked for)
REFERENCES = [
    ("lora-a", "lora-a", None),
    ("la", "lora-a", None),  # an alias of the adapter
    ("lora-b", None, None),  # a versioned adapter, by name and by version
    ("lora-b@1", None, None),
    ("base", None, "base"),
    ("ab", "lora-a", "base"),  # a split of adapter and base: the granted arm only
    ("lora-fb", None, None),  # an adapter not granted, though its fallback is
]


def _adapters(folder: Path) -> dict[str, Path]:
    return {"a": write_stub(folder / "a"), "b": write_stub(folder / "b", rank=12)}


def _write(folder: Path, models: str = MODELS) -> Path:
    paths = _adapters(folder)
    (folder / "models.yaml").write_text(models.format(**paths))
    (folder / "keys.yaml").write_text(textwrap.dedent(KEYS))
    return folder / "models.yaml"


@pytest.fixture
def started() -> dict[str, EngineSettings]:
    return {}


@pytest.fixture
def engines(started: dict[str, EngineSettings]) -> dict[str, FakeEngine]:
    return {}


def _starter(engines: dict[str, FakeEngine], started: dict[str, EngineSettings]) -> Any:
    def start(settings: EngineSettings) -> FakeEngine:
        started[settings.served_model_name] = settings
        engine = engines[settings.served_model_name] = FakeEngine(
            settings.served_model_name, max_loras=settings.max_loras if settings.enable_lora else None)
        return engine
    return start


@pytest.fixture
def client(tmp_path: Path, engines: dict[str, FakeEngine], started: dict[str, EngineSettings]) -> Iterator[TestClient]:
    settings = fake_settings(models_file=_write(tmp_path), keys_file=tmp_path / "keys.yaml", admin_keys=["sk-admin"],
                             cache={"backend": "memory"})
    with TestClient(create_app(settings, engine_starter=_starter(engines, started))) as found:
        yield found


def _asked(engines: dict[str, FakeEngine], before: int) -> set[str]:
    """What the base engine was asked for since `before` requests: "base", or the adapters' names."""
    return {request.adapter or "base" for request in engines["base"].requests[before:]}


def test_the_base_gets_lora_sized_by_its_adapters(client: TestClient, started: dict[str, EngineSettings]) -> None:
    base = started["base"]
    assert (base.enable_lora, base.max_loras, base.max_lora_rank, base.max_cpu_loras) == (True, 3, 16, 3)
    assert not started["spare"].enable_lora
    assert set(started) == {"base", "spare"}  # adapters start no engine


def test_an_adapter_answers_under_its_own_name_from_its_base_s_engine(
    client: TestClient, engines: dict[str, FakeEngine]
) -> None:
    answer = client.post("/v1/chat/completions", json={"model": "la", "messages": HELLO, "max_tokens": 2}, headers=ALL)
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == "lora-a"
    assert answer.json()["choices"][0]["message"]["content"] == "lora-a:the lora-a:quick"
    assert engines["base"].requests[-1].adapter == "lora-a"
    versioned = client.post("/v1/chat/completions", json={"model": "lora-b", "messages": HELLO}, headers=ALL).json()
    assert versioned["model"] == "lora-b@1.0.0"
    assert versioned["usage"]["completion_tokens"] == 2  # the adapter's own sampling defaults
    assert engines["base"].requests[-1].adapter == "lora-b@1.0.0"


@pytest.mark.parametrize("route", ROUTES)
def test_every_route_reaches_through_adapters_only_what_the_key_may_use(
    client: TestClient, engines: dict[str, FakeEngine], route: str
) -> None:
    for reference, adapter_key, base_key in REFERENCES:
        path, body = ROUTES[route](reference)
        for headers, reaches in ((ADAPTER_ONLY, adapter_key), (BASE_ONLY, base_key)):
            for _ in range(3 if reference == "ab" else 1):  # a split's arm is chosen at random
                before = len(engines["base"].requests)
                answer = client.post(path, json=body, headers=headers)
                if reaches is None:
                    assert answer.status_code == 404, (route, reference, headers, answer.text)
                    assert _asked(engines, before) == set()
                    continue
                assert answer.status_code == 200, (route, reference, headers, answer.text)
                assert _asked(engines, before) <= {reaches}, (route, reference)


def test_models_lists_adapters_to_the_keys_that_reach_them(client: TestClient) -> None:
    def listed(headers: dict[str, str]) -> set[str]:
        return {card["id"] for card in client.get("/v1/models", headers=headers).json()["data"]}

    assert listed(ADAPTER_ONLY) == {"lora-a", "la", "ab"}
    assert listed(BASE_ONLY) == {"base", "ab"}
    cards = {card["id"]: card for card in client.get("/v1/models", headers=ALL).json()["data"]}
    assert cards["lora-a"]["parent"] == "base"
    assert cards["base"].get("parent") is None


def test_the_cache_and_the_metrics_know_the_adapter_by_its_name(client: TestClient) -> None:
    def hits(model: str) -> float:
        return REGISTRY.get_sample_value("gateway_cache_hits_total", {"model": model}) or 0

    body = {"messages": HELLO, "max_tokens": 2, "temperature": 0}
    before = {model: hits(model) for model in ("lora-a", "base")}
    first = client.post("/v1/chat/completions", json={"model": "lora-a", **body}, headers=ALL).json()
    again = client.post("/v1/chat/completions", json={"model": "lora-a", **body}, headers=ALL).json()
    base = client.post("/v1/chat/completions", json={"model": "base", **body}, headers=ALL).json()
    assert again["choices"] == first["choices"]
    assert again["model"] == "lora-a"
    assert hits("lora-a") == before["lora-a"] + 1
    assert base["model"] == "base"
    assert base["choices"][0]["message"]["content"] == "the quick"
    assert hits("base") == before["base"]
    requests = REGISTRY.get_sample_value(
        "gateway_requests_total", {"model": "lora-a", "route": "/v1/chat/completions", "status": "200"})
    assert requests is not None
    assert requests >= 2


def test_lora_requests_info_is_exported_from_the_engines_adapter_load(
    client: TestClient, engines: dict[str, FakeEngine]
) -> None:
    def info() -> list[tuple[dict[str, str], float]]:
        return [(sample.labels, sample.value) for metric in REGISTRY.collect() for sample in metric.samples
                if sample.name == "vllm:lora_requests_info"]

    assert [labels for labels, _ in info()] == [
        {"max_lora": "3", "waiting_lora_adapters": "", "running_lora_adapters": ""}]
    engines["base"].delay = 0.05
    with client.stream("POST", "/v1/chat/completions", headers=ALL, json={
            "model": "lora-a", "messages": HELLO, "max_tokens": 4, "stream": True}) as streaming:
        lines = streaming.iter_lines()
        while "lora-a:" not in next(lines):  # generating
            pass
        (labels, value), = info()
        assert labels["running_lora_adapters"] == "lora-a"
        assert value > 0
        for _ in lines:
            pass
    assert info()[0][0]["running_lora_adapters"] == ""
    assert b"vllm:lora_requests_info{" in client.get("/metrics").content


# (the models file, what the start-up refuses with)
BAD_FILES = [
    ("models:\n  - {{name: base}}\n  - {{name: x, kind: adapter, base: base}}\n", "needs a base"),
    ("models:\n  - {{name: base}}\n  - {{name: x, kind: adapter, base: ghost, path: {a}}}\n", "'ghost', which is not declared"),
    ("models:\n  - {{name: v, kind: embedding}}\n  - {{name: x, kind: adapter, base: v, path: {a}}}\n", "not an embedded model"),
    ("models:\n  - {{name: r, kind: remote, url: 'http://127.0.0.1:9/v1'}}\n  - {{name: x, kind: adapter, base: r, path: {a}}}\n",
     "not an embedded model"),
    ("models:\n  - {{name: base}}\n  - {{name: x, kind: adapter, base: base, path: missing}}\n", "does not exist"),
    ("models:\n  - {{name: base}}\n  - {{name: x, kind: adapter, base: base, path: {a}, engine: {{dtype: float32}}}}\n",
     "only embedded models take engine settings"),
    ("models:\n  - {{name: base, path: {a}}}\n", "only adapters take a base and a path"),
    ("models:\n  - {{name: base, engine: {{enable_lora: false}}}}\n  - {{name: x, kind: adapter, base: base, path: {a}}}\n",
     "enable_lora: false"),
    ("models:\n  - {{name: base, engine: {{max_lora_rank: 8}}}}\n  - {{name: x, kind: adapter, base: base, path: {b}}}\n",
     "its adapter 'x' (rank 12) is above its max_lora_rank (8)"),
    ("models:\n  - {{name: base, engine: {{max_lora_rank: 12}}}}\n", "max_lora_rank must be one of"),
]


@pytest.mark.parametrize(("text", "refusal"), BAD_FILES)
def test_a_bad_adapter_entry_is_refused_at_start(tmp_path: Path, text: str, refusal: str) -> None:
    path = _write(tmp_path, text)

    def start() -> None:
        for spec in modelfile.load(fake_settings(models_file=path)).models:
            if spec.kind == "embedded":
                spec.engine_settings(EngineSettings())

    with pytest.raises(ConfigError, match=re.escape(refusal)):
        start()


@pytest.mark.parametrize("config", ["{not json", '{"peft_type": "PREFIX_TUNING", "r": 8}', '{"peft_type": "LORA", "r": 0}',
                                    '{"peft_type": "LORA", "r": 8}'])
def test_a_malformed_adapter_directory_is_refused_at_start(tmp_path: Path, config: str) -> None:
    folder = tmp_path / "bad"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(config)  # the last: no weights file
    path = tmp_path / "models.yaml"
    path.write_text(f"models:\n  - {{name: base}}\n  - {{name: x, kind: adapter, base: base, path: {folder}}}\n")
    with pytest.raises(ConfigError, match="adapter 'x'"):
        modelfile.load(fake_settings(models_file=path))


def test_the_base_s_engine_settings_override_what_its_adapters_derive(tmp_path: Path) -> None:
    text = ("models:\n  - {{name: base, engine: {{max_loras: 1, max_lora_rank: 64, max_cpu_loras: 4}}}}\n"
            "  - {{name: x, kind: adapter, base: base, path: a}}\n")  # relative: to the file's folder
    models = modelfile.load(fake_settings(models_file=_write(tmp_path, text)))
    settings = models.models[0].engine_settings(EngineSettings())
    assert (settings.enable_lora, settings.max_loras, settings.max_lora_rank, settings.max_cpu_loras) == (True, 1, 64, 4)
    assert models.models[1].path == str(tmp_path / "a")


def test_admin_api_loads_serves_and_unloads(client: TestClient, engines: dict[str, FakeEngine], tmp_path: Path) -> None:
    body = {"lora_name": "lora-c", "lora_path": str(write_stub(tmp_path / "c"))}
    assert client.post("/v1/load_lora_adapter", json=body, headers=ALL).status_code == 401  # an API key is no admin key
    assert client.post("/v1/load_lora_adapter", json=body).status_code == 401
    loaded = client.post("/v1/load_lora_adapter", json=body, headers=ADMIN)
    assert (loaded.status_code, loaded.text) == (200, "Success: LoRA adapter 'lora-c' added successfully.")
    chat = client.post("/v1/chat/completions", json={"model": "lora-c", "messages": HELLO, "max_tokens": 1}, headers=ALL)
    assert chat.json()["choices"][0]["message"]["content"] == "lora-c:the"
    assert client.post("/v1/chat/completions", json={"model": "lora-c", "messages": HELLO},
                       headers=ADAPTER_ONLY).status_code == 404  # not in its list
    again = client.post("/v1/load_lora_adapter", json=body, headers=ADMIN)
    assert again.status_code == 400
    assert "conflicts" in again.json()["error"]["message"]
    unloaded = client.post("/v1/unload_lora_adapter", json={"lora_name": "lora-c"}, headers=ADMIN)
    assert (unloaded.status_code, unloaded.text) == (200, "Success: LoRA adapter 'lora-c' removed successfully.")
    assert engines["base"].adapter_calls[-2:] == [("load", "lora-c"), ("unload", "lora-c")]
    assert client.post("/v1/chat/completions", json={"model": "lora-c", "messages": HELLO}, headers=ALL).status_code == 404
    gone = client.post("/v1/unload_lora_adapter", json={"lora_name": "lora-c"}, headers=ADMIN)
    assert gone.status_code == 404
    assert gone.json()["error"]["message"] == "The lora adapter 'lora-c' cannot be found."


@pytest.mark.parametrize(("body", "refusal"), [
    ({"lora_name": "x", "lora_path": "/no/such/dir"}, "does not exist"),
    ({"lora_name": "base", "lora_path": "{c}"}, "conflicts with a served model"),
    ({"lora_name": "la", "lora_path": "{c}"}, "conflicts with a served model"),
    ({"lora_name": "x@1", "lora_path": "{c}"}, "without '@'"),
    # the router page lists adapters comma-separated (an endpoint picker would read two adapters),
    # and a name is a model id in logs and metrics: no commas, whitespace or control characters
    ({"lora_name": "lora-a,la", "lora_path": "{c}"}, "cannot name an adapter"),
    ({"lora_name": "x\ny", "lora_path": "{c}"}, "cannot name an adapter"),
    ({"lora_name": "x y", "lora_path": "{c}"}, "cannot name an adapter"),
    ({"lora_name": "x\u200by", "lora_path": "{c}"}, "cannot name an adapter"),
    ({"lora_name": "x" * 257, "lora_path": "{c}"}, "cannot name an adapter"),
    ({"lora_name": "x", "lora_path": "{c}", "base": "spare"}, "runs without LoRA"),
    ({"lora_name": "x", "lora_path": "{c}", "base": "lora-a"}, "not an embedded model"),
    ({"lora_name": "x", "lora_path": "{c}", "load_inplace": True}, "load_inplace is not supported"),
    ({"lora_name": "x"}, "lora_path"),
])
def test_admin_api_refuses_a_bad_load_with_400(client: TestClient, tmp_path: Path, body: dict[str, Any], refusal: str) -> None:
    stub = write_stub(tmp_path / "c")
    body = {key: value.format(c=stub) if isinstance(value, str) else value for key, value in body.items()}
    answer = client.post("/v1/load_lora_adapter", json=body, headers=ADMIN)
    assert answer.status_code == 400, answer.text
    assert refusal in answer.text
    assert client.post("/v1/chat/completions", json={"model": "base", "messages": HELLO}, headers=ALL).status_code == 200


def test_admin_api_refuses_to_unload_what_the_models_file_routes_to(client: TestClient) -> None:
    answer = client.post("/v1/unload_lora_adapter", json={"lora_name": "lora-a"}, headers=ADMIN)
    assert answer.status_code == 400
    assert "ab, lora-fb" in answer.json()["error"]["message"]
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "base"}, headers=ADMIN).status_code == 404


def test_without_admin_keys_the_admin_api_does_not_exist(tmp_path: Path) -> None:
    settings = fake_settings(models_file=_write(tmp_path), api_keys=["sk-x"])
    with TestClient(create_app(settings, engine_starter=lambda es: FakeEngine(es.served_model_name, max_loras=2))) as found:
        for headers in ({}, {"Authorization": "Bearer sk-x"}):
            assert found.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/"},
                              headers=headers).status_code == 404


async def test_an_unload_waits_for_the_requests_in_flight_on_the_adapter(tmp_path: Path) -> None:
    base_engine = FakeEngine("base", delay=0.01, max_loras=1)
    base = Backend("base", Admission("base", AdmissionSettings()), base_engine)
    registry = ModelRegistry({"base": base})
    admin = AdapterAdmin(registry)
    await admin.load("ad", str(write_stub(tmp_path / "ad")))
    adapter = registry.backends["ad"].engine
    assert isinstance(adapter, AdapterEngine)
    request = GenerationRequest("r1", [1, 2], SamplingOptions(max_tokens=20))
    stream = adapter.generate(request)
    await stream.__anext__()  # in flight
    unloading = asyncio.create_task(admin.unload("ad"))
    await asyncio.sleep(0.05)  # a window for what must not happen: the unload ending before the request
    assert not unloading.done()
    assert "ad" in base_engine.adapters
    with pytest.raises(ModelNotFound):
        registry.reach("ad")  # but new requests no longer reach it
    outputs = [output async for output in stream]
    assert outputs[-1].finished
    assert len(outputs) == 19
    await asyncio.wait_for(unloading, 60)
    assert "ad" not in base_engine.adapters
    assert base_engine.adapter_calls == [("load", "ad"), ("unload", "ad")]
    with pytest.raises(NotFound):
        await admin.unload("ad")


async def test_a_base_is_chosen_only_when_one_serves_adapters(tmp_path: Path) -> None:
    def backend(name: str, loras: int | None) -> Backend:
        return Backend(name, Admission(name, AdmissionSettings()), FakeEngine(name, max_loras=loras))

    stub = str(write_stub(tmp_path / "x"))
    two = AdapterAdmin(ModelRegistry({"one": backend("one", 1), "two": backend("two", 1)}))
    with pytest.raises(InvalidRequest, match="name one as `base`"):
        await two.load("x", stub)
    await two.load("x", stub, base="two")
    assert two.registry.backends["x"].base == "two"
    none = AdapterAdmin(ModelRegistry({"one": backend("one", None)}))
    with pytest.raises(InvalidRequest, match="No model here serves adapters"):
        await none.load("x", stub)


def test_the_documented_example_is_valid_configuration(tmp_path: Path) -> None:
    doc = (Path(__file__).parents[2] / "docs" / "models.md").read_text()
    section = doc[doc.index("## LoRA adapters"):]
    example = section[section.index("```yaml") + len("```yaml"):section.index("```", section.index("```yaml") + 7)]
    (tmp_path / "models.yaml").write_text(example.replace("/adapters/sql-lora", str(write_stub(tmp_path / "sql"))))
    engines: dict[str, FakeEngine] = {}
    app = create_app(fake_settings(models_file=tmp_path / "models.yaml"), engine_starter=_starter(engines, {}))
    with TestClient(app) as client:
        answer = client.post("/v1/chat/completions", json={"model": "sql", "messages": HELLO, "max_tokens": 1})
        assert answer.json()["model"] == "sql-lora@1.0.0"


@pytest.mark.parametrize(("weights", "refusal"), [
    (b"not safetensors at all", "is not a safetensors file"),
    (None, "has rank 4, its config says r=8"),
])
def test_weights_that_are_not_the_config_s_are_refused_at_start(tmp_path: Path, weights: bytes | None, refusal: str) -> None:
    folder = write_stub(tmp_path / "bad", rank=8)
    if weights is None:  # a rank-4 adapter's weights under a rank-8 config
        (folder / "adapter_model.safetensors").write_bytes((write_stub(tmp_path / "r4", rank=4) / "adapter_model.safetensors").read_bytes())
    else:
        (folder / "adapter_model.safetensors").write_bytes(weights)
    path = tmp_path / "models.yaml"
    path.write_text(f"models:\n  - {{name: base}}\n  - {{name: x, kind: adapter, base: base, path: {folder}}}\n")
    with pytest.raises(ConfigError, match=re.escape(refusal)):
        modelfile.load(fake_settings(models_file=path))


def test_an_adapter_of_another_model_s_size_is_seen_not_to_fit(tmp_path: Path) -> None:
    from engine.adapters import read

    assert read(write_stub(tmp_path / "a", hidden=4)).misfit(4) is None
    assert read(write_stub(tmp_path / "b", hidden=4)).misfit(576) == "its q_proj takes 4 inputs, the model's hidden size is 576"


def test_an_admin_key_may_not_also_be_an_api_key() -> None:
    with pytest.raises(ValueError, match="also an API key"):
        fake_settings(api_keys=["sk-same"], admin_keys=["sk-same"])


def test_the_router_page_counts_the_base_s_engine_once(client: TestClient, engines: dict[str, FakeEngine]) -> None:
    """Adapters are served by their base's engine and share its admission queue: the picker's page
    counts that engine's requests and that queue once, not once per adapter."""
    from prometheus_client.parser import text_string_to_metric_families

    from engine.types import EngineLoad

    engines["base"].scheduler = EngineLoad(waiting=3, block_size=16, num_blocks=100)
    engines["spare"].scheduler = EngineLoad(waiting=1, block_size=16, num_blocks=100)
    page = {f.name: f.samples[0].value for f in text_string_to_metric_families(client.get("/metrics/router").text)}
    assert page["vllm:num_requests_waiting"] == 4  # not 3 once per adapter as well
