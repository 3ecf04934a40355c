"""Fuzzing: property-based tests of the request models (hypothesis) and an OpenAPI-driven fuzzer
(schemathesis, from the gateway's own /openapi.json) against the app on the fake engine. The one
property everywhere: whatever a client sends, the answer is never a 5xx, and every refusal is
OpenAI's error object. Kept to about a minute on two cores (`EXAMPLES`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError
from schemathesis.generation.modes import GenerationMode
from starlette.testclient import TestClient

from gateway.apis.native import native_wire
from gateway.apis.routes import TABLE
from gateway.errors import from_exception
from gateway.protocol import openai as p
from gateway.stores.cache import cache_key
from tests.fakes import FakeEngine, app_with

EXAMPLES = 50
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
# schemathesis' generation from the schema costs up to half a second an example (its negative mode on
# the large bodies: most of this file's time), on some 70 operations: fewer examples each, drawn anew
# on every run (no database, not derandomized), so the runs together still cover more
SCHEMA_EXAMPLES = 25
SCHEMA_FUZZ = settings(FUZZ, max_examples=SCHEMA_EXAMPLES)
MODEL = "fake-model"

scalars = (
    st.none() | st.booleans() | st.text(max_size=12)
    | st.integers(min_value=-(2**70), max_value=2**70) | st.integers(min_value=-3, max_value=130)
    | st.floats(allow_nan=False, allow_infinity=False) | st.floats(min_value=-3, max_value=3)
)
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)
MESSAGES = [{"role": "user", "content": "hello there"}]
BASES: dict[type[BaseModel], dict[str, Any]] = {
    p.ChatCompletionRequest: {"model": MODEL, "messages": MESSAGES, "max_tokens": 4},
    p.CompletionRequest: {"model": MODEL, "prompt": "hello there", "max_tokens": 4},
    native_wire.GenerateRequest: {"prompt": "hello there", "max_tokens": 4},
    native_wire.TokenizeRequest: {"model": MODEL, "prompt": "hello there"},
    native_wire.DetokenizeRequest: {"model": MODEL, "tokens": [10, 11]},
}
ROUTES = {
    p.ChatCompletionRequest: "/v1/chat/completions",
    p.CompletionRequest: "/v1/completions",
    native_wire.GenerateRequest: "/generate",
    native_wire.TokenizeRequest: "/tokenize",
    native_wire.DetokenizeRequest: "/detokenize",
}


def near_valid(model: type[BaseModel]) -> st.SearchStrategy[dict[str, Any]]:
    """A valid request with any of its fields (and sometimes an unknown one) set to any JSON."""
    fields = {info.alias or name: json_values for name, info in model.model_fields.items()}
    extra = st.dictionaries(st.sampled_from([*fields, "bogus"]), json_values, max_size=3)
    return st.builds(lambda base, more: {**base, **more}, st.just(BASES[model]), extra)


@pytest.mark.parametrize("model", list(BASES), ids=lambda m: m.__name__)
def test_request_models_accept_or_refuse_cleanly(model: type[BaseModel]) -> None:
    @FUZZ
    @given(body=near_valid(model))
    def check(body: dict[str, Any]) -> None:
        try:
            request = model.model_validate_json(json.dumps(body))
        except ValidationError as exc:
            error = from_exception(exc)
            assert error.status == 400
            assert error.message
            return
        assert len(cache_key("/route", MODEL, request)) == 64  # any accepted request has a cache key
        if isinstance(request, p.SamplingFields):
            assert request.engine_requests() >= 1

    check()


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    app = app_with(FakeEngine(vocab_size=5000), cache={"backend": "memory"}, max_body_bytes=100_000)
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client


def assert_clean(response: Any) -> None:
    """No 5xx, and every refusal in its route's error shape (Anthropic's on its routes; on /mcp, a JSON-RPC error once
    the request reached the MCP protocol)."""
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code >= 400:
        body = response.json()
        if urlsplit(str(response.request.url)).path == "/mcp" and "jsonrpc" in body:
            assert {"code", "message"} <= set(body["error"])
        elif TABLE.dialect(urlsplit(str(response.request.url)).path) == "anthropic":
            assert body["type"] == "error"
            assert set(body["error"]) == {"type", "message"}
        else:
            assert set(body["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("model", list(ROUTES), ids=lambda m: m.__name__)
def test_no_request_body_gets_a_server_error(client: TestClient, model: type[BaseModel]) -> None:
    @FUZZ
    @given(body=near_valid(model), stream=st.booleans())
    def check(body: dict[str, Any], stream: bool) -> None:
        if stream and "stream" in model.model_fields:
            body = {**body, "stream": True}
        assert_clean(client.post(ROUTES[model], content=json.dumps(body), headers={"Content-Type": "application/json"}))

    check()


def test_no_raw_body_gets_a_server_error(client: TestClient) -> None:
    @FUZZ
    @given(raw=st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
    def check(raw: bytes) -> None:
        assert_clean(client.post("/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"}))

    check()


@pytest.fixture
def api_schema() -> Any:
    """A fresh app per test: schemathesis' pytest plugin ends the app's lifespan after each test."""
    return schemathesis.openapi.from_asgi("/openapi.json", app_with(FakeEngine(vocab_size=5000), cache={"backend": "memory"}))


def operations() -> list[tuple[str, str, GenerationMode]]:
    cases = []
    for endpoint in TABLE.endpoints:
        if endpoint.path == "/openapi.json":
            continue
        cases.append((endpoint.method, endpoint.template, GenerationMode.POSITIVE))
        if endpoint.request is not None:
            cases.append((endpoint.method, endpoint.template, GenerationMode.NEGATIVE))
    return cases


@pytest.mark.parametrize(("method", "path", "mode"), operations(), ids=lambda v: getattr(v, "value", v))
def test_schemathesis_finds_no_server_error(api_schema: Any, method: str, path: str, mode: GenerationMode) -> None:
    """schemathesis generates requests from /openapi.json: valid ones (with the served model's
    name, so they reach the engine) and ones that break the schema on purpose."""
    operation = api_schema[path][method]

    @SCHEMA_FUZZ
    @given(case=operation.as_strategy(generation_mode=mode))
    def check(case: Any) -> None:
        if mode is GenerationMode.POSITIVE and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = MODEL
        assert_clean(case.call())

    check()
