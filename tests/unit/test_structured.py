"""Structured output with bounds (`serving.structured`, `engine.grammar`'s seam): schema limits,
references, finiteness and the compile check refuse before the engine; failed or empty
constrained answers are never cached."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from gateway.app import create_app
from gateway.errors import InvalidRequest
from gateway.serving.structured import check_schema, resolve
from gateway.settings import StructuredOutputSettings
from tests.fakes import FakeEngine, FakeGrammar, fake_settings

MODEL = "fake-model"
ASK = [{"role": "user", "content": "hi"}]
LIMITS = StructuredOutputSettings()
OBJECT = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}


def fmt(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def nested(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels - 1):
        schema = {"type": "object", "properties": {"x": schema}, "required": ["x"]}
    return schema


def refusal(schema: Any, limits: StructuredOutputSettings = LIMITS) -> str:
    with pytest.raises(InvalidRequest) as caught:
        check_schema(schema, limits, "response_format.json_schema.schema")
    assert caught.value.param == "response_format.json_schema.schema"
    return caught.value.message


# --- check_schema: one table per kind of refusal ------------------------------------------------

OVER_LIMITS = [
    ({"enum": [f"v{i}" for i in range(1001)]}, "1001 enum values"),
    ({"type": "object", "properties": {"a": {"enum": list(range(600))}, "b": {"enum": list(range(600))}}}, "1200 enum values"),
    ({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(5001)}}, "5001 object properties"),
    (nested(11), "nested 11 levels"),
    ({"type": "array", "items": nested(10)}, "nested 11 levels"),
    ({"anyOf": [{"const": i} for i in range(1001)]}, "1001 anyOf, oneOf and allOf branches"),
    ({"enum": ["x" * 1000] * 121}, "121000 characters"),
    ({"type": "object", "description": "x" * 300_000}, "bytes; at most 262144"),
]


@pytest.mark.parametrize(("schema", "said"), OVER_LIMITS)
def test_schemas_past_a_limit_are_refused(schema: dict[str, Any], said: str) -> None:
    assert said in refusal(schema)


def test_the_limits_are_settings() -> None:
    tight = StructuredOutputSettings(max_enum_values=3, max_depth=2)
    assert "4 enum values" in refusal({"enum": [1, 2, 3, 4]}, tight)
    assert "nested 3 levels" in refusal(nested(3), tight)
    check_schema({"enum": [1, 2, 3]}, tight, "p")


WITHIN = [
    OBJECT,
    nested(10),
    {"enum": [f"v{i}" for i in range(1000)]},
    # OpenAI's own recursive examples: root recursion and $defs recursion, both with a way out
    {"type": "object", "properties": {"children": {"type": "array", "items": {"$ref": "#"}}}, "required": ["children"]},
    {"$defs": {"node": {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}},
                        "required": ["next"]}}, "$ref": "#/$defs/node"},
    {"definitions": {"a/b": {"type": "integer"}}, "properties": {"x": {"$ref": "#/definitions/a~1b"}}},
    {"type": "object", "properties": {"$ref": {"type": "string"}}},  # a property named $ref is no reference
    {"type": "array", "prefixItems": [{"type": "integer"}], "minItems": 1},
    {"type": ["string", "null"], "enum": ["a", None]},
]


@pytest.mark.parametrize("schema", WITHIN)
def test_real_schemas_pass(schema: dict[str, Any]) -> None:
    check_schema(schema, LIMITS, "p")


REFERENCES = [
    ({"$ref": "http://example.com/schema.json"}, "not external ones"),
    ({"properties": {"a": {"$ref": "https://example.com/a.json#/x"}}}, "not external ones"),
    ({"properties": {"a": {"$ref": "file:///etc/passwd"}}}, "not external ones"),
    ({"properties": {"a": {"$ref": "other.json"}}}, "not external ones"),
    ({"properties": {"a": {"$ref": "#/$defs/missing"}}}, "points to nothing"),
    ({"properties": {"a": {"$ref": "#anchor"}}}, "points to nothing"),
    ({"properties": {"a": {"$ref": 3}}}, "must be a string"),
]


@pytest.mark.parametrize(("schema", "said"), REFERENCES)
def test_references_must_be_local_and_resolve(schema: dict[str, Any], said: str) -> None:
    assert said in refusal(schema)


UNSATISFIABLE = [
    {"$ref": "#"},
    {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}}, "$ref": "#/$defs/n"},
    {"type": "array", "minItems": 1, "items": {"$ref": "#"}},
    {"type": "object", "properties": {}, "required": ["x"], "additionalProperties": False},
    {"type": "object", "properties": {"a": False}, "required": ["a"]},
    {"type": "string", "enum": [1, 2]},
    {"allOf": [{"$ref": "#"}]},
]


@pytest.mark.parametrize("schema", UNSATISFIABLE)
def test_schemas_no_finite_value_satisfies_are_refused(schema: dict[str, Any]) -> None:
    assert "no finite JSON value" in refusal(schema)


@pytest.mark.parametrize("schema", [{"anyOf": []}, {"oneOf": []}, {"enum": []}, {"anyOf": {"type": "string"}}])
def test_empty_or_malformed_alternatives_are_refused(schema: dict[str, Any]) -> None:
    refusal(schema)


def test_a_deep_document_is_refused_without_exhausting_the_stack() -> None:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(5000):
        schema = {"anyOf": [schema]}  # no data nesting: within max_depth, but 10,000 levels of JSON
    assert "more than 64 levels" in refusal(schema)
    check_schema({"default": [[[[1]]]], **nested(10)}, LIMITS, "p")


def test_resolve_reads_json_pointers() -> None:
    root = {"$defs": {"a~b": {"type": "string"}, "c/d": {"type": "integer"}, "list": [{"type": "null"}]}}
    assert resolve(root, "#") is root
    assert resolve(root, "#/$defs/a~0b") == {"type": "string"}
    assert resolve(root, "#/$defs/c~1d") == {"type": "integer"}
    assert resolve(root, "#/$defs/list/0") == {"type": "null"}
    assert resolve(root, "#/$defs/c%2Fd") == {"type": "integer"}  # a URI fragment: percent-decoded (RFC 6901)
    assert resolve(root, "#/$defs/list/7") is None


# --- through the app: every way a schema comes in ---------------------------------------------


@pytest.fixture
def grammar() -> FakeGrammar:
    return FakeGrammar()


@pytest.fixture
def app_client(engine: FakeEngine, grammar: FakeGrammar) -> Iterator[TestClient]:
    settings = fake_settings(max_body_bytes=2_000_000, cache={"backend": "memory"},
                             structured_output={"compile_timeout_s": 0.2})
    app = create_app(settings, engine_starter=lambda es: engine, grammar_starter=lambda e, w, v: grammar)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


BIG_ENUM = {"type": "object", "properties": {"v": {"enum": [f"value-{i}" for i in range(10_000)]}}, "required": ["v"]}
TOOL = {"type": "function", "function": {"name": "pick", "parameters": OBJECT}}


def _tool(parameters: dict[str, Any], name: str = "pick") -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


WAYS_IN = [  # (route, body, the field the refusal names)
    ("/v1/chat/completions", {"messages": ASK, "response_format": fmt(BIG_ENUM)}, "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"messages": ASK, "tools": [TOOL, _tool(BIG_ENUM, "big")],
                              "tool_choice": {"type": "function", "function": {"name": "big"}}}, "tools.1.function.parameters"),
    ("/v1/chat/completions", {"messages": ASK, "tools": [_tool(BIG_ENUM)], "tool_choice": "required"},
     "tools.0.function.parameters"),
    ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": BIG_ENUM}}},
     "text.format.schema"),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "function", "name": "pick", "parameters": BIG_ENUM}],
                       "tool_choice": "required"}, "tools.0.parameters"),
]


@pytest.mark.parametrize(("route", "body", "param"), WAYS_IN)
def test_a_10000_value_enum_is_refused_before_the_engine(
    app_client: TestClient, engine: FakeEngine, grammar: FakeGrammar, route: str, body: dict[str, Any], param: str
) -> None:
    answer = app_client.post(route, json={"model": MODEL, **body})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param
    assert "10000 enum values" in error["message"]
    assert engine.requests == []
    assert grammar.checked == []


def test_anthropic_output_format_is_refused_in_its_dialect(app_client: TestClient, engine: FakeEngine) -> None:
    body = {"model": MODEL, "max_tokens": 8, "messages": ASK,
            "output_config": {"format": {"type": "json_schema", "schema": {"$ref": "http://example.com/s.json"}}}}
    answer = app_client.post("/v1/messages", json=body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["type"] == "error"
    assert "external" in answer.json()["error"]["message"]
    assert engine.requests == []


def test_auto_tool_choice_constrains_nothing_and_checks_nothing(app_client: TestClient, engine: FakeEngine) -> None:
    body = {"model": MODEL, "messages": ASK, "tools": [_tool(BIG_ENUM)], "max_tokens": 2}
    assert app_client.post("/v1/chat/completions", json=body).status_code == 200
    assert engine.requests[0].sampling.json_schema is None


def test_the_compiler_refusal_names_the_field(app_client: TestClient, engine: FakeEngine, grammar: FakeGrammar) -> None:
    grammar.refuse["minimum"] = "Invalid range: minimum greater than maximum"
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}}}
    answer = app_client.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "response_format": fmt(schema)})
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "response_format.json_schema.schema"
    assert "minimum greater than maximum" in answer.json()["error"]["message"]
    assert engine.requests == []


def test_a_compile_past_its_deadline_is_refused(app_client: TestClient, engine: FakeEngine, grammar: FakeGrammar) -> None:
    grammar.hang = "slow"
    schema = {"type": "object", "properties": {"slow": {"type": "string"}}}
    answer = app_client.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "response_format": fmt(schema)})
    assert answer.status_code == 400
    assert "did not compile within 0.2 s" in answer.json()["error"]["message"]
    assert engine.requests == []


def test_json_object_and_good_schemas_are_compiled_then_generated(
    app_client: TestClient, engine: FakeEngine, grammar: FakeGrammar
) -> None:
    engine.reply = ['{"a": "b"}']
    for response_format in ({"type": "json_object"}, fmt(OBJECT)):
        body = {"model": MODEL, "messages": ASK, "response_format": response_format}
        assert app_client.post("/v1/chat/completions", json=body).status_code == 200
    assert grammar.checked == ["", json.dumps(OBJECT)]
    assert len(engine.requests) == 2


def test_plain_requests_never_meet_the_compiler(app_client: TestClient, grammar: FakeGrammar) -> None:
    assert app_client.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 2}).status_code == 200
    assert app_client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}).status_code == 200
    assert grammar.checked == []


async def test_a_client_that_leaves_stops_its_compile(engine: FakeEngine, grammar: FakeGrammar) -> None:
    """The compile runs under the disconnect watch: the client's going cancels it (the real
    compiler kills its worker process then)."""
    grammar.delay = 30
    asking = asyncio.Event()
    check = grammar.check

    async def noted(*args: Any) -> Any:
        asking.set()
        return await check(*args)

    grammar.check = noted  # type: ignore[method-assign]
    settings = fake_settings(structured_output={"compile_timeout_s": 60})
    app = create_app(settings, engine_starter=lambda es: engine, grammar_starter=lambda e, w, v: grammar)
    body = json.dumps({"model": MODEL, "messages": ASK, "response_format": fmt(OBJECT)}).encode()
    sent: list[dict[str, Any]] = []
    stages = iter([{"type": "http.request", "body": body, "more_body": False}])

    async def receive() -> dict[str, Any]:
        step = next(stages, None)
        if step is not None:
            return step
        await asking.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
             "query_string": b"", "headers": [(b"content-type", b"application/json")], "http_version": "1.1",
             "scheme": "http", "server": ("test", 80), "client": ("127.0.0.1", 1), "root_path": ""}
    async with app.router.lifespan_context(app) as state:
        await asyncio.wait_for(app({**scope, "state": dict(state)}, receive, send), 10)
    assert grammar.cancelled == [json.dumps(OBJECT)]
    assert engine.requests == []
    assert not any(m.get("status") == 200 for m in sent)


# --- the response cache keeps no failed or empty constrained answer ---------------------------


def _cached(client: TestClient, body: dict[str, Any]) -> str:
    first = client.post("/v1/chat/completions", json=body)
    second = client.post("/v1/chat/completions", json=body)
    assert first.status_code == second.status_code, (first.text, second.text)
    return second.headers.get("x-cache", "")


def test_an_empty_constrained_answer_is_not_cached(app_client: TestClient, engine: FakeEngine) -> None:
    engine.reply = [""]
    body = {"model": MODEL, "messages": ASK, "temperature": 0, "response_format": fmt(OBJECT)}
    assert _cached(app_client, body) == "MISS"
    assert len(engine.requests) == 2


def test_an_answer_is_cached_as_before(app_client: TestClient, engine: FakeEngine) -> None:
    engine.reply = ['{"a": "b"}']
    body = {"model": MODEL, "messages": ASK, "temperature": 0, "response_format": fmt(OBJECT)}
    assert _cached(app_client, body) == "HIT"
    engine.reply = [""]  # an empty answer without a constraint is an answer
    assert _cached(app_client, {"model": MODEL, "messages": ASK, "temperature": 0}) == "HIT"


@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_error_before_any_token_is_no_empty_200(
    app_client: TestClient, engine: FakeEngine, stream: bool
) -> None:
    """vLLM finishes a request whose grammar failed to compile with reason "error" and no text:
    a 400 for a constrained request (500 otherwise), never an empty answer, never cached."""
    engine.reply, engine.last_finish = [""], "error"
    constrained = {"model": MODEL, "messages": ASK, "temperature": 0, "response_format": fmt(OBJECT), "stream": stream}
    answer = app_client.post("/v1/chat/completions", json=constrained)
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "response_format.json_schema.schema"
    assert app_client.post("/v1/chat/completions", json=constrained).status_code == 400  # not cached
    plain = {"model": MODEL, "messages": ASK, "temperature": 0, "stream": stream}
    assert app_client.post("/v1/chat/completions", json=plain).status_code == 500


def test_the_compilers_close_with_the_app(engine: FakeEngine, grammar: FakeGrammar) -> None:
    app = create_app(fake_settings(), engine_starter=lambda es: engine, grammar_starter=lambda e, w, v: grammar)
    with TestClient(app):
        assert not grammar.closed
    assert grammar.closed
