"""/v1/embeddings on fake embedding engines: inputs, encodings, dimensions, usage, the task check
both ways, the models file's `kind: embedding` and the opt-in embedding model of the default set-up."""

from __future__ import annotations

import base64
import math
import struct
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from starlette.testclient import TestClient

from engine.config import EngineSettings
from gateway.app import create_app
from gateway.backends import modelfile
from tests.fakes import EMBEDDING_SIZE, FakeEngine, fake_settings

MODELS = """
models:
  - name: chat
  - name: embed
    kind: embedding
    aliases: [vectors]
  - name: embed-short
    kind: embedding
"""


@pytest.fixture
def engines() -> dict[str, FakeEngine]:
    embedder = FakeEngine("embed", task="embed")
    embedder.info.extra["vocab_size"] = 1000
    return {"chat": FakeEngine("chat"), "embed": embedder, "embed-short": FakeEngine("embed-short", task="embed", matryoshka=True)}


@pytest.fixture
def started(engines: dict[str, FakeEngine], tmp_path: Any) -> Iterator[tuple[TestClient, list[EngineSettings]]]:
    models = tmp_path / "models.yaml"
    models.write_text(MODELS)
    seen: list[EngineSettings] = []

    def start(settings: EngineSettings) -> FakeEngine:
        seen.append(settings)
        return engines[settings.served_model_name]

    app = create_app(fake_settings(models_file=models, warmup=True), engine_starter=start)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, seen


@pytest.fixture
def api(started: tuple[TestClient, list[EngineSettings]]) -> TestClient:
    return started[0]


def embed(client: TestClient, status: int = 200, **body: Any) -> dict[str, Any]:
    response = client.post("/v1/embeddings", json={"model": "embed", **body})
    assert response.status_code == status, response.text
    return dict(response.json())


def test_one_input_is_one_unit_vector(api: TestClient, engines: dict[str, FakeEngine]) -> None:
    answer = embed(api, input="hello world")
    assert answer["object"] == "list"
    assert answer["model"] == "embed"
    [item] = answer["data"]
    assert item["object"] == "embedding"
    assert item["index"] == 0
    assert len(item["embedding"]) == EMBEDDING_SIZE
    assert math.isclose(sum(v * v for v in item["embedding"]), 1.0, rel_tol=1e-9)
    assert answer["usage"] == {"prompt_tokens": 2, "total_tokens": 2}
    assert engines["embed"].embedded[-1].inputs[0] == engines["embed"].tokenizer.encode("hello world")


def test_a_batch_gives_the_vectors_of_its_inputs_one_by_one(api: TestClient) -> None:
    texts = ["one", "two words", "three little words"]
    batch = embed(api, input=texts)
    assert [item["index"] for item in batch["data"]] == [0, 1, 2]
    assert [item["embedding"] for item in batch["data"]] == [embed(api, input=t)["data"][0]["embedding"] for t in texts]
    assert batch["usage"]["prompt_tokens"] == 6


def test_token_ids_and_lists_of_them(api: TestClient, engines: dict[str, FakeEngine]) -> None:
    ids = engines["embed"].tokenizer.encode("hello world")
    assert embed(api, input=ids)["data"][0]["embedding"] == embed(api, input="hello world")["data"][0]["embedding"]
    both = embed(api, input=[ids, ids[:1]])
    assert len(both["data"]) == 2
    assert both["usage"]["prompt_tokens"] == 3
    assert embed(api, 400, input=[10, 99999])["error"]["param"] == "input"  # outside the vocabulary


def test_base64_is_little_endian_float32(api: TestClient) -> None:
    floats = embed(api, input="hello")["data"][0]["embedding"]
    encoded = embed(api, input="hello", encoding_format="base64")["data"][0]["embedding"]
    decoded = struct.unpack(f"<{EMBEDDING_SIZE}f", base64.b64decode(encoded))
    assert decoded == pytest.approx(floats, rel=1e-6)


def test_the_openai_sdk_reads_floats_and_base64(api: TestClient) -> None:
    client = openai.OpenAI(base_url=str(api.base_url) + "/v1", api_key="unused", http_client=api)
    as_floats = client.embeddings.create(model="vectors", input=["a b", "c"], encoding_format="float")
    as_default = client.embeddings.create(model="vectors", input=["a b", "c"])  # the SDK asks for base64
    assert [len(d.embedding) for d in as_floats.data] == [EMBEDDING_SIZE, EMBEDDING_SIZE]
    for f, b in zip(as_floats.data, as_default.data, strict=True):
        assert b.embedding == pytest.approx(f.embedding, rel=1e-6)
    assert as_floats.usage.prompt_tokens == 3


