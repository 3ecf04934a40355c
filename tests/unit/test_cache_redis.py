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


def test_replicas_agree_on_an_adapter_by_its_files_not_by_their_place(redis: RedisServer, tmp_path: Path) -> None:
    """Two replicas sharing Redis, each its own copy of an adapter's files: one's answer is the other's hit; another
    replica that loaded other weights under the same name misses (its digest differs, not a per-process counter)."""
    from tests.adapters import write_stub

    cache = {"backend": "redis", "redis_url": redis.url, "ttl_s": 60}
    models = tmp_path / "models.yaml"
    models.write_text("models:\n  - {name: base, engine: {enable_lora: true, max_loras: 2}}\n")
    copies = [write_stub(tmp_path / "one"), write_stub(tmp_path / "two"), write_stub(tmp_path / "other", rank=16)]
    body = {**BODY, "model": "x"}
    statuses = []
    for copy in copies:
        settings = fake_settings(models_file=models, admin_keys=["sk-admin"], cache=cache)
        start = lambda es: FakeEngine(es.served_model_name, max_loras=2)
        with TestClient(create_app(settings, engine_starter=start)) as replica:
            loaded = replica.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(copy)},
                                  headers={"Authorization": "Bearer sk-admin"})
            assert loaded.status_code == 200, loaded.text
            statuses.append(replica.post("/v1/chat/completions", json=body).headers["x-cache"])
    assert statuses == ["MISS", "HIT", "MISS"]
