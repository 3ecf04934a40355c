"""API keys (middleware.auth) and per-key rate limits (limits, middleware.auth)."""

from __future__ import annotations

import hashlib
import hmac
import json

import pytest
import structlog.testing
from pydantic import SecretStr
from starlette.testclient import TestClient
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.settings import Settings
from gateway.tenancy.keys import AttemptThrottle, ForwardedHeader, KeyRing, TrustedProxies
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
    assert b"sk-secret" not in b"".join(digest for digest, _ in ring._identities)
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


ONE, TWO = ("Authorization", "Bearer sk-one"), ("Authorization", "Bearer sk-two")
X_ONE, X_TWO = ("x-api-key", "sk-one"), ("x-api-key", "sk-two")


@pytest.mark.parametrize("headers", [
    [ONE, TWO], [TWO, ONE], [ONE, X_TWO], [X_TWO, ONE], [X_ONE, X_TWO], [TWO, X_ONE],
    [ONE, ("Authorization", "Basic c2stb25lOg==")], [("Authorization", "Basic c2stb25lOg=="), X_ONE],
    [ONE, ("x-api-key", "")], [ONE, X_ONE, X_TWO],
])
def test_two_different_credentials_are_refused_whatever_their_order(headers: list[tuple[str, str]]) -> None:
    with TestClient(app_with(api_keys=["sk-one", "sk-two"])) as client:
        for path, body in [("/v1/chat/completions", chat_body()), ("/v1/messages", None)]:
            refused = client.post(path, json=body or {}, headers=headers)
            assert refused.status_code == 401
            assert "more than one" in str(refused.json())
        for alone in headers:
            if alone[1] not in ("", "Basic c2stb25lOg=="):
                assert client.post("/v1/chat/completions", json=chat_body(), headers=[alone]).status_code == 200


@pytest.mark.parametrize("headers", [[ONE, ONE], [ONE, X_ONE], [X_ONE, ONE], [X_ONE, X_ONE]])
def test_the_same_key_sent_twice_is_one_credential(headers: list[tuple[str, str]]) -> None:
    with TestClient(app_with(api_keys=["sk-one", "sk-two"])) as client:
        assert client.post("/v1/chat/completions", json=chat_body(), headers=headers).status_code == 200


