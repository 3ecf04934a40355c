"""Structured output with bounds on the real engine (the session's gateway) and the real grammar
compiler (`engine.grammar`, xgrammar with the model's tokenizer): what used to stall every
structured request, answer an empty 200 or go silently unconstrained is refused with a 400 before
the engine, and the other requests go on."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import openai
import pytest

from engine.grammar import GrammarCompiler
from engine.models import default_model_dir
from tests.integration.conftest import MODEL

pytestmark = [pytest.mark.integration, pytest.mark.gateway_only("structured-output bounds are the gateway's")]
ASK = [{"role": "user", "content": "Name a colour."}]
BIG_ENUM = {"type": "object", "properties": {"v": {"enum": [f"a fairly long enumeration value number {i} of many"
                                                             for i in range(10_000)]}}, "required": ["v"]}
ENUM_10K = {"type": "object", "properties": {"v": {"enum": [f"value-{i}" for i in range(10_000)]}}, "required": ["v"]}
VOCAB_SIZE = 49152  # SmolLM2's


def fmt(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def fresh_schema() -> dict:
    """A schema no earlier request sent (its compile verdict is not known yet)."""
    return {"type": "object", "properties": {f"colour_{uuid.uuid4().hex[:8]}": {"type": "string", "maxLength": 12}},
            "additionalProperties": False}


def refused(sdk: openai.OpenAI, schema: dict) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.chat.completions.create(model=MODEL, messages=ASK, max_tokens=20, temperature=0, response_format=fmt(schema))
    return caught.value


async def test_a_huge_enum_is_refused_and_holds_back_no_other_schema(async_sdk: openai.AsyncOpenAI) -> None:
    """The 10,000-value enum used to take the engine's only grammar worker for seconds; now it is a
    400 at once, and a structured request with a new schema beside it completes (no timing assert:
    the bound is the test's own timeout)."""

    async def huge() -> float:
        started = time.perf_counter()
        with pytest.raises(openai.BadRequestError) as caught:
            await async_sdk.chat.completions.create(model=MODEL, messages=ASK, max_tokens=20, response_format=fmt(ENUM_10K))
        assert caught.value.body["param"] == "response_format.json_schema.schema"  # type: ignore[index]
        assert "10000 enum values" in caught.value.message
        return time.perf_counter() - started

    async def normal() -> dict:
        answer = await async_sdk.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=30, temperature=0, response_format=fmt(fresh_schema()))
        content = answer.choices[0].message.content
        assert content
        return json.loads(content) if answer.choices[0].finish_reason == "stop" else {}

    took, parsed = await asyncio.wait_for(asyncio.gather(huge(), normal()), 120)
    assert took < 30  # generous: a refusal before the engine, not a compile
    assert isinstance(parsed, dict)


@pytest.mark.parametrize("ref", ["http://example.com/colour.json", "https://example.com/c.json#/x", "file:///etc/passwd",
                                 "#/$defs/missing"])
def test_external_or_dangling_references_are_refused(sdk: openai.OpenAI, ref: str) -> None:
    error = refused(sdk, {"type": "object", "properties": {"c": {"$ref": ref}}, "required": ["c"]})
    assert error.body["param"] == "response_format.json_schema.schema"  # type: ignore[index]
    assert "$ref" in error.message


@pytest.mark.parametrize("schema", [
    {"$ref": "#"},  # used to answer 200 with empty text (the grammar allows no token), then cached
    {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}},
     "$ref": "#/$defs/n"},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}}, "required": ["n"]},
    {"type": "object", "properties": {"s": {"type": "string", "pattern": "[unclosed"}}, "required": ["s"]},
])
def test_unsatisfiable_schemas_are_refused_every_time(sdk: openai.OpenAI, schema: dict) -> None:
    for _ in range(2):  # the second is no cached empty answer either
        assert refused(sdk, schema).body["param"] == "response_format.json_schema.schema"  # type: ignore[index]


def test_a_forced_tool_with_an_external_reference_is_refused(sdk: openai.OpenAI) -> None:
    tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"c": {"$ref": "http://example.com/c.json"}}}}}
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.chat.completions.create(model=MODEL, messages=ASK, max_tokens=20, tools=[tool],
                                    tool_choice={"type": "function", "function": {"name": "pick"}})
    assert caught.value.body["param"] == "tools.0.function.parameters"  # type: ignore[index]


def test_a_good_schema_still_constrains_the_answer(sdk: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]}},
              "required": ["colour"], "additionalProperties": False}
    answer = sdk.chat.completions.create(model=MODEL, messages=ASK, max_tokens=30, temperature=0, response_format=fmt(schema))
    assert json.loads(answer.choices[0].message.content or "")["colour"] in {"red", "green", "blue"}


async def test_the_compiler_stops_a_slow_compile_and_goes_on() -> None:
    """`engine.grammar` on its own: a compile past its deadline is killed with its process, a
    cancelled one too, and the compiler answers the next schema meanwhile and after."""
    compiler = GrammarCompiler(str(default_model_dir()), VOCAB_SIZE, workers=2).start()
    try:
        await asyncio.wait_for(compiler.started(), 120)
        slow = json.dumps(BIG_ENUM)
        simple = json.dumps(fresh_schema())
        stopped, quick = await asyncio.gather(compiler.check("json_schema", slow, True, 0.5),
                                              compiler.check("json_schema", simple, True, 30))
        assert stopped.timed_out
        assert quick.ok
        assert (await compiler.check("json_schema", simple, True, 30)).cached
        assert not (await compiler.check("json_schema", '{"anyOf": []}', True, 30)).ok  # admits nothing
        task = asyncio.create_task(compiler.check("json_schema", slow, False, 60))
        await asyncio.sleep(0.5)  # the cancel comes mid-compile (the slow schema takes far longer)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(compiler.started(), 120)  # replaced
        assert (await compiler.check("json_schema", json.dumps(fresh_schema()), True, 30)).ok
    finally:
        await compiler.close()
