"""Resumable streams across replicas: two gateways in front of the session's (its model their remote upstream: no
engine of their own) share a real Redis. A client dropped mid-stream on replica A reconnects to replica B and gets
exactly the events it missed, live while A goes on generating; then, with A SIGKILLed mid-stream, the events A
produced before it died and then the rest of the answer, continued on B (`apis.takeover`): the same model behind both
at temperature 0, so together exactly the uninterrupted answer (a prompt whose answer runs past `max_tokens`: no
`ignore_eos`, whose tokens past the model's end of turn are special ones the text leaves out, so no continuation of
the text could repeat them; docs/streams.md)."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
from collections.abc import Iterator

import httpx
import pytest

from tests.integration.conftest import MODEL, gateway_process, in_front_of
from tests.redis_server import RedisServer

pytestmark = [pytest.mark.integration, pytest.mark.gateway_only("resumable streams are the gateway's")]
KEYS = ("sk-resume", "sk-resume-other")
# SmolLM2's answer is 120 tokens of numbers, cut by max_tokens, not ended by the model
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Write the numbers from 340 to 400 separated by commas."}],
        "max_tokens": 120, "temperature": 0, "stream": True}
TIMEOUT = httpx.Timeout(60)


@pytest.fixture(scope="module")
def replicas(server: str, redis: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[tuple]]:
    folder = tmp_path_factory.mktemp("resume")
    env = {**in_front_of(server, folder / "front"), "GATEWAY_API_KEYS": json.dumps(list(KEYS)),
           "GATEWAY_CACHE__BACKEND": "redis", "GATEWAY_CACHE__REDIS_URL": redis.url,
           "GATEWAY_CACHE__REDIS_PREFIX": "resume-test:", "GATEWAY_WARMUP": "false", "GATEWAY_LOG_FORMAT": "json",
           "GATEWAY_STREAMS__RESUMABLE": "true", "GATEWAY_STREAMS__GRACE_S": "60",
           "GATEWAY_STREAMS__LEASE_S": "4"}  # a killed producer is found dead soon; a loaded machine's stall is not
    with contextlib.ExitStack() as stack:
        started = []
        for name in ("a", "b"):
            (folder / name).mkdir()
            started.append(stack.enter_context(gateway_process(folder / name, env)))
        yield started


def auth(key: str = KEYS[0]) -> dict[str, str]:
    return {"authorization": f"Bearer {key}", "cache-control": "no-cache"}  # generated, not a cached answer's replay


def blocks(lines: Iterator[str]) -> Iterator[str]:
    """An SSE body's events as they come, each its lines joined."""
    pending: list[str] = []
    for line in lines:
        if line:
            pending.append(line)
        elif pending:
            yield "\n".join(pending)
            pending = []
    if pending:
        yield "\n".join(pending)


def number(event: str) -> int | None:
    return next((int(line[4:]) for line in event.split("\n") if line.startswith("id: ")), None)


def fresh_body() -> dict:
    # a seed of its own, which the cache's key holds (greedy sampling ignores it): the session's gateway (the upstream)
    # would replay a cached answer in one chunk
    return {**BODY, "seed": secrets.randbits(62)}


def text_of(events: list[str]) -> str:
    chunks = [json.loads(e.split("data: ", 1)[1]) for e in events if "data: {" in e]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))


def first_events(base: str, count: int, body: dict | None = None) -> tuple[str, list[str]]:
    """A stream started on `base`, read for `count` events; the client then drops (the connection closed)."""
    body = body or fresh_body()
    with httpx.Client(timeout=TIMEOUT) as client, \
            client.stream("POST", f"{base}/v1/chat/completions", json=body, headers=auth()) as response:
        assert response.status_code == 200
        stream_id = response.headers["x-stream-id"]
        got = []
        for event in blocks(response.iter_lines()):
            got.append(event)
            if len(got) == count:
                break
    assert number(got[-1]) == count - 1, got  # mid-stream, not its end
    return stream_id, got


def resumed(base: str, stream_id: str, last: int, key: str = KEYS[0]) -> httpx.Response:
    headers = {**auth(key), "last-event-id": str(last)}
    return httpx.get(f"{base}/v1/chat/completions/streams/{stream_id}", headers=headers, timeout=TIMEOUT)


def test_a_dropped_client_resumes_on_the_other_replica_with_exactly_what_it_missed(replicas: list[tuple]) -> None:
    (a, _), (b, _) = replicas
    stream_id, got = first_events(a, 5)
    last = number(got[-1])
    assert [number(event) for event in got] == list(range(5))
    rest = resumed(b, stream_id, last)  # live from B while A generates, to the end
    assert rest.status_code == 200
    missed = list(blocks(rest.text.split("\n")))
    assert missed[-1] == "data: [DONE]"
    assert [number(event) for event in missed[:-1]] == list(range(5, 5 + len(missed) - 1))
    assert len(missed) > 2
    everything = httpx.get(f"{b}/v1/chat/completions/streams/{stream_id}", headers=auth(), timeout=TIMEOUT)
    assert list(blocks(everything.text.split("\n"))) == got + missed  # nothing repeated, nothing missing
    theirs = resumed(b, stream_id, last, key=KEYS[1])
    assert theirs.status_code == 404


def test_a_killed_producers_stream_goes_on_on_the_other_replica(replicas: list[tuple]) -> None:
    (a, producer), (b, _) = replicas
    body = fresh_body()
    stream_id, got = first_events(a, 5, body)
    os.kill(producer.pid, signal.SIGKILL)
    producer.wait(timeout=30)
    rest = resumed(b, stream_id, number(got[-1]))
    assert rest.status_code == 200
    after = list(blocks(rest.text.split("\n")))
    assert after[-1] == "data: [DONE]"
    assert [number(event) for event in after[:-1]] == list(range(5, 5 + len(after) - 1))  # numbered on, each once
    assert not any('"error"' in event for event in after)
    ids = {json.loads(e.split("data: ", 1)[1])["id"] for e in got + after[:-1]}
    assert len(ids) == 1  # one stream
    # a fresh answer (a seed of its own: no cached one, here or upstream) of the same greedy tokens
    uninterrupted = httpx.post(f"{b}/v1/chat/completions", json=fresh_body(), headers=auth(), timeout=TIMEOUT)
    assert text_of(got + after) == text_of(list(blocks(uninterrupted.text.split("\n"))))
