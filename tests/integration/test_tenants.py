"""Tenants on real servers: a front gateway (remote models only, so no engine of its own: the
documented front-gateway set-up) over the session's gateway on the real engine, with a keys file,
limits and budgets in a real redis-server, the openai SDK as the client, and a real SIGHUP."""

from __future__ import annotations

import hashlib
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis

from tests.integration.conftest import gateway_process
from tests.redis_server import RedisServer
from tests.waits import until_sync

pytestmark = [pytest.mark.integration, pytest.mark.gateway_only("tenants are the gateway's own")]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WAIT_S = 60  # a bound on waiting for a reload, not a measurement
MODELS = """
models:
  - name: smol-remote
    kind: remote
    url: {upstream}/v1
    upstream_model: smollm2-135m-instruct
  - name: other-remote
    kind: remote
    url: {upstream}/v1
    upstream_model: smollm2-135m-instruct
"""
KEYS = f"""
keys:
  qa:
    key_sha256: "{hashlib.sha256(b"sk-qa").hexdigest()}"
    models: [smol-remote]
    team: quality
  tiny:
    key: sk-tiny
    budget: {{day: 50}}
"""


@pytest.fixture(scope="module")
def front(server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, subprocess.Popen, Path, RedisServer]]:
    folder = tmp_path_factory.mktemp("front")
    limits = RedisServer(folder).start()
    (folder / "models.yaml").write_text(MODELS.format(upstream=server))
    keys = folder / "keys.yaml"
    keys.write_text(KEYS)
    env = {
        "GATEWAY_MODELS_FILE": str(folder / "models.yaml"), "GATEWAY_KEYS_FILE": str(keys),
        "GATEWAY_KEYS_RELOAD_INTERVAL_S": "0",  # SIGHUP only: the reload below is the signal's
        "GATEWAY_LIMITS__REDIS_URL": limits.url, "GATEWAY_CACHE__BACKEND": "memory", "GATEWAY_LOG_FORMAT": "json",
    }
    try:
        with gateway_process(folder, env) as (base, process):
            yield base, process, keys, limits
    finally:
        limits.stop()


def sdk(base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=120)


def sample(exposition: str, name: str, **labels: str) -> float:
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in exposition.splitlines():
        match = re.fullmatch(rf"{re.escape(name)}\{{(.*)\}} (\S+)", line)
        if match and ",".join(sorted(match.group(1).split(","))) == wanted:
            return float(match.group(2))
    return 0.0


def test_a_tenant_on_a_remote_model_charged_cached_and_measured(front) -> None:
    base, _, _, limits = front
    client = sdk(base, "sk-qa")
    raw = client.chat.completions.with_raw_response.create(model="smol-remote", messages=QUESTION, temperature=0,
                                                           max_tokens=20)
    first = raw.parse()
    assert "Paris" in (first.choices[0].message.content or "")
    assert raw.headers["x-cache"] == "MISS"
    hit = client.chat.completions.with_raw_response.create(model="smol-remote", messages=QUESTION, temperature=0,
                                                           max_tokens=20)
    assert hit.headers["x-cache"] == "HIT"
    assert hit.parse().choices[0].message.content == first.choices[0].message.content
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        model="smol-remote", messages=QUESTION, temperature=0, max_tokens=20, stream=True) if chunk.choices)
    assert streamed == first.choices[0].message.content  # the cached answer, replayed as a stream

    with pytest.raises(openai.NotFoundError) as refused:  # not in the key's models
        client.chat.completions.create(model="other-remote", messages=QUESTION, max_tokens=5)
    assert refused.value.code == "model_not_found"
    assert [m.id for m in client.models.list()] == ["smol-remote"]

    metrics = httpx.get(f"{base}/metrics").text
    assert sample(metrics, "gateway_key_prompt_tokens_total", key="qa", team="quality") == first.usage.prompt_tokens
    assert sample(metrics, "gateway_key_completion_tokens_total", key="qa", team="quality") == first.usage.completion_tokens
    assert sample(metrics, "gateway_key_requests_total", key="qa", team="quality") == 4  # 3 chats, the list
    assert sample(metrics, "gateway_time_to_first_token_seconds_count", model="smol-remote") == 1  # hits: none
    assert sample(metrics, "gateway_requests_in_flight", model="smol-remote") == 0
    assert redis.Redis.from_url(limits.url).keys("llm-gateway:limits:*") == []  # qa has no limits to count


def test_a_budget_across_requests_and_one_that_never_fits(front) -> None:
    base, _, _, limits = front
    client = sdk(base, "sk-tiny")
    with pytest.raises(openai.RateLimitError) as never:
        client.chat.completions.create(model="smol-remote", messages=QUESTION, max_tokens=100)
    assert never.value.code == "insufficient_quota"
    assert "retry-after" not in never.value.response.headers
    served = 0

    def spend() -> None:
        nonlocal served
        for _ in range(10):
            client.chat.completions.create(model="smol-remote", messages=QUESTION, max_tokens=5, temperature=1)
            served += 1

    with pytest.raises(openai.RateLimitError) as spent:
        spend()
    assert spent.value.code == "insufficient_quota"
    assert int(spent.value.response.headers["retry-after"]) > 0
    day = time.strftime("%Y-%m-%d", time.gmtime())
    used = int(redis.Redis.from_url(limits.url).get(f"llm-gateway:limits:budget:tiny:day:{day}") or 0)
    assert served >= 1
    assert used <= 50


def test_sighup_reloads_the_keys_file(front) -> None:
    base, process, keys, _ = front
    with pytest.raises(openai.AuthenticationError):
        sdk(base, "sk-late").models.list()
    keys.write_text(KEYS + "  late: {key: sk-late, team: late}\n")
    process.send_signal(signal.SIGHUP)

    def listed() -> list[str] | None:
        try:
            return [m.id for m in sdk(base, "sk-late").models.list()]
        except openai.AuthenticationError:
            return None

    assert until_sync(listed, WAIT_S, "the keys file reloaded", step_s=0.2) == ["smol-remote", "other-remote"]
    assert process.poll() is None  # SIGHUP reloads, it does not stop the server
