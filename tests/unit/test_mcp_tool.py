"""The Responses API's `mcp` tool (`apis.responses.responses_mcp`) on the fake engine, whose turns are scripted (a tool
call, then an answer), against a real MCP server (the `mcp` SDK's server side on loopback, which the servers file
allows), through the openai SDK and raw HTTP: listings, calls, the loop's bounds, approvals, streams, the guards on
both sides of a call, and what a hostile request or model cannot do."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import structlog.testing
from mcp.server.mcpserver import MCPServer
from mcp_types import ToolAnnotations
from starlette.testclient import TestClient

from engine.types import GenerationOutput, GenerationRequest
from gateway.app import create_app
from tests.fakes import FakeEngine, fake_settings
from tests.mcp_servers import SeenHeaders, serving, tool_server
from tests.unit.test_responses import sse
from tests.waits import until

MODEL = "fake-model"


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


class Tools:
    """The MCP server of these tests: `tool_server`'s (echo, fail, slow, large) and `note`, which keeps what it
    was called with (a test checks which calls reached the server)."""

    def __init__(self, url: str, seen: SeenHeaders, calls: list[str]) -> None:
        self.url, self.seen, self.calls = url, seen, calls


def recording_server(calls: list[str]) -> MCPServer:
    server = tool_server()

    @server.tool()
    def note(text: str) -> str:
        """Notes its text."""
        calls.append(text)
        return f"noted: {text}"

    @server.tool(annotations=ToolAnnotations(readOnlyHint=True))
    def peek(text: str) -> str:
        """Reads without writing."""
        calls.append(f"peek {text}")
        return f"peeked: {text}"

    return server


@pytest.fixture(scope="module")
def tools() -> Iterator[Tools]:
    calls: list[str] = []
    with serving(recording_server(calls)) as (url, seen):
        yield Tools(url, seen, calls)


@pytest.fixture
def server(tools: Tools) -> Tools:
    tools.calls.clear()
    return tools


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def engine() -> TurnEngine:
    return TurnEngine()


def app_for(engine: TurnEngine, tools: Tools, folder: Path, keys: tuple[str, ...] = (), keys_file: str = "",
            input_guards: str = "{pii: {email: redact}}", **mcp: Any) -> Any:
    guards, servers = folder / "guards.yaml", folder / "servers.yaml"
    guards.write_text(f"default: standard\nprofiles:\n  standard:\n    input: {input_guards}\n"
                      "    output: {deny: ['(?i)hydra'], pii: {email: redact}}\n")
    slow = tools.url.replace("/mcp", "/mcp?slow")  # the same server under a label with a short timeout
    servers.write_text(f"servers:\n  tools: {{url: '{tools.url}', allow_private: true}}\n"
                       f"  slowpoke: {{url: '{slow}', allow_private: true, timeout_s: 1}}\n"
                       f"  gone: {{url: 'http://127.0.0.1:{closed_port()}/mcp', allow_private: true}}\n")
    more: dict[str, Any] = {}
    if keys_file:
        (folder / "keys.yaml").write_text(keys_file)
        more["keys_file"] = folder / "keys.yaml"
    settings = fake_settings(guards_file=guards, api_keys=list(keys), **more, mcp={"servers_file": servers, "max_calls_per_response": 3,
                                                      "max_output_bytes": 1000, **mcp})
    return create_app(settings, engine_starter=lambda es: engine)


@pytest.fixture
def http(engine: TurnEngine, server: Tools, tmp_path: Path) -> Iterator[TestClient]:
    with TestClient(app_for(engine, server, tmp_path), raise_server_exceptions=False) as client:
        yield client


@pytest.fixture
def sdk(http: TestClient) -> openai.OpenAI:
    return openai.OpenAI(base_url=str(http.base_url) + "/v1", api_key="unused", http_client=http, max_retries=0)


def mcp(**extra: Any) -> dict[str, Any]:
    return {"type": "mcp", "server_label": "tools", "require_approval": "never", **extra}


def types(output: list[Any]) -> list[str]:
    return [item.type for item in output]


def listed_requests(tools: Tools, before: int) -> list[dict[str, str]]:
    return tools.seen.headers[before:]


def test_a_tool_is_listed_called_and_answered(sdk: openai.OpenAI, engine: TurnEngine, server: Tools) -> None:
    engine.turns = [called("note", text="ping"), ["It said ping."]]
    before = len(server.seen.headers)
    answer = sdk.responses.create(model=MODEL, input="Note ping", tools=[mcp(headers={"X-Token": "t0ken"})])
    assert types(answer.output) == ["mcp_list_tools", "mcp_call", "message"]
    listing, call = answer.output[0], answer.output[1]
    assert [tool.name for tool in listing.tools] == ["echo", "fail", "slow", "large", "note", "peek"]  # type: ignore[union-attr]
    assert call.name == "note"
    assert json.loads(call.arguments) == {"text": "ping"}  # type: ignore[union-attr]
    assert call.output == "noted: ping"  # type: ignore[union-attr]
    assert call.error is None  # type: ignore[union-attr]
    assert server.calls == ["ping"]
    assert all(h.get("x-token") == "t0ken" for h in server.seen.headers[before:])  # the client's header, sent on
    assert "noted: ping" in engine.prompts[1]  # the model read the output
    assert "Notes its text" in engine.prompts[0]  # it was offered the tools
    assert answer.output_text == "It said ping."
    assert answer.usage is not None
    assert answer.usage.output_tokens == 2  # both turns: one piece each
    assert answer.status == "completed"
    assert "t0ken" not in answer.model_dump_json()  # credentials are not echoed
    stored = sdk.responses.retrieve(answer.id)
    assert types(stored.output) == types(answer.output)
    assert "t0ken" not in stored.model_dump_json()


def test_a_stream_carries_openai_events_in_order(http: TestClient, engine: TurnEngine, server: Tools) -> None:
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
    assert done[1]["item"]["output"] == "ping"
    final = events[-1][1]["response"]
    assert [item["type"] for item in final["output"]] == ["mcp_list_tools", "mcp_call", "message"]


def test_the_sdk_streams_a_failing_tool(sdk: openai.OpenAI, engine: TurnEngine, server: Tools) -> None:
    engine.turns = [called("fail"), ["It failed."]]
    with sdk.responses.stream(model=MODEL, input="Try", tools=[mcp()]) as stream:  # type: ignore[list-item]
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.mcp_call.failed" in kinds
    call = final.output[1]
    assert call.type == "mcp_call"
    assert call.output is None
    assert "Error executing tool fail" in str(call.error)
    assert final.output_text == "It failed."
    assert "Error executing tool fail" in engine.prompts[1]  # the model is told


def test_a_slow_tool_is_an_error_in_time(sdk: openai.OpenAI, engine: TurnEngine, server: Tools) -> None:
    engine.turns = [called("slow"), ["Too slow."]]
    answer = sdk.responses.create(model=MODEL, input="Wait", tools=[mcp(server_label="slowpoke")])
    call = answer.output[1]
    assert call.type == "mcp_call"
    assert "did not answer in time" in str(call.error)
    assert answer.status == "completed"


def test_an_approval_round_trip(sdk: openai.OpenAI, engine: TurnEngine, server: Tools) -> None:
    engine.turns = [called("note", text="ok?"), ["Approved and done."]]
    tool = mcp(require_approval="always")
    asked = sdk.responses.create(model=MODEL, input="Note", tools=[tool])
    assert types(asked.output) == ["mcp_list_tools", "mcp_approval_request"]
    assert server.calls == []
    request = asked.output[1]
    before = len(server.seen.headers)
    answer = sdk.responses.create(model=MODEL, previous_response_id=asked.id, tools=[tool], input=[
        {"type": "mcp_approval_response", "approval_request_id": request.id, "approve": True}])
    assert types(answer.output) == ["mcp_call", "message"]  # the listing is the conversation's already
    assert answer.output[0].approval_request_id == request.id  # type: ignore[union-attr]
    assert server.calls == ["ok?"]
    assert len(server.seen.headers) - before <= 4  # one session (the call's), not a second listing's too
    with pytest.raises(openai.BadRequestError) as again:  # answered once
        sdk.responses.create(model=MODEL, previous_response_id=answer.id, tools=[tool], input=[
            {"type": "mcp_approval_response", "approval_request_id": request.id, "approve": True}])
    assert again.value.body["param"] == "input[0].approval_request_id"  # type: ignore[index]


def test_a_denied_approval_is_told_to_the_model(sdk: openai.OpenAI, engine: TurnEngine, server: Tools) -> None:
    engine.turns = [called("note", text="x"), ["Understood."]]
    tool = mcp(require_approval={"always": {"tool_names": ["note"]}})
    asked = sdk.responses.create(model=MODEL, input="Note", tools=[tool])
    answer = sdk.responses.create(model=MODEL, previous_response_id=asked.id, tools=[tool], input=[
        {"type": "mcp_approval_response", "approval_request_id": asked.output[1].id, "approve": False}])
    assert types(answer.output) == ["message"]
    assert server.calls == []
    assert "did not approve" in engine.prompts[-1]


def test_an_approval_must_answer_the_previous_response(sdk: openai.OpenAI, engine: TurnEngine, server: Tools) -> None:
    tool = mcp(require_approval="always")
    engine.turns = [called("note", text="a")]
    first = sdk.responses.create(model=MODEL, input="Note", tools=[tool])
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


@pytest.mark.parametrize("name", ["echo", "\uff4e\uff4f\uff54\uff45", "note ", "note\u200b", "nope"])
def test_a_tool_not_offered_is_never_called(sdk: openai.OpenAI, engine: TurnEngine, server: Tools, name: str) -> None:
    engine.turns = [called(name, text="x")]
    answer = sdk.responses.create(model=MODEL, input="Go", tools=[mcp(allowed_tools=["note", "fail"])])
    assert [tool.name for tool in answer.output[0].tools] == ["fail", "note"]  # type: ignore[union-attr]
    assert server.calls == []
    assert types(answer.output) == ["mcp_list_tools", "message"]


def test_read_only_allows_only_what_the_server_marks_read_only(sdk: openai.OpenAI, engine: TurnEngine,
                                                               server: Tools) -> None:
    """`read_only` in allowed_tools or require_approval: the tools the server's listing marks readOnlyHint."""
    engine.turns = [called("note", text="x")]
    answer = sdk.responses.create(model=MODEL, input="Go", tools=[mcp(allowed_tools={"read_only": True})])
    assert [tool.name for tool in answer.output[0].tools] == ["peek"]  # type: ignore[union-attr]
    assert server.calls == []
    tool = mcp(require_approval={"never": {"read_only": True}})
    engine.turns = [called("peek", text="y"), ["Seen."]]
    spared = sdk.responses.create(model=MODEL, input="Go", tools=[tool])
    assert types(spared.output) == ["mcp_list_tools", "mcp_call", "message"]
    engine.turns = [called("note", text="z")]
    asked = sdk.responses.create(model=MODEL, input="Go", tools=[tool])
    assert types(asked.output) == ["mcp_list_tools", "mcp_approval_request"]
    assert server.calls == ["peek y"]


