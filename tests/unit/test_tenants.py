"""Tenants (gateway.tenancy.tenants, gateway.tenancy.quota in process): the keys file (plain keys and SHA-256s,
validation, reload), each key's models, limits, token budgets (429 insufficient_quota), guard
profile and priority, and usage per key in the metrics."""

from __future__ import annotations

import asyncio
import hashlib
import textwrap
from pathlib import Path

import httpx
import openai
import pytest
import structlog.testing
from prometheus_client import REGISTRY
from starlette.testclient import TestClient

from gateway.app import create_app
from gateway.backends.versions import covers
from gateway.tenancy.tenants import KeysFileError, Tenants
from tests.fakes import FakeEngine, HeldEngine, app_with, chat_body, fake_settings
from tests.waits import until

# chat_body's prompt on the fake engine: "<user> hi <assistant>", 3 tokens; max_tokens 3
PROMPT_TOKENS = 3


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def keys_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "keys.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture
def two_keys(tmp_path: Path) -> Path:
    return keys_file(tmp_path, f"""
        keys:
          alpha:
            key: sk-alpha
            team: research
            owner: alice@example.com
          beta:
            key_sha256: {sha("sk-beta").upper()}
            rpm: 2
            models: [fake-model]
            team: billing
    """)


# ---------------------------------------------------------------------------------------------
# the file, auth


def test_plain_keys_and_sha256s_authenticate_and_are_logged_by_their_id(two_keys: Path) -> None:
    with TestClient(app_with(keys_file=two_keys)) as client, structlog.testing.capture_logs() as logs:
        for key in ("sk-alpha", "sk-beta"):
            assert client.post("/v1/chat/completions", json=chat_body(), headers=bearer(key)).status_code == 200
        assert client.post("/v1/chat/completions", json=chat_body(), headers=bearer("sk-gamma")).status_code == 401
        assert client.post("/v1/chat/completions", json=chat_body()).status_code == 401
    ids = [line.get("api_key_id") for line in logs if line["event"] == "request"]
    assert ids[:2] == ["alpha", "beta"]
    assert "sk-alpha" not in str(logs)


def test_flat_keys_keep_working_beside_the_file(two_keys: Path) -> None:
    with TestClient(app_with(keys_file=two_keys, api_keys=["sk-flat"], rate_limit_rpm=1)) as client:
        assert client.post("/v1/chat/completions", json=chat_body(), headers=bearer("sk-flat")).status_code == 200
        # the global limit: GATEWAY_RATE_LIMIT_RPM for keys without their own
        assert client.post("/v1/chat/completions", json=chat_body(), headers=bearer("sk-flat")).status_code == 429
        first = client.post("/v1/chat/completions", json=chat_body(), headers=bearer("sk-beta"))
        assert first.headers["x-ratelimit-limit-requests"] == "2"  # beta's own


def test_an_empty_keys_file_still_requires_keys(tmp_path: Path) -> None:
    with TestClient(app_with(keys_file=keys_file(tmp_path, "keys: {}\n"))) as client:
        assert client.post("/v1/chat/completions", json=chat_body()).status_code == 401
        assert client.get("/health").status_code == 200


@pytest.mark.parametrize(("text", "problem"), [
    ("keys: {a: {key: sk-a, key_sha256: '" + "0" * 64 + "'}}", "exactly one of"),
    ("keys: {a: {key_sha256: " + "0" * 64 + "}}", "quote it"),
    ("keys: {a: {}}", "exactly one of"),
    ("keys: {a: {key_sha256: abc}}", "key_sha256"),
    ("keys: {a: {key: sk-a}, b: {key_sha256: " + sha("sk-a") + "}}", "are the same key"),
    ("keys: {a: {key: sk-a, models: [gpt-9]}}", "no model 'gpt-9'"),
    ("keys: {a: {key: sk-a, guards: strict}}", "no guard profile 'strict'"),
    ("keys: {a: {key: sk-a, priority: urgent}}", "priority"),
    ("keys: {a: {key: sk-a, budget: {week: 10}}}", "week"),
    ("keys: {'a b': {key: sk-a}}", "keys.a b"),
    ("keys: [a", "keys file"),
])
def test_bad_keys_files_are_refused_at_start(tmp_path: Path, text: str, problem: str) -> None:
    with pytest.raises(KeysFileError, match=problem):
        app_with(keys_file=keys_file(tmp_path, text))


# ---------------------------------------------------------------------------------------------
# models


