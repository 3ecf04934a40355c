"""The MCP core (gateway/mcp): the servers file, who may reach which server and tool (`access.reach`, `tool_allowed`:
allow-lists by label and URL, private addresses in every spelling, whose headers go where), and the client against
real MCP servers the SDK's server side runs here (a tool that answers, one that fails, one that is slow, one too
large; a server that is down; a redirect; the connection pinned to the checked address)."""

from __future__ import annotations

import asyncio
import logging
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog.testing
from mcp.server.mcpserver import MCPServer
from mcp_types import ToolAnnotations
from starlette.applications import Starlette
from starlette.responses import RedirectResponse
from starlette.routing import Route

from gateway.errors import InvalidRequest, PermissionDenied
from gateway.mcp import client
from gateway.mcp.access import Target, reach, tool_allowed
from gateway.mcp.servers import McpServers, ServersFileError, canonical_url
from gateway.settings import McpSettings
from gateway.tenancy.tenants import KeyPolicy, KeysFileError, Tenants
from tests.fakes import app_with
from tests.mcp_servers import SeenHeaders, serving, tool_server
from tests.served import served

TOKEN = "gateway-s3cret-token"


def servers_of(tmp_path: Path, text: str, **settings: Any) -> McpServers:
    path = tmp_path / "servers.yaml"
    path.write_text(textwrap.dedent(text))
    return McpServers(McpSettings(servers_file=path, **settings))


def policy_of(tmp_path: Path, mcp: str) -> KeyPolicy:
    path = tmp_path / "keys.yaml"
    path.write_text('keys:\n  k:\n    key: "sk-k"\n' + textwrap.indent(textwrap.dedent(mcp), "    "))
    return Tenants(path).policy("k")


@pytest.fixture
def servers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> McpServers:
    monkeypatch.setenv("TEST_MCP_TOKEN", TOKEN)
    return servers_of(tmp_path, """\
        servers:
          docs:
            url: https://93.184.216.34/mcp
            headers: {Authorization: "Bearer ${TEST_MCP_TOKEN}"}
          inside:
            url: http://10.0.0.7:8080/mcp
            allow_private: true
            timeout_s: 5
          unsafe:
            url: http://127.0.0.1:9/mcp
        """)


# --- the servers file and the canonical URL


@pytest.mark.parametrize(("url", "canonical"), [
    ("HTTPS://Example.COM./mcp", "https://example.com/mcp"),
    ("https://example.com:443", "https://example.com/"),
    ("http://example.com:8080/mcp?x=1#frag", "http://example.com:8080/mcp?x=1"),
    ("http://[::1]:80/mcp", "http://[::1]/mcp"),
    ("http://bücher.example/mcp", "http://xn--bcher-kva.example/mcp"),
])
def test_a_url_has_one_canonical_form(url: str, canonical: str) -> None:
    assert canonical_url(url) == canonical


@pytest.mark.parametrize("url", ["ftp://example.com/", "file:///etc/passwd", "example.com/mcp", "http://",
                                 "http://user:pw@example.com/", "http://exa mple.com/", "http://example.com:99999/",
                                 "gopher://example.com/", "http://example.com/\r\nx"])
def test_a_url_that_is_not_plain_http_is_refused(url: str) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - each has its own message
        canonical_url(url)


def test_the_servers_file_reads_environment_references_and_hides_headers(servers: McpServers) -> None:
    docs = servers.by_label["docs"]
    assert docs.headers == {"Authorization": f"Bearer {TOKEN}"}
    assert TOKEN not in repr(docs)
    assert servers.by_url["http://10.0.0.7:8080/mcp"].timeout_s == 5


@pytest.mark.parametrize(("text", "error"), [
    ("servers: {a__b: {url: 'http://x.example/'}}", "servers.a__b"),
    ("servers: {a: {url: 'ftp://x.example/'}}", "servers.a.url"),
    ("servers: {a: {url: 'http://x.example/', token: 1}}", "servers.a.token"),
    ("servers: {a: {url: 'http://x.example/', headers: {A: '${NO_SUCH_VARIABLE_HERE}'}}}", "NO_SUCH_VARIABLE_HERE"),
    ("servers: {a: {url: 'http://x.example/'}, b: {url: 'HTTP://X.example:80/'}}", "same url"),
])
def test_a_bad_servers_file_is_refused(tmp_path: Path, text: str, error: str) -> None:
    with pytest.raises(ServersFileError, match=error):
        servers_of(tmp_path, text)


# --- the keys file's allow-list


