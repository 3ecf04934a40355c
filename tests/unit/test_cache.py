"""The response cache (gateway.stores.cache) in memory: hits, misses, bounds and TTL."""

from __future__ import annotations

import asyncio
import json
import re
import time

import pytest
from pydantic import BaseModel
from starlette.testclient import TestClient

from gateway.apis.chat.chat_serving import CHAT
from gateway.apis.completions.completions_serving import COMPLETIONS
from gateway.protocol.openai import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    Usage,
)
from gateway.serving.encoding import Renewal
from tests.fakes import FakeEngine, app_with, chat_body
from tests.unit.test_chat import sse_events


def test_memory_cache_hits_for_stream_and_non_stream() -> None:
    engine = FakeEngine()
    with TestClient(app_with(engine, cache={"backend": "memory"})) as client:
        body = chat_body(temperature=0)
        first = client.post("/v1/chat/completions", json=body)
        second = client.post("/v1/chat/completions", json=body)
        assert (first.headers["x-cache"], second.headers["x-cache"]) == ("MISS", "HIT")
        assert second.json()["choices"] == first.json()["choices"]
        assert second.json()["usage"] == first.json()["usage"]
        assert second.json()["id"] != first.json()["id"]
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
        assert hit.headers["x-cache"] == "HIT"
        assert hit.json()["choices"][0]["text"] == "the quick"
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
    from gateway.stores.cache import MemoryCache

    cache = MemoryCache(max_entries=2, max_bytes=10, ttl_s=60)
    await cache.set("a", b"1234")
    await cache.set("b", b"1234")
    await cache.get("a")  # a is now the most recent
    await cache.set("c", b"1234")  # over 2 entries: b, the least recent, goes
    assert await cache.get("b") is None
    assert await cache.get("a") == b"1234"
    await cache.set("d", b"123456789")  # over 10 bytes: the oldest go until it fits
    assert cache.bytes <= 10
    assert await cache.get("d") == b"123456789"
    expiring = MemoryCache(max_entries=10, max_bytes=100, ttl_s=0.01)
    await expiring.set("x", b"1")
    await asyncio.sleep(0.02)  # time passing is the behaviour: past the ttl
    assert await expiring.get("x") is None


def test_with_keys_each_key_has_its_own_cache_unless_shared() -> None:
    """One tenant must not learn what another asked: its unique prompt is a MISS for everyone else."""
    alice, bob = {"Authorization": "Bearer sk-alice"}, {"Authorization": "Bearer sk-bob"}
    body = chat_body(temperature=0, messages=[{"role": "user", "content": "alice's secret question"}])
    engine = FakeEngine()
    with TestClient(app_with(engine, api_keys=["sk-alice", "sk-bob"], cache={"backend": "memory"})) as client:
        assert client.post("/v1/chat/completions", json=body, headers=alice).headers["x-cache"] == "MISS"
        assert client.post("/v1/chat/completions", json=body, headers=alice).headers["x-cache"] == "HIT"
        assert client.post("/v1/chat/completions", json=body, headers=bob).headers["x-cache"] == "MISS"
        assert len(engine.requests) == 2
    shared = {"backend": "memory", "shared_across_keys": True}
    with TestClient(app_with(FakeEngine(), api_keys=["sk-alice", "sk-bob"], cache=shared)) as client:
        assert client.post("/v1/chat/completions", json=body, headers=alice).headers["x-cache"] == "MISS"
        assert client.post("/v1/chat/completions", json=body, headers=bob).headers["x-cache"] == "HIT"


def test_integers_past_64_bits_in_free_form_fields_are_cached_too() -> None:
    """orjson refuses them; the key falls back to json, and a different number is another key.
    (Tools offered with tool_choice auto go to the prompt, so any JSON number is fine there.)"""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 2**80}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    engine = FakeEngine(max_model_len=1000)
    with TestClient(app_with(engine, cache={"backend": "memory"})) as client:
        body = chat_body(temperature=0, seed=2**63 - 1, tools=tools)
        first = client.post("/v1/chat/completions", json=body)
        again = client.post("/v1/chat/completions", json=body)
        assert (first.status_code, first.headers["x-cache"], again.headers["x-cache"]) == (200, "MISS", "HIT")
        schema["properties"]["n"]["maximum"] = 2**80 + 1
        assert client.post("/v1/chat/completions", json=chat_body(temperature=0, seed=2**63 - 1, tools=tools)).headers["x-cache"] == "MISS"
        # but a schema the engine must follow cannot hold them (its wire format stops at 64 bits)
        forced = client.post("/v1/chat/completions", json=chat_body(tools=tools, tool_choice="required"))
        assert forced.status_code == 400
        assert forced.json()["error"]["param"] == "tools"
        fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
        constrained = client.post("/v1/chat/completions", json=chat_body(response_format=fmt))
        assert constrained.status_code == 400
        assert constrained.json()["error"]["param"] == "response_format.json_schema.schema"
        assert len(engine.requests) == 2


