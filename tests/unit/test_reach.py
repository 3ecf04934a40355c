"""Which models a request can reach (`ModelRegistry.reach`, the one decision): a key's `models`
list holds for every model a request can reach, whatever way it names one (the name, an alias, a
version range, a split, a fallback hop), on every route that takes a model, in /v1/models, and in
the response cache shared across keys."""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from gateway.app import create_app
from gateway.backends.admission import Admission
from gateway.backends.registry import Backend, ModelRegistry, Split
from gateway.backends.versions import Catalog
from gateway.settings import AdmissionSettings
from tests.fakes import HELLO, FakeEngine, fake_settings

MODELS = """
models:
  - {name: small, aliases: [tiny], fallback: [big]}
  - {name: big, aliases: [huge]}
  - {name: assistant, version: 1.0.0}
  - {name: assistant, version: 2.0.0, aliases: [newest]}
  - {name: ab, kind: split, versions: {small: 1, big: 1}}
  - {name: bigab, kind: split, versions: {big: 1, assistant@2.0.0: 1}}
  - {name: vec, kind: embedding}
  - {name: vec-big, kind: embedding}
"""
KEYS = """
keys:
  narrow: {key: sk-narrow, models: [small, assistant@1, vec]}
  wide: {key: sk-wide}
"""
GENERATING = ("small", "big", "assistant@1.0.0", "assistant@2.0.0")

# (how the request names a model, what the narrow key reaches with it: None is a 404)
REFERENCES = [
    ("small", "small"),  # the model itself
    ("tiny", "small"),  # an alias of a granted model
    ("big", None),
    ("huge", None),  # an alias of a model not granted
    ("assistant", "assistant@1.0.0"),  # the newest stable version it may use, not 2.0.0
    ("assistant@1", "assistant@1.0.0"),
    ("assistant@1.0.0", "assistant@1.0.0"),
    ("assistant@2", None),  # a version range it may not use
    ("assistant@2.0.0", None),
    ("newest", None),
    ("ab", "small"),  # a split: only its granted arm, every time
    ("bigab", None),  # a split without a granted arm
    ("ghost", None),  # nothing at all: the same answer
]


def _chat(model: str) -> tuple[str, dict[str, Any]]:
    return "/v1/chat/completions", {"model": model, "messages": HELLO, "max_tokens": 3, "temperature": 0}


ROUTES: dict[str, Callable[[str], tuple[str, dict[str, Any]]]] = {
    "chat": _chat,
    "chat stream": lambda m: ("/v1/chat/completions", {"model": m, "messages": HELLO, "max_tokens": 3, "stream": True}),
    "completions": lambda m: ("/v1/completions", {"model": m, "prompt": "hi", "max_tokens": 3}),
    "responses": lambda m: ("/v1/responses", {"model": m, "input": "hi", "max_output_tokens": 16}),
    "responses stream": lambda m: ("/v1/responses", {"model": m, "input": "hi", "max_output_tokens": 16, "stream": True}),
    "messages": lambda m: ("/v1/messages", {"model": m, "messages": HELLO, "max_tokens": 3}),
    "count tokens": lambda m: ("/v1/messages/count_tokens", {"model": m, "messages": HELLO}),
    "tokenize": lambda m: ("/tokenize", {"model": m, "prompt": "hi"}),
    "detokenize": lambda m: ("/detokenize", {"model": m, "tokens": [1]}),
    "generate": lambda m: ("/generate", {"model": m, "prompt": "hi", "max_tokens": 2}),
    "stream-generate": lambda m: ("/stream-generate", {"model": m, "prompt": "hi", "max_tokens": 2}),
    "native chat": lambda m: ("/chat", {"model": m, "messages": HELLO, "max_tokens": 2}),
}


def _engines() -> dict[str, FakeEngine]:
    found = {name: FakeEngine(name) for name in GENERATING}
    found.update({name: FakeEngine(name, task="embed") for name in ("vec", "vec-big")})
    return found


@pytest.fixture
def engines() -> dict[str, FakeEngine]:
    return _engines()


