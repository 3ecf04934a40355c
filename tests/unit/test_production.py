"""API keys, rate limits, admission control, the response cache, several models, fallbacks."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
import structlog.testing
from starlette.testclient import TestClient

from gateway.app import create_app
from gateway.backends.modelfile import ConfigError
from tests.fakes import FakeEngine, fake_settings
from tests.unit.test_chat import sse_events

HELLO = [{"role": "user", "content": "hi"}]


def chat_body(model: str = "fake-model", **extra) -> dict:
    return {"model": model, "messages": HELLO, "max_tokens": 3, **extra}


def app_with(engine: FakeEngine | None = None, **settings):
    engine = engine or FakeEngine()
    return create_app(fake_settings(**settings), engine_starter=lambda es: engine)


# --- API keys and rate limits -------------------------------------------------------------------


def test_api_keys_guard_api_routes_not_ops() -> None:
    with TestClient(app_with(api_keys=["sk-one", "sk-two"])) as client:
        missing = client.post("/v1/chat/completions", json=chat_body())
        assert missing.status_code == 401
        assert missing.json()["error"] == {
            "message": missing.json()["error"]["message"], "type": "invalid_request_error", "param": None, "code": "invalid_api_key",
        }
        wrong = client.post("/v1/chat/completions", json=chat_body(), headers={"Authorization": "Bearer sk-three"})
        assert wrong.status_code == 401
        for key in ("sk-one", "sk-two"):
            ok = client.post("/v1/chat/completions", json=chat_body(), headers={"Authorization": f"Bearer {key}"})
            assert ok.status_code == 200
        assert client.get("/v1/models").status_code == 401
        assert client.post("/tokenize", json={"prompt": "a"}).status_code == 401
        for path in ("/health", "/ready", "/metrics", "/openapi.json"):
            assert client.get(path).status_code == 200


def test_ops_routes_closed_by_setting() -> None:
    with TestClient(app_with(api_keys=["sk-one"], auth_ops_routes=True)) as client:
        assert client.get("/metrics").status_code == 401
        assert client.get("/ready", headers={"Authorization": "Bearer sk-one"}).status_code == 200


def test_keys_are_kept_as_hashes_and_logged_by_id() -> None:
    from pydantic import SecretStr

    from gateway.middleware.auth import KeyRing

    ring = KeyRing([SecretStr("sk-secret")])
    assert b"sk-secret" not in b"".join(ring._hashes)
    key_id = ring.identify("sk-secret")
    assert key_id and "secret" not in key_id and ring.identify("sk-other") is None
    with TestClient(app_with(api_keys=["sk-secret"])) as client, structlog.testing.capture_logs() as logs:
        client.post("/v1/chat/completions", json=chat_body(), headers={"Authorization": "Bearer sk-secret"})
    line = next(m for m in logs if m["event"] == "request")
    assert line["api_key_id"] == key_id and "sk-secret" not in str(logs)


def test_requests_per_minute_with_openai_headers() -> None:
    with TestClient(app_with(rate_limit_rpm=2)) as client:
        first = client.post("/v1/chat/completions", json=chat_body())
        assert first.headers["x-ratelimit-limit-requests"] == "2"
        assert first.headers["x-ratelimit-remaining-requests"] == "1"
        assert first.headers["x-ratelimit-reset-requests"].endswith("s")
        assert client.post("/v1/chat/completions", json=chat_body()).status_code == 200
        third = client.post("/v1/chat/completions", json=chat_body())
        assert third.status_code == 429
        assert third.json()["error"]["code"] == "rate_limit_exceeded" and third.json()["error"]["type"] == "rate_limit_error"
        assert int(third.headers["retry-after"]) >= 1 and third.headers["x-ratelimit-remaining-requests"] == "0"


def test_limits_are_per_key() -> None:
    with TestClient(app_with(api_keys=["a", "b"], rate_limit_rpm=1)) as client:
        for key in ("a", "b"):
            assert client.post("/v1/chat/completions", json=chat_body(), headers={"Authorization": f"Bearer {key}"}).status_code == 200
        assert client.post("/v1/chat/completions", json=chat_body(), headers={"Authorization": "Bearer a"}).status_code == 429


def test_tokens_per_minute_count_prompt_and_budget() -> None:
    engine = FakeEngine()
    with TestClient(app_with(engine, rate_limit_tpm=30)) as client:
        ok = client.post("/v1/chat/completions", json=chat_body(max_tokens=10))
        assert ok.status_code == 200
        budget = len(engine.requests[0].prompt_token_ids) + 10
        assert ok.headers["x-ratelimit-remaining-tokens"] == str(30 - budget)
        refused = client.post("/v1/chat/completions", json=chat_body(max_tokens=25))
        assert refused.status_code == 429 and "tokens" in refused.json()["error"]["message"]
        assert len(engine.requests) == 1


# --- admission control --------------------------------------------------------------------------


async def test_flood_holds_the_bound_and_admitted_requests_complete() -> None:
    engine = FakeEngine(delay=0.02)
    app = app_with(engine, admission={"max_running": 2, "max_waiting": 3, "wait_timeout_s": 30, "retry_after_s": 2})
    peak = 0

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, len(engine.running))
            await asyncio.sleep(0.005)

    async with app.router.lifespan_context(app) as state:
        async def with_state(scope, receive, send):
            scope["state"] = dict(state)
            await app(scope, receive, send)

        transport = httpx.ASGITransport(app=with_state)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            watcher = asyncio.create_task(watch())
            bodies = [chat_body(max_tokens=10, stream=i % 2 == 0) for i in range(12)]
            responses = await asyncio.gather(*(client.post("/v1/chat/completions", json=b) for b in bodies))
            watcher.cancel()
    statuses = sorted(r.status_code for r in responses)
    assert statuses.count(200) == 5 and statuses.count(429) == 7
    assert peak == 2
    for response in responses:
        if response.status_code == 429:
            assert response.headers["retry-after"] == "2"
            assert response.json()["error"]["code"] == "model_overloaded"
        elif "text/event-stream" in response.headers["content-type"]:
            assert response.text.endswith("data: [DONE]\n\n")
        else:
            assert response.json()["usage"]["completion_tokens"] == 10
    assert len(engine.finished) == 5


async def test_waiting_past_the_timeout_is_refused_with_503_when_configured() -> None:
    engine = FakeEngine(delay=0.05)
    app = app_with(engine, admission={"max_running": 1, "max_waiting": 5, "wait_timeout_s": 0.1, "reject_status": 503})
    async with app.router.lifespan_context(app) as state:
        async def with_state(scope, receive, send):
            scope["state"] = dict(state)
            await app(scope, receive, send)

        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=with_state), base_url="http://test") as client:
            slow, late = await asyncio.gather(
                client.post("/v1/chat/completions", json=chat_body(max_tokens=10)),
                client.post("/v1/chat/completions", json=chat_body(max_tokens=10)),
            )
    assert slow.status_code == 200
    assert late.status_code == 503 and late.json()["error"]["code"] == "model_overloaded"


# --- response cache -----------------------------------------------------------------------------


def test_memory_cache_hits_for_stream_and_non_stream() -> None:
    engine = FakeEngine()
    with TestClient(app_with(engine, cache={"backend": "memory"})) as client:
        body = chat_body(temperature=0)
        first = client.post("/v1/chat/completions", json=body)
        second = client.post("/v1/chat/completions", json=body)
        assert (first.headers["x-cache"], second.headers["x-cache"]) == ("MISS", "HIT")
        assert second.json()["choices"] == first.json()["choices"]
        assert second.json()["usage"] == first.json()["usage"] and second.json()["id"] != first.json()["id"]
        streamed = client.post("/v1/chat/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
        assert streamed.headers["x-cache"] == "HIT"
        chunks = [json.loads(e) for e in sse_events(streamed.text)[:-1]]
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == "the quick brown"
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert chunks[-1]["usage"] == first.json()["usage"]
        assert len(engine.requests) == 1


def test_stream_miss_fills_the_cache() -> None:
    engine = FakeEngine()
    with TestClient(app_with(engine, cache={"backend": "memory"})) as client:
        body = {"model": "fake-model", "prompt": "a b", "max_tokens": 2, "seed": 5}
        assert client.post("/v1/completions", json={**body, "stream": True}).headers["x-cache"] == "MISS"
        hit = client.post("/v1/completions", json=body)
        assert hit.headers["x-cache"] == "HIT" and hit.json()["choices"][0]["text"] == "the quick"
        assert len(engine.requests) == 1


def test_cache_skips_nondeterministic_and_no_cache() -> None:
    engine = FakeEngine()
    with TestClient(app_with(engine, cache={"backend": "memory"})) as client:
        for _ in range(2):
            assert client.post("/v1/chat/completions", json=chat_body(temperature=0.7)).headers["x-cache"] == "MISS"
        client.post("/v1/chat/completions", json=chat_body(temperature=0))
        skipped = client.post("/v1/chat/completions", json=chat_body(temperature=0), headers={"Cache-Control": "no-cache"})
        assert skipped.headers["x-cache"] == "MISS"
        assert client.post("/v1/chat/completions", json=chat_body(temperature=0, max_tokens=4)).headers["x-cache"] == "MISS"
        assert len(engine.requests) == 5


async def test_memory_cache_bounds_and_ttl() -> None:
    from gateway.cache import MemoryCache

    cache = MemoryCache(max_entries=2, max_bytes=10, ttl_s=60)
    await cache.set("a", b"1234")
    await cache.set("b", b"1234")
    await cache.get("a")  # a is now the most recent
    await cache.set("c", b"1234")  # over 2 entries: b, the least recent, goes
    assert await cache.get("b") is None and await cache.get("a") == b"1234"
    await cache.set("d", b"123456789")  # over 10 bytes: the oldest go until it fits
    assert cache.bytes <= 10 and await cache.get("d") == b"123456789"
    expiring = MemoryCache(max_entries=10, max_bytes=100, ttl_s=0.01)
    await expiring.set("x", b"1")
    await asyncio.sleep(0.02)
    assert await expiring.get("x") is None


# --- several models, A/B, fallback ----------------------------------------------------------------


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "models.yaml"
    path.write_text(text)
    return path


MODELS = """
models:
  - name: primary
    aliases: [default]
    fallback: [backup]
    admission: {max_running: 1, max_waiting: 0}
  - name: backup
  - name: chat
    kind: split
    versions: {primary: 1, backup: 1}
    sticky: true
