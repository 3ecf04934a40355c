"""The /mcp gateway: the `mcp` SDK's client against the gateway (real uvicorn, port 0, the fake engine: /mcp needs no
model) in front of two real MCP servers, with keys that see different tools. The listing and the call agree (one check);
namespaced-name tricks find nothing; a server's failure or slowness is a tool error; the gateway's credentials reach the
server and no log line; each call is counted, logged and limited by the key's requests per minute."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import httpx2
import pytest
import structlog.testing
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from prometheus_client import REGISTRY

from gateway.apis.mcp import mcp_serving
from gateway.app import create_app
from tests.fakes import FakeEngine, app_with, fake_settings
from tests.mcp_servers import SeenHeaders, serving, tool_server
from tests.served import served
from tests.waits import until

TOKEN = "gateway-held-s3cret"
KEYS = {"all": "sk-all-key", "narrow": "sk-narrow-key", "none": "sk-none-key", "limited": "sk-limited-key"}


@pytest.fixture(scope="module")
def upstreams() -> Iterator[dict[str, tuple[str, SeenHeaders]]]:
    with serving(tool_server("docs")) as docs, serving(tool_server("wiki", extra=("page", "a__b"))) as wiki:
        yield {"docs": docs, "wiki": wiki}


@pytest.fixture(scope="module")
def gateway(upstreams: dict[str, tuple[str, SeenHeaders]], tmp_path_factory: pytest.TempPathFactory,
            ) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("mcp-gateway")
    servers = folder / "servers.yaml"
    servers.write_text(textwrap.dedent(f"""\
        servers:
          docs:
            url: {upstreams["docs"][0]}
            headers: {{Authorization: "Bearer {TOKEN}"}}
            allow_private: true
          brief:
            url: {upstreams["docs"][0]}?bound=short
            allow_private: true
            timeout_s: 1
          wiki:
            url: {upstreams["wiki"][0]}
            allow_private: true
          down:
            url: http://127.0.0.1:1/mcp
            allow_private: true
          outside:
            url: http://127.0.0.1:2/mcp
        """))
    keys = folder / "keys.yaml"
    keys.write_text(textwrap.dedent(f"""\
        keys:
          all:
            key: "{KEYS["all"]}"
          narrow:
            key: "{KEYS["narrow"]}"
            mcp: {{servers: [wiki], tools: {{wiki: [page, "a__b"]}}}}
          none:
            key: "{KEYS["none"]}"
            mcp: {{servers: []}}
          limited:
            key: "{KEYS["limited"]}"
            rpm: 3
            mcp: {{servers: [docs]}}
        """))
    app = app_with(keys_file=keys, mcp={"servers_file": servers, "timeout_s": 30})
    with served(app) as base:
        yield f"{base}/mcp"


@pytest.fixture
def connect(gateway: str) -> Any:
    """A client of the gateway with one key's credential; `mode`: the SDK's default (auto: the 2026 protocol, as the
    gateway offers it) or legacy (the initialize handshake of older clients)."""

    def connected(key: str, mode: Any = "auto") -> Client:
        http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {KEYS[key]}"}, timeout=30)
        return Client(streamable_http_client(gateway, http_client=http), mode=mode)

    return connected


async def names(client: Client) -> set[str]:
    return {tool.name for tool in (await client.list_tools()).tools}


async def text_of(client: Client, name: str, arguments: dict[str, Any] | None = None) -> tuple[str, bool]:
    result = await client.call_tool(name, arguments or {})
    return result.content[0].text, result.is_error  # type: ignore[union-attr]


BASE = {"echo", "fail", "slow", "large"}


@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_each_key_lists_the_tools_its_allow_list_gives(connect: Any, mode: str) -> None:
    async with connect("all", mode) as client:
        listed = {name for name in await names(client) if not name.startswith("brief__")}  # brief's bound is short
        assert listed == {f"docs__{t}" for t in BASE} | {f"wiki__{t}" for t in {*BASE, "page", "a__b"}}
    async with connect("narrow", mode) as client:
        assert await names(client) == {"wiki__page", "wiki__a__b"}
        assert await text_of(client, "wiki__page", {"text": "p"}) == ("page: p", False)
        assert (await text_of(client, "wiki__echo", {"text": "p"}))[1]
    async with connect("none", mode) as client:
        assert await names(client) == set()


async def test_a_call_goes_to_its_server_with_the_gateways_credentials(
        connect: Any, upstreams: dict[str, tuple[str, SeenHeaders]]) -> None:
    seen = upstreams["docs"][1].headers
    before = len(seen)
    with structlog.testing.capture_logs() as logs:
        async with connect("all") as client:
            assert await text_of(client, "docs__echo", {"text": "hello"}) == ("hello", False)
            assert await text_of(client, "wiki__a__b", {"text": "x"}) == ("a__b: x", False)
    asked = [headers for headers in seen[before:] if not headers[":query"]]  # `brief` is the same server's ?bound=short
    assert asked
    assert all(headers["authorization"] == f"Bearer {TOKEN}" for headers in asked)
    assert all("authorization" not in headers for headers in seen[before:] if headers[":query"])
    assert all("authorization" not in headers for headers in upstreams["wiki"][1].headers)  # never the client's key
    assert TOKEN not in repr(logs)
    assert KEYS["all"] not in repr(logs)
    line = next(entry for entry in logs if entry["event"] == "mcp_tool_call" and entry["tool"] == "echo")
    assert (line["server"], line["outcome"]) == ("docs", "ok")
    assert line["api_key_id"] == "all"
    assert "duration_s" in line
    assert "arguments" not in line


@pytest.mark.parametrize("name", [
    "docs__echo", "wiki__echo", "wiki__Page", "wiki__page ", " wiki__page", "wiki__p\u0430ge", "Wiki__page",
    "wiki___page", "wiki_page", "wiki__", "__page", "page", "wiki__a__b__c", "wiki__a", "wiki\u200b__page",
    "outside__echo", "nowhere__echo", "w\u0456ki__page", "WIKI__page", "wiki__page\n",
])
async def test_a_key_calls_nothing_its_listing_does_not_show(connect: Any, name: str) -> None:
    async with connect("narrow") as client:
        text, is_error = await text_of(client, name, {"text": "x"})
    assert is_error
    assert text == f"Unknown tool: {name}"


async def test_a_servers_failure_or_slowness_is_a_tool_error(connect: Any) -> None:
    async with connect("all") as client:
        failed, is_error = await text_of(client, "docs__fail")
        assert is_error
        assert failed
        slow, is_error = await text_of(client, "brief__slow")  # the servers file gives it 1 s
        assert is_error
        assert "in time" in slow
        down, is_error = await text_of(client, "down__echo", {"text": "x"})
        assert is_error
        assert "could not be reached" in down


def counted(server: str, tool: str, outcome: str) -> float:
    labels = {"server": server, "tool": tool, "outcome": outcome}
    return REGISTRY.get_sample_value("gateway_mcp_tool_calls_total", labels) or 0.0


async def test_calls_are_counted_and_limited_per_key(connect: Any) -> None:
    ok, limited = counted("docs", "echo", "ok"), counted("docs", "echo", "rate_limited")
    async with connect("limited") as client:
        assert await names(client) == {f"docs__{t}" for t in BASE}  # a listing counts too: it asks every server
        results = [await text_of(client, "docs__echo", {"text": "x"}) for _ in range(3)]
        with pytest.raises(MCPError, match="Rate limit"):
            await names(client)
    assert results[:2] == [("x", False), ("x", False)]
    assert results[2][1]
    assert "rate limit" in results[2][0].lower()
    assert counted("docs", "echo", "ok") == ok + 2
    assert counted("docs", "echo", "rate_limited") == limited + 1
    before = counted("other", "other", "refused")
    async with connect("all") as client:
        await text_of(client, "made-up__name")
    assert counted("other", "other", "refused") == before + 1


async def test_mcp_needs_a_key(gateway: str) -> None:
    async with httpx.AsyncClient() as raw:
        body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
        headers = {"Accept": "application/json, text/event-stream"}
        refused = await raw.post(gateway, json=body, headers=headers)
        assert refused.status_code == 401
        wrong = await raw.post(gateway, json=body, headers={**headers, "Authorization": "Bearer sk-wrong"})
        assert wrong.status_code == 401
        got = await raw.get(gateway, headers={"Authorization": f"Bearer {KEYS['all']}"})
        assert got.status_code == 405
        garbage = await raw.post(gateway, content=b"{not json", headers={
            **headers, "Authorization": f"Bearer {KEYS['all']}", "Content-Type": "application/json"})
        assert 400 <= garbage.status_code < 500


async def test_a_call_has_its_span_and_with_log_prompts_its_arguments(
        upstreams: dict[str, tuple[str, SeenHeaders]], tmp_path: Path) -> None:
    servers = tmp_path / "servers.yaml"
    servers.write_text(f"servers: {{wiki: {{url: '{upstreams['wiki'][0]}', allow_private: true}}}}\n")
    exporter = InMemorySpanExporter()
    settings = fake_settings(log_prompts=True, mcp={"servers_file": servers},
                             tracing={"otlp_endpoint": "http://127.0.0.1:9/v1/traces"})
    app = create_app(settings, engine_starter=lambda es: FakeEngine(), trace_exporter=exporter)
    with served(app) as base, structlog.testing.capture_logs() as logs:
        async with Client(streamable_http_client(f"{base}/mcp")) as client:
            assert await text_of(client, "wiki__page", {"text": "secret words"}) == ("page: secret words", False)

        def call_span() -> Any:
            return next((s for s in exporter.get_finished_spans() if s.name == "mcp.tools/call"), None)

        span = await until(call_span, what="the tool call's span")
        server = await until(lambda: next((s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER
                                           and s.context.trace_id == span.context.trace_id), None))
    assert dict(span.attributes or {}) == {"mcp.server": "wiki", "mcp.tool": "page"}
    assert span.parent is not None
    assert span.parent.span_id == server.context.span_id
    line = next(entry for entry in logs if entry["event"] == "mcp_tool_call")
    assert line["arguments"] == '{"text": "secret words"}'


async def test_a_call_lists_no_server(connect: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The SDK's server would list every server's tools per call with arguments (to check `Mcp-Param-*` headers)
    unless told the gateway has no schema to check them against."""
    listings = []
    listed = mcp_serving.list_tools

    async def counted_listing(*args: Any) -> Any:
        listings.append(args)
        return await listed(*args)

    monkeypatch.setattr(mcp_serving, "list_tools", counted_listing)
    async with connect("narrow") as client:
        await client.list_tools()
        for _ in range(3):
            assert await text_of(client, "wiki__page", {"text": "p"}) == ("page: p", False)
    assert len(listings) == 1
