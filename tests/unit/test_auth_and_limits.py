"""API keys (middleware.auth) and per-key rate limits (limits, middleware.rate_limit)."""

from __future__ import annotations

import hashlib
import hmac
import json

import structlog.testing
from pydantic import SecretStr
from starlette.testclient import TestClient

from gateway.tenancy.keys import AttemptThrottle, KeyRing
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


def test_keys_are_kept_as_hashes_and_logged_by_a_keyed_hash() -> None:
    ring = KeyRing([SecretStr("sk-secret")], SecretStr("id-secret"))
    assert b"sk-secret" not in b"".join(ring._hashes)
    identity = ring.identify("sk-secret")
    assert identity
    assert ring.identify("sk-other") is None
    stored = hashlib.sha256(b"sk-secret").digest()
    assert identity.key_id == hmac.new(b"id-secret", stored, hashlib.sha256).hexdigest()[:12]
    assert identity.key_id not in (stored.hex(), hashlib.sha256(b"sk-secret").hexdigest()[:12])
    # without a configured secret, a random one per process: the same key gets another id
    assert KeyRing([SecretStr("sk-secret")]).identify("sk-secret").key_id != identity.key_id
    assert KeyRing([SecretStr("sk-secret")]).identify("sk-secret").tenant == identity.tenant  # stable
    with TestClient(app_with(api_keys=["sk-secret"], key_id_secret="id-secret")) as client, \
            structlog.testing.capture_logs() as logs:
        client.post("/v1/chat/completions", json=chat_body(), headers={"Authorization": "Bearer sk-secret"})
    line = next(m for m in logs if m["event"] == "request")
    assert line["api_key_id"] == identity.key_id
    assert "sk-secret" not in str(logs)
    assert identity.tenant not in str(logs)


def test_two_authorization_headers_are_refused() -> None:
    with TestClient(app_with(api_keys=["sk-one", "sk-two"])) as client:
        headers = [("Authorization", "Bearer sk-one"), ("Authorization", "Bearer sk-two")]
        refused = client.post("/v1/chat/completions", json=chat_body(), headers=headers)
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "invalid_api_key"
        assert client.post("/v1/chat/completions", json=chat_body(), headers=headers[:1]).status_code == 200


def test_failed_key_attempts_are_throttled_per_client_address() -> None:
    app, address = app_with(api_keys=["sk-right"], auth_failures_per_minute=3), ["10.0.0.1"]

    async def from_address(scope, receive, send):
        if scope["type"] == "http":
            scope["client"] = (address[0], 5000)
        await app(scope, receive, send)

    right, wrong = {"Authorization": "Bearer sk-right"}, {"Authorization": "Bearer sk-guess"}
    with TestClient(from_address) as client:
        statuses = [client.post("/v1/chat/completions", json=chat_body(), headers=wrong).status_code for _ in range(3)]
        assert statuses == [401, 401, 401]
        throttled = client.post("/v1/chat/completions", json=chat_body(), headers=right)
        assert throttled.status_code == 429
        assert int(throttled.headers["retry-after"]) >= 1
        assert throttled.json()["error"]["code"] == "rate_limit_exceeded"
        assert "failed" in throttled.json()["error"]["message"]
        address[0] = "10.0.0.2"  # another client is not held back
        assert client.post("/v1/chat/completions", json=chat_body(), headers=right).status_code == 200
    throttle = AttemptThrottle(per_minute=1, max_addresses=2)
    for name in ("a", "b", "c"):
        throttle.failed(name)
    assert throttle.wait_s("a") == 0
    assert throttle.wait_s("c") > 0


def test_without_keys_a_post_must_declare_json() -> None:
    """A web page can POST text/plain (or a typeless body) to any site without CORS consent."""
    with TestClient(app_with()) as client:
        body = json.dumps(chat_body()).encode()
        for headers in ({"Content-Type": "text/plain"}, {}, {"Content-Type": "application/x-www-form-urlencoded"}):
            refused = client.post("/v1/chat/completions", content=body, headers=headers)
            assert refused.status_code == 415
            assert refused.json()["error"]["code"] == "unsupported_media_type"
        ok = client.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json; charset=utf-8"})
        assert ok.status_code == 200
    with TestClient(app_with(api_keys=["sk-one"])) as client:  # a key proves the caller: curl -d works
        sent = client.post("/v1/chat/completions", content=body, headers={"Authorization": "Bearer sk-one", "Content-Type": "text/plain"})
        assert sent.status_code == 200


def test_a_compressed_body_is_a_415_before_it_is_read() -> None:
    import gzip

    body = json.dumps(chat_body()).encode()
    with TestClient(app_with()) as client:
        for encoding in ("gzip", "br, gzip"):
            refused = client.post("/v1/chat/completions", content=gzip.compress(body),
                                  headers={"Content-Type": "application/json", "Content-Encoding": encoding})
            assert refused.status_code == 415
            assert refused.json()["error"]["code"] == "unsupported_media_type"
            assert encoding in refused.json()["error"]["message"]
        refused = client.post("/v1/messages", content=b"x", headers={"Content-Type": "application/json",
                                                                     "Content-Encoding": "gzip"})
        assert refused.status_code == 415
        assert refused.json()["type"] == "error"
        sent = client.post("/v1/chat/completions", content=body,
                           headers={"Content-Type": "application/json", "Content-Encoding": "identity"})
        assert sent.status_code == 200


def test_requests_per_minute_with_openai_headers() -> None:
    with TestClient(app_with(rate_limit_rpm=2)) as client:
        first = client.post("/v1/chat/completions", json=chat_body())
        assert first.headers["x-ratelimit-limit-requests"] == "2"
        assert first.headers["x-ratelimit-remaining-requests"] == "1"
        assert first.headers["x-ratelimit-reset-requests"].endswith("s")
        assert client.post("/v1/chat/completions", json=chat_body()).status_code == 200
        third = client.post("/v1/chat/completions", json=chat_body())
        assert third.status_code == 429
        assert third.json()["error"]["code"] == "rate_limit_exceeded"
        assert third.json()["error"]["type"] == "rate_limit_error"
        assert int(third.headers["retry-after"]) >= 1
        assert third.headers["x-ratelimit-remaining-requests"] == "0"


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
        assert refused.status_code == 429
        assert "tokens" in refused.json()["error"]["message"]
        assert len(engine.requests) == 1


def test_a_request_that_can_never_fit_the_tokens_per_minute_is_told_so_once() -> None:
    engine = FakeEngine()
    with TestClient(app_with(engine, rate_limit_tpm=30)) as client:
        refused = client.post("/v1/chat/completions", json=chat_body(max_tokens=40))
        assert refused.status_code == 400
        assert "retry-after" not in refused.headers
        error = refused.json()["error"]
        assert error["code"] == "tokens_over_limit"
        assert error["param"] == "max_tokens"
        assert "30" in error["message"]
        assert engine.requests == []
        assert client.post("/v1/chat/completions", json=chat_body(max_tokens=10)).status_code == 200  # nothing was taken
