"""The Responses API's `mcp` tool (`apis.responses.mcp_tool`) on the fake engine, whose turns are scripted (a tool
call, then an answer), through the openai SDK and raw HTTP: listings, calls, the loop's bounds, approvals, streams,
the guards on both sides of a call, and what a hostile request or server cannot do."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from starlette.testclient import TestClient

from engine.types import GenerationOutput, GenerationRequest
from gateway.app import create_app
from gateway.mcp import client as mcp_client
from gateway.mcp.access import Target
from gateway.mcp.client import McpTool, McpUnavailable, ToolOutcome
from tests.fakes import FakeEngine, fake_settings
from tests.unit.test_responses import sse

MODEL = "fake-model"
URL = "https://tools.example.com/mcp"


def called(name: str, **arguments: Any) -> list[str]:
    return [f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>']


class TurnEngine(FakeEngine):
    """Answers each generation with the next scripted reply (then "Done.")."""

    def __init__(self) -> None:
        super().__init__(max_model_len=8192)
        self.turns: list[list[str]] = []
        self.prompts: list[str] = []

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        self.reply = self.turns.pop(0) if self.turns else ["Done."]
        self.prompts.append(request.prompt_text or "")
        async for output in super().generate(request):
            yield output


class FakeServer:
    """An MCP server as `gateway.mcp.client` reaches it: a tool that answers, one that fails."""

    def __init__(self) -> None:
        schema = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
        self.tools = [McpTool("echo", "Echoes its text", schema), McpTool("fail", "Always fails", schema),
                      McpTool("secret", "Not for the model", schema)]
        self.listed = 0
        self.calls: list[tuple[str, dict[str, Any], dict[str, str]]] = []
        self.down = False
        self.output: str | None = None  # what echo answers instead of its text

    async def list_tools(self, target: Target, *, timeout_s: float) -> list[McpTool]:
        self.listed += 1
        if self.down:
            raise McpUnavailable("the MCP server 'tools' did not answer")
        return self.tools

    async def call_tool(self, target: Target, name: str, arguments: dict[str, Any], *, timeout_s: float) -> ToolOutcome:
        self.calls.append((name, arguments, dict(target.headers)))
        if name == "fail":
            return ToolOutcome(None, "the tool broke")
        return ToolOutcome(self.output if self.output is not None else f"echo: {arguments.get('text')}", None)


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> FakeServer:
    fake = FakeServer()
    monkeypatch.setattr(mcp_client, "list_tools", fake.list_tools)
    monkeypatch.setattr(mcp_client, "call_tool", fake.call_tool)
    return fake


@pytest.fixture
def engine() -> TurnEngine:
    return TurnEngine()


@pytest.fixture
def http(engine: TurnEngine, tmp_path: Path) -> Iterator[TestClient]:
    guards = tmp_path / "guards.yaml"
    guards.write_text("default: standard\nprofiles:\n  standard:\n    input: {pii: {email: redact}}\n"
                      "    output: {deny: ['(?i)hydra']}\n")
    app = create_app(fake_settings(guards_file=guards, mcp_tool={"max_calls": 3, "max_output_chars": 1000}),
                     engine_starter=lambda es: engine)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


@pytest.fixture
def sdk(http: TestClient) -> openai.OpenAI:
    return openai.OpenAI(base_url=str(http.base_url) + "/v1", api_key="unused", http_client=http, max_retries=0)


def mcp(**extra: Any) -> dict[str, Any]:
    return {"type": "mcp", "server_label": "tools", "server_url": URL, "require_approval": "never", **extra}


def types(output: list[Any]) -> list[str]:
    return [item.type for item in output]


def test_a_tool_is_listed_called_and_answered(sdk: openai.OpenAI, engine: TurnEngine, server: FakeServer) -> None:
    engine.turns = [called("echo", text="ping"), ["It said ping."]]
    answer = sdk.responses.create(model=MODEL, input="Echo ping", tools=[mcp(headers={"X-Token": "t0ken"})])
    assert types(answer.output) == ["mcp_list_tools", "mcp_call", "message"]
    listing, call = answer.output[0], answer.output[1]
    assert [tool.name for tool in listing.tools] == ["echo", "fail", "secret"]  # type: ignore[union-attr]
    assert call.name == "echo"
    assert json.loads(call.arguments) == {"text": "ping"}
    assert call.output == "echo: ping"
    assert call.error is None
    assert server.calls == [("echo", {"text": "ping"}, {"X-Token": "t0ken"})]
    assert "echo: ping" in engine.prompts[1]  # the model read the output
    assert "Echoes its text" in engine.prompts[0]  # it was offered the tools
    assert answer.output_text == "It said ping."
    assert answer.usage is not None
    assert answer.usage.output_tokens == 2
    assert answer.status == "completed"
    assert "t0ken" not in answer.model_dump_json()  # credentials are not echoed
    stored = sdk.responses.retrieve(answer.id)
    assert types(stored.output) == types(answer.output)
    assert "t0ken" not in stored.model_dump_json()


def test_a_stream_carries_openai_events_in_order(http: TestClient, engine: TurnEngine, server: FakeServer) -> None:
    engine.turns = [called("echo", text="ping"), ["Ok."]]
    body = {"model": MODEL, "input": "Echo ping", "tools": [mcp()], "stream": True}
    with http.stream("POST", "/v1/responses", json=body) as streamed:
        events = sse(streamed.read().decode())
    names = [name for name, _ in events]
    assert names[:2] == ["response.created", "response.in_progress"]
    assert names[2:6] == ["response.output_item.added", "response.mcp_list_tools.in_progress",
                          "response.mcp_list_tools.completed", "response.output_item.done"]
    assert names[6:12] == ["response.output_item.added", "response.mcp_call_arguments.delta",
                           "response.mcp_call_arguments.done", "response.mcp_call.in_progress",
                           "response.mcp_call.completed", "response.output_item.done"]
    assert names[-1] == "response.completed"
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    done = [data for name, data in events if name == "response.output_item.done"]
    assert [d["output_index"] for d in done] == [0, 1, 2]
    assert done[1]["item"]["output"] == "echo: ping"
    final = events[-1][1]["response"]
    assert [item["type"] for item in final["output"]] == ["mcp_list_tools", "mcp_call", "message"]


def test_the_sdk_streams_it(sdk: openai.OpenAI, engine: TurnEngine, server: FakeServer) -> None:
    engine.turns = [called("fail", text="x"), ["It failed."]]
    with sdk.responses.stream(model=MODEL, input="Try", tools=[mcp()]) as stream:  # type: ignore[list-item]
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.mcp_call.failed" in kinds
    call = final.output[1]
    assert call.type == "mcp_call"
    assert call.output is None
    assert call.error is not None
    assert final.output_text == "It failed."
    assert "the tool broke" in engine.prompts[1]  # the model is told


def test_an_approval_round_trip(sdk: openai.OpenAI, engine: TurnEngine, server: FakeServer) -> None:
    engine.turns = [called("echo", text="ok?"), ["Approved and done."]]
    tool = mcp(require_approval="always")
    asked = sdk.responses.create(model=MODEL, input="Echo", tools=[tool])
    assert types(asked.output) == ["mcp_list_tools", "mcp_approval_request"]
    assert server.calls == []
    request = asked.output[1]
    answer = sdk.responses.create(model=MODEL, previous_response_id=asked.id, tools=[tool], input=[
        {"type": "mcp_approval_response", "approval_request_id": request.id, "approve": True}])
    assert types(answer.output) == ["mcp_call", "message"]  # the listing is the conversation's already
    assert answer.output[0].approval_request_id == request.id  # type: ignore[union-attr]
    assert server.listed == 1
    assert [c[0] for c in server.calls] == ["echo"]
    with pytest.raises(openai.BadRequestError) as again:  # answered once
        sdk.responses.create(model=MODEL, previous_response_id=answer.id, tools=[tool], input=[
            {"type": "mcp_approval_response", "approval_request_id": request.id, "approve": True}])
    assert again.value.body["param"] == "input[0].approval_request_id"  # type: ignore[index]


def test_a_denied_approval_is_told_to_the_model(sdk: openai.OpenAI, engine: TurnEngine, server: FakeServer) -> None:
    engine.turns = [called("echo", text="x"), ["Understood."]]
    tool = mcp(require_approval={"always": {"tool_names": ["echo"]}})
    asked = sdk.responses.create(model=MODEL, input="Echo", tools=[tool])
    answer = sdk.responses.create(model=MODEL, previous_response_id=asked.id, tools=[tool], input=[
        {"type": "mcp_approval_response", "approval_request_id": asked.output[1].id, "approve": False}])
    assert types(answer.output) == ["message"]
    assert server.calls == []
    assert "did not approve" in engine.prompts[-1]


def test_an_approval_must_answer_the_previous_response(sdk: openai.OpenAI, engine: TurnEngine,
                                                       server: FakeServer) -> None:
    tool = mcp(require_approval="always")
    engine.turns = [called("echo", text="a")]
    first = sdk.responses.create(model=MODEL, input="Echo", tools=[tool])
    engine.turns = [["Hi."]]
    later = sdk.responses.create(model=MODEL, input="Hello", tools=[tool])
    for previous, request_id in ((later.id, first.output[1].id), (first.id, "mcpr_nope"), (None, first.output[1].id)):
        body: dict[str, Any] = {"tools": [tool], "input": [
            {"type": "mcp_approval_response", "approval_request_id": request_id, "approve": True}]}
        if previous:
            body["previous_response_id"] = previous
        with pytest.raises(openai.BadRequestError) as refused:
            sdk.responses.create(model=MODEL, **body)
        assert refused.value.body["param"] == "input[0].approval_request_id"  # type: ignore[index]
    assert server.calls == []


@pytest.mark.parametrize("name", ["secret", "\uff45\uff43\uff48\uff4f", "echo ", "echo\u200b", "nope"])
def test_a_tool_not_offered_is_never_called(sdk: openai.OpenAI, engine: TurnEngine, server: FakeServer,
                                            name: str) -> None:
    engine.turns = [called(name, text="x")]
    answer = sdk.responses.create(model=MODEL, input="Go", tools=[mcp(allowed_tools=["echo", "fail"])])
    assert [tool.name for tool in answer.output[0].tools] == ["echo", "fail"]  # type: ignore[union-attr]
    assert server.calls == []
    assert types(answer.output) == ["mcp_list_tools", "message"]


def test_arguments_that_are_not_json_reach_no_server(sdk: openai.OpenAI, engine: TurnEngine,
                                                     server: FakeServer) -> None:
    engine.turns = [["{\"text\": "], ["Sorry."]]  # a forced call cut short
    answer = sdk.responses.create(model=MODEL, input="Go", tools=[mcp()],
                                  tool_choice={"type": "mcp", "server_label": "tools", "name": "echo"})
    call = answer.output[1]
    assert call.type == "mcp_call"
    assert call.error is not None
    assert server.calls == []


def test_a_gigantic_output_is_an_error(sdk: openai.OpenAI, engine: TurnEngine, server: FakeServer) -> None:
    server.output = "x" * 5000
    engine.turns = [called("echo", text="big"), ["Too big."]]
    call = sdk.responses.create(model=MODEL, input="Go", tools=[mcp()]).output[1]
    assert call.type == "mcp_call"
    assert call.output is None
    assert "5000 characters" in str(call.error.model_dump())
    assert "x" * 1001 not in "".join(engine.prompts)


def test_guards_read_the_output_and_the_arguments(sdk: openai.OpenAI, engine: TurnEngine, server: FakeServer) -> None:
    server.output = "Write to ops@example.com"
    engine.turns = [called("echo", text="project hydra"), ["Noted."]]
    answer = sdk.responses.create(model=MODEL, input="Go", tools=[mcp()])
    assert server.calls == []  # the model's arguments were cut by the output guard: nothing sent
    assert answer.status == "incomplete" or types(answer.output)[-1] == "message"
    engine.turns = [called("echo", text="fine"), ["Noted."]]
    answer = sdk.responses.create(model=MODEL, input="Go", tools=[mcp()])
    call = answer.output[1]
    assert call.type == "mcp_call"
    assert call.output is not None
    assert "ops@example.com" not in call.output
    assert "ops@example.com" not in "".join(engine.prompts)


def test_a_server_down_is_an_item_not_an_error(sdk: openai.OpenAI, engine: TurnEngine, server: FakeServer) -> None:
    server.down = True
    engine.turns = [["No tools today."]]
    answer = sdk.responses.create(model=MODEL, input="Go", tools=[mcp()])
    listing = answer.output[0]
    assert listing.type == "mcp_list_tools"
    assert listing.error
    assert answer.output_text == "No tools today."


def test_the_calls_are_bounded(sdk: openai.OpenAI, engine: TurnEngine, server: FakeServer) -> None:
    engine.turns = [called("echo", text=str(i)) for i in range(6)]
    answer = sdk.responses.create(model=MODEL, input="Loop", tools=[mcp()], max_tool_calls=2)
    assert types(answer.output).count("mcp_call") == 2
    assert len(server.calls) == 2
    assert answer.max_tool_calls == 2
    assert types(answer.output)[-1] == "message"  # the last turn is offered no tools: the model answers


@pytest.mark.parametrize(("tool", "extra", "param"), [
    (mcp(connector_id="connector_gmail"), {}, "tools[0].connector_id"),
    (mcp(authorization="a", headers={"Authorization": "b"}), {}, "tools[0].authorization"),
    (mcp(), {"background": True}, "background"),
    (mcp(), {"tool_choice": {"type": "mcp", "server_label": "other"}}, "tool_choice"),
    (mcp(server_label="bad label"), {}, "tools.0.server_label"),
])
def test_bad_mcp_tools_are_refused(http: TestClient, server: FakeServer, tool: dict[str, Any],
                                   extra: dict[str, Any], param: str) -> None:
    refused = http.post("/v1/responses", json={"model": MODEL, "input": "Go", "tools": [tool], **extra})
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == param
    assert server.listed == 0


def test_a_stream_refused_before_its_first_turn_is_a_status(http: TestClient, server: FakeServer) -> None:
    body = {"model": MODEL, "input": "Go", "tools": [mcp()], "stream": True,
            "tool_choice": {"type": "mcp", "server_label": "tools", "name": "nope"}}
    refused = http.post("/v1/responses", json=body)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "tool_choice"


def test_past_the_time_bound_the_model_answers_without_tools(engine: TurnEngine, server: FakeServer) -> None:
    app = create_app(fake_settings(mcp_tool={"time_s": 1e-9}), engine_starter=lambda es: engine)
    engine.turns = [called("echo", text="late")]
    with TestClient(app) as http:
        answer = http.post("/v1/responses", json={"model": MODEL, "input": "Go", "tools": [mcp()]}).json()
    assert [item["type"] for item in answer["output"]] == ["mcp_list_tools", "message"]
    assert server.calls == []
    assert "Echoes its text" not in engine.prompts[0]  # no tools described to the model