def test_a_model_the_key_may_not_use_is_not_found(tmp_path: Path) -> None:
    models = tmp_path / "models.yaml"
    models.write_text("models:\n  - {name: fake-model, aliases: [smol]}\n  - {name: other, aliases: [o]}\n")
    path = keys_file(tmp_path, "keys:\n  narrow: {key: sk-n, models: [fake-model]}\n  wide: {key: sk-w}\n")
    with TestClient(app_with(keys_file=path, models_file=models)) as client:
        assert client.post("/v1/chat/completions", json=chat_body("smol"), headers=bearer("sk-n")).status_code == 200
        refused = client.post("/v1/chat/completions", json=chat_body("o"), headers=bearer("sk-n"))
        assert refused.status_code == 404
        assert refused.json()["error"]["code"] == "model_not_found"
        assert "access" in refused.json()["error"]["message"]
        assert client.post("/v1/chat/completions", json=chat_body("o"), headers=bearer("sk-w")).status_code == 200
        listed = {m["id"] for m in client.get("/v1/models", headers=bearer("sk-n")).json()["data"]}
        assert listed == {"fake-model", "smol"}
        assert {"other", "o"} <= {m["id"] for m in client.get("/v1/models", headers=bearer("sk-w")).json()["data"]}
        assert client.get("/v1/models/smol", headers=bearer("sk-n")).json()["id"] == "smol"
        hidden = client.get("/v1/models/o", headers=bearer("sk-n"))  # as a model that does not exist
        assert hidden.status_code == 404
        assert hidden.json()["error"]["code"] == "model_not_found"
        assert client.get("/v1/models/o", headers=bearer("sk-w")).json()["root"] == "other"


# ---------------------------------------------------------------------------------------------
# reload


def test_reload_on_sighup_and_on_change_keeps_the_table_when_the_file_is_bad(two_keys: Path) -> None:
    tenants = Tenants(two_keys, reload_interval_s=0.01)
    tenants.check({"fake-model"}, frozenset())
    assert tenants.identify("sk-alpha") == "alpha"
    assert tenants.policy("beta").rpm == 2
    two_keys.write_text("keys:\n  gamma: {key: sk-gamma, rpm: 7, models: [fake-model]}\n")
    assert tenants.reload("SIGHUP")
    assert tenants.identify("sk-alpha") is None
    assert tenants.identify("sk-gamma") == "gamma"
    failed = metric("gateway_keys_reloads_total", result="error")
    two_keys.write_text("keys:\n  delta: {key: sk-delta, models: [gpt-9]}\n")  # an unknown model: refused
    tenants._next_poll = 0
    tenants.poll()
    assert metric("gateway_keys_reloads_total", result="error") == failed + 1
    assert tenants.identify("sk-gamma") == "gamma"
    assert tenants.policy("gamma").rpm == 7
    tenants._next_poll = 0
    tenants.poll()  # the same bad file is not tried again
    assert metric("gateway_keys_reloads_total", result="error") == failed + 1
    two_keys.write_text("keys:\n  delta: {key: sk-delta}\n")
    tenants._next_poll = 0
    tenants.poll()
    assert tenants.identify("sk-delta") == "delta"


def test_a_reload_reaches_the_running_app(tmp_path: Path) -> None:
    path = keys_file(tmp_path, "keys:\n  one: {key: sk-one}\n")
    tenants = Tenants(path, reload_interval_s=0)
    engine = FakeEngine()
    app = create_app(fake_settings(keys_file=path), engine_starter=lambda es: engine, tenants=tenants)
    with TestClient(app) as client:
        assert client.post("/v1/chat/completions", json=chat_body(), headers=bearer("sk-one")).status_code == 200
        path.write_text("keys:\n  two: {key: sk-two, rpm: 1}\n")
        tenants.reload("SIGHUP")
        assert client.post("/v1/chat/completions", json=chat_body(), headers=bearer("sk-one")).status_code == 401
        assert client.post("/v1/chat/completions", json=chat_body(), headers=bearer("sk-two")).status_code == 200
        assert client.post("/v1/chat/completions", json=chat_body(), headers=bearer("sk-two")).status_code == 429


# ---------------------------------------------------------------------------------------------
# limits, budgets, usage


def test_per_key_tokens_per_minute(tmp_path: Path) -> None:
    path = keys_file(tmp_path, "keys:\n  small: {key: sk-s, tpm: 10}\n  big: {key: sk-b}\n")
    with TestClient(app_with(keys_file=path, rate_limit_tpm=1000)) as client:
        ok = client.post("/v1/chat/completions", json=chat_body(max_tokens=3), headers=bearer("sk-s"))
        assert ok.headers["x-ratelimit-remaining-tokens"] == str(10 - PROMPT_TOKENS - 3)
        refused = client.post("/v1/chat/completions", json=chat_body(max_tokens=5), headers=bearer("sk-s"))
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        big = client.post("/v1/chat/completions", json=chat_body(max_tokens=5), headers=bearer("sk-b"))
        assert big.headers["x-ratelimit-limit-tokens"] == "1000"