def test_arguments_that_are_not_json_reach_no_server(sdk: openai.OpenAI, engine: TurnEngine, server: Tools) -> None:
    engine.turns = [["{\"text\": "], ["Sorry."]]  # a forced call cut short
    answer = sdk.responses.create(model=MODEL, input="Go", tools=[mcp()],
                                  tool_choice={"type": "mcp", "server_label": "tools", "name": "note"})
    call = answer.output[1]
    assert call.type == "mcp_call"
    assert call.error is not None
    assert server.calls == []


def test_a_gigantic_output_never_reaches_the_model(sdk: openai.OpenAI, engine: TurnEngine, server: Tools) -> None:
    engine.turns = [called("large"), ["Too big."]]
    call = sdk.responses.create(model=MODEL, input="Go", tools=[mcp()]).output[1]
    assert call.type == "mcp_call"
    assert call.output is None or len(call.output) < 1100  # refused, or cut at the bound and said so
    assert "x" * 1001 not in "".join(engine.prompts)


def test_guards_read_the_output_and_the_arguments(sdk: openai.OpenAI, engine: TurnEngine, server: Tools) -> None:
    engine.turns = [called("note", text="project hydra"), ["Noted."]]
    answer = sdk.responses.create(model=MODEL, input="Go", tools=[mcp()])
    assert server.calls == []  # the model's arguments were cut by the output guard: nothing sent
    assert answer.status == "incomplete"
    engine.turns = [called("note", text="write to ops@example.com"), ["Noted."]]
    answer = sdk.responses.create(model=MODEL, input="Go", tools=[mcp()])
    call = answer.output[1]
    assert call.type == "mcp_call"
    assert call.output is not None
    assert "ops@example.com" not in call.output  # as the model read it
    assert len(server.calls) == 1
    assert "ops@example.com" not in server.calls[0]  # the output guards redacted the model's arguments
    assert "ops@example.com" not in call.arguments
    assert "ops@example.com" not in engine.prompts[-1]


