"""Limits and budgets shared by replicas (gateway.tenancy.quota on Redis): two gateways (the fake engine
behind real uvicorn servers) on one real redis-server stay together within a key's limits, and
count in process, logged and counted, while Redis is down."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
import structlog.testing
from prometheus_client import REGISTRY

from tests.fakes import FakeEngine, chat_body
from tests.redis_server import RedisServer
from tests.served import gateway
from tests.waits import until_sync

WAIT_S = 10  # a bound on waiting for an off-path correction, not a measurement


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path).start()
    yield server
    server.stop()


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    path = tmp_path / "keys.yaml"
    path.write_text("keys:\n"
                    "  shared: {key: sk-shared, rpm: 6}\n"
                    "  capped: {key: sk-capped, budget: {day: 30}}\n"
                    "  tokens: {key: sk-tokens, tpm: 24}\n")
    return path


def post(base: str, key: str, **extra: object) -> httpx.Response:
    return httpx.post(f"{base}/v1/chat/completions", json=chat_body(**extra),
                      headers={"Authorization": f"Bearer {key}"}, timeout=WAIT_S)


def settled(stored: redis.Redis, counter: str, tokens: int) -> None:
    until_sync(lambda: int(stored.get(counter) or 0) == tokens, WAIT_S, f"{counter} at {tokens}")


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_two_gateways_on_one_redis_stay_within_a_keys_limits(redis_server: RedisServer, keys: Path) -> None:
    settings = {"keys_file": keys, "limits": {"redis_url": redis_server.url}}
    with gateway(**settings) as a, gateway(**settings) as b:
        statuses = [post(base, "sk-shared").status_code for base in [a, b] * 6]
        assert sorted(statuses) == [200] * 6 + [429] * 6  # 6 a minute for the key, not 6 per replica
        # tokens per minute: 3 prompt + 3 output = 6 a request, 24 a minute: 4 requests together
        statuses = [post(base, "sk-tokens").status_code for base in [a, b] * 4]
        assert sorted(statuses) == [200] * 4 + [429] * 4
        # a budget of 30 tokens a day, 6 a request: 5 requests, whichever replica serves them
        served = 0
        for base in [a, b] * 4:
            answer = post(base, "sk-capped")
            if answer.status_code == 200:
                served += 1
            else:
                assert answer.json()["error"]["code"] == "insufficient_quota"
                assert "retry-after" in answer.headers
        assert served == 5
    stored = redis.Redis.from_url(redis_server.url)
    day = time.strftime("%Y-%m-%d", time.gmtime())
    assert int(stored.get(f"llm-gateway:limits:budget:capped:day:{day}") or 0) == 30
    assert stored.exists("llm-gateway:limits:requests:shared")


def test_budgets_settle_in_redis_to_what_was_used(redis_server: RedisServer, keys: Path) -> None:
    """max_tokens 20 reserves 23 tokens; the engine's reply ends after 2: 5 are kept."""
    engine = FakeEngine()
    engine.reply = ["Hello", " there"]
    stored = redis.Redis.from_url(redis_server.url)
    counter = f"llm-gateway:limits:budget:capped:day:{time.strftime('%Y-%m-%d', time.gmtime())}"
    with gateway(engine, keys_file=keys, limits={"redis_url": redis_server.url}) as a:
        assert post(a, "sk-capped", max_tokens=20, stream=True).status_code == 200
        settled(stored, counter, 5)  # just after the answer, off its path
        assert post(a, "sk-capped", max_tokens=20).status_code == 200
        settled(stored, counter, 10)
        # 46 reserved, 10 used: without the settlements this one (20) would not fit in 30
        assert post(a, "sk-capped", max_tokens=17).status_code == 200
    assert int(stored.get(counter) or 0) == 15  # the gateway settles before it stops
    assert stored.ttl(counter) > 86400  # the day, plus a day for late settlements


def test_redis_down_counts_in_process_logged_and_counted(redis_server: RedisServer, keys: Path) -> None:
    errors = metric("gateway_limits_redis_errors_total", operation="bucket")
    local = metric("gateway_limits_local_decisions_total")
    with gateway(keys_file=keys, limits={"redis_url": redis_server.url, "redis_retry_s": 60}) as a:
        assert post(a, "sk-shared").status_code == 200  # counted in Redis
        redis_server.stop()
        with structlog.testing.capture_logs() as logs:
            statuses = [post(a, "sk-shared").status_code for _ in range(8)]
    # in process, the bucket starts full again: 6 more, then refused; served throughout
    assert statuses == [200] * 6 + [429] * 2
    assert metric("gateway_limits_redis_errors_total", operation="bucket") == errors + 1  # then not tried for 60 s
    assert metric("gateway_limits_local_decisions_total") >= local + 8
    unavailable = [line for line in logs if line["event"] == "limits_redis_unavailable"]
    assert len(unavailable) == 1
    assert unavailable[0]["counting"] == "in process"