def test_a_spent_budget_is_insufficient_quota_as_openai_says(tmp_path: Path) -> None:
    # each request: 3 prompt + 3 output tokens reserved up front, 6 used
    path = keys_file(tmp_path, "keys:\n  capped: {key: sk-c, budget: {day: 14, month: 1000}}\n")
    with TestClient(app_with(keys_file=path)) as client:
        sdk = openai.OpenAI(base_url=f"{client.base_url}/v1", api_key="sk-c", http_client=client, max_retries=0)
        for _ in range(2):
            sdk.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        with pytest.raises(openai.RateLimitError) as refused:
            sdk.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        body = refused.value.body
        assert isinstance(body, dict)
        assert body["type"] == "insufficient_quota"
        assert body["code"] == "insufficient_quota"
        assert int(refused.value.response.headers["retry-after"]) > 0  # until the next UTC day
        assert "12 of its 14 tokens" in body["message"]
        assert client.post("/v1/chat/completions", json=chat_body(max_tokens=1), headers=bearer("sk-c")).status_code == 429


def test_a_request_larger_than_the_whole_budget_has_no_retry_after(tmp_path: Path) -> None:
    path = keys_file(tmp_path, "keys:\n  capped: {key: sk-c, budget: {month: 20}}\n")
    with TestClient(app_with(keys_file=path)) as client:
        refused = client.post("/v1/chat/completions", json=chat_body(max_tokens=30), headers=bearer("sk-c"))
        assert refused.status_code == 429
        assert "retry-after" not in refused.headers
        assert refused.json()["error"] == {"message": refused.json()["error"]["message"], "type": "insufficient_quota",
                                           "param": None, "code": "insufficient_quota"}
        assert client.post("/v1/chat/completions", json=chat_body(max_tokens=3), headers=bearer("sk-c")).status_code == 200


def test_the_budget_counts_what_was_used_not_the_estimate(tmp_path: Path) -> None:
    """max_tokens 10 reserves 13, but a cache hit uses nothing: the reservation comes back."""
    path = keys_file(tmp_path, "keys:\n  capped: {key: sk-c, budget: {day: 30}}\n")
    engine = FakeEngine()
    with TestClient(app_with(engine, keys_file=path, cache={"backend": "memory"})) as client:
        body = chat_body(max_tokens=10, temperature=0)
        for _ in range(6):  # 1 generation (13 tokens), then hits: 6 x 13 reserved would pass 30
            answer = client.post("/v1/chat/completions", json=body, headers=bearer("sk-c"))
            assert answer.status_code == 200, answer.text
        assert len(engine.requests) == 1
        # stream: settled when it ends
        streamed = client.post("/v1/chat/completions", json=chat_body(max_tokens=4, stream=True), headers=bearer("sk-c"))
        assert streamed.status_code == 200
        # used: 13 + 7 = 20 of 30; 3 + 8 = 11 does not fit any more, 3 + 7 does
        assert client.post("/v1/chat/completions", json=chat_body(max_tokens=8), headers=bearer("sk-c")).status_code == 429
        assert client.post("/v1/chat/completions", json=chat_body(max_tokens=7), headers=bearer("sk-c")).status_code == 200


def test_usage_per_key_and_team_in_the_metrics(two_keys: Path) -> None:
    before = {name: metric(name, key="alpha", team="research") for name in (
        "gateway_key_requests_total", "gateway_key_prompt_tokens_total", "gateway_key_completion_tokens_total")}
    with TestClient(app_with(keys_file=two_keys)) as client:
        client.post("/v1/chat/completions", json=chat_body(max_tokens=3), headers=bearer("sk-alpha"))
        client.post("/v1/chat/completions", json=chat_body(max_tokens=4, stream=True), headers=bearer("sk-alpha"))
        client.post("/v1/chat/completions", json=chat_body(model="nope"), headers=bearer("sk-alpha"))  # 404
        exposition = client.get("/metrics").text
    after = {name: metric(name, key="alpha", team="research") for name in before}
    assert after["gateway_key_requests_total"] - before["gateway_key_requests_total"] == 2
    assert after["gateway_key_prompt_tokens_total"] - before["gateway_key_prompt_tokens_total"] == 2 * PROMPT_TOKENS
    assert after["gateway_key_completion_tokens_total"] - before["gateway_key_completion_tokens_total"] == 7
    assert 'gateway_key_prompt_tokens_total{key="alpha",team="research"}' in exposition


# ---------------------------------------------------------------------------------------------
# guard profile, priority