def test_dimensions_only_where_the_model_allows(api: TestClient) -> None:
    refused = embed(api, 400, input="hi", dimensions=4)["error"]
    assert refused["param"] == "dimensions"
    assert "Matryoshka" in refused["message"]
    assert len(embed(api, input="hi", dimensions=EMBEDDING_SIZE)["data"][0]["embedding"]) == EMBEDDING_SIZE
    short = api.post("/v1/embeddings", json={"model": "embed-short", "input": "hi", "dimensions": 4}).json()
    vector = short["data"][0]["embedding"]
    assert len(vector) == 4
    assert math.isclose(sum(v * v for v in vector), 1.0, rel_tol=1e-9)
    too_many = api.post("/v1/embeddings", json={"model": "embed-short", "input": "hi", "dimensions": 9})
    assert too_many.status_code == 400
    assert too_many.json()["error"]["param"] == "dimensions"


def test_bad_inputs_are_400s(api: TestClient) -> None:
    assert embed(api, 400, input="")["error"]["param"] == "input"
    assert embed(api, 400, input=[])["error"]["param"] == "input"
    assert embed(api, 400, input=["a", ""])["error"]["param"] == "input"
    assert embed(api, 400, input=[[1], []])["error"]["param"] == "input"
    assert embed(api, 400, input=["a"] * 2049)["error"]["param"] == "input"
    assert embed(api, 400, input="hi", encoding_format="bytes")["error"]["param"] == "encoding_format"
    assert embed(api, 400, input="hi", stream=True)["error"]["param"] == "stream"
    too_long = embed(api, 400, input=" ".join(["word"] * 65))["error"]
    assert too_long["code"] == "context_length_exceeded"
    assert too_long["param"] == "input"


def test_chat_and_embedding_models_refuse_each_other_s_routes(api: TestClient) -> None:
    wrong = api.post("/v1/embeddings", json={"model": "chat", "input": "hi"})
    assert wrong.status_code == 400
    assert "embedding model" in wrong.json()["error"]["message"]
    for path, body in [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"}),
                       ("/v1/messages", {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})]:
        refused = api.post(path, json={"model": "vectors", **body})
        assert refused.status_code == 400, path
        assert "is an embedding model" in str(refused.json()), path
    assert api.post("/generate", json={"prompt": "hi"}).status_code == 200  # the default is the chat model


def test_the_models_file_starts_embedding_engines_without_warm_up(
    started: tuple[TestClient, list[EngineSettings]], engines: dict[str, FakeEngine]
) -> None:
    client, seen = started
    assert {s.served_model_name: s.task for s in seen} == {"chat": "generate", "embed": "embed", "embed-short": "embed"}
    assert len(engines["chat"].requests) == 1
    assert engines["embed"].requests == []
    assert {"chat", "embed", "vectors"} <= {m["id"] for m in client.get("/v1/models").json()["data"]}


def test_the_default_set_up_serves_an_embedding_model_on_request() -> None:
    assert [m.name for m in modelfile.load(fake_settings()).models] == ["fake-model"]
    both = modelfile.load(fake_settings(embedding_model="fake-embed")).models
    assert [(m.name, m.kind) for m in both] == [("fake-model", "embedded"), ("fake-embed", "embedding")]
    assert both[1].engine_settings(EngineSettings()).task == "embed"


def test_models_that_generate_and_embed_do_not_stand_in_for_each_other(tmp_path: Any) -> None:
    models = tmp_path / "models.yaml"
    for text in ["models: [{name: a}, {name: e, kind: embedding, fallback: [a]}]",
                 "models: [{name: a}, {name: e, kind: embedding}, {name: s, kind: split, versions: {a: 1, e: 1}}]"]:
        models.write_text(text)
        with pytest.raises(modelfile.ConfigError, match="generate and models that embed"):
            modelfile.load(fake_settings(models_file=models))
    models.write_text("models: [{name: a}]")
    with pytest.raises(modelfile.ConfigError, match="kind: embedding"):
        modelfile.load(fake_settings(models_file=models, embedding_model="e"))


def test_engine_args_run_vllm_s_pooling_runner() -> None:
    pytest.importorskip("vllm")
    from engine.vllm_engine import CPU_EMBED_KV_CACHE_BYTES, engine_args

    args = engine_args(EngineSettings(model="/models/m", task="embed"))
    assert (args.runner, args.convert, args.kv_cache_memory_bytes) == ("pooling", "embed", CPU_EMBED_KV_CACHE_BYTES)
    chat = engine_args(EngineSettings(model="/models/m"))
    assert chat.runner != "pooling"
    assert chat.kv_cache_memory_bytes > CPU_EMBED_KV_CACHE_BYTES
