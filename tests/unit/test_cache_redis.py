"""The shared cache on a real redis-server (started here on loopback), and serving on when it dies."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog.testing
from starlette.testclient import TestClient

from gateway.app import create_app
from tests.fakes import FakeEngine, fake_settings
from tests.redis_server import RedisServer
from tests.unit.test_chat import sse_events

BODY = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path).start()
    yield server
    server.stop()


def test_two_replicas_share_answers_through_redis(redis: RedisServer) -> None:
    engines = [FakeEngine(), FakeEngine()]
    cache = {"backend": "redis", "redis_url": redis.url, "ttl_s": 60}
    apps = [create_app(fake_settings(cache=cache), engine_starter=lambda es, e=e: e) for e in engines]
    with TestClient(apps[0]) as first, TestClient(apps[1]) as second:
        miss = first.post("/v1/chat/completions", json=BODY)
        hit = second.post("/v1/chat/completions", json={**BODY, "stream": True})
        assert miss.headers["x-cache"] == "MISS"
        assert hit.headers["x-cache"] == "HIT"
        chunks = [json.loads(e) for e in sse_events(hit.text)[:-1]]
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "the quick brown"
        assert len(engines[0].requests) == 1
        assert len(engines[1].requests) == 0


def test_redis_going_away_serves_uncached_and_says_so(redis: RedisServer) -> None:
    engine = FakeEngine()
    settings = fake_settings(cache={"backend": "redis", "redis_url": redis.url, "redis_timeout_s": 0.2})
    with TestClient(create_app(settings, engine_starter=lambda es: engine)) as client:
        client.post("/v1/chat/completions", json=BODY)
        assert client.post("/v1/chat/completions", json=BODY).headers["x-cache"] == "HIT"
        redis.stop()
        with structlog.testing.capture_logs() as logs:
            for _ in range(2):
                answer = client.post("/v1/chat/completions", json=BODY)
                assert answer.status_code == 200
                assert answer.headers["x-cache"] == "MISS"
        assert any(line["event"] == "cache_unavailable" for line in logs)
        assert 'gateway_cache_errors_total{backend="redis"}' in client.get("/metrics").text
        assert len(engine.requests) == 3
