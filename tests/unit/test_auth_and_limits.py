"""API keys (middleware.auth) and per-key rate limits (limits, middleware.rate_limit)."""

from __future__ import annotations

import structlog.testing
from starlette.testclient import TestClient

from tests.fakes import FakeEngine, app_with, chat_body


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
