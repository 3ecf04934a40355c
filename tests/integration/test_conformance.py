"""Conformance: every parameter and error case of the OpenAI API that the gateway offers, on the
real engine, through the official openai SDK (parsing into its types) and raw HTTP.

Run against vLLM's own server with `make conformance-vllm`; docs/api.md lists what differs.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.conftest import MODEL
from tests.waits import until, until_sync

pytestmark = pytest.mark.integration
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
CITY_SCHEMA = {
    "type": "object",
    "properties": {"capital": {"type": "string", "maxLength": 30}},
    "required": ["capital"],
    "additionalProperties": False,
}


def chat(sdk: openai.OpenAI, **kwargs):
    return sdk.chat.completions.create(model=MODEL, messages=kwargs.pop("messages", QUESTION), **kwargs)


# --- chat parameters -------------------------------------------------------------------------


def test_logprobs_and_top_logprobs(sdk: openai.OpenAI) -> None:
    result = chat(sdk, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    content = result.choices[0].logprobs.content
    assert len(content) == result.usage.completion_tokens
    assert "".join(t.token for t in content).startswith("The capital")
    for token in content:
        assert token.logprob <= 0
        assert len(token.top_logprobs) == 3
        assert token.top_logprobs[0].logprob >= token.top_logprobs[-1].logprob
        assert token.logprob == pytest.approx(token.top_logprobs[0].logprob)  # greedy: chosen = best


def test_logprobs_when_streaming(sdk: openai.OpenAI) -> None:
    chunks = list(chat(sdk, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2, stream=True))
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == 4
    assert all(len(e.top_logprobs) == 2 for e in entries)


def test_response_format_json_schema(sdk: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA, "strict": True}}
    result = chat(sdk, max_tokens=60, temperature=0, response_format=fmt)
    data = json.loads(result.choices[0].message.content)
    assert set(data) == {"capital"}
    assert isinstance(data["capital"], str)


def test_response_format_json_object(sdk: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Give the capital of France as JSON."}]
    result = chat(sdk, messages=messages, max_tokens=200, temperature=0, response_format={"type": "json_object"})
    text = result.choices[0].message.content
    assert text.lstrip().startswith("{")
    if result.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_response_format_text(sdk: openai.OpenAI) -> None:
    assert "Paris" in chat(sdk, max_tokens=20, temperature=0, response_format={"type": "text"}).choices[0].message.content


@pytest.mark.gateway_only("named and required tool_choice need --tool-call-parser, and no parser fits SmolLM2")
def test_named_tool_choice_gives_schema_valid_arguments(sdk: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "What's the weather in Paris?"}]
    choice = {"type": "function", "function": {"name": "get_weather"}}
    result = chat(sdk, messages=messages, tools=[WEATHER], tool_choice=choice, max_tokens=60, temperature=0)
    call = result.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)


@pytest.mark.gateway_only("named and required tool_choice need --tool-call-parser, and no parser fits SmolLM2")
def test_required_tool_choice(sdk: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "What's the weather in Paris?"}]
    result = chat(sdk, messages=messages, tools=[WEATHER], tool_choice="required", max_tokens=80,
                  temperature=0, parallel_tool_calls=False)
    calls = result.choices[0].message.tool_calls
    assert len(calls) == 1
    assert calls[0].function.name == "get_weather"
    assert "city" in json.loads(calls[0].function.arguments)
    assert result.choices[0].finish_reason == "tool_calls"


@pytest.mark.gateway_only("named and required tool_choice need --tool-call-parser, and no parser fits SmolLM2")
def test_named_tool_choice_streams_arguments(sdk: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "What's the weather in Rome?"}]
    choice = {"type": "function", "function": {"name": "get_weather"}}
    chunks = list(chat(sdk, messages=messages, tools=[WEATHER], tool_choice=choice, max_tokens=60, temperature=0, stream=True))
    calls = [tc for c in chunks if c.choices and c.choices[0].delta.tool_calls for tc in c.choices[0].delta.tool_calls]
    assert calls[0].function.name == "get_weather"
    assert "city" in json.loads("".join(tc.function.arguments or "" for tc in calls))


@pytest.mark.gateway_only("auto tool choice needs --enable-auto-tool-choice and a parser")
def test_auto_tool_choice_parses_without_error(sdk: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "What's the weather in Paris? Use the tool."}]
    result = chat(sdk, messages=messages, tools=[WEATHER], tool_choice="auto", max_tokens=60, temperature=0)
    message = result.choices[0].message
    assert message.content or message.tool_calls
    if message.tool_calls:
        assert result.choices[0].finish_reason == "tool_calls"


def test_tool_result_messages_render(sdk: openai.OpenAI) -> None:
    messages = [
        {"role": "user", "content": "What's the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"},
    ]
    result = chat(sdk, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=30, temperature=0)
    assert result.choices[0].message.content


def test_tool_choice_none(sdk: openai.OpenAI) -> None:
    result = chat(sdk, tools=[WEATHER], tool_choice="none", max_tokens=20, temperature=0)
    assert result.choices[0].message.tool_calls in (None, [])
    assert "Paris" in result.choices[0].message.content


def test_n_streaming_chunks_carry_their_index(sdk: openai.OpenAI) -> None:
    chunks = list(chat(sdk, max_tokens=6, n=3, temperature=1, seed=1, stream=True))
    indexes = {choice.index for c in chunks for choice in c.choices}
    assert indexes == {0, 1, 2}


def test_stop_sequences(sdk: openai.OpenAI) -> None:
    result = chat(sdk, max_tokens=30, temperature=0, stop=[" of", "xyz"])
    assert result.choices[0].message.content == "The capital"
    single = chat(sdk, max_tokens=30, temperature=0, stop="France")
    assert single.choices[0].message.content == "The capital of "


def test_seed_reproducible_and_user_accepted(sdk: openai.OpenAI) -> None:
    a = chat(sdk, max_tokens=10, temperature=1.2, seed=123, user="user-1")
    b = chat(sdk, max_tokens=10, temperature=1.2, seed=123, user="user-2")
    assert a.choices[0].message.content == b.choices[0].message.content


def test_logit_bias_forces_a_token(sdk: openai.OpenAI, base_url: str) -> None:
    token = httpx.post(f"{base_url}/tokenize", json={"model": MODEL, "prompt": " banana", "add_special_tokens": False}).json()["tokens"][0]
    result = chat(sdk, max_tokens=3, temperature=0, logit_bias={str(token): 100})
    assert result.choices[0].message.content == " banana" * 3


def test_max_completion_tokens_and_penalties(sdk: openai.OpenAI) -> None:
    result = chat(sdk, max_completion_tokens=3, presence_penalty=1.0, frequency_penalty=1.0, temperature=0)
    assert result.usage.completion_tokens == 3
    assert result.choices[0].finish_reason == "length"


def test_stream_options_include_usage(sdk: openai.OpenAI) -> None:
    chunks = list(chat(sdk, max_tokens=5, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 5
    assert chunks[-1].choices == []


def test_vllm_extra_sampling_parameters(sdk: openai.OpenAI) -> None:
    greedy = chat(sdk, max_tokens=8, temperature=0).choices[0].message.content
    top_k = chat(sdk, max_tokens=8, temperature=1, extra_body={"top_k": 1}).choices[0].message.content
    assert top_k == greedy
    long = chat(sdk, max_tokens=12, temperature=0, extra_body={"min_tokens": 12, "ignore_eos": True})
    assert long.usage.completion_tokens == 12
    tuned = chat(sdk, max_tokens=8, extra_body={"min_p": 0.1, "repetition_penalty": 1.2, "skip_special_tokens": False})
    assert tuned.choices[0].message.content is not None
    kept = chat(sdk, max_tokens=30, temperature=0, stop=[" Paris"], extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].message.content.endswith(" Paris")


def test_stop_token_ids(sdk: openai.OpenAI, base_url: str) -> None:
    token = httpx.post(f"{base_url}/tokenize", json={"model": MODEL, "prompt": " of", "add_special_tokens": False}).json()["tokens"][0]
    result = chat(sdk, max_tokens=30, temperature=0, extra_body={"stop_token_ids": [token]})
    assert result.choices[0].message.content.startswith("The capital")
    assert "France" not in result.choices[0].message.content


# --- completions ------------------------------------------------------------------------------


def test_completion_prompt_forms(sdk: openai.OpenAI, base_url: str) -> None:
    ids = httpx.post(f"{base_url}/tokenize", json={"model": MODEL, "prompt": "The capital of France is"}).json()["tokens"]
    by_text = sdk.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0)
    by_ids = sdk.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    assert by_text.choices[0].text == by_ids.choices[0].text
    many = sdk.completions.create(model=MODEL, prompt=["Hello", "The sky is"], max_tokens=3, n=2)
    assert sorted(c.index for c in many.choices) == [0, 1, 2, 3]
    lists = sdk.completions.create(model=MODEL, prompt=[ids, ids[:3]], max_tokens=3, temperature=0)
    assert len(lists.choices) == 2
    assert lists.choices[0].text == by_text.choices[0].text[: len(lists.choices[0].text)]


def test_completion_echo_and_logprobs(sdk: openai.OpenAI) -> None:
    result = sdk.completions.create(model=MODEL, prompt="The sky is", max_tokens=3, echo=True, logprobs=2, temperature=0)
    choice = result.choices[0]
    assert choice.text.startswith("The sky is")
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert len(lp.tokens) == result.usage.prompt_tokens + 3
    assert lp.token_logprobs[0] is None
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == sorted(lp.text_offset)


def test_completion_logprobs_stream(sdk: openai.OpenAI) -> None:
    chunks = list(sdk.completions.create(model=MODEL, prompt="Once upon", max_tokens=4, logprobs=1, stream=True))
    tokens = [t for c in chunks for t in (c.choices[0].logprobs.tokens if c.choices and c.choices[0].logprobs else [])]
    assert len(tokens) == 4


@pytest.mark.gateway_only("vLLM's v1 engine dropped best_of")
def test_completion_best_of(sdk: openai.OpenAI) -> None:
    result = sdk.completions.create(model=MODEL, prompt="The sky is", max_tokens=4, n=1, best_of=3, temperature=1)
    assert len(result.choices) == 1
    assert result.usage.completion_tokens <= 12


def test_completion_suffix_is_400(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError):
        sdk.completions.create(model=MODEL, prompt="def f():", suffix="return 1", max_tokens=4)


# --- around them ------------------------------------------------------------------------------


def test_tokenize_detokenize(base_url: str) -> None:
    tokens = httpx.post(f"{base_url}/tokenize", json={"model": MODEL, "prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    assert tokens["max_model_len"] == 2048
    text = httpx.post(f"{base_url}/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]}).json()
    assert text["prompt"] == "Hello world"
    chat_tokens = httpx.post(f"{base_url}/tokenize", json={"model": MODEL, "messages": QUESTION}).json()
    assert chat_tokens["count"] > tokens["count"]


@pytest.mark.gateway_only("no native /generate API")
def test_native_generate_and_stream(base_url: str) -> None:
    body = {"prompt": "The capital of France is", "max_tokens": 5, "temperature": 0}
    answer = httpx.post(f"{base_url}/generate", json=body, timeout=60).json()
    assert answer["output"]
    assert answer["usage"]["completion_tokens"] <= 5
    with httpx.stream("POST", f"{base_url}/stream-generate", json=body, timeout=60) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]  # not the id: lines
    assert lines[-1] == "data: [DONE]"
    assert "".join(json.loads(line[6:])["output"] for line in lines[:-1]) == answer["output"]


def test_truncate_prompt_tokens_avoids_context_error(sdk: openai.OpenAI) -> None:
    long = "hello " * 3000
    result = sdk.completions.create(model=MODEL, prompt=long, max_tokens=2, extra_body={"truncate_prompt_tokens": 100})
    assert result.usage.prompt_tokens == 100


@pytest.mark.gateway_only("FastAPI's own /openapi.json has other schema names")
def test_openapi_document(base_url: str) -> None:
    doc = httpx.get(f"{base_url}/openapi.json").json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models"} <= set(doc["paths"])
    assert "ChatCompletionRequest" in doc["components"]["schemas"]


# --- errors -----------------------------------------------------------------------------------


def error_of(response: httpx.Response) -> dict:
    error = response.json()["error"]
    assert {"message", "type", "param", "code"} <= set(error)
    return error


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL, "messages": QUESTION, "temperature": 3}, "temperature"),
        ({"model": MODEL, "messages": QUESTION, "top_logprobs": 30, "logprobs": True}, "top_logprobs"),
        ({"model": MODEL, "messages": QUESTION, "n": 0}, "n"),
    ],
)
@pytest.mark.gateway_only("vLLM answers these 400s too, but param is null")
def test_invalid_parameter_names_param(base_url: str, body: dict, param: str) -> None:
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert error_of(response)["param"] == param


def test_context_length_exceeded(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        chat(sdk, messages=[{"role": "user", "content": "hello " * 3000}])
    assert info.value.status_code == 400


@pytest.mark.gateway_only("error codes: vLLM puts the status number in code; no body size limit")
def test_error_codes(base_url: str) -> None:
    long = httpx.post(f"{base_url}/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi " * 3000}]})
    assert error_of(long)["code"] == "context_length_exceeded"
    missing = httpx.post(f"{base_url}/v1/chat/completions", json={"model": "nope", "messages": QUESTION})
    assert missing.status_code == 404
    assert error_of(missing)["code"] == "model_not_found"
    wrong_method = httpx.put(f"{base_url}/v1/chat/completions")
    assert wrong_method.status_code == 405
    assert error_of(wrong_method)["code"] == "method_not_allowed"
    huge = httpx.post(f"{base_url}/v1/chat/completions", content=b"x" * (5 * 1024 * 1024), timeout=60,
                      headers={"Content-Type": "application/json"})
    assert huge.status_code == 413
    assert error_of(huge)["code"] == "request_too_large"


def test_sdk_parses_error_into_types(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        sdk.chat.completions.create(model="nope", messages=QUESTION)


# --- disconnects ------------------------------------------------------------------------------


def engine_running(base_url: str) -> float:
    families = text_string_to_metric_families(httpx.get(f"{base_url}/metrics").text)
    return sum(s.value for f in families if f.name == "vllm:num_requests_running" for s in f.samples)


def wait_for_idle(base_url: str, timeout: float = 20.0) -> float:
    until_sync(lambda: engine_running(base_url) == 0, timeout, "the engine idle", step_s=0.2)
    return 0


def test_stream_disconnect_frees_the_engine(base_url: str) -> None:
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 1500, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        for _ in range(3):
            next(lines)
        until_sync(lambda: engine_running(base_url) >= 1, what="the request in vLLM's gauges", step_s=0.1)
    assert wait_for_idle(base_url) == 0


async def test_non_stream_disconnect_frees_the_engine(base_url: str) -> None:
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 1500, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=60) as client:
        task = asyncio.create_task(client.post(f"{base_url}/v1/chat/completions", json=body))
        await until(lambda: engine_running(base_url) >= 1, what="the request in vLLM's gauges")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert wait_for_idle(base_url) == 0