def _through_the_model(raw: bytes, kind: type[BaseModel], new_id: str, created: int) -> bytes:
    """What a non-streamed hit answered before `Service.renewed`: the stored JSON validated, given a
    new id and time (`fresh`) and written again (`api.requests.json_response`)."""
    answer = kind.model_validate_json(raw).model_copy(update={"id": new_id, "created": created})
    return answer.__pydantic_serializer__.to_json(answer, exclude_none=True)


RENEWABLE: list[BaseModel] = [
    Completion(id="cmpl-1", created=5, model="m", choices=[CompletionChoice(index=0, text="a", finish_reason="length")],
               usage=Usage(prompt_tokens=3, completion_tokens=1, total_tokens=4)),
    Completion(id="up\u00e9 id", created=-1, model="m\u00e9", usage=None, choices=[CompletionChoice(
        index=1, text="x\n\"y\" \u2603 \U0001f600", logprobs=CompletionLogprobs(
            tokens=["x", ""], token_logprobs=[None, -0.1234567890123],
            top_logprobs=[None, {"x": -1e-300, "\u00e9": -2.5}],
            text_offset=[0, 1]))]),
    ChatCompletion(id="chatcmpl-1", created=7, model="m", system_fingerprint="fp", choices=[ChatChoice(
        index=0, finish_reason="tool_calls", message=AssistantMessage(content=None, tool_calls=[
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"n\": 2}"}}]))],
        usage=Usage(prompt_tokens=3, completion_tokens=1, total_tokens=4, prompt_tokens_details={"cached_tokens": 2})),
    ChatCompletion.model_validate({"id": "x", "object": "chat.completion", "created": 1, "model": "m", "choices": [],
                                   "usage": {"prompt_tokens": 1, "completion_tokens": 0, "total_tokens": 1},
                                   "service_tier": "default", "extra": {"a": [1, 2.5, None, 2**70], "b": None}}),
]


@pytest.mark.parametrize("answer", RENEWABLE)
def test_a_renewed_hit_is_what_the_model_would_have_answered(answer: BaseModel) -> None:
    """A non-streamed hit is answered from the stored JSON with a new head: byte for byte what
    validating it, `fresh` and `json_response` wrote (floats, escapes, extra fields, None left out)."""
    raw = answer.model_dump_json(exclude_none=True).encode()  # as ResponseCache.put stores it
    kind = "text_completion" if isinstance(answer, Completion) else "chat.completion"
    renewed = Renewal(kind, lambda: "new-id", lambda: 1234)(raw)
    assert renewed == _through_the_model(raw, type(answer), "new-id", 1234)
    assert Renewal("chat.completion" if kind == "text_completion" else "text_completion", str, int)(raw) is None


def test_what_renewal_cannot_write_goes_through_the_model() -> None:
    answer = Completion(id='with "quotes"', created=1, model="m", choices=[])
    raw = answer.model_dump_json(exclude_none=True).encode()
    assert COMPLETIONS.renewed(raw) is None  # the id has escapes
    assert COMPLETIONS.renewed(b'{"object":"text_completion","id":"x","created":1,"model":"m"}') is None
    assert CHAT.renewed(b"") is None


def test_services_renew_ids_as_fresh_does() -> None:
    for service, answer, prefix in ((COMPLETIONS, RENEWABLE[0], "cmpl"), (CHAT, RENEWABLE[2], "chatcmpl")):
        raw = answer.model_dump_json(exclude_none=True).encode()
        renewed, before = service.renewed(raw), int(time.time())
        assert renewed is not None
        fresh = json.loads(renewed)
        assert re.fullmatch(prefix + r"-[0-9a-f]{32}", fresh["id"])
        assert fresh["id"] != json.loads(service.renewed(raw) or b"")["id"]
        assert before - 1 <= fresh["created"] <= before + 1
        assert {**fresh, "id": answer.id, "created": answer.created} == json.loads(raw)  # type: ignore[attr-defined]


def test_a_completions_hit_answers_as_the_miss_did_under_a_new_id() -> None:
    engine = FakeEngine()
    with TestClient(app_with(engine, cache={"backend": "memory"})) as client:
        body = {"model": "fake-model", "prompt": "a b", "max_tokens": 2, "temperature": 0, "logprobs": 1, "echo": True}
        miss, hit = (client.post("/v1/completions", json=body) for _ in range(2))
        assert (miss.headers["x-cache"], hit.headers["x-cache"]) == ("MISS", "HIT")
        assert len(engine.requests) == 1
        assert hit.headers["content-type"] == "application/json"
        assert int(hit.headers["content-length"]) == len(hit.content)
        first, again = miss.json(), hit.json()
        assert re.fullmatch(r"cmpl-[0-9a-f]{32}", again["id"])
        assert again["id"] != first["id"]
        assert {**again, "id": first["id"], "created": first["created"]} == first
        assert list(again) == list(first)  # the same fields in the same order