def _app(tmp_path: Path, engines: dict[str, FakeEngine], **settings: Any) -> Any:
    (tmp_path / "models.yaml").write_text(MODELS)
    (tmp_path / "keys.yaml").write_text(textwrap.dedent(KEYS))
    return create_app(
        fake_settings(models_file=tmp_path / "models.yaml", keys_file=tmp_path / "keys.yaml", **settings),
        engine_starter=lambda es: engines[es.served_model_name],
    )


@pytest.fixture
def client(tmp_path: Path, engines: dict[str, FakeEngine]) -> Iterator[TestClient]:
    with TestClient(_app(tmp_path, engines)) as found:
        yield found


def _served(answer: httpx.Response, engines: dict[str, FakeEngine], before: dict[str, int]) -> set[str]:
    return {name for name, engine in engines.items() if len(engine.requests) > before[name]}


@pytest.mark.parametrize("route", ROUTES)
def test_every_route_reaches_only_what_the_key_may_use(
    client: TestClient, engines: dict[str, FakeEngine], route: str
) -> None:
    narrow, wide = {"Authorization": "Bearer sk-narrow"}, {"Authorization": "Bearer sk-wide"}
    unknown = None
    for reference, reaches in REFERENCES:
        path, body = ROUTES[route](reference)
        for _ in range(3 if reference == "ab" else 1):  # a split's arm is chosen at random
            before = {name: len(engine.requests) for name, engine in engines.items()}
            answer = client.post(path, json=body, headers=narrow)
            if reaches is None:
                assert answer.status_code == 404, (route, reference, answer.text)
                error = dict(answer.json()["error"])
                error["message"] = error["message"].replace(f"'{reference}'", "'X'")
                unknown = unknown or error
                assert error == unknown, (route, reference)  # denied and absent say the same
                assert _served(answer, engines, before) == set()
                continue
            assert answer.status_code == 200, (route, reference, answer.text)
            assert _served(answer, engines, before) <= {reaches}
            if "x-served-model" in answer.headers:
                assert answer.headers["x-served-model"] == reaches
        if reaches is None and reference != "ghost":  # the wide key reaches it
            assert client.post(path, json=body, headers=wide).status_code == 200, (route, reference)


def test_embeddings_reach_only_what_the_key_may_use(client: TestClient, engines: dict[str, FakeEngine]) -> None:
    narrow, wide = {"Authorization": "Bearer sk-narrow"}, {"Authorization": "Bearer sk-wide"}
    assert client.post("/v1/embeddings", json={"model": "vec", "input": "hi"}, headers=narrow).status_code == 200
    refused = client.post("/v1/embeddings", json={"model": "vec-big", "input": "hi"}, headers=narrow)
    assert refused.status_code == 404
    assert refused.json()["error"]["code"] == "model_not_found"
    assert engines["vec-big"].requests == []
    assert client.post("/v1/embeddings", json={"model": "vec-big", "input": "hi"}, headers=wide).status_code == 200


def test_models_lists_only_names_that_reach_a_granted_model(client: TestClient) -> None:
    narrow = {"Authorization": "Bearer sk-narrow"}
    cards = {card["id"]: card for card in client.get("/v1/models", headers=narrow).json()["data"]}
    assert set(cards) == {"small", "tiny", "assistant@1.0.0", "assistant", "ab", "vec"}
    assert cards["assistant"]["root"] == "assistant@1.0.0"  # the newest it may use
    for name in {"big", "huge", "assistant@2.0.0", "newest", "bigab", "vec-big"}:
        hidden = client.get(f"/v1/models/{name}", headers=narrow)
        assert hidden.status_code == 404
        assert hidden.json()["error"]["code"] == "model_not_found"
    wide = {card["id"] for card in client.get("/v1/models", headers={"Authorization": "Bearer sk-wide"}).json()["data"]}
    assert wide >= {"big", "huge", "assistant@2.0.0", "newest", "bigab", "vec-big"}


def test_a_fallback_hop_the_key_may_not_use_is_skipped(client: TestClient, engines: dict[str, FakeEngine]) -> None:
    engines["small"].dead = True
    path, body = _chat("small")
    denied = client.post(path, json=body, headers={"Authorization": "Bearer sk-narrow"})
    assert denied.status_code == 503  # small's only other hop is big, which it may not use
    assert engines["big"].requests == []
    served = client.post(path, json=body, headers={"Authorization": "Bearer sk-wide"})
    assert served.status_code == 200
    assert served.headers["x-served-model"] == "big"