def test_the_keys_file_takes_an_allow_list(tmp_path: Path) -> None:
    policy = policy_of(tmp_path, """\
        mcp:
          servers: [docs, "HTTPS://Tools.example/mcp"]
          tools: {docs: [search], "https://tools.example/mcp": [read]}
        """)
    assert policy.mcp is not None
    assert policy.mcp.servers == ("docs", "https://tools.example/mcp")
    assert dict(policy.mcp.tools) == {"docs": frozenset({"search"}), "https://tools.example/mcp": frozenset({"read"})}


@pytest.mark.parametrize(("mcp", "error"), [
    ("mcp: {servers: [docs], tools: {other: [x]}}", "not one of this key's servers"),
    ("mcp: {servers: ['ftp://x.example/']}", "http"),
    ("mcp: {servers: ['a b']}", "neither a label"),
    ("mcp: {tools: {}}", "servers"),
])
def test_a_bad_allow_list_is_refused(tmp_path: Path, mcp: str, error: str) -> None:
    with pytest.raises(KeysFileError, match=error):
        policy_of(tmp_path, mcp)


def test_the_allow_list_is_checked_against_the_servers_file(tmp_path: Path, servers: McpServers) -> None:
    labels = {label: server.url for label, server in servers.by_label.items()}
    for mcp, error in [("mcp: {servers: [nowhere]}", "no MCP server 'nowhere'"),
                       ("mcp: {servers: ['https://93.184.216.34/mcp']}", "by its label 'docs'")]:
        path = tmp_path / "keys.yaml"
        path.write_text(f'keys:\n  k:\n    key: "sk-k"\n    {mcp}\n')
        with pytest.raises(KeysFileError, match=error):
            Tenants(path).check([], [], labels)


# --- reach: who may reach which server, with whose headers


async def test_a_label_of_the_servers_file_reaches_its_url_with_the_gateways_headers(servers: McpServers) -> None:
    target = await reach(None, servers=servers, server_label="docs", server_url=None,
                         headers={"Authorization": "Bearer client", "X-Trace": "1"})
    assert (target.label, target.url, target.address) == ("docs", "https://93.184.216.34/mcp", "93.184.216.34")
    assert target.headers == {"X-Trace": "1", "Authorization": f"Bearer {TOKEN}"}
    assert TOKEN not in repr(target)
    assert TOKEN not in str(target)


async def test_the_url_of_a_servers_file_server_is_that_server(servers: McpServers) -> None:
    target = await reach(None, servers=servers, server_label="mine", server_url="HTTPS://93.184.216.34:443/mcp",
                         headers={})
    assert target.label == "docs"
    assert target.headers == {"Authorization": f"Bearer {TOKEN}"}


async def test_a_url_the_file_does_not_name_gets_the_clients_headers_only(servers: McpServers) -> None:
    target = await reach(None, servers=servers, server_label="docs", server_url="https://93.184.216.35/mcp",
                         headers={"Authorization": "Bearer client"})
    assert target.label == "https://93.184.216.35/mcp"  # not the file's 'docs': that label is the client's word only
    assert target.headers == {"Authorization": "Bearer client"}


async def test_a_private_server_of_the_servers_file_is_reached_only_when_it_allows_it(servers: McpServers) -> None:
    inside = await reach(None, servers=servers, server_label="inside", server_url=None, headers={})
    assert (inside.address, inside.timeout_s) == (None, 5)
    with pytest.raises(InvalidRequest) as refused:
        await reach(None, servers=servers, server_label="unsafe", server_url=None, headers={})
    assert refused.value.param == "server_label"


async def test_an_unknown_label_without_a_url_is_a_400(servers: McpServers) -> None:
    with pytest.raises(InvalidRequest) as refused:
        await reach(None, servers=servers, server_label="nowhere", server_url=None, headers={})
    assert refused.value.param == "server_url"


PRIVATE = [
    "http://127.0.0.1/mcp", "http://127.1/mcp", "http://2130706433/mcp", "http://0177.0.0.1/mcp",
    "http://0x7f.0.0.1/mcp", "http://0x7f000001/mcp", "http://localhost/mcp", "http://LOCALHOST./mcp",
    "http://[::1]/mcp", "http://[::ffff:127.0.0.1]/mcp", "http://[::ffff:7f00:1]/mcp", "http://[0:0:0:0:0:0:0:1]/mcp",
    "http://0.0.0.0/mcp", "http://0/mcp", "http://[::]/mcp", "http://10.1.2.3/mcp", "http://172.16.0.1/mcp",
    "http://192.168.1.1/mcp", "http://169.254.169.254/latest", "http://100.64.0.1/mcp", "http://[fe80::1]/mcp",
    "http://[fc00::1]/mcp", "http://[fd12:3456::1]/mcp", "http://224.0.0.1/mcp", "http://[ff02::1]/mcp",
    "http://240.0.0.1/mcp", "http://255.255.255.255/mcp", "http://[64:ff9b::a00:1]/mcp", "http://[2002:7f00:1::]/mcp",
    "http://198.18.0.1/mcp", "http://192.0.2.1/mcp", "http://[2001:db8::1]/mcp", "https://127.0.0.1:8443/mcp",
]