def test_the_access_line_names_every_turns_guard_actions(http: TestClient, engine: TurnEngine, server: Tools) -> None:
    engine.turns = [called("note", text="write to ops@example.com"), ["Noted."]]
    with structlog.testing.capture_logs() as logs:
        http.post("/v1/responses", json={"model": MODEL, "input": "Go", "tools": [mcp()]})
    line = next(entry for entry in logs if entry["event"] == "request")
    assert any(action.startswith("output:") for action in line["guards"])  # the first turn's, on its arguments


def test_guards_hold_streamed_too(http: TestClient, engine: TurnEngine, server: Tools) -> None:
    engine.turns = [called("note", text="mail ops@example.com"), ["Noted."]]
    body = {"model": MODEL, "input": "Go", "tools": [mcp()], "stream": True}
    with http.stream("POST", "/v1/responses", json=body) as streamed:
        events = sse(streamed.read().decode())
    done = [data["item"] for name, data in events if name == "response.output_item.done"]
    assert "ops@example.com" not in json.dumps(events)  # not in the arguments, their deltas, nor the output
    assert done[1]["output"].startswith("noted: mail [")
    assert len(server.calls) == 1
    assert "ops@example.com" not in server.calls[0]
    assert "ops@example.com" not in engine.prompts[-1]


