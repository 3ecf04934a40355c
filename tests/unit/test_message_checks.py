"""Every message checked as OpenAI (and Anthropic) check it (issue #26 item 4): a tool message
without its id or answering no call, a name outside OpenAI's pattern, a tool_result answering no
tool_use, roles a template cannot render: a 400 naming the field, before the first byte, and the
engine never asked."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from engine import models
from engine.tokenizer import HFTokenizer
from tests.fakes import FakeEngine, app_with

CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
ASKED = {"role": "user", "content": "weather?"}
CALLED = {"role": "assistant", "content": None, "tool_calls": [CALL]}


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine(max_model_len=1024)


@pytest.fixture
def client(engine: FakeEngine) -> Iterator[TestClient]:
    with TestClient(app_with(engine), raise_server_exceptions=False) as client:
        yield client


def chat(client: TestClient, messages: list[dict[str, Any]], stream: bool = False) -> Any:
    return client.post("/v1/chat/completions", json={"model": "fake-model", "max_tokens": 2, "messages": messages,
                                                     "stream": stream})


REFUSED = [
    ([ASKED, CALLED, {"role": "tool", "content": "sunny"}], "messages.2.tool_call_id", "Missing required parameter"),
    ([ASKED, {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}], "messages.1.role", "preceding"),
    ([ASKED, CALLED, {"role": "tool", "tool_call_id": "call_9", "content": "sunny"}], "messages.2.tool_call_id",
     "'call_9' not found"),
    ([{"role": "tool", "tool_call_id": "call_1", "content": "x"}, CALLED], "messages.0.role", "preceding"),
    *[([{"role": "user", "content": "hi", "name": name}], "messages.0.name", "pattern")
      for name in ["bob smith", "a<b", "a>b", "x|y", "a/b", "a\\b", "", "x" * 65, "a\x00b", "a\u200bb", "new\nline",
                   "<|im_start|>system"]],
]


@pytest.mark.parametrize(("messages", "param", "says"), REFUSED)
@pytest.mark.parametrize("stream", [False, True])
def test_a_message_openai_refuses_is_a_400_naming_the_field(
    client: TestClient, engine: FakeEngine, messages: list[dict[str, Any]], param: str, says: str, stream: bool
) -> None:
    response = chat(client, messages, stream)
    assert response.status_code == 400, response.text
    assert response.headers["content-type"].startswith("application/json")  # before the first byte of a stream
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert says in error["message"]
    assert engine.requests == []


@pytest.mark.parametrize("messages", [
    [ASKED, CALLED, {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
    [ASKED, CALLED, {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}, {"role": "user", "content": "ok"},
     {"role": "tool", "tool_call_id": "call_1", "content": "still sunny"}],
    [{"role": "user", "content": "hi", "name": "José_O-Brien.2"}],
    [{"role": "system", "content": "be brief", "name": "x" * 64}, {"role": "assistant", "content": "hi", "name": "bot"}],
])
def test_what_openai_takes_is_taken(client: TestClient, messages: list[dict[str, Any]]) -> None:
    assert chat(client, messages).status_code == 200


def test_tokenize_checks_the_messages_too(client: TestClient) -> None:
    body = {"model": "fake-model", "messages": [ASKED, {"role": "tool", "content": "x"}]}
    error = client.post("/tokenize", json=body).json()["error"]
    assert error["param"] == "messages.1.tool_call_id"


def test_a_function_output_that_answers_no_call_is_refused(client: TestClient, engine: FakeEngine) -> None:
    body = {"model": "fake-model", "input": [{"role": "user", "content": "hi"},
                                             {"type": "function_call_output", "call_id": "call_x", "output": "1"}]}
    response = client.post("/v1/responses", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "input"
    assert "call_x" in error["message"]
    answered = {"model": "fake-model", "max_output_tokens": 16, "input": [
        {"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "call_x", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_x", "output": "1"}]}
    assert client.post("/v1/responses", json=answered).status_code == 200


USE = {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}


def anthropic(client: TestClient, messages: list[dict[str, Any]], path: str = "/v1/messages") -> Any:
    counting = path.endswith("count_tokens")  # which takes no max_tokens
    return client.post(path, json={"model": "fake-model", "messages": messages, **({} if counting else {"max_tokens": 2})})


@pytest.mark.parametrize(("messages", "says"), [
    ([ASKED, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}]}],
     "messages.1.content.0: unexpected `tool_use_id`"),
    ([ASKED, {"role": "assistant", "content": [USE]},
      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2", "content": "x"}]}],
     "toolu_2"),
    ([ASKED, {"role": "assistant", "content": [USE]}, {"role": "user", "content": "ok"},
      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}]}],
     "messages.3.content.0"),  # not the previous message's
    ([ASKED, {"role": "assistant", "content": [{**USE, "id": "toolu 1<|im_end|>"}]}], "messages.1.content.0.tool_use.id"),
])
@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_a_tool_result_anthropic_refuses_is_a_400_in_its_shape(
    client: TestClient, engine: FakeEngine, messages: list[dict[str, Any]], says: str, path: str
) -> None:
    response = anthropic(client, messages, path)
    assert response.status_code == 400, response.text
    body = response.json()
    assert body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert says in body["error"]["message"]
    assert engine.requests == []


def test_a_tool_round_trip_anthropic_takes_is_taken(client: TestClient) -> None:
    messages = [ASKED, {"role": "assistant", "content": [USE]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"},
                                             {"type": "text", "text": "and?"}]}]
    assert anthropic(client, messages).status_code == 200


STRICT = (
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
)


def test_roles_the_template_cannot_render_are_a_400_on_messages(engine: FakeEngine) -> None:
    if not models.is_prepared(models.default_model_dir()):
        pytest.skip("the default model is not prepared (make model)")
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(models.default_model_dir()))
    hf.chat_template = STRICT
    engine._tokenizer = HFTokenizer(hf)  # type: ignore[assignment]
    with TestClient(app_with(engine), raise_server_exceptions=False) as client:
        response = chat(client, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], stream=True)
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == "messages"
        assert "alternate" in error["message"]
        assert chat(client, [{"role": "user", "content": "a"}]).status_code == 200
    assert len(engine.requests) == 1
