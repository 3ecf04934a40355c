"""/v1/embeddings on the real engine: a gateway whose models file declares SmolLM2 as a model of
kind `embedding` (vLLM's pooling runner), with API keys; the openai SDK (floats, base64, batches),
the task check, and Anthropic's SDK against its keys (x-api-key, errors in Anthropic's shape)."""

from __future__ import annotations

import math
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest

from tests.integration.conftest import gateway_process

pytestmark = [pytest.mark.integration, pytest.mark.gateway_only("embeddings beside chat are the gateway's own")]
KEY = "sk-embed"
# SmolLM2 is no Matryoshka model; vLLM is told it is (hf_overrides), so that `dimensions` reaches the
# engine here: shortening then is vLLM's truncate-and-renormalise, which this checks.
MODELS = """
models:
  - name: smol-embed
    kind: embedding
    aliases: [vectors]
    engine: {enforce_eager: true, engine_args: {hf_overrides: {is_matryoshka: true}}}
"""
SIZE = 576  # SmolLM2-135M's hidden size


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("embeddings")
    models = folder / "models.yaml"
    models.write_text(MODELS)
    env = {"GATEWAY_MODELS_FILE": str(models), "GATEWAY_API_KEYS": f'["{KEY}"]', "GATEWAY_LOG_FORMAT": "json"}
    with gateway_process(folder, env) as (base, _):
        yield base


@pytest.fixture
def client(gateway: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key=KEY, max_retries=0, timeout=120)


def norm(vector: list[float]) -> float:
    return math.sqrt(sum(v * v for v in vector))


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True)) / (norm(a) * norm(b))


def test_floats_and_base64_are_the_same_unit_vectors(client: openai.OpenAI) -> None:
    floats = client.embeddings.create(model="smol-embed", input="The capital of France is Paris.", encoding_format="float")
    base64 = client.embeddings.create(model="vectors", input="The capital of France is Paris.")  # the SDK's default
    vector = floats.data[0].embedding
    assert len(vector) == SIZE
    assert math.isclose(norm(vector), 1.0, rel_tol=1e-4)
    assert base64.data[0].embedding == pytest.approx(vector, abs=1e-6)
    assert floats.model == "smol-embed"
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > 5


def test_a_batch_gives_the_same_vectors_as_single_inputs(client: openai.OpenAI) -> None:
    texts = ["The cat sat on the mat.", "A cat was sitting on a mat.", "Stock markets fell sharply today."]
    batch = client.embeddings.create(model="smol-embed", input=texts, encoding_format="float")
    singles = [client.embeddings.create(model="smol-embed", input=t, encoding_format="float").data[0] for t in texts]
    assert [d.index for d in batch.data] == [0, 1, 2]
    for together, alone in zip(batch.data, singles, strict=True):
        assert together.embedding == pytest.approx(alone.embedding, abs=1e-5)
    assert batch.usage.prompt_tokens == sum(
        client.embeddings.create(model="smol-embed", input=t).usage.prompt_tokens for t in texts)
    cat, kitten, stocks = (d.embedding for d in batch.data)
    assert cosine(cat, kitten) > cosine(cat, stocks)


def test_token_ids_and_dimensions(client: openai.OpenAI, gateway: str) -> None:
    text = client.embeddings.create(model="smol-embed", input="hello world", encoding_format="float")
    ids = httpx.post(f"{gateway}/tokenize", json={"model": "smol-embed", "prompt": "hello world"},
                     headers={"x-api-key": KEY}).json()["tokens"]
    by_ids = client.embeddings.create(model="smol-embed", input=[ids, ids[:1]], encoding_format="float")
    assert by_ids.data[0].embedding == pytest.approx(text.data[0].embedding, abs=1e-5)
    assert len(by_ids.data) == 2
    short = client.embeddings.create(model="smol-embed", input="hello world", dimensions=64, encoding_format="float")
    vector = short.data[0].embedding
    head = text.data[0].embedding[:64]
    assert len(vector) == 64
    assert math.isclose(norm(vector), 1.0, rel_tol=1e-4)
    assert vector == pytest.approx([v / norm(head) for v in head], abs=1e-4)
    with pytest.raises(openai.BadRequestError) as too_many:
        client.embeddings.create(model="smol-embed", input="hello", dimensions=SIZE + 1)
    assert too_many.value.body["param"] == "dimensions"


def test_generating_routes_refuse_the_embedding_model(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="smol-embed", messages=[{"role": "user", "content": "hi"}])
    assert "embedding model" in refused.value.body["message"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=client.base_url, api_key="sk-wrong", max_retries=0).embeddings.create(
            model="smol-embed", input="hi")


def test_anthropic_s_sdk_with_its_key_header(gateway: str) -> None:
    with anthropic.Anthropic(base_url=gateway, api_key="sk-wrong", max_retries=0) as wrong, \
            pytest.raises(anthropic.AuthenticationError) as refused:
        wrong.messages.create(model="smol-embed", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert refused.value.body["type"] == "error"
    assert refused.value.body["error"]["type"] == "authentication_error"
    with anthropic.Anthropic(base_url=gateway, api_key=KEY, max_retries=0) as keyed, \
            pytest.raises(anthropic.BadRequestError) as not_chat:  # the key sent as x-api-key
        keyed.messages.count_tokens(model="smol-embed", messages=[{"role": "user", "content": "hi"}])
    assert not_chat.value.body["error"]["type"] == "invalid_request_error"
    assert "embedding model" in not_chat.value.body["error"]["message"]
