"""The production layer on real servers: a second gateway (its own real engine) with a models file,
API keys, the Redis cache on a real redis-server, a remote upstream (the session's gateway), A/B,
fallbacks, admission under a flood, and finally SIGTERM under load."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest

from tests.integration.conftest import Shared, gateway_process
from tests.ports import closed_port
from tests.redis_server import RedisServer
from tests.waits import until_sync

pytestmark = [pytest.mark.integration, pytest.mark.gateway_only("the production layer is the gateway's own")]
KEY = {"Authorization": "Bearer sk-integration"}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MODELS = """
models:
  - name: smol
    engine: {{enforce_eager: true}}
    aliases: [default]
    admission: {{max_running: 3, max_waiting: 3, wait_timeout_s: 300, retry_after_s: 3}}
  - name: smol-remote
    kind: remote
    url: {upstream}/v1
    upstream_model: smollm2-135m-instruct
    admission: {{max_running: 2, max_waiting: 0}}
    fallback: [smol]
  - name: dead-remote
    kind: remote
    url: http://127.0.0.1:{closed_port}/v1
    connect_timeout_s: 2
    fallback: [smol-remote]
  - name: chat
    kind: split
    versions: {{smol: 1, smol-remote: 1}}
    sticky: true
"""
KEYS_FILE = """
keys:
  narrow: {key: sk-narrow, models: [smol-remote, dead-remote]}   # the remote only (dead-remote falls back to it)
  edge: {key: sk-edge, models: [dead-remote]}                    # its only fallback hop is not granted
"""


@pytest.fixture(scope="module")
def second(server: str, redis: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, subprocess.Popen]]:
    """Gateway B: a real engine of its own, and gateway A (the session's) as its remote upstream."""
    folder = tmp_path_factory.mktemp("second")
    models, keys = folder / "models.yaml", folder / "keys.yaml"
    keys.write_text(KEYS_FILE)
    env = {
        "GATEWAY_MODELS_FILE": str(models), "GATEWAY_API_KEYS": '["sk-integration"]', "GATEWAY_KEYS_FILE": str(keys),
        "GATEWAY_CACHE__BACKEND": "redis", "GATEWAY_CACHE__REDIS_URL": redis.url, "GATEWAY_CACHE__REDIS_TIMEOUT_S": "0.3",
        "GATEWAY_WARMUP": "false", "GATEWAY_DRAIN_TIMEOUT_S": "120", "GATEWAY_LOG_FORMAT": "json",
    }
    with closed_port() as dead:  # dead-remote's upstream: refused while the module runs
        models.write_text(MODELS.format(upstream=server, closed_port=dead))
        with gateway_process(folder, env) as started:
            yield started


def post(base: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(f"{base}/v1/chat/completions", json=body, headers={**KEY, **kwargs.pop("headers", {})}, timeout=300, **kwargs)


def test_keys_are_required(second) -> None:
    base, _ = second
    refused = httpx.post(f"{base}/v1/chat/completions", json={"model": "smol", "messages": QUESTION})
    assert refused.status_code == 401
    assert refused.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{base}/health").status_code == 200


def test_ready_lists_every_model(second) -> None:
    base, _ = second
    ready = httpx.get(f"{base}/ready", timeout=30)
    body = ready.json()
    assert body["models"]["smol"] == "ready"
    assert body["models"]["smol-remote"] == "ready"
    assert body["models"]["dead-remote"].startswith("unavailable")
    assert ready.status_code == 503
    listed = {m["id"] for m in httpx.get(f"{base}/v1/models", headers=KEY).json()["data"]}
    assert listed == {"smol", "smol-remote", "dead-remote", "chat", "default"}


def test_remote_upstream_streams_through(second) -> None:
    base, _ = second
    # a stop string of its own: no other test's answer in the upstream's cache (a hit is one chunk)
    body = {"model": "smol-remote", "messages": QUESTION, "max_tokens": 20, "temperature": 0, "stream": True,
            "stop": ["<streams-through>"]}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, headers=KEY, timeout=120) as response:
        assert response.headers["x-served-model"] == "smol-remote"
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]  # not the id: lines
    assert lines[-1] == "data: [DONE]"
    assert len(lines) > 3
    text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or "" for line in lines[:-1]
                   if json.loads(line[6:])["choices"])
    assert "Paris" in text
    whole = post(base, {**body, "stream": False})
    assert "Paris" in whole.json()["choices"][0]["message"]["content"]


def test_upstream_failure_falls_back(second) -> None:
    base, _ = second
    answer = post(base, {"model": "dead-remote", "messages": QUESTION, "max_tokens": 10, "temperature": 0})
    assert answer.status_code == 200
    assert answer.headers["x-served-model"] == "smol-remote"
    metrics = httpx.get(f"{base}/metrics").text
    assert 'gateway_fallbacks_total{fallback="smol-remote",model="dead-remote"}' in metrics
    assert 'gateway_upstream_errors_total{model="dead-remote"}' in metrics