async def test_the_storer_hands_back_what_it_stored_of_that_answer_only() -> None:
    from gateway.stores.cache import MemoryCache, ResponseCache

    backend = MemoryCache(max_entries=10, max_bytes=10_000, ttl_s=60)
    store = ResponseCache(backend).storer("k")
    answer, other = RENEWABLE[1], RENEWABLE[0]
    assert store.written(answer) is None
    await store(answer)
    written = store.written(answer)
    assert written == await backend.get("k") == answer.model_dump_json(exclude_none=True).encode()
    assert store.written(other) is None
    assert store.written(answer.model_copy()) is None


def test_a_stored_miss_answers_the_bytes_it_stored() -> None:
    """The non-streamed miss goes out as the JSON the cache stored: the same answer as uncached."""
    body = {"model": "fake-model", "prompt": "a b", "max_tokens": 2, "seed": 3, "logprobs": 2}
    answers = []
    for cache in ({"backend": "memory"}, {"backend": "off"}):
        with TestClient(app_with(FakeEngine(), cache=cache)) as client:
            answer = client.post("/v1/completions", json=body)
            assert answer.headers["content-type"] == "application/json"
            assert int(answer.headers["content-length"]) == len(answer.content)
            answers.append(answer.json())
            if cache["backend"] == "memory":
                assert answer.headers["x-cache"] == "MISS"
                assert client.post("/v1/completions", json=body).content[-200:] == answer.content[-200:]
    stored, plain = answers
    assert list(stored) == list(plain)
    assert {**stored, "id": plain["id"], "created": plain["created"]} == plain


def test_keys_stay_the_same_for_the_same_request() -> None:
    """A key is the sha256 of the request's canonical JSON (sorted keys, defaults filled, stream,
    stream_options and user left out): replicas of other versions sharing a Redis cache agree on it."""
    import hashlib

    from gateway.protocol.openai import ChatCompletionRequest, CompletionRequest
    from gateway.stores.cache import cache_key

    body = CompletionRequest.model_validate_json(
        b'{"model":"m","prompt":"a b","temperature":0,"logit_bias":{"7":1,"3":-1},"user":"u","stream":true}'
    )
    fields = body.model_dump(mode="json", by_alias=True, exclude={"stream", "stream_options", "user", "model"})
    whole = {"route": "/v1/completions", "model": "served", "identity": "w", "tenant": "t", "body": fields}
    expected = hashlib.sha256(json.dumps(whole, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert cache_key("/v1/completions", "served", body, "t", "w") == expected
    chat = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], "seed": 1})
    reordered = ChatCompletionRequest.model_validate(
        {"seed": 1, "messages": [{"content": "hi", "role": "user"}], "model": "x"}
    )
    assert cache_key("/v1/chat/completions", "served", chat) == cache_key("/v1/chat/completions", "served", reordered)
    assert cache_key("/v1/chat/completions", "served", chat) != cache_key("/v1/chat/completions", "served", chat, "t")
    assert cache_key("/v1/chat/completions", "served", chat) != cache_key("/v1/chat/completions", "served", chat, "", "w")


@pytest.mark.parametrize(("control", "looked_up", "stored"), [
    (["no-cache"], False, True),
    (["No-Cache, max-age=0"], False, True),
    (["no-store"], True, False),
    (["max-age=0", "no-store"], True, False),  # every Cache-Control header counts, not only the first
    (["no-cache, no-store"], False, False),
    (["max-age=60"], True, True),
    (["no-cache-please"], True, True),  # a directive is a whole name
])
def test_cache_control_of_a_request(control: list[str], looked_up: bool, stored: bool) -> None:
    """RFC 9111: a request's `no-cache` skips a stored answer (its fresh one is stored), `no-store`
    keeps its answer out of the cache (a stored one may still answer it)."""
    engine = FakeEngine()
    body = chat_body(temperature=0)
    with TestClient(app_with(engine, cache={"backend": "memory"})) as client:
        client.post("/v1/chat/completions", json=body)  # stored
        asked = client.post("/v1/chat/completions", json=body, headers=[("Cache-Control", c) for c in control])
        assert asked.headers["x-cache"] == ("HIT" if looked_up else "MISS")
        assert len(engine.requests) == (1 if looked_up else 2)
        other = chat_body(temperature=0, max_tokens=4)
        client.post("/v1/chat/completions", json=other, headers=[("Cache-Control", c) for c in control])
        again = client.post("/v1/chat/completions", json=other)
        assert again.headers["x-cache"] == ("HIT" if stored else "MISS")