def test_a_server_down_is_an_item_not_an_error(sdk: openai.OpenAI, engine: TurnEngine, server: Tools) -> None:
    engine.turns = [["No tools today."]]
    answer = sdk.responses.create(model=MODEL, input="Go", tools=[mcp(server_label="gone")])
    listing = answer.output[0]
    assert listing.type == "mcp_list_tools"
    assert "could not be reached" in (listing.error or "")
    assert answer.output_text == "No tools today."


def test_the_calls_are_bounded(sdk: openai.OpenAI, engine: TurnEngine, server: Tools) -> None:
    engine.turns = [called("note", text=str(i)) for i in range(6)]
    answer = sdk.responses.create(model=MODEL, input="Loop", tools=[mcp()], max_tool_calls=2)
    assert types(answer.output).count("mcp_call") == 2
    assert server.calls == ["0", "1"]
    assert answer.max_tool_calls == 2
    assert types(answer.output)[-1] == "message"  # the last turn is offered no tools: the model answers


@pytest.mark.parametrize(("tool", "extra", "param"), [
    (mcp(connector_id="connector_gmail"), {}, "tools[0].connector_id"),
    (mcp(authorization="a", headers={"Authorization": "b"}), {}, "tools[0].authorization"),
    (mcp(), {"background": True}, "background"),
    (mcp(), {"tool_choice": {"type": "mcp", "server_label": "other"}}, "tool_choice"),
    (mcp(server_label="bad label"), {}, "tools.0.server_label"),
    (mcp(server_label="nowhere"), {}, "tools[0].server_url"),  # not in the servers file, and no url
    (mcp(server_url="http://127.0.0.1:1/mcp"), {}, "tools[0].server_url"),  # a private address the file does not name
    (mcp(headers={"Host": "evil"}), {}, "tools[0].headers"),
    (mcp(), {"tools": [mcp(server_label=f"s{i}", server_url=f"https://s{i}.example/mcp") for i in range(17)]}, "tools"),
])
def test_bad_mcp_tools_are_refused(http: TestClient, server: Tools, tool: dict[str, Any],
                                   extra: dict[str, Any], param: str) -> None:
    before = len(server.seen.headers)
    refused = http.post("/v1/responses", json={"model": MODEL, "input": "Go", "tools": [tool], **extra})
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == param
    assert len(server.seen.headers) == before  # the server was not reached