def test_split_is_sticky_and_says_which_version(second) -> None:
    base, _ = second
    body = {"model": "chat", "messages": QUESTION, "max_tokens": 3, "user": "alice"}
    versions = {post(base, body).headers["x-model-version"] for _ in range(3)}
    assert len(versions) == 1
    assert versions <= {"smol", "smol-remote"}
    seen = {post(base, {**body, "user": f"user-{i}"}).headers["x-model-version"] for i in range(12)}
    assert seen == {"smol", "smol-remote"}


def test_a_keys_models_hold_through_splits_fallbacks_and_aliases(second) -> None:
    """A key granted only the remote model: the split chooses the remote arm for every user, the
    alias of the embedded model answers as an unknown model, a fallback chain skips hops not granted."""
    base, _ = second
    narrow, edge = {"Authorization": "Bearer sk-narrow"}, {"Authorization": "Bearer sk-edge"}
    body = {"messages": QUESTION, "max_tokens": 5, "temperature": 1}
    for user in ("ann", "bob", "cy", "dee", "eve", "fay"):
        split = post(base, {**body, "model": "chat", "user": user}, headers=narrow)
        assert split.status_code == 200, split.text
        assert split.headers["x-served-model"] == "smol-remote", user
    unknown = post(base, {**body, "model": "no-such-model"}, headers=narrow)
    for name in ("default", "smol"):
        denied = post(base, {**body, "model": name}, headers=narrow)
        assert denied.status_code == 404
        assert denied.json() == {"error": {**unknown.json()["error"], "message": unknown.json()["error"]["message"]
                                           .replace("no-such-model", name)}}
    hop = post(base, {**body, "model": "dead-remote"}, headers=narrow)
    assert (hop.status_code, hop.headers["x-served-model"]) == (200, "smol-remote")
    skipped = post(base, {**body, "model": "dead-remote"}, headers=edge)
    assert skipped.status_code == 503  # dead, and its one fallback is not this key's
    listed = {m["id"] for m in httpx.get(f"{base}/v1/models", headers=narrow).json()["data"]}
    assert listed == {"smol-remote", "dead-remote", "chat"}
    embedded = httpx.post(f"{base}/tokenize", json={"model": "smol", "prompt": "hi"}, headers=narrow)
    assert embedded.status_code == 404


def test_another_tenants_responses_on_the_real_engine(second) -> None:
    """A stored response and a running background one, on the real engine: another key's every
    action answers as for an unknown id, and the run goes on to its end."""
    base, _ = second
    owner = openai.OpenAI(base_url=f"{base}/v1", api_key="sk-integration", max_retries=0, timeout=120)
    done = owner.responses.create(model="smol", input="Hi", max_output_tokens=16)
    running = owner.responses.create(model="smol", input="Write a long story.", max_output_tokens=200,
                                     temperature=1, background=True)
    other = {"Authorization": "Bearer sk-narrow"}
    unknown = "resp_0123456789abcdef0123456789abcdef"
    for theirs in (done.id, running.id):
        for method, path in [("GET", "/v1/responses/{}"), ("GET", "/v1/responses/{}/input_items"),
                             ("POST", "/v1/responses/{}/cancel"), ("DELETE", "/v1/responses/{}")]:
            refused = httpx.request(method, base + path.format(theirs), headers=other, timeout=30)
            expected = httpx.request(method, base + path.format(unknown), headers=other, timeout=30)
            assert refused.status_code == expected.status_code == 404, path
            assert refused.json()["error"]["message"] == expected.json()["error"]["message"].replace(unknown, theirs)
        follow = httpx.post(f"{base}/v1/responses", headers=other, timeout=30, json={
            "model": "smol-remote", "input": "and?", "previous_response_id": theirs})
        assert follow.status_code == 404
        assert follow.json()["error"]["param"] == "previous_response_id"
    status = until_sync(lambda: (now := owner.responses.retrieve(running.id).status) not in ("queued", "in_progress")
                        and now, 120, "the response done", step_s=0.2)
    assert status in ("completed", "incomplete")  # ran to its end: not cancelled, not deleted
    assert owner.responses.retrieve(done.id).output_text == done.output_text


async def test_overloaded_model_falls_back(second) -> None:
    base, _ = second
    body = {"model": "smol-remote", "messages": QUESTION, "max_tokens": 32, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=600) as client:
        answers = await asyncio.gather(*(client.post(f"{base}/v1/chat/completions", json=body, headers=KEY) for _ in range(4)))
    assert all(a.status_code == 200 for a in answers)
    served = sorted(a.headers["x-served-model"] for a in answers)
    assert served.count("smol-remote") == 2
    assert served.count("smol") == 2