def _from(app: ASGIApp, peer: list[str]) -> ASGIApp:
    async def from_address(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope["client"] = (peer[0], 5000)
        await app(scope, receive, send)

    return from_address


def test_unknown_keys_are_throttled_per_client_address_and_a_known_key_never() -> None:
    """Behind a balancer every client shares one address: one client's bad keys lock out only more
    bad keys from it, never a tenant with a valid key."""
    peer = ["10.0.0.1"]
    right, wrong = {"Authorization": "Bearer sk-right"}, {"Authorization": "Bearer sk-guess"}
    with TestClient(_from(app_with(api_keys=["sk-right"], auth_failures_per_minute=3), peer)) as client:
        statuses = [client.post("/v1/chat/completions", json=chat_body(), headers=wrong).status_code for _ in range(3)]
        assert statuses == [401, 401, 401]
        throttled = client.post("/v1/chat/completions", json=chat_body(), headers=wrong)
        assert throttled.status_code == 429
        assert int(throttled.headers["retry-after"]) >= 1
        assert throttled.json()["error"]["code"] == "rate_limit_exceeded"
        assert "failed" in throttled.json()["error"]["message"]
        for _ in range(3):  # from the same address, while it is throttled
            assert client.post("/v1/chat/completions", json=chat_body(), headers=right).status_code == 200
            assert client.get("/v1/models", headers={"x-api-key": "sk-right"}).status_code == 200
        peer[0] = "10.0.0.2"  # another address is not held back
        assert client.post("/v1/chat/completions", json=chat_body(), headers=wrong).status_code == 401
    throttle = AttemptThrottle(per_minute=1, max_addresses=2)
    for name in ("a", "b", "c"):
        throttle.failed(name)
    assert throttle.wait_s("a") == 0
    assert throttle.wait_s("c") > 0


@pytest.mark.parametrize(("trusted", "header", "peer", "headers", "client"), [
    ("", "x-forwarded-for", "10.0.0.9", [(b"x-forwarded-for", b"1.2.3.4")], "10.0.0.9"),  # trusts nobody
    ("10.0.0.0/8", "x-forwarded-for", "10.0.0.9", [(b"x-forwarded-for", b"1.2.3.4")], "1.2.3.4"),
    ("10.0.0.0/8", "x-forwarded-for", "192.0.2.7", [(b"x-forwarded-for", b"1.2.3.4")], "192.0.2.7"),  # untrusted peer
    # the client forges a first hop: the nearest untrusted hop, read from the right, counts
    ("10.0.0.0/8", "x-forwarded-for", "10.0.0.9", [(b"x-forwarded-for", b"6.6.6.6, 1.2.3.4, 10.0.0.3")], "1.2.3.4"),
    ("10.0.0.0/8", "x-forwarded-for", "10.0.0.9",
     [(b"x-forwarded-for", b"6.6.6.6"), (b"x-forwarded-for", b"1.2.3.4")], "1.2.3.4"),
    ("10.0.0.0/8", "x-forwarded-for", "10.0.0.9", [], "10.0.0.9"),
    ("10.0.0.0/8", "x-forwarded-for", "10.0.0.9", [(b"forwarded", b"for=1.2.3.4")], "10.0.0.9"),  # not the header
    ("10.0.0.0/8", "forwarded", "10.0.0.9", [(b"x-forwarded-for", b"1.2.3.4")], "10.0.0.9"),
    ("10.0.0.0/8", "forwarded", "10.0.0.9",
     [(b"forwarded", b'for=6.6.6.6, for="[2001:db8::17]:4711";proto=https, for=10.0.0.3:80')], "2001:db8::17"),
    ("*", "x-forwarded-for", "192.0.2.7", [(b"x-forwarded-for", b"1.2.3.4, 5.6.7.8")], "1.2.3.4"),
    ("127.0.0.1, ::1", "x-forwarded-for", "::1", [(b"x-forwarded-for", b"1.2.3.4")], "1.2.3.4"),
    # hops with a port (Azure's balancers write them): the address, not one client per connection
    ("10.0.0.0/8", "x-forwarded-for", "10.0.0.9", [(b"x-forwarded-for", b"1.2.3.4:51234, 10.0.0.3:443")], "1.2.3.4"),
    ("10.0.0.0/8", "x-forwarded-for", "10.0.0.9", [(b"x-forwarded-for", b"[2001:db8::17]:4711")], "2001:db8::17"),
    ("10.0.0.0/8", "x-forwarded-for", "10.0.0.9", [(b"x-forwarded-for", b"2001:db8::17")], "2001:db8::17"),
    # a dual-stack socket names an IPv4 peer ::ffff:10.0.0.9: still the trusted proxy 10.0.0.9
    ("10.0.0.0/8", "x-forwarded-for", "::ffff:10.0.0.9", [(b"x-forwarded-for", b"1.2.3.4")], "1.2.3.4"),
])
def test_the_client_address_comes_from_trusted_proxies_only(
    trusted: str, header: ForwardedHeader, peer: str, headers: list[tuple[bytes, bytes]], client: str
) -> None:
    assert TrustedProxies(trusted, header).client(peer, headers) == client


def test_a_proxy_setting_that_is_no_address_stops_the_start() -> None:
    with pytest.raises(ValueError, match="does not appear to be"):
        Settings(forwarded_allow_ips="10.0.0.0/8, lb.internal")


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


def test_rate_limit_headers_on_every_kind_of_answer() -> None:
    """Streamed, replayed from the cache, and refused for tokens (in either API's shape): the key's
    x-ratelimit-* headers for requests and tokens, and the refusal's Retry-After."""
    limits = ("x-ratelimit-remaining-requests", "x-ratelimit-remaining-tokens")
    with TestClient(app_with(rate_limit_rpm=10, rate_limit_tpm=60, cache={"backend": "memory"})) as client:
        streamed = client.post("/v1/chat/completions", json=chat_body(max_tokens=5, stream=True, temperature=0))
        replayed = client.post("/v1/chat/completions", json=chat_body(max_tokens=5, temperature=0))
        assert replayed.headers["x-cache"] == "HIT"
        for answer in (streamed, replayed):
            assert answer.status_code == 200
            assert all(name in answer.headers for name in limits), answer.headers
        messages = {"model": "fake-model", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}
        for path, body in (("/v1/chat/completions", chat_body(max_tokens=50, stream=True)), ("/v1/messages", messages)):
            refused = client.post(path, json=body)
            assert refused.status_code == 429
            assert all(name in refused.headers for name in limits), refused.headers
            assert int(refused.headers["retry-after"]) >= 1
        assert refused.json()["type"] == "error"  # Anthropic's shape on its route


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