def test_the_keys_guard_profile_comes_before_the_guards_file(tmp_path: Path) -> None:
    guards = tmp_path / "guards.yaml"
    guards.write_text("profiles:\n  strict: {input: {deny: ['(?i)hydra']}}\n")
    path = keys_file(tmp_path, "keys:\n  careful: {key: sk-c, guards: strict}\n  free: {key: sk-f}\n")
    body = chat_body(messages=[{"role": "user", "content": "tell me about Hydra"}])
    with TestClient(app_with(keys_file=path, guards_file=guards)) as client:
        refused = client.post("/v1/chat/completions", json=body, headers=bearer("sk-c"))
        assert refused.status_code == 400
        assert refused.json()["error"]["code"] == "content_policy_violation"
        assert client.post("/v1/chat/completions", json=body, headers=bearer("sk-f")).status_code == 200


async def test_low_priority_is_refused_first_as_the_queue_fills(tmp_path: Path) -> None:
    """max_running 1, max_waiting 4: low may fill half of the queue, normal all of it."""
    path = keys_file(tmp_path, "keys:\n  batch: {key: sk-low, priority: low}\n  web: {key: sk-web}\n")
    engine = HeldEngine()
    app = app_with(engine, keys_file=path, admission={"max_running": 1, "max_waiting": 4, "wait_timeout_s": 30})
    async with app.router.lifespan_context(app) as state:
        async def with_state(scope, receive, send):
            scope["state"] = dict(state)
            await app(scope, receive, send)

        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=with_state), base_url="http://test") as client:
            async def post(key: str) -> httpx.Response:
                return await client.post("/v1/chat/completions", json=chat_body(max_tokens=5), headers=bearer(key))

            running = asyncio.create_task(post("sk-web"))
            await until(lambda: engine.held, what="one running")
            waiting = [asyncio.create_task(post("sk-web")), asyncio.create_task(post("sk-web"))]
            admission = state["gateway"].models.backends["fake-model"].admission
            await until(lambda: admission.waiting == 2, what="both queued: the queue half full")
            low = await post("sk-low")
            normal = asyncio.create_task(post("sk-web"))
            await until(lambda: admission.waiting == 3, what="normal queued")
            engine.go.set()
            results = await asyncio.gather(running, *waiting, normal)
    assert low.status_code == 429
    assert low.json()["error"]["code"] == "model_overloaded"
    assert [r.status_code for r in results] == [200, 200, 200, 200]


def test_the_documented_keys_file_example(tmp_path: Path) -> None:
    doc = (Path(__file__).parents[2] / "docs" / "tenants-and-guards.md").read_text()
    section = doc[doc.index("## Tenants: a keys file"):]
    example = section[section.index("```yaml") + 7:section.index("```", section.index("```yaml") + 7)]
    path = keys_file(tmp_path, example.replace("sk-support-0c5e...", "sk-support-0c5e"))
    tenants = Tenants(path)
    tenants.check({"smollm2-135m-instruct", "assistant"}, frozenset({"strict"}))
    assert tenants.identify("sk-research-0123456789") == "research-batch"  # its key_sha256 is this key's
    policy = tenants.policy("research-batch")
    assert (policy.rpm, policy.tpm, policy.budget_day, policy.priority, policy.team) == (60, 20000, 200000, "low", "research")
    assert policy.models == ("smollm2-135m-instruct", "assistant@1")
    assert covers("assistant@1", "assistant@1.2.0")
    assert not covers("assistant@1", "assistant@2.0.0")


def test_the_tokenizer_routes_hold_the_key_to_its_models(tmp_path: Path) -> None:
    """/tokenize, /detokenize and Anthropic's count_tokens name a model too: a key limited to
    some models gets the same 404 there as on the generation routes, and the native routes'
    default model is one the key may use."""
    models = tmp_path / "models.yaml"
    models.write_text("models:\n  - {name: fake-model, aliases: [smol]}\n  - {name: other, aliases: [o]}\n")
    path = keys_file(tmp_path, "keys:\n  narrow: {key: sk-n, models: [other]}\n  wide: {key: sk-w}\n")
    count = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
    with TestClient(app_with(keys_file=path, models_file=models)) as client:
        for route, body in [("/tokenize", {"model": "smol", "prompt": "a b"}),
                            ("/detokenize", {"model": "fake-model", "tokens": [1]}),
                            ("/v1/messages/count_tokens", count)]:
            refused = client.post(route, json=body, headers={**bearer("sk-n"), "x-api-key": "sk-n"})
            assert refused.status_code == 404, route
            assert client.post(route, json=body, headers={**bearer("sk-w"), "x-api-key": "sk-w"}).status_code == 200, route
        assert client.post("/tokenize", json={"model": "o", "prompt": "a b"}, headers=bearer("sk-n")).status_code == 200
        # no model named: the first generating model this key may use (other), not the first served
        generated = client.post("/generate", json={"prompt": "a b", "max_tokens": 1}, headers=bearer("sk-n"))
        assert generated.status_code == 200
        tokenized = client.post("/tokenize", json={"prompt": "a b"}, headers=bearer("sk-n"))
        assert tokenized.status_code == 200