@pytest.fixture
def replica(two_workers: Callable[[], Shared]) -> str:
    """Gateway C: another replica on the same Redis (and keys) as B, its own engine (the Responses API
    serves embedded models only): the two-worker gateway of test_workers (tests/integration/conftest.py)."""
    return two_workers()[0]


def test_a_conversation_continues_on_another_replica(second, replica: str) -> None:
    """previous_response_id on C reads the conversation B stored in Redis."""
    base, _ = second
    on_b = openai.OpenAI(base_url=f"{base}/v1", api_key="sk-integration", max_retries=0, timeout=120)
    on_c = openai.OpenAI(base_url=f"{replica}/v1", api_key="sk-integration", max_retries=0, timeout=120)
    first = on_b.responses.create(model="smol", input=QUESTION[0]["content"], temperature=0, max_output_tokens=30)
    assert "Paris" in first.output_text
    then = on_c.responses.create(model="smollm2-135m-instruct", input="And of Italy?", previous_response_id=first.id,
                                 temperature=0, max_output_tokens=30)
    assert then.status == "completed"
    assert then.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    items = list(on_c.responses.input_items.list(then.id, order="asc"))
    assert [i.role for i in items] == ["user", "assistant", "user"]
    assert items[1].content[0].text == first.output_text
    assert on_b.responses.retrieve(then.id).output_text == then.output_text
    other_key = openai.OpenAI(base_url=f"{replica}/v1", api_key="sk-other", max_retries=0)
    with pytest.raises(openai.NotFoundError):  # scoped per API key
        other_key.responses.retrieve(first.id)


def test_redis_cache_hits_then_serves_on_without_redis(second, redis: RedisServer) -> None:
    base, _ = second
    body = {"model": "smol", "messages": QUESTION, "max_tokens": 12, "temperature": 0}
    first, again = post(base, body), post(base, body)
    assert (first.headers["x-cache"], again.headers["x-cache"]) == ("MISS", "HIT")
    assert again.json()["choices"] == first.json()["choices"]
    assert again.json()["usage"] == first.json()["usage"]
    with httpx.stream("POST", f"{base}/v1/chat/completions", json={**body, "stream": True}, headers=KEY, timeout=60) as streamed:
        assert streamed.headers["x-cache"] == "HIT"
        lines = [line for line in streamed.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    skipped = post(base, body, headers={"Cache-Control": "no-cache"})
    assert skipped.headers["x-cache"] == "MISS"
    redis.stop()
    after = post(base, body)
    assert after.status_code == 200
    assert after.headers["x-cache"] == "MISS"
    assert 'gateway_cache_errors_total{backend="redis"}' in httpx.get(f"{base}/metrics").text
    redis.start()  # (empty) for the session's other users of this Redis: test_workers' gateway


async def test_sigterm_drains_without_losing_admitted_requests(second) -> None:
    """Last in this module: it stops gateway B."""
    base, process = second
    body = {"model": "smol", "messages": QUESTION, "max_tokens": 64, "ignore_eos": True, "stream": True}

    async def stream(client: httpx.AsyncClient, started: asyncio.Event) -> str:
        async with client.stream("POST", f"{base}/v1/chat/completions", json=body, headers=KEY) as response:
            assert response.status_code == 200
            chunks = []
            async for chunk in response.aiter_text():
                chunks.append(chunk)
                started.set()
            return "".join(chunks)

    async with httpx.AsyncClient(timeout=600) as client:
        events = [asyncio.Event() for _ in range(3)]
        tasks = [asyncio.create_task(stream(client, e)) for e in events]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 120)
        process.send_signal(signal.SIGTERM)
        ready = await client.get(f"{base}/ready")  # (503 already: dead-remote is unavailable)
        while ready.json()["status"] != "draining":  # until the signal is handled (bounded by the test's timeout)
            await asyncio.sleep(0.05)
            ready = await client.get(f"{base}/ready")
        refused = await client.post(f"{base}/v1/chat/completions", json={**body, "stream": False}, headers=KEY)
        texts = await asyncio.gather(*tasks)
    assert ready.status_code == 503
    assert ready.json()["status"] == "draining"
    assert refused.status_code == 503
    assert refused.json()["error"]["type"] == "server_error"
    for text in texts:
        assert text.endswith("data: [DONE]\n\n")
        assert sum(1 for event in text.split("\n\n") if '"content"' in event) >= 60
    process.wait(timeout=120)
    assert process.returncode in (0, -signal.SIGTERM)
