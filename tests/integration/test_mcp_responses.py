"""The Responses API's `mcp` tool on the real engine, through the openai SDK: the session's gateway lists the tools
of a real MCP server (the `mcp` SDK's own server side, on loopback, which its servers file allows), the model's
forced call reaches the server, and the answer comes back whole, streamed, and after an approval."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.integration.conftest import MODEL
from tests.mcp_servers import SeenHeaders

FORCED = {"type": "mcp", "server_label": "tools", "name": "weather"}
# one call, then an answer; room for the call's arguments (each turn has max_output_tokens)
BOUNDS: dict[str, Any] = {"max_tool_calls": 1, "max_output_tokens": 64, "temperature": 0}


@pytest.fixture
def client(sdk: openai.OpenAI) -> openai.OpenAI:
    """The SDK retrying a 503 as a client should: the forced call's schema is compiled first, and while the
    compiler processes start on a busy machine the gateway says to try again shortly."""
    return sdk.with_options(max_retries=8)


def tool(**extra: Any) -> dict[str, Any]:
    return {"type": "mcp", "server_label": "tools", "allowed_tools": ["weather"], **extra}


def test_a_forced_call_whole(client: openai.OpenAI, mcp_tools: tuple[str, SeenHeaders]) -> None:
    url, seen = mcp_tools
    before = len(seen.headers)
    answer = client.responses.create(model=MODEL, input="Weather in Paris?", tool_choice=FORCED,  # type: ignore[arg-type]
                                  tools=[tool(server_url=url, require_approval="never",  # type: ignore[list-item]
                                              headers={"X-Client": "client-secret-9"})], **BOUNDS)
    kinds = [item.type for item in answer.output]
    assert kinds[:2] == ["mcp_list_tools", "mcp_call"]
    assert kinds[-1] == "message"
    listing, call = answer.output[0], answer.output[1]
    assert [t.name for t in listing.tools] == ["weather"]  # type: ignore[union-attr]
    assert call.error is None  # type: ignore[union-attr]
    assert call.output in ("Paris: sunny, 21C", "Rome: sunny, 21C")  # type: ignore[union-attr]
    assert answer.usage is not None
    assert answer.usage.output_tokens > 0
    assert any(h.get("x-client") == "client-secret-9" for h in seen.headers[before:])  # the client's header reached the server
    assert "client-secret-9" not in answer.model_dump_json()


def test_a_forced_call_streamed(client: openai.OpenAI) -> None:
    with client.responses.stream(model=MODEL, input="Weather in Rome?", tool_choice=FORCED,  # type: ignore[arg-type]
                              tools=[tool(require_approval="never")], **BOUNDS) as stream:  # type: ignore[list-item]
        events = list(stream)
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    for kind in ("response.mcp_list_tools.completed", "response.mcp_call_arguments.done",
                 "response.mcp_call.completed"):
        assert kind in kinds
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete")  # the answer may use all its tokens
    assert [item.type for item in last.response.output][:2] == ["mcp_list_tools", "mcp_call"]  # type: ignore[union-attr]


def test_an_approval_round_trip(client: openai.OpenAI) -> None:
    tools: Any = [tool(require_approval="always")]
    asked = client.responses.create(model=MODEL, input="Weather in Paris, please.", tool_choice=FORCED,  # type: ignore[arg-type]
                                 tools=tools, **BOUNDS)
    assert [item.type for item in asked.output] == ["mcp_list_tools", "mcp_approval_request"]
    request = asked.output[1]
    answer = client.responses.create(model=MODEL, previous_response_id=asked.id, tools=tools, input=[
        {"type": "mcp_approval_response", "approval_request_id": request.id, "approve": True}], **BOUNDS)
    call = answer.output[0]
    assert call.type == "mcp_call"
    assert call.approval_request_id == request.id
    assert call.output is not None
    assert answer.output[-1].type == "message"