@pytest.mark.parametrize("url", PRIVATE)
async def test_a_private_address_in_any_spelling_is_refused(servers: McpServers, url: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        await reach(None, servers=servers, server_label="x", server_url=url, headers={})
    assert refused.value.param == "server_url"
    assert refused.value.status == 400


async def test_a_public_address_is_reached_and_pinned(servers: McpServers) -> None:
    target = await reach(None, servers=servers, server_label="x", server_url="http://[2606:4700:4700::1111]:8080/m",
                         headers={})
    assert (target.url, target.address) == ("http://[2606:4700:4700::1111]:8080/m", "2606:4700:4700::1111")


@pytest.mark.parametrize("url", ["ftp://93.184.216.34/", "http://user:pass@93.184.216.34/", "javascript:alert(1)",
                                 "http://no-such-host.invalid/mcp"])
async def test_a_bad_url_is_a_400_naming_server_url(servers: McpServers, url: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        await reach(None, servers=servers, server_label="x", server_url=url, headers={})
    assert refused.value.param == "server_url"


@pytest.mark.parametrize("headers", [{"Host": "internal"}, {"X-A": "1\r\nX-B: 2"}, {"Bad Name": "1"},
                                     {"mcp-session-id": "other"}, {"Content-Length": "0"}])
async def test_a_header_the_gateway_cannot_send_is_a_400(servers: McpServers, headers: dict[str, str]) -> None:
    with pytest.raises(InvalidRequest) as refused:
        await reach(None, servers=servers, server_label="x", server_url="https://93.184.216.34/", headers=headers)
    assert refused.value.param == "headers"


async def test_the_allow_list_admits_only_what_it_names(tmp_path: Path, servers: McpServers) -> None:
    policy = policy_of(tmp_path, """\
        mcp:
          servers: [docs, "https://93.184.216.40/mcp"]
          tools: {docs: [search]}
        """)
    assert (await reach(policy, servers=servers, server_label="docs", server_url=None, headers={})).label == "docs"
    assert (await reach(policy, servers=servers, server_label="any", server_url="HTTPS://93.184.216.40/mcp",
                        headers={})).label == "https://93.184.216.40/mcp"
    refusals = [("inside", None), ("x", "https://93.184.216.41/mcp"), ("docs", "https://93.184.216.41/mcp"),
                ("x", "http://10.0.0.7:8080/mcp"), ("x", "https://93.184.216.40/other")]
    for label, url in refusals:
        with pytest.raises(PermissionDenied) as refused:
            await reach(policy, servers=servers, server_label=label, server_url=url, headers={})
        assert refused.value.status == 403, (label, url)
    assert tool_allowed(policy, "docs", "search")
    for tool in ("Search", "search ", "s\u0435arch", "search\u200b", "other", "docs__search"):  # Cyrillic ie
        assert not tool_allowed(policy, "docs", tool)
    assert tool_allowed(policy, "https://93.184.216.40/mcp", "anything")
    assert not tool_allowed(policy, "inside", "anything")
    assert tool_allowed(None, "anything", "anything")
    assert tool_allowed(KeyPolicy("k"), "inside", "x")


async def test_an_empty_allow_list_reaches_nothing(tmp_path: Path, servers: McpServers) -> None:
    policy = policy_of(tmp_path, "mcp: {servers: []}")
    with pytest.raises(PermissionDenied):
        await reach(policy, servers=servers, server_label="docs", server_url=None, headers={})
    with pytest.raises(PermissionDenied):
        await reach(policy, servers=servers, server_label="x", server_url="https://93.184.216.34/", headers={})


# --- the client against real MCP servers


@pytest.fixture(scope="module")
def tools() -> Iterator[tuple[str, SeenHeaders]]:
    with serving(tool_server()) as found:
        yield found


def target(url: str, **fields: Any) -> Target:
    return Target("tools", url, {"Authorization": f"Bearer {TOKEN}"}, **{"address": "127.0.0.1", **fields})


async def test_the_client_lists_a_servers_tools(tools: tuple[str, SeenHeaders]) -> None:
    listed = await client.list_tools(target(tools[0]), timeout_s=30)
    assert {tool.name for tool in listed} == {"echo", "fail", "slow", "large"}
    echo = next(tool for tool in listed if tool.name == "echo")
    assert echo.description == "Answers with its text."
    assert echo.annotations is None  # no hints given (a server's readOnlyHint is kept: `read_only` reads it)
    assert echo.input_schema["required"] == ["text"]


async def test_a_listing_keeps_a_tools_hints() -> None:
    """A tool's annotations (readOnlyHint: what the Responses tool's `allowed_tools: {read_only: true}` reads)."""
    reader = MCPServer("reader")

    @reader.tool(annotations=ToolAnnotations(readOnlyHint=True))
    def look(text: str) -> str:
        """Looks."""
        return f"saw {text}"

    with serving(reader) as (url, _):
        listed = await client.list_tools(target(url), timeout_s=30)
    assert [(tool.name, tool.annotations) for tool in listed] == [("look", {"readOnlyHint": True})]


async def test_a_gigantic_listing_is_a_failing_server(tools: tuple[str, SeenHeaders]) -> None:
    """Every tool listed is described to the model in each prompt: a listing is bounded in count and in size."""
    with pytest.raises(client.McpUnavailable, match="too large"):
        await client.list_tools(target(tools[0], max_output_bytes=200), timeout_s=30)
    many = tuple(f"t{i}" for i in range(client.MAX_TOOLS))
    with serving(tool_server(extra=many)) as (url, _), \
            pytest.raises(client.McpUnavailable, match=f"more than {client.MAX_TOOLS} tools"):
        await client.list_tools(target(url), timeout_s=30)


async def test_a_server_echoing_a_credential_shows_none(tools: tuple[str, SeenHeaders]) -> None:
    """A header value sent to a server (the gateway's credential for it) is not in what the server answers."""
    echoed = await client.call_tool(target(tools[0]), "echo", {"text": f"seen: Bearer {TOKEN}"}, timeout_s=30)
    assert echoed.output == "seen: [credential]"
    bare = await client.call_tool(target(tools[0]), "echo", {"text": TOKEN}, timeout_s=30)
    assert bare.output == "[credential]"


async def test_a_tool_that_answers_fails_or_is_unknown(tools: tuple[str, SeenHeaders]) -> None:
    assert await client.call_tool(target(tools[0]), "echo", {"text": "hi"}, timeout_s=30) == client.ToolOutcome("hi", None)
    failed = await client.call_tool(target(tools[0]), "fail", {}, timeout_s=30)
    assert failed.output is None
    assert failed.error
    unknown = await client.call_tool(target(tools[0]), "no_such_tool", {}, timeout_s=30)
    assert unknown.output is None
    assert unknown.error


async def test_the_gateways_headers_reach_the_server_and_no_log_line(
        tools: tuple[str, SeenHeaders], caplog: pytest.LogCaptureFixture) -> None:
    before = len(tools[1].headers)
    caplog.set_level(logging.DEBUG)
    with structlog.testing.capture_logs() as logs:
        await client.call_tool(target(tools[0]), "echo", {"text": "hi"}, timeout_s=30)
        await client.call_tool(target("http://127.0.0.1:1/mcp"), "echo", {"text": "hi"}, timeout_s=30)
        await client.call_tool(target(tools[0]), "fail", {}, timeout_s=30)
    assert all(seen["authorization"] == f"Bearer {TOKEN}" for seen in tools[1].headers[before:])
    assert TOKEN not in repr(logs)
    assert TOKEN not in caplog.text  # nor the SDK's and httpx2's own lines, at any level


async def test_a_clients_url_is_logged_by_its_origin_only() -> None:
    """A client's server URL may hold a token in its path or query (some servers' URLs are their credential)."""
    url = "http://127.0.0.1:1/mcp/s3cret-path?token=s3cret-query"
    with structlog.testing.capture_logs() as logs:
        outcome = await client.call_tool(Target(url, url, {}, address="127.0.0.1"), "echo", {}, timeout_s=30)
    assert outcome.error is not None
    assert "s3cret" not in repr(logs)
    assert any(entry.get("server") == "http://127.0.0.1:1" for entry in logs)


async def test_two_keys_on_one_server_never_share_a_credential(tools: tuple[str, SeenHeaders]) -> None:
    """Calls of two keys to one server at once: each request carries its own key's credential (no pooled session or
    client keyed by the URL)."""
    before = len(tools[1].headers)
    first = Target("tools", tools[0], {"Authorization": "Bearer first"}, address="127.0.0.1")
    second = Target("tools", tools[0], {"Authorization": "Bearer second"}, address="127.0.0.1")
    calls = [client.call_tool(t, "echo", {"text": t.headers["Authorization"]}, timeout_s=30) for t in (first, second) * 3]
    outcomes = await asyncio.gather(*calls)
    assert [o.output for o in outcomes] == ["[credential]"] * 6  # each echoed its own credential, scrubbed
    seen = tools[1].headers[before:]
    assert {headers["authorization"] for headers in seen} == {"Bearer first", "Bearer second"}
    calls_seen = [h["authorization"] for h in seen if h.get("content-length", "0") != "0"]
    assert sorted(calls_seen).count("Bearer first") == sorted(calls_seen).count("Bearer second")


async def test_a_slow_tool_is_an_error_at_the_timeout(tools: tuple[str, SeenHeaders]) -> None:
    outcome = await client.call_tool(target(tools[0]), "slow", {}, timeout_s=0.5)
    assert outcome.output is None
    assert "in time" in (outcome.error or "")
    outcome = await client.call_tool(target(tools[0], timeout_s=0.5), "slow", {}, timeout_s=30)  # the server's own
    assert "in time" in (outcome.error or "")


async def test_a_large_output_is_cut_or_refused(tools: tuple[str, SeenHeaders]) -> None:
    cut = await client.call_tool(target(tools[0], max_output_bytes=2 * 1024 * 1024), "large", {}, timeout_s=30)
    assert cut.output is not None
    assert cut.output.endswith(f"[output cut at {2 * 1024 * 1024} bytes]")
    assert len(cut.output) < 2 * 1024 * 1024 + 100
    refused = await client.call_tool(target(tools[0], max_output_bytes=1024), "large", {}, timeout_s=30)
    assert refused.output is None
    assert "too large" in (refused.error or "")


async def test_a_server_that_is_down_is_unavailable_or_an_error() -> None:
    down = target("http://127.0.0.1:1/mcp")
    with pytest.raises(client.McpUnavailable, match="'tools'"):
        await client.list_tools(down, timeout_s=30)
    outcome = await client.call_tool(down, "echo", {"text": "hi"}, timeout_s=30)
    assert outcome.output is None
    assert "could not be reached" in (outcome.error or "")


async def test_the_connection_goes_to_the_checked_address(tools: tuple[str, SeenHeaders]) -> None:
    """A name that resolves nowhere (or, rebinding, somewhere else) is still connected to the address reach checked;
    the name stays the Host header."""
    url = tools[0].replace("127.0.0.1", "mcp-server.invalid")
    before = len(tools[1].headers)
    outcome = await client.call_tool(target(url), "echo", {"text": "pinned"}, timeout_s=30)
    assert outcome == client.ToolOutcome("pinned", None)
    assert tools[1].headers[before]["host"].startswith("mcp-server.invalid:")


async def test_a_redirect_is_not_followed(tools: tuple[str, SeenHeaders]) -> None:
    async def moved(request: Any) -> RedirectResponse:
        return RedirectResponse(tools[0], status_code=307)

    with served(Starlette(routes=[Route("/mcp", moved, methods=["GET", "POST", "DELETE"])])) as base:
        before = len(tools[1].headers)
        with pytest.raises(client.McpUnavailable):
            await client.list_tools(target(base + "/mcp"), timeout_s=30)
        outcome = await client.call_tool(target(base + "/mcp"), "echo", {"text": "hi"}, timeout_s=30)
        assert outcome.output is None
        assert len(tools[1].headers) == before  # the server redirected to never heard of it


def test_the_app_refuses_a_key_naming_an_mcp_server_the_servers_file_lacks(tmp_path: Path) -> None:
    servers = tmp_path / "servers.yaml"
    servers.write_text("servers: {docs: {url: 'https://93.184.216.34/mcp'}}\n")
    keys = tmp_path / "keys.yaml"
    keys.write_text('keys:\n  k:\n    key: "sk-k"\n    mcp: {servers: [docs, wiki]}\n')
    with pytest.raises(KeysFileError, match="no MCP server 'wiki'"):
        app_with(keys_file=keys, mcp={"servers_file": servers})
    keys.write_text('keys:\n  k:\n    key: "sk-k"\n    mcp: {servers: [docs]}\n')
    app_with(keys_file=keys, mcp={"servers_file": servers})
    servers.write_text("servers: {docs: {url: 'https://93.184.216.34/mcp', headers: {A: '${NO_SUCH_VARIABLE_X}'}}}\n")
    with pytest.raises(ServersFileError, match="NO_SUCH_VARIABLE_X"):
        app_with(keys_file=keys, mcp={"servers_file": servers})