def test_a_stream_refused_before_its_first_turn_is_a_status(http: TestClient, server: Tools) -> None:
    body = {"model": MODEL, "input": "Go", "tools": [mcp()], "stream": True,
            "tool_choice": {"type": "mcp", "server_label": "tools", "name": "nope"}}
    refused = http.post("/v1/responses", json=body)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "tool_choice"


def test_past_the_time_bound_the_model_answers_without_tools(engine: TurnEngine, server: Tools,
                                                             tmp_path: Path) -> None:
    engine.turns = [called("note", text="late")]
    with TestClient(app_for(engine, server, tmp_path, response_time_s=1e-9)) as http:
        answer = http.post("/v1/responses", json={"model": MODEL, "input": "Go", "tools": [mcp()]}).json()
    assert [item["type"] for item in answer["output"]] == ["mcp_list_tools", "message"]
    assert server.calls == []
    assert "Notes its text" not in engine.prompts[0]  # no tools described to the model


def test_another_keys_approval_is_unknown(engine: TurnEngine, server: Tools, tmp_path: Path) -> None:
    tool = mcp(require_approval="always")
    with TestClient(app_for(engine, server, tmp_path, keys=("sk-a", "sk-b"))) as http:
        a = openai.OpenAI(base_url=str(http.base_url) + "/v1", api_key="sk-a", http_client=http, max_retries=0)
        b = openai.OpenAI(base_url=str(http.base_url) + "/v1", api_key="sk-b", http_client=http, max_retries=0)
        engine.turns = [called("note", text="a's")]
        asked = a.responses.create(model=MODEL, input="Note", tools=[tool])  # type: ignore[list-item]
        engine.turns = [["Hi."]]
        own = b.responses.create(model=MODEL, input="Hello", tools=[tool])  # type: ignore[list-item]
        approval = {"type": "mcp_approval_response", "approval_request_id": asked.output[1].id, "approve": True}
        with pytest.raises(openai.NotFoundError) as unknown:  # a's response is no response of b's
            b.responses.create(model=MODEL, previous_response_id=asked.id, tools=[tool], input=[approval])  # type: ignore[list-item]
        assert unknown.value.body["param"] == "previous_response_id"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as refused:  # nor is its approval request
            b.responses.create(model=MODEL, previous_response_id=own.id, tools=[tool], input=[approval])  # type: ignore[list-item]
        assert refused.value.body["param"] == "input[0].approval_request_id"  # type: ignore[index]
    assert server.calls == []


class LateTurns(TurnEngine):
    """Every turn after the first answers only once the request's deadline (`LATE_S` from its first turn) has passed."""

    began = 0.0

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        loop = asyncio.get_running_loop()
        if self.prompts:
            passed = self.began + LATE_S + 0.05
            await until(lambda: loop.time() > passed, what="the request's deadline passed")
        else:
            self.began = loop.time()
        async for output in super().generate(request):
            yield output


LATE_S = 2.0  # the first byte's bound: far above a busy machine's first byte, and each later turn waits it out