def test_a_shared_cache_answers_only_a_key_allowed_the_model_that_produced_it(
    tmp_path: Path, engines: dict[str, FakeEngine]
) -> None:
    settings = {"cache": {"backend": "memory", "shared_across_keys": True}}
    narrow, wide = {"Authorization": "Bearer sk-narrow"}, {"Authorization": "Bearer sk-wide"}
    with TestClient(_app(tmp_path, engines, **settings)) as client:
        path, body = _chat("small")
        engines["small"].dead = True
        first = client.post(path, json=body, headers=wide)
        assert (first.headers["x-served-model"], first.headers["x-cache"]) == ("big", "MISS")  # stored: big's
        assert client.post(path, json=body, headers=wide).headers["x-cache"] == "HIT"
        engines["small"].dead = False
        answer = client.post(path, json=body, headers=narrow)
        assert answer.headers["x-served-model"] == "small"
        assert answer.headers["x-cache"] == "MISS"
        assert len(engines["small"].requests) == 1
        big_path, big_body = _chat("big")
        assert client.post(big_path, json=big_body, headers=narrow).status_code == 404  # not big's cached answer
        ab_path, ab_body = _chat("ab")
        assert client.post(ab_path, json=ab_body, headers=narrow).headers["x-served-model"] == "small"
        again = client.post(path, json=body, headers=wide)  # the same key and model: a hit
        assert again.headers["x-cache"] == "HIT"


def _registry() -> ModelRegistry:
    catalog = Catalog()
    backends = {name: Backend(name, Admission(name, AdmissionSettings(max_running=4, max_waiting=4)), FakeEngine(name)) for name in ("small", "big", "family@0.1.0-beta")}
    for version in ("1.0.0", "1.4.2", "2.0.0"):
        name = catalog.add("assistant", version)
        backends[name] = Backend(name, Admission(name, AdmissionSettings(max_running=4, max_waiting=4)), FakeEngine(name))
    catalog.add("family", "0.1.0-beta")
    splits = {"chat": Split("chat", [("small", 1), ("assistant@2.0.0", 1)])}
    return ModelRegistry(backends, splits, {"smol": "small", "helper": "assistant"}, catalog)


@pytest.mark.parametrize(("entries", "granted"), [
    (None, None),
    ((), set()),
    (("assistant@1",), {"assistant@1.0.0", "assistant@1.4.2"}),
    (("assistant@1.4",), {"assistant@1.4.2"}),
    (("assistant@1.4.2",), {"assistant@1.4.2"}),
    (("assistant",), {"assistant@1.0.0", "assistant@1.4.2", "assistant@2.0.0"}),
    (("helper",), {"assistant@1.0.0", "assistant@1.4.2", "assistant@2.0.0"}),  # an alias of the family
    (("chat",), {"small", "assistant@2.0.0"}),  # a split: its arms
    (("smol",), {"small"}),
    (("family",), {"family@0.1.0-beta"}),
    (("assistant@1.4.2-rc.1", "big"), {"big"}),
])
def test_what_a_keys_models_entries_grant(entries: tuple[str, ...] | None, granted: set[str] | None) -> None:
    found = _registry().access(entries)
    assert found == (None if granted is None else frozenset(granted))


def test_a_split_chooses_among_granted_arms_and_versions_among_granted_versions() -> None:
    registry = _registry()
    access = registry.access(("assistant@1",))
    assert registry.reach("assistant", access).version == "assistant@1.4.2"
    assert registry.reach("helper", access).version == "assistant@1.4.2"
    assert registry.reach("assistant").version == "assistant@2.0.0"
    only_small = registry.access(("small",))
    assert {registry.reach("chat", only_small, sticky_key=str(i)).version for i in range(20)} == {"small"}
    assert {registry.reach("chat", sticky_key=str(i)).version for i in range(20)} == {"small", "assistant@2.0.0"}