"""


def multi_app(tmp_path: Path, engines: dict[str, FakeEngine]):
    return create_app(fake_settings(models_file=write(tmp_path, MODELS)),
                      engine_starter=lambda es: engines[es.served_model_name])


def test_models_aliases_and_listing(tmp_path: Path) -> None:
    engines = {"primary": FakeEngine("primary"), "backup": FakeEngine("backup")}
    with TestClient(multi_app(tmp_path, engines)) as client:
        ids = [m["id"] for m in client.get("/v1/models").json()["data"]]
        assert set(ids) == {"primary", "backup", "chat", "default"}
        answer = client.post("/v1/chat/completions", json=chat_body("default"))
        assert answer.json()["model"] == "primary" and answer.headers["x-served-model"] == "primary"
        assert len(engines["primary"].requests) == 1


def test_fallback_when_the_engine_is_dead(tmp_path: Path) -> None:
    engines = {"primary": FakeEngine("primary"), "backup": FakeEngine("backup")}
    engines["primary"].dead = True
    with TestClient(multi_app(tmp_path, engines)) as client:
        answer = client.post("/v1/chat/completions", json=chat_body("primary", stream=True))
        assert answer.status_code == 200 and answer.headers["x-served-model"] == "backup"
        assert answer.headers["x-model-version"] == "primary"
        assert '"model":"backup"' in answer.text
        metrics = client.get("/metrics").text
        assert 'gateway_fallbacks_total{fallback="backup",model="primary"} 1.0' in metrics


async def test_fallback_when_overloaded(tmp_path: Path) -> None:
    engines = {"primary": FakeEngine("primary", delay=0.05), "backup": FakeEngine("backup")}
    app = multi_app(tmp_path, engines)
    async with app.router.lifespan_context(app) as state:
        async def with_state(scope, receive, send):
            scope["state"] = dict(state)
            await app(scope, receive, send)

        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=with_state), base_url="http://test") as client:
            answers = await asyncio.gather(*(client.post("/v1/chat/completions", json=chat_body("primary")) for _ in range(3)))
    served = sorted(a.headers["x-served-model"] for a in answers)
    assert all(a.status_code == 200 for a in answers)
    assert served == ["backup", "backup", "primary"]


def test_split_is_sticky_per_user_and_spreads(tmp_path: Path) -> None:
    engines = {"primary": FakeEngine("primary"), "backup": FakeEngine("backup")}
    with TestClient(multi_app(tmp_path, engines)) as client:
        versions = {client.post("/v1/chat/completions", json=chat_body("chat", user="alice")).headers["x-model-version"] for _ in range(5)}
        assert len(versions) == 1
        spread = {client.post("/v1/chat/completions", json=chat_body("chat", user=f"user-{i}")).headers["x-model-version"] for i in range(20)}
        assert spread == {"primary", "backup"}
        metrics = client.get("/metrics").text
        assert 'model="backup",route="/v1/chat/completions",status="200"' in metrics


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("models: [{name: a}, {name: a}]", "declared twice"),
        ("models: [{name: a, aliases: [b]}, {name: b}]", "declared twice"),
        ("models: [{name: a, fallback: [nope]}]", "not declared"),
        ("models: [{name: a, fallback: [b]}, {name: b, fallback: [a]}]", "loops"),
        ("models: [{name: r, kind: remote}]", "needs a url"),
        ("models: [{name: s, kind: split}]", "needs versions"),
        ("models: [{name: s, kind: split, versions: {a: -1}}, {name: a}]", "not positive"),
        ("models: [{name: a, colour: red}]", "colour"),
        ("models: [{name: a, engine: {max_model_len: many}}]", "bad engine settings"),
        ("models: {{", "not valid"),
        ("models: []", "not valid"),
    ],
)
def test_bad_models_file_is_refused_with_a_clear_message(tmp_path: Path, text: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        app = create_app(fake_settings(models_file=write(tmp_path, text)), engine_starter=lambda es: FakeEngine(es.served_model_name))
        with TestClient(app):
            pass


def test_models_file_in_toml(tmp_path: Path) -> None:
    path = tmp_path / "models.toml"
    path.write_text('[[models]]\nname = "primary"\naliases = ["p"]\n')
    app = create_app(fake_settings(models_file=path), engine_starter=lambda es: FakeEngine(es.served_model_name))
    with TestClient(app) as client:
        assert client.post("/v1/chat/completions", json=chat_body("p")).status_code == 200


def test_missing_models_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        create_app(fake_settings(models_file=tmp_path / "none.yaml"))