def test_a_streamed_responses_later_turns_are_not_cut_by_the_deadline(server: Tools, tmp_path: Path) -> None:
    """The client's deadline bounds the first byte (docs/tenants-and-guards.md): once the stream has begun,
    a later model turn is not refused when it passes (a whole response's turns all count against it)."""
    engine = LateTurns()
    engine.turns = [called("echo", text="ping"), ["Ok."]]
    body = {"model": MODEL, "input": "Echo ping", "tools": [mcp()], "stream": True}
    with TestClient(app_for(engine, server, tmp_path)) as http, \
            http.stream("POST", "/v1/responses", json=body, headers={"request-timeout": str(LATE_S)}) as streamed:
        events = sse(streamed.read().decode())
    names = [name for name, _ in events]
    assert "response.failed" not in names, events[-1]
    assert names[-1] == "response.completed"
    assert len(engine.prompts) == 2
def test_a_label_of_another_server_does_not_widen_the_tools(engine: TurnEngine, server: Tools, tmp_path: Path) -> None:
    """The key may call only `echo` of `tools`; naming that server's URL under the label of a server whose tools it
    may all call (`slowpoke`) must not offer or call `note`."""
    keys = 'keys:\n  k:\n    key: "sk-k"\n    mcp: {servers: [tools, slowpoke], tools: {tools: [echo]}}\n'
    engine.turns = [called("note", text="sneaked")]
    with TestClient(app_for(engine, server, tmp_path, keys_file=keys)) as http:
        tool = mcp(server_label="slowpoke", server_url=server.url)
        answer = http.post("/v1/responses", headers={"Authorization": "Bearer sk-k"},
                           json={"model": MODEL, "input": "Go", "tools": [tool]}).json()
    assert [t["name"] for t in answer["output"][0]["tools"]] == ["echo"]
    assert server.calls == []


def test_a_conversation_holds_the_mcp_turns(http: TestClient, sdk: openai.OpenAI, engine: TurnEngine,
                                            server: Tools) -> None:
    """`conversation` with mcp tools: its items are the history (its listing reused, its approval requests
    answerable), and each response's input and output are added to it, as without mcp tools."""
    conversation = sdk.conversations.create().id
    engine.turns = [called("note", text="one"), ["Noted one."]]
    first = sdk.responses.create(model=MODEL, input="Note one", tools=[mcp()], conversation=conversation)
    assert types(first.output) == ["mcp_list_tools", "mcp_call", "message"]
    tool = mcp(require_approval="always")
    engine.turns = [called("note", text="two")]
    asked = sdk.responses.create(model=MODEL, input="Note two", tools=[tool], conversation=conversation)
    assert types(asked.output) == ["mcp_approval_request"]  # the conversation's listing, reused
    assert "Noted one." in engine.prompts[-1]  # the model read the conversation
    approval = {"type": "mcp_approval_response", "approval_request_id": asked.output[0].id, "approve": True}
    other = sdk.conversations.create().id
    with pytest.raises(openai.BadRequestError) as refused:  # another conversation's request is unknown there
        sdk.responses.create(model=MODEL, tools=[tool], conversation=other, input=[approval])  # type: ignore[list-item]
    assert refused.value.body["param"] == "input[0].approval_request_id"  # type: ignore[index]
    engine.turns = [["Noted two."]]
    answer = sdk.responses.create(model=MODEL, tools=[tool], conversation=conversation, input=[approval])  # type: ignore[list-item]
    assert types(answer.output) == ["mcp_call", "message"]
    assert server.calls == ["one", "two"]
    items = http.get(f"/v1/conversations/{conversation}/items", params={"order": "asc"}).json()["data"]
    assert [item["type"] for item in items] == [
        "message", "mcp_list_tools", "mcp_call", "message", "message", "mcp_approval_request",
        "mcp_approval_response", "mcp_call", "message"]
    with pytest.raises(openai.BadRequestError) as again:  # answered once
        sdk.responses.create(model=MODEL, tools=[tool], conversation=conversation, input=[approval])  # type: ignore[list-item]
    assert again.value.body["param"] == "input[0].approval_request_id"  # type: ignore[index]


def test_a_tools_error_is_read_through_the_input_guards(engine: TurnEngine, server: Tools, tmp_path: Path) -> None:
    """A server's error text is read by the model as an output is: a text the input guards block is not shown to
    the model (nor does it fail the response at the next turn)."""
    engine.turns = [called("fail"), ["It failed."]]
    with TestClient(app_for(engine, server, tmp_path, input_guards="{deny: ['(?i)executing tool']}")) as http:
        answer = http.post("/v1/responses", json={"model": MODEL, "input": "Go", "tools": [mcp()]})
    assert answer.status_code == 200, answer.text
    call = answer.json()["output"][1]
    assert call["type"] == "mcp_call"
    assert "executing tool" not in json.dumps(call["error"])  # as the model read it: the refusal
    assert answer.json()["output"][2]["content"][0]["text"] == "It failed."
    assert "executing tool" not in engine.prompts[-1]


def test_a_hanging_server_is_bounded_by_the_responses_time(engine: TurnEngine, server: Tools, tmp_path: Path) -> None:
    """A call (or listing) takes at most what is left of `response_time_s`, not each its own `timeout_s` in full."""
    engine.turns = [called("slow"), ["Too slow."]]
    with TestClient(app_for(engine, server, tmp_path, response_time_s=2, timeout_s=120)) as http:
        started = time.monotonic()
        answer = http.post("/v1/responses", json={"model": MODEL, "input": "Go", "tools": [mcp()]}).json()
        took = time.monotonic() - started
    assert "did not answer in time" in json.dumps(answer["output"][1]["error"])
    assert answer["output"][-1]["type"] == "message"
    assert took < 60


def test_max_output_tokens_bounds_every_turn_together(sdk: openai.OpenAI, engine: TurnEngine, server: Tools) -> None:
    """A response's max_output_tokens is all its turns': spent by the first, the response ends incomplete."""
    call = called("note", text="spent")[0]
    pieces = [call[i:i + 4] for i in range(0, len(call), 4)]  # one token each, at least 16
    engine.turns = [pieces, ["Never", " said."]]
    answer = sdk.responses.create(model=MODEL, input="Go", tools=[mcp()], max_output_tokens=16)
    assert types(answer.output) == ["mcp_list_tools", "mcp_call"]
    assert engine.turns == [["Never", " said."]]  # no second turn
    assert answer.usage is not None
    assert answer.usage.output_tokens == len(pieces)
    assert answer.status == "incomplete"
    assert answer.incomplete_details is not None
    assert answer.incomplete_details.reason == "max_output_tokens"


def test_approval_requests_count_against_the_calls_bound(sdk: openai.OpenAI, engine: TurnEngine, server: Tools) -> None:
    """Each approval request is a call the client may approve: one turn asking for more than the bound asks for
    the bound's worth, so that approving them all cannot make more calls than max_tool_calls."""
    engine.turns = [called("note", text="1") + called("note", text="2") + called("note", text="3")]
    tool = mcp(require_approval="always")
    asked = sdk.responses.create(model=MODEL, input="Note", tools=[tool], max_tool_calls=2)
    assert types(asked.output) == ["mcp_list_tools", "mcp_approval_request", "mcp_approval_request"]


def test_approved_calls_past_the_bound_are_not_made(sdk: openai.OpenAI, engine: TurnEngine, server: Tools) -> None:
    engine.turns = [called("note", text="1") + called("note", text="2")]
    tool = mcp(require_approval="always")
    asked = sdk.responses.create(model=MODEL, input="Note", tools=[tool])
    approvals = [{"type": "mcp_approval_response", "approval_request_id": item.id, "approve": True}
                 for item in asked.output[1:]]
    assert len(approvals) == 2
    engine.turns = [["Done."]]
    answer = sdk.responses.create(model=MODEL, previous_response_id=asked.id, tools=[tool], input=approvals,  # type: ignore[arg-type]
                                  max_tool_calls=1)
    assert types(answer.output) == ["mcp_call", "mcp_call", "message"]
    assert server.calls == ["1"]
    assert "bound on tool calls" in str(answer.output[1].error)  # type: ignore[union-attr]
    assert "bound on tool calls" in engine.prompts[-1]  # the model is told
